"""The per-patch status record that status(), doctor and the JSON report share."""
from __future__ import annotations

from dataclasses import dataclass, field

from .decide import Decision

STATES = ("pending", "applied", "skipped", "failed", "disabled", "reverted")


@dataclass
class PatchRecord:
    name: str
    summary: str
    decision: Decision
    targets: list
    state: str = "disabled"
    error: str | None = None
    note: str | None = None                 # e.g. "upstream has it (probe handles_dtensor)"
    applied_targets: list = field(default_factory=list)
    waiting_for: list = field(default_factory=list)
    imported_before_activation: list = field(default_factory=list)
    stale_refs: dict = field(default_factory=dict)   # target symbol -> modules holding the original

    def as_dict(self) -> dict:
        return {
            "name": self.name,
            "summary": self.summary,
            "decision": "enabled" if self.decision.enabled else "disabled",
            "reason": self.decision.reason,
            "explicit": self.decision.explicit,
            "state": self.state,
            "error": self.error,
            "note": self.note,
            "targets": list(self.targets),
            "applied_targets": list(self.applied_targets),
            "waiting_for": list(self.waiting_for),
            "verified": self.decision.verified,
            "unverified": list(self.decision.unverified),
            "imported_before_activation": list(self.imported_before_activation),
            "stale_refs": {k: list(v) for k, v in self.stale_refs.items()},
        }
