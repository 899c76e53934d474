"""hp_fp32_main_params on hyper-parallel's args-based trainer lineage (issue 30).

tests/fixtures/hyper_parallel_args follows ``hyper_parallel/trainer/base.py`` at e3e3a0e1:
``BaseTrainer(args)`` with no ``self.config``, ``_build_optimizer()`` building
``torch.optim.AdamW(..., foreach=args.train.optimizer.foreach)``, the step under
``SkipDTensorDispatch``. Its contract is not the one the patch wraps, so the patch stands down, says why
in ``status``, ``explain`` and ``doctor``, and the trainer runs as without the plugin, constructed by
position or by keyword. Child: tests/children/hp_args_lineage.py.
"""
import pytest

from tests.distributed import launch_once, run_ranks
from tests.multirank import hp_args_recipe_cases as recipe
from tests.support import assert_check, install_fixture, run_case
from tests.torch_versions import needs_fsdp2_on_cpu


@pytest.fixture(scope="module")
def outcome(tmp_path_factory):
    from tests.support import install_fixture
    site = install_fixture("hyper_parallel_args", tmp_path_factory.mktemp("args_lineage"))
    return run_case("tests.children.hp_args_lineage:run", paths=[site], timeout=180,
                    env={"NPU_FSDP_PATCHES_ENABLE": "hp_fp32_main_params"})


def test_patch_stands_down_on_the_args_lineage_and_says_why(outcome):
    assert outcome["state"] == "skipped" and outcome["error"] is None, outcome
    assert "args lineage" in outcome["note"] and "['args']" in outcome["note"], outcome["note"]
    for view in ("explain", "doctor"):
        text = " ".join(outcome[view].split())   # both wrap long lines
        assert "takes ['args'], not config (args lineage)" in text, f"{view} lacks the reason:\n{outcome[view]}"


def test_the_trainer_runs_unwrapped_by_position_and_by_keyword(outcome):
    assert [s["construct"] for s in outcome["steps"]] == ["positional", "keyword"]
    for step in outcome["steps"]:
        assert step["optimizer"] == "AdamW"           # never wrapped, never an AttributeError
        assert step["foreach"] == [False, False]      # args.train.optimizer.foreach reaches torch
        assert step["moved"] is True


@launch_once
def _recipe(tmp):
    from pathlib import Path
    site = install_fixture("hyper_parallel_args", Path(tmp) / "site")
    return run_ranks("tests.multirank.hp_args_recipe_cases:two_ranks", 2, args={"tmp": tmp}, timeout=300,
                     env={"PYTHONPATH": str(site), "NPU_FSDP_PATCHES_ENABLE": "hp_fp32_main_params"})


@needs_fsdp2_on_cpu
@pytest.mark.parametrize("check", recipe.CHECKS)
def test_wrapping_by_hand_on_the_args_lineage(tmp_path_factory, check):
    """docs/main_params.md#8's recipe on 2 ranks, bf16 fully_shard: it wraps the base's AdamW, steps as
    hyper-parallel's own fp32 wrapper does (bitwise), keeps updates below a bf16 ulp, resumes exactly."""
    assert_check(_recipe(str(tmp_path_factory.getbasetemp() / "args_recipe")), check, recipe.CHECKS)
