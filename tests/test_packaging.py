"""Packaging (docs/design.md#2-layout): a fresh venv, a plain checkout on PYTHONPATH, then a non-editable install."""
import ast
import importlib.util
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support import REPO_ROOT, run_python

DEPS = ["wrapt", "packaging", "PyYAML", "importlib-metadata"]


def _copy_sources(dest):
    """Copy the tracked-looking sources (no venvs, caches or build output) preserving symlinks."""
    ignore = shutil.ignore_patterns(".git", ".venv", "venvs", "__pycache__", "*.egg-info", "build", "dist",
                                    ".pytest_cache", "fixtures", "benchmarks", "examples")
    shutil.copytree(REPO_ROOT, dest, symlinks=True, ignore=ignore)


@pytest.fixture(scope="module")
def fresh_venv(tmp_path_factory):
    root = tmp_path_factory.mktemp("pkg")
    venv = root / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    pip = subprocess.run([venv / "bin" / "python", "-m", "pip", "install", "-q", *DEPS],
                         capture_output=True, text=True, timeout=600)
    if pip.returncode != 0:
        pytest.fail(f"installing runtime deps failed:\n{pip.stderr[-3000:]}")
    return root, venv


def test_plain_checkout_then_non_editable_install(fresh_venv):
    root, venv = fresh_venv
    python = venv / "bin" / "python"
    clean_env = {"PATH": "/usr/bin:/bin", "HOME": str(root)}
    probe = ("import json, npu_fsdp_patches as n; from npu_fsdp_patches.plan.loader import builtin_table; "
             "from npu_fsdp_patches.plan.matrix import SHIPPED_MATRIX; "
             "print(json.dumps({'names': sorted(r['name'] for r in n.status()), "
             "'builtins': sorted(builtin_table()), 'matrix': str(SHIPPED_MATRIX.resolve())}))")
    checkout = subprocess.run([python, "-c", probe], capture_output=True, text=True, timeout=120, cwd=root,
                              env={**clean_env, "PYTHONPATH": str(REPO_ROOT)})
    assert checkout.returncode == 0, checkout.stderr
    shipped = ["hp_fp32_main_params", "hp_skip_dispatch_adamw", "te_fused_adam_dtensor",
               "te_fused_adam_empty_group_step", "te_fused_adam_empty_scale", "te_initialize_state_compat",
               "te_multi_tensor_apply_empty_tail"]
    found = json.loads(checkout.stdout)
    assert found["names"] == shipped and found["builtins"] == shipped

    src = root / "src"
    _copy_sources(src)
    install = subprocess.run([python, "-m", "pip", "install", "-q", "--no-deps", str(src)],
                             capture_output=True, text=True, timeout=600)
    assert install.returncode == 0, install.stderr[-3000:]
    shutil.rmtree(src)  # nothing may depend on the source tree any more
    meta = subprocess.run([python, "-c", "import importlib.metadata as m; d = m.distribution('npu-fsdp-patches'); "
                           "import npu_fsdp_patches as n; print(d.version == n.__version__); "
                           "print(d.metadata['License-Expression']); print(*(d.files or []), sep='\\n')"],
                          capture_output=True, text=True, timeout=120, cwd=root, env=clean_env)
    same_version, license_expr, *files = meta.stdout.splitlines()
    assert same_version == "True"  # one home for the version: npu_fsdp_patches.__version__
    assert license_expr == "Apache-2.0"  # SPDX expression, not the deprecated license table
    assert any(f.endswith("licenses/LICENSE") for f in files), files

    doctor = subprocess.run([venv / "bin" / "npu-fsdp-patches", "doctor", "--json"], capture_output=True,
                            text=True, timeout=300, cwd=root, env=clean_env)
    assert doctor.returncode == 0, doctor.stderr
    report = json.loads(doctor.stdout)
    assert sorted(p["name"] for p in report["patches"]) == shipped
    assert "site-packages" in report["plugin"]["matrix"]
    assert report["environment"]["torch"] is None  # no torch in this venv: doctor still works
    installed = subprocess.run([python, "-c", probe], capture_output=True, text=True, timeout=120,
                               cwd=root, env=clean_env)
    assert installed.returncode == 0, installed.stderr
    found = json.loads(installed.stdout)
    assert found["names"] == shipped and found["builtins"] == shipped and "site-packages" in found["matrix"]
    listed = subprocess.run([python, "-m", "npu_fsdp_patches", "list"], capture_output=True, text=True,
                            timeout=120, cwd=root, env=clean_env)
    assert listed.returncode == 0 and len(listed.stdout.splitlines()) == len(shipped)

    # self-test from the wheel alone: torch comes from the test's own site-packages on PYTHONPATH, the
    # plugin (and every rank torchrun starts) from the installed copy; the sources are gone
    torch_site = str(Path(importlib.util.find_spec("torch").origin).parent.parent)
    ran = subprocess.run([venv / "bin" / "npu-fsdp-patches", "self-test", "--device", "cpu", "--only",
                          "foreach_adamw", "--json"], capture_output=True, text=True, timeout=600, cwd=root,
                         env={**clean_env, "PYTHONPATH": torch_site, "OMP_NUM_THREADS": "1"})
    assert ran.returncode == 0, ran.stderr[-4000:]
    assert [(c["name"], c["status"]) for c in json.loads(ran.stdout)["checks"]] == [("foreach_adamw", "passed")]


def test_pyproject_registers_no_builtin_in_the_patch_entry_point_group():
    """The built-ins are derived from patches/ (tests/plan/test_patch_declarations.py); the group is for
    third-party patches only, so no second list of the built-ins can drift."""
    text = (REPO_ROOT / "pyproject.toml").read_text()
    assert '[project.entry-points."npu_fsdp_patches.patches"]' not in text


def test_optim_exports_resolve_lazily_to_their_modules():
    """Every public optim name resolves; importing the package, asking for a name it lacks and
    listing it load no implementation (and no torch)."""
    out = run_python("""
import sys, npu_fsdp_patches.optim as optim
loaded = lambda: sorted(m for m in sys.modules if m.startswith('npu_fsdp_patches.optim.') or m == 'torch')
before = loaded()
missing = hasattr(optim, 'not_a_name') or hasattr(optim, 'fused_adam') or hasattr(optim, '__wrapped__')
listed = set(optim.__all__) <= set(dir(optim))
after_lookups = loaded()
names = {n: getattr(optim, n).__module__ for n in optim.__all__}
print(before, after_lookups, missing, listed, names['build_muon_adamw'], optim.FusedAdam.__name__)
""").stdout.split()
    assert out == ["[]", "[]", "False", "True", "npu_fsdp_patches.optim.muon_routing", "FusedAdam"], out


def test_optim_type_checking_imports_name_every_lazy_export():
    """The package's TYPE_CHECKING imports (what editors and type checkers see) and its lazy
    ``_EXPORTS`` table name the same objects in the same modules."""
    source = (REPO_ROOT / "npu_fsdp_patches" / "optim" / "__init__.py").read_text()
    guarded = next(node for node in ast.parse(source).body
                   if isinstance(node, ast.If) and getattr(node.test, "id", "") == "TYPE_CHECKING")
    imported = {alias.name: node.module for node in guarded.body for alias in node.names}
    table = ast.literal_eval(next(node.value for node in ast.parse(source).body
                                  if isinstance(node, ast.Assign) and node.targets[0].id == "_EXPORTS"))
    assert imported == table
