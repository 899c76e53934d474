"""veomni's ``DistributedCheckpointer`` saves and resumes a MainParamsOptimizer run bit for bit,
``extra_state`` included, against the veomni 0.1.12 stand-in (tests/fixtures/veomni_dcp: its
``OptimizerState`` hands the optimizer to torch's get/set_optimizer_state_dict, as veomni does).

One process, a bf16 model plus an fp32 param on CPU, torch DCP without a process group: runs on
every verified torch. The real veomni 0.1.12 on 2 gloo ranks with FSDP2 is
tests/clients/test_veomni.py (CI step 40).
"""
import json

from tests.support import install_fixture, run_python

CODE = """
import json, tempfile
import torch
from torch import nn
from veomni.checkpoint.dcp_checkpointer import DistributedCheckpointer as C
from npu_fsdp_patches.optim import MainParamsOptimizer

root = tempfile.mkdtemp()

class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 3).to(torch.bfloat16)
        self.gain = nn.Parameter(torch.full((3,), 0.5))          # fp32: its own main param
    def forward(self, x):
        return self.lin(x).float() * self.gain

def build():
    torch.manual_seed(0)
    model = Net()
    return model, MainParamsOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-3), model)

def step(model, opt, i):
    x = torch.randn(2, 4, generator=torch.Generator().manual_seed(i)).to(torch.bfloat16)
    model(x).square().sum().backward()
    opt.step()
    opt.zero_grad()

def bits(t):
    t = t.detach()
    return t.view(torch.int16 if t.dtype == torch.bfloat16 else torch.int32).tolist() \\
        if t.is_floating_point() else t.tolist()

def tensors(model, opt):
    out = {f"p.{n}": bits(p) for n, p in model.named_parameters()}
    for model_param, state in opt.state.items():
        out.update({f"s.{opt.fqn(model_param)}.{k}": bits(v) for k, v in state.items()})
    return out

model, opt = build()
for i in range(2):
    step(model, opt, i)
saved = tensors(model, opt)
C.save(f"{root}/ckpt", {"model": model, "optimizer": opt, "extra_state": {"global_step": 2}}, global_steps=2)
for i in range(2, 4):
    step(model, opt, i)
straight = tensors(model, opt)

model2, opt2 = build()
state = C.load(f"{root}/ckpt/global_step_2", {"model": model2, "optimizer": opt2, "extra_state": {}})
R = {"extra": state["extra_state"], "keys": sorted(k for k in saved if k.endswith(".main_param")),
     "restored": tensors(model2, opt2) == saved}
R["tails"] = sum(int((model2.lin.weight.main_param != model2.lin.weight.float()).sum()) for _ in [0])
for i in range(2, 4):
    step(model2, opt2, i)
resumed = tensors(model2, opt2)
R["resumed"] = resumed == straight
R["compared"] = len(straight)
opt2.reload_model_params()          # negative control: main params re-derived from bf16 differ
R["rederived_differs"] = tensors(model2, opt2) != resumed
print(json.dumps(R))
"""


def test_veomni_checkpointer_resumes_a_main_params_run_bit_for_bit(tmp_path):
    site = install_fixture("veomni_dcp", tmp_path)
    out = json.loads(run_python(CODE, paths=[site]).stdout.splitlines()[-1])
    assert out["extra"] == {"global_step": 2}
    assert out["keys"] == ["s.lin.bias.main_param", "s.lin.weight.main_param"]   # none for fp32 gain
    assert out["restored"] is True and out["tails"] > 0
    assert out["resumed"] is True and out["compared"] == 14   # 3 params, 3 x 3 AdamW state, 2 main params
    assert out["rederived_differs"] is True
