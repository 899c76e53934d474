"""Rewrite a checkpoint in the other layout offline: ``npu-fsdp-patches checkpoint PATH --convert-to
upstream|torch OUT`` (docs/main_params.md#7-the-checkpoint-command, :mod:`.upstream_layout`).

A DCP folder converts without a process group and without loading it: the two layouts hold the same
tensors under other names, so the rank files are copied byte for byte (a block at a time: a checkpoint
larger than memory converts), and a new ``.metadata`` maps the new names to the same bytes. Only what
has no bytes yet is written, into one more rank file: a flattened param group setting's nested entry
(``params`` lists), and the fp32 main param of a bf16/fp16 param that has no optimizer state in torch's
layout (its main param is its model param cast to fp32, read and cast one chunk at a time). A
``torch.save`` file is memory-mapped, re-keyed and saved again.

The output appears whole or not at all: everything is written into a new temporary folder beside OUT,
``.metadata`` last, files created exclusively and never through a link, then the folder is renamed to
OUT, which must not exist (docs/security.md#files-it-writes). The input is only read.
"""
from __future__ import annotations

import dataclasses
import io
import os
import pickle
import shutil
import tempfile
import uuid
from typing import Any, Callable

import torch

from ._leaf_views import MAIN_PARAM
from ._main_params_state import MAIN_PARAMS_KEY, MP_KEY
from .checkpoint_files import CheckpointError, DcpFolder, TorchSaveFile, open_checkpoint
from .checkpoint_report import index_names
from .upstream_layout import SECTION, SavedLayout

__all__ = ["convert_checkpoint"]

Progress = Callable[[int, int, str], None]
_BLOCK = 1 << 20
_CREATE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0)


def convert_checkpoint(src: str, out: str, to: str, report: dict, *, param_groups: str = "auto",
                       progress: Progress | None = None) -> dict:
    """Write ``src`` (inspected as ``report``) in layout ``to`` (``"upstream"`` or ``"torch"``) at the
    new path ``out``. Returns what was written; raises :class:`CheckpointError` before writing
    anything when the checkpoint cannot be converted."""
    if to not in ("upstream", "torch"):
        raise CheckpointError(f"--convert-to must be upstream or torch, not {to!r}")
    if report["layout"] == "fused_adam":
        raise CheckpointError("a FusedAdam checkpoint keeps its fp32 masters as FusedAdam state: there is "
                              "no main-params layout to convert it to")
    if report["consumers"]["ours"]["outcome"] == "refused":
        raise CheckpointError(f"not converted: {report['consumers']['ours']['why']}")
    out = os.path.abspath(out)
    _check_out(os.path.abspath(src), out)
    progress = progress or (lambda done, total, what: None)
    ckpt = open_checkpoint(src)
    if isinstance(ckpt, DcpFolder):
        plan = _DcpPlan(ckpt, report)
        plan.build(to, param_groups)
        written = _atomic_folder(out, lambda tmp: plan.write(tmp, out, progress))
        return {"out": out, "layout": to, "items": len(plan.entries), "bytes": written}
    converted = _convert_dict(ckpt, to, param_groups)
    written = _atomic_file(out, lambda fh: torch.save(converted, fh))
    progress(1, 1, f"wrote {out}")
    return {"out": out, "layout": to, "items": len(converted.get("state", converted)), "bytes": written}


def _check_out(src: str, out: str) -> None:
    if os.path.lexists(out):
        raise CheckpointError(f"{out} exists; the output must be a new path")
    parent = os.path.dirname(out)
    if not os.path.isdir(parent):
        raise CheckpointError(f"{parent} is not a folder")
    real_src, real_parent = os.path.realpath(src), os.path.realpath(parent)
    if real_parent == real_src or real_parent.startswith(real_src + os.sep):
        raise CheckpointError(f"{out} is inside the input {src}, which is never written")


def _create(path: str):
    return os.fdopen(os.open(path, _CREATE, 0o666), "wb")


