"""The one place NPU_FSDP_PATCHES_* environment variables are parsed (docs/design.md#32-environment-variables).

Two kinds of setting, two rules for a bad value. A setting that decides which patches apply or how a
failure is handled (the kill switch, DISABLE, ENABLE, STRICT, MATRIX) raises ConfigError: guessing
could apply a patch the user switched off, so the plugin stays inactive and says why. A cosmetic
setting (LOG: only what is printed) falls back to its default with one warning, since a typo there
must not switch the numerics fixes off for a whole job.
"""
from __future__ import annotations

import os
from typing import Mapping, NamedTuple

from ..errors import ConfigError

PREFIX = "NPU_FSDP_PATCHES"
#: Python's standard level names (logging._nameToLevel), in any case
LOG_LEVELS = ("debug", "info", "warning", "warn", "error", "critical", "fatal", "notset")
ENV_VARS = {
    PREFIX: "kill switch: 0 registers and applies nothing",
    f"{PREFIX}_DISABLE": "comma list of patch names, or *: never apply these",
    f"{PREFIX}_ENABLE": "comma list of patch names: apply even where the matrix says no (failures raise)",
    f"{PREFIX}_STRICT": "1: any patch failure raises PatchError instead of being logged",
    f"{PREFIX}_MATRIX": "path of a compat_matrix.yaml to use instead of the shipped one",
    f"{PREFIX}_LOG": "log level of the npu_fsdp_patches logger: a Python level name (debug, info, warning, error, critical)",
}
#: set by the plugin itself and inherited by child processes (job_log.py); not a setting
SAID_VAR = f"{PREFIX}_SAID"
INTERNAL_VARS = (SAID_VAR,)


class Settings(NamedTuple):
    active: bool = True
    disable: frozenset = frozenset()
    disable_all: bool = False
    enable: frozenset = frozenset()
    strict: bool = False
    matrix_path: str | None = None
    log_level: str | None = None
    warnings: tuple = ()            # e.g. a misspelled NPU_FSDP_PATCHES_* variable, naming the closest
    kill_value: str = "0"           # the kill switch as the user wrote it (off, false, 0 ...), for messages

    @property
    def kill_switch(self) -> str:
        """``NPU_FSDP_PATCHES=off`` as it was set, for every message that names it."""
        return f"{PREFIX}={self.kill_value}"

    def unknown_names(self, known: set) -> list:
        """Names given in DISABLE/ENABLE that no patch has (sorted)."""
        return sorted((self.disable | self.enable) - set(known))

    def unknown_names_message(self, known: set) -> str | None:
        """The warning for unknown DISABLE/ENABLE names: each with the closest known name, then all
        known names; None when every name is known."""
        unknown = self.unknown_names(known)
        if not unknown:
            return None
        import difflib   # only a misconfiguration pays for it
        named = []
        for name in unknown:
            close = difflib.get_close_matches(name, sorted(known), n=1, cutoff=0.6)
            named.append(f"{name} (did you mean {close[0]}?)" if close else name)
        return (f"{PREFIX}_DISABLE/{PREFIX}_ENABLE name unknown patch(es) {', '.join(named)}; "
                f"known patches: {', '.join(sorted(known))}")


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
    log, log_warning = _log_level(environ)
    matrix = environ.get(f"{PREFIX}_MATRIX", "").strip() or None
    if matrix is not None:   # a spawned worker may start in another directory (os.chdir)
        matrix = os.path.abspath(os.path.expanduser(matrix))
    return Settings(active=_flag(environ, PREFIX, True), kill_value=(environ.get(PREFIX) or "").strip() or "0",
                    disable=disable, disable_all=disable_all,
                    enable=enable, strict=_flag(environ, f"{PREFIX}_STRICT", False),
                    matrix_path=matrix, log_level=log,
                    warnings=tuple(filter(None, [log_warning])) + misspelled_variables(environ))


def _log_level(environ: Mapping[str, str]) -> tuple:
    """(level or None, warning or None): a bad value is cosmetic, so the default level and one warning."""
    key = f"{PREFIX}_LOG"
    log = environ.get(key, "").strip().lower() or None
    if log is None or log in LOG_LEVELS:
        return log, None
    return None, (f"{key}={environ[key]!r} is not valid and is ignored (the default level, warning, is "
                  f"used; every patch still applies); accepted values: {', '.join(LOG_LEVELS)} "
                  "(Python level names, any case)")


def misspelled_variables(environ: Mapping[str, str]) -> tuple:
    """A warning for each set variable that looks like one of ours but is not (it would be ignored),
    naming the closest valid variable."""
    suspects = [key for key in environ if key.upper().startswith("NPU_FSDP") and key not in ENV_VARS
                and key not in INTERNAL_VARS]
    if not suspects:
        return ()
    import difflib   # only a misspelling pays for it
    found = []
    for key in sorted(suspects):
        close = difflib.get_close_matches(key.upper(), list(ENV_VARS), n=1, cutoff=0.6)
        hint = f"; did you mean {close[0]}?" if close else f"; valid variables: {', '.join(ENV_VARS)}"
        found.append(f"{key} is not a variable of npu_fsdp_patches and is ignored{hint}")
    return tuple(found)


def strict_requested(environ: Mapping[str, str]) -> bool:
    """Best-effort STRICT lookup used when the rest of the environment failed to parse."""
    return environ.get(f"{PREFIX}_STRICT", "").strip().lower() in ("1", "true", "yes", "on")
