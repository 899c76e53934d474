"""The per-patch status record that status(), doctor and the JSON report share.

A record owns its lifecycle transitions (docs/design.md#35-status-and-doctor): the lifecycle asks it to
move (``mark_applied``, ``mark_failed``, ...), and a move the table below does not list is a bug in the
plugin, raised as :class:`IllegalTransition`, never a silent state.
"""
from __future__ import annotations

from enum import Enum

from ..plan.decide import Decision
from ..process_state import kept


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


State = kept("State", lambda: State)   # records compare states by identity: one enum per process, reloads included
_P, _A, _S, _F, _D, _R = State.PENDING, State.APPLIED, State.SKIPPED, State.FAILED, State.DISABLED, State.REVERTED

#: state -> the states it may move to. FAILED is reachable from every state a hook may still be working
#: on (patch code runs unlocked, so a revert or a stand-down can land between its build and its failure).
LEGAL = {
    _P: frozenset({_P, _A, _S, _F, _R}),
    _A: frozenset({_A, _P, _F, _R}),      # PENDING: its module left sys.modules
    _S: frozenset({_P, _F, _R}),          # PENDING: apply() asked again
    _F: frozenset({_P, _F, _R}),
    _D: frozenset({_P}),                  # apply() asked, or a framework appeared after activation
    _R: frozenset({_P, _F, _R}),          # REVERTED: a target someone replaced is still registered
}


class IllegalTransition(RuntimeError):
    """A record was asked for a move that :data:`LEGAL` does not list: a bug in the plugin."""


IllegalTransition = kept("IllegalTransition", lambda: IllegalTransition)


class PatchRecord:
    """Mutable status of one patch. Only the methods below change ``state``; the lifecycle still
    keeps the target lists (waiting_for, stale_refs, notes) as hooks fire and patches revert."""

    def __init__(self, name: str, summary: str, decision: Decision, targets: list,
                 state: State = State.DISABLED):
        self.name, self.summary, self.decision, self.targets = name, summary, decision, targets
        self._state = State(state)
        self.error: str | None = None
        self.note: str | None = None                  # e.g. "upstream has it (probe handles_dtensor)"
        self.applied_targets: list = []
        self.waiting_for: list = []
        self.imported_before_activation: list = []
        self.stale_refs: dict = {}                     # target symbol -> modules holding the original
        self.provenance: dict | None = None            # loader.Provider.as_dict(): who ships the code

    @property
    def state(self) -> State:
        return self._state

    @property
    def live(self) -> bool:
        """Pending or applied: a hook may still apply (more of) it."""
        return self._state in (State.PENDING, State.APPLIED)

    def _move(self, to: State) -> None:
        if to not in LEGAL[self._state]:
            raise IllegalTransition(f"patch {self.name}: {self._state.value} -> {to.value} is not a legal "
                                    "transition (a bug in npu_fsdp_patches)")
        self._state = to

    def request(self, decision: Decision) -> None:
        """apply() asked for it: its decision, a clean slate, and pending again (an applied one stays)."""
        if self._state is State.APPLIED:
            raise IllegalTransition(f"patch {self.name}: apply() requested an applied record again")
        self._move(State.PENDING)
        self.decision, self.error, self.note = decision, None, None

    def decide_again(self, decision: Decision, note: str) -> None:
        """A framework appeared after activation: a disabled record's new decision (still disabled)."""
        if self._state is not State.DISABLED:
            raise IllegalTransition(f"patch {self.name}: only a disabled record is decided again, "
                                    f"not a {self._state.value} one")
        self.decision, self.note = decision, note

    def mark_pending(self, waiting_for: str | None = None) -> None:
        """Wait for a target module (again); ``waiting_for`` joins the modules it waits for."""
        self._move(State.PENDING)
        if waiting_for is not None and waiting_for not in self.waiting_for:
            self.waiting_for.append(waiting_for)

    def mark_applied(self, symbols: list) -> None:
        """Targets installed now (others may be installed already); at least one target is ours."""
        if not (symbols or self.applied_targets):
            raise IllegalTransition(f"patch {self.name}: applied without a target")
        self._move(State.APPLIED)
        for symbol in symbols:
            if symbol not in self.applied_targets:
                self.applied_targets.append(symbol)

    def mark_skipped(self, note: str) -> None:
        """The stand-down probe found the fix upstream; nothing of ours is installed."""
        if self.applied_targets:
            raise IllegalTransition(f"patch {self.name}: skipped while installed at {self.applied_targets}")
        self._move(State.SKIPPED)
        self.note = note

    def mark_failed(self, error: str) -> None:
        self._move(State.FAILED)
        self.error = error

    def mark_reverted(self, error: str | None) -> None:
        """The originals are back (``error``: what could not be restored, if anything)."""
        self._move(State.REVERTED)
        self.applied_targets, self.stale_refs, self.error = [], {}, error

    def drop_targets(self, symbols: list) -> None:
        """Targets no longer ours (module dropped, attribute replaced); the caller decides the state."""
        for symbol in symbols:
            self.applied_targets.remove(symbol)

    def as_dict(self) -> dict:
        return {
            "name": self.name,
            "summary": self.summary,
            "decision": "enabled" if self.decision.enabled else "disabled",
            "reason": self.decision.reason,
            "explicit": self.decision.explicit,
            "state": self._state.value,
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
