"""Rank-side code of the RFC 001 acceptance cases 2.1-2.5 (docs/hyper_parallel.md#5-hyper-parallel-rfc-001) (2
gloo ranks, real torch FSDP2 + DCP).

``acceptance`` runs cases 1-5 in one launch; ``reshard_load`` loads case 2's checkpoint at another
world size. Ranks assert and return small summaries (max diffs) for the test to report.
"""
from __future__ import annotations

import copy
import os
import warnings

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict
from torch.distributed.tensor import DTensor

from npu_fsdp_patches.optim import (MainParamsOptimizer, apply_model_init_dtype, load_checkpoint,
                                    save_checkpoint, validate_fp32_main_params_config)
from npu_fsdp_patches.optim.tensors import local_tensor
from npu_fsdp_patches.optim.muon_routing import OptimizerChain, build_muon_adamw
from npu_fsdp_patches.selftest.checks.main_params import DIM, SEQ, VOCAB, TinyLM as SelfTestLM
from tests.support import bit_mismatches

BATCH = 8
MUON = {"lr": 0.02, "weight_decay": 0.0, "momentum": 0.95, "nesterov": True, "ns_steps": 5}
ADAMW = {"lr": 1e-3, "weight_decay": 0.01}
#: torch.optim.Muon exists from torch 2.9; older torch runs the same cases with AdamW alone
HAS_MUON = hasattr(torch.optim, "Muon")


