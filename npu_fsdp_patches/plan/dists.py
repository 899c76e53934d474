"""Installed distributions read straight from their metadata, in the forms ``importlib.metadata`` reads.

Activation needs only a few facts per distribution (name, version, files, entry points), and
``importlib.metadata`` costs a third of activation to import (it pulls in email, zipfile and csv).
So the ``sys.path`` directories are scanned once, and only the metadata files asked for are read.
The forms and the order are importlib.metadata's (CPython ``importlib/metadata/__init__.py``
``Lookup`` and ``PathDistribution``): ``*.dist-info`` and ``*.egg-info`` folders, an ``*.egg-info``
file (``setup.py install`` of distutils), the ``EGG-INFO`` of a ``*.egg`` folder on ``sys.path``;
METADATA, else PKG-INFO; the first match in ``sys.path`` order, each folder in ``os.listdir`` order.
Entries that are not directories (zip files, wheels) fall back to ``importlib.metadata``.
Metadata is never allowed to raise: text that is not UTF-8 is read with replacement characters and
reported in ``problems``.
"""
from __future__ import annotations

import os
import re
import sys
from typing import Iterator

_SUFFIXES = (".dist-info", ".egg-info")


def normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def info_name(basename: str) -> str:
    """The normalized distribution name of a metadata entry, as importlib.metadata derives it
    (``transformer_engine-2.11.0-py3.11.egg-info`` -> ``transformer-engine``)."""
    return normalize(basename.lower().rpartition(".")[0].partition("-")[0])


class InstalledDist:
    """One installed distribution's metadata (the part of importlib's Distribution we use)."""

    def __init__(self, info_path: str, root: str | None = None):
        self.info_path = info_path
        self.root = root if root is not None else os.path.dirname(info_path)
        self._headers: dict | None = None
        self.problems: list = []        # metadata that could not be read as it should
        self.others: list = []          # later metadata of the same distribution (stale copies)

    def read_text(self, filename: str) -> str | None:
        """A metadata file's text; METADATA falls back to PKG-INFO, and an ``.egg-info`` file is its
        own PKG-INFO. Never raises: undecodable bytes are replaced and reported."""
        if os.path.isfile(self.info_path):
            return self._read(self.info_path) if filename in ("METADATA", "PKG-INFO") else None
        text = self._read(os.path.join(self.info_path, filename))
        if text is None and filename == "METADATA":
            text = self._read(os.path.join(self.info_path, "PKG-INFO"))
        return text

    def _read(self, path: str) -> str | None:
        try:
            with open(path, "rb") as fh:
                data = fh.read()
        except OSError:
            return None
        try:
            return data.decode("utf-8")
        except UnicodeDecodeError as exc:
            self.problems.append(f"{path} is not UTF-8 (byte {data[exc.start:exc.start + 1].hex()} at "
                                 f"offset {exc.start}); read with replacement characters")
            return data.decode("utf-8", errors="replace")

    def _header(self, key: str) -> str | None:
        if self._headers is None:
            self._headers = {}
            for line in (self.read_text("METADATA") or "").splitlines():
                if not line.strip():
                    break
                field, _, value = line.partition(":")
                self._headers.setdefault(field.strip().lower(), value.strip())
        return self._headers.get(key)

    @property
    def name(self) -> str | None:
        return self._header("name")

    @property
    def version(self) -> str | None:
        return self._header("version")

    def files(self) -> list | None:
        """Installed file paths relative to the install folder: RECORD (dist-info), else
        installed-files.txt (egg-info, relative to the metadata folder), else SOURCES.txt; None
        when the metadata lists no files (an egg-info file)."""
        record = self.read_text("RECORD")
        if record is not None:
            return [line.split(",", 1)[0] for line in record.splitlines() if line]
        installed = self.read_text("installed-files.txt")
        if installed is not None:
            return [os.path.normpath(os.path.join(os.path.basename(self.info_path), line)).replace(os.sep, "/")
                    for line in installed.splitlines() if line.strip()]
        sources = self.read_text("SOURCES.txt")
        return sources.split() if sources is not None else None

    def entry_points(self, group: str) -> list:
        """(name, "module:attr") pairs of one group in entry_points.txt."""
        found, current = [], None
        for raw in (self.read_text("entry_points.txt") or "").splitlines():
            line = raw.strip()
            if line.startswith("[") and line.endswith("]"):
                current = line[1:-1].strip()
            elif current == group and "=" in line and not line.startswith(("#", ";")):
                name, _, value = line.partition("=")
                found.append((name.strip(), value.strip()))
        return found


