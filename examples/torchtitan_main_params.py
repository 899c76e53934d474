"""fp32 main params for a bf16 model in torchtitan's OptimizersContainer, resumed by its CheckpointManager.

    torchrun --nproc_per_node=2 examples/torchtitan_main_params.py [--device cpu|cuda|npu] [--ckpt DIR]

Needs torchtitan (0.3.0, installed as docs/integrations/torchtitan.md says; it imports with torch >= 2.10)
and numpy in the environment where npu_fsdp_patches is installed; without either it exits 2 at once and
says which. No
patch is needed for torchtitan. torchtitan 0.3.0 builds only Adam, AdamW and DistMuon by name
(``OptimizersContainer._resolve_optimizer_factory``) and hands its factory no model, so the wrapper
cannot be named in its config: :class:`MainParamsOptimizersContainer` (below) builds torchtitan's
optimizers and wraps each in ``MainParamsOptimizer``. It has its own ``Config``, so a trainer config
can name it (``optimizer=MainParamsOptimizersContainer.Config(...)``) and torchtitan's trainer builds it.

1. **fp32 masters, saved and resumed.** A bf16 model, built as torchtitan's trainer builds one with
   ``training.dtype="bfloat16"`` (params stored in bf16, no fp32 copy) and sharded with ``fully_shard``
   (fp32 gradient reduction), with torchtitan's AdamW wrapped, trains 4 steps; a second run trains 2,
   saves with torchtitan's own ``CheckpointManager`` (its flat optimizer state carries ``state.<fqn>.main_param``),
   resumes into a fresh model, container and LR scheduler and trains 2 more. Check: bit for bit the
   uninterrupted run (losses, bf16 params, fp32 main params).
2. **A plain AdamW run moves to fp32 masters.** A run with torchtitan's plain ``OptimizersContainer``
   saves after 2 steps. torchtitan's ``CheckpointManager`` cannot load that into the wrapped container
   (``dcp.load`` with no planner: ``Missing key in checkpoint state_dict: optimizer.state.<fqn>.main_param``);
   :class:`RebuildMainParamsCheckpointManager` (below) passes ``RebuildMainParamsPlanner`` to that
   ``dcp.load``, so the main params are rebuilt from the loaded bf16 params, with a warning. Check: the
   resumed run equals the plain run's state handed to the wrapped container in memory, bit for bit.

Exits 1 when a check fails. The checkpoints go to ``--ckpt DIR`` (kept), else to a temporary folder
that the example removes at the end.
"""
import argparse
import os
import warnings
from dataclasses import dataclass

import npu_fsdp_patches

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from device_setup import (add_device_argument, checkpoint_dir, finish, init_distributed, require,
                          require_numpy)
from npu_fsdp_patches.optim import MainParamsOptimizer, RebuildMainParamsPlanner

EXAMPLE = "torchtitan_main_params.py"
require_numpy(EXAMPLE)
for _module in ("torchtitan.components.optimizer", "torchtitan.components.checkpointer"):
    require(EXAMPLE, _module, "torchtitan 0.3.0's OptimizersContainer and CheckpointManager, on torch >= 2.10",
            "install it as docs/integrations/torchtitan.md says, `pip install torchtitan==0.3.0`")

from torchtitan.components.checkpointer import CheckpointManager  # noqa: E402  (after the check above)
from torchtitan.components.checkpointer.base import MODEL  # noqa: E402
from torchtitan.components.optimizer import (LRSchedulersContainer, OptimizersContainer,  # noqa: E402
                                             default_adamw)
from torchtitan.tools.utils import set_default_dtype  # noqa: E402

VOCAB, DIM, BATCH, SEQ = 11, 8, 4, 6
SAVE_AFTER, STEPS = 2, 4
# what torchtitan's apply_fsdp sets (training.mixed_precision_param/_reduce): bf16 compute, fp32 reduction
MIXED_PRECISION = {"param_dtype": torch.bfloat16, "reduce_dtype": torch.float32}
ADAMW = default_adamw(lr=1e-3).param_groups          # torchtitan's AdamW group (betas, eps, weight decay)


