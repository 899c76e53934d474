"""Rank-side code: MainParamsOptimizer through torch's distributed state-dict API and DCP (issue 19).

A bf16 ``fully_shard`` TinyLM (uneven shards; the 1-element ``gain`` leaves ranks >= 1 an empty
shard) with Muon + AdamW (AdamW alone before torch 2.9), trained with ``opt.step()``. ``api_cases``
checks, in one launch: in-memory get/set_state_dict, a DCP resume bit-identical to the
uninterrupted run, ``full_state_dict=True, cpu_offload=True``, ``flatten_optimizer_state_dict``,
cross-loading (plain <-> wrapped, the earlier layout) and saves a checkpoint that ``reshard_api``
loads at another world size. Every comparison is bitwise (tests.support.bit_mismatches).
"""
from __future__ import annotations

import os
import warnings

import torch
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch.distributed.checkpoint import DefaultLoadPlanner
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_optimizer_state_dict,
                                                     get_state_dict, set_optimizer_state_dict,
                                                     set_state_dict)
from torch.distributed.tensor import DTensor

from npu_fsdp_patches.optim import drop_main_params, load_checkpoint
from npu_fsdp_patches.optim.tensors import local_tensor
from tests.multirank.main_params_cases import (VOCAB, acceptance, batch, build, check_model_equals_main,
                                               compare_snapshots, full, reshard_load, snapshot)
from tests.support import bit_mismatches

BF16 = torch.bfloat16


def step(model, opt, i, rank, world):
    """The plain loop a framework runs: forward, backward, step, zero_grad."""
    ids, targets = batch(i, rank, world)
    F.cross_entropy(model(ids).float().reshape(-1, VOCAB), targets.reshape(-1)).backward()
    opt.step()
    opt.zero_grad()


def trained(rank, world, steps=1):
    model, chain, opt = build(BF16, sharded=True, world=world)
    for i in range(steps):
        step(model, opt, i, rank, world)
    return model, chain, opt


def same(a, b, where):
    """Main params and every leaf state bitwise equal; param groups equal."""
    for section in ("main", "state"):
        bad = {k: n for k, n in compare_snapshots(a, b, section).items() if n}
        assert not bad, f"{where}: {section} differs: {bad}"
    # torch's broadcast_from_rank0 turns tuples (betas) into lists, for any optimizer
    norm = lambda groups: [{k: list(v) if isinstance(v, tuple) else v for k, v in g.items()} for g in groups]  # noqa: E731
    assert norm(a["groups"]) == norm(b["groups"]), (where, a["groups"], b["groups"])


def same_model(m1, m2, where):
    for (name, p), q in zip(m1.named_parameters(), m2.parameters()):
        assert bit_mismatches(full(p), full(q))[0] == 0, f"{where}: {name}"


def dcp_load(state, ckpt, partial=False):
    planner = DefaultLoadPlanner(allow_partial_load=True) if partial else None
    dcp.load(state, checkpoint_id=ckpt, planner=planner)


def in_memory_round_trip(rank, world, model, opt):
    before = snapshot(opt)
    msd, osd = get_state_dict(model, opt)
    same(before, snapshot(opt), "get_state_dict changed the optimizer (a priming step?)")
    assert set(osd["state"]) == {n for n, _ in model.named_parameters()}, sorted(osd["state"])
    for name, p in model.named_parameters():
        assert osd["state"][name]["main_param"] is p.main_param, name
        assert isinstance(p.main_param, DTensor) and p.main_param.dtype == torch.float32, name
    model2, _, opt2 = trained(rank, world, steps=0)
    set_state_dict(model2, opt2, model_state_dict=msd, optim_state_dict=osd)
    same(before, snapshot(opt2), "set_state_dict")
    same_model(model, model2, "set_state_dict model")
    tails = sum(int((local_tensor(m) != local_tensor(m).to(BF16).float()).sum())
                for m in opt.main_params_by_fqn().values())
    return tails


