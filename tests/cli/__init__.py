"""Tests of the commands (npu_fsdp_patches/cli/): doctor, explain, list, report and the CLI's output handling."""