class MainParamsOptimizersContainer(OptimizersContainer):
    """torchtitan's ``OptimizersContainer`` with each optimizer it builds wrapped in ``MainParamsOptimizer``
    (over the model part that owns its params). Steps, ``zero_grad``, LR schedulers, hooks and the flat
    FQN-keyed state dict work as before; the state dict adds ``state.<fqn>.main_param`` per bf16 param."""

    @dataclass(kw_only=True, slots=True)
    class Config(OptimizersContainer.Config):
        """The same fields as torchtitan's; ``build(model_parts=...)`` makes this container."""

    def __init__(self, config: Config, *, model_parts: list) -> None:
        super().__init__(config, model_parts=model_parts)
        self.optimizers = [MainParamsOptimizer(opt, _part_of(opt, model_parts)) for opt in self.optimizers]


def _part_of(optimizer, model_parts: list) -> nn.Module:
    ids = {id(p) for group in optimizer.param_groups for p in group["params"]}
    return next(part for part in model_parts if ids <= {id(p) for p in part.parameters()})


class RebuildMainParamsCheckpointManager(CheckpointManager):
    """torchtitan's ``CheckpointManager`` whose ``dcp.load`` takes ``RebuildMainParamsPlanner``, so a
    checkpoint without fp32 main params (a plain optimizer's) resumes into the wrapped container, the
    main params rebuilt from the loaded model. A checkpoint with them loads exactly as before.
    (torchtitan 0.3.0 components/checkpointer/dcp.py:372 calls ``dcp.load`` with no planner.)"""

    @dataclass(kw_only=True, slots=True)
    class Config(CheckpointManager.Config):
        """The same fields as torchtitan's; ``build(...)`` makes this manager."""

    def dcp_load(self, state_dict: dict, checkpoint_id: str, from_hf: bool, from_quantized: bool) -> None:
        if from_hf:      # a Hugging Face model-only load has no optimizer state: torchtitan's own path
            return super().dcp_load(state_dict, checkpoint_id, from_hf, from_quantized)
        dcp.load(state_dict, checkpoint_id=checkpoint_id, planner=RebuildMainParamsPlanner())
        if MODEL in self.states:
            self.states[MODEL].load_state_dict(state_dict)


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.wq = nn.Linear(DIM, DIM)
        self.wo = nn.Linear(DIM, DIM, bias=False)

    def forward(self, h):
        return h + self.wo(torch.tanh(self.wq(h)))


class TinyDecoder(nn.Module):
    """torchtitan's decoder layout in small: ``tok_embeddings`` (11 rows: uneven shards), ``layers``, ``output``."""

    def __init__(self) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleDict({str(i): Block() for i in range(2)})
        self.output = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, ids):
        h = self.tok_embeddings(ids.reshape(-1))     # tokens as rows: 2-D activations, no views
        for layer in self.layers.values():
            h = layer(h)
        return self.output(h)


def build(container: type, mesh, device) -> tuple:
    """Model, optimizers and LR schedulers as torchtitan's trainer builds them with
    ``training.dtype="bfloat16"`` (trainer.py: the model built under that default dtype, sharded, then
    the optimizers and schedulers from their configs)."""
    torch.manual_seed(1234)
    with set_default_dtype(torch.bfloat16):       # bf16 params, no fp32 copy: what the wrapper adds
        model = TinyDecoder().to(device)
    for layer in model.layers.values():           # each block, then the root, as torchtitan's apply_fsdp
        fully_shard(layer, mesh=mesh, mp_policy=MixedPrecisionPolicy(**MIXED_PRECISION))
    fully_shard(model, mesh=mesh, mp_policy=MixedPrecisionPolicy(**MIXED_PRECISION))
    optimizers = container.Config(param_groups=ADAMW).build(model_parts=[model])
    lr_schedulers = LRSchedulersContainer.Config(warmup_steps=2).build(optimizers=optimizers,
                                                                       training_steps=STEPS)
    return model, optimizers, lr_schedulers


