"""Rank-side code: MainParamsOptimizer <-> hyper-parallel's own ``Float16OptimizerWithFloat16Params``
(issue 30; docs/main_params.md §2.1).

The upstream wrapper is the stand-in tests/fixtures/upstream_fp32_wrapper, written apart from our code and
loaded here by path (no package of ours imports it). Both sides wrap one ``torch.optim.AdamW`` over
the same bf16 ``fully_shard`` TinyLM (uneven shards, an empty shard on rank 1) and get the same fp32
``main_grad`` (hyper reduces in fp32 into ``main_grad``, docs/hyper_parallel.md#rfc-001-8-main_grad-and-step),
so a correct interchange makes the next step bit-identical. Every comparison is bitwise.
"""
from __future__ import annotations

import logging
import os
import warnings

import torch
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from npu_fsdp_patches.optim import MainParamsOptimizer, apply_model_init_dtype
from npu_fsdp_patches.optim.muon_routing import OptimizerChain, split_muon_adamw_params
from tests.multirank.main_params_cases import HAS_MUON, MUON, VOCAB, TinyLM, batch, full
from tests.support import bit_mismatches, load_fixture_module

BF16 = torch.bfloat16
ADAMW = {"lr": 1e-3, "weight_decay": 0.01, "foreach": False}
SECTION, MAINS = "_mixed_precision_optimizer", "fp32_from_fp16_params"


def upstream_module():
    return load_fixture_module("upstream_fp32_wrapper/mixed_precision_optimizer.py")


