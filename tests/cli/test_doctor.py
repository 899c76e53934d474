"""doctor text/JSON, exit codes, explain and list, through the real CLI in fresh interpreters."""
import json
import os
import subprocess
import sys
from pathlib import Path

from tests.core_demo import demo_env
from tests.support import REPO_ROOT, install_fixture, make_dist, run_python


def cli(tmp_path, *args, matrix="demo_matrix.yaml", extra_paths=(), **env):
    site = install_fixture("core_demo", tmp_path)
    code = "import sys; from npu_fsdp_patches.cli import main; sys.exit(main(sys.argv[1:]))"
    child_env = demo_env(site, matrix, **env)
    proc = run_python(f"import sys; sys.argv[1:] = {list(args)!r}\n" + code,
                      paths=[site, *extra_paths], env=child_env, check=False)
    return proc


def test_doctor_json_healthy_schema_and_exit_0(tmp_path):
    proc = cli(tmp_path, "doctor", "--json")
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert (report["schema"], report["schema_version"], report["exit_code"]) == ("npu-fsdp-patches/doctor", 1, 0)
    assert set(report) == {"schema", "schema_version", "plugin", "environment", "frameworks", "patches",
                           "errors", "warnings", "self_test", "exit_code", "late_detections"}
    assert report["errors"] == []
    assert report["environment"]["device"] == "cpu" and report["environment"]["torch"].startswith("2.")
    assert report["frameworks"]["demo"]["version"] == "1.2.0"
    shout = next(p for p in report["patches"] if p["name"] == "demo_shout")
    assert (shout["decision"], shout["state"], shout["verified"]) == ("enabled", "pending", True)
    assert shout["reason"] == "demo-framework 1.2.0 matches >=1.0"


def test_doctor_names_misspelled_variables_and_suggests_patch_names(tmp_path):
    proc = cli(tmp_path, "doctor", "--json", NPU_FSDP_PATCHES_DISABLED="demo_shout",
               NPU_FSDP_PATCHES_DISABLE="demo_shuot")
    warnings = json.loads(proc.stdout)["warnings"]
    assert any("NPU_FSDP_PATCHES_DISABLED" in w and "did you mean NPU_FSDP_PATCHES_DISABLE?" in w
               for w in warnings), warnings
    assert any("demo_shuot (did you mean demo_shout?)" in w and "known patches:" in w for w in warnings), warnings


def test_doctor_import_applies_and_reports_failures_with_exit_1(tmp_path):
    proc = cli(tmp_path, "doctor", "--json", "--import", matrix="demo_matrix_failing.yaml")
    assert proc.returncode == 1
    states = {p["name"]: [p["state"], p["error"]] for p in json.loads(proc.stdout)["patches"]}
    assert states["demo_shout"] == ["applied", None]
    assert states["demo_boom"] == ["failed", "RuntimeError: boom from demo_boom"]
    assert states["demo_missing"] == ["failed", "target not found: demo_target:Engine.vanished"]


def test_doctor_bad_configuration_exit_2_in_text_and_json(tmp_path):
    proc = cli(tmp_path, "doctor", NPU_FSDP_PATCHES_STRICT="chatty")
    assert proc.returncode == 2
    assert "INACTIVE: NPU_FSDP_PATCHES_STRICT='chatty' is not valid" in proc.stdout
    bad = tmp_path / "bad.yaml"
    bad.write_text("schema_version: 1\nframeworks: {}\npatches: [\n")
    proc = cli(tmp_path, "doctor", "--json", NPU_FSDP_PATCHES_MATRIX=str(bad))
    report = json.loads(proc.stdout)
    assert proc.returncode == 2 and report["exit_code"] == 2
    assert report["plugin"]["config_error"].startswith(f"{bad}:")


