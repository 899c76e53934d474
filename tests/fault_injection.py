"""Fault injection: make the N-th internal write of a call fail, for every N the call reaches, and
check that every object the user handed over is identity- and bit-equal to what it was before.

A write is one call of a write primitive the optimizer code uses:

* tensor data: ``Tensor.copy_``, ``Tensor.__setitem__``, ``zero_``, ``fill_``, ``set_`` and
  ``torch._foreach_copy_``;
* attributes of tensors (``p.main_param = ...``, ``p.grad = ...``) and of optimizers;
* ``torch.optim.Optimizer.load_state_dict``;
* the plugin's writes to a patch target (``npu_fsdp_patches.runtime.registry._put`` and ``_remove``:
  apply, revert, a patch applied as its module is imported, late detection);
* item writes on the optimizers' ``state``, their param-group dicts, the groups' ``params`` lists
  and FusedAdam's ``_scales`` (:func:`instrument` swaps these containers for counting subclasses
  *before* the snapshot, so the call sees, and the check compares, the very objects).

``mode="after"`` performs the N-th write and then raises (the write happened, the next step
failed: rollback must undo it); ``mode="before"`` raises instead of performing it. A rollback
restores through the base types' own methods (``dict.clear``, ``TensorBase.copy_``), which these
counters do not see: only the call's forward writes are failed. A call that
swallows an injected fault fails the check too: the fault must reach the caller.

Adding an entry point is one :class:`Entry` line: a name, a ``setup()`` returning the objects the
user hands over (a dict: ``model``, ``optimizer``, ``state_dict``, ``checkpoint`` (a directory), any
other object), a ``call(handed)``, and the exception type the call raises by itself (None when it
succeeds).
"""
from __future__ import annotations

import collections
import contextlib
import functools
import hashlib
import os
import sys
import types
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
from torch import nn

LIMIT = 2000   # writes per call; a call that reaches it is reported, not looped on forever


MARK = "<<injected fault>>"   # found in messages that wrap the fault as text (Module.load_state_dict)


class InjectedFault(RuntimeError):
    """The failure the harness injects at the N-th write."""


class _Counter:
    active: Optional["_Counter"] = None

    def __init__(self, fail_at: int, mode: str) -> None:
        self.fail_at, self.mode, self.calls, self.fired = fail_at, mode, 0, None

    def write(self, what: str, perform: Callable[[], Any]) -> Any:
        """Count one write; fail it if it is the N-th (once: rollback writes afterwards pass)."""
        self.calls += 1
        if self.fired is None and self.calls == self.fail_at:
            self.fired = what
            if self.mode == "before":
                raise InjectedFault(f"{MARK} before write {self.calls}: {what}")
            perform()
            raise InjectedFault(f"{MARK} after write {self.calls}: {what}")
        return perform()


def _count(what: str, perform: Callable[[], Any]) -> Any:
    counter = _Counter.active
    return perform() if counter is None else counter.write(what, perform)


# ---- counting containers ---------------------------------------------------------------------
def _counting(base: type, methods: tuple[str, ...]) -> type:
    def make(name: str) -> Callable:
        real = getattr(base, name)

        def method(self, *args, **kwargs):
            return _count(f"{base.__name__}.{name}", lambda: real(self, *args, **kwargs))
        return method
    return type(f"Counting{base.__name__}", (base,), {name: make(name) for name in methods})


_DICT_WRITES = ("__setitem__", "__delitem__", "pop", "popitem", "setdefault", "update", "clear")
CountingDict = _counting(dict, _DICT_WRITES)
CountingDefaultDict = _counting(collections.defaultdict, _DICT_WRITES)
CountingList = _counting(list, ("__setitem__", "__delitem__", "append", "extend", "insert", "pop",
                                "remove", "clear", "__iadd__", "sort", "reverse"))


