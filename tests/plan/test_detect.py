"""Detection from metadata and files, never by importing the frameworks."""
import json
from pathlib import Path

from tests.support import make_dist, run_python


DETECT = """
import importlib.metadata, json, sys
{prelude}
import npu_fsdp_patches
found = npu_fsdp_patches.detect()
print(json.dumps({{"found": found, "imported": sorted(m for m in ("transformer_engine", "megatron",
    "torch_npu", "hyper_parallel", "torch") if m in sys.modules)}}))
"""


def detect(paths, prelude="", env=None):
    import json
    proc = run_python(DETECT.format(prelude=prelude), paths=paths, env=env)
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["imported"] == [], "detection imported a framework"
    return out["found"]


def test_te_flavors_and_the_rule_that_decided(tmp_path):
    npu, nv, shipped = tmp_path / "npu", tmp_path / "nv", tmp_path / "shipped"
    make_dist(npu, "transformer_engine_npu", "2.2.0", {"transformer_engine/__init__.py": ""})
    make_dist(nv, "transformer_engine", "2.11.0", {"transformer_engine/__init__.py": ""})
    make_dist(nv, "transformer_engine_torch", "2.11.0", {"transformer_engine_torch.py": ""})
    make_dist(shipped, "transformer-engine", "2.5.0",
              {"transformer_engine/__init__.py": "", "transformer_engine_npu/__init__.py": ""},
              top_level="transformer_engine\ntransformer_engine_npu")
    te = detect([npu])["transformer_engine"]
    assert (te["version"], te["flavor"], te["source"]) == ("2.2.0", "npu", "metadata")
    assert te["flavor_rule"].startswith("rule 0: distribution name 'transformer_engine_npu' matches")
    te = detect([nv])["transformer_engine"]
    assert (te["version"], te["flavor"], te["flavor_rule"]) == ("2.11.0", "nvidia", "rule 2: default")
    te = detect([shipped])["transformer_engine"]
    assert (te["flavor"], te["flavor_rule"]) == ("npu", "rule 1: module 'transformer_engine_npu' is installed")


def test_immune_to_mindspeed_patched_metadata_version(tmp_path):
    make_dist(tmp_path, "transformer_engine", "2.11.0", {"transformer_engine/__init__.py": ""})
    make_dist(tmp_path, "transformer_engine_torch", "2.11.0", {"transformer_engine_torch.py": ""})
    prelude = "importlib.metadata.version = lambda name: '2.2.0'  # what MindSpeed does"
    assert detect([tmp_path], prelude)["transformer_engine"]["version"] == "2.11.0"


def test_megatron_source_checkout_read_statically(tmp_path):
    pkg = tmp_path / "megatron" / "core"
    pkg.mkdir(parents=True)
    (tmp_path / "megatron" / "__init__.py").write_text("raise RuntimeError('must not be imported')\n")
    (pkg / "__init__.py").write_text("raise RuntimeError('must not be imported')\n")
    (pkg / "package_info.py").write_text("MAJOR = 0\nMINOR = 18\nPATCH = 0\nPRE_RELEASE = 'rc1'\n")
    mc = detect([tmp_path])["megatron_core"]
    assert mc["version"] == "0.18.0rc1" and mc["source"] == "source-tree version file"
    assert mc["location"] == str(tmp_path / "megatron" / "core")


def test_hyper_parallel_commit_id_and_veomni(tmp_path):
    make_dist(tmp_path, "hyper_parallel", "0.1.0", {"hyper_parallel/__init__.py": "",
                                                     "hyper_parallel/.commit_id": "fdd0a808423ac220\n"})
    make_dist(tmp_path, "veomni", "0.1.12", {"veomni/__init__.py": ""})
    found = detect([tmp_path])
    assert (found["hyper_parallel"]["version"], found["hyper_parallel"]["commit"]) == ("0.1.0", "fdd0a808423ac220")
    assert found["veomni"]["version"] == "0.1.12"
    assert found["mindspeed"] == {"name": "mindspeed", "installed": False, "distribution": None, "version": None,
                                  "location": None, "source": "not found", "flavor": None,
                                  "flavor_rule": None, "commit": None, "note": None, "source_id": None}


def test_uninportable_torch_npu_is_detected_without_import(tmp_path):
    make_dist(tmp_path, "torch_npu", "2.8.0.post2",
              {"torch_npu/__init__.py": "raise ImportError('libascendcl.so: cannot open shared object file')\n"})
    npu = detect([tmp_path])["torch_npu"]
    assert (npu["installed"], npu["version"]) == (True, "2.8.0.post2")


