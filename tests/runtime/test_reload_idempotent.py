"""Reloading the plugin never applies a patch twice, and one revert restores the original (issue 28).

Each case runs in a fresh interpreter against the core_demo fixture: activate with the target imported,
reload the plugin one way (``importlib.reload`` of the package, of its runtime and lifecycle modules, or
every ``npu_fsdp_patches*`` entry dropped from ``sys.modules`` and imported again), import the target
again, then check that the target is wrapped exactly once and that one revert gives back the very
original objects. The runtime is kept per process (npu_fsdp_patches/process_state.py). One case does
the same with torch's adam functions, patched at ``import torch``.
"""
import json

import pytest

from tests.core_demo import run_demo
from tests.support import install_fixture, run_python

#: the modules of the runtime, reloaded callers first (a module reloaded before those it imports from is
#: the hard order: the modules that imported from it keep the old objects)
RUNTIME_MODULES = ("runtime", "lifecycle", "install", "registry", "records", "hooks", "errors")

RELOADS = {
    "package": "importlib.reload(npu_fsdp_patches)",
    "runtime modules": (f"for name in {RUNTIME_MODULES!r}:\n"
                        "    if 'npu_fsdp_patches.' + name in sys.modules:\n"
                        "        importlib.reload(sys.modules['npu_fsdp_patches.' + name])\n"
                        "importlib.reload(npu_fsdp_patches)"),
    "every module": ("for name in [m for m in sys.modules if m.startswith('npu_fsdp_patches')]:\n"
                     "    importlib.reload(sys.modules[name])"),
    "sys.modules": ("for name in [m for m in sys.modules if m.startswith('npu_fsdp_patches')]:\n"
                    "    del sys.modules[name]\n"
                    "import npu_fsdp_patches"),
}

CASE = """
import importlib
def ours(f):
    layers = 0
    while hasattr(f, "__npu_fsdp_patch__"):
        layers, f = layers + 1, f.__wrapped__
    return layers, f
def targets():
    import demo_target
    return demo_target.greet, vars(demo_target.Engine)["run"]
{before}
import npu_fsdp_patches
{reload}
{reload}
{after}
live = targets()
originals = [ours(f)[1] for f in live]
import demo_target
called = (demo_target.greet("x"), demo_target.Engine().run(1))
try:
    npu_fsdp_patches.apply("no_such_patch")
    caught = "nothing raised"
except npu_fsdp_patches.PatchError:
    caught = "PatchError"
npu_fsdp_patches.revert("demo_shout")
emit(layers=[ours(f)[0] for f in live], called=called, caught=caught,
     state=records()["demo_shout"]["state"], reverted=(demo_target.greet("x"), demo_target.Engine().run(1)),
     identical=[f is o for f, o in zip(targets(), originals)],
     first=[f is o for f, o in zip(targets(), first)] if first else None)
"""

#: the target imported before activation (its originals captured first), or only after the reloads
WHEN = {
    "target first": ("first = targets()", ""),
    "target after reload": ("first = None", "import demo_target"),
}


@pytest.mark.parametrize("when", sorted(WHEN))
@pytest.mark.parametrize("how", sorted(RELOADS))
def test_reload_applies_once_and_one_revert_restores(tmp_path, how, when):
    before, after = WHEN[when]
    result, _ = run_demo(tmp_path, CASE.format(reload=RELOADS[how], before=before, after=after))
    assert result["layers"] == [1, 1], result          # one replacement over the original, not two
    assert result["called"] == ["hello x!", 20]
    assert result["caught"] == "PatchError"            # the class callers catch is the one raised
    assert result["state"] == "reverted"
    assert result["reverted"] == ["hello x", 2]        # one revert: no layer left
    assert result["identical"] == [True, True]
    assert result["first"] in (None, [True, True])     # the very objects seen before activation


TORCH_CASE = """
import importlib, json, sys
import torch   # torch's autoload activates the plugin, which patches torch.optim's adam functions
from npu_fsdp_patches.patch import unpatched
def layers(f):
    count = 0
    while hasattr(f, "__npu_fsdp_patch__"):
        count, f = count + 1, f.__wrapped__
    return count
def live(symbols):
    out = []
    for symbol in symbols:
        module, _, name = symbol.partition(":")
        out.append(getattr(sys.modules[module], name))
    return out
import npu_fsdp_patches
record = {r["name"]: r for r in npu_fsdp_patches.status()}["hp_skip_dispatch_adamw"]
symbols = record["applied_targets"]
originals = [unpatched(f) for f in live(symbols)]
for name in [m for m in sys.modules if m.startswith("npu_fsdp_patches")]:
    del sys.modules[name]
import npu_fsdp_patches
importlib.reload(npu_fsdp_patches)
wrapped = [layers(f) for f in live(symbols)]
npu_fsdp_patches.revert("hp_skip_dispatch_adamw")
print(json.dumps({"state": record["state"], "symbols": len(symbols), "layers": wrapped,
                  "restored": [f is o for f, o in zip(live(symbols), originals)]}))
"""


def test_reload_after_torch_autoload_wraps_torch_adam_once(tmp_path):
    """The same with torch's own adam functions, patched by hp_skip_dispatch_adamw at ``import torch``
    (the hyper-parallel stand-in enables it)."""
    site = install_fixture("hyper_parallel_new", tmp_path)
    result = json.loads(run_python(TORCH_CASE, paths=[site], timeout=240).stdout.splitlines()[-1])
    assert result["state"] == "applied" and result["symbols"] >= 4, result
    assert result["layers"] == [1] * result["symbols"], result
    assert result["restored"] == [True] * result["symbols"], result
