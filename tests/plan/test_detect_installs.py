"""Detection on the installs clusters really have: legacy egg-info metadata, stale duplicate metadata,
metadata that is not UTF-8, source trees identified by git, MindSpeed's placeholder modules."""
import json
import subprocess

import pytest

from tests.support import run_case, run_python

PKG_INFO = "Metadata-Version: 1.1\nName: transformer_engine\nVersion: 2.11.0\nSummary: x\n"


def _te_package(site):
    (site / "transformer_engine").mkdir(parents=True, exist_ok=True)
    (site / "transformer_engine" / "__init__.py").write_text("raise RuntimeError('must not be imported')\n")
    # the torch extension a source build installs next to it (without it, a transformer-engine
    # distribution is only the meta package)
    (site / "transformer_engine_torch.py").write_text("raise RuntimeError('must not be imported')\n")


def _detect(site, distribution="transformer-engine", framework="transformer_engine"):
    out = run_case("tests.children.detection_cases:detect_like_importlib",
                   args={"distribution": distribution, "framework": framework}, paths=[site])
    assert out["imported"] == [], "detection imported a framework"
    return out


@pytest.mark.parametrize("form", ["egg-info file", "egg-info folder", "bare egg-info folder",
                                  "egg on sys.path"])
def test_legacy_metadata_is_read_as_importlib_metadata_reads_it(tmp_path, form):
    site = tmp_path / "site"
    site.mkdir()
    name = "transformer_engine-2.11.0-py3.11"
    if form == "egg-info file":            # distutils' setup.py install
        (site / f"{name}.egg-info").write_text(PKG_INFO)
    elif form.endswith("egg-info folder"):
        info = site / f"{name}.egg-info"
        info.mkdir()
        (info / "PKG-INFO").write_text(PKG_INFO)
        if form == "egg-info folder":
            (info / "SOURCES.txt").write_text("setup.py\ntransformer_engine/__init__.py\n")
            (info / "top_level.txt").write_text("transformer_engine\n")
    if form == "egg on sys.path":          # easy_install: the .egg folder itself is the sys.path entry
        site = tmp_path / f"{name}.egg"
        (site / "EGG-INFO").mkdir(parents=True)
        (site / "EGG-INFO" / "PKG-INFO").write_text(PKG_INFO)
    _te_package(site)
    out = _detect(site)
    te = out["ours"]
    assert out["importlib"] == "2.11.0"
    assert (te["installed"], te["version"], te["source"], te["flavor"]) == (True, "2.11.0", "metadata", "nvidia")


def test_two_metadata_folders_of_one_package_pick_importlib_metadatas_and_name_both(tmp_path):
    site = tmp_path / "site"
    _te_package(site)
    for version in ("2.13.0", "2.14.0"):    # a stale dist-info left behind by an upgrade
        info = site / f"transformer_engine-{version}.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: transformer_engine\nVersion: {version}\n")
        (info / "RECORD").write_text("transformer_engine/__init__.py,,\n")
    out = _detect(site)
    te = out["ours"]
    assert te["version"] == out["importlib"]
    other = {"2.13.0": "2.14.0", "2.14.0": "2.13.0"}[te["version"]]
    assert "several metadata folders for transformer_engine" in te["note"]
    assert f"transformer_engine-{te['version']}.dist-info ({te['version']}, used" in te["note"]
    assert f"transformer_engine-{other}.dist-info ({other})" in te["note"]


def test_the_same_site_twice_on_sys_path_is_not_a_duplicate(tmp_path):
    site = tmp_path / "site"
    _te_package(site)
    (site / "transformer_engine-2.11.0.dist-info").mkdir()
    (site / "transformer_engine-2.11.0.dist-info" / "METADATA").write_text(PKG_INFO)
    out = run_case("tests.children.detection_cases:detect_like_importlib",
                   args={"distribution": "transformer-engine", "framework": "transformer_engine"},
                   paths=[site, site])
    assert (out["ours"]["version"], out["ours"]["note"]) == ("2.11.0", None)


