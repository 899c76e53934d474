"""Rank-side code of tests/test_hp_fp32_args_lineage.py's recipe tests (issue 39): a user of
hyper-parallel's args-lineage ``BaseTrainer(args)`` (tests/fixtures/hyper_parallel_args), on which
``hp_fp32_main_params`` stands down, wraps by hand as
docs/main_params.md#8-hyper-parallels-args-lineage-trainer-wrapping-by-hand shows, on 2 ranks with a bf16
``fully_shard`` model.

The reference is hyper-parallel's own fp32 wrapper (the stand-in tests/fixtures/upstream_fp32_wrapper,
written apart from our code) over the same AdamW groups, driven through the same trainer steps: both
keep fp32 masters, so every step is compared bitwise.
"""
from __future__ import annotations

import os
import warnings
from types import SimpleNamespace

import torch
import torch.distributed as dist
import torch.nn.functional as F

from tests.multirank.main_params_cases import VOCAB, batch
from tests.multirank.upstream_interchange_cases import differences, sharded_model, snapshot, upstream_module
from tests.support import Checks

CHECKS = ("patch_stands_down", "recipe_wraps_the_trainers_optimizer", "steps_match_upstreams_wrapper",
          "small_updates_kept", "resume_bit_for_bit")


def args(world, lr=1e-3):
    return SimpleNamespace(
        model=SimpleNamespace(name="tiny", build_model_fn=lambda a: sharded_model(world)),
        train=SimpleNamespace(max_grad_norm=1.0, optimizer=SimpleNamespace(
            lr=lr, weight_decay=0.01, betas=(0.9, 0.95), eps=1e-8, foreach=False)))


def recipe_trainer(world, lr=1e-3):
    """docs/main_params.md#8: subclass, let the base build its AdamW, then wrap it."""
    from hyper_parallel.trainer.base import BaseTrainer

    from npu_fsdp_patches.optim import MainParamsOptimizer

    class Trainer(BaseTrainer):
        def _build_optimizer(self):
            super()._build_optimizer()
            self.optimizer = MainParamsOptimizer(self.optimizer, self.model)

    trainer = Trainer(args(world, lr))
    trainer._build_model()   # the model_fn casts to bf16 after fully_shard (apply_model_init_dtype)
    trainer._build_optimizer()
    return trainer


def upstream_trainer(world, lr=1e-3):
    from hyper_parallel.trainer.base import BaseTrainer
    up = upstream_module()
    trainer = BaseTrainer(args(world, lr))
    trainer._build_model()
    trainer._build_optimizer()
    chain = up.ChainedOptimizer(trainer.model, {"adamw": trainer.optimizer})
    trainer.optimizer = up.Float16OptimizerWithFloat16Params(chain, trainer.model)
    return trainer


def step(trainer, i, rank, world):
    """What the args-lineage LLMTrainer does around the base: loss, backward, then its step."""
    ids, targets = batch(i, rank, world)
    F.cross_entropy(trainer.model(ids).float().reshape(-1, VOCAB), targets.reshape(-1)).backward()
    trainer._optimizer_step_after_backward()
    return trainer


def snap(trainer):
    return snapshot(trainer.model, trainer.optimizer)


def two_ranks(rank, world, tmp):
    checks = Checks()
    ours = recipe_trainer(world)
    ref = upstream_trainer(world)

    @checks("patch_stands_down")
    def _():
        import npu_fsdp_patches
        record = {r["name"]: r for r in npu_fsdp_patches.status()}["hp_fp32_main_params"]
        assert record["state"] == "skipped" and "args lineage" in record["note"], record

    @checks("recipe_wraps_the_trainers_optimizer")
    def _():
        opt = ours.optimizer
        assert type(opt).__name__ == "MainParamsOptimizer", type(opt)
        assert [g["weight_decay"] for g in opt.param_groups] == [0.01, 0.0]   # the base's two groups
        assert all(g["foreach"] is False for g in opt.param_groups)          # its args reach torch
        low = [p for p in ours.model.parameters() if p.dtype == torch.bfloat16]
        assert low and all(p.main_param.dtype == torch.float32 for p in low)

    @checks("steps_match_upstreams_wrapper")
    def _():
        for i in range(3):
            step(ours, i, rank, world)
            step(ref, i, rank, world)
            bad = differences(snap(ref), snap(ours))
            assert not bad, f"step {i}: {bad}"

    @checks("small_updates_kept")
    def _():   # lr far below a bf16 ulp: only an fp32 main param holds the update
        small = recipe_trainer(world, lr=1e-7)
        before = snap(small)
        after = snap(step(small, 0, rank, world))
        assert all(torch.equal(before[n]["param"], after[n]["param"]) for n in ("proj1.weight", "lm_head.weight"))
        assert not all(torch.equal(before[n]["main"], after[n]["main"]) for n in ("proj1.weight", "lm_head.weight"))

    @checks("resume_bit_for_bit")
    def _():
        from npu_fsdp_patches.optim import load_checkpoint, save_checkpoint
        path = os.path.join(tmp, "args_recipe")
        save_checkpoint(path, ours.model, ours.optimizer)
        resumed = recipe_trainer(world, lr=1e-3)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            branch = load_checkpoint(path, resumed.model, resumed.optimizer)
        assert branch == "main_params" and not [w for w in caught if "fp32" in str(w.message)], branch
        bad = differences(snap(ours), snap(resumed))
        assert not bad, f"loaded: {bad}"
        bad = differences(snap(step(ours, 3, rank, world)), snap(step(resumed, 3, rank, world)))
        assert not bad, f"next step: {bad}"

    dist.barrier()
    return {"checks": checks.results}
