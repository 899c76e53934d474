"""Frameworks that appear after activation (docs/design.md#33-detection).

Under autoload the plugin decides at ``import torch``; a launcher or notebook may put Megatron,
MindSpeed or TE on sys.path later. The module of each gated framework not found at activation is
watched (hooks.when_looked_up); when an import first looks it up, these functions detect it again and
decide again the disabled patches whose gate names it. The runtime arms what they enable.
"""
from __future__ import annotations

from typing import Mapping

from .decide import decide
from .detect import detect_all
from .matrix import Matrix
from .records import State


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
        record.decision = decide(spec, frameworks, settings)
        record.note = f"decided again after activation: {', '.join(appeared)} found when {module} was imported"
        if record.decision.enabled and name in runnable:
            record.state = State.PENDING
            enabled.append(name)
    return enabled
