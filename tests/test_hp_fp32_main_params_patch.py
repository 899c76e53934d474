"""hp_fp32_main_params against the hyper-parallel stand-in (tests/fixtures/hyper_parallel_new).

Each test runs tests/children/hp_fp32_trainer.py in a fresh interpreter with the fixture distribution on the path. The stand-in
trainer predates the upstream FP32 wrapper: without the patch ``optimizer.fp32_main_params`` is
silently dropped (bf16 updates are lost); with it the trainer validates the config, wraps its
ChainedOptimizer (no ``reset_optimizer_parameters``) and checkpoints the main params. Adding
``hyper_parallel/components/optim/mixed_precision_optimizer.py`` makes the patch stand down.
"""
from pathlib import Path

from tests.support import run_case
from tests.torch_versions import HAS_MUON

#: the stand-in trainer routes 2-D weights to torch.optim.Muon for "muon" (torch >= 2.9 only)
OPTIMIZER = "muon" if HAS_MUON else "adamw"



def _run(site, env, trainer_module="hyper_parallel.trainer.base"):
    return run_case("tests.children.hp_fp32_trainer:train", paths=[site], env=env, timeout=180,
                    args={"trainer_module": trainer_module, "optimizer": OPTIMIZER})


def test_patch_makes_fp32_main_params_work(hyper_site):
    out = _run(hyper_site, {"NPU_FSDP_PATCHES_ENABLE": "hp_fp32_main_params"})
    assert out["state"] == "applied"
    assert out["models_built_for_bad_configs"] == 0 and len(out["config_errors"]) == 2
    for msg in out["config_errors"]:
        assert "optimizer.fp32_main_params" in msg and "fsdp_config.mix_precision.reduce_dtype" in msg
    assert out["optimizer"] == "MainParamsOptimizer"
    assert out["head_main_changed"] is True and out["model_is_cast_main"] is True
    assert out["load_branch"] == "main_params" and out["mains_restored"] is True
    assert out["resume_loss_equal"] is True


def test_without_patch_the_key_is_dropped_and_small_updates_are_lost(hyper_site):
    out = _run(hyper_site, {"NPU_FSDP_PATCHES_DISABLE": "hp_fp32_main_params"})
    assert out["state"] == "disabled"
    assert out["optimizer"] == "ChainedOptimizer" and out["models_built_for_bad_configs"] == 2
    assert out["head_changed"] is False       # the pre-fix bug this patch exists for


def test_stands_down_when_upstream_wrapper_exists(hyper_site):
    site = hyper_site
    optim = Path(site) / "hyper_parallel" / "components" / "optim"
    optim.mkdir(parents=True)
    for pkg in (optim.parent, optim):
        (pkg / "__init__.py").write_text('"""temp copy: upstream wrapper present"""\n')
    (optim / "mixed_precision_optimizer.py").write_text('"""upstream FP32 wrapper (present)."""\n')
    out = _run(site, {})
    assert out["state"] == "skipped"
    assert out["optimizer"] == "ChainedOptimizer"


def test_patch_covers_the_older_auto_models_trainer_path(hyper_site):
    """Builds before the trainer moved keep it at hyper_parallel/auto_models/trainer
    (docs/hyper_parallel.md#16-trainer)."""
    site = hyper_site
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


def _trainer_module(init_source: str, extra: str = ""):
    """A module holding a ``BaseTrainer`` with the given ``__init__`` (the lineage under test)."""
    import types
    module = types.ModuleType("lineage_case")
    exec(f"class BaseTrainer:\n    {init_source}\n    def _build_optimizer(self):\n        return 'built'\n{extra}",
         module.__dict__)
    return module


def test_lineages_are_decided_by_signature():
    from patches.hp_fp32_main_params import trainer_shape_problem
    assert trainer_shape_problem(_trainer_module("def __init__(self, config, model_fn): pass")) == ""
    args = trainer_shape_problem(_trainer_module("def __init__(self, args): pass"))
    assert "args lineage" in args and "['args']" in args
    hyper = trainer_shape_problem(_trainer_module("def __init__(self, config): pass",
                                                  "class HyperTrainer:\n    pass\n"))
    assert "HyperTrainer" in hyper


def test_wrappers_pass_keyword_and_positional_construction_through():
    import inspect
    from patches.hp_fp32_main_params import _build_optimizer, _init
    module = _trainer_module("def __init__(self, args):\n        self.args = args\n"
                             "        self.optimizer = self._build_optimizer()")
    cls = module.BaseTrainer
    original = cls.__init__
    cls.__init__ = _init(original)
    cls._build_optimizer = _build_optimizer(cls.__dict__["_build_optimizer"])
    assert inspect.signature(cls.__init__) == inspect.signature(original)
    assert cls.__init__.__wrapped__ is original
    for trainer in (cls({"train": 1}), cls(args={"train": 1})):   # no self.config: no AttributeError
        assert trainer.optimizer == "built" and trainer.args == {"train": 1}
