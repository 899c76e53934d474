"""Tests of the layer that applies (npu_fsdp_patches/runtime/): activation, lifecycle, install, registry, hooks, records, reload."""
