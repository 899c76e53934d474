"""The per-patch status record that status(), doctor and the JSON report share."""
from __future__ import annotations

from enum import Enum

from .decide import Decision


class State(str, Enum):
    """A patch's lifecycle state; the value is what status(), doctor and the JSON report print."""

    PENDING = "pending"        # enabled, waiting for a target module to be imported
    APPLIED = "applied"
    SKIPPED = "skipped"        # the stand-down probe found the fix upstream
    FAILED = "failed"
    DISABLED = "disabled"      # the matrix or the environment says no
    REVERTED = "reverted"

    def __str__(self) -> str:
        return self.value


class PatchRecord:
    """Mutable: the runtime updates state, error and targets as hooks fire and patches revert."""

    def __init__(self, name: str, summary: str, decision: Decision, targets: list,
                 state: State = State.DISABLED):
        self.name, self.summary, self.decision, self.targets = name, summary, decision, targets
        self.state = State(state)
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
            "state": State(self.state).value,
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