def test_doctor_text_fits_100_columns_with_one_line_per_patch(tmp_path):
    proc = cli(tmp_path, "doctor", NPU_FSDP_PATCHES_MATRIX_UNUSED="x")
    assert proc.returncode == 0
    lines = proc.stdout.splitlines()
    assert max(len(line) for line in lines) <= 100
    start = lines.index(next(line for line in lines if line.startswith("Patches (matrix")))
    header = next(i for i in range(start, len(lines)) if lines[i].split() == ["patch", "decision", "state", "reason"])
    matrix = "".join(line.strip() for line in lines[start:header])   # on the title, else whole below it
    assert str(tmp_path) in matrix and matrix.endswith("demo_matrix.yaml") and "…" not in matrix, matrix
    patch_lines = lines[header + 1:lines.index("", header)]
    assert [line.split()[0] for line in patch_lines] == ["demo_shout", "demo_child", "demo_gated_off", "demo_absent"]
    assert "  demo_gated_off disabled  disabled   demo-framework 1.2.0 does not match <1.0" in lines
    assert lines[lines.index("Frameworks") + 1].split() == ["name", "version", "source", "location"]
    assert lines[-1] == "Summary: 2 disabled, 2 pending; exit code 0"


def test_doctor_warns_unverified_and_stale_references(demo_site):
    code = """
import demo_target, demo_target.extra
import npu_fsdp_patches
npu_fsdp_patches.apply("demo_child")
from npu_fsdp_patches.cli.doctor import collect
import json; print(json.dumps(collect()["warnings"]))
"""
    proc = run_python(code, paths=[demo_site], env=demo_env(demo_site))
    warnings = json.loads(proc.stdout.splitlines()[-1])
    assert "demo_shout: demo_target was imported before npu_fsdp_patches activated; stale references " \
           "to the unpatched objects in: demo_target.extra" in warnings
    assert "demo_child: demo-framework 1.2.0 in range but not verified by the test suite" in warnings


def test_doctor_import_reports_unimportable_torch_npu(tmp_path):
    fake = tmp_path / "fake_npu"
    make_dist(fake, "torch_npu", "2.8.0.post2",
              {"torch_npu/__init__.py": "raise ImportError('libascendcl.so: cannot open shared object file')\n"})
    for args in (("doctor", "--json"), ("doctor", "--json", "--import")):
        proc = cli(tmp_path, *args, extra_paths=[fake])
        report = json.loads(proc.stdout)
        assert report["environment"]["torch_npu"] == {
            "installed": True, "version": "2.8.0.post2", "importable": False,
            "import_error": "ImportError: libascendcl.so: cannot open shared object file"}, args
        assert proc.returncode == 1 and report["exit_code"] == 1, args


def _broken_npu_sites(tmp_path):
    """The torch_npu-without-CANN stand-in plus hyper-parallel, whose patch targets import torch."""
    return [install_fixture("torch_npu_broken", tmp_path), install_fixture("hyper_parallel_new", tmp_path)]


def test_doctor_with_torch_npu_but_no_cann_never_crashes_and_says_what_to_do(tmp_path):
    sites = _broken_npu_sites(tmp_path)
    for args in (("doctor", "--json", "--import"), ("doctor",)):
        proc = cli(tmp_path, *args, extra_paths=sites, NPU_FSDP_PATCHES_MATRIX="")
        assert proc.returncode == 1, (args, proc.returncode, proc.stderr[-2000:])
        if "--json" not in args:
            assert "Errors\n  - torch_npu 2.8.0.post2 is installed but cannot be imported: ImportError: " \
                   "libhccl.so" in proc.stdout
            continue
        report = json.loads(proc.stdout)
        env = report["environment"]
        assert env["torch"].startswith("2.") and env["device"] is None
        assert env["torch_npu"]["importable"] is False
        assert env["torch_npu"]["import_error"] == ("ImportError: libhccl.so: cannot open shared object file: "
                                                    "No such file or directory")
        # the device probe ran with the user's environment: torch's autoload tried torch_npu there
        assert "Failed to load the backend extension: torch_npu" in env["device_error"]
        assert "libhccl.so" in report["errors"][0] and "set_env.sh" in report["errors"][0]
        states = {p["name"]: p["state"] for p in report["patches"]}
        assert states["hp_skip_dispatch_adamw"] != "applied"  # never claimed in a process without torch
        assert report["errors"][1].startswith("patch targets not imported: `import torch` fails")


def test_probe_children_get_the_autoload_switch_the_process_started_with(tmp_path):
    code = """
import os
import npu_fsdp_patches.cli.doctor as doctor
os.environ["TORCH_DEVICE_BACKEND_AUTOLOAD"] = "0"     # what a failed torch_npu import leaves behind
print(doctor.user_environment().get("TORCH_DEVICE_BACKEND_AUTOLOAD"))
"""
    assert run_python(code).stdout.split() == ["None"]
    assert run_python(code, env={"TORCH_DEVICE_BACKEND_AUTOLOAD": "1"}).stdout.split() == ["1"]


