"""Table tests of the env parser (pure function)."""
import pytest

from npu_fsdp_patches.errors import ConfigError
from npu_fsdp_patches.plan.settings import parse_settings

P = "NPU_FSDP_PATCHES"


@pytest.mark.parametrize("env, expected", [
    ({}, dict(active=True, strict=False, disable=frozenset(), disable_all=False, enable=frozenset())),
    ({P: "0"}, dict(active=False)),
    ({P: "1", f"{P}_STRICT": "1"}, dict(active=True, strict=True)),
    ({f"{P}_DISABLE": "a, b,,"}, dict(disable=frozenset({"a", "b"}), disable_all=False)),
    ({f"{P}_DISABLE": "*"}, dict(disable=frozenset(), disable_all=True)),
    ({f"{P}_DISABLE": "*", f"{P}_ENABLE": "x"}, dict(disable_all=True, enable=frozenset({"x"}))),
    ({f"{P}_MATRIX": " /m.yaml "}, dict(matrix_path="/m.yaml")),
    ({f"{P}_LOG": "DEBUG"}, dict(log_level="debug")),
    ({f"{P}_LOG": "error"}, dict(log_level="error")),
    ({f"{P}_LOG": "WARNING"}, dict(log_level="warning")),
    ({f"{P}_LOG": "Critical"}, dict(log_level="critical")),
    ({f"{P}_DISABLE": "a"}, dict(warnings=())),
    ({f"{P}_STRICT": "0"}, dict(strict=False)),
    ({f"{P}_ENABLE": "x,y"}, dict(enable=frozenset({"x", "y"}))),
])
def test_valid_settings(env, expected):
    settings = parse_settings(env)
    for key, value in expected.items():
        assert getattr(settings, key) == value, key


@pytest.mark.parametrize("env, message", [
    ({P: "2"}, f"{P}='2' is not valid; accepted values: 0 or 1"),
    ({f"{P}_STRICT": "yes please"}, f"{P}_STRICT='yes please' is not valid"),
    ({f"{P}_ENABLE": "*"}, f"{P}_ENABLE='*' is not valid; accepted values: a comma-separated list"),
    ({f"{P}_DISABLE": "a;b"}, f"{P}_DISABLE='a;b' is not valid (a;b)"),
    ({f"{P}_DISABLE": "a", f"{P}_ENABLE": "a"}, "both name a"),
])
def test_invalid_settings_name_the_variable(env, message):
    with pytest.raises(ConfigError) as info:
        parse_settings(env)
    assert message in str(info.value)


def test_unknown_names():
    settings = parse_settings({f"{P}_DISABLE": "b,zz", f"{P}_ENABLE": "aa"})
    assert settings.unknown_names({"b"}) == ["aa", "zz"]


def test_a_relative_matrix_path_is_made_absolute_against_the_directory_of_activation(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert parse_settings({f"{P}_MATRIX": "sub/m.yaml"}).matrix_path == str(tmp_path / "sub" / "m.yaml")


def test_a_misspelled_variable_is_named_with_the_closest_valid_one():
    settings = parse_settings({f"{P}_DISABLED": "x", "NPU_FSDP_PATCH_LOG": "debug", f"{P}_DISABLE": "y",
                               "NPU_FSDP_ZZZZZZZZZZZZ": "1", "OTHER": "1"})
    assert settings.warnings == (
        "NPU_FSDP_PATCHES_DISABLED is not a variable of npu_fsdp_patches and is ignored; "
        "did you mean NPU_FSDP_PATCHES_DISABLE?",
        "NPU_FSDP_PATCH_LOG is not a variable of npu_fsdp_patches and is ignored; "
        "did you mean NPU_FSDP_PATCHES_LOG?",
        "NPU_FSDP_ZZZZZZZZZZZZ is not a variable of npu_fsdp_patches and is ignored; valid variables: "
        "NPU_FSDP_PATCHES, NPU_FSDP_PATCHES_DISABLE, NPU_FSDP_PATCHES_ENABLE, NPU_FSDP_PATCHES_STRICT, "
        "NPU_FSDP_PATCHES_MATRIX, NPU_FSDP_PATCHES_LOG")


def test_unknown_patch_names_are_reported_with_the_closest_known_name():
    settings = parse_settings({f"{P}_DISABLE": "te_fused_adam_dtensr,zz"})
    assert settings.unknown_names_message({"te_fused_adam_dtensor", "hp_fp32_main_params"}) == (
        f"{P}_DISABLE/{P}_ENABLE name unknown patch(es) te_fused_adam_dtensr (did you mean "
        "te_fused_adam_dtensor?), zz; known patches: hp_fp32_main_params, te_fused_adam_dtensor")
    assert settings.unknown_names_message({"te_fused_adam_dtensr", "zz"}) is None


# Every variable, with a bad value, and what that does: a setting that decides patches (or how a failure
# is handled) refuses the value and leaves the plugin inactive; a cosmetic one (LOG) falls back to its
# default with one warning (docs/usage.md#environment-variables).
BAD_VALUES = {
    P: ("2", "refused"),
    f"{P}_DISABLE": ("a;b", "refused"),
    f"{P}_ENABLE": ("*", "refused"),
    f"{P}_STRICT": ("sometimes", "refused"),
    f"{P}_MATRIX": (None, "a path: any value is one (a missing file is a matrix error, tests/plan/test_matrix.py)"),
    f"{P}_LOG": ("verbose", "default"),
}


def test_every_variable_has_a_bad_value_rule():
    from npu_fsdp_patches.plan.settings import ENV_VARS
    assert set(BAD_VALUES) == set(ENV_VARS)


@pytest.mark.parametrize("name", [n for n, (value, rule) in BAD_VALUES.items() if rule == "refused"])
def test_a_bad_value_of_a_setting_that_decides_patches_is_refused(name):
    value, _ = BAD_VALUES[name]
    with pytest.raises(ConfigError) as info:
        parse_settings({name: value})
    assert str(info.value).startswith(f"{name}={value!r} is not valid")


def test_a_bad_log_level_falls_back_to_the_default_with_one_warning():
    settings = parse_settings({f"{P}_LOG": "verbose", f"{P}_DISABLE": "x"})
    assert (settings.log_level, settings.active, settings.disable) == (None, True, frozenset({"x"}))
    assert settings.warnings == (
        f"{P}_LOG='verbose' is not valid and is ignored (the default level, warning, is used; every patch "
        "still applies); accepted values: debug, info, warning, warn, error, critical, fatal, notset "
        "(Python level names, any case)",)


def test_a_bad_log_level_keeps_the_plugin_active_in_a_real_process():
    from tests.support import run_python
    code = ("import npu_fsdp_patches; from npu_fsdp_patches.runtime import RUNTIME; "
            "print(RUNTIME.snapshot().config_error, len(npu_fsdp_patches.status()))")
    proc = run_python(code, env={f"{P}_LOG": "verbose"})
    error, count = proc.stdout.split()
    assert error == "None" and int(count) > 0
    assert proc.stderr.count(f"{P}_LOG='verbose' is not valid and is ignored") == 1, proc.stderr


def test_the_kill_switch_is_named_as_it_was_set():
    from npu_fsdp_patches.plan.decide import decide
    from npu_fsdp_patches.plan.matrix import load_matrix
    spec = load_matrix().patches["te_fused_adam_dtensor"]
    for raw in ("off", "False", "0"):
        settings = parse_settings({P: raw})
        assert settings.active is False and settings.kill_switch == f"{P}={raw}"
        assert decide(spec, {}, settings).reason == f"{P}={raw} (kill switch)"