def _optimizers(handed: Any) -> list[torch.optim.Optimizer]:
    """Every torch optimizer reachable from the handed objects (wrappers, chains, lists, dicts)."""
    found, seen = [], set()

    def visit(obj: Any) -> None:
        if id(obj) in seen:
            return
        seen.add(id(obj))
        if isinstance(obj, torch.optim.Optimizer):
            found.append(obj)
            for child in getattr(obj, "__dict__", {}).get("leaf_optimizers", []):
                visit(child)
        if isinstance(obj, dict):
            for value in obj.values():
                visit(value)
        elif isinstance(obj, (list, tuple)):
            for value in obj:
                visit(value)
        for attr in ("chained_optimizers", "optimizers_dict", "optimizer"):
            child = getattr(obj, "__dict__", {}).get(attr)
            if child is not None:
                visit(child)
    visit(handed)
    return found


def instrument(handed: dict) -> None:
    """Swap each optimizer's ``state``, param groups, ``params`` lists and ``_scales`` for counting
    containers with the same contents (done before the snapshot, so these are the compared objects)."""
    for opt in _optimizers(handed):
        if "state" in vars(opt) and isinstance(opt.state, collections.defaultdict):
            state = CountingDefaultDict(opt.state.default_factory, opt.state)
            object.__setattr__(opt, "state", state)
        if "param_groups" in vars(opt):
            groups = CountingList(CountingDict({**g, "params": CountingList(g["params"])})
                                  for g in opt.param_groups)
            object.__setattr__(opt, "param_groups", groups)
        if isinstance(vars(opt).get("_scales"), dict):
            object.__setattr__(opt, "_scales", CountingDict(opt._scales))


# ---- write primitives ------------------------------------------------------------------------
_TENSOR_WRITES = ("copy_", "__setitem__", "zero_", "fill_", "set_")


@contextlib.contextmanager
def faults(fail_at: int, mode: str = "after"):
    """Count every write during the block; the ``fail_at``-th raises :class:`InjectedFault`."""
    counter = _Counter(fail_at, mode)
    saved = {name: vars(torch.Tensor).get(name) for name in _TENSOR_WRITES + ("__setattr__",)}
    real_foreach_copy = torch._foreach_copy_
    real_load = vars(torch.optim.Optimizer)["load_state_dict"]
    had_opt_setattr = "__setattr__" in vars(torch.optim.Optimizer)

    def tensor_method(name: str) -> Callable:
        real = getattr(torch._C.TensorBase, name)

        @functools.wraps(real)
        def method(self, *args, **kwargs):
            return _count(f"Tensor.{name}", lambda: real(self, *args, **kwargs))
        return method

    def tensor_setattr(self, name, value):
        _count(f"Tensor.{name} =", lambda: object.__setattr__(self, name, value))

    def optimizer_setattr(self, name, value):
        _count(f"{type(self).__name__}.{name} =", lambda: object.__setattr__(self, name, value))

    def load_state_dict(self, state_dict):
        return _count(f"{type(self).__name__}.load_state_dict (torch's)", lambda: real_load(self, state_dict))

    def foreach_copy(*args, **kwargs):
        return _count("torch._foreach_copy_", lambda: real_foreach_copy(*args, **kwargs))

    registry = sys.modules.get("npu_fsdp_patches.runtime.registry")
    real_put, real_remove = (registry._put, registry._remove) if registry is not None else (None, None)
    if registry is not None:   # the plugin is active in this process: its target writes count too
        registry._put = lambda owner, attr, value: _count(
            f"bind {getattr(owner, '__name__', owner)}.{attr}", lambda: real_put(owner, attr, value))
        registry._remove = lambda owner, attr: _count(
            f"drop {getattr(owner, '__name__', owner)}.{attr}", lambda: real_remove(owner, attr))
    for name in _TENSOR_WRITES:
        setattr(torch.Tensor, name, tensor_method(name))
    torch.Tensor.__setattr__ = tensor_setattr
    torch.optim.Optimizer.__setattr__ = optimizer_setattr
    torch.optim.Optimizer.load_state_dict = load_state_dict
    torch._foreach_copy_ = foreach_copy
    _Counter.active = counter
    try:
        yield counter
    finally:
        _Counter.active = None
        for name, value in saved.items():
            if value is None:
                delattr(torch.Tensor, name)
            else:
                setattr(torch.Tensor, name, value)
        if not had_opt_setattr:
            del torch.optim.Optimizer.__setattr__
        torch.optim.Optimizer.load_state_dict = real_load
        torch._foreach_copy_ = real_foreach_copy
        if registry is not None:
            registry._put, registry._remove = real_put, real_remove