def test_explain_and_list(tmp_path):
    proc = cli(tmp_path, "explain", "demo_shout")
    assert proc.returncode == 0
    out = proc.stdout
    assert out.startswith("demo_shout: append ! to greet and scale Engine.run\n")
    assert "  [1] yes demo >=1.0: demo-framework 1.2.0 matches >=1.0" in out
    assert "  demo_target:Engine.gone?" in out
    assert "Appends '!' to greet() and multiplies Engine.run by 10." in out
    assert "Upstream fix: demo commit abc123" in out and "Upstream issues: demo#1" in out
    assert max(len(line) for line in out.splitlines()) <= 100
    proc = cli(tmp_path, "explain", "nope")
    assert proc.returncode == 2 and "unknown patch 'nope'" in proc.stderr
    lines = cli(tmp_path, "list").stdout.splitlines()
    assert [line.split()[:2] for line in lines] == [["demo_shout", "enabled"], ["demo_child", "enabled"],
                                                   ["demo_gated_off", "disabled"], ["demo_absent", "disabled"]]


def test_python_dash_m_entry(demo_site):
    site = demo_site
    proc = subprocess.run([sys.executable, "-m", "npu_fsdp_patches", "list"], capture_output=True, text=True,
                          env={**demo_env(site), "PYTHONPATH": str(site), "PATH": "/usr/bin:/bin"}, timeout=120)
    assert proc.returncode == 0 and proc.stdout.startswith("demo_shout")


def test_doctor_self_test_passes_and_a_broken_step_gives_exit_1(demo_site):
    code = """
import json, sys
from npu_fsdp_patches.cli import main
import os
if {broken}:   # the self-test engine's negative control: one element one ulp off
    os.environ["NPU_FSDP_PATCHES_SELF_TEST_PLANT"] = "adamw_step"
rc = main(["doctor", "--json", "--self-test"])
print("RC", rc)
"""
    site = demo_site
    for broken, expected in ((False, 0), (True, 1)):
        proc = run_python(code.format(broken=broken), paths=[site], env=demo_env(site))
        rc_line = proc.stdout.strip().splitlines()[-1]
        report = json.loads(proc.stdout[:proc.stdout.rindex("RC ")])
        assert rc_line == f"RC {expected}"
        assert report["self_test"]["passed"] is (not broken)
        assert report["self_test"]["dtypes"]["bfloat16"]["passed"] is (not broken)


def test_explain_every_shipped_patch_fits_100_columns():
    code = """
import contextlib, io, json
from npu_fsdp_patches.cli import main
out = {}
from npu_fsdp_patches.plan.matrix import SHIPPED_MATRIX, load_matrix
for name in load_matrix(SHIPPED_MATRIX).patches:
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        rc = main(["explain", name])
    out[name] = [rc, buf.getvalue()]
print(json.dumps(out))
"""
    out = json.loads(run_python(code).stdout.splitlines()[-1])
    for name, (rc, text) in out.items():
        assert rc == 0, name
        assert "What it changes:" in text and "Upstream " in text and "Facts: " in text, name
        assert max(len(line) for line in text.splitlines()) <= 100, name


def test_doctor_shows_each_patch_provenance(tmp_path):
    proc = cli(tmp_path, "doctor")
    lines = proc.stdout.splitlines()
    start = lines.index("Patch code:")
    assert lines[start + 1] == "  demo_shout     demo-patches 0.1.0 entry point demo_patches:Shout"
    report = json.loads(cli(tmp_path, "doctor", "--json").stdout)
    assert report["patches"][0]["provenance"] == {"value": "demo_patches:Shout", "distribution": "demo-patches",
                                                  "version": "0.1.0", "builtin": False}


def _entry(tmp_path, entry, *args, **env):
    """Run the real console script or ``python -m npu_fsdp_patches`` (how users start the CLI)."""
    import os
    from pathlib import Path
    site = install_fixture("core_demo", tmp_path)
    start = ([str(Path(sys.executable).parent / "npu-fsdp-patches")] if entry == "script"
             else [sys.executable, "-m", "npu_fsdp_patches"])
    child_env = {k: v for k, v in os.environ.items() if not k.startswith("NPU_FSDP_PATCHES")}
    child_env.update(demo_env(site), PYTHONPATH=str(site), **env)
    return subprocess.run(start + list(args), capture_output=True, text=True, env=child_env, timeout=300)