@pytest.mark.parametrize("autoload", [False, True])
def test_metadata_that_is_not_utf8_is_reported_never_raised(tmp_path, autoload):
    site = tmp_path / "site"
    _te_package(site)
    info = site / "transformer_engine-2.11.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_bytes(PKG_INFO.encode() + b"Author: J\xe9r\xf4me\n\nd\xe9j\xe0 vu\n")
    (info / "RECORD").write_text("transformer_engine/__init__.py,,\n")
    if not autoload:   # torch's own autoload raises on it (importlib.metadata entry_points)
        other = site / "other-1.0.dist-info"        # any distribution: our entry points are read from all
        other.mkdir()
        (other / "METADATA").write_bytes(b"Metadata-Version: 2.1\nName: other\nVersion: 1.0\n")
        (other / "entry_points.txt").write_bytes(b"[console_scripts]\nx = caf\xe9:main\n")
    out = run_case("tests.children.detection_cases:undecodable_metadata", args={"autoload": autoload},
                   paths=[site])
    assert out["autoloaded"] is autoload
    assert {r["name"] for r in out["status"]} >= {"te_fused_adam_dtensor", "te_fused_adam_empty_scale"}
    te = out["te"]
    assert (te["installed"], te["version"]) == (True, "2.11.0")
    assert "METADATA is not UTF-8 (byte e9 at offset" in te["note"] and "replacement characters" in te["note"]
    assert "transformer_engine" in out["doctor_frameworks"]


def test_doctor_cli_survives_undecodable_metadata(tmp_path):
    site = tmp_path / "site"
    _te_package(site)
    (site / "transformer_engine-2.11.0-py3.11.egg-info").write_bytes(PKG_INFO.encode() + b"Author: \xff\n")
    proc = run_python("import sys; from npu_fsdp_patches.cli import main; sys.argv = ['npu-fsdp-patches', "
                      "'doctor', '--json']; main()", paths=[site], check=False)
    assert "Traceback" not in proc.stderr, proc.stderr
    report = json.loads(proc.stdout)
    assert report["frameworks"]["transformer_engine"]["version"] == "2.11.0"


def _git(*args, cwd):
    subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True,
                   env={"GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t",
                        "GIT_COMMITTER_EMAIL": "t@t", "HOME": str(cwd), "PATH": "/usr/bin:/bin"})


def test_a_mindspeed_source_tree_is_identified_by_its_git_branch_and_commit(tmp_path):
    tree = tmp_path / "MindSpeed"
    (tree / "mindspeed").mkdir(parents=True)
    (tree / "mindspeed" / "__init__.py").write_text("raise RuntimeError('must not be imported')\n")
    (tree / "setup.py").write_text("__version__ = '0.12.1'\n")
    _git("init", "-q", "-b", "core_r0.18.0", cwd=tree)
    _git("add", ".", cwd=tree)
    _git("commit", "-q", "-m", "x", cwd=tree)
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=tree, capture_output=True, text=True).stdout.strip()
    ms = _detect(tree, "mindspeed", "mindspeed")["ours"]
    assert (ms["version"], ms["source_id"]) == ("0.12.1", f"git {commit} (branch core_r0.18.0)")
    _git("pack-refs", "--all", cwd=tree)             # refs packed: read from packed-refs
    _git("checkout", "-q", "--detach", cwd=tree)
    assert _detect(tree, "mindspeed", "mindspeed")["ours"]["source_id"] == f"git {commit} (detached HEAD)"


def test_an_install_from_a_vcs_url_is_identified_by_its_direct_url(tmp_path):
    site = tmp_path / "site"
    (site / "mindspeed").mkdir(parents=True)
    (site / "mindspeed" / "__init__.py").write_text("")
    info = site / "mindspeed-0.12.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: mindspeed\nVersion: 0.12.1\n")
    (info / "direct_url.json").write_text(json.dumps({
        "url": "https://gitcode.com/Ascend/MindSpeed.git",
        "vcs_info": {"vcs": "git", "commit_id": "4213c913", "requested_revision": "core_r0.18.0"}}))
    ms = _detect(site, "mindspeed", "mindspeed")["ours"]
    assert ms["source_id"] == "git+https://gitcode.com/Ascend/MindSpeed.git 4213c913 (requested core_r0.18.0)"