class _MetadataDist(InstalledDist):
    """Adapter over importlib.metadata for entries the directory scan cannot read (zip files)."""

    def __init__(self, dist):
        super().__init__(str(getattr(dist, "_path", "")), str(dist.locate_file("")))
        self._dist = dist
        self._headers = {"name": self._field("Name"), "version": self._field("Version")}

    def _field(self, field: str) -> str | None:
        try:
            return self._dist.metadata[field]
        except Exception as exc:  # noqa: BLE001 - metadata must never break activation
            self.problems.append(f"metadata of {self.info_path} unreadable: {type(exc).__name__}: {exc}")
            return None

    def read_text(self, filename: str) -> str | None:
        try:
            return self._dist.read_text(filename)
        except Exception as exc:  # noqa: BLE001
            self.problems.append(f"{self.info_path}/{filename} unreadable: {type(exc).__name__}: {exc}")
            return None


def _scan_dirs() -> Iterator[tuple]:
    """(normalized name, InstalledDist) for each metadata entry of the sys.path directories; a folder
    reached twice (a repeated sys.path entry, a symlink) is read once."""
    seen = set()
    for entry in sys.path:
        folder = entry or os.getcwd()
        real = os.path.realpath(folder)
        if real in seen or not os.path.isdir(folder):
            continue
        seen.add(real)
        base = os.path.basename(folder.rstrip("/" + os.sep))
        if base.lower().endswith(".egg") and os.path.isdir(os.path.join(folder, "EGG-INFO")):
            yield info_name(base), InstalledDist(os.path.join(folder, "EGG-INFO"), folder)
        try:
            names = os.listdir(folder)    # unsorted, as importlib.metadata reads it
        except OSError:
            continue
        for name in names:
            if name.lower().endswith(_SUFFIXES):
                yield info_name(name), InstalledDist(os.path.join(folder, name))


def _non_directory_entries() -> Iterator[tuple]:
    zipped = [p for p in sys.path if p and os.path.isfile(p)]
    if not zipped:
        return
    if sys.version_info >= (3, 10):
        import importlib.metadata as metadata
    else:  # pragma: no cover - Python 3.9 only
        import importlib_metadata as metadata
    for dist in metadata.distributions(path=zipped):
        found = _MetadataDist(dist)
        yield normalize(found.name or ""), found


_SCANNED: dict = {}


def installed() -> dict:
    """normalized name -> first InstalledDist in sys.path order (what ``import`` would see); later
    metadata of the same name is kept in its ``others``.

    Scanned once per distinct ``sys.path`` (activation asks twice: detection and entry points).
    """
    key = tuple(sys.path)
    if key not in _SCANNED:
        _SCANNED.clear()
        _SCANNED[key] = _scan_index()
    return _SCANNED[key]


def _scan_index() -> dict:
    index: dict = {}
    for key, dist in list(_scan_dirs()) + list(_non_directory_entries()):
        first = index.setdefault(key, dist)
        if first is not dist:
            first.others.append(dist)
    return index


def entry_points(group: str) -> list:
    """(name, value) of every entry point in ``group``, first distribution on sys.path first."""
    return [ep for dist in installed().values() for ep in dist.entry_points(group)]
