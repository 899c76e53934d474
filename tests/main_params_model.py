"""The small Muon + AdamW model the single-process MainParamsOptimizer tests share."""
import torch
from torch import nn

from npu_fsdp_patches.optim import MainParamsOptimizer, apply_model_init_dtype
from npu_fsdp_patches.optim.muon_routing import OptimizerChain, build_muon_adamw, split_muon_adamw_params
from tests.torch_versions import HAS_MUON


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(6, 4)
        self.body = nn.Linear(4, 5)
        self.lm_head = nn.Linear(5, 6, bias=False)
        self.register_buffer("steps", torch.zeros(2, dtype=torch.int32))
        self.register_buffer("mask", torch.ones(2, dtype=torch.bool))
        self.register_buffer("scale", torch.ones(4))

    def forward(self, ids):
        return self.lm_head(torch.tanh(self.body(self.embed(ids) * self.scale)))


def make(dtype=torch.bfloat16, seed=0):
    """Muon + AdamW by the routing rule, wrapped (see :func:`make_chain`)."""
    model, chain = make_chain(dtype, seed)
    return model, chain, MainParamsOptimizer(chain, model)


def make_chain(dtype=torch.bfloat16, seed=0):
    """A model and its unwrapped Muon + AdamW chain by the routing rule. Without torch.optim.Muon
    (torch < 2.9) the Muon-routed params get a momentum SGD, which keeps a ``momentum_buffer`` state
    as Muon does."""
    torch.manual_seed(seed)
    model = apply_model_init_dtype(Net(), dtype)
    if HAS_MUON:
        chain = build_muon_adamw(model, muon_kwargs={"lr": 0.02}, adamw_kwargs={"lr": 1e-3})
    else:
        muon, adamw = split_muon_adamw_params(model.named_parameters())
        chain = OptimizerChain({"adamw": torch.optim.AdamW(adamw, lr=1e-3),
                                "muon": torch.optim.SGD(muon, lr=0.02, momentum=0.95)})
    return model, chain


def backward(model, seed=0):
    ids = torch.randint(0, 6, (3, 4), generator=torch.Generator().manual_seed(seed))
    model(ids).float().pow(2).mean().backward()