def _atomic_folder(out: str, fill: Callable[[str], int]) -> int:
    """``fill(tmp)`` in a fresh temporary folder beside ``out``, then the folder becomes ``out``: created
    exclusively (``mkdir`` fails on anything there, a link included) and replaced by the full one."""
    parent = os.path.dirname(out)
    tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(out)}.tmp-", dir=parent)
    made = False
    try:
        written = fill(tmp)
        _fsync_dir(tmp)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o777 & ~umask)
        os.mkdir(out, 0o700)   # exclusive; ours and private until the rename below replaces it
        made = True
        os.rename(tmp, out)
        _fsync_dir(parent)
        return written
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        if made and os.path.isdir(out) and not os.path.islink(out) and not os.listdir(out):
            os.rmdir(out)
        raise


def _atomic_file(out: str, fill: Callable[[Any], None]) -> int:
    parent = os.path.dirname(out)
    tmp = os.path.join(parent, f".{os.path.basename(out)}.tmp-{uuid.uuid4().hex}")
    try:
        with _create(tmp) as fh:
            fill(fh)
            fh.flush()
            os.fsync(fh.fileno())
        os.link(tmp, out)   # exclusive: fails if out exists, a link included
        return os.path.getsize(out)
    finally:
        if os.path.lexists(tmp):
            os.unlink(tmp)


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError:   # some file systems cannot sync a folder
        pass
    finally:
        os.close(fd)


# ------------------------------------------------------------------------------------------ DCP

