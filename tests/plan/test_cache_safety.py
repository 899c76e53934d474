"""The user cache of the compiled matrix and patch table is safe by construction (docs/security.md):
whatever state the cache is in, activation decides exactly as with no cache, imports nothing the cache
names, never hangs on a FIFO and never writes through a planted link."""
import json
import marshal
import os
import stat

import pytest

from npu_fsdp_patches.plan import loader, matrix, matrix_cache
from tests.support import run_python

DECISIONS = """
import json, npu_fsdp_patches
print(json.dumps([[s["name"], s["decision"], s["state"]] for s in npu_fsdp_patches.status()]))
"""
UNUSED_UID = 54321


def decisions(home, extra_paths=()):
    env = {"XDG_CACHE_HOME": str(home), "PYTHONDONTWRITEBYTECODE": "1"}
    return json.loads(run_python(DECISIONS, env=env, paths=extra_paths, timeout=60).stdout)


def forged_matrix() -> bytes:
    """The shipped matrix under its true key, with hp_skip_dispatch_adamw's gate made to always hold."""
    text = matrix.shipped_text()
    key = matrix_cache._key(text, str(matrix.SHIPPED_MATRIX), matrix.__file__)
    parsed = matrix.parse_matrix(text, str(matrix.SHIPPED_MATRIX))
    patches = dict(parsed.patches)
    patches["hp_skip_dispatch_adamw"] = patches["hp_skip_dispatch_adamw"]._replace(gate=((),))
    return marshal.dumps((key, matrix_cache._encode(parsed._replace(patches=patches), {t.__name__: t for t in matrix._CACHED_TYPES})))


def forged_provider(marker_module: str) -> bytes:
    """The built-in table under its true key, with a patch provided by an arbitrary module."""
    path = loader._builtin_path()
    table = dict(loader._read_builtin_table(), hp_skip_dispatch_adamw=f"{marker_module}:Patch")
    return marshal.dumps((loader._stamp(path), matrix_cache._encode(table, {})))


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_every_cache_state_decides_as_no_cache(home, tmp_path):
    (matrix_file,) = map(os.path.abspath, matrix_cache._locations("compat_matrix"))
    (table_file,) = map(os.path.abspath, matrix_cache._locations("builtin_patches"))
    folder = os.path.dirname(matrix_file)
    evil = tmp_path / "evil"
    evil.mkdir()
    (evil / "evil_provider.py").write_text(f"open({str(tmp_path / 'imported')!r}, 'w').close()\n")
    expected = decisions(tmp_path / "none")                     # no cache at all
    assert decisions(home) == expected and os.path.isfile(matrix_file)   # written, then read
    assert decisions(home) == expected

    def plant(name, payload, *, mode=0o600, uid=None, folder_mode=0o700):
        os.chmod(folder, folder_mode)
        os.chmod(folder, folder_mode)
        if os.path.lexists(name):
            os.unlink(name)
        with open(name, "wb") as fh:
            fh.write(payload)
        os.chmod(name, mode)
        if uid is not None:
            os.chown(name, uid, -1)

    # the negative control: a trusted forged decision does change it, so the states below can fail
    plant(matrix_file, forged_matrix())
    assert decisions(home) != expected
    states = {
        "stale": lambda: plant(matrix_file, marshal.dumps(((0, "old"), ("value", None)))),
        "truncated": lambda: plant(matrix_file, forged_matrix()[:500]),
        "garbage": lambda: plant(matrix_file, b"\xe3\x00\xffgarbage" * 50),
        "foreign-owned": lambda: plant(matrix_file, forged_matrix(), uid=UNUSED_UID),
        "group-writable file": lambda: plant(matrix_file, forged_matrix(), mode=0o620),
        "group-writable folder": lambda: plant(matrix_file, forged_matrix(), folder_mode=0o770),
        "forged provider": lambda: plant(table_file, forged_provider("evil_provider")),
    }
    for state, make in states.items():
        make()
        assert decisions(home, [evil]) == expected, state
        assert not (tmp_path / "imported").exists(), state
        for name in (matrix_file, table_file):
            if os.path.lexists(name):
                os.unlink(name)
    elsewhere = tmp_path / "elsewhere.marshal"
    elsewhere.write_bytes(forged_matrix())
    os.chmod(folder, 0o700)
    os.symlink(elsewhere, matrix_file)
    assert decisions(home) == expected, "symlink"
    assert elsewhere.read_bytes() == forged_matrix()            # neither followed nor rewritten
    os.unlink(matrix_file)
    os.mkfifo(matrix_file)
    assert decisions(home) == expected, "FIFO"                  # the child's timeout catches a hang
    assert stat.S_ISREG(os.lstat(matrix_file).st_mode)                # replaced by a good file


def test_a_link_planted_at_any_temporary_name_is_never_followed(home, tmp_path, monkeypatch):
    """The temporary name is unpredictable; and even a link at the name it draws is not written through."""
    (location,) = matrix_cache._locations("compat_matrix")
    folder = os.path.dirname(location)
    os.makedirs(folder, mode=0o700)
    victim = tmp_path / "victim"
    victim.write_text("precious")
    drawn = b"\x01" * 8
    predictable = [f"{location}.{os.getpid()}.tmp", f"{location}.tmp",
                   os.path.join(folder, f".{os.path.basename(location)}.{drawn.hex()}.tmp")]
    for name in predictable:
        os.symlink(victim, name)
    monkeypatch.setattr(matrix_cache.os, "urandom", lambda n: drawn)
    matrix_cache._write([location], ("k",), {"a": 1}, {})
    assert victim.read_text() == "precious"
    assert all(os.path.islink(name) for name in predictable)
    assert not os.path.exists(location)                         # the one drawn name was taken: no write
    monkeypatch.undo()
    matrix_cache._write([location], ("k",), {"a": 1}, {})
    assert matrix_cache._read(location, ("k",), {}) == {"a": 1} and victim.read_text() == "precious"
    assert stat.S_IMODE(os.lstat(location).st_mode) == 0o600


@pytest.mark.parametrize("kind", ["fifo", "device", "folder"])
def test_a_matrix_setting_naming_no_regular_file_never_hangs_the_import(tmp_path, kind):
    """NPU_FSDP_PATCHES_MATRIX at a FIFO or ``/dev/zero`` blocked ``import npu_fsdp_patches`` forever."""
    target = {"fifo": tmp_path / "matrix.fifo", "device": "/dev/zero", "folder": tmp_path}[kind]
    if kind == "fifo":
        os.mkfifo(target)
    proc = run_python("import npu_fsdp_patches; print(npu_fsdp_patches.status())",
                      env={"NPU_FSDP_PATCHES_MATRIX": str(target)}, timeout=60, check=False)
    assert proc.returncode == 0, proc.stderr
    assert "not a regular file" in proc.stderr or "Is a directory" in proc.stderr, proc.stderr
