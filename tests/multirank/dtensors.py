"""DTensor helpers shared by the rank-side cases, working on every verified torch."""
from npu_fsdp_patches.selftest.checks.context import distribute_same

__all__ = ["distribute_same"]
