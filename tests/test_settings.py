"""Table tests of the env parser (pure function)."""
import pytest

from npu_fsdp_patches.errors import ConfigError
from npu_fsdp_patches.settings import parse_settings

P = "NPU_FSDP_PATCHES"


@pytest.mark.parametrize("env, expected", [
    ({}, dict(active=True, strict=False, disable=frozenset(), disable_all=False, enable=frozenset())),
    ({P: "0"}, dict(active=False)),
    ({P: "1", f"{P}_STRICT": "1"}, dict(active=True, strict=True)),
    ({f"{P}_DISABLE": "a, b,,"}, dict(disable=frozenset({"a", "b"}), disable_all=False)),
    ({f"{P}_DISABLE": "*"}, dict(disable=frozenset(), disable_all=True)),
    ({f"{P}_DISABLE": "*", f"{P}_ENABLE": "x"}, dict(disable_all=True, enable=frozenset({"x"}))),
    ({f"{P}_MATRIX": " m.yaml "}, dict(matrix_path="m.yaml")),
    ({f"{P}_LOG": "DEBUG"}, dict(log_level="debug")),
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
    ({f"{P}_LOG": "trace"}, f"{P}_LOG='trace' is not valid; accepted values: debug, info, warning"),
    ({f"{P}_DISABLE": "a", f"{P}_ENABLE": "a"}, "both name a"),
])
def test_invalid_settings_name_the_variable(env, message):
    with pytest.raises(ConfigError) as info:
        parse_settings(env)
    assert message in str(info.value)


def test_unknown_names():
    settings = parse_settings({f"{P}_DISABLE": "b,zz", f"{P}_ENABLE": "aa"})
    assert settings.unknown_names({"b"}) == ["aa", "zz"]
