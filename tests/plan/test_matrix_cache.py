"""The compiled form of the shipped matrix (npu_fsdp_patches/plan/matrix_cache.py): used only for exactly
the text it was built from, never a different result, silent when it cannot be read or written."""
import os
import pathlib
import sys
from typing import NamedTuple

import pytest

from npu_fsdp_patches.plan import matrix, matrix_cache
from tests.support import run_python


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """Cache files under tmp_path; returns the two locations (the first may be unwritable)."""
    locations = [str(tmp_path / "pkg" / "__pycache__" / "m.marshal"), str(tmp_path / "home" / "m.marshal")]
    monkeypatch.setattr(matrix_cache, "_locations", lambda _stem: list(locations))
    return locations


def load(text, path, parse):
    """The matrix's own call of the cache (matrix.load_matrix), with another text, path or parser."""
    return matrix_cache.load(text, path, parse, matrix._CACHED_TYPES, matrix.__file__)


def counting_parse(calls):
    def parse(text, path):
        calls.append(text)
        return matrix.parse_matrix(text, path)
    return parse


def test_the_stored_matrix_equals_a_fresh_parse_and_is_used_for_the_same_text(cache):
    text, calls = matrix.shipped_text(), []
    first = load(text, "shipped.yaml", counting_parse(calls))
    again = load(text, "shipped.yaml", counting_parse(calls))
    assert len(calls) == 1
    assert again == first == matrix.parse_matrix(text, "shipped.yaml")
    assert again.patches["te_fused_adam_dtensor"].gate[1][0].version.contains("2.13.0")


def test_a_changed_matrix_text_is_parsed_again(cache):
    text, calls = matrix.shipped_text(), []
    load(text, "shipped.yaml", counting_parse(calls))
    edited = text.replace('version: ">=2.10,<2.14"', 'version: ">=2.10,<2.15"')
    assert edited != text
    found = load(edited, "shipped.yaml", counting_parse(calls))
    assert len(calls) == 2 and str(found.patches["te_fused_adam_dtensor"].gate[1][0].version) == "<2.15,>=2.10"


def test_an_unreadable_or_unwritable_cache_falls_back_to_parsing(cache, tmp_path):
    text, calls = matrix.shipped_text(), []
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__pycache__").write_text("a file where the folder should be: unwritable")
    (tmp_path / "home").mkdir()
    (tmp_path / "home" / "m.marshal").write_bytes(b"\x00garbage")
    assert load(text, "s", counting_parse(calls)) == matrix.parse_matrix(text, "s")
    assert load(text, "s", counting_parse(calls)) == matrix.parse_matrix(text, "s")
    assert len(calls) == 1                          # the second location was rewritten and read back


def test_nothing_is_written_beside_the_package_with_or_without_bytecode(monkeypatch, tmp_path):
    """Uninstall must leave nothing of ours in site-packages: pip's RECORD lists no cache file."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    (location,) = matrix_cache._locations("compat_matrix")
    assert location.startswith(str(tmp_path / "npu_fsdp_patches"))
    package = str(pathlib.Path(matrix.__file__).parents[1])   # the package root, npu_fsdp_patches/
    monkeypatch.setattr(sys, "dont_write_bytecode", False)
    assert not any(loc.startswith(package) for loc in matrix_cache._locations("builtin_patches"))


def test_a_relative_cache_folder_is_never_used(monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", "relative/cache")                 # ignored: the home folder's
    assert matrix_cache._locations("compat_matrix")[0].startswith(os.path.expanduser("~"))
    with monkeypatch.context() as no_home:
        no_home.setattr(matrix_cache.os.path, "expanduser", lambda path: path)   # "~" stays relative
        assert matrix_cache._locations("compat_matrix") == []


def test_each_package_folder_has_its_own_user_cache_file(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    first = matrix_cache._locations("compat_matrix")
    monkeypatch.setattr(matrix_cache, "__file__", str(tmp_path / "other-venv" / "npu_fsdp_patches" / "plan" / "matrix_cache.py"))
    second = matrix_cache._locations("compat_matrix")
    assert first != second
    assert all(location.startswith(str(tmp_path / "npu_fsdp_patches")) for location in first + second)


def test_a_matrix_holding_a_type_the_cache_does_not_know_is_never_stored(cache):
    class Extra(NamedTuple):      # e.g. a field type added to the matrix later
        value: str

    def parse(text, path):
        calls.append(text)
        found = matrix.parse_matrix(text, path)
        return found._replace(lines={"x": Extra("y")})

    calls = []
    load(matrix.shipped_text(), "s", parse)
    assert load(matrix.shipped_text(), "s", parse).lines == {"x": Extra("y")}
    assert len(calls) == 2


def test_activation_with_the_stored_matrix_imports_no_yaml(tmp_path):
    env = {"PYTHONDONTWRITEBYTECODE": "", "XDG_CACHE_HOME": str(tmp_path)}
    code = "import sys, npu_fsdp_patches; print(len(npu_fsdp_patches.status()), 'yaml' in sys.modules)"
    run_python(code, env=env)                       # builds the cache where it can
    assert run_python(code, env=env).stdout.split() == [str(len(matrix.load_matrix().patches)), "False"]
