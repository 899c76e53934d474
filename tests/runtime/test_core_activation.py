"""Activation, ordering and revert in fresh interpreters (ddtrace PatchTestCase style)."""
from tests.core_demo import run_demo


def test_import_imports_neither_torch_nor_targets(tmp_path):
    result, _ = run_demo(tmp_path, """
import npu_fsdp_patches
heavy = [m for m in ("torch", "demo_target", "transformer_engine", "megatron", "hyper_parallel",
                     "veomni", "mindspeed", "torch_npu", "yaml.cyaml_missing") if m in sys.modules]
emit(heavy=heavy, states={n: r["state"] for n, r in records().items()})
""")
    assert result["heavy"] == []
    assert result["states"]["demo_shout"] == "pending"
    assert result["states"]["demo_gated_off"] == "disabled"


def test_plugin_then_target_import_patches_on_import(tmp_path):
    result, _ = run_demo(tmp_path, """
import npu_fsdp_patches
import demo_target
r = records()["demo_shout"]
emit(greet=demo_target.greet("x"), run=demo_target.Engine().run(1), state=r["state"],
     applied=r["applied_targets"], before=r["imported_before_activation"])
""")
    assert result == {"greet": "hello x!", "run": 20, "state": "applied",
                      "applied": ["demo_target:greet", "demo_target:Engine.run"], "before": []}


def test_target_imported_first_is_patched_at_once_and_stale_refs_named(tmp_path):
    result, _ = run_demo(tmp_path, """
import demo_target, demo_target.extra
import npu_fsdp_patches
r = records()["demo_shout"]
emit(greet=demo_target.greet("x"), stale=demo_target.extra.greet("x"), state=r["state"],
     before=r["imported_before_activation"], refs=r["stale_refs"])
""")
    assert result["greet"] == "hello x!" and result["stale"] == "hello x"
    assert result["state"] == "applied" and result["before"] == ["demo_target"]
    assert result["refs"] == {"demo_target:greet": ["demo_target.extra"]}


def test_revert_restores_the_exact_originals(tmp_path):
    result, _ = run_demo(tmp_path, """
import demo_target
before = {k: id(v) for k, v in [("greet", demo_target.greet), ("run", vars(demo_target.Engine)["run"])]}
had_child_run = "run" in vars(demo_target.Child)
import npu_fsdp_patches
npu_fsdp_patches.apply("demo_child")
patched = (demo_target.greet("x"), demo_target.Child().run(1))
npu_fsdp_patches.revert("demo_shout", "demo_child")
after = {k: id(v) for k, v in [("greet", demo_target.greet), ("run", vars(demo_target.Engine)["run"])]}
emit(same=before == after, patched=patched, child_own=had_child_run or "run" in vars(demo_target.Child),
     restored=(demo_target.greet("x"), demo_target.Child().run(1)),
     states=[records()[n]["state"] for n in ("demo_shout", "demo_child")])
""")
    assert result["patched"] == ["hello x!", -20]
    assert result["same"] is True and result["child_own"] is False
    assert result["restored"] == ["hello x", 2]
    assert result["states"] == ["reverted", "reverted"]


def test_patch_revert_reimport_apply_orderings(tmp_path):
    result, _ = run_demo(tmp_path, """
import npu_fsdp_patches, demo_target
seen = [demo_target.greet("a")]
npu_fsdp_patches.revert("demo_shout")
del sys.modules["demo_target"]
import demo_target
seen.append(demo_target.greet("b"))            # re-imported after revert: stays unpatched
npu_fsdp_patches.apply("demo_shout")
seen.append(demo_target.greet("c"))            # re-applied on the fresh module
npu_fsdp_patches.apply("demo_shout")           # twice: nothing is wrapped twice
seen.append(demo_target.greet("d"))
npu_fsdp_patches.revert("demo_shout")
npu_fsdp_patches.apply("demo_shout")
seen.append(demo_target.greet("e"))
emit(seen=seen, state=records()["demo_shout"]["state"])
""")
    assert result["seen"] == ["hello a!", "hello b", "hello c!", "hello d!", "hello e!"]
    assert result["state"] == "applied"


def test_double_activation_wraps_nothing_twice(tmp_path):
    result, _ = run_demo(tmp_path, """
import npu_fsdp_patches, importlib
from npu_fsdp_patches.runtime import RUNTIME
RUNTIME.activate(); RUNTIME.activated = False; RUNTIME.activate()
import demo_target
import npu_fsdp_patches_autoload as autoload
autoload.autoload(); autoload.autoload()
emit(greet=demo_target.greet("x"), run=demo_target.Engine().run(1))
""")
    assert result == {"greet": "hello x!", "run": 20}


