"""Frameworks that appear after activation (docs/design.md#33-detection).

Under autoload the plugin decides at ``import torch``; a launcher or notebook may put Megatron,
MindSpeed or TE on sys.path later. The module of each gated framework not found at activation is
watched (hooks.when_looked_up); when an import first looks it up, these functions detect it again and
decide again the disabled patches whose gate names it, and :class:`LateDetection` arms what they enable.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Mapping

from ..plan.decide import decide
from ..plan.detect import detect_all
from ..plan.matrix import Matrix
from ..plugin_log import log
from . import hooks
from .records import State

if TYPE_CHECKING:
    from .lifecycle import Lifecycle


def watched_modules(matrix: Matrix, frameworks: Mapping) -> dict:
    """module -> names of the gated frameworks with that module that were not found."""
    gated = {c.framework for spec in matrix.patches.values() for alt in spec.gate for c in alt}
    watched: dict = {}
    for name in sorted(gated):
        module = matrix.frameworks[name].module
        if module and not frameworks[name].installed:
            watched.setdefault(module, []).append(name)
    return watched


def detect_again(matrix: Matrix, names: list, module: str) -> dict:
    """name -> Detected for each of ``names`` found now, its note saying when it was found."""
    found = detect_all(matrix.frameworks[n] for n in names)
    return {name: info._replace(note="; ".join(filter(None, (
                f"found after activation, when {module} was first looked up", info.note))))
            for name, info in found.items() if info.installed}


def decide_again(matrix: Matrix, records: Mapping, frameworks: Mapping, settings, runnable,
                 appeared: list, module: str) -> list:
    """Decide again every disabled patch whose gate names a framework in ``appeared``; return those
    that are enabled now and have code (``runnable``), their records set to pending."""
    enabled = []
    for name, record in records.items():
        spec = matrix.patches[name]
        if record.state != State.DISABLED or not {c.framework for a in spec.gate for c in a} & set(appeared):
            continue
        record.decide_again(decide(spec, frameworks, settings),
                            f"decided again after activation: {', '.join(appeared)} found when {module} was imported")
        if record.decision.enabled and name in runnable:
            record.mark_pending()
            enabled.append(name)
    return enabled


class LateDetection:
    """The frameworks as detected now (the plan's, updated by late finds) and what was found late.

    ``found``: one dict per framework found after activation: framework, module, before, after
    (Detected.as_dict) and the patches enabled then."""

    def __init__(self, life: Lifecycle) -> None:
        self._life = life
        self.frameworks: dict = dict(life.plan.frameworks)
        self.found: list = []
        self._watched: dict = {}             # framework module -> frameworks not found at activation

    def watch(self) -> None:
        """Watch the module of each gated framework not found now."""
        self._watched = watched_modules(self._life.plan.matrix, self.frameworks)
        for module in self._watched:
            hooks.when_looked_up(module, self._looked_up)

    def _looked_up(self, module: str) -> bool:
        """An import looks for a watched framework module: detect its frameworks again, decide again the
        patches they gate and arm those enabled now. True when none of them is left to watch."""
        life, plan = self._life, self._life.plan
        with life.lock:
            names = self._watched.get(module, [])
            found = detect_again(plan.matrix, names, module)
            self._watched[module] = [n for n in names if n not in found]
            enabled: list = []
            for name, after in found.items():
                self.found.append({"framework": name, "module": module, "enabled": enabled,
                                   "before": self.frameworks[name].as_dict(), "after": after.as_dict()})
                self.frameworks[name] = after
            if found:
                enabled += decide_again(plan.matrix, life.records, self.frameworks, plan.settings,
                                        plan.providers, list(found), module)
                log.info("%s found after activation (%s imported); enabled now: %s", ", ".join(found), module,
                         ", ".join(enabled) or "none")
        failures = life.arm_all(enabled)   # patch code: no lock
        if failures:
            raise failures[0]
        return not self._watched[module]
