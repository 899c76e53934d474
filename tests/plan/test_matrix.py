"""compat_matrix.yaml validation: every malformation names file, key path and line."""
import pytest

from npu_fsdp_patches.errors import MatrixError
from npu_fsdp_patches.plan.matrix import load_matrix, parse_matrix
from tests.core_demo import IMPORT_PLUGIN, run_demo

GOOD = """\
schema_version: 1
frameworks:
  demo: {distributions: [demo-framework], module: demo_target}
patches:
  p1:
    summary: s
    targets: ["m:f", "m:C.g?"]
    gate:
      - demo: {version: ">=1.0"}
"""


def test_good_matrix_parses():
    m = parse_matrix(GOOD, "good.yaml")
    spec = m.patches["p1"]
    assert [t.symbol for t in spec.targets] == ["m:f", "m:C.g"]
    assert [t.optional for t in spec.targets] == [False, True]
    assert str(spec.gate[0][0].version) == ">=1.0"


@pytest.mark.parametrize("text, key_path, line, fragment", [
    (GOOD.replace("summary: s", "summary: [unclosed"), "", 7, "YAML error"),
    (GOOD.replace("    summary: s", "    summary: s\n    colour: red"), "patches.p1.colour", 7, "unknown key 'colour'"),
    (GOOD.replace(">=1.0", ">=>1"), "patches.p1.gate[0].demo.version", 9, "bad PEP 440 specifier '>=>1'"),
    (GOOD.replace("- demo:", "- nothere:"), "patches.p1.gate[0].nothere", 9, "unknown framework 'nothere'"),
    (GOOD.replace('"m:f"', '"m.f"'), "patches.p1.targets[0]", 7, "bad target 'm.f'"),
    (GOOD.replace("schema_version: 1", "schema_version: 7"), "schema_version", 1, "unsupported schema_version 7"),
    (GOOD.replace("    summary: s\n", ""), "patches.p1", 5, "missing required key 'summary'"),
    (GOOD.replace("{version", "{installed: maybe, version"), "patches.p1.gate[0].demo.installed", 9,
     "expected true or false"),
])
def test_malformed_matrix_errors_carry_file_key_path_and_line(text, key_path, line, fragment):
    with pytest.raises(MatrixError) as info:
        parse_matrix(text, "bad.yaml")
    err = info.value
    assert (err.file, err.key_path, err.line) == ("bad.yaml", key_path, line)
    assert fragment in str(err)
    assert str(err).startswith(f"bad.yaml:{line}")


def test_unreadable_matrix_file(tmp_path):
    with pytest.raises(MatrixError, match="cannot read matrix"):
        load_matrix(tmp_path / "absent.yaml")


def test_shipped_matrix_is_valid_and_lists_the_seven_patches():
    m = load_matrix()
    assert set(m.patches) == {"te_fused_adam_dtensor", "te_initialize_state_compat",
                              "te_multi_tensor_apply_empty_tail", "te_fused_adam_empty_scale",
                              "te_fused_adam_empty_group_step", "hp_fp32_main_params", "hp_skip_dispatch_adamw"}
    for spec in m.patches.values():
        assert spec.summary and spec.facts and spec.upstream and spec.verified, spec.name
    # the upstream history behind the gates is a field `explain` prints, not a comment in the YAML
    assert {name for name, spec in m.patches.items() if spec.why} == {
        "te_fused_adam_dtensor", "te_multi_tensor_apply_empty_tail", "te_fused_adam_empty_scale",
        "te_fused_adam_empty_group_step", "hp_skip_dispatch_adamw"}


def _import_survives(tmp_path, name: str, text: str):
    """Import the plugin and demo_target under the matrix ``text`` (written to ``name``): nothing is
    patched and the import works. Returns the matrix path and the child process."""
    bad = tmp_path / name
    bad.write_text(text)
    result, proc = run_demo(tmp_path, """
import npu_fsdp_patches, demo_target
emit(status=npu_fsdp_patches.status(), greet=demo_target.greet("x"))
""", NPU_FSDP_PATCHES_MATRIX=str(bad))   # run_python's timeout fails the test if loading hangs
    assert result == {"status": [], "greet": "hello x"}
    return bad, proc


def test_broken_matrix_leaves_the_plugin_inactive_and_the_import_working(tmp_path):
    bad, proc = _import_survives(tmp_path, "bad.yaml", GOOD.replace(">=1.0", "~~1"))
    assert f"{bad}:9 at patches.p1.gate[0].demo.version: bad PEP 440 specifier '~~1'" in proc.stderr


