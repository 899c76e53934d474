"""Rank-side code of tests/test_upstream_resume.py (issue 39): the hyper-parallel trainer route under
``hp_fp32_main_params`` and hyper-parallel's own fp32 wrapper + DCP checkpointer resume each other's
checkpoints.

Ours: the config-lineage trainer stand-in (tests/fixtures/hyper_parallel_new) with the patch applied
through the plugin (autoload, the fixture on the path): its ``save_checkpoint``/``load_checkpoint`` are
the patched ones. Upstream: the stand-ins tests/fixtures/upstream_fp32_wrapper/{mixed_precision_optimizer,
dcp_checkpointer}.py (written apart from our code; loaded by path). Both train the same bf16
``fully_shard`` TinyLM with Muon + AdamW (AdamW alone on torch < 2.9, which has no ``torch.optim.Muon``)
on the same batches, so every comparison is bitwise. ``two_ranks`` saves and cross-loads at 2 ranks;
``three_ranks`` loads the 2-rank checkpoints at 3.
"""
from __future__ import annotations

import importlib.util
import logging
import os
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import get_model_state_dict

from npu_fsdp_patches.optim import upstream_state_dict
from tests.multirank.main_params_cases import HAS_MUON
from tests.multirank.upstream_interchange_cases import differences, one_ulp_off, sharded_model, snapshot
from tests.support import Checks

OPTIMIZER = "muon" if HAS_MUON else "adamw"
MUON_CONFIG = {"muon_lr": 0.02, "muon_weight_decay": 0.0, "muon_momentum": 0.95, "muon_nesterov": True,
               "muon_ns_steps": 5}
ADAMW_CONFIG = {"adamw_lr": 1e-3, "adamw_weight_decay": 0.01, "adamw_foreach": False}
CONFIG = {"optimizer": {"name": OPTIMIZER, "fp32_main_params": True, "muon_config": MUON_CONFIG,
                        "adamw_config": ADAMW_CONFIG},
          "fsdp_config": {"mix_precision": {"param_dtype": "bfloat16", "reduce_dtype": "float32"}}}
SECTION = "_mixed_precision_optimizer.fp32_from_fp16_params"
DROPPED = ("embed.weight", "proj1.weight")   # left out of the partial checkpoint's section
_FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "upstream_fp32_wrapper"

TWO_RANK_CHECKS = ("patch_applied", "trained_alike", "keys_as_upstream", "main_params_once",
                   "upstream_resumes_ours", "ours_resumes_upstream", "negative_control",
                   "partial_refused_by_both", "plain_takes_branch_2", "torch_layout_unchanged",
                   "every_loader_outcome")
THREE_RANK_CHECKS = ("upstream_resumes_ours_resharded", "ours_resumes_upstream_resharded",
                     "partial_refused_resharded", "converted_to_torch_loads_through_torchs_api",
                     "converted_to_upstream_loads_into_upstream")
#: the checkpoints two_ranks writes (under tmp), each loaded by every consumer
CHECKPOINTS = ("ours", "upstream", "partial", "plain", "torch")


