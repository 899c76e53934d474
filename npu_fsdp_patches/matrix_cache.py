"""A validated, compiled form of the shipped matrix, so activation neither imports yaml nor validates.

Loading and validating compat_matrix.yaml is a third of activation (yaml's import alone compiles a
large regular expression). The result of ``parse_matrix`` is stored with :mod:`marshal` (plain data,
the format of ``.pyc`` files; nothing is executed on load) in the package's ``__pycache__``, else
in the user's cache folder (one file per installed package folder, so several venvs do not evict each
other). It is used only when it was built from exactly the same matrix text, by the same ``matrix.py``
(size and mtime) and the same Python; anything else is parsed again. Every failure to read or write it
is silent and falls back to parsing: the cache can make activation faster, never different.

Bytecode writing off (``-B``, PYTHONDONTWRITEBYTECODE, common in container images) keeps it out of
``__pycache__``, as it keeps ``.pyc`` files out, but not out of the user's cache folder: the
``.pyc`` files still come from pip's compile step at install time, this cache has no such step, and
without it every activation would parse and validate the YAML again. Nothing is written from a zip.
"""
from __future__ import annotations

import marshal
import os
import sys
import zlib
from typing import Callable

from . import matrix
from .versions import VersionBounds

FORMAT = 1
#: the NamedTuples of a Matrix, by name; an unknown type makes the matrix uncacheable (parsed each time)
_TYPES = {cls.__name__: cls for cls in (matrix.Target, matrix.Condition, matrix.FlavorRule,
                                        matrix.FrameworkSpec, matrix.PatchSpec, matrix.PatchDefaults,
                                        matrix.Matrix)}


class _Uncacheable(Exception):
    pass


def _encode(value):
    """Plain marshal-able data; NamedTuples and version specifiers are tagged so they come back as such."""
    if isinstance(value, VersionBounds):
        return ("VersionBounds", value.text)
    if type(value).__name__ == "SpecifierSet" and type(value).__module__ == "packaging.specifiers":
        return ("SpecifierSet", str(value))
    if isinstance(value, tuple) and hasattr(value, "_fields"):
        if _TYPES.get(type(value).__name__) is not type(value):
            raise _Uncacheable(type(value).__name__)
        return (type(value).__name__, tuple(_encode(v) for v in value))
    if isinstance(value, tuple):
        return ("tuple", tuple(_encode(v) for v in value))
    if isinstance(value, list):
        return ("list", tuple(_encode(v) for v in value))
    if isinstance(value, dict):
        return ("dict", tuple((_encode(k), _encode(v)) for k, v in value.items()))
    if value is None or isinstance(value, (str, bool, int, float)):
        return ("value", value)
    raise _Uncacheable(type(value).__name__)


def _decode(item):
    kind, value = item
    if kind == "value":
        return value
    if kind == "VersionBounds":
        return VersionBounds(value)
    if kind == "SpecifierSet":
        from packaging.specifiers import SpecifierSet
        return SpecifierSet(value)
    if kind == "tuple":
        return tuple(_decode(v) for v in value)
    if kind == "list":
        return [_decode(v) for v in value]
    if kind == "dict":
        return {_decode(k): _decode(v) for k, v in value}
    return _TYPES[kind](*(_decode(v) for v in value))


def _key(text: str, path: str) -> tuple | None:
    """What the cached matrix depends on; None where it cannot be known (matrix.py in a zip)."""
    try:
        code = os.stat(matrix.__file__)
    except (OSError, TypeError):
        return None
    return (FORMAT, sys.version, path, code.st_size, code.st_mtime_ns, text)


def _locations(stem: str) -> list:
    """Beside the package (like a .pyc), then the user's cache folder, named by the package's folder.
    A relative cache folder (a relative XDG_CACHE_HOME, which the XDG spec says to ignore, or no home
    directory) is never used: it would write into the training script's working directory."""
    package = os.path.dirname(os.path.abspath(matrix.__file__))
    tag = sys.implementation.cache_tag
    locations = [os.path.join(package, "__pycache__", f"{stem}.{tag}.marshal")]
    home = os.environ.get("XDG_CACHE_HOME", "")
    if not os.path.isabs(home):
        home = os.path.join(os.path.expanduser("~"), ".cache")
    if os.path.isabs(home):
        name = f"{stem}-{zlib.crc32(package.encode()):08x}.{tag}.marshal"
        locations.append(os.path.join(home, "npu_fsdp_patches", name))
    return locations


def _read(location: str, key: tuple):
    try:
        with open(location, "rb") as fh:
            stored_key, data = marshal.load(fh)
        return _decode(data) if stored_key == key else None
    except Exception:  # noqa: BLE001 - a cache that cannot be read is no cache
        return None


def _write(locations: list, key: tuple, found) -> None:
    """Into the first location that can be written; with bytecode writing off, not beside the package."""
    if sys.dont_write_bytecode:
        locations = locations[1:]
    try:
        payload = marshal.dumps((key, _encode(found)))
    except (_Uncacheable, ValueError):
        return
    for location in locations:
        temporary = f"{location}.{os.getpid()}.tmp"
        try:
            os.makedirs(os.path.dirname(location), exist_ok=True)
            with open(temporary, "wb") as fh:
                fh.write(payload)
            os.replace(temporary, location)   # atomic: a concurrent reader sees the old or the new file
            return
        except OSError:
            try:
                os.unlink(temporary)
            except OSError:
                pass


def cached(stem: str, key: tuple, compute: Callable[[], object]):
    """``compute()``, or the result stored under ``stem`` for exactly ``key`` (which must hold everything
    the result depends on). Also serves the built-in patch table (:mod:`npu_fsdp_patches.loader`)."""
    locations = _locations(stem)
    for location in locations:
        found = _read(location, key)
        if found is not None:
            return found
    found = compute()
    _write(locations, key, found)
    return found


def load(text: str, path: str, parse: Callable[[str, str], "matrix.Matrix"]) -> "matrix.Matrix":
    """``parse(text, path)``, or its stored result for exactly this text, matrix.py and Python."""
    key = _key(text, path)
    if key is None:
        return parse(text, path)
    return cached("compat_matrix", key, lambda: parse(text, path))
