"""Patch veomni_dcp_refuse_main_params against the veomni 0.1.12 stand-in (tests/fixtures/veomni_dcp).

One process, a bf16 model on CPU, torch DCP without a process group: runs on every verified torch.
The real veomni 0.1.12 on 2 gloo ranks with FSDP2 is tests/clients/test_veomni.py (CI step 40).
"""
import json

from tests.support import install_fixture, run_python

CODE = """
import json, os, tempfile
import torch
from torch import nn
import npu_fsdp_patches
from veomni.checkpoint.dcp_checkpointer import DistributedCheckpointer as C
from npu_fsdp_patches.optim import MainParamsOptimizer, save_checkpoint

PATCH = "veomni_dcp_refuse_main_params"
root = tempfile.mkdtemp()

def build(wrap):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 3)).to(torch.bfloat16)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return model, (MainParamsOptimizer(opt, model) if wrap else opt)

def step(model, opt):
    model(torch.ones(2, 4, dtype=torch.bfloat16)).float().square().sum().backward()
    opt.step()
    opt.zero_grad()

def tensors(model, opt):
    sd = opt.state_dict()
    out = {f"p.{k}": v.float().tolist() for k, v in model.state_dict().items()}
    for key, state in sd["state"].items():
        out.update({f"s.{key}.{k}": v.float().tolist() for k, v in state.items()})
    out.update({f"m.{k}": v.tolist() for k, v in sd.get("_mixed_precision_optimizer", {})
                .get("fp32_from_fp16_params", {}).items()})
    return out

def error(call):
    try:
        call()
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"

def listing(path):
    return sorted(os.path.relpath(os.path.join(d, n), path) for d, ds, fs in os.walk(path) for n in ds + fs)

def state():
    return {r["name"]: r["state"] for r in npu_fsdp_patches.status()}[PATCH]

R = {"state": state()}
model, opt = build(True)
step(model, opt)
R["save"] = error(lambda: C.save(f"{root}/save", {"model": model, "optimizer": opt,
                                                  "extra_state": {"step": 1}}, global_steps=1))
R["save_wrote"] = os.path.exists(f"{root}/save")
save_checkpoint(f"{root}/ours", model, opt)
step(model, opt)
before, files, extra = tensors(model, opt), listing(f"{root}/ours"), {}
R["load"] = error(lambda: C.load(f"{root}/ours", {"model": model, "optimizer": opt, "extra_state": extra}))
R["load_kept_state"] = tensors(model, opt) == before and extra == {}
R["load_kept_files"] = listing(f"{root}/ours") == files

plain = {}
for mode in ("patched", "reverted"):
    if mode == "reverted":
        npu_fsdp_patches.revert(PATCH)
    m, o = build(False)
    step(m, o)
    C.save(f"{root}/{mode}", {"model": m, "optimizer": o, "extra_state": {"step": 1}})
    m2, o2 = build(False)
    extra = {}
    loaded = C.load(f"{root}/{mode}", {"model": m2, "optimizer": o2, "extra_state": extra})
    plain[mode] = [state(), tensors(m, o) == tensors(m2, o2), tensors(m2, o2), loaded["extra_state"],
                   listing(f"{root}/{mode}")]
R["plain"] = plain
R["reverted_save"] = error(lambda: C.save(f"{root}/rev", {"model": model, "optimizer": opt,
                                                          "extra_state": {"step": 2}}))
R["reverted_wrote"] = listing(f"{root}/rev")
npu_fsdp_patches.apply(PATCH)
R["reapplied"] = [state(), error(lambda: C.load(f"{root}/ours", {"model": model, "optimizer": opt}))]
print(json.dumps(R))
"""


def test_refuses_main_params_before_writing_or_loading_and_leaves_plain_optimizers_alone(tmp_path):
    site = install_fixture("veomni_dcp", tmp_path)
    out = json.loads(run_python(CODE, paths=[site]).stdout.splitlines()[-1])
    assert out["state"] == "applied"
    for action in ("save", "load"):
        assert out[action].startswith(
            f"TypeError: veomni DistributedCheckpointer.{action} cannot checkpoint the optimizer "
            f"npu_fsdp_patches.optim.main_params.MainParamsOptimizer: its fp32 main params are not "
            f"model parameters, so torch DCP's get_optimizer_state_dict/set_optimizer_state_dict"), out
        assert "npu_fsdp_patches.optim.save_checkpoint(path, model, optimizer)" in out[action]
    assert "nothing was written to" in out["save"] and "nothing was loaded from" in out["load"]
    assert out["save_wrote"] is False
    assert out["load_kept_state"] is True and out["load_kept_files"] is True

    patched, reverted = out["plain"]["patched"], out["plain"]["reverted"]
    assert patched[0] == "applied" and reverted[0] == "reverted"
    assert patched[1] is True and reverted[1] is True       # round trip exact
    assert patched[2:] == reverted[2:]                      # same tensors, extra_state, files
    assert patched[3] == {"step": 1}

    # revert: the stand-in's (veomni's) own path fails inside dcp.save, after writing extra_state
    assert out["reverted_save"] in ("KeyError: '0.weight'", "KeyError: '0.bias'",
                                    "KeyError: '1.weight'", "KeyError: '1.bias'"), out["reverted_save"]
    assert out["reverted_wrote"][:2] == ["extra_state", "extra_state/extra_state_rank_0.pt"]
    assert out["reapplied"][0] == "applied"
    assert out["reapplied"][1].startswith("TypeError: veomni DistributedCheckpointer.load")
