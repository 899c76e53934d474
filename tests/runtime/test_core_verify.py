"""Declared patches checked against the matrix at activation, before any target is imported, and
reported by doctor; the one marker convention every replacement carries."""
import json

import pytest

from npu_fsdp_patches.plan.matrix import parse_matrix
from npu_fsdp_patches.patch import ORIGINAL_MARK, PATCH_MARK, Patch, mark, unpatched
from npu_fsdp_patches.runtime.verify import problems
from tests.core_demo import demo_env, run_demo
from tests.support import install_fixture, run_python

MISMATCHED = """schema_version: 1
frameworks:
  demo: {distributions: [demo-framework], module: demo_target}
patches:
  demo_shout:
    summary: one target the class declares no factory for, and a probe it does not define
    targets: ["demo_target:greet", "demo_target:Engine.stop"]
    gate: [{demo: {installed: true}}]
    stand_down_probe: no_such_probe
  demo_child:
    summary: matches its class
    targets: ["demo_target:Child.run"]
    gate: [{demo: {installed: true}}]
  demo_wrong_name:
    summary: registered under a name its class does not declare; gated off
    targets: ["demo_target:greet"]
    gate: [{demo: {version: "<1.0"}}]
"""
SHOUT_PROBLEMS = ("patch code does not match the matrix: stand-down probe 'no_such_probe' is not defined by "
                  "Shout; matrix target demo_target:Engine.stop has no factory in demo_patches:Shout.factories "
                  "(declared: gone, greet, run)")
WRONG_NAME = ("demo_wrong_name: patch code does not match the matrix: demo_patches:Shout declares name "
              "'demo_shout', but is registered and listed in the matrix as 'demo_wrong_name'")