def test_stand_down_probe_skips_when_upstream_has_the_fix(tmp_path):
    result, _ = run_demo(tmp_path, """
import npu_fsdp_patches, demo_target
r = records()["demo_shout"]
emit(greet=demo_target.greet("x"), state=r["state"], note=r["note"])
""", DEMO_TARGET_FIXED="1")
    assert result == {"greet": "hello x", "state": "skipped",
                      "note": "upstream has it (probe upstream_has_fix)"}


def test_kill_switch_registers_and_applies_nothing(tmp_path):
    result, _ = run_demo(tmp_path, """
import npu_fsdp_patches, demo_target
emit(untouched=vars(demo_target.Engine)["run"].__qualname__ == "Engine.run"
     and demo_target.greet.__qualname__ == "greet" and demo_target.greet("x") == "hello x",
     meta_path=[type(f).__name__ for f in sys.meta_path],
     states={n: (r["state"], r["reason"]) for n, r in records().items()})
""", NPU_FSDP_PATCHES="0")
    assert result["untouched"] is True
    assert "ImportHookFinder" not in result["meta_path"]
    assert {tuple(v) for v in result["states"].values()} == {("disabled", "NPU_FSDP_PATCHES=0 (kill switch)")}


def test_revert_also_restores_copies_made_after_the_patch(tmp_path):
    result, _ = run_demo(tmp_path, """
import npu_fsdp_patches, demo_target
import demo_target.late                      # `from demo_target import greet` after the patch
patched = demo_target.late.greet("x")
npu_fsdp_patches.revert("demo_shout")
emit(patched=patched, restored=demo_target.late.greet("x"),
     same=demo_target.late.greet is demo_target.greet)
""")
    assert result == {"patched": "hello x!", "restored": "hello x", "same": True}


def test_revert_refuses_to_drop_a_wraps_wrapper_and_leaves_foreign_replacements(tmp_path):
    """A functools.wraps wrapper stacked on ours is never silently dropped: revert refuses, naming it,
    and ours stays applied beneath it; once the wrapper is gone, revert restores the original."""
    result, _ = run_demo(tmp_path, """
import functools, npu_fsdp_patches, demo_target
patched_run = vars(demo_target.Engine)["run"]
demo_target.Engine.run = functools.wraps(patched_run)(lambda self, x: patched_run(self, x))  # a profiler
foreign = lambda name: "foreign"
demo_target.greet = foreign
try:
    npu_fsdp_patches.revert("demo_shout")
    refused = None
except npu_fsdp_patches.PatchError as exc:
    refused = str(exc)
r = records()["demo_shout"]   # greet was overwritten: failed, naming it; Engine.run is still ours
kept = [r["state"], r["applied_targets"], demo_target.Engine().run(1), r["note"], r["error"]]
demo_target.Engine.run = patched_run                                  # the profiler removes itself
records_after = npu_fsdp_patches.revert("demo_shout")
emit(refused=refused, kept=kept, run=demo_target.Engine().run(1), greet_is_foreign=demo_target.greet is foreign,
     error=records_after[0]["error"], state=records_after[0]["state"])
""")
    assert result["refused"].startswith("patch demo_shout not reverted: demo_target:Engine.run is wrapped by "
                                        "__main__.<lambda> (<string>:"), result["refused"]
    assert "ours stays applied" in result["refused"]
    state, applied, run, note, error = result["kept"]
    assert [state, applied, run] == ["failed", ["demo_target:Engine.run"], 20]
    assert note.startswith("demo_target:Engine.run is wrapped by __main__.<lambda>"), note
    assert "demo_target:greet now holds __main__.<lambda> (<string>:" in error, error
    assert result["run"] == 2 and result["greet_is_foreign"] is True
    assert result["state"] == "reverted" and result["error"] is None   # greet was already reported lost


def test_states_are_an_enum_reported_as_their_plain_names():
    from npu_fsdp_patches.plan.decide import Decision
    from npu_fsdp_patches.runtime.records import PatchRecord, State
    record = PatchRecord("p", "s", Decision(False, "r"), [])
    assert record.state is State.DISABLED and record.as_dict()["state"] == "disabled"
    record.mark_pending()
    record.mark_applied(["m:f"])
    assert type(record.as_dict()["state"]) is str and f"{record.state:<8}|" == "applied |"
    assert [s.value for s in State] == ["pending", "applied", "skipped", "failed", "disabled", "reverted"]