class TinyLM(SelfTestLM):
    """The self-test's model (two Muon matrices with uneven shards, a 1-element gain with an empty
    shard) plus an int and a float buffer, which ``apply_model_init_dtype`` must treat differently."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("positions", torch.arange(SEQ))          # int buffer: never cast
        self.register_buffer("scale", torch.ones(DIM))                 # float buffer: cast

    def forward(self, ids):
        h = self.embed(ids) * self.scale
        h = h + self.proj2(torch.tanh(self.proj1(h))) * self.gain
        return self.lm_head(h)


def build(dtype, *, sharded, world=None, wrap=True):
    """RFC 001 build order (docs/hyper_parallel.md#rfc-001-6-model-dtype): build -> fully_shard ->
    apply_model_init_dtype -> Muon+AdamW -> wrapper."""
    torch.manual_seed(1234)
    model = TinyLM()
    if sharded:
        mesh = init_device_mesh("cpu", (world,))
        policy = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
        for sub in (model.proj1, model.proj2):
            fully_shard(sub, mesh=mesh, mp_policy=policy)
        fully_shard(model, mesh=mesh, mp_policy=policy)
    apply_model_init_dtype(model, dtype)
    if HAS_MUON:
        chain = build_muon_adamw(model, muon_kwargs=MUON, adamw_kwargs=ADAMW)
    else:
        chain = OptimizerChain({"adamw": torch.optim.AdamW(model.parameters(), **ADAMW)})
    return model, chain, (MainParamsOptimizer(chain, model) if wrap else None)


def batch(step, rank=None, world=None):
    g = torch.Generator().manual_seed(100 + step)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    targets = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    if rank is not None:
        rows = slice(rank * BATCH // world, (rank + 1) * BATCH // world)
        ids, targets = ids[rows], targets[rows]
    return ids, targets


def full(t):
    return t.full_tensor() if isinstance(t, DTensor) else t.detach().clone()


def train_step(model, opt, step, rank=None, world=None, clip=1.0):
    """Forward/backward/prepare/clip/step; returns the per-step quantities RFC 001 compares."""
    ids, targets = batch(step, rank, world)
    loss = F.cross_entropy(model(ids).float().reshape(-1, VOCAB), targets.reshape(-1))
    loss.backward()
    opt.prepare_grads()   # the grads move to the main params, which Megatron's split step clips
    mains = [opt.main_param(p) for g in opt.param_groups for p in g["params"]]
    grad_norm = torch.nn.utils.clip_grad_norm_(mains, clip)
    main_grads = {opt.fqn(p): full(p.grad) for p in mains}
    opt.step_with_ready_grads()
    opt.zero_grad()
    loss = loss.detach()
    if world is not None:
        dist.all_reduce(loss)
        loss /= world
    return {"loss": loss.item(), "grad_norm": full(grad_norm).item(), "main_grads": main_grads,
            "params": {n: full(p) for n, p in model.named_parameters()},
            "mains": {opt.fqn(p): full(p) for p in mains}}


def close(a, b, what, rtol, atol):
    diff = (a.float() - b.float()).abs().max().item() if a.numel() else 0.0
    assert torch.allclose(a.float(), b.float(), rtol=rtol, atol=atol), f"{what}: max diff {diff}"
    return diff


def check_model_equals_main(model, opt):
    for name, p in model.named_parameters():
        main = p.main_param
        if main is p:
            continue
        cast = local_tensor(main).to(p.dtype)
        assert bit_mismatches(local_tensor(p), cast)[0] == 0, f"{name} != main_param.to({p.dtype})"


def case1_accuracy(rank, world, steps=3):
    ref_model, _, ref_opt = build(torch.bfloat16, sharded=False)
    model, chain, opt = build(torch.bfloat16, sharded=True, world=world)
    # every floating param/buffer bf16, ints untouched; every bf16 param has its own fp32 main param
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    assert model.scale.dtype == torch.bfloat16 and model.positions.dtype == torch.int64
    storages = set()
    for name, p in model.named_parameters():
        main = p.main_param
        assert main is not p and main.dtype == torch.float32 and isinstance(main, DTensor), name
        assert main.placements == p.placements and main.shape == p.shape, name
        storages.add(local_tensor(main).untyped_storage().data_ptr() if main.numel() else id(main))
    assert len(storages) == len(list(model.parameters())), "main params share storage"
    leaves = chain.optimizers_dict
    assert set(leaves) == ({"adamw", "muon"} if HAS_MUON else {"adamw"})
    for key in leaves:
        for p in (q for g in leaves[key].param_groups for q in g["params"]):
            assert p is opt.main_param(opt.model_param(p)) and p.dtype == torch.float32, key
    muon_names = {opt.fqn(p) for g in leaves["muon"].param_groups for p in g["params"]} if HAS_MUON else set()
    assert muon_names == ({"proj1.weight", "proj2.weight"} if HAS_MUON else set()), muon_names

    worst = {"loss": 0.0, "grad_norm": 0.0, "main_grad": 0.0, "param": 0.0, "main_update": 0.0}
    init = {n: full(p).float() for n, p in ref_model.named_parameters()}
    for step in range(steps):
        before = {opt.fqn(q): full(q.main_param) for g in opt.param_groups for q in g["params"]}
        ref = train_step(ref_model, ref_opt, step)
        got = train_step(model, opt, step, rank, world)
        worst["loss"] = max(worst["loss"], abs(ref["loss"] - got["loss"]))
        assert abs(ref["loss"] - got["loss"]) < 1e-3 * max(1.0, abs(ref["loss"])), (ref["loss"], got["loss"])
        worst["grad_norm"] = max(worst["grad_norm"], abs(ref["grad_norm"] - got["grad_norm"]))
        assert abs(ref["grad_norm"] - got["grad_norm"]) < 2e-2 * ref["grad_norm"], \
            f"step {step}: grad norm {got['grad_norm']} vs unsharded {ref['grad_norm']}"
        for fqn, g in ref["main_grads"].items():
            assert got["main_grads"][fqn].dtype == torch.float32
            worst["main_grad"] = max(worst["main_grad"], close(got["main_grads"][fqn], g,
                                                               f"step {step} main_grad {fqn}", 3e-2, 2e-3))
        for fqn, p in ref["params"].items():
            worst["param"] = max(worst["param"], close(got["params"][fqn], p,
                                                       f"step {step} param {fqn}", 1e-2, 4e-3))
        for fqn, m in ref["mains"].items():   # fp32 updates so far: relative Frobenius error
            upd_ref, upd = m - init[fqn], got["mains"][fqn] - init[fqn]
            err = ((upd - upd_ref).norm() / upd_ref.norm()).item()
            # torch Muon's bf16 Newton-Schulz on Shard(0) DTensors alone differs by ~2-3% from the
            # unsharded one (bf16 matmul partial sums); AdamW updates agree far more closely.
            limit = 0.12 if fqn in muon_names else 0.03
            worst["main_update"] = max(worst["main_update"], err)
            assert err < limit, f"step {step} main param update {fqn}: relative error {err}"
        check_model_equals_main(model, opt)
        for key in leaves:   # every group updates, on the main params
            changed = [bit_mismatches(before[opt.fqn(p)], p)[0] > 0
                       for g in leaves[key].param_groups for p in g["params"]]
            assert all(changed), f"step {step}: {key} left some main params unchanged"
        assert all(p.grad is None and getattr(p, "main_grad", None) is None for p in model.parameters())
    return worst


def snapshot(opt):
    """Full tensors of main params and leaf state, keyed by FQN (bitwise comparisons)."""
    out = {"main": {k: full(v) for k, v in opt.main_params_by_fqn().items()}, "state": {}}
    for leaf in opt.leaf_optimizers:
        for p, st in leaf.state.items():
            for k, v in st.items():
                out["state"][f"{opt.fqn(p)}.{k}"] = full(v) if torch.is_tensor(v) else v
    out["groups"] = [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
    return out


def compare_snapshots(a, b, section):
    assert a[section].keys() == b[section].keys(), (sorted(a[section]), sorted(b[section]))
    return {k: bit_mismatches(a[section][k], b[section][k])[0] for k in a[section]}


def case2_save_restore(rank, world, ckpt):
    model, _, opt = build(torch.bfloat16, sharded=True, world=world)
    train_step(model, opt, 0, rank, world)
    saved = snapshot(opt)
    tails = {k: int((v != v.to(torch.bfloat16).float()).sum()) for k, v in saved["main"].items()}
    assert all(tails[k] > 0 for k in ("proj1.weight", "proj2.weight", "lm_head.weight", "embed.weight")), tails
    save_checkpoint(ckpt, model, opt)
    keys = set(dcp.FileSystemReader(ckpt).read_metadata().state_dict_metadata)
    assert {f"optimizer.state.{n}.main_param" for n, _ in model.named_parameters()} <= keys
    if rank == 0:
        torch.save(saved, os.path.join(ckpt, "..", "case2_snapshot.pt"))
    uninterrupted = train_step(model, opt, 1, rank, world)
    after_two = snapshot(opt)

    model2, _, opt2 = build(torch.bfloat16, sharded=True, world=world)
    assert load_checkpoint(ckpt, model2, opt2) == "main_params"
    restored = snapshot(opt2)
    for section in ("main", "state"):
        bad = {k: n for k, n in compare_snapshots(saved, restored, section).items() if n}
        assert not bad, f"{section} not restored bitwise: {bad}"
    assert saved["groups"] == restored["groups"]
    check_model_equals_main(model2, opt2)
    resumed = train_step(model2, opt2, 1, rank, world)
    assert resumed["loss"] == uninterrupted["loss"]
    for fqn in uninterrupted["params"]:
        assert bit_mismatches(resumed["params"][fqn], uninterrupted["params"][fqn])[0] == 0, fqn
        assert bit_mismatches(resumed["main_grads"][fqn], uninterrupted["main_grads"][fqn])[0] == 0, fqn
    for section in ("main", "state"):
        assert not any(compare_snapshots(after_two, snapshot(opt2), section).values()), section

    # negative controls: 1 ulp is caught, and the bf16 round trip (plain branch) loses the tails
    one = saved["main"]["proj1.weight"].clone()
    one.view(-1)[0] = torch.nextafter(one.view(-1)[0], torch.tensor(float("inf")))
    assert bit_mismatches(one, saved["main"]["proj1.weight"])[0] == 1
    model3, _, opt3 = build(torch.bfloat16, sharded=True, world=world)
    load_checkpoint(ckpt, model3, opt3)
    opt3.reload_model_params()
    lost = compare_snapshots(saved, snapshot(opt3), "main")
    assert sum(lost.values()) >= sum(tails.values()) > 0, (lost, tails)
    return {"tail_elements": sum(tails.values()), "lost_by_round_trip": sum(lost.values())}


def storage_count(model, opt=None):
    tensors = list(model.parameters())
    if opt is not None:
        tensors += [p for g in opt.param_groups for p in g["params"]]
    return len({local_tensor(t).untyped_storage().data_ptr() for t in tensors if local_tensor(t).numel()})


def case3_fp32(rank, world, ckpt):
    model, chain, _ = build(torch.float32, sharded=True, world=world, wrap=False)
    before = storage_count(model)
    opt = MainParamsOptimizer(chain, model)
    assert all(p.main_param is p for p in model.parameters())
    assert storage_count(model, opt) == before
    assert opt.main_params_by_fqn() == {}
    assert not opt.float16_groups[0] and not any(opt.fp32_from_float16_groups)
    train_step(model, opt, 0, rank, world)
    save_checkpoint(ckpt, model, opt)
    keys = set(dcp.FileSystemReader(ckpt).read_metadata().state_dict_metadata)
    assert not any(k.endswith(".main_param") for k in keys)   # +0 B: fp32 params are their own main
    saved = snapshot(opt)
    uninterrupted = train_step(model, opt, 1, rank, world)
    model2, _, opt2 = build(torch.float32, sharded=True, world=world)
    assert load_checkpoint(ckpt, model2, opt2) == "main_params"
    assert not any(compare_snapshots(saved, snapshot(opt2), "state").values())
    resumed = train_step(model2, opt2, 1, rank, world)
    assert resumed["loss"] == uninterrupted["loss"]
    for fqn in uninterrupted["params"]:
        assert bit_mismatches(resumed["params"][fqn], uninterrupted["params"][fqn])[0] == 0, fqn
    return {"storages": before}


def case4_plain_and_partial(rank, world, plain_ckpt, partial_ckpt):
    # 1. plain optimizer checkpoint: unwrapped Muon + AdamW on the bf16 model
    model, chain, _ = build(torch.bfloat16, sharded=True, world=world, wrap=False)
    ids, targets = batch(0, rank, world)
    F.cross_entropy(model(ids).float().reshape(-1, VOCAB), targets.reshape(-1)).backward()
    chain.step()
    chain.zero_grad()
    save_checkpoint(plain_ckpt, model, chain.chained_optimizers)
    keys = set(dcp.FileSystemReader(plain_ckpt).read_metadata().state_dict_metadata)
    assert not any(k.endswith(".main_param") for k in keys)
    model2, _, opt2 = build(torch.bfloat16, sharded=True, world=world)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert load_checkpoint(plain_ckpt, model2, opt2) == "plain"
    assert any("fp32 tails" in str(w.message) for w in caught), [str(w.message) for w in caught]
    for (name, p), (_, q) in zip(model.named_parameters(), model2.named_parameters()):
        assert bit_mismatches(p, q)[0] == 0, name
        assert bit_mismatches(q.main_param, full(p).float())[0] == 0, name
    for leaf, leaf2 in zip(chain.chained_optimizers, opt2.leaf_optimizers):
        for p, p2 in zip(leaf.param_groups[0]["params"], leaf2.param_groups[0]["params"]):
            for k, v in leaf.state[p].items():
                assert bit_mismatches(full(v).float() if v.is_floating_point() and k != "step" else v,
                                          leaf2.state[p2][k])[0] == 0, (opt2.fqn(p2), k)

    # 2. partial main params: two FQNs dropped; the load must raise and touch nothing
    sd = {"model": model2.state_dict(), "optimizer": get_optimizer_state_dict(model2, opt2)}
    for fqn in ("proj2.weight", "gain"):
        sd["optimizer"]["state"][fqn] = {k: v for k, v in sd["optimizer"]["state"][fqn].items()
                                         if k != "main_param"}
    dcp.save(sd, checkpoint_id=partial_ckpt)
    target, _, topt = build(torch.bfloat16, sharded=True, world=world)
    train_step(target, topt, 3, rank, world)                 # has state, differs from the checkpoint
    before = (snapshot(topt), {n: full(p) for n, p in target.named_parameters()})
    try:
        load_checkpoint(partial_ckpt, target, topt)
    except ValueError as exc:
        message = str(exc)
    else:
        raise AssertionError("partial main params were accepted")
    assert "proj2.weight" in message and "gain" in message and "embed.weight" not in message, message
    after = (snapshot(topt), {n: full(p) for n, p in target.named_parameters()})
    for section in ("main", "state"):
        assert not any(compare_snapshots(before[0], after[0], section).values()), section
    assert before[0]["groups"] == after[0]["groups"]
    assert all(bit_mismatches(before[1][n], after[1][n])[0] == 0 for n in before[1])
    return {"partial_error": message}


def case5_bad_configs():
    built = []
    base = {"model_init_dtype": "bfloat16", "optimizer": {"fp32_main_params": True},
            "fsdp_config": {"mix_precision": {"param_dtype": "bfloat16", "output_dtype": "bfloat16"}}}
    errors = []
    for reduce_dtype in (None, "bfloat16"):
        cfg = copy.deepcopy(base)
        if reduce_dtype is not None:
            cfg["fsdp_config"]["mix_precision"]["reduce_dtype"] = reduce_dtype
        frozen = copy.deepcopy(cfg)
        try:
            validate_fp32_main_params_config(cfg)
            built.append(build(torch.bfloat16, sharded=False))     # a trainer would build here
        except ValueError as exc:
            errors.append(str(exc))
        assert cfg == frozen, "the config was rewritten"
    assert not built and len(errors) == 2, errors
    for msg in errors:
        assert "optimizer.fp32_main_params" in msg and "fsdp_config.mix_precision.reduce_dtype" in msg
    return errors


def acceptance(rank, world, root):
    path = lambda name: os.path.join(root, name)   # noqa: E731
    return {"dtype_layout": dtype_layout_case(rank, world),
            "case1": case1_accuracy(rank, world),
            "case2": case2_save_restore(rank, world, path("bf16")),
            "case3": case3_fp32(rank, world, path("fp32")),
            "case4": case4_plain_and_partial(rank, world, path("plain"), path("partial")),
            "case5": case5_bad_configs()}


def reshard_load(rank, world, root):
    """Load case 2's 2-rank checkpoint at ``world`` ranks; main params and state come back bitwise."""
    saved = torch.load(os.path.join(root, "case2_snapshot.pt"), weights_only=False)
    model, _, opt = build(torch.bfloat16, sharded=True, world=world)
    assert load_checkpoint(os.path.join(root, "bf16"), model, opt) == "main_params"
    restored = snapshot(opt)
    for section in ("main", "state"):
        bad = {k: n for k, n in compare_snapshots(saved, restored, section).items() if n}
        assert not bad, f"{section} at world size {world}: {bad}"
    check_model_equals_main(model, opt)
    local_rows = local_tensor(model.proj1.weight).shape[0]
    train_step(model, opt, 1, rank, world)
    return {"proj1_local_rows": local_rows}


def dtype_layout_case(rank, world):
    """apply_model_init_dtype on an FSDP2 model: Parameter identity, mesh, placements, int buffers."""
    torch.manual_seed(0)
    model = TinyLM()
    mesh = init_device_mesh("cpu", (world,))
    fully_shard(model.proj1, mesh=mesh)
    fully_shard(model, mesh=mesh)
    before = {n: (p, p.device_mesh, p.placements, local_tensor(p).shape) for n, p in model.named_parameters()}
    values = {n: full(p) for n, p in model.named_parameters()}
    apply_model_init_dtype(model, "bfloat16")
    for name, p in model.named_parameters():
        obj, mesh_, placements, local_shape = before[name]
        assert p is obj and p.device_mesh is mesh_ and p.placements == placements, name
        assert p.dtype == torch.bfloat16 and local_tensor(p).shape == local_shape, name
        assert bit_mismatches(full(p), values[name].to(torch.bfloat16))[0] == 0, name
    assert model.positions.dtype == torch.int64 and model.scale.dtype == torch.bfloat16
    ids, targets = batch(0, rank, world)
    F.cross_entropy(model(ids).float().reshape(-1, VOCAB), targets.reshape(-1)).backward()
    assert all(p.grad is not None and p.grad.dtype == torch.bfloat16 for p in model.parameters())
    return True


def mesh_equal_by_value(rank, world):
    """``apply_model_init_dtype``'s layout check compares meshes by value: an equal mesh object made
    later (as torch's sharding cache may hand a cast DTensor) is the same layout, another mesh is not."""
    from npu_fsdp_patches.optim.model_dtype import _layout
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import Shard
    first = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    again = DeviceMesh("cpu", list(range(world)), mesh_dim_names=("dp",))
    other = DeviceMesh("cpu", list(range(world)), mesh_dim_names=("tp",))
    local = torch.zeros(2, 3)
    a, b, c = (DTensor.from_local(local, mesh, [Shard(0)]) for mesh in (first, again, other))
    return [again is not first, _layout(a) == _layout(b), _layout(a) == _layout(c)]
