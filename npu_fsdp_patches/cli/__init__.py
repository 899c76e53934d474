"""The commands (docs/design.md#2-layout): ``npu-fsdp-patches`` and ``python -m npu_fsdp_patches``.

``commands`` parses the command line and dispatches; ``doctor`` collects what it reports, ``render``
turns it into text, ``report`` writes the bug report (with ``report_env``), and ``output_guard``
keeps every command's output errors to one line and an exit code. The CLI reads the runtime through
its snapshot and never changes a patch's state except through the public API.
"""
from .commands import main

__all__ = ["main"]