def detect_without_site_packages(tmp_path, paths):
    """detect() in an interpreter without site-packages (the test venv has megatron-core installed):
    only ``paths``, the plugin checkout and its two import-time dependencies are importable."""
    import subprocess
    import sys

    import packaging
    import yaml
    from tests.support import REPO_ROOT
    deps = tmp_path / "deps"
    if not deps.exists():
        deps.mkdir()
        for module in (yaml, packaging):
            (deps / module.__name__).symlink_to(Path(module.__file__).parent)
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": ":".join(map(str, [*paths, deps, REPO_ROOT]))}
    proc = subprocess.run([sys.executable, "-S", "-c", DETECT.format(prelude="")], capture_output=True,
                          text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["imported"] == [], "detection imported a framework"
    return out["found"]


def test_megatron_energon_alone_is_not_megatron_core_and_the_namespace_is_searched_everywhere(tmp_path):
    energon, core = tmp_path / "energon", tmp_path / "core_checkout"
    make_dist(energon, "megatron_energon", "7.2.0", {"megatron/energon/__init__.py": ""})   # namespace megatron
    assert detect_without_site_packages(tmp_path, [energon])["megatron_core"]["installed"] is False
    (core / "megatron" / "core").mkdir(parents=True)   # a second location of the namespace, no metadata
    (core / "megatron" / "core" / "__init__.py").write_text("raise RuntimeError('must not be imported')\n")
    (core / "megatron" / "core" / "package_info.py").write_text("MAJOR = 0\nMINOR = 16\nPATCH = 1\n")
    mc = detect_without_site_packages(tmp_path, [energon, core])["megatron_core"]
    assert (mc["installed"], mc["version"], mc["location"]) == (True, "0.16.1", str(core / "megatron" / "core"))


# The files of the registry's transformer-engine 2.13.0 wheel (181 in all): TE's whole Python
# package, without the torch extension transformer_engine_torch (a distribution of its own).
META_FILES = {"transformer_engine/__init__.py": "raise RuntimeError('must not be imported')\n",
              "transformer_engine/common/__init__.py": "",
              "transformer_engine/pytorch/__init__.py": "",
              "transformer_engine/pytorch/optimizers/fused_adam.py": ""}


def test_transformer_engine_meta_package_with_its_python_files_but_no_torch_extension(tmp_path):
    make_dist(tmp_path, "transformer_engine", "2.11.0", META_FILES)
    make_dist(tmp_path, "transformer_engine_cu12", "2.11.0", {"transformer_engine/libtransformer_engine.so": ""})
    te = detect([tmp_path])["transformer_engine"]
    assert (te["installed"], te["version"], te["source"]) == (False, "2.11.0", "meta package only")
    assert te["note"] == ("transformer_engine 2.11.0 is only the meta package: transformer-engine-torch or "
                          "transformer-engine-npu is not installed, so the framework cannot be imported")
    make_dist(tmp_path, "transformer_engine_torch", "2.11.0", {"transformer_engine_torch.py": ""})
    te = detect([tmp_path])["transformer_engine"]
    assert (te["installed"], te["version"], te["flavor"]) == (True, "2.11.0", "nvidia")


def test_transformer_engine_source_build_ships_its_extension_among_its_own_files(tmp_path):
    make_dist(tmp_path, "transformer_engine", "2.12.0",
              {**META_FILES, "transformer_engine/transformer_engine_torch.cpython-311-x86_64-linux-gnu.so": ""})
    te = detect([tmp_path])["transformer_engine"]
    assert (te["installed"], te["source"], te["flavor"]) == (True, "metadata", "nvidia")


def test_transformer_engine_tree_without_metadata_has_an_unknown_flavour_and_a_warning(tmp_path):
    (tmp_path / "transformer_engine").mkdir()
    (tmp_path / "transformer_engine" / "__init__.py").write_text("")
    proc = run_python("""
import json, npu_fsdp_patches
from npu_fsdp_patches.cli.doctor import collect
r = {x["name"]: x for x in npu_fsdp_patches.status()}
print(json.dumps([npu_fsdp_patches.detect()["transformer_engine"], r["te_fused_adam_dtensor"]["reason"]]))
""", paths=[tmp_path])
    te, reason = json.loads(proc.stdout.splitlines()[-1])
    assert (te["installed"], te["flavor"], te["flavor_rule"]) == (True, None, "no distribution metadata: flavour unknown")
    assert te["note"].startswith("flavour unknown: no distribution metadata for ")
    assert "flavour unknown, not npu" in reason


def test_mindspeed_version_comes_from_its_source_tree_setup_py(tmp_path):
    tree = tmp_path / "MindSpeed"
    (tree / "mindspeed").mkdir(parents=True)
    (tree / "mindspeed" / "__init__.py").write_text("raise RuntimeError('must not be imported')\n")
    (tree / "setup.py").write_text("import setuptools\n__version__ = '0.12.1'\n"
                                   "setuptools.setup(name='mindspeed', version=__version__)\n")
    ms = detect([tree])["mindspeed"]
    assert (ms["installed"], ms["version"], ms["source"]) == (True, "0.12.1", "source-tree version file")
