"""A PatchRecord owns its lifecycle transitions: the legal moves work, every other one raises, and no
product code outside records.py assigns a record's state."""
import ast
from pathlib import Path

import pytest

from npu_fsdp_patches.plan.decide import Decision
from npu_fsdp_patches.runtime.records import LEGAL, IllegalTransition, PatchRecord, State

REPO = Path(__file__).resolve().parents[2]
PRODUCT = [REPO / "npu_fsdp_patches", REPO / "patches"]
OWNER = REPO / "npu_fsdp_patches" / "runtime" / "records.py"
OPTIM = REPO / "npu_fsdp_patches" / "optim"

#: how a record moves into each state (nothing moves into DISABLED: it is only a starting state)
MOVES = {
    State.PENDING: lambda r: r.mark_pending(),
    State.APPLIED: lambda r: r.mark_applied(["m:f"]),
    State.SKIPPED: lambda r: r.mark_skipped("upstream has it"),
    State.FAILED: lambda r: r.mark_failed("boom"),
    State.REVERTED: lambda r: r.mark_reverted(None),
}


def record_in(state: State) -> PatchRecord:
    """A record brought to ``state`` through legal moves only."""
    if state is State.DISABLED:
        return PatchRecord("p", "s", Decision(False, "off"), ["m:f"])
    record = PatchRecord("p", "s", Decision(True, "on"), ["m:f"], state=State.PENDING)
    if state is not State.PENDING:
        MOVES[state](record)
    return record


def test_no_state_moves_back_to_disabled():
    assert all(State.DISABLED not in targets for targets in LEGAL.values())
    assert set(LEGAL) == set(State)


@pytest.mark.parametrize("start", list(State), ids=str)
@pytest.mark.parametrize("to", list(MOVES), ids=str)
def test_each_move_is_legal_exactly_when_the_table_lists_it(start, to):
    record = record_in(start)
    assert record.state is start
    if to in LEGAL[start]:
        MOVES[to](record)
        assert record.state is to
    else:
        with pytest.raises(IllegalTransition, match=f"patch p: ({start.value} -> {to.value}|skipped while installed)"):
            MOVES[to](record)
        assert record.state is start


def test_the_lifecycle_walk_of_one_patch():
    record = record_in(State.PENDING)
    record.mark_applied(["m:f", "m:g"])
    assert record.as_dict()["applied_targets"] == ["m:f", "m:g"]
    record.drop_targets(["m:f", "m:g"])
    record.mark_pending("m")                                  # its module left sys.modules
    assert (record.state, record.waiting_for) == (State.PENDING, ["m"])
    record.mark_applied(["m:f"])
    record.mark_reverted("m:g was replaced by someone else")
    assert record.as_dict()["state"] == "reverted" and record.applied_targets == []
    record.request(Decision(True, "requested by apply()", explicit=True))
    assert (record.state, record.error, record.decision.explicit) == (State.PENDING, None, True)
    record.mark_failed("boom")
    assert record.as_dict()["error"] == "boom"


def test_state_cannot_be_assigned_and_other_moves_check_where_they_start():
    record = record_in(State.APPLIED)
    with pytest.raises(AttributeError):
        record.state = State.DISABLED
    with pytest.raises(IllegalTransition):
        record.request(Decision(True, "again"))               # apply() skips an applied record
    with pytest.raises(IllegalTransition):
        record.decide_again(Decision(True, "late"), "note")   # only a disabled record is decided again
    with pytest.raises(IllegalTransition, match="without a target"):
        record_in(State.PENDING).mark_applied([])
    disabled = record_in(State.DISABLED)
    disabled.decide_again(Decision(True, "found late"), "decided again")
    assert disabled.state is State.DISABLED and disabled.note == "decided again"


def state_assignments(source: str, names: tuple = ("state", "_state")) -> list:
    """Line numbers where ``source`` assigns an attribute named in ``names``."""
    lines = []
    for node in ast.walk(ast.parse(source)):
        targets = (list(node.targets) if isinstance(node, ast.Assign) else
                   [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else [])
        while targets:
            target = targets.pop()
            if isinstance(target, (ast.Tuple, ast.List)):
                targets += target.elts
            elif isinstance(target, ast.Starred):
                targets.append(target.value)
            elif isinstance(target, ast.Attribute) and target.attr in names:
                lines.append(node.lineno)
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "setattr"
                and len(node.args) > 1 and isinstance(node.args[1], ast.Constant)
                and node.args[1].value in names):
            lines.append(node.lineno)
    return lines


def test_the_state_scan_finds_every_form_of_assignment():
    source = ("r.state = 1\nr.state, r.error = 1, 2\nr._state: int = 1\nsetattr(r, 'state', 1)\n"
              "r.state_of = 1\nopt.state[p] = 1\n")
    assert state_assignments(source) == [1, 2, 3, 4]


def test_nothing_outside_records_py_assigns_a_state():
    """``state`` and ``_state``. The numerics (optim/) are outside the scan: there ``state`` is torch's
    ``Optimizer.state`` (restored on a failed load, issue 29), and optim/ cannot reach a record at all."""
    found = {}
    for root in PRODUCT:
        for path in sorted(root.rglob("*.py")):
            if path != OWNER and OPTIM not in path.parents:
                lines = state_assignments(path.read_text())
                if lines:
                    found[str(path.relative_to(REPO))] = lines
    assert found == {}


def test_the_numerics_import_nothing_that_holds_a_record():
    """What makes leaving optim/ out of the scan above safe."""
    allowed = {"patch"}   # ``unpatched``: the original of a patched function, no record
    for path in sorted(OPTIM.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level >= 2:
                assert (node.module or "").split(".")[0] in allowed | {"optim"}, (path.name, node.module)