def checkpointer(manager: type, folder: str, model, optimizers, lr_schedulers):
    config = manager.Config(enable=True, folder=folder, interval=1, keep_latest_k=0,
                            initial_load_model_only=False)
    return config.build(dataloader=None, model_parts=[model], optimizers=optimizers,
                        lr_schedulers=lr_schedulers, states={}, sd_adapter=None)


def rank_batch(step: int, device) -> tuple:
    """This rank's rows of the step's global batch: (token ids, next-token targets)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(100 + step)
    ids, targets = torch.randint(0, VOCAB, (2, BATCH * world, SEQ), generator=g).unbind(0)
    rows = slice(rank * BATCH, (rank + 1) * BATCH)
    return ids[rows].to(device), targets[rows].to(device)


def train(model, optimizers, lr_schedulers, steps: range, device) -> list:
    """torchtitan's step order; returns each step's global mean loss."""
    losses = []
    for step in steps:
        optimizers.zero_grad()
        ids, targets = rank_batch(step, device)
        loss = F.cross_entropy(model(ids).float(), targets.reshape(-1))
        loss.backward()
        optimizers.step()
        lr_schedulers.step()
        losses.append(loss.detach())
    total = torch.stack(losses)
    dist.all_reduce(total)
    return (total / dist.get_world_size()).tolist()


def gathered(model, optimizers) -> list:
    """Every param and its fp32 main param, gathered to full tensors."""
    opt = optimizers.optimizers[0]
    return [t.full_tensor() for p in model.parameters() for t in (p, opt.main_param(p))]


def resume_with_fp32_masters(root: str, mesh, device) -> dict:
    """Part 1: a wrapped run saved and resumed by torchtitan's own CheckpointManager."""
    model, optimizers, lr_schedulers = build(MainParamsOptimizersContainer, mesh, device)
    straight = train(model, optimizers, lr_schedulers, range(STEPS), device)
    final = gathered(model, optimizers)

    model, optimizers, lr_schedulers = build(MainParamsOptimizersContainer, mesh, device)
    first = train(model, optimizers, lr_schedulers, range(SAVE_AFTER), device)
    flat = optimizers.state_dict()
    carries = all(f"state.{name}.main_param" in flat for name, _ in model.named_parameters())
    checkpointer(CheckpointManager, root, model, optimizers, lr_schedulers).save(curr_step=SAVE_AFTER)
    model, optimizers, lr_schedulers = build(MainParamsOptimizersContainer, mesh, device)
    manager = checkpointer(CheckpointManager, root, model, optimizers, lr_schedulers)
    manager.load()
    manager.close()
    resumed = first + train(model, optimizers, lr_schedulers, range(SAVE_AFTER, STEPS), device)
    same = resumed == straight and all(torch.equal(a, b) for a, b in zip(final, gathered(model, optimizers)))
    return {"losses": straight, "carries": carries, "same": same}