def dcp_resume(rank, world, model, opt, ckpt):
    """dcp.save of get_state_dict; a fresh build loads it and trains on bit-identically."""
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optimizer": osd}, checkpoint_id=ckpt)
    saved = snapshot(opt)
    saved_model = {n: full(p) for n, p in model.named_parameters()}
    if rank == 0:
        torch.save(saved, ckpt + ".pt")
    step(model, opt, 1, rank, world)
    step(model, opt, 2, rank, world)
    model2, _, opt2 = trained(rank, world, steps=0)
    msd2, osd2 = get_state_dict(model2, opt2)      # primes opt2 (torch's zero-grad step at lr=0)
    state = {"model": msd2, "optimizer": osd2}
    dcp_load(state, ckpt)
    set_state_dict(model2, opt2, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
    same(saved, snapshot(opt2), "after dcp.load")
    check_model_equals_main(model2, opt2)
    step(model2, opt2, 1, rank, world)
    step(model2, opt2, 2, rank, world)
    same(snapshot(opt), snapshot(opt2), "resumed run")
    same_model(model, model2, "resumed run model")
    # negative controls: 1 ulp in a main param is visible, and so is rebuilding the mains from bf16
    nudged = local_tensor(opt2.main_params_by_fqn()["proj1.weight"])
    if rank == 0:
        nudged.view(torch.int32).view(-1)[0] += 1
    assert compare_snapshots(snapshot(opt), snapshot(opt2), "main")["proj1.weight"] == 1
    opt2.reload_model_params()
    rebuilt = compare_snapshots(snapshot(opt), snapshot(opt2), "main")
    return sum(rebuilt.values()), saved, saved_model


def full_cpu_offload(rank, world, model, opt):
    """Full CPU tensors on rank 0 (torch gives the other ranks nothing); loaded back with
    broadcast_from_rank0, as torch's docs pair the two."""
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    osd = get_optimizer_state_dict(model, opt, options=options)
    main_of_proj1 = full(model.proj1.weight.main_param)
    if rank == 0:
        main = osd["state"]["proj1.weight"]["main_param"]
        assert type(main) is torch.Tensor and main.device.type == "cpu" and main.shape == (7, 8)
        assert bit_mismatches(main, main_of_proj1)[0] == 0
    else:
        assert osd == {}
    msd = model.state_dict()
    model2, _, opt2 = trained(rank, world, steps=0)
    model2.load_state_dict(msd)
    set_optimizer_state_dict(model2, opt2, osd, options=StateDictOptions(
        full_state_dict=True, cpu_offload=True, broadcast_from_rank0=True))
    same(snapshot(opt), snapshot(opt2), "full_state_dict + cpu_offload")


def flattened(rank, world, model, opt, ckpt):
    options = StateDictOptions(flatten_optimizer_state_dict=True)
    msd, osd = get_state_dict(model, opt, options=options)
    assert "state.gain.main_param" in osd and "state.proj1.weight.main_param" in osd
    dcp.save({"model": msd, "optimizer": osd}, checkpoint_id=ckpt)
    model2, _, opt2 = trained(rank, world, steps=0)
    msd2, osd2 = get_state_dict(model2, opt2, options=options)
    state = {"model": msd2, "optimizer": osd2}
    dcp_load(state, ckpt)
    set_state_dict(model2, opt2, model_state_dict=state["model"], optim_state_dict=state["optimizer"],
                   options=options)
    same(snapshot(opt), snapshot(opt2), "flattened")


def plain_into_wrapped(rank, world, ckpt):
    """A plain optimizer's checkpoint: the documented route (drop_main_params on the template)
    and veomni's (allow_partial_load) both warn and rebuild the mains from the loaded model; the
    default planner names the missing key."""
    model, chain, _ = build(BF16, sharded=True, world=world, wrap=False)
    step(model, chain, 0, rank, world)
    plain = chain.chained_optimizers
    dcp.save({"model": model.state_dict(), "optimizer": get_optimizer_state_dict(model, plain)},
             checkpoint_id=ckpt)
    messages = {}
    for route in ("drop_main_params", "allow_partial_load", "default"):
        # a fresh build, as a resuming job has (a stepped one whose main param still rounds to the
        # loaded bf16 param keeps it under allow_partial_load: consistent with the model)
        model2, _, opt2 = trained(rank, world, steps=0 if route == "allow_partial_load" else 1)
        msd, osd = get_state_dict(model2, opt2)
        state = {"model": msd, "optimizer": drop_main_params(osd) if route == "drop_main_params" else osd}
        try:
            dcp_load(state, ckpt, partial=route == "allow_partial_load")
        except CheckpointException as exc:   # DCP gathers the per-rank errors (a BaseException)
            messages[route] = str(exc)
            continue
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            set_state_dict(model2, opt2, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
        assert any("fp32 tails" in str(w.message) for w in caught), (route, [str(w.message) for w in caught])
        same_model(model, model2, route)
        for p in model2.parameters():
            assert bit_mismatches(full(p.main_param), full(p).float())[0] == 0, route
    assert set(messages) == {"default"}, messages
    missing = [line for line in messages["default"].splitlines() if line.startswith("RuntimeError: Missing key")]
    assert missing and "optimizer.state." in missing[0] and ".main_param" in missing[0], messages
    return missing[0]


def wrapped_into_plain(rank, world, saved, saved_model, ckpt):
    """The wrapper's checkpoint into the plain leaf optimizers: the main params are not loaded."""
    model2, chain, _ = build(BF16, sharded=True, world=world, wrap=False)
    plain = chain.chained_optimizers
    msd, osd = get_state_dict(model2, plain)
    assert not any("main_param" in s for s in osd["state"].values())
    state = {"model": msd, "optimizer": osd}
    dcp_load(state, ckpt)
    set_state_dict(model2, plain, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
    names = {id(p): n for n, p in model2.named_parameters()}
    checked = 0
    for leaf in plain:
        for p in (q for g in leaf.param_groups for q in g["params"]):
            fqn = names[id(p)]
            assert bit_mismatches(full(p), saved_model[fqn])[0] == 0, fqn
            assert "main_param" not in leaf.state[p], fqn
            for k, v in leaf.state[p].items():   # torch casts float state to the (bf16) param dtype
                want = saved["state"][f"{fqn}.{k}"]
                want = want if k == "step" else want.to(p.dtype)
                assert bit_mismatches(full(v), want)[0] == 0, (fqn, k)
                checked += 1
    return checked


def api_cases(rank, world, root, load_from=None):
    path = lambda name: os.path.join(root, f"{name}{world}")   # noqa: E731
    out = {}
    if load_from is not None:   # another world size's checkpoint: resharded by DCP
        out["resharded"] = reshard_api(rank, world, os.path.join(root, load_from))
    model, _, opt = trained(rank, world, steps=1)
    out["tails"] = in_memory_round_trip(rank, world, model, opt)
    full_cpu_offload(rank, world, model, opt)
    flattened(rank, world, model, opt, path("flat"))
    out["rebuilt_mismatches"], saved, saved_model = dcp_resume(rank, world, model, opt, path("api"))
    out["plain_states_checked"] = wrapped_into_plain(rank, world, saved, saved_model, path("api"))
    out["default_planner_error"] = plain_into_wrapped(rank, world, path("plain_api"))
    return out


def reshard_api(rank, world, ckpt):
    """Load another world size's torch-API checkpoint: via load_checkpoint and via torch's API."""
    saved = torch.load(ckpt + ".pt", weights_only=False)
    model, _, opt = build(BF16, sharded=True, world=world)
    assert load_checkpoint(ckpt, model, opt) == "main_params"
    same(saved, snapshot(opt), f"load_checkpoint at {world} ranks")
    model2, _, opt2 = build(BF16, sharded=True, world=world)
    msd, osd = get_state_dict(model2, opt2)
    state = {"model": msd, "optimizer": osd}
    dcp_load(state, ckpt)
    set_state_dict(model2, opt2, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
    same(saved, snapshot(opt2), f"torch API at {world} ranks")
    check_model_equals_main(model2, opt2)
    return local_tensor(model2.proj1.weight).shape[0]


# ---- the three launches of tests/test_main_params_acceptance.py ---------------------------------
def two_ranks(rank, world, root):
    """RFC 001 acceptance cases and the torch-API cases; writes the 2-rank checkpoints."""
    return {"acceptance": acceptance(rank, world, root), "api": api_cases(rank, world, root)}


def three_ranks(rank, world, root):
    """The 2-rank checkpoints resharded to 3 (save_checkpoint's through torch's API too), and the
    torch-API cases at 3 ranks (empty shards of ``gain`` on ranks 1 and 2)."""
    saved = os.path.join(root, "bf16")
    model, _, opt = build(BF16, sharded=True, world=world)
    msd, osd = get_state_dict(model, opt)
    state = {"model": msd, "optimizer": osd}
    dcp_load(state, saved)               # save_checkpoint's layout is torch's: loads with its API
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
    same(torch.load(os.path.join(root, "case2_snapshot.pt"), weights_only=False), snapshot(opt),
         "save_checkpoint's checkpoint through torch's API at 3 ranks")
    return {"case2_resharded_rows": reshard_load(rank, world, root)["proj1_local_rows"],
            "api": api_cases(rank, world, root, load_from="api2")}


def back_to_two(rank, world, root):
    """The 3-rank torch-API checkpoint resharded to 2."""
    return {"api3_resharded_rows": reshard_api(rank, world, os.path.join(root, "api3"))}
