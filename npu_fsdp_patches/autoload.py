"""Entry point of torch's ``torch.backends`` group: torch >= 2.5 calls it at the end of ``import torch``.

torch turns any exception raised here into a failed ``import torch`` (reference/plugin_anchors.md §4),
so this never raises, strict mode included, and it is re-entrant: activation runs once per process.
torch's own kill switch is TORCH_DEVICE_BACKEND_AUTOLOAD=0; ours is NPU_FSDP_PATCHES=0.
"""
import logging


def autoload() -> None:
    try:
        import npu_fsdp_patches  # noqa: F401 - importing activates the plugin
    except Exception as exc:  # noqa: BLE001 - must never break `import torch`
        logging.getLogger("npu_fsdp_patches").error(
            "npu_fsdp_patches could not activate during torch autoload: %s", exc)
