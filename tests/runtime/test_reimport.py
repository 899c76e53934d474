"""Revert and status tell the truth across a module deleted from sys.modules and imported again, and
a patch's swaps are atomic for other threads (issue 29; docs/design.md#37-validate-then-commit)."""
import json

import pytest

from tests.core_demo import run_demo
from tests.support import run_python

REIMPORT = """
import sys, npu_fsdp_patches, demo_target
old, Engine = demo_target, demo_target.Engine
del sys.modules["demo_target"]
{between}
import demo_target as new
r = records()["demo_shout"]
before = [new is not old, new.greet("x"), new.Engine().run(1), old.greet("x"), Engine().run(1),
          r["state"], r["applied_targets"], r["note"]]
npu_fsdp_patches.revert("demo_shout")
r = records()["demo_shout"]
emit(before=before, after=[old.greet("x"), Engine().run(1), new.greet("x"), new.Engine().run(1),
                           r["state"], r["error"], r["note"]])
"""


@pytest.mark.parametrize("between", ["", "records()"], ids=["no status call", "status while deleted"])
def test_a_module_imported_anew_is_patched_and_revert_restores_both(tmp_path, between):
    result, _ = run_demo(tmp_path, REIMPORT.format(between=between))
    assert result["before"][:5] == [True, "hello x!", 20, "hello x!", 20]   # new object patched, old kept
    assert result["before"][5:7] == ["applied", ["demo_target:greet", "demo_target:Engine.run"]]
    assert "earlier demo_target module object" in result["before"][7]
    assert result["after"] == ["hello x", 2, "hello x", 2, "reverted", None, None]


def test_torch_adam_reimported_is_patched_and_revert_restores_the_old_module(hyper_site):
    pytest.importorskip("torch")
    proc = run_python("""
import json, sys, torch, torch.optim.adam as old
import npu_fsdp_patches
ours = lambda f: getattr(f, "__npu_fsdp_patch__", None)
del sys.modules["torch.optim.adam"]
import torch.optim.adam as new
state = {x["name"]: x for x in npu_fsdp_patches.status()}["hp_skip_dispatch_adamw"]["state"]
before = [new is not old, ours(new.adam), ours(old.adam), state]
npu_fsdp_patches.revert("hp_skip_dispatch_adamw")
import inspect; step_globals = inspect.unwrap(torch.optim.Adam.step).__globals__["adam"]
print(json.dumps([before, ours(old.adam), ours(new.adam), ours(step_globals),
                  {x["name"]: x for x in npu_fsdp_patches.status()}["hp_skip_dispatch_adamw"]["state"]]))
""", paths=[hyper_site])
    before, old_after, new_after, step_after, state = json.loads(proc.stdout.splitlines()[-1])
    assert before == [True, "hp_skip_dispatch_adamw", "hp_skip_dispatch_adamw", "applied"]
    assert [old_after, new_after, step_after, state] == [None, None, None, "reverted"]


def test_other_threads_never_see_a_half_applied_patch(tmp_path):
    """A reader thread compares greet and Engine.run (two targets of one module) while the main
    thread reverts and applies again; switching threads every microsecond, a half-swapped state
    that lasts across two reads in a row is seen without the swap guard."""
    result, _ = run_demo(tmp_path, """
import sys, threading, npu_fsdp_patches, demo_target
ns, cls = vars(demo_target), vars(demo_target.Engine)
mixed, stop = [], threading.Event()
def patched():
    return (hasattr(ns["greet"], "__npu_fsdp_patch__"), hasattr(cls["run"], "__npu_fsdp_patch__"))
def reader():
    while not stop.is_set():
        a = patched(); b = patched()
        if a == b and a[0] != a[1]:
            mixed.append(a)
sys.setswitchinterval(1e-6)
t = threading.Thread(target=reader); t.start()
for _ in range(300):
    npu_fsdp_patches.revert("demo_shout")
    npu_fsdp_patches.apply("demo_shout")
stop.set(); t.join()
emit(mixed=len(mixed), state=records()["demo_shout"]["state"])
""")
    assert result == {"mixed": 0, "state": "applied"}
