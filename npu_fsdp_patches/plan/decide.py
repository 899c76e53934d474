"""Pure decision functions: (matrix entry, detected frameworks, settings) -> enabled or not, and why."""
from __future__ import annotations

from typing import Mapping, NamedTuple

from .detect import Detected
from .matrix import STAND_IN, Condition, PatchSpec
from .settings import PREFIX, Settings
from .versions import VersionBounds, release_of


class Decision(NamedTuple):
    enabled: bool
    reason: str
    explicit: bool = False          # forced by ENABLE or apply(): a failure raises
    verified: bool | None = None    # installed versions all in the tested set (None: nothing installed to check)
    unverified: tuple = ()          # "name version" of installed versions outside the tested set

    def as_dict(self) -> dict:
        return self._asdict()


def display_name(fw: Detected) -> str:
    return fw.distribution or fw.name.replace("_", "-")


def _describe(fw: Detected) -> str:
    text = f"{display_name(fw)} {fw.version or '(unknown version)'}"
    return f"{text} ({fw.flavor})" if fw.flavor else text


def check_condition(cond: Condition, fw: Detected) -> tuple:
    """Return (holds, human reason) for one framework condition."""
    if not cond.installed:
        return (not fw.installed,
                f"{display_name(fw)} absent" if not fw.installed else f"{_describe(fw)} is installed")
    if not fw.installed:
        if fw.source == "meta package only":
            return False, f"{display_name(fw)} {fw.version} is only the meta package: not importable"
        return False, f"{display_name(fw)} not installed"
    if cond.flavor is not None and fw.flavor is None:
        return False, f"{_describe(fw)}: flavour unknown, not {cond.flavor} ({fw.flavor_rule or 'no flavour rule'})"
    if cond.flavor is not None and fw.flavor != cond.flavor:
        return False, f"{_describe(fw)} is not the {cond.flavor} flavor"
    if cond.version is None:
        return True, f"{_describe(fw)} installed" + (f": {cond.note}" if cond.note else "")
    if fw.version is None:
        return False, f"{display_name(fw)} version unknown ({fw.source})"
    try:
        release = gate_version(fw.version)
    except ValueError:   # packaging's InvalidVersion
        return False, f"{display_name(fw)} version {fw.version!r} is not a PEP 440 version"
    if isinstance(cond.version, VersionBounds):
        matches = cond.version.holds_for(release)
    else:                # a packaging SpecifierSet built elsewhere
        from packaging.version import Version
        matches = cond.version.contains(Version(release), prereleases=True)
    verb = "matches" if matches else "does not match"
    counted = f", counted as {release}," if release != public_version(fw.version) else ""   # a local label changes nothing
    text = f"{_describe(fw)}{counted} {verb} {cond.version}"
    return matches, f"{text}: {cond.note}" if matches and cond.note else text


def gate_version(version: str) -> str:
    """The version a gate bound is compared with: the release segment of ``version`` (and its epoch).

    Under PEP 440 ``<2.14`` excludes ``2.14.0.dev0``, and ``>=2.14`` excludes it too (a pre-release
    matches only where the specifier asks for pre-releases), so a nightly or source build at a split
    edge fell through both sides. The rule (docs/design.md#341-versions-at-gate-edges): ``X.devN``,
    ``XaN``/``XbN``/``XrcN``, ``X.postN`` and ``X+local`` all count as ``X``; a build that predates
    X's fix is caught by the stand-down probe of the patch on X's side, which checks the code itself.
    Raises ValueError (packaging's InvalidVersion) for a string that is not PEP 440.
    """
    return release_of(version)


def evaluate_gate(spec: PatchSpec, frameworks: Mapping[str, Detected]) -> tuple:
    """Return (enabled, reason, index of the matching alternative or None)."""
    failures = []
    for index, alternative in enumerate(spec.gate):
        results = [check_condition(c, frameworks[c.framework]) for c in alternative]
        if all(ok for ok, _ in results):
            return True, "; ".join(text for _, text in results), index
        failures.append(next(text for ok, text in results if not ok))
    return False, " / ".join(dict.fromkeys(failures)) or "empty gate", None


def verification(spec: PatchSpec, frameworks: Mapping[str, Detected], alternative: int | None) -> tuple:
    """(all verified?, unverified list) over the installed frameworks the gate relies on."""
    alternatives = [spec.gate[alternative]] if alternative is not None else list(spec.gate)
    names = dict.fromkeys(c.framework for alt in alternatives for c in alt if c.installed)
    installed = [frameworks[n] for n in names if frameworks[n].installed]
    if not installed:
        return None, ()
    unverified = tuple(_describe(fw) + ("; the suite ran only a stand-in of it" if is_verified(entries, fw, True)
                                        else "")
                       for fw in installed for entries in [spec.verified.get(fw.name, ())]
                       if not is_verified(entries, fw))
    return not unverified, unverified


def is_verified(entries: tuple, fw: Detected, stand_in: bool = False) -> bool:
    """Whether the suite ran this version (of this flavour: ``2.13.0 [nvidia]``; a plain entry, any); with
    ``stand_in``, whether it ran only a test stand-in of it (``0.1.0 [npu] (stand-in)``), which does not
    make the installed package verified."""
    version, mark = public_version(fw.version), STAND_IN if stand_in else ""
    return f"{version}{mark}" in entries or (fw.flavor is not None and f"{version} [{fw.flavor}]{mark}" in entries)


def public_version(version: str | None) -> str | None:
    """``version`` without its local label: torch's ``2.6.0+cu124`` and ``2.13.0+cpu`` are the
    verified ``2.6.0`` and ``2.13.0`` (the label names the build, not the release)."""
    return version.split("+", 1)[0] if version else version


def decide(spec: PatchSpec, frameworks: Mapping[str, Detected], settings: Settings) -> Decision:
    """The enable/disable decision for one patch; the order of the checks is the precedence."""
    if not settings.active:
        return Decision(False, f"{settings.kill_switch} (kill switch)")
    if spec.name in settings.enable:
        _, _, alternative = evaluate_gate(spec, frameworks)
        verified, unverified = verification(spec, frameworks, alternative)
        return Decision(True, f"forced by {PREFIX}_ENABLE", True, verified, unverified)
    if spec.name in settings.disable or settings.disable_all:
        return Decision(False, f"disabled by {PREFIX}_DISABLE")
    enabled, reason, alternative = evaluate_gate(spec, frameworks)
    verified, unverified = verification(spec, frameworks, alternative) if enabled else (None, ())
    return Decision(enabled, reason, False, verified, unverified)


def requested_by_apply(spec: PatchSpec, frameworks: Mapping[str, Detected]) -> Decision:
    """The decision behind ``npu_fsdp_patches.apply(name)``: enabled whatever the gate says, and
    explicit (a failure raises); verified over every installed framework the gate names."""
    _, unverified = verification(spec, frameworks, None)
    return Decision(True, "requested by apply()", True, not unverified, unverified)
