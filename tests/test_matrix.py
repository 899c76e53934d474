"""compat_matrix.yaml validation: every malformation names file, key path and line."""
import pytest

from npu_fsdp_patches.errors import MatrixError
from npu_fsdp_patches.matrix import load_matrix, parse_matrix
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


def test_shipped_matrix_is_valid_and_lists_the_six_patches():
    m = load_matrix()
    assert set(m.patches) == {"te_fused_adam_dtensor", "te_initialize_state_compat",
                              "te_multi_tensor_apply_empty_tail", "te_fused_adam_empty_scale",
                              "hp_fp32_main_params", "hp_skip_dispatch_adamw"}
    for spec in m.patches.values():
        assert spec.summary and spec.facts and spec.upstream and spec.verified, spec.name


def test_broken_matrix_leaves_the_plugin_inactive_and_the_import_working(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text(GOOD.replace(">=1.0", "~~1"))
    result, proc = run_demo(tmp_path, """
import npu_fsdp_patches, demo_target
emit(status=npu_fsdp_patches.status(), greet=demo_target.greet("x"))
""", NPU_FSDP_PATCHES_MATRIX=str(bad))
    assert result == {"status": [], "greet": "hello x"}
    assert f"{bad}:9 at patches.p1.gate[0].demo.version: bad PEP 440 specifier '~~1'" in proc.stderr


def test_unknown_patch_in_matrix_is_a_matrix_error(tmp_path):
    bad = tmp_path / "unknown.yaml"
    bad.write_text(GOOD)
    result, proc = run_demo(tmp_path, IMPORT_PLUGIN, NPU_FSDP_PATCHES_MATRIX=str(bad), NPU_FSDP_PATCHES_STRICT="1")
    assert result["raised"] == "MatrixError"
    assert result["message"].startswith(f"{bad}:5 at patches.p1: unknown patch 'p1'")
