"""doctor --import and report on frameworks that are installed but cannot be imported, and on what decides
detection (issue 41), with the shipped matrix, through the real CLI in fresh interpreters.

The broken frameworks are small distributions with real .dist-info metadata whose module raises what the
real one raised in the issue's trials: veomni 0.1.12 with the registry's torchvision (`operator
torchvision::nms does not exist`), and the same kind of failure for Megatron-Core, MindSpeed and
hyper-parallel, none of which any enabled patch gates on here (so only --import imports them)."""
import json
import subprocess
import sys
from pathlib import Path

from tests.support import make_dist, run_python

CLI = "import sys; from npu_fsdp_patches.cli import main; sys.exit(main(sys.argv[1:]))"
NMS = "operator torchvision::nms does not exist"


def _cli(paths, *args, env=None):
    return run_python(f"import sys; sys.argv[1:] = {list(args)!r}\n" + CLI, paths=paths, env=env, check=False)


def _broken_site(tmp_path: Path) -> Path:
    site = tmp_path / "site"
    make_dist(site, "veomni", "0.1.12", {"veomni/__init__.py": f"raise RuntimeError({NMS!r})\n"})
    make_dist(site, "transformers", "5.24.0", {"transformers/__init__.py": ""})
    make_dist(site, "torchvision", "0.28.0", {"torchvision/__init__.py": ""})
    make_dist(site, "mindspeed", "0.12.1", {"mindspeed/__init__.py": "import mindspeed_missing_dep_xyz\n"})
    make_dist(site, "megatron-core", "0.16.1", {"megatron/core/__init__.py": "raise ImportError('apex_C')\n"},
              top_level="megatron")
    return site


def test_doctor_import_names_each_framework_that_cannot_be_imported(tmp_path):
    site = _broken_site(tmp_path)
    plain = json.loads(_cli([site], "doctor", "--json").stdout)
    # without --import, a framework no enabled patch gates on is read from its metadata only
    assert plain["frameworks"]["veomni"]["importable"] is None and plain["exit_code"] == 0, plain["errors"]
    proc = _cli([site], "doctor", "--json", "--import")
    report = json.loads(proc.stdout)
    fws = report["frameworks"]
    assert (fws["veomni"]["importable"], fws["veomni"]["import_error"]) == (False, f"RuntimeError: {NMS}")
    assert fws["veomni"]["depends_on"] == {"transformers": "5.24.0", "torchvision": "0.28.0", "timm": None}
    assert fws["mindspeed"]["import_error"] == "ModuleNotFoundError: No module named 'mindspeed_missing_dep_xyz'"
    assert fws["megatron_core"]["import_error"] == "ImportError: apex_C"
    assert fws["torch"]["importable"] is True            # torch's own probe, in the same section
    errors = {e.split(":")[0]: e for e in report["errors"]}
    assert set(errors) == {"veomni", "mindspeed", "megatron_core"}, report["errors"]
    assert errors["veomni"].startswith(f"veomni: veomni 0.1.12 is installed but not importable: RuntimeError: {NMS}. "
                                       "No patch that needs it can apply; a job that imports it fails the same "
                                       "way. Next step: make `import veomni` work in this Python (what it "
                                       "depends on, here: transformers 5.24.0, torchvision 0.28.0, timm not "
                                       "installed)"), errors["veomni"]
    assert proc.returncode == report["exit_code"] == 1
    text = _cli([site], "doctor", "--import").stdout
    assert "veomni              0.1.12" in text and "installed but not importable (see Errors)" in text


def _hyper_checkout(tmp_path: Path, body: str = "") -> Path:
    """A hyper-parallel source checkout as the public one is used: on PYTHONPATH, no metadata, setup.py's
    version, a .git folder on a branch."""
    root = tmp_path / "hyper-parallel"
    (root / "hyper_parallel").mkdir(parents=True)
    (root / "hyper_parallel" / "__init__.py").write_text(body)
    (root / "setup.py").write_text("from setuptools import setup\nsetup(name='hyper_parallel', version='0.1.0')\n")
    (root / ".git" / "refs" / "heads").mkdir(parents=True)
    (root / ".git" / "HEAD").write_text("ref: refs/heads/master\n")
    (root / ".git" / "refs" / "heads" / "master").write_text("fdd0a808423ac220f66a5009fdd827429b6fb82f\n")
    return root


def test_report_sections_agree_on_a_source_checkout_and_record_what_decides_detection(tmp_path):
    root = _hyper_checkout(tmp_path)
    out = tmp_path / "rep"
    proc = run_python(f"import sys; sys.argv[1:] = ['report', '--no-self-test', '-o', {str(out)!r}]\n" + CLI,
                      paths=[root], env={"HYPER_PARALLEL_PLATFORM": "torch"}, check=False, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads(out.with_suffix(".json").read_text())
    assert (data["schema"], data["schema_version"]) == ("npu-fsdp-patches/report", 2)
    fw, row = data["doctor"]["frameworks"]["hyper_parallel"], data["packages"]["hyper-parallel"]
    assert (fw["version"], fw["source"], fw["importable"]) == ("0.1.0", "source-tree version file", True)
    assert (row["version"], row["found"], row["location"], row["importable"]) == (
        "0.1.0", "source-tree version file", fw["location"], True)
    assert fw["source_id"] == "git fdd0a808423ac220f66a5009fdd827429b6fb82f (branch master)"
    detection = data["doctor"]["environment"]["detection"]
    assert detection["pythonpath"][0] == {"path": str(root), "exists": True,
                                          "git": "git fdd0a808423ac220f66a5009fdd827429b6fb82f (branch master)"}
    assert detection["variables"] == {"HYPER_PARALLEL_PLATFORM": "torch"}
    assert data["packages"]["mindspore"]["needed_by"] == ["hyper_parallel"]
    md = out.with_suffix(".md").read_text()
    assert f"| hyper-parallel | 0.1.0 | source-tree version file: {fw['location']} | framework hyper_parallel, " \
           "imports |" in md
    assert "| HYPER_PARALLEL_PLATFORM | torch |" in md and f"| PYTHONPATH[0] | {root} (git fdd0a808" in md
    # no warning that hyper-parallel's version is unknown and unverified: setup.py names it
    assert not [w for w in data["doctor"]["warnings"] if "unknown version" in w], data["doctor"]["warnings"]


def test_report_lists_the_packages_that_broke_a_framework(tmp_path):
    site = _broken_site(tmp_path)
    out = tmp_path / "rep"
    proc = run_python(f"import sys; sys.argv[1:] = ['report', '--no-self-test', '-o', {str(out)!r}]\n" + CLI,
                      paths=[site], check=False, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    packages = json.loads(out.with_suffix(".json").read_text())["packages"]
    assert packages["veomni"]["importable"] is False and packages["veomni"]["import_error"] == f"RuntimeError: {NMS}"
    assert (packages["transformers"]["version"], packages["transformers"]["needed_by"]) == ("5.24.0", ["veomni"])
    assert packages["timm"]["found"] == "not found"
    assert "| veomni | 0.1.12 | metadata | framework veomni, **does not import** (see Doctor) |" in \
        out.with_suffix(".md").read_text()
