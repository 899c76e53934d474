"""A validated, compiled form of the shipped matrix, so activation neither imports yaml nor validates.

Loading and validating compat_matrix.yaml is a third of activation (yaml's import alone compiles a
large regular expression). The result of ``parse_matrix`` is stored with :mod:`marshal` (plain data;
nothing is executed on load, and only plain values and the matrix's own types are decoded) in the
user's cache folder, one file per installed package folder, so several venvs do not evict each other.
It is used only when it was built from exactly the same matrix text, by the same ``matrix.py`` (size
and mtime) and the same Python; anything else is parsed again. Every failure to read or write it falls
back to parsing: the cache can make activation faster, never different.

It is read and written as CPython writes ``.pyc`` files and pip guards its cache (docs/security.md):
a folder or file owned by another user, or writable by group or others, is not used; only a regular
file is read, never through a link and never with a blocking open; the temporary file is created
exclusively under an unpredictable name, then renamed into place.
"""
from __future__ import annotations

import marshal
import os
import stat
import sys
import zlib
from typing import Callable, Iterable

from ..plugin_log import log
from .versions import VersionBounds

FORMAT = 2
_MAX_BYTES = 8 << 20     # far above the shipped matrix; a larger file is not ours
_KEEP = 32              # cache files kept: two per installed package folder


class _Uncacheable(Exception):
    pass


def _encode(value, types: dict):
    """Plain marshal-able data; NamedTuples and version specifiers are tagged so they come back as such."""
    if isinstance(value, VersionBounds):
        return ("VersionBounds", value.text)
    if type(value).__name__ == "SpecifierSet" and type(value).__module__ == "packaging.specifiers":
        return ("SpecifierSet", str(value))
    if isinstance(value, tuple) and hasattr(value, "_fields"):
        if types.get(type(value).__name__) is not type(value):
            raise _Uncacheable(type(value).__name__)
        return (type(value).__name__, tuple(_encode(v, types) for v in value))
    if isinstance(value, tuple):
        return ("tuple", tuple(_encode(v, types) for v in value))
    if isinstance(value, list):
        return ("list", tuple(_encode(v, types) for v in value))
    if isinstance(value, dict):
        return ("dict", tuple((_encode(k, types), _encode(v, types)) for k, v in value.items()))
    if value is None or isinstance(value, (str, bool, int, float)):
        return ("value", value)
    raise _Uncacheable(type(value).__name__)


def _decode(item, types: dict):
    kind, value = item
    if kind == "value":
        if value is not None and type(value) not in (str, bool, int, float):
            raise _Uncacheable(type(value).__name__)     # e.g. a code object in a crafted file
        return value
    if kind == "VersionBounds":
        return VersionBounds(value)
    if kind == "SpecifierSet":
        from packaging.specifiers import SpecifierSet
        return SpecifierSet(value)
    if kind == "tuple":
        return tuple(_decode(v, types) for v in value)
    if kind == "list":
        return [_decode(v, types) for v in value]
    if kind == "dict":
        return {_decode(k, types): _decode(v, types) for k, v in value}
    if kind not in types:
        raise _Uncacheable(kind)
    return types[kind](*(_decode(v, types) for v in value))


def _key(text: str, path: str, code_file: str) -> tuple | None:
    """What the cached matrix depends on; None where it cannot be known (matrix.py in a zip)."""
    try:
        code = os.stat(code_file)
    except (OSError, TypeError):
        return None
    return (FORMAT, sys.version, path, code.st_size, code.st_mtime_ns, text)


def _locations(stem: str) -> list:
    """The user's cache folder, one file per installed package folder; never beside the package, so that
    nothing of ours outside pip's RECORD is left in site-packages (uninstall leaves nothing importable)
    and PYTHONPYCACHEPREFIX and read-only installs need no special case. A relative cache folder (a
    relative XDG_CACHE_HOME, which the XDG spec says to ignore, or no home directory) is never used:
    it would write into the training script's working directory."""
    package = os.path.dirname(os.path.abspath(__file__))
    home = os.environ.get("XDG_CACHE_HOME", "")
    if not os.path.isabs(home):
        home = os.path.join(os.path.expanduser("~"), ".cache")
    if not os.path.isabs(home):
        return []
    name = f"{stem}-{zlib.crc32(package.encode()):08x}.{sys.implementation.cache_tag}.marshal"
    return [os.path.join(home, "npu_fsdp_patches", name)]


def _untrusted(st: os.stat_result) -> str | None:
    """Why a cache folder or file is not ours to use: another owner, or group/others may write it
    (pip's cache and git's safe.directory apply the same rule); None when it is."""
    if hasattr(os, "getuid") and st.st_uid != os.getuid():
        return f"owned by uid {st.st_uid}, not {os.getuid()}"
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return f"writable by group or others (mode {stat.S_IMODE(st.st_mode):o})"
    return None


_SAID: set = set()


