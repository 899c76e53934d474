"""Tests of the layer that decides (npu_fsdp_patches/plan/): settings, the matrix and its cache, detection, decisions, patch declarations."""
