"""Child side of tests/test_hp_fp32_main_params_patch.py: a small LM trained by the hyper-parallel
stand-in trainer in a fresh interpreter (see that module for what each result shows)."""
import importlib
import tempfile

import torch
from torch import nn

import npu_fsdp_patches


class LM(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(11, 8)
        self.proj = nn.Linear(8, 8)
        self.lm_head = nn.Linear(8, 11, bias=False)

    def forward(self, ids):
        return self.lm_head(torch.tanh(self.proj(self.embed(ids))))


def config(optimizer: str, reduce_dtype="float32"):
    mp = {"param_dtype": "bfloat16"} | ({"reduce_dtype": reduce_dtype} if reduce_dtype else {})
    return {"model_init_dtype": "bfloat16", "max_grad_norm": 1.0,
            "optimizer": {"name": optimizer, "fp32_main_params": True,
                          "muon_config": {"muon_lr": 0.02, "muon_weight_decay": 0.0},
                          "adamw_config": {"adamw_lr": 1e-6, "adamw_weight_decay": 0.0}},
            "fsdp_config": {"mix_precision": mp}}


def batch(step):
    g = torch.Generator().manual_seed(step)
    return torch.randint(0, 11, (4, 6), generator=g), torch.randint(0, 11, (4, 6), generator=g)


def train(trainer_module: str, optimizer: str) -> dict:
    """Bad configs, 3 steps, checkpoint and resume with ``trainer_module``'s BaseTrainer."""
    BaseTrainer = importlib.import_module(trainer_module).BaseTrainer
    out = {"state": {r["name"]: r["state"] for r in npu_fsdp_patches.status()}.get("hp_fp32_main_params"),
           "error": [r.get("error") for r in npu_fsdp_patches.status() if r["name"] == "hp_fp32_main_params"]}
    built = []
    for bad in (None, "bfloat16"):
        try:
            BaseTrainer(config(optimizer, bad), lambda: built.append(1) or LM())
        except ValueError as exc:
            out.setdefault("config_errors", []).append(str(exc))
    out["models_built_for_bad_configs"] = len(built)

    trainer = BaseTrainer(config(optimizer), LM)
    out["optimizer"] = type(trainer.optimizer).__name__
    head = trainer.model.lm_head.weight
    start = head.detach().clone()
    for step in range(3):
        trainer.train_step(*batch(step))
    out["head_changed"] = not torch.equal(start, head)     # lr 1e-6: below half a bf16 ulp
    out["head_main_changed"] = (not torch.equal(head.main_param, start.float())
                                if hasattr(head, "main_param") else None)   # kept by the fp32 main param
    out["model_is_cast_main"] = all(torch.equal(p, p.main_param.to(p.dtype)) if p.main_param is not p else True
                                    for p in trainer.model.parameters()) if hasattr(head, "main_param") else None
    if hasattr(head, "main_param"):
        ckpt = tempfile.mkdtemp()
        trainer.save_checkpoint(ckpt)
        saved = {n: p.main_param.detach().clone() for n, p in trainer.model.named_parameters()}
        fresh = BaseTrainer(config(optimizer), LM)
        out["load_branch"] = fresh.load_checkpoint(ckpt)
        out["mains_restored"] = all(torch.equal(p.main_param, saved[n]) for n, p in fresh.model.named_parameters())
        a, b = trainer.train_step(*batch(3)), fresh.train_step(*batch(3))
        out["resume_loss_equal"] = a == b
    return out