def test_strict_mode_with_a_config_error_gives_exit_2_and_complete_json_for_every_command(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("schema_version: [\n")
    for entry, args, env in (("script", ("doctor", "--json"), {"NPU_FSDP_PATCHES_DISABLE": "a;b"}),
                             ("module", ("list", "--json"), {"NPU_FSDP_PATCHES_MATRIX": str(bad)}),
                             ("script", ("explain", "demo_shout", "--json"), {"NPU_FSDP_PATCHES_MATRIX": str(bad)})):
        proc = _entry(tmp_path, entry, *args, NPU_FSDP_PATCHES_STRICT="1", **env)
        assert proc.returncode == 2, (entry, args, proc.stderr[-2000:])
        assert "Traceback" not in proc.stderr
        report = json.loads(proc.stdout)
        assert report["exit_code"] == 2 and report["plugin"]["strict"] is True
        expected = "NPU_FSDP_PATCHES_DISABLE='a;b'" if "NPU_FSDP_PATCHES_DISABLE" in env else f"{bad}:2: YAML error"
        assert report["plugin"]["config_error"].startswith(expected), report["plugin"]
    proc = _entry(tmp_path, "module", "list", NPU_FSDP_PATCHES_STRICT="1", NPU_FSDP_PATCHES_MATRIX=str(bad))
    assert proc.returncode == 2 and proc.stderr.strip().endswith("YAML error: did not find expected node content")
    healthy = json.loads(_entry(tmp_path, "module", "list", "--json").stdout)
    assert healthy["exit_code"] == 0 and [p["name"] for p in healthy["patches"]][0] == "demo_shout"


def test_version_and_help_without_rst_markup(tmp_path):
    proc = _entry(tmp_path, "script", "--version")
    assert (proc.returncode, proc.stdout.strip()) == (0, "npu-fsdp-patches 0.1.0")
    proc = _entry(tmp_path, "module", "-h")
    assert proc.returncode == 0 and "``" not in proc.stdout and "--version" in proc.stdout
    assert "NPU_FSDP_PATCHES_DISABLE   comma list of patch names, or *: never apply these" in proc.stdout


def test_doctor_wraps_long_warnings_instead_of_cutting_them_and_prints_each_once():
    from npu_fsdp_patches.cli.render import doctor_text
    long_error = "import x: RuntimeError: " + "word " * 40 + "THE-END"
    report = {"plugin": {"version": "0", "matrix": "m.yaml", "config_error": None},
              "environment": {"python": "3", "platform": "p", "torch": "2", "device": "cpu", "device_error": None,
                              "torch_npu": {"installed": False}},
              "frameworks": {}, "patches": [], "errors": [], "warnings": [long_error, long_error], "exit_code": 0}
    lines = doctor_text(report).splitlines()
    assert max(len(line) for line in lines) <= 100
    assert sum(line.startswith("  - import x") for line in lines) == 1
    assert "THE-END" in "".join(lines) and not any(line.endswith("…") for line in lines)


def test_doctor_text_says_unknown_version_instead_of_none():
    from npu_fsdp_patches.cli.render import doctor_text
    fw = {"installed": True, "version": None, "flavor": None, "commit": None, "source": "find_spec (no version found)",
          "location": "/x/megatron/core", "distribution": None}
    report = {"plugin": {"version": "0", "matrix": "m.yaml", "config_error": None},
              "environment": {"python": "3", "platform": "p", "torch": "2", "device": "cpu", "device_error": None,
                              "torch_npu": {"installed": False}},
              "frameworks": {"megatron_core": fw}, "patches": [], "errors": [], "warnings": [], "exit_code": 0}
    line = next(x for x in doctor_text(report).splitlines() if x.startswith("  megatron_core"))
    assert "None" not in line and "unknown version" in line


def _report(**over):
    """A doctor report dict for render tests (the shape collect() returns)."""
    report = {"plugin": {"version": "0", "matrix": "m.yaml", "config_error": None},
              "environment": {"python": "3", "platform": "p", "torch": "2.13.0", "device": "cpu",
                              "device_error": None, "torch_npu": {"installed": False}},
              "frameworks": {}, "patches": [], "errors": [], "warnings": [], "exit_code": 0}
    report.update(over)
    return report


def _record(name, reason, provenance=None):
    return {"name": name, "decision": "disabled", "state": "disabled", "reason": reason, "error": None,
            "note": None, "provenance": provenance or {"value": "x:Y", "distribution": "npu-fsdp-patches",
                                                       "version": "0.1.0", "builtin": True}}


def test_doctor_wraps_long_reasons_under_the_row_and_shows_builtin_provenance_once():
    from npu_fsdp_patches.cli.render import doctor_text
    reason = "torch 2.13.0+cpu matches >=2.6; " + "transformer-engine 2.11.0 does not match <2.10 " * 3 + "END"
    patches = [_record("te_fused_adam_dtensor", reason), _record("hp_fp32_main_params", "short")]
    lines = doctor_text(_report(patches=patches)).splitlines()
    assert max(len(line) for line in lines) <= 100
    row = lines.index(next(line for line in lines if line.startswith("  te_fused_adam_dtensor")))
    column = lines[row].index("torch 2.13.0")
    assert lines[row + 1].startswith(" " * column) and lines[row + 1][column] != " "   # wrapped under the row
    assert "END" in " ".join(lines[row:row + 4]) and not any(line.endswith("…") for line in lines)
    assert [line for line in lines if "npu-fsdp-patches 0.1.0" in line] == [
        "Patch code: built into npu-fsdp-patches 0.1.0"]


def test_doctor_text_has_no_dangling_reference_and_no_empty_section():
    from npu_fsdp_patches.cli.render import doctor_text
    env = {"python": "3", "platform": "p", "torch": "2.13.0", "device": None,
           "device_error": "RuntimeError: Failed to load the backend extension: torch_npu",
           "torch_npu": {"installed": True, "version": "2.8.0", "importable": False,
                         "import_error": "ImportError: libhccl.so"}}
    npu_error = "torch_npu 2.8.0 is installed but cannot be imported: ImportError: libhccl.so. Next step: ..."
    text = doctor_text(_report(environment=env, errors=[npu_error]))   # no Warnings section: torch's own
    assert "Warnings" not in text and "see Warnings" not in text       # failure is named where it is
    assert "import fails: RuntimeError: Failed to load the backend extension: torch_npu" in text
    assert "NOT importable (see Errors)" in text and "\nErrors\n" in text
    config = doctor_text(_report(plugin={"version": "0", "matrix": None, "config_error": "NPU_FSDP_PATCHES_LOG="
                                         "'chatty' is not valid"}, exit_code=2))
    blocks = [block.splitlines() for block in config.split("\n\n")]
    assert all(len(block) > 1 for block in blocks[1:-1]), blocks       # every heading has content
    assert [block[0] for block in blocks[1:-1]] == ["Environment", "Configuration"]


def test_doctor_without_torch_says_so(tmp_path):
    """A real Python without torch: only the plugin's own dependencies on the path, site disabled (-S),
    and doctor's probe children run with the same flag."""
    import importlib.util
    site = tmp_path / "site"
    site.mkdir()
    for name in ("yaml", "_yaml", "packaging", "wrapt"):
        spec = importlib.util.find_spec(name)
        if spec is not None:
            source = Path(spec.origin).parent if spec.submodule_search_locations else Path(spec.origin)
            (site / source.name).symlink_to(source)
    env = {"PYTHONPATH": os.pathsep.join([str(site), str(REPO_ROOT)]), "PATH": os.environ["PATH"]}
    proc = subprocess.run([sys.executable, "-S", "-m", "npu_fsdp_patches", "doctor", "--json"], capture_output=True,
                          text=True, timeout=300, cwd=tmp_path, env=env)
    report = json.loads(proc.stdout)
    assert report["environment"]["torch"] is None and report["frameworks"]["torch"]["installed"] is False
    assert any(w.startswith("torch is not installed in this Python") for w in report["warnings"]), report["warnings"]
    assert proc.returncode == report["exit_code"] == 0     # documented: a warning, exit 0 (docs/cli.md)
    text = subprocess.run([sys.executable, "-S", "-m", "npu_fsdp_patches", "doctor"], capture_output=True,
                          text=True, timeout=300, cwd=tmp_path, env=env).stdout
    assert "  torch       not installed: no patch can apply in this Python" in text


def test_doctor_import_shows_the_real_error_of_a_target_and_fails_a_forced_patch_left_pending(tmp_path):
    site = install_fixture("core_demo", tmp_path)
    (site / "demo_broken_dep.py").write_text("import a_missing_dependency_xyz\nthing = 1\n")
    matrix = tmp_path / "broken.yaml"
    matrix.write_text((site / "demo_matrix.yaml").read_text().replace(
        'targets: ["not_installed_module_xyz:thing"]\n    gate:\n      - nowhere: {installed: true}',
        'targets: ["demo_broken_dep:thing"]\n    gate:\n      - demo: {installed: true}'))
    report = json.loads(cli(tmp_path, "doctor", "--json", "--import", NPU_FSDP_PATCHES_MATRIX=str(matrix)).stdout)
    # the target module is there but raises: the patch can never apply here, so it fails with the error
    record = next(r for r in report["patches"] if r["targets"] == ["demo_broken_dep:thing"])
    assert record["state"] == "failed", record
    assert record["error"].startswith("target not importable: import demo_broken_dep: ModuleNotFoundError: "
                                      "No module named 'a_missing_dependency_xyz' (at "), record
    assert record["error"].endswith("demo_broken_dep.py:1)")
    assert not [w for w in report["warnings"] if "demo_broken_dep" in w], report["warnings"]
    assert report["exit_code"] == 1
    # demo_absent forced on: its target module is not there, so it stays pending: an error, exit 1
    proc = cli(tmp_path, "doctor", "--json", "--import", NPU_FSDP_PATCHES_ENABLE="demo_absent")
    report = json.loads(proc.stdout)
    assert proc.returncode == report["exit_code"] == 1
    assert [e for e in report["errors"] if e.startswith("demo_absent: forced on by NPU_FSDP_PATCHES_ENABLE but "
                                                        "still pending")], report["errors"]
    # its one target module is missing: one warning says it stays pending, in place of a bare "not found"
    assert ("demo_absent stays pending: none of its target modules is in this Python (not_installed_module_xyz "
            "not found), so nothing here can apply it; it applies in a job that imports one of them"
            in report["warnings"]), report["warnings"]
    assert "import not_installed_module_xyz: not found" not in report["warnings"]
    proc = cli(tmp_path, "doctor", "--json", "--import")          # not forced: pending is no error
    assert proc.returncode == 0, proc.stdout[-3000:]


def test_an_unimportable_framework_names_the_enabled_patches_it_leaves_without_effect():
    """hp_skip_dispatch_adamw's targets are torch's, so it can apply while hyper-parallel cannot be imported:
    the error names it with the other enabled patches gated on the framework instead of saying none can
    apply; with none enabled the old words stay."""
    from npu_fsdp_patches.cli.doctor import framework_errors
    from npu_fsdp_patches.plan.matrix import load_matrix
    matrix = load_matrix()
    broken = {"hyper_parallel": {"importable": False, "distribution": "hyper-parallel", "version": "0.1.0",
                                 "import_error": "ImportError: libfoo.so", "source": "metadata", "note": None}}
    records = [{"name": "hp_skip_dispatch_adamw", "decision": "enabled"},
               {"name": "hp_fp32_main_params", "decision": "enabled"},
               {"name": "te_fused_adam_dtensor", "decision": "enabled"}]
    [error] = framework_errors(broken, matrix, records)
    assert error.startswith("hyper_parallel: hyper-parallel 0.1.0 is installed but not importable: ImportError: "
                            "libfoo.so. hp_skip_dispatch_adamw, hp_fp32_main_params are enabled for it but cannot "
                            "take effect; a job that imports it fails the same way. Next step: make "
                            "`import hyper_parallel` work"), error
    [error] = framework_errors(broken, matrix, records[1:2])
    assert "libfoo.so. hp_fp32_main_params is enabled for it but cannot take effect; a job" in error, error
    [error] = framework_errors(broken, matrix, [])
    assert "libfoo.so. No patch that needs it can apply; a job that imports it fails the same way. Next step: " \
           "make `import hyper_parallel` work in this Python (install" in error, error