class _DcpPlan:
    """The new metadata of a DCP folder: each new key's storage metadata, its items (chunk -> where its
    bytes are) and its path in the nested state dict; ``blobs`` are bytes still to be written."""

    def __init__(self, folder: DcpFolder, report: dict) -> None:
        self.folder, self.report = folder, report
        self.layout = SavedLayout.from_keys(folder.entries)
        self.entries: dict[str, Any] = {}
        self.items: dict[Any, Any] = {}
        self.paths: dict[str, tuple] = {}
        self.blobs: list[tuple[Any, bytes | Callable[[], bytes]]] = []   # (MetadataIndex, payload)

    def _keep(self, old: str, new: str, path: tuple) -> None:
        from torch.distributed.checkpoint.metadata import MetadataIndex
        self.entries[new] = self.folder.entries[old]
        for index, info in self.folder.storage(old):
            self.items[MetadataIndex(new, index.offset, index.index)] = info
        self.paths[new] = path

    def _blob(self, new: str, path: tuple, payload: Any, md: Any, offset: Any = None) -> None:
        from torch.distributed.checkpoint.metadata import MetadataIndex
        self.entries[new] = md
        self.paths[new] = path
        self.blobs.append((MetadataIndex(new, offset), payload))

    def build(self, to: str, param_groups: str) -> None:
        flat = self._flatten(to, param_groups)
        state_path = (lambda f, k: ("optimizer", f"state.{f}.{k}")) if flat else (
            lambda f, k: ("optimizer", "state", f, k))
        mains = set(self.layout.main_params())
        saved_paths = self.folder.metadata.planner_data or {}
        for key in [*self.layout.other, *(f"model.{f}" for f in self.layout.model)]:   # unchanged
            self._keep(key, key, saved_paths.get(key, tuple(key.split(".", 1))))
        for fqn, names in self.layout.state.items():
            for name in names:
                old = f"optimizer.state.{fqn}.{name}"
                if name == MAIN_PARAM and to == "upstream":
                    self._keep(old, f"optimizer.{SECTION}.{fqn}", ("optimizer", MP_KEY, MAIN_PARAMS_KEY, fqn))
                elif name != MAIN_PARAM or to == "torch":
                    self._keep(old, old, state_path(fqn, name))
        for fqn in self.layout.section:
            old = f"optimizer.{SECTION}.{fqn}"
            if to == "upstream":
                self._keep(old, old, ("optimizer", MP_KEY, MAIN_PARAMS_KEY, fqn))
            elif fqn in self.layout.state or not self._equals_model(fqn):
                self._keep(old, f"optimizer.state.{fqn}.{MAIN_PARAM}", state_path(fqn, MAIN_PARAM))
        if to == "upstream" and mains:   # upstream's section names every bf16/fp16 param
            for fqn in self.report["model"]["low_precision"]:
                if fqn not in mains and f"model.{fqn}" in self.folder.entries:
                    self._cast_model(fqn)
        self._groups(flat)

    def _flatten(self, to: str, param_groups: str) -> bool:
        if to == "torch":
            return False
        if param_groups != "auto":
            return param_groups == "flat"
        if self.layout.flat_groups:
            return True
        kinds = {frozenset(keys - {"params"}) for keys in self.layout.nested_groups.values()}
        return len(kinds) > 1   # groups of several optimizer kinds: upstream's chain flattens

    def _equals_model(self, fqn: str) -> bool:
        """The saved main param of a param without optimizer state is its model param cast to fp32."""
        if f"model.{fqn}" not in self.folder.entries:
            return False
        model = {tuple(i.offset or ()): t for i, t in self.folder.read_chunks(f"model.{fqn}")}
        for index, main in self.folder.read_chunks(f"optimizer.{SECTION}.{fqn}"):
            piece = model.get(tuple(index.offset or ()))
            if piece is None or piece.shape != main.shape or not torch.equal(piece.to(main.dtype), main):
                return False
        return True

    def _cast_model(self, fqn: str) -> None:
        md = self.folder.entries[f"model.{fqn}"]
        props = dataclasses.replace(md.properties, dtype=torch.float32)
        new_md = dataclasses.replace(md, properties=props)
        new = f"optimizer.{SECTION}.{fqn}"
        from torch.distributed.checkpoint.metadata import MetadataIndex
        self.entries[new] = new_md
        self.paths[new] = ("optimizer", MP_KEY, MAIN_PARAMS_KEY, fqn)
        for index, info in self.folder.storage(f"model.{fqn}"):
            def cast(info=info) -> bytes:
                tensor = torch.load(io.BytesIO(self.folder.read_bytes(info)), map_location="cpu", weights_only=True)
                return _saved(tensor.to(torch.float32))
            self.blobs.append((MetadataIndex(new, index.offset, index.index), cast))

    def _setting(self, key: str) -> Any:
        md = self.folder.entries[key]
        if getattr(md, "properties", None) is None:
            return self.folder.read_object(key)
        return next(t for _, t in self.folder.read_chunks(key))

    def _groups(self, flat: bool) -> None:
        from torch.distributed.checkpoint.metadata import BytesStorageMetadata
        if self.layout.nested_groups:
            groups = []
            for i in sorted(self.layout.nested_groups):
                params = [str(f) for f in self.folder.read_object(f"optimizer.param_groups.{i}.params")]
                groups.append((params, {k: f"optimizer.param_groups.{i}.{k}"
                                        for k in self.layout.nested_groups[i] if k != "params"}))
        else:
            groups = self._groups_of_flat()
        for i, (params, keys) in enumerate(groups):
            if flat:
                for fqn in params:
                    for name, old in keys.items():
                        self._keep(old, f"optimizer.param_groups.{fqn}.{name}",
                                   ("optimizer", f"param_groups.{fqn}.{name}"))
                continue
            for name, old in keys.items():
                self._keep(old, f"optimizer.param_groups.{i}.{name}", ("optimizer", "param_groups", i, name))
            self._blob(f"optimizer.param_groups.{i}.params", ("optimizer", "param_groups", i, "params"),
                       _saved(params), BytesStorageMetadata())

    def _groups_of_flat(self) -> list[tuple[list[str], dict[str, str]]]:
        """Flattened groups regrouped: params whose settings are all equal form one group, groups in
        the order their first param appears. Two groups with equal settings cannot be told apart in
        the flattened layout and become one (docs/main_params.md#7-the-checkpoint-command)."""
        groups: list[tuple[list[str], dict[str, str], dict[str, Any]]] = []
        for fqn, names in self.layout.flat_groups.items():
            keys = {name: f"optimizer.param_groups.{fqn}.{name}" for name in sorted(names)}
            values = {name: self._setting(key) for name, key in keys.items()}
            for params, _, settings in groups:
                if settings.keys() == values.keys() and all(_same(settings[k], values[k]) for k in values):
                    params.append(fqn)
                    break
            else:
                groups.append(([fqn], keys, values))
        return [(params, keys) for params, keys, _ in groups]

    def write(self, tmp: str, out: str, progress: Progress) -> int:
        files = self.folder.rank_files()
        total = sum(os.path.getsize(os.path.join(self.folder.path, n)) for n in files)
        done = 0
        for name in files:
            with open(os.path.join(self.folder.path, name), "rb") as src, _create(os.path.join(tmp, name)) as dst:
                while True:
                    block = src.read(_BLOCK)
                    if not block:
                        break
                    dst.write(block)
                    done += len(block)
                    progress(done, total + 1, f"copying {name}")
                dst.flush()
                os.fsync(dst.fileno())
        if self.blobs:
            from torch.distributed.checkpoint.filesystem import _StorageInfo
            taken = set(files)
            name = next(f"__0_{n}.distcp" for n in range(len(taken) + 1) if f"__0_{n}.distcp" not in taken)
            with _create(os.path.join(tmp, name)) as fh:
                for index, payload in self.blobs:
                    data = payload() if callable(payload) else payload
                    self.items[index] = _StorageInfo(relative_path=name, offset=fh.tell(), length=len(data))
                    fh.write(data)
                    done += len(data)
                fh.flush()
                os.fsync(fh.fileno())
        meta = self.folder.metadata
        storage_meta = getattr(meta, "storage_meta", None)
        if storage_meta is not None:
            storage_meta = dataclasses.replace(storage_meta, checkpoint_id=out, save_id=str(uuid.uuid4()))
        metadata = dataclasses.replace(meta, state_dict_metadata=self.entries, storage_data=self.items,
                                       planner_data=self.paths, **({"storage_meta": storage_meta}
                                                                   if storage_meta is not None else {}))
        with _create(os.path.join(tmp, ".metadata")) as fh:   # last: DCP's sign of a finished save
            pickle.dump(metadata, fh)
            fh.flush()
            os.fsync(fh.fileno())
        progress(total + 1, total + 1, f"wrote {out}")
        return done