# ---- snapshots -------------------------------------------------------------------------------
def _bytes(t: torch.Tensor) -> bytes:
    local = t.to_local() if callable(getattr(t, "to_local", None)) else t
    flat = local.detach().reshape(-1).contiguous()
    return flat.view(torch.uint8).cpu().numpy().tobytes() if flat.numel() else b""


def snapshot(handed: Any) -> dict[str, Any]:
    """A flat ``{path: what is there}`` picture of ``handed``: identity and type of every object,
    dtype, shape, stride and bytes of every tensor, the items of containers, the attributes of
    tensors and optimizers, modules' params and buffers."""
    memo: dict[int, str] = {}
    flat: dict[str, Any] = {}

    def snap(obj: Any, path: str) -> None:
        if obj is None or isinstance(obj, (bool, int, float, complex, str, bytes, torch.dtype, torch.device)):
            flat[path] = (type(obj).__name__, obj)
            return
        if id(obj) in memo:
            flat[path] = ("same object as", memo[id(obj)])
            return
        memo[id(obj)] = path
        flat[path] = (type(obj).__qualname__, id(obj))
        if isinstance(obj, torch.Tensor):
            flat[path + ":data"] = (obj.dtype, tuple(obj.shape), obj.requires_grad,
                                    tuple(obj.stride()) if obj.layout == torch.strided else None, _bytes(obj))
            if obj.is_leaf:   # what autograd does with its grads: the dtype it keeps, the hooks it runs
                flat[path + ":autograd"] = (getattr(obj, "grad_dtype", None),
                                            len(getattr(obj, "_post_accumulate_grad_hooks", None) or ()))
            for k, v in sorted(vars(obj).items()):
                snap(v, f"{path}.{k}")
            snap(obj.grad if obj.is_leaf else None, f"{path}.grad")
        elif isinstance(obj, nn.Module):
            for n, p in obj.named_parameters(remove_duplicate=False):
                snap(p, f"{path}.{n}")
            for n, b in obj.named_buffers(remove_duplicate=False):
                snap(b, f"{path}.{n}")
        elif isinstance(obj, dict):
            flat[path + ":keys"] = [memo.get(id(k), repr(k)) if isinstance(k, torch.Tensor) else repr(k)
                                    for k in obj]
            for i, (k, v) in enumerate(obj.items()):
                key = f"<key {i}>"
                if isinstance(k, torch.Tensor):
                    snap(k, f"{path}{key}")
                else:
                    key = repr(k)
                snap(v, f"{path}[{key}]")
        elif isinstance(obj, (list, tuple)):
            flat[path + ":len"] = len(obj)
            for i, v in enumerate(obj):
                snap(v, f"{path}[{i}]")
        elif isinstance(obj, (set, frozenset)):
            flat[path + ":items"] = sorted(map(repr, obj))
        elif isinstance(obj, (types.ModuleType, type)):   # a patch's target module or class: what is bound
            for k, v in sorted(vars(obj).items()):
                flat[f"{path}.{k}"] = (type(v).__qualname__, id(v))
        elif isinstance(obj, torch.optim.Optimizer) or _is_chain(obj):
            for k, v in sorted(vars(obj).items()):
                snap(v, f"{path}.{k}")
    snap(handed, "handed")
    return flat


def _is_chain(obj: Any) -> bool:
    d = getattr(obj, "__dict__", {})
    return "chained_optimizers" in d or "optimizers_dict" in d


def _files(directory: str) -> dict[str, str]:
    out = {}
    for root, _, names in os.walk(directory):
        for name in names:
            path = os.path.join(root, name)
            with open(path, "rb") as f:
                out[os.path.relpath(path, directory)] = hashlib.sha256(f.read()).hexdigest()
    return out