def _site_with_wrong_name(tmp_path):
    """The demo fixtures plus a distribution registering demo_patches:Shout under another name."""
    site = install_fixture("core_demo", tmp_path)
    info = site / "wrong_name_patches-1.0.dist-info"
    info.mkdir(exist_ok=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: wrong-name-patches\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text("[npu_fsdp_patches.patches]\ndemo_wrong_name = demo_patches:Shout\n")
    (tmp_path / "mismatched.yaml").write_text(MISMATCHED)
    return site


def test_a_mismatch_fails_the_patch_at_activation_without_importing_the_target(tmp_path):
    _site_with_wrong_name(tmp_path)
    result, proc = run_demo(tmp_path, """
import sys, npu_fsdp_patches
before = "demo_target" in sys.modules
r = records()
emit(before=before, shout=[r["demo_shout"]["state"], r["demo_shout"]["error"]],
     child=r["demo_child"]["state"], wrong=r["demo_wrong_name"]["state"])
""", NPU_FSDP_PATCHES_MATRIX=str(tmp_path / "mismatched.yaml"))
    assert result["before"] is False        # found from the declarations alone
    assert result["shout"] == ["failed", SHOUT_PROBLEMS]
    assert result["child"] == "pending" and result["wrong"] == "disabled"
    assert f"LOG WARNING patch demo_shout failed: {SHOUT_PROBLEMS}" in proc.stderr


def test_a_mismatch_raises_in_strict_mode_and_for_an_explicit_request(tmp_path):
    _site_with_wrong_name(tmp_path)
    result, _ = run_demo(tmp_path, """
import npu_fsdp_patches
try:
    npu_fsdp_patches.apply("demo_wrong_name")
    emit(raised=False)
except npu_fsdp_patches.PatchError as exc:
    emit(raised=exc.patch, message=str(exc))
""", NPU_FSDP_PATCHES_MATRIX=str(tmp_path / "mismatched.yaml"), NPU_FSDP_PATCHES_DISABLE="demo_shout")
    assert result == {"raised": "demo_wrong_name",
                      "message": "patch demo_wrong_name failed at demo_wrong_name: "
                                 + WRONG_NAME.split(": ", 1)[1]}


def test_doctor_reports_each_mismatch_enabled_as_error_disabled_as_warning(tmp_path):
    site = _site_with_wrong_name(tmp_path)
    code = "import sys; from npu_fsdp_patches.cli import main; sys.argv[1:] = ['doctor', '--json']; sys.exit(main())"
    proc = run_python(code, paths=[site], env=demo_env(site, str(tmp_path / "mismatched.yaml")), check=False)
    report = json.loads(proc.stdout)
    assert report["exit_code"] == 1
    assert report["errors"] == [f"demo_shout: {SHOUT_PROBLEMS}"]
    assert WRONG_NAME in report["warnings"]
    assert [line for line in report["warnings"] if "does not match the matrix" in line] == [WRONG_NAME]


def _spec(targets, probe=None):
    probe_line = f"    stand_down_probe: {probe}\n" if probe else ""
    text = ("schema_version: 1\nframeworks:\n  f: {distributions: [f]}\npatches:\n  p:\n    summary: s\n"
            f"    targets: {json.dumps(targets)}\n    gate: [{{f: {{installed: true}}}}]\n" + probe_line)
    return parse_matrix(text).patches["p"]


class _Declared(Patch):
    name = "p"
    factories = {"f": lambda original: original, "g": lambda original: original}

    def probe_with_argument(self, value):
        return value

    def probe(self, optional=None):
        return False


def test_problems_cover_missing_factory_uncallable_factory_probe_arguments_and_name():
    assert problems(_spec(["m:C.f"], "probe"), _Declared()) == []
    assert problems(_spec(["m:C.f", "m:h?"]), _Declared()) == [
        "matrix target m:h has no factory in tests.runtime.test_core_verify:_Declared.factories (declared: f, g)"]

    class Uncallable(_Declared):
        factories = {"g": "not callable"}

    assert problems(_spec(["m:g"]), Uncallable()) == [
        "tests.runtime.test_core_verify:test_problems_cover_missing_factory_uncallable_factory_probe_arguments_and_name"
        ".<locals>.Uncallable.factories['g'] is str, not a factory"]
    assert problems(_spec(["m:f"], "probe_with_argument"), _Declared()) == [
        "stand-down probe 'probe_with_argument' of tests.runtime.test_core_verify:_Declared must take no arguments, it needs 1"]

    class Renamed(_Declared):
        name = "q"

    assert problems(_spec(["m:f"]), Renamed())[0].endswith("declares name 'q', but is registered and listed "
                                                            "in the matrix as 'p'")


def test_an_imperative_patch_that_overrides_replacement_opts_out_of_the_target_check():
    class Imperative(Patch):
        name = "p"

        def replacement(self, symbol, original):
            return original

    class Undeclared(Patch):
        name = "p"

    assert problems(_spec(["m:anything"]), Imperative()) == []
    assert problems(_spec(["m:anything"]), Undeclared()) == [
        "matrix target m:anything has no factory in tests.runtime.test_core_verify:"
        "test_an_imperative_patch_that_overrides_replacement_opts_out_of_the_target_check.<locals>.Undeclared"
        ".factories (declared: none)"]


def test_every_replacement_is_marked_one_way_and_unpatched_finds_the_original():
    def original(x):
        """doc"""
        return x

    class Double(Patch):
        name = "double"
        factories = {"original": lambda fn: lambda x: 2 * fn(x)}

    replacement = Double().replacement("m:original", original)
    assert replacement(3) == 6 and getattr(replacement, PATCH_MARK) == "double"
    assert getattr(replacement, ORIGINAL_MARK) is original and unpatched(replacement) is original
    assert (replacement.__name__, replacement.__qualname__, replacement.__doc__) == (
        original.__name__, original.__qualname__, "doc")
    again = mark(lambda x: x, replacement, "outer")   # a replacement of a replacement unwinds to the root
    assert unpatched(again) is original and unpatched(original) is original
    assert mark(original, original, "keeps") is original and not hasattr(original, PATCH_MARK)
    with pytest.raises(ValueError, match="double: no replacement declared for m:other"):
        Double().replacement("m:other", original)


def test_every_builtin_patch_matches_the_shipped_matrix():
    from npu_fsdp_patches.plan import loader
    from npu_fsdp_patches.plan.matrix import load_matrix
    matrix, table = load_matrix(), loader.builtin_table()
    assert set(table) == set(matrix.patches)
    for name, value in table.items():
        assert problems(matrix.patches[name], loader.load_patch(value)) == [], name
