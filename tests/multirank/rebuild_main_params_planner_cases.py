"""Rank-side code of tests/test_rebuild_main_params_planner.py: ``RebuildMainParamsPlanner`` with torch's
own DCP and state-dict API on 2 gloo ranks, no framework.

A bf16 ``fully_shard`` model (the self-test's: uneven shards, a 1-element gain with an empty shard on
rank 1) trains with plain AdamW and is saved as torch's API writes it. The fp32-masters resume loads
that checkpoint into a fresh ``MainParamsOptimizer`` through the planner and must continue exactly as
the plain run's live state handed to a wrapper in memory at the same step (torch's state-dict API, no
DCP: main params rebuilt from the bf16 model, moments and step count carried over). Grads are drawn per
step, not computed (no FSDP2 forward/backward, which CPU torch 2.6 cannot run), so every verified torch
runs the launch.
"""
from __future__ import annotations

import warnings

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (get_model_state_dict, get_optimizer_state_dict,
                                                     set_model_state_dict, set_optimizer_state_dict)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from npu_fsdp_patches.optim import (MainParamsOptimizer, RebuildMainParamsPlanner, apply_model_init_dtype,
                                    drop_main_params)
from npu_fsdp_patches.optim._leaf_views import MAIN_PARAM
from npu_fsdp_patches.optim._main_params_state import MAIN_PARAMS_KEY, MP_KEY
from npu_fsdp_patches.selftest.checks.main_params import TinyLM
from tests.multirank.dtensors import distribute_same
from tests.multirank.main_params_cases import full
from tests.support import Checks, bit_mismatches

CHECKS = ("default_planner_refuses_plain", "plain_loads_with_warnings", "loaded_state_is_the_plain_runs",
          "resume_equals_in_memory_switch", "comparison_sees_one_ulp", "wrapped_checkpoint_loads_exactly",
          "partial_refused_before_writing", "section_refused_before_writing", "other_missing_keys_still_refused")
ADAMW = {"lr": 1e-3, "weight_decay": 0.01}
SAVE_AFTER, STEPS = 2, 4