def picture(handed: dict) -> tuple:
    """:func:`snapshot` plus the bytes of the checkpoint directory, if one was handed over."""
    checkpoint = handed.get("checkpoint")
    return snapshot(handed), (_files(checkpoint) if checkpoint else None)


def differences(before: tuple, after: tuple, limit: int = 6) -> list[str]:
    """Where two pictures differ (the first few places)."""
    out = []
    (a, files_a), (b, files_b) = before, after
    for path in list(dict.fromkeys([*a, *b])):
        if a.get(path, "<absent>") != b.get(path, "<absent>"):
            out.append(f"{path}: {str(a.get(path, '<absent>'))[:100]} -> {str(b.get(path, '<absent>'))[:100]}")
    if files_a != files_b:
        out.append(f"checkpoint files changed: {files_a} -> {files_b}")
    return out[:limit]


# ---- the driver ------------------------------------------------------------------------------
def _carries_fault(error: Optional[BaseException]) -> bool:
    """The injected fault reached the caller: as itself, as a cause, wrapped by DCP (a rank's
    failure as a ``CheckpointException``) or as text (``Module.load_state_dict`` reports a failed
    copy in its error message)."""
    while error is not None:
        if isinstance(error, InjectedFault) or MARK in repr(error) or MARK in str(error):
            return True
        error = error.__cause__ or error.__context__
    return False


@dataclass
class Entry:
    """One entry point: ``setup()`` -> handed objects, ``call(handed)``, the exception it raises
    by itself (None: it succeeds)."""
    name: str
    setup: Callable[[], dict]
    call: Callable[[dict], Any]
    raises: Optional[type] = None


@dataclass
class Result:
    writes: int                   # writes the call makes when nothing fails
    error: Optional[BaseException]   # what it raised by itself


def run_once(entry: Entry, n: int, mode: str = "after") -> tuple[Optional[str], Optional[BaseException]]:
    """One run of ``entry.call`` with write ``n`` failed: asserts the fault reached the caller and the
    handed objects are unchanged after any exception; returns (the write that failed or None, the
    exception raised)."""
    handed = entry.setup()
    instrument(handed)
    before = picture(handed)
    error = None
    with faults(n, mode) as counter:
        try:
            entry.call(handed)
        except BaseException as exc:   # noqa: BLE001 - every failure must leave things as they were
            error = exc
    if counter.fired is not None and not _carries_fault(error):
        raise AssertionError(f"{entry.name} [{mode}]: write {n} ({counter.fired}) failed, but the "
                             f"call {'succeeded' if error is None else f'raised {error!r}'}")
    if error is not None:
        diffs = differences(before, picture(handed))
        if diffs:
            what = counter.fired or f"no injection: {error!r}"
            raise AssertionError(f"{entry.name} [{mode}]: after write {n} failed ({what}) the handed "
                                 f"objects changed:\n  " + "\n  ".join(diffs))
    return counter.fired, error


def check_entry(entry: Entry, mode: str = "after",
                run: Optional[Callable[[int], tuple]] = None) -> Result:
    """Fail write 1, 2, ... of ``entry.call`` until a run no longer reaches N; after every failed
    run, assert the handed objects are unchanged. Returns the number of writes of a clean run.
    ``run(n)`` replaces :func:`run_once` where each run needs a fresh process (it then reports the
    exception as text)."""
    run = run or (lambda n: run_once(entry, n, mode))
    n = 1
    while n <= LIMIT:
        fired, error = run(n)
        if fired is None:
            if entry.raises is None and error is not None:
                raise AssertionError(f"{entry.name}: expected success, got {error!r}")
            if entry.raises is not None and not isinstance(error, entry.raises):
                raise AssertionError(f"{entry.name}: expected {entry.raises.__name__}, got {error!r}")
            return Result(n - 1, error)
        n += 1
    raise AssertionError(f"{entry.name}: more than {LIMIT} writes")
