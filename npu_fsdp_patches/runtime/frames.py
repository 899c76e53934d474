"""Keep the frames of our replacements out of torch.compile's frame-level tracing.

Why: when torch.compile (dynamo) hits a graph break inside a call it was inlining, it falls back to
eager for that frame and traces each frame below it on its own. A replacement adds one Python frame
between the caller and the original, so a compiled step that breaks inside the original (e.g. a fused
Adam step on CPU, "Skip calling torch.compiler.disable()d function") broke once more with the patch
applied than without it. Dynamo's ``skip_code`` (torch/_dynamo/eval_frame.py) skips tracing a code
object as a frame of its own, while calls inside it are still traced and an outer frame still inlines
it, so the graph breaks and the results stay those of the unpatched step.

Only code defined in the patch's own module is skipped (never torch's, e.g. the step-profiling wrapper
that ``te_fused_adam_dtensor`` installs around its ``step``). torch._dynamo is never imported here: the
code objects are handed to it when it is imported (a post-import hook), or at once if it already is.
"""
from __future__ import annotations

import sys
import threading
from types import FunctionType, ModuleType
from typing import Any

_EVAL_FRAME = "torch._dynamo.eval_frame"
_lock = threading.Lock()
_codes: list = []          # every code object to skip, in the order found
_hooked = False            # the post-import hook on torch._dynamo.eval_frame is registered


def skip_frames(replacement: Any, home: dict | None) -> None:
    """Skip the frames of ``replacement`` (and of functions it ``__wraps__``) whose globals are ``home``,
    the namespace of the module that built it."""
    if home is None:
        return
    codes = []
    fn = getattr(replacement, "__func__", replacement)   # classmethod / staticmethod
    for _ in range(8):
        if isinstance(fn, FunctionType) and fn.__globals__ is home and fn.__code__ not in codes:
            codes.append(fn.__code__)
        fn = fn.__dict__.get("_npu_fsdp_inner") if isinstance(fn, FunctionType) else None
        if fn is None:
            break
    if not codes:
        return
    global _hooked
    with _lock:
        new = [c for c in codes if c not in _codes]
        _codes.extend(new)
        register, _hooked = not _hooked, True
    eval_frame = sys.modules.get(_EVAL_FRAME)
    if eval_frame is not None:
        _skip(eval_frame, new)
    if register:
        from .hooks import when_imported   # pylint: disable=C0415
        when_imported(_EVAL_FRAME, lambda module: _skip(module, list(_codes)))


def _skip(eval_frame: ModuleType, codes: list) -> None:
    skip_code = getattr(eval_frame, "skip_code", None)
    if skip_code is None:   # an older or newer torch without it: the extra frame only adds a graph break
        return
    for code in codes:
        skip_code(code)
