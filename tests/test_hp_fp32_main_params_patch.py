"""hp_fp32_main_params against the hyper-parallel stand-in (tests/fixtures/hyper_parallel_new).

Each test runs in a fresh interpreter with the fixture distribution on the path. The stand-in
trainer predates the upstream FP32 wrapper: without the patch ``optimizer.fp32_main_params`` is
silently dropped (bf16 updates are lost); with it the trainer validates the config, wraps its
ChainedOptimizer (no ``reset_optimizer_parameters``) and checkpoints the main params. Adding
``hyper_parallel/components/optim/mixed_precision_optimizer.py`` makes the patch stand down.
"""
import json
from pathlib import Path

from tests.support import install_fixture, run_python
from tests.torch_versions import HAS_MUON

#: the stand-in trainer routes 2-D weights to torch.optim.Muon for "muon" (torch >= 2.9 only)
OPTIMIZER = "muon" if HAS_MUON else "adamw"

TRAIN = """
import json, tempfile, warnings
import torch
from torch import nn
import npu_fsdp_patches
from __TRAINER_MODULE__ import BaseTrainer

class LM(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(11, 8)
        self.proj = nn.Linear(8, 8)
        self.lm_head = nn.Linear(8, 11, bias=False)
    def forward(self, ids):
        return self.lm_head(torch.tanh(self.proj(self.embed(ids))))

def config(reduce_dtype="float32"):
    mp = {"param_dtype": "bfloat16"} | ({"reduce_dtype": reduce_dtype} if reduce_dtype else {})
    return {"model_init_dtype": "bfloat16", "max_grad_norm": 1.0,
            "optimizer": {"name": "__OPTIMIZER__", "fp32_main_params": True,
                          "muon_config": {"muon_lr": 0.02, "muon_weight_decay": 0.0},
                          "adamw_config": {"adamw_lr": 1e-6, "adamw_weight_decay": 0.0}},
            "fsdp_config": {"mix_precision": mp}}

def batch(step):
    g = torch.Generator().manual_seed(step)
    return torch.randint(0, 11, (4, 6), generator=g), torch.randint(0, 11, (4, 6), generator=g)

out = {"state": {r["name"]: r["state"] for r in npu_fsdp_patches.status()}.get("hp_fp32_main_params"),
       "error": [r.get("error") for r in npu_fsdp_patches.status() if r["name"] == "hp_fp32_main_params"]}
built = []
for bad in (None, "bfloat16"):
    try:
        BaseTrainer(config(bad), lambda: built.append(1) or LM())
    except ValueError as exc:
        out.setdefault("config_errors", []).append(str(exc))
out["models_built_for_bad_configs"] = len(built)

trainer = BaseTrainer(config(), LM)
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
    fresh = BaseTrainer(config(), LM)
    out["load_branch"] = fresh.load_checkpoint(ckpt)
    out["mains_restored"] = all(torch.equal(p.main_param, saved[n]) for n, p in fresh.model.named_parameters())
    a, b = trainer.train_step(*batch(3)), fresh.train_step(*batch(3))
    out["resume_loss_equal"] = a == b
print("RESULT" + json.dumps(out))
"""


def _run(site, env, trainer_module="hyper_parallel.trainer.base"):
    code = TRAIN.replace("__TRAINER_MODULE__", trainer_module).replace("__OPTIMIZER__", OPTIMIZER)
    proc = run_python(code, paths=[site], env=env, timeout=180)
    line = [l for l in proc.stdout.splitlines() if l.startswith("RESULT")][-1]
    return json.loads(line[len("RESULT"):])


def test_patch_makes_fp32_main_params_work(tmp_path):
    site = install_fixture("hyper_parallel_new", tmp_path)
    out = _run(site, {"NPU_FSDP_PATCHES_ENABLE": "hp_fp32_main_params"})
    assert out["state"] == "applied"
    assert out["models_built_for_bad_configs"] == 0 and len(out["config_errors"]) == 2
    for msg in out["config_errors"]:
        assert "optimizer.fp32_main_params" in msg and "fsdp_config.mix_precision.reduce_dtype" in msg
    assert out["optimizer"] == "MainParamsOptimizer"
    assert out["head_main_changed"] is True and out["model_is_cast_main"] is True
    assert out["load_branch"] == "main_params" and out["mains_restored"] is True
    assert out["resume_loss_equal"] is True


def test_without_patch_the_key_is_dropped_and_small_updates_are_lost(tmp_path):
    site = install_fixture("hyper_parallel_new", tmp_path)
    out = _run(site, {"NPU_FSDP_PATCHES_DISABLE": "hp_fp32_main_params"})
    assert out["state"] == "disabled"
    assert out["optimizer"] == "ChainedOptimizer" and out["models_built_for_bad_configs"] == 2
    assert out["head_changed"] is False       # the pre-fix bug this patch exists for


def test_stands_down_when_upstream_wrapper_exists(tmp_path):
    site = install_fixture("hyper_parallel_new", tmp_path)
    optim = Path(site) / "hyper_parallel" / "components" / "optim"
    optim.mkdir(parents=True)
    for pkg in (optim.parent, optim):
        (pkg / "__init__.py").write_text('"""temp copy: upstream wrapper present"""\n')
    (optim / "mixed_precision_optimizer.py").write_text('"""upstream FP32 wrapper (present)."""\n')
    out = _run(site, {})
    assert out["state"] == "skipped"
    assert out["optimizer"] == "ChainedOptimizer"


def test_patch_covers_the_older_auto_models_trainer_path(tmp_path):
    """Builds before the trainer moved keep it at hyper_parallel/auto_models/trainer
    (docs/hyper_parallel.md#16-trainer)."""
    site = install_fixture("hyper_parallel_new", tmp_path)
    package = Path(site) / "hyper_parallel"
    (package / "auto_models").mkdir()
    (package / "auto_models" / "__init__.py").write_text('"""temp copy: the older trainer location"""\n')
    (package / "trainer").rename(package / "auto_models" / "trainer")
    out = _run(site, {"NPU_FSDP_PATCHES_ENABLE": "hp_fp32_main_params"},
               trainer_module="hyper_parallel.auto_models.trainer.base")
    assert out["state"] == "applied"
    assert out["optimizer"] == "MainParamsOptimizer"
    assert out["models_built_for_bad_configs"] == 0
    assert out["head_main_changed"] is True and out["resume_loss_equal"] is True