def _by_path(name):
    spec = importlib.util.spec_from_file_location(f"upstream_{name}", _FIXTURE / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


UP = _by_path("mixed_precision_optimizer")
CKPT = _by_path("dcp_checkpointer")


def _model_fn(world, seed):
    def build():
        model = sharded_model(world)   # seeded 1234; another seed shifts every value
        if seed != 1234:
            with torch.no_grad():
                for p in model.parameters():
                    p.to_local().add_(0.01 * seed)
        return model
    return build


def ours(world, seed=1234):
    """The patched trainer (its optimizer is our MainParamsOptimizer)."""
    from hyper_parallel.trainer.base import BaseTrainer
    return BaseTrainer(CONFIG, _model_fn(world, seed))


class Upstream:
    """Upstream's wrapper over its ChainedOptimizer, built and stepped as the trainer stand-in does
    (the same leaves, kwargs and routing as ``get_hyper_optimizer``), saved with its checkpointer."""

    def __init__(self, world, seed=1234):
        from hyper_parallel.trainer import base
        self.model = _model_fn(world, seed)()
        muon, adamw = [], []
        for name, p in self.model.named_parameters():
            use_muon = OPTIMIZER == "muon" and p.ndim == 2 and not base._ADAMW_NAMES.search(name)
            (muon if use_muon else adamw).append(p)
        leaves = {"adamw": torch.optim.AdamW(adamw, lr=1e-3, weight_decay=0.01, foreach=False)}
        if muon:
            leaves["muon"] = torch.optim.Muon(muon, lr=0.02, weight_decay=0.0, momentum=0.95, nesterov=True,
                                              ns_steps=5)
        chain = UP.ChainedOptimizer(self.model, leaves, flatten=len(leaves) > 1)
        self.optimizer = UP.Float16OptimizerWithFloat16Params(chain, self.model)
        self.checkpointer = CKPT.DistributedCheckpointer()

    def train_step(self, inputs, targets):
        from hyper_parallel.trainer.base import BaseTrainer
        return BaseTrainer.train_step(self, inputs, targets)   # the same step; self.config below

    config = CONFIG

    def save_checkpoint(self, path):
        self.checkpointer.save(path, self.model, self.optimizer)

    def load_checkpoint(self, path):
        return self.checkpointer.load(path, self.model, self.optimizer)


def train(run, steps, rank, world, start=0):
    from tests.multirank.main_params_cases import batch
    for i in range(start, start + steps):
        run.train_step(*batch(i, rank, world))
    return run


class _Logged(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def load(run, path):
    """``run.load_checkpoint(path)``: (its result, the fp32 fallback warnings and log lines)."""
    handler = _Logged()
    for name in (UP.logger.name, CKPT.logger.name):
        logging.getLogger(name).addHandler(handler)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            result = run.load_checkpoint(path)
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as exc:   # DCP's CheckpointException is a BaseException: keep it in its check
        if isinstance(exc, Exception):
            raise
        raise RuntimeError(f"{type(exc).__name__}: {exc}") from exc
    finally:
        for name in (UP.logger.name, CKPT.logger.name):
            logging.getLogger(name).removeHandler(handler)
    said = [str(w.message) for w in caught if "fp32" in str(w.message)] + handler.messages
    return result, said


def snap(run):
    return snapshot(run.model, run.optimizer)


def _refused(run, path):
    """``run.load_checkpoint(path)`` raises, naming every dropped param, and changes nothing."""
    before = snap(run)
    try:
        load(run, path)
    except (ValueError, RuntimeError) as exc:
        message = str(exc)
    else:
        raise AssertionError(f"{type(run).__name__} loaded a partial section")
    assert all(name in message for name in DROPPED), message
    bad = differences(before, snap(run))
    assert not bad, f"{type(run).__name__}: a refused load wrote {bad}"
    return message


def metadata(path):
    return dcp.FileSystemReader(path).read_metadata().state_dict_metadata


def _describe(md):
    if isinstance(md, TensorStorageMetadata):
        return ("tensor", str(md.properties.dtype), tuple(md.size))
    return ("bytes",)


def write_partial_and_plain(trainer, tmp):
    """From ours: the upstream layout with two section entries dropped, and with no section."""
    model_sd = get_model_state_dict(trainer.model)
    sd = upstream_state_dict(trainer.model, trainer.optimizer)
    section = sd["_mixed_precision_optimizer"]["fp32_from_fp16_params"]
    partial = {**sd, "_mixed_precision_optimizer": {
        "fp32_from_fp16_params": {k: v for k, v in section.items() if k not in DROPPED}}}
    dcp.save({"model": model_sd, "optimizer": partial}, checkpoint_id=os.path.join(tmp, "partial"))
    plain = {k: v for k, v in sd.items() if k != "_mixed_precision_optimizer"}
    dcp.save({"model": model_sd, "optimizer": plain}, checkpoint_id=os.path.join(tmp, "plain"))


def two_ranks(rank, world, tmp):
    checks, facts = Checks(), {"optimizer": OPTIMIZER}
    ours_run = train(ours(world), 2, rank, world)
    up_run = train(Upstream(world), 2, rank, world)
    paths = {name: os.path.join(tmp, name) for name in ("ours", "upstream", "torch")}
    ours_run.save_checkpoint(paths["ours"])
    up_run.save_checkpoint(paths["upstream"])
    saved = snap(ours_run)
    if rank == 0:
        torch.save(saved, os.path.join(tmp, "saved.pt"))
    write_partial_and_plain(ours_run, tmp)
    reference = snap(train(ours(world), 3, rank, world))        # uninterrupted, one step further
    outcomes = facts.setdefault("outcomes", {})

    @checks("patch_applied")
    def _():
        import npu_fsdp_patches
        state = {r["name"]: r["state"] for r in npu_fsdp_patches.status()}["hp_fp32_main_params"]
        assert state == "applied" and type(ours_run.optimizer).__name__ == "MainParamsOptimizer", state

    @checks("trained_alike")   # the stand-in steps as ours does: the comparisons below can be bitwise
    def _():
        bad = differences(saved, snap(up_run))
        assert not bad, bad

    @checks("keys_as_upstream")
    def _():
        ours_md, up_md = metadata(paths["ours"]), metadata(paths["upstream"])
        assert sorted(ours_md) == sorted(up_md), (sorted(set(ours_md) ^ set(up_md)))
        kinds = {k: (_describe(ours_md[k]), _describe(up_md[k])) for k in ours_md}
        assert all(a == b for a, b in kinds.values()), {k: v for k, v in kinds.items() if v[0] != v[1]}
        facts["keys"] = sorted(ours_md)

    @checks("main_params_once")
    def _():
        keys = metadata(paths["ours"])
        low = sorted(n for n, p in ours_run.model.named_parameters() if p.dtype == torch.bfloat16)
        section = sorted(k[len(f"optimizer.{SECTION}."):] for k in keys if k.startswith(f"optimizer.{SECTION}."))
        assert section == low and low, (section, low)
        assert not [k for k in keys if k.endswith((".main_param", ".main_grad")) or "main_grad" in k]
        stored = {k: keys[k] for k in keys if isinstance(keys[k], TensorStorageMetadata)
                  and keys[k].properties.dtype == torch.float32 and tuple(keys[k].size) != ()}
        mains = [k for k in stored if k.startswith(f"optimizer.{SECTION}.")]
        assert len(mains) == len(low)

    def resumes(target, checkpoint, key, branch):
        """``target`` loads ``checkpoint`` with no fallback: the saved state bit for bit, then the
        uninterrupted run's next step."""
        outcomes[f"{checkpoint}:{key}"], said = load(target, paths[checkpoint])
        assert outcomes[f"{checkpoint}:{key}"] == branch and not said, (outcomes, said)
        assert not getattr(getattr(target, "checkpointer", None), "missing_optimizer", None)
        bad = differences(saved, snap(target))
        assert not bad, f"loaded state differs: {bad}"
        bad = differences(reference, snap(train(target, 1, rank, world, start=2)))
        assert not bad, f"next step differs: {bad}"

    checks.run("upstream_resumes_ours", lambda: resumes(Upstream(world, seed=7), "ours", "upstream", 1))
    checks.run("ours_resumes_upstream", lambda: resumes(ours(world, seed=7), "upstream", "ours", "main_params"))

    @checks("negative_control")
    def _():
        target = ours(world, seed=7)
        load(target, paths["upstream"])
        assert differences(saved, one_ulp_off(snap(target))) == {"proj1.weight.main": 1}

    @checks("partial_refused_by_both")
    def _():
        for run, key in ((train(ours(world, seed=7), 1, rank, world), "ours"),
                         (train(Upstream(world, seed=7), 1, rank, world), "upstream")):
            outcomes[f"partial:{key}"] = "refused: " + _refused(run, os.path.join(tmp, "partial"))

    @checks("plain_takes_branch_2")
    def _():
        loaded = {}
        for run, key in ((ours(world, seed=7), "ours"), (Upstream(world, seed=7), "upstream")):
            branch, said = load(run, os.path.join(tmp, "plain"))
            outcomes[f"plain:{key}"] = branch
            assert said, f"{key}: no warning that the fp32 tails are lost"
            loaded[key] = snap(run)
            for name, entry in loaded[key].items():
                assert torch.equal(entry["main"], entry["param"].float()), f"{key}: {name} not rebuilt"
        assert (outcomes["plain:ours"], outcomes["plain:upstream"]) == ("plain", 2)
        assert not differences(loaded["ours"], loaded["upstream"])

    @checks("torch_layout_unchanged")
    def _():
        from npu_fsdp_patches.optim import load_checkpoint, save_checkpoint
        save_checkpoint(paths["torch"], ours_run.model, ours_run.optimizer)
        keys = metadata(paths["torch"])
        assert not [k for k in keys if SECTION in k]
        assert {k.split(".")[-1] for k in keys if k.startswith("optimizer.state.")} >= {"main_param", "exp_avg"}
        assert any(k.startswith("optimizer.param_groups.0.") for k in keys)
        target = ours(world, seed=7)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            outcomes["torch:ours"] = load_checkpoint(paths["torch"], target.model, target.optimizer)
        assert outcomes["torch:ours"] == "main_params" and not [w for w in caught if "fp32" in str(w.message)]
        assert not differences(saved, snap(target))

    @checks("every_loader_outcome")   # what the checkpoint command's predictions are compared with
    def _():
        for name in CHECKPOINTS:
            path = os.path.join(tmp, name)
            outcomes[f"{name}:torch"] = torch_api_load(ours(world, seed=7), path, saved)
            for key, build in (("ours", ours), ("upstream", Upstream)):
                if f"{name}:{key}" not in outcomes:
                    try:
                        outcomes[f"{name}:{key}"] = load(build(world, seed=7), path)[0]
                    except (ValueError, RuntimeError) as exc:
                        outcomes[f"{name}:{key}"] = f"refused: {exc}"

    dist.barrier()
    return {"checks": checks.results, "facts": facts}


def torch_api_load(run, path, saved):
    """torch's own recipe into our wrapper: ``dcp.load`` of ``get_state_dict``'s template (default
    planner), ``set_state_dict``: "exact" (every main param and moment as ``saved``), "rebuilt", or
    "refused: <what torch raised>"."""
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    msd, osd = get_state_dict(run.model, run.optimizer)
    state = {"model": msd, "optimizer": osd}
    try:
        dcp.load(state, checkpoint_id=path)
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as exc:   # noqa: BLE001 - DCP's CheckpointException is a BaseException
        return f"refused: {type(exc).__name__}"
    set_state_dict(run.model, run.optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
    return "exact" if not differences(saved, snap(run)) else "differs"


def three_ranks(rank, world, tmp):
    """The 2-rank checkpoints at 3 ranks: loaded exactly, and upstream and ours take the same next step."""
    checks, outcomes = Checks(), {}
    saved = torch.load(os.path.join(tmp, "saved.pt"), weights_only=True)

    def both(path, what):
        runs = {"upstream": Upstream(world, seed=7), "ours": ours(world, seed=7)}
        for key, run in runs.items():
            branch, said = load(run, path)
            outcomes[f"{what}:{key}"] = branch
            assert branch in (1, "main_params") and not said, (key, branch, said)
            bad = differences(saved, snap(run))
            assert not bad, f"{key} loaded {what}'s checkpoint differently: {bad}"
        steps = {key: snap(train(run, 1, rank, world, start=2)) for key, run in runs.items()}
        bad = differences(steps["upstream"], steps["ours"])
        assert not bad, f"next step differs: {bad}"

    checks.run("upstream_resumes_ours_resharded", lambda: both(os.path.join(tmp, "ours"), "ours"))
    checks.run("ours_resumes_upstream_resharded", lambda: both(os.path.join(tmp, "upstream"), "upstream"))

    @checks("converted_to_torch_loads_through_torchs_api")
    def _():   # the command converted our upstream-layout checkpoint offline, between the launches
        outcome = torch_api_load(ours(world, seed=7), os.path.join(tmp, "ours_as_torch"), saved)
        assert outcome == "exact", outcome

    @checks("converted_to_upstream_loads_into_upstream")
    def _():
        run = Upstream(world, seed=7)
        branch, said = load(run, os.path.join(tmp, "torch_as_upstream"))
        assert branch == 1 and not said and not run.checkpointer.missing_optimizer, (branch, said)
        bad = differences(saved, snap(run))
        assert not bad, bad

    @checks("partial_refused_resharded")
    def _():
        for run in (ours(world, seed=7), Upstream(world, seed=7)):   # trained: priming would add state
            _refused(train(run, 1, rank, world), os.path.join(tmp, "partial"))

    dist.barrier()
    return {"checks": checks.results, "facts": {"outcomes": outcomes}}
