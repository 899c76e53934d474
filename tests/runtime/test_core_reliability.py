"""Activation tells the truth and no failure disables another patch (issue 8), each in a fresh interpreter."""
import json

import pytest

from tests.core_demo import demo_matrix, run_demo
from tests.support import make_dist, run_python

FAILING = "demo_matrix_failing.yaml"
STATES = "emit(states={n: [r['state'], r['error']] for n, r in records().items()}, greet=demo_target.greet('x'), " \
         "run=demo_target.Engine().run(1), child=demo_target.Child().run(1))"


def _states(result):
    return {n: s for n, (s, _) in result["states"].items()}


def test_strict_failure_under_the_torch_autoload_still_arms_every_other_patch(tmp_path):
    pytest.importorskip("torch")
    result, _ = run_demo(tmp_path, "import demo_target\nimport torch\n" + STATES,
                         matrix=FAILING, NPU_FSDP_PATCHES_STRICT="1")
    assert _states(result) == {"demo_boom": "failed", "demo_missing": "failed", "demo_shout": "applied",
                               "demo_child": "applied", "demo_gated_off": "disabled", "demo_absent": "disabled"}
    assert (result["greet"], result["run"], result["child"]) == ("hello x!", 20, -20)


def test_strict_failure_in_an_import_applies_the_others_and_a_retried_import_is_patched(tmp_path):
    result, _ = run_demo(tmp_path, """
import npu_fsdp_patches
try:
    import demo_target
    raised = None
except npu_fsdp_patches.PatchError as exc:
    raised = exc.patch
dropped = "demo_target" not in sys.modules
pending = {n: r["waiting_for"] for n, r in records().items() if r["state"] == "pending"}
import demo_target                      # the retry gets a module with every other patch applied
emit(raised=raised, dropped=dropped, pending=pending, **json.loads(json.dumps(dict(
    states={n: [r['state'], r['error']] for n, r in records().items()}, greet=demo_target.greet('x'),
    run=demo_target.Engine().run(1), child=demo_target.Child().run(1)))))
""", matrix=FAILING, NPU_FSDP_PATCHES_STRICT="1")
    assert result["raised"] == "demo_boom" and result["dropped"] is True
    assert result["pending"] == {"demo_shout": ["demo_target"], "demo_child": ["demo_target"]}
    assert _states(result)["demo_shout"] == _states(result)["demo_child"] == "applied"
    assert (result["greet"], result["run"], result["child"]) == ("hello x!", 20, -20)


def test_a_second_patch_on_the_same_symbol_fails_naming_the_first(tmp_path):
    result, _ = run_demo(tmp_path, """
import npu_fsdp_patches
try:
    import demo_target
except npu_fsdp_patches.PatchError as exc:
    error = str(exc)
import demo_target
emit(error=error, state=records()["demo_gated_off"]["state"], greet=demo_target.greet("x"))
""", NPU_FSDP_PATCHES_ENABLE="demo_gated_off")
    assert result["error"] == ("patch demo_gated_off failed at demo_target:greet: demo_target:greet is already "
                               "patched by demo_shout; two patches cannot change the same object")
    assert result["state"] == "failed" and result["greet"] == "hello x!"


def test_a_patch_inside_an_object_another_patch_replaced_fails_naming_it(tmp_path, demo_site):
    matrix = demo_matrix(tmp_path / "overlap.yaml", """\
  demo_absent:
    summary: replaces the whole Engine class (demo_patches.Shout returns a function for it)
    targets: ["demo_target:Engine"]
    gate: [{demo: {installed: true}}]
  demo_shout:
    summary: wraps greet and Engine.run
    targets: ["demo_target:greet", "demo_target:Engine.run"]
    gate: [{demo: {installed: true}}]
""")
    result, _ = run_demo(tmp_path, "import npu_fsdp_patches, demo_target\n"
                         "emit(states={n: [r['state'], r['error']] for n, r in records().items()})",
                         NPU_FSDP_PATCHES_MATRIX=str(matrix))
    assert result["states"]["demo_absent"] == ["applied", None]
    assert result["states"]["demo_shout"] == [
        "failed", "demo_target:Engine.run overlaps demo_target:Engine, which is already patched by demo_absent; "
                  "two patches cannot change the same object"]
    assert demo_site.exists()


def _entry_point_dist(site, name, version, entries):
    make_dist(site, name, version, {f"{name}.py": "from demo_patches import Shout as Hijack\n"})
    (next(site.glob(f"{name}-{version}.dist-info")) / "entry_points.txt").write_text(
        "[npu_fsdp_patches.patches]\n" + "".join(f"{k} = {v}\n" for k, v in entries.items()))


def test_builtin_patch_names_cannot_be_hijacked_and_conflicts_name_both_distributions(tmp_path, demo_site):
    hostile = tmp_path / "hostile"
    _entry_point_dist(hostile, "megatron_extras", "1.0", {"hp_skip_dispatch_adamw": "megatron_extras:Hijack"})
    site = demo_site
    code = """
import json, logging
logging.basicConfig(format="LOG %(levelname)s %(message)s")
import npu_fsdp_patches
print(json.dumps({r["name"]: r["provenance"] for r in npu_fsdp_patches.status()}))
"""
    proc = run_python(code, paths=[hostile, site])
    provenance = json.loads(proc.stdout.splitlines()[-1])["hp_skip_dispatch_adamw"]
    assert provenance["builtin"] is True and provenance["distribution"] == "npu-fsdp-patches"
    assert provenance["value"] == "npu_fsdp_patches.patches.hp_skip_dispatch:HpSkipDispatchAdamW"
    assert ("LOG WARNING patch name 'hp_skip_dispatch_adamw' is built in (npu-fsdp-patches 0.1.0 (built-in)) "
            "but also registered by megatron_extras 1.0 (entry point megatron_extras:Hijack); that "
            "registration is ignored") in proc.stderr


