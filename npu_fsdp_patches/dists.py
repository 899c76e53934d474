"""Installed distributions read straight from their ``*.dist-info`` / ``*.egg-info`` folders.

Activation needs only a few facts per distribution (name, version, files, entry points), and
``importlib.metadata`` costs a third of activation to import (it pulls in email, zipfile and csv).
So the ``sys.path`` directories are scanned once, and only the metadata files asked for are read.
Entries that are not directories (zip files, eggs) fall back to ``importlib.metadata``.
"""
from __future__ import annotations

import os
import re
import sys
from typing import Iterator

_INFO = re.compile(r"^(?P<name>.+?)(-[^-]*)?\.(dist-info|egg-info)$")


def normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


class InstalledDist:
    """One installed distribution's metadata folder (the part of importlib's Distribution we use)."""

    def __init__(self, info_path: str):
        self.info_path = info_path
        self.root = os.path.dirname(info_path)
        self._headers: dict | None = None

    def read_text(self, filename: str) -> str | None:
        folder = self.info_path
        if folder.endswith(".egg-info") and filename == "METADATA":
            filename = "PKG-INFO"
        try:
            with open(os.path.join(folder, filename), encoding="utf-8") as fh:
                return fh.read()
        except OSError:
            return None

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
    """Adapter over importlib.metadata for entries the directory scan cannot read."""

    def __init__(self, dist):
        self._dist = dist
        self.info_path = str(getattr(dist, "_path", ""))
        self.root = str(dist.locate_file(""))
        self._headers = {"name": dist.metadata["Name"], "version": dist.metadata["Version"]}

    def read_text(self, filename: str) -> str | None:
        return self._dist.read_text(filename)


def _scan_dirs() -> Iterator[InstalledDist]:
    for entry in sys.path:
        folder = entry or os.getcwd()
        if not os.path.isdir(folder):
            continue
        try:
            names = sorted(os.listdir(folder))
        except OSError:
            continue
        for name in names:
            if _INFO.match(name) and os.path.isdir(os.path.join(folder, name)):
                yield InstalledDist(os.path.join(folder, name))


def _non_directory_entries() -> Iterator[InstalledDist]:
    zipped = [p for p in sys.path if p and os.path.isfile(p)]
    if not zipped:
        return
    if sys.version_info >= (3, 10):
        import importlib.metadata as metadata
    else:  # pragma: no cover - Python 3.9 only
        import importlib_metadata as metadata
    for dist in metadata.distributions(path=zipped):
        yield _MetadataDist(dist)


_SCANNED: dict = {}


def installed() -> dict:
    """normalized name -> first InstalledDist in sys.path order (what ``import`` would see).

    Scanned once per distinct ``sys.path`` (activation asks twice: detection and entry points).
    """
    key = tuple(sys.path)
    if key not in _SCANNED:
        _SCANNED.clear()
        _SCANNED[key] = _scan_index()
    return _SCANNED[key]


def _scan_index() -> dict:
    index: dict = {}
    for dist in list(_scan_dirs()) + list(_non_directory_entries()):
        match = _INFO.match(os.path.basename(dist.info_path)) if dist.info_path else None
        key = normalize(match["name"]) if match else normalize(dist.name or "")
        index.setdefault(key, dist)
    return index


def entry_points(group: str) -> list:
    """(name, value) of every entry point in ``group``, first distribution on sys.path first."""
    return [ep for dist in installed().values() for ep in dist.entry_points(group)]
