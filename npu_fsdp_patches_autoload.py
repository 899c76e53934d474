"""Entry point of torch's ``torch.backends`` group: torch >= 2.5 calls it at the end of ``import torch``.

A top-level module (see pyproject), because an entry point
inside ``npu_fsdp_patches`` would make ``ep.load()`` run the package ``__init__`` (activation) before
this guard exists, and torch turns any exception there into a failed ``import torch``
(docs/design.md#72-torch-backend-autoload). So activation errors, strict mode included, are logged here and
never raised; activation is re-entrant and runs once per process. torch's own kill switch is
TORCH_DEVICE_BACKEND_AUTOLOAD=0; ours is NPU_FSDP_PATCHES=0.
"""
import logging


def autoload() -> None:
    try:
        import npu_fsdp_patches  # noqa: F401 - importing activates the plugin
    except Exception as exc:  # noqa: BLE001 - must never break `import torch`
        logging.getLogger("npu_fsdp_patches").error(
            "npu_fsdp_patches could not activate during torch autoload: %s", exc)