def sharded_model(world, dtype=BF16):
    torch.manual_seed(1234)
    model = TinyLM()
    mesh = init_device_mesh("cpu", (world,))
    policy = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
    for sub in (model.proj1, model.proj2):
        fully_shard(sub, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    return apply_model_init_dtype(model, dtype)


def ours(world, dtype=BF16):
    model = sharded_model(world, dtype)
    return model, MainParamsOptimizer(torch.optim.AdamW(model.parameters(), **ADAMW), model)


def upstream(world, dtype=BF16):
    up = upstream_module()
    model = sharded_model(world, dtype)
    chain = up.ChainedOptimizer(model, {"adamw": torch.optim.AdamW(model.parameters(), **ADAMW)})
    return model, up.Float16OptimizerWithFloat16Params(chain, model)


def muon_adamw(model):
    """Muon + AdamW by the routing rule (upstream's builders route the same way)."""
    muon, adamw = split_muon_adamw_params(model.named_parameters())
    return {"adamw": torch.optim.AdamW(adamw, **ADAMW), "muon": torch.optim.Muon(muon, **MUON)}


def ours_chain(world):
    model = sharded_model(world)
    return model, MainParamsOptimizer(OptimizerChain(muon_adamw(model)), model)


def upstream_chain(world):
    """Muon + AdamW behind upstream's wrapper; its ChainedOptimizer flattens (multi-optimizer)."""
    up = upstream_module()
    model = sharded_model(world)
    return model, up.Float16OptimizerWithFloat16Params(up.ChainedOptimizer(model, muon_adamw(model), flatten=True), model)


def leaves_of(opt):
    return opt.leaf_optimizers if isinstance(opt, MainParamsOptimizer) else opt.chained_optimizers


def train(model, opt, i, rank, world):
    ids, targets = batch(i, rank, world)
    F.cross_entropy(model(ids).float().reshape(-1, VOCAB), targets.reshape(-1)).backward()
    for p in model.parameters():
        p.main_grad = p.grad.float()
    opt.step()
    opt.zero_grad()


def snapshot(model, opt):
    """{fqn: {"param", "main", AdamW state...}}: full tensors (a collective: every rank calls it)."""
    out = {}
    for name, p in model.named_parameters():
        main = p.main_param
        entry = {"param": full(p), "main": full(main)}
        state = next((leaf.state[main] for leaf in leaves_of(opt) if main in leaf.state), {})
        for key in ("step", "exp_avg", "exp_avg_sq", "momentum_buffer"):
            if key in state:
                entry[key] = full(state[key])
        out[name] = entry
    return out


def differences(a, b):
    assert a.keys() == b.keys(), (sorted(a), sorted(b))
    bad = {}
    for name in a:
        assert a[name].keys() == b[name].keys(), (name, sorted(a[name]), sorted(b[name]))
        for key in a[name]:
            n = bit_mismatches(a[name][key], b[name][key])[0]
            if n:
                bad[f"{name}.{key}"] = n
    return bad


class _Fallbacks(logging.Handler):
    """Records upstream's fallback warning (``logger.warning`` on a missing section)."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def load_into_upstream(sd, src_model, world, build=upstream):
    """A fresh upstream wrapper over a model loaded from ``src_model``, then ``sd``; returns it and
    the fallback warnings it logged."""
    model, opt = build(world)
    model.load_state_dict(src_model.state_dict())
    handler = _Fallbacks()
    log = logging.getLogger("hyper_parallel.components.optim.mixed_precision_optimizer")
    log.addHandler(handler)
    try:
        opt.load_state_dict(sd)
    finally:
        log.removeHandler(handler)
    return model, opt, handler.messages


def load_into_ours(sd, src_model, world, build=ours):
    model, opt = build(world)
    model.load_state_dict(src_model.state_dict())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt.load_state_dict(sd)
    return model, opt, [str(w.message) for w in caught if "fp32" in str(w.message)]


def per_rank_file(sd, tmp, name, rank):
    """torch.save + torch.load per rank, as hyper's trainer checkpointer stores optimizer state."""
    path = os.path.join(tmp, f"{name}_rank{rank}.pt")
    torch.save(sd, path)
    return torch.load(path, weights_only=False), os.path.getsize(path)


def one_ulp_off(snap):
    """Negative control: ``snap`` with one element of one main param moved by one ulp."""
    out = {name: dict(entry) for name, entry in snap.items()}
    main = out["proj1.weight"]["main"].clone()
    main.view(-1)[3] = torch.nextafter(main.view(-1)[3], torch.tensor(float("inf")))
    out["proj1.weight"]["main"] = main
    return out


def has_tails(snap):
    """Some main param is not representable in bf16 (so a fallback through the model would show)."""
    return any(bool((e["main"] != e["main"].to(BF16).float()).any()) for e in snap.values()
               if e["main"].dtype == torch.float32 and e["param"].dtype == BF16)


def check_next_step(model_a, opt_a, model_b, opt_b, i, rank, world, where):
    train(model_a, opt_a, i, rank, world)
    train(model_b, opt_b, i, rank, world)
    bad = differences(snapshot(model_a, opt_a), snapshot(model_b, opt_b))
    assert not bad, f"{where}: next step differs: {bad}"


def trained(build, rank, world, steps=2):
    model, opt = build(world)
    for i in range(steps):
        train(model, opt, i, rank, world)
    return model, opt


def interchange(build_src, load, rank, world, tmp, where):
    """``build_src`` trained 2 steps, its ``state_dict()`` loaded by ``load`` in memory and through
    a per-rank file: no fallback, every tensor bit for bit, and the next step bit-identical to the
    uninterrupted run (a twin of the source, trained the same way)."""
    src_model, src = trained(build_src, rank, world)
    saved = snapshot(src_model, src)
    assert has_tails(saved), "test would not see a fallback: no fp32 tails"
    sd = src.state_dict()
    # written first: an in-memory load may share the state tensors, which its next step then moves
    from_file = per_rank_file(sd, tmp, where.split()[0], rank)[0]
    for how, loaded in (("memory", sd), ("torch.save", from_file)):
        model, opt, fallbacks = load(loaded, src_model, world)
        assert not fallbacks, f"{where} ({how}): fell back to the model params: {fallbacks}"
        loaded_snap = snapshot(model, opt)
        bad = differences(saved, loaded_snap)
        assert not bad, f"{where} ({how}): loaded state differs: {bad}"
        assert differences(saved, one_ulp_off(loaded_snap)) == {"proj1.weight.main": 1}, "control"
        twin_model, twin = trained(build_src, rank, world)
        check_next_step(twin_model, twin, model, opt, 2, rank, world, f"{where} ({how})")
    return "ok"


def ours_to_upstream(rank, world, tmp):
    return interchange(ours, load_into_upstream, rank, world, tmp, "ours -> upstream")


def upstream_to_ours(rank, world, tmp):
    return interchange(upstream, load_into_ours, rank, world, tmp, "upstream -> ours")


def upstream_chain_to_ours(rank, world, tmp):
    """Upstream's Muon + AdamW state (flattened FQN layout) into ours over the same chain."""
    if not HAS_MUON:
        return "skipped: torch.optim.Muon needs torch >= 2.9"
    load = lambda sd, src, w: load_into_ours(sd, src, w, build=ours_chain)   # noqa: E731
    return interchange(upstream_chain, load, rank, world, tmp, "upstream(muon+adamw) -> ours")


def as_upstream_chain_state(model, opt):
    """docs/main_params.md §2.1 for upstream's multi-leaf wrapper: ``upstream_state_dict`` (torch's
    flattened FQN layout, each main param moved into the section)."""
    from npu_fsdp_patches.optim import upstream_state_dict
    return upstream_state_dict(model, opt)


def ours_chain_to_upstream_chain(rank, world, tmp):
    """Ours over Muon + AdamW -> upstream's Muon + AdamW wrapper, through the recipe."""
    if not HAS_MUON:
        return "skipped: torch.optim.Muon needs torch >= 2.9"
    src_model, src = trained(ours_chain, rank, world)
    saved = snapshot(src_model, src)
    sd = as_upstream_chain_state(src_model, src)
    from_file = per_rank_file(sd, tmp, "recipe", rank)[0]
    for how, loaded in (("memory", sd), ("torch.save", from_file)):
        model, opt, fallbacks = load_into_upstream(loaded, src_model, world, build=upstream_chain)
        assert not fallbacks, f"recipe ({how}): {fallbacks}"
        bad = differences(saved, snapshot(model, opt))
        assert not bad, f"recipe ({how}): loaded state differs: {bad}"
        twin_model, twin = trained(ours_chain, rank, world)
        check_next_step(twin_model, twin, model, opt, 2, rank, world, f"recipe ({how})")
    return "ok"


def rfc_state_dict(rank, world, tmp):
    """hyper-parallel RFC 001 2.2-2.4 (docs/hyper_parallel.md#5-hyper-parallel-rfc-001) on ``state_dict()``,
    the single copy on disk, and the partial-section refusal."""
    model, opt = ours(world)
    train(model, opt, 0, rank, world)
    sd = opt.state_dict()
    mains = opt.main_params_by_fqn()
    low = sorted(n for n, p in model.named_parameters() if p.dtype in (BF16, torch.float16) and p.requires_grad)
    section = sd[SECTION][MAINS]
    assert sorted(section) == low and low, (sorted(section), low)
    for fqn, value in section.items():
        assert value.dtype == torch.float32, (fqn, value.dtype)
        assert value is mains[fqn], f"{fqn}: the section holds a copy, not the main param"
        assert bit_mismatches(value, mains[fqn])[0] == 0
    # torch's API keeps state/param_groups only: each main param once, as state.<fqn>.main_param
    osd = get_optimizer_state_dict(model, opt)
    assert SECTION not in osd and sorted(f for f, s in osd["state"].items() if "main_param" in s) == low
    # torch.save stores a shared storage once: the section adds names, not tensor bytes
    without = {k: v for k, v in sd.items() if k != SECTION}
    size_with, size_without = per_rank_file(sd, tmp, "with", rank)[1], per_rank_file(without, tmp, "without", rank)[1]
    main_bytes = sum(full_local_bytes(v) for v in mains.values())   # checked by the test (rank-local)
    # RFC 001 2.3: fp32 model
    model32, opt32 = ours(world, torch.float32)
    train(model32, opt32, 0, rank, world)
    assert opt32.state_dict()[SECTION] == {MAINS: {}}
    assert all(p.main_param is p for p in model32.parameters())
    # RFC 001 2.4: a partial section is refused, naming the missing params, before anything is written
    partial = dict(sd)
    partial[SECTION] = {MAINS: {k: v for k, v in section.items() if k not in ("embed.weight", "proj1.weight")}}
    target_model, target = ours(world)
    train(target_model, target, 1, rank, world)
    before = snapshot(target_model, target)
    try:
        target.load_state_dict(partial)
    except ValueError as e:
        message = str(e)
    else:
        raise AssertionError("a partial section was loaded")
    assert "embed.weight, proj1.weight" in message and "nothing was written" in message, message
    bad = differences(before, snapshot(target_model, target))
    assert not bad, f"refused load still wrote: {bad}"
    return {"size_with": size_with, "size_without": size_without, "main_bytes": main_bytes}


def full_local_bytes(t):
    local = t.to_local() if hasattr(t, "to_local") else t
    return local.numel() * local.element_size()


def two_ranks(rank, world, tmp):
    """Each case's result, or its AssertionError's message (every check above runs the same on
    every rank, so one failing case does not desynchronize the collectives of the next)."""
    out = {}
    for name, case in (("rfc", rfc_state_dict), ("ours_to_upstream", ours_to_upstream),
                       ("upstream_to_ours", upstream_to_ours), ("upstream_chain_to_ours", upstream_chain_to_ours),
                       ("ours_chain_to_upstream_chain", ours_chain_to_upstream_chain)):
        try:
            out[name] = case(rank, world, tmp)
        except Exception as exc:   # noqa: BLE001 - reported by the test of that case
            out[name] = f"FAILED: {type(exc).__name__}: {exc}"
    return out