def _saved(obj: Any) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and torch.equal(a, b)
    return a == b


# ------------------------------------------------------------------------------------------ torch.save

def _convert_dict(ckpt: TorchSaveFile, to: str, param_groups: str) -> dict:
    """One rank's state dict keyed by FQN in layout ``to`` (the tensors as loaded, memory-mapped)."""
    osd = ckpt.optimizer
    if "state" not in osd:
        raise CheckpointError(f"{ckpt.path} holds a flattened optimizer state; convert the DCP checkpoint "
                              f"instead, or load it and call upstream_state_dict / get_optimizer_state_dict")
    names = index_names(osd)
    unnamed = sorted(str(v) for v in names.values() if str(v).startswith("#"))
    if unnamed:
        raise CheckpointError(f"{ckpt.path} keys its state by position and names no FQN for {', '.join(unnamed)} "
                              f"(no param_names, not in the RFC section): the layouts need FQNs")
    section = dict(osd.get(MP_KEY, {}).get(MAIN_PARAMS_KEY, {})) if isinstance(osd.get(MP_KEY), dict) else {}
    state = {}
    for key, entry in osd.get("state", {}).items():
        fqn = names.get(key, key)
        entry = dict(entry)
        main = entry.pop(MAIN_PARAM, None)
        if main is not None:
            section.setdefault(fqn, main)
        state[fqn] = entry
    groups = [{**g, "params": [names.get(k, k) for k in g["params"]]} for g in osd.get("param_groups", [])]
    if to == "torch":
        for fqn, main in section.items():
            state.setdefault(fqn, {})[MAIN_PARAM] = main
        converted = {"state": state, "param_groups": groups}
    else:
        kinds = {frozenset(set(g) - {"params"}) for g in groups}
        flat = param_groups == "flat" or (param_groups == "auto" and len(kinds) > 1)
        converted = {"state": state, "param_groups": groups}
        if flat:
            converted = {f"state.{f}.{k}": v for f, e in state.items() for k, v in e.items()}
            for g in groups:
                for fqn in g["params"]:
                    converted.update({f"param_groups.{fqn}.{k}": v for k, v in g.items() if k != "params"})
        converted[MP_KEY] = {MAIN_PARAMS_KEY: section}
    if ckpt.optimizer is not ckpt.obj:
        return {**ckpt.obj, "optimizer": converted}
    return converted
