"""Built-in framework patches, installed as ``npu_fsdp_patches.patches``.

Each module is a thin adapter onto ``npu_fsdp_patches.optim``. ``BUILTIN_PATCHES`` mirrors the
``npu_fsdp_patches.patches`` entry points in pyproject.toml (a test keeps the two equal) so a
plain checkout without installed metadata still finds them.
"""

BUILTIN_PATCHES = {
    "te_fused_adam_dtensor": "npu_fsdp_patches.patches.te_fused_adam:TeFusedAdamDTensor",
    "te_initialize_state_compat": "npu_fsdp_patches.patches.te_initialize_state:TeInitializeStateCompat",
    "te_multi_tensor_apply_empty_tail":
        "npu_fsdp_patches.patches.te_multi_tensor_apply:TeMultiTensorApplyEmptyTail",
    "te_fused_adam_empty_scale": "npu_fsdp_patches.patches.te_apply_scale:TeFusedAdamEmptyScale",
    "hp_fp32_main_params": "npu_fsdp_patches.patches.hp_fp32_main_params:HpFp32MainParams",
    "hp_skip_dispatch_adamw": "npu_fsdp_patches.patches.hp_skip_dispatch:HpSkipDispatchAdamW",
}
