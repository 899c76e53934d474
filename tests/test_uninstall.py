"""Uninstall leaves nothing of ours importable or on disk in site-packages (issue 28; docs/security.md).

A non-editable install (``pip install --no-deps --no-build-isolation --no-compile``, so that the
imports write the bytecode) into a fresh venv, which sees torch and the other dependencies through a
folder of links to this venv's site-packages without our editable install. Then ``import torch``
(autoload activates the plugin) with bytecode writing on and off, ``pip uninstall``, and a walk of
site-packages. ``PYTHONPYCACHEPREFIX`` is honoured: with it set, not even bytecode lands beside us.
"""
import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from npu_fsdp_patches.plan.loader import builtin_table
from tests.test_packaging import _copy_sources

#: the patches the installed plugin reports: every built-in one of this checkout
PATCHES = [str(len(builtin_table()))]
#: what the installed plugin does at ``import torch``: activate, report, load the optimizers
IMPORT = ("import torch, npu_fsdp_patches as n, npu_fsdp_patches.optim as o; "
          "assert 'site-packages' in n.__file__, n.__file__; o.FusedAdam; print(len(n.status()))")


def _dependency_links(dest: Path) -> Path:
    """A folder of links to this venv's site-packages entries, leaving out our editable install (its
    .pth finder, dist-info and entry points) and pip: the fresh venv imports torch and our dependencies
    from it (PYTHONPATH processes no .pth file, so nothing of the checkout is importable from there)."""
    dest.mkdir()
    for entry in Path(sysconfig.get_paths()["purelib"]).iterdir():
        name = entry.name.lower().replace("-", "_")
        if name.startswith(("npu_fsdp_patches", "__editable__", "pip", "__pycache__")) or name.endswith(".pth"):
            continue
        (dest / entry.name).symlink_to(entry)
    return dest


class Venv:
    def __init__(self, root: Path, links: Path, src: Path):
        self.root, self.links, self.src = root, links, src
        subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(root / "venv")], check=True, timeout=120)
        self.python = root / "venv" / "bin" / "python"
        self.site = Path(subprocess.run([self.python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                        capture_output=True, text=True, check=True, timeout=60).stdout.strip())
        (self.site / "someone_else.py").write_text("")   # a venv is never empty: pip keeps the folder

    def env(self, **extra) -> dict:
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(self.root), "OMP_NUM_THREADS": "1",
               "XDG_CACHE_HOME": str(self.root / "cache"), "PYTHONPATH": str(self.links)}
        env.update(extra)
        return env

    def pip(self, *args: str) -> None:
        proc = subprocess.run([sys.executable, "-m", "pip", "--python", str(self.python), *args], capture_output=True,
                              text=True, timeout=300, env=self.env())
        assert proc.returncode == 0, proc.stderr[-3000:]

    def run(self, *args: str, **env: str) -> subprocess.CompletedProcess:
        return subprocess.run([self.python, *args], capture_output=True, text=True, timeout=180, cwd=self.root,
                              env=self.env(**env))

    def ours(self) -> list:
        """Every file or folder under site-packages whose path names our package or distribution."""
        found = []
        for folder, dirs, files in os.walk(self.site):
            for name in dirs + files:
                path = os.path.relpath(os.path.join(folder, name), self.site)
                if "npu_fsdp_patches" in path.lower().replace("-", "_"):
                    found.append(path)
        return sorted(found)


@pytest.fixture(scope="module")
def parts(tmp_path_factory):
    root = tmp_path_factory.mktemp("uninstall")
    src = root / "src"
    _copy_sources(src)
    return _dependency_links(root / "links"), src


def _installed(tmp_path, parts) -> Venv:
    venv = Venv(tmp_path, *parts)
    venv.pip("install", "-q", "--no-deps", "--no-build-isolation", "--no-compile", str(venv.src))
    assert venv.ours(), "nothing was installed"
    return venv


def _gone(venv: Venv) -> None:
    venv.pip("uninstall", "-y", "-q", "npu-fsdp-patches")
    assert venv.ours() == [], venv.ours()
    assert (venv.site / "someone_else.py").is_file()
    assert not (venv.python.parent / "npu-fsdp-patches").exists()
    probe = venv.run("-c", "import importlib.util, importlib.metadata as m, torch\n"
                     "print(importlib.util.find_spec('npu_fsdp_patches'), 'npu_fsdp_patches' in __import__('sys').modules,\n"
                     "      [d.name for d in m.distributions() if 'npu' in (d.name or '').lower()])\n"
                     "import npu_fsdp_patches")
    assert "ModuleNotFoundError: No module named 'npu_fsdp_patches'" in probe.stderr, probe.stderr[-3000:]
    assert probe.stdout.split() == ["None", "False", "[]"], probe.stdout   # torch imports, autoloads nothing


def test_uninstall_leaves_nothing_after_imports_with_bytecode_on_and_off(tmp_path, parts):
    venv = _installed(tmp_path, parts)
    for env in ({}, {"PYTHONDONTWRITEBYTECODE": "1"}):
        ran = venv.run("-c", IMPORT, **env)
        assert ran.returncode == 0 and ran.stdout.split() == PATCHES, ran.stderr[-3000:]
    written = [p for p in venv.ours() if "__pycache__/" in p]
    assert any(p.endswith(".cpython-%d%d.pyc" % sys.version_info[:2]) for p in written), written  # bytecode was on
    assert not [p for p in written if not p.endswith(".pyc")], written   # nothing of the plugin's own: no .marshal
    assert list((venv.root / "cache" / "npu_fsdp_patches").glob("*.marshal"))   # the cache is in the user's
    _gone(venv)


def test_pycache_prefix_keeps_even_optimized_bytecode_out_of_site_packages(tmp_path, parts):
    """pip removes only the bytecode of its own interpreter's default level (pypa/pip#11835): ``-O``
    bytecode beside the package would outlive uninstall as an importable namespace package. With
    PYTHONPYCACHEPREFIX nothing is written beside it, by CPython or by us."""
    venv = _installed(tmp_path, parts)
    prefix = tmp_path / "pycache"
    ran = venv.run("-O", "-c", IMPORT, PYTHONPYCACHEPREFIX=str(prefix))
    assert ran.returncode == 0 and ran.stdout.split() == PATCHES, ran.stderr[-3000:]
    assert [p for p in venv.ours() if "__pycache__" in p] == []
    ours_in_prefix = [p.name for p in prefix.rglob("*.pyc") if "npu_fsdp_patches" in str(p)]
    assert any(n.endswith(".opt-1.pyc") for n in ours_in_prefix), ours_in_prefix   # bytecode was written
    _gone(venv)
