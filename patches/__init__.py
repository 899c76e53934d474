"""Built-in framework patches, installed as ``npu_fsdp_patches.patches``.

Each module defines ``Patch`` subclasses (thin adapters onto ``npu_fsdp_patches.optim``); the plugin
finds them by reading the modules (npu_fsdp_patches/plan/loader.py), so no list here names them.
"""
