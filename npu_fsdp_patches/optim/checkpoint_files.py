"""Read a checkpoint offline, with no process group and a few tensors at a time: a DCP folder or a
``torch.save`` file (docs/main_params.md#7-the-checkpoint-command).

A DCP folder is its ``.metadata`` (which keys, dtypes, global shapes and chunks, and where each item's
bytes sit in the ``__<rank>_<n>.distcp`` files) plus those files. The metadata is a pickle, so it is
read with an unpickler that builds only the types DCP's metadata is made of (torch's own loader would
build any object a crafted file names; docs/security.md#inputs-read-by-the-cli); items are read one
at a time by ``torch.load(..., weights_only=True)``. A ``torch.save`` file is memory-mapped and read
with ``weights_only=True``. Nothing here writes.
"""
from __future__ import annotations

import io
import os
import pickle
import re
from dataclasses import dataclass, field
from typing import Any, Iterator

import torch

__all__ = ["CheckpointError", "DcpFolder", "TorchSaveFile", "open_checkpoint"]

_RANK_FILE = re.compile(r"^__(\d+)_(\d+)\.distcp$")


class CheckpointError(Exception):
    """The path is no checkpoint this can read, or the checkpoint is malformed; the message says which."""


class _MetadataUnpickler(pickle.Unpickler):
    """Builds only what DCP's ``.metadata`` holds: its metadata classes, the file storage info,
    ``torch.Size``, dtypes, layouts and memory formats, and paths; any other global is refused."""

    _MODULES = ("torch.distributed.checkpoint.metadata",)
    _NAMES = {("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("torch", "Size"),
              ("torch.serialization", "_get_layout"), ("collections", "OrderedDict"),
              ("builtins", "set"), ("builtins", "frozenset")}
    _PATHS = {"PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath", "Path"}

    def find_class(self, module: str, name: str) -> Any:
        allowed = (module in self._MODULES or (module, name) in self._NAMES
                   or (module == "pathlib" and name in self._PATHS)
                   or (module == "torch" and isinstance(getattr(torch, name, None),
                                                        (torch.dtype, torch.layout, torch.memory_format))))
        if not allowed:
            raise pickle.UnpicklingError(f"the metadata names {module}.{name}, which DCP metadata never "
                                         f"holds; refusing to build it")
        return super().find_class(module, name)


def _open_read(path: str) -> io.BufferedReader:
    """Open a file inside a checkpoint for reading only, never blocking on a FIFO."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    try:
        if not _is_regular(os.fstat(fd)):
            raise CheckpointError(f"{path} is not a regular file")
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def _is_regular(st: os.stat_result) -> bool:
    import stat
    return stat.S_ISREG(st.st_mode)


@dataclass
class DcpFolder:
    """A DCP checkpoint folder, read through its metadata."""

    path: str
    metadata: Any = field(repr=False)

    @classmethod
    def open(cls, path: str) -> DcpFolder:
        meta = os.path.join(path, ".metadata")
        if not os.path.exists(meta):
            raise CheckpointError(f"{path} is a folder without a .metadata file: not a DCP checkpoint "
                                  f"(or one whose save did not finish)")
        try:
            with _open_read(meta) as fh:
                metadata = _MetadataUnpickler(fh).load()
        except (pickle.UnpicklingError, EOFError, AttributeError, ImportError, ValueError, TypeError) as exc:
            raise CheckpointError(f"cannot read {meta}: {exc}") from exc
        if not hasattr(metadata, "state_dict_metadata") or not hasattr(metadata, "storage_data"):
            raise CheckpointError(f"{meta} holds a {type(metadata).__name__}, not DCP metadata")
        return cls(os.fspath(path), metadata)

    @property
    def entries(self) -> dict[str, Any]:
        """key -> ``TensorStorageMetadata`` or ``BytesStorageMetadata``."""
        return self.metadata.state_dict_metadata

    def rank_files(self) -> list[str]:
        return sorted(n for n in os.listdir(self.path) if _RANK_FILE.match(n))

    def world_size(self) -> int | None:
        """Ranks that wrote the checkpoint: DCP's file writer leaves one ``__<rank>_<n>.distcp`` per
        rank (also a rank with nothing to write)."""
        ranks = {int(_RANK_FILE.match(n).group(1)) for n in self.rank_files()}
        return max(ranks) + 1 if ranks else None

    def storage(self, key: str) -> list[tuple[Any, Any]]:
        """``[(MetadataIndex, _StorageInfo), ...]`` of ``key``'s items (chunks), in chunk order."""
        if not hasattr(self, "_by_key"):
            self._by_key: dict[str, list] = {}
            for index, info in self.metadata.storage_data.items():
                self._by_key.setdefault(index.fqn, []).append((index, info))
        return self._by_key.get(key, [])

    def read_bytes(self, info: Any) -> bytes:
        if getattr(info, "transform_descriptors", None):
            raise CheckpointError(f"{info.relative_path} stores items with transforms "
                                  f"{list(info.transform_descriptors)}, which this command does not read")
        with _open_read(os.path.join(self.path, info.relative_path)) as fh:
            fh.seek(info.offset)
            data = fh.read(info.length)
        if len(data) != info.length:
            raise CheckpointError(f"{info.relative_path} is truncated (item at {info.offset} needs "
                                  f"{info.length} bytes)")
        return data

    def read_object(self, key: str) -> Any:
        """A non-tensor entry (a param group setting), loaded with ``weights_only=True``."""
        items = self.storage(key)
        if not items:
            raise CheckpointError(f"{key} has no stored item")
        return torch.load(io.BytesIO(self.read_bytes(items[0][1])), weights_only=True)

    def read_chunks(self, key: str) -> Iterator[tuple[Any, torch.Tensor]]:
        """``(MetadataIndex, tensor)`` for each stored chunk of a tensor entry, one at a time."""
        for index, info in self.storage(key):
            yield index, torch.load(io.BytesIO(self.read_bytes(info)), map_location="cpu", weights_only=True)


@dataclass
class TorchSaveFile:
    """A ``torch.save`` file of an optimizer state dict (one rank's), or of ``{"model", "optimizer"}``."""

    path: str
    obj: Any = field(repr=False)

    @classmethod
    def open(cls, path: str) -> TorchSaveFile:
        import torch.distributed.tensor  # noqa: F401  (a saved DTensor loads only once torch knows it)
        try:
            with _open_read(path):
                pass
            obj = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except CheckpointError:
            raise
        except Exception as exc:   # noqa: BLE001 - torch.load raises many kinds for a bad file
            raise CheckpointError(f"cannot read {path} as a torch.save file with weights_only=True: "
                                  f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}") from exc
        if not isinstance(obj, dict):
            raise CheckpointError(f"{path} holds a {type(obj).__name__}, not a state dict")
        return cls(os.fspath(path), obj)

    @property
    def optimizer(self) -> dict:
        return self.obj["optimizer"] if isinstance(self.obj.get("optimizer"), dict) else self.obj

    @property
    def model(self) -> dict:
        return self.obj["model"] if isinstance(self.obj.get("model"), dict) else {}


def open_checkpoint(path: str | os.PathLike) -> DcpFolder | TorchSaveFile:
    """A DCP folder or a ``torch.save`` file at ``path`` (followed if a link, as the user named it)."""
    path = os.fspath(path)
    if os.path.isdir(path):
        return DcpFolder.open(path)
    if os.path.exists(path):
        return TorchSaveFile.open(path)
    raise CheckpointError(f"{path}: no such file or folder")