def test_a_name_registered_by_two_distributions_runs_neither_and_the_rest_go_on(tmp_path):
    rival = tmp_path / "rival"
    _entry_point_dist(rival, "rival_patches", "2.0", {"demo_shout": "rival_patches:Hijack"})
    result, _ = run_demo(tmp_path, """
import npu_fsdp_patches, demo_target
emit(shout=[records()["demo_shout"][k] for k in ("state", "error")], child=records()["demo_child"]["state"],
     greet=demo_target.greet("x"))
""", PYTHONPATH=str(rival))
    assert result["shout"] == ["failed", "patch name 'demo_shout' is registered by both demo-patches 0.1.0 "
                                         "(entry point demo_patches:Shout) and rival_patches 2.0 (entry point "
                                         "rival_patches:Hijack); neither is used"]
    assert result["child"] == "applied" and result["greet"] == "hello x"


def test_status_has_no_stale_refs_for_copies_patched_in_the_same_activation(tmp_path):
    matrix = demo_matrix(tmp_path / "copies.yaml", """\
  demo_shout:
    summary: greet and its from-import copy in demo_target.extra
    targets: ["demo_target:greet", "demo_target.extra:greet?"]
    gate: [{demo: {installed: true}}]
    verified: {demo: ["1.2.0"]}
""")
    result, _ = run_demo(tmp_path, """
import demo_target, demo_target.extra
import npu_fsdp_patches
from npu_fsdp_patches.cli.doctor import warnings_for
r = records()["demo_shout"]
emit(refs=r["stale_refs"], before=r["imported_before_activation"], copy=demo_target.extra.greet("x"),
     warnings=warnings_for(npu_fsdp_patches.status()))
""", NPU_FSDP_PATCHES_MATRIX=str(matrix))
    assert result["copy"] == "hello x!" and result["refs"] == {}
    assert result["before"] == ["demo_target", "demo_target.extra"]
    assert result["warnings"] == []   # imported first, yet every copy is patched: nothing to warn about


def test_import_torch_with_hyper_parallel_lists_no_stale_refs(hyper_site):
    pytest.importorskip("torch")
    site = hyper_site
    proc = run_python("""
import json, sys, torch
import npu_fsdp_patches
r = {x["name"]: x for x in npu_fsdp_patches.status()}["hp_skip_dispatch_adamw"]
ours = [getattr(sys.modules[m].adam, "__npu_fsdp_patch__", None) for m in r["imported_before_activation"]]
from npu_fsdp_patches.cli.doctor import warnings_for
said = [w for w in warnings_for(npu_fsdp_patches.status()) if "imported before" in w]
print(json.dumps([r["state"], r["stale_refs"], ours, said]))
""", paths=[site])
    # doctor says nothing about it: no module holds an unpatched copy (issue 41: it alarmed every hyper user)
    assert json.loads(proc.stdout.splitlines()[-1]) == ["applied", {}, ["hp_skip_dispatch_adamw"] * 3, []]


def test_reload_of_a_patched_module_is_reported_and_apply_fixes_it(tmp_path):
    result, _ = run_demo(tmp_path, """
import importlib, npu_fsdp_patches, demo_target
importlib.reload(demo_target)
r = records()["demo_shout"]
lost = [r["state"], r["error"], r["applied_targets"], demo_target.greet("x")]
npu_fsdp_patches.apply("demo_shout")
emit(lost=lost, again=[records()["demo_shout"]["state"], demo_target.greet("x"), demo_target.Engine().run(1)])
""")
    state, error, targets, greeted = result["lost"]
    assert [state, targets, greeted] == ["failed", [], "hello x"]
    assert error.startswith("no longer installed at demo_target:greet, demo_target:Engine.run (module reloaded or "
                            "attribute replaced after apply: demo_target:greet now holds demo_target.greet ("), error
    assert "which does not wrap ours; demo_target:Engine.run now holds demo_target.Engine.run (" in error
    assert error.endswith("which does not wrap ours); npu_fsdp_patches.apply('demo_shout') applies it again")
    assert result["again"] == ["applied", "hello x!", 20]


def test_revert_of_a_never_applied_patch_keeps_its_state(tmp_path):
    result, _ = run_demo(tmp_path, """
import npu_fsdp_patches, demo_target
npu_fsdp_patches.revert("demo_gated_off", "demo_boom", "demo_shout")
emit(states={n: records()[n]["state"] for n in ("demo_gated_off", "demo_boom", "demo_shout")})
""", matrix=FAILING)
    assert result["states"] == {"demo_gated_off": "disabled", "demo_boom": "failed", "demo_shout": "reverted"}


def test_debug_log_shows_decisions_and_applies_with_provenance(tmp_path):
    _, proc = run_demo(tmp_path, "import npu_fsdp_patches, demo_target\n", NPU_FSDP_PATCHES_LOG="debug")
    err = proc.stderr
    assert ("DEBUG npu_fsdp_patches: patch demo_shout enabled: demo-framework 1.2.0 matches >=1.0; code: "
            "demo-patches 0.1.0 (entry point demo_patches:Shout)") in err
    assert "DEBUG npu_fsdp_patches: patch demo_gated_off disabled: demo-framework 1.2.0 does not match <1.0" in err
    assert ("INFO npu_fsdp_patches: patch demo_shout applied at demo_target:greet, demo_target:Engine.run; code: "
            "demo-patches 0.1.0 (entry point demo_patches:Shout)") in err
