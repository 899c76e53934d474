"""Detection from metadata and files, never by importing the frameworks."""
from pathlib import Path

from tests.support import run_python


def make_dist(site: Path, name: str, version: str, modules: dict, top_level: str | None = None) -> None:
    """Write a minimal installed distribution: .dist-info with METADATA plus module files."""
    info = site / f"{name}-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    (info / "RECORD").write_text("")
    if top_level:
        (info / "top_level.txt").write_text(top_level + "\n")
    for rel, text in modules.items():
        path = site / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


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
    assert mc["location"] == str(tmp_path / "megatron")


def test_hyper_parallel_commit_id_and_veomni(tmp_path):
    make_dist(tmp_path, "hyper_parallel", "0.1.0", {"hyper_parallel/__init__.py": "",
                                                     "hyper_parallel/.commit_id": "fdd0a808423ac220\n"})
    make_dist(tmp_path, "veomni", "0.1.12", {"veomni/__init__.py": ""})
    found = detect([tmp_path])
    assert (found["hyper_parallel"]["version"], found["hyper_parallel"]["commit"]) == ("0.1.0", "fdd0a808423ac220")
    assert found["veomni"]["version"] == "0.1.12"
    assert found["mindspeed"] == {"name": "mindspeed", "installed": False, "distribution": None, "version": None,
                                  "location": None, "source": "not found", "flavor": None,
                                  "flavor_rule": None, "commit": None, "note": None}


def test_uninportable_torch_npu_is_detected_without_import(tmp_path):
    make_dist(tmp_path, "torch_npu", "2.8.0.post2",
              {"torch_npu/__init__.py": "raise ImportError('libascendcl.so: cannot open shared object file')\n"})
    npu = detect([tmp_path])["torch_npu"]
    assert (npu["installed"], npu["version"]) == (True, "2.8.0.post2")
