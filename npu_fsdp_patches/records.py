"""The per-patch status record that status(), doctor and the JSON report share."""
from __future__ import annotations

from .decide import Decision

STATES = ("pending", "applied", "skipped", "failed", "disabled", "reverted")


class PatchRecord:
    """Mutable: the runtime updates state, error and targets as hooks fire and patches revert."""

    def __init__(self, name: str, summary: str, decision: Decision, targets: list, state: str = "disabled"):
        self.name, self.summary, self.decision, self.targets, self.state = name, summary, decision, targets, state
        self.error: str | None = None
        self.note: str | None = None                  # e.g. "upstream has it (probe handles_dtensor)"
        self.applied_targets: list = []
        self.waiting_for: list = []
        self.imported_before_activation: list = []
        self.stale_refs: dict = {}                     # target symbol -> modules holding the original
        self.provenance: dict | None = None            # loader.Provider.as_dict(): who ships the code

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
            "provenance": dict(self.provenance) if self.provenance else None,
        }