def build(world: int, wrap: bool):
    torch.manual_seed(1234)
    model = TinyLM()
    mesh = init_device_mesh("cpu", (world,))
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for sub in (model.proj1, model.proj2):
        fully_shard(sub, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    apply_model_init_dtype(model, torch.bfloat16)
    opt = torch.optim.AdamW(model.parameters(), **ADAMW)
    return model, (MainParamsOptimizer(opt, model) if wrap else opt)


def train(model, opt, steps: range) -> None:
    """Each step's grads drawn from its own seed (bf16, sharded like the params), then a step."""
    for step in steps:
        g = torch.Generator().manual_seed(200 + step)
        for p in model.parameters():
            grad = torch.randn(p.shape, generator=g).to(p.dtype)
            p.grad = distribute_same(grad, p.device_mesh, p.placements)
        opt.step()
        opt.zero_grad()


def snapshot(model, opt) -> dict:
    """Every param and optimizer-state tensor, gathered, by FQN (``main_param`` for a wrapper)."""
    fqns = {id(p): n for n, p in model.named_parameters()}
    tensors = {f"param.{n}": full(p) for n, p in model.named_parameters()}
    for p, state in opt.state.items():
        tensors.update({f"state.{fqns[id(p)]}.{k}": full(v) for k, v in state.items() if torch.is_tensor(v)})
    return tensors


def differing(a: dict, b: dict, keys=None) -> dict:
    keys = sorted(a) if keys is None else keys
    assert set(keys) <= set(a) and set(keys) <= set(b), sorted(set(keys) - (set(a) & set(b)))
    return {k: n for k in keys if (n := bit_mismatches(a[k], b[k])[0])}


def save(model, opt, path: str, drop: tuple[str, str] | None = None, section: bool = False) -> None:
    """torch's API layout in one DCP save; ``drop`` = (fqn, state key) left out of the checkpoint;
    ``section``: the main params in hyper-parallel's section instead (upstream's and the earlier layout)."""
    osd = get_optimizer_state_dict(model, opt)
    if section:
        mains = {fqn: state[MAIN_PARAM] for fqn, state in osd["state"].items() if MAIN_PARAM in state}
        osd = {**drop_main_params(osd), MP_KEY: {MAIN_PARAMS_KEY: mains}}
    if drop is not None:
        fqn, key = drop
        osd["state"] = {**osd["state"], fqn: {k: v for k, v in osd["state"][fqn].items() if k != key}}
    dcp.save({"model": get_model_state_dict(model), "optimizer": osd}, checkpoint_id=path)


def template(model, opt) -> dict:
    return {"model": get_model_state_dict(model), "optimizer": get_optimizer_state_dict(model, opt)}


def load(model, opt, path: str, planner=None) -> dict:
    """dcp.load into torch's API templates, then the model first (the optimizer rebuilds from it)."""
    state = template(model, opt)
    dcp.load(state, checkpoint_id=path, planner=planner)
    set_model_state_dict(model, state["model"])
    set_optimizer_state_dict(model, opt, state["optimizer"])
    return state


def refused(fn) -> str:
    """The text of the ``CheckpointException`` (a BaseException) DCP raises from ``fn``; fails if none."""
    try:
        fn()
    except dcp.api.CheckpointException as exc:
        return str(exc)
    raise AssertionError("the load went through; a refusal was expected")


def case(rank: int, world: int, root: str) -> dict:
    checks = Checks()
    plain_path, wrapped_path = f"{root}/plain", f"{root}/wrapped"
    model, plain = build(world, wrap=False)
    train(model, plain, range(SAVE_AFTER))
    save(model, plain, plain_path)
    saved = snapshot(model, plain)
    low = sorted(n for n, p in model.named_parameters() if p.dtype == torch.bfloat16)
    # the uninterrupted run: the plain run's state handed in memory to a wrapper (torch's API, no DCP)
    switched_model, switched = build(world, wrap=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")      # "rebuilt from the low-precision model params": expected
        set_model_state_dict(switched_model, get_model_state_dict(model))
        set_optimizer_state_dict(switched_model, switched, get_optimizer_state_dict(model, plain))
    train(switched_model, switched, range(SAVE_AFTER, STEPS))
    straight = snapshot(switched_model, switched)
    out = {"checks": checks.results, "low_precision": low}

    @checks("default_planner_refuses_plain")
    def default_planner_refuses_plain():
        text = refused(lambda: load(*build(world, wrap=True), plain_path))
        assert "Missing key in checkpoint state_dict: optimizer.state." in text and ".main_param" in text, text

    model, opt = build(world, wrap=True)
    planner = RebuildMainParamsPlanner()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        state = load(model, opt, plain_path, planner)
    said = [str(w.message) for w in caught if issubclass(w.category, UserWarning)]
    loaded = snapshot(model, opt)

    @checks("plain_loads_with_warnings")
    def plain_loads_with_warnings():
        assert planner.rebuilt == low, (planner.rebuilt, low)
        assert not any("main_param" in entry for entry in state["optimizer"]["state"].values())
        ours = [s for s in said if s.startswith("RebuildMainParamsPlanner: the checkpoint holds no fp32 main params")]
        assert len(ours) == 1 and all(n in ours[0] for n in low), said
        assert any("MainParamsOptimizer.load_state_dict: the optimizer state has no fp32 main params" in s
                   and "cannot be recovered" in s for s in said), said

    @checks("loaded_state_is_the_plain_runs")
    def loaded_state_is_the_plain_runs():
        # moments as saved, in the fp32 of the main params (the leaf's load casts them: exact from bf16)
        assert differing({k: v.to(loaded[k].dtype) for k, v in saved.items()}, loaded, sorted(saved)) == {}
        assert all(loaded[f"param.{n}"].dtype == torch.bfloat16 for n in low)
        rebuilt = {n: bit_mismatches(loaded[f"state.{n}.main_param"], loaded[f"param.{n}"].float())[0] for n in low}
        assert not any(rebuilt.values()), rebuilt

    train(model, opt, range(SAVE_AFTER, STEPS))
    resumed = snapshot(model, opt)

    @checks("resume_equals_in_memory_switch")
    def resume_equals_in_memory_switch():
        assert set(resumed) == set(straight), sorted(set(resumed) ^ set(straight))
        assert differing(straight, resumed) == {}

    @checks("comparison_sees_one_ulp")
    def comparison_sees_one_ulp():
        control = resumed["state.proj1.weight.main_param"].clone()
        control.view(-1)[0] = torch.nextafter(control.view(-1)[0], torch.tensor(float("inf")))
        assert bit_mismatches(straight["state.proj1.weight.main_param"], control)[0] == 1

    # a wrapped run's checkpoint: the planner changes nothing
    model, opt = build(world, wrap=True)
    train(model, opt, range(SAVE_AFTER))
    save(model, opt, wrapped_path)
    save(model, opt, f"{root}/partial", drop=("proj1.weight", "main_param"))
    save(model, opt, f"{root}/section", section=True)
    before = snapshot(model, opt)
    out["fp32_tail_elements"] = sum(int((before[f"state.{n}.main_param"] != before[f"param.{n}"].float()).sum())
                                    for n in low)

    @checks("wrapped_checkpoint_loads_exactly")
    def wrapped_checkpoint_loads_exactly():
        fresh, fresh_opt = build(world, wrap=True)
        exact = RebuildMainParamsPlanner()
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            load(fresh, fresh_opt, wrapped_path, exact)
        assert exact.rebuilt == [] and not [w for w in seen if issubclass(w.category, UserWarning)], seen
        assert differing(before, snapshot(fresh, fresh_opt)) == {}

    @checks("partial_refused_before_writing")
    def partial_refused_before_writing():
        fresh, fresh_opt = build(world, wrap=True)
        template(fresh, fresh_opt)       # torch primes the fresh optimizer's state here, as load does
        untouched = snapshot(fresh, fresh_opt)
        text = refused(lambda: load(fresh, fresh_opt, f"{root}/partial", RebuildMainParamsPlanner()))
        assert "optimizer state is incomplete" in text and "proj1.weight" in text, text
        assert "nothing was written" in text, text
        assert differing(untouched, snapshot(fresh, fresh_opt)) == {}

    @checks("section_refused_before_writing")
    def section_refused_before_writing():
        fresh, fresh_opt = build(world, wrap=True)
        template(fresh, fresh_opt)
        untouched = snapshot(fresh, fresh_opt)
        text = refused(lambda: load(fresh, fresh_opt, f"{root}/section", RebuildMainParamsPlanner()))
        assert "holds fp32 main params in hyper-parallel's section" in text and "load_checkpoint" in text, text
        assert differing(untouched, snapshot(fresh, fresh_opt)) == {}

    @checks("other_missing_keys_still_refused")
    def other_missing_keys_still_refused():
        plain_model, plain_opt = build(world, wrap=False)
        train(plain_model, plain_opt, range(SAVE_AFTER))
        save(plain_model, plain_opt, f"{root}/no_moment", drop=("proj2.weight", "exp_avg"))
        text = refused(lambda: load(*build(world, wrap=True), f"{root}/no_moment", RebuildMainParamsPlanner()))
        assert "Missing key in checkpoint state_dict: optimizer.state.proj2.weight.exp_avg" in text, text

    dist.barrier()
    return out
