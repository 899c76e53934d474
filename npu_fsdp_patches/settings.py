"""The one place NPU_FSDP_PATCHES_* environment variables are parsed (docs/design.md#32-environment-variables)."""
from __future__ import annotations

from typing import Mapping, NamedTuple

from .errors import ConfigError

PREFIX = "NPU_FSDP_PATCHES"
LOG_LEVELS = ("debug", "info", "warning")
ENV_VARS = {
    PREFIX: "kill switch: 0 registers and applies nothing",
    f"{PREFIX}_DISABLE": "comma list of patch names, or *: never apply these",
    f"{PREFIX}_ENABLE": "comma list of patch names: apply even where the matrix says no (failures raise)",
    f"{PREFIX}_STRICT": "1: any patch failure raises PatchError instead of being logged",
    f"{PREFIX}_MATRIX": "path of a compat_matrix.yaml to use instead of the shipped one",
    f"{PREFIX}_LOG": "log level of the npu_fsdp_patches logger: debug, info or warning",
}


class Settings(NamedTuple):
    active: bool = True
    disable: frozenset = frozenset()
    disable_all: bool = False
    enable: frozenset = frozenset()
    strict: bool = False
    matrix_path: str | None = None
    log_level: str | None = None

    def unknown_names(self, known: set) -> list:
        """Names given in DISABLE/ENABLE that no patch has (sorted)."""
        return sorted((self.disable | self.enable) - set(known))


def _flag(environ: Mapping[str, str], name: str, default: bool) -> bool:
    raw = environ.get(name)
    if raw is None or raw.strip() == "":
        return default
    value = raw.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise ConfigError(f"{name}={raw!r} is not valid; accepted values: 0 or 1 (also true/false, yes/no, on/off)")


def _names(environ: Mapping[str, str], name: str, allow_star: bool) -> tuple:
    raw = environ.get(name, "")
    items = [part.strip() for part in raw.split(",") if part.strip()]
    star = "*" in items
    if star and not allow_star:
        raise ConfigError(f"{name}={raw!r} is not valid; accepted values: a comma-separated list of patch names")
    bad = [item for item in items if item != "*" and not item.replace("_", "").replace("-", "").isalnum()]
    if bad:
        accepted = "a comma-separated list of patch names" + (", or *" if allow_star else "")
        raise ConfigError(f"{name}={raw!r} is not valid ({', '.join(bad)}); accepted values: {accepted}")
    return frozenset(item for item in items if item != "*"), star


def parse_settings(environ: Mapping[str, str]) -> Settings:
    """Read the environment into Settings; raise ConfigError naming the variable and accepted values."""
    disable, disable_all = _names(environ, f"{PREFIX}_DISABLE", allow_star=True)
    enable, _ = _names(environ, f"{PREFIX}_ENABLE", allow_star=False)
    both = sorted(disable & enable)
    if both:
        raise ConfigError(f"{PREFIX}_DISABLE and {PREFIX}_ENABLE both name {', '.join(both)}; "
                          "accepted values: a patch name in at most one of them")
    log = environ.get(f"{PREFIX}_LOG", "").strip().lower() or None
    if log is not None and log not in LOG_LEVELS:
        raise ConfigError(f"{PREFIX}_LOG={environ[f'{PREFIX}_LOG']!r} is not valid; "
                          f"accepted values: {', '.join(LOG_LEVELS)}")
    matrix = environ.get(f"{PREFIX}_MATRIX", "").strip() or None
    return Settings(active=_flag(environ, PREFIX, True), disable=disable, disable_all=disable_all,
                    enable=enable, strict=_flag(environ, f"{PREFIX}_STRICT", False),
                    matrix_path=matrix, log_level=log)


def strict_requested(environ: Mapping[str, str]) -> bool:
    """Best-effort STRICT lookup used when the rest of the environment failed to parse."""
    return environ.get(f"{PREFIX}_STRICT", "").strip().lower() in ("1", "true", "yes", "on")