def test_unknown_patch_in_matrix_is_a_matrix_error(tmp_path):
    bad = tmp_path / "unknown.yaml"
    bad.write_text(GOOD)
    result, proc = run_demo(tmp_path, IMPORT_PLUGIN, NPU_FSDP_PATCHES_MATRIX=str(bad), NPU_FSDP_PATCHES_STRICT="1")
    assert result["raised"] == "MatrixError"
    assert result["message"].startswith(f"{bad}:5 at patches.p1: unknown patch 'p1'")


FRAMEWORK_WITH_RULES = GOOD.replace(
    "  demo: {distributions: [demo-framework], module: demo_target}",
    "  demo:\n    distributions: [demo-framework]\n    module: demo_target\n"
    "    flavors:\n      - {flavor: a, distribution_matches: '^demo'}")


@pytest.mark.parametrize("text, key_path, line, fragment", [
    (GOOD.replace("module: demo_target", "module: [x]"), "frameworks.demo.module", 3, "expected a string"),
    (FRAMEWORK_WITH_RULES.replace("'^demo'", "5"), "frameworks.demo.flavors[0].distribution_matches", 7,
     "expected a string"),
    (FRAMEWORK_WITH_RULES.replace("{flavor: a,", "{flavor: 5,"), "frameworks.demo.flavors[0].flavor", 7,
     "expected a string"),
    (GOOD.replace('{version: ">=1.0"}', '{flavor: [npu]}'), "patches.p1.gate[0].demo.flavor", 9,
     "expected a string"),
    (GOOD.replace("    summary: s", "    summary: s\n    stand_down_probe: [probe]"),
     "patches.p1.stand_down_probe", 7, "expected a string"),
    (GOOD.replace("    summary: s", "    summary: s\n    why: [a, b]"), "patches.p1.why", 7, "expected a string"),
    (GOOD.replace("schema_version: 1", 'schema_version: "1"'), "schema_version", 1, "expected an integer"),
    (GOOD.replace("schema_version: 1", "schema_version: true"), "schema_version", 1, "expected an integer"),
    (GOOD.replace("    summary: s", "    summary: s\n    summary: t"), "patches.p1.summary", 7,
     "duplicate key 'summary' (first at line 6)"),
    (GOOD.replace("frameworks:", "patches: {}\nframeworks:"), "patches", 5, "duplicate key 'patches' (first at line 2)"),
    (GOOD.replace("summary: s", "summary: !!python/name:os.system"), "", 6,
     "YAML tag 'tag:yaml.org,2002:python/name:os.system' is not allowed"),
    (GOOD.replace("schema_version: 1", "schema_version: !!int 1"), "", 1, "YAML tag"),
    (GOOD.replace("    summary: s", "    summary: s\n    verified: {demo: [1.2]}"), "patches.p1.verified.demo[0]",
     7, "expected a string (quote numbers)"),
    (GOOD.replace("    summary: s", "    summary: s\n    upstream: {issues: issue-1}"), "patches.p1.upstream.issues",
     7, "expected a list of strings"),
    (GOOD.replace("    summary: s", "    summary: s\n    1: x"), "patches.p1", 7, "keys must be strings"),
])
def test_wrong_types_tags_and_duplicates_name_file_key_path_and_line(text, key_path, line, fragment):
    with pytest.raises(MatrixError) as info:
        parse_matrix(text, "bad.yaml")
    err = info.value
    assert (err.file, err.key_path, err.line) == ("bad.yaml", key_path, line), str(err)
    assert fragment in str(err) and str(err).startswith(f"bad.yaml:{line}")


ALIAS_BOMB = "a: &a [x, x, x, x, x, x, x, x, x]\n" + "".join(
    f"{chr(98 + i)}: &{chr(98 + i)} [{', '.join(['*' + chr(97 + i)] * 9)}]\n" for i in range(8))


@pytest.mark.parametrize("body, fragment", [
    (ALIAS_BOMB, "after alias expansion (an alias bomb?)"),
    ("a: " + "[" * 40 + "]" * 40 + "\n", "levels after alias expansion"),
    ("# pad\n" * 200_000, "larger than 1048576 bytes"),
])
def test_hostile_matrix_is_rejected_quickly_and_the_import_survives(tmp_path, body, fragment):
    bad, proc = _import_survives(tmp_path, "hostile.yaml", body)
    assert str(bad) in proc.stderr and fragment in proc.stderr


def test_wrongly_typed_matrix_leaves_the_import_working(tmp_path):
    bad, proc = _import_survives(tmp_path, "typed.yaml", GOOD.replace("module: demo_target", "module: [x]"))
    assert f"{bad}:3 at frameworks.demo.module: expected a string" in proc.stderr
    assert "Traceback" not in proc.stderr