def _skip(location: str, why: str) -> None:
    """One DEBUG line per location and reason: activation then runs as with no cache."""
    if (location, why) not in _SAID:
        _SAID.add((location, why))
        log.debug("cache %s not used: %s", location, why)


def _folder_problem(folder: str) -> str | None:
    try:
        st = os.lstat(folder)
    except FileNotFoundError:
        raise
    except OSError as exc:
        return f"folder: {exc.strerror}"
    if not stat.S_ISDIR(st.st_mode):
        return "folder is not a directory (a link or a file)"
    problem = _untrusted(st)
    return problem and f"folder {problem}"


def _read_bytes(location: str) -> bytes | None:
    """The file's bytes when it is a regular file we own that nobody else may write; never follows a
    link and never blocks (a FIFO is opened non-blocking, then refused)."""
    try:
        problem = _folder_problem(os.path.dirname(location))
    except FileNotFoundError:
        return None
    if problem:
        return _skip(location, problem)
    flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)
    try:
        fd = os.open(location, flags)
    except FileNotFoundError:
        return None
    except OSError as exc:
        return _skip(location, f"cannot open it: {exc.strerror}")
    try:
        st = os.fstat(fd)
        problem = "not a regular file" if not stat.S_ISREG(st.st_mode) else _untrusted(st)
        if problem:
            return _skip(location, problem)
        with os.fdopen(os.dup(fd), "rb") as fh:
            return fh.read(_MAX_BYTES + 1)
    except OSError as exc:
        return _skip(location, f"cannot read it: {exc.strerror}")
    finally:
        os.close(fd)


def _read(location: str, key: tuple, types: dict):
    data = _read_bytes(location)
    if data is None or len(data) > _MAX_BYTES:
        return None
    try:    # marshal is not safe against crafted data: anything it raises, or a wrong shape, is no cache
        loaded = marshal.loads(data)
        if not (type(loaded) is tuple and len(loaded) == 2 and loaded[0] == key):
            return None
        return _decode(loaded[1], types)
    except Exception:  # noqa: BLE001 - a cache that cannot be read is no cache
        _skip(location, "malformed")
        return None


def _write(locations: list, key: tuple, found, types: dict) -> None:
    """Into the first location that can be written: a temporary file created exclusively (O_EXCL,
    never through a link, an unpredictable name, mode 0600) in the same folder, then renamed into
    place, as CPython's ``importlib._bootstrap_external._write_atomic`` writes a ``.pyc``."""
    try:
        payload = marshal.dumps((key, _encode(found, types)))
    except (_Uncacheable, ValueError):
        return
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0)
    for location in locations:
        folder = os.path.dirname(location)
        try:
            os.makedirs(folder, mode=0o700, exist_ok=True)
        except OSError:
            continue
        problem = _folder_problem(folder)   # the folder exists: makedirs made it or found it
        if problem:
            _skip(location, problem)
            continue
        temporary = os.path.join(folder, f".{os.path.basename(location)}.{os.urandom(8).hex()}.tmp")
        try:
            fd = os.open(temporary, flags, 0o600)
        except OSError:
            continue
        try:
            with os.fdopen(fd, "wb") as fh:
                fh.write(payload)
            os.replace(temporary, location)   # atomic: a concurrent reader sees the old or the new file
            _evict(folder)
            return
        except OSError:
            try:
                os.unlink(temporary)
            except OSError:
                pass


def _evict(folder: str) -> None:
    """At most ``_KEEP`` cache files: the least recently written go (venvs that no longer exist)."""
    try:
        with os.scandir(folder) as entries:
            files = [(e.stat(follow_symlinks=False).st_mtime_ns, e.path) for e in entries
                     if e.name.endswith(".marshal") and e.is_file(follow_symlinks=False)]
        for _, path in sorted(files)[:-_KEEP]:
            os.unlink(path)
    except OSError:
        pass


def cached(stem: str, key: tuple, compute: Callable[[], object], types: Iterable[type] = ()):
    """``compute()``, or the result stored under ``stem`` for exactly ``key`` (which must hold everything
    the result depends on). ``types`` are the NamedTuples the result may hold (any other type makes it
    uncacheable: computed each time). Also serves the built-in patch table
    (:mod:`npu_fsdp_patches.plan.loader`)."""
    by_name = {cls.__name__: cls for cls in types}
    locations = _locations(stem)
    for location in locations:
        found = _read(location, key, by_name)
        if found is not None:
            return found
    found = compute()
    _write(locations, key, found, by_name)
    return found


def load(text: str, path: str, parse: Callable[[str, str], object], types: Iterable[type],
         code_file: str) -> object:
    """``parse(text, path)``, or its stored result for exactly this text, the parser's code file
    (``code_file``, matrix.py) and Python. The matrix passes its own types in: this module knows no
    matrix (no import cycle)."""
    key = _key(text, path, code_file)
    if key is None:
        return parse(text, path)
    return cached("compat_matrix", key, lambda: parse(text, path), types)