def plain_to_fp32_masters(root: str, mesh, device) -> dict:
    """Part 2: a plain AdamW run's checkpoint resumed with fp32 masters."""
    plain_model, plain, plain_lr = build(OptimizersContainer, mesh, device)
    train(plain_model, plain, plain_lr, range(SAVE_AFTER), device)
    checkpointer(CheckpointManager, root, plain_model, plain, plain_lr).save(curr_step=SAVE_AFTER)

    model, optimizers, lr_schedulers = build(MainParamsOptimizersContainer, mesh, device)
    try:       # torchtitan's own manager: DCP's refusal is a CheckpointException, a BaseException
        checkpointer(CheckpointManager, root, model, optimizers, lr_schedulers).load()
        refusal = "none (it loaded)"
    except dcp.api.CheckpointException as exc:
        refusal = next((line.strip() for line in str(exc).splitlines() if line.startswith("RuntimeError: Missing key")),
                       str(exc))

    # the uninterrupted run: the plain run's state handed to the wrapped container in memory
    model, optimizers, lr_schedulers = build(MainParamsOptimizersContainer, mesh, device)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")       # "rebuilt from the low-precision model params": expected
        model.load_state_dict(plain_model.state_dict())
        optimizers.load_state_dict(plain.state_dict())
        lr_schedulers.load_state_dict(plain_lr.state_dict())
    straight = train(model, optimizers, lr_schedulers, range(SAVE_AFTER, STEPS), device)
    final = gathered(model, optimizers)

    model, optimizers, lr_schedulers = build(MainParamsOptimizersContainer, mesh, device)
    manager = checkpointer(RebuildMainParamsCheckpointManager, root, model, optimizers, lr_schedulers)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        manager.load()
    manager.close()
    said = [str(w.message) for w in caught if issubclass(w.category, UserWarning)]
    opt = optimizers.optimizers[0]
    rebuilt = all(torch.equal(opt.main_param(p).to_local(), p.to_local().float()) for p in model.parameters())
    resumed = train(model, optimizers, lr_schedulers, range(SAVE_AFTER, STEPS), device)
    same = resumed == straight and all(torch.equal(a, b) for a, b in zip(final, gathered(model, optimizers)))
    warning = next((s for s in said if s.startswith("RebuildMainParamsPlanner: the checkpoint holds no fp32")), None)
    return {"refusal": refusal, "rebuilt": rebuilt, "warning": warning, "same": same}


def patch_line() -> str:
    applied = [r["name"] for r in npu_fsdp_patches.status() if r["state"] == "applied"]
    return (f"npu_fsdp_patches.status(): applied: {', '.join(applied) or 'none'}; no patch is needed "
            "for torchtitan (its containers hold the wrapped optimizers)")


def main() -> None:
    parser = argparse.ArgumentParser()
    add_device_argument(parser)
    parser.add_argument("--ckpt", default=None, help="checkpoint folder (kept); default: a temporary one")
    args = parser.parse_args()
    device = init_distributed(args.device)
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    root = checkpoint_dir(args.ckpt, "torchtitan_main_params")   # a temporary one is removed at the end
    masters = resume_with_fp32_masters(os.path.join(root, "fp32_masters"), mesh, device)
    plain = plain_to_fp32_masters(os.path.join(root, "plain_adamw"), mesh, device)
    if dist.get_rank() == 0:
        print(f"torchtitan OptimizersContainer(AdamW) -> MainParamsOptimizer per optimizer, bf16 model on "
              f"{device.type}, {dist.get_world_size()} ranks")
        print(patch_line())
        print(f"flat optimizer state carries state.<fqn>.main_param for every param: {masters['carries']}")
        print(f"losses: {' '.join(f'{x:.4f}' for x in masters['losses'])}")
        print(f"CheckpointManager resume matches uninterrupted: {masters['same']}")
        print(f"plain AdamW checkpoint into MainParamsOptimizersContainer, torchtitan's CheckpointManager: "
              f"refused: {plain['refusal']}")
        print(f"RebuildMainParamsCheckpointManager warned: {plain['warning']}")
        print(f"plain AdamW checkpoint -> fp32 masters through RebuildMainParamsPlanner: main params rebuilt "
              f"from the bf16 params: {plain['rebuilt']}; resume matches the in-memory switch: {plain['same']}")
    failures = [what for what, bad in (
        ("the resumed run differs from the uninterrupted one", not masters["same"]),
        ("the flat optimizer state lacks main_param", not masters["carries"]),
        ("the plain checkpoint's resume differs from the in-memory switch", not plain["same"]),
        ("the main params were not rebuilt from the loaded bf16 params", not plain["rebuilt"]),
        ("the planner did not warn that it rebuilt the main params", plain["warning"] is None)) if bad]
    finish(not failures, "; ".join(failures))


if __name__ == "__main__":
    main()
