"""Child side of tests/test_hp_fp32_args_lineage.py: the args-lineage trainer stand-in
(tests/fixtures/hyper_parallel_args) built and stepped with the plugin active."""
import contextlib
import io
from types import SimpleNamespace

import torch
from torch import nn

import npu_fsdp_patches


def _args(foreach):
    def build(args):
        torch.manual_seed(0)
        return nn.Sequential(nn.Embedding(11, 8), nn.Linear(8, 11))
    return SimpleNamespace(
        model=SimpleNamespace(name="tiny", build_model_fn=build),
        train=SimpleNamespace(max_grad_norm=1.0, optimizer=SimpleNamespace(
            lr=1e-3, weight_decay=0.01, betas=(0.9, 0.95), eps=1e-8, foreach=foreach)))


def _cli(*argv):
    from npu_fsdp_patches.cli.commands import main
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        main(list(argv))
    return buf.getvalue()


def run() -> dict:
    from hyper_parallel.trainer.base import BaseTrainer
    record = {r["name"]: r for r in npu_fsdp_patches.status()}["hp_fp32_main_params"]
    out = {"state": record["state"], "note": record.get("note"), "error": record.get("error"), "steps": []}
    for construct in ("positional", "keyword"):
        args = _args(foreach=False)
        trainer = BaseTrainer(args) if construct == "positional" else BaseTrainer(args=args)
        trainer._build_model()
        trainer._build_optimizer()
        ids = torch.randint(0, 11, (2, 5), generator=torch.Generator().manual_seed(1))
        before = [p.detach().clone() for p in trainer.model.parameters()]
        trainer.model(ids).float().pow(2).mean().backward()
        trainer._optimizer_step_after_backward()
        out["steps"].append({
            "construct": construct, "optimizer": type(trainer.optimizer).__name__,
            "foreach": [g["foreach"] for g in trainer.optimizer.param_groups],
            "moved": all(not torch.equal(a, p) for a, p in zip(before, trainer.model.parameters()))})
    out["explain"] = _cli("explain", "hp_fp32_main_params")
    out["doctor"] = _cli("doctor")
    return out
