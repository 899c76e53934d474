"""hyper-parallel's own fp32 wrapper and DCP checkpointer resume the patched trainer's checkpoints, and
the patched trainer resumes theirs, bit for bit, next step included (issue 39; docs/main_params.md#5).

Ours: the config-lineage trainer stand-in tests/fixtures/hyper_parallel_new with ``hp_fp32_main_params``
applied through the plugin. Upstream: tests/fixtures/upstream_fp32_wrapper (its wrapper and its DCP
checkpointer's three load branches, written apart from our code). bf16 ``fully_shard``, Muon + AdamW
(AdamW alone on torch < 2.9: no ``torch.optim.Muon``). One 2-rank launch saves and cross-loads; one
3-rank launch loads the same checkpoints resharded. Rank code: tests/multirank/upstream_resume_cases.py.
"""
import pytest

from tests.distributed import launch_once, run_ranks
from tests.multirank import upstream_resume_cases as cases
from tests.support import assert_check, install_fixture


@launch_once
def _launch(tmp):
    from pathlib import Path
    site = install_fixture("hyper_parallel_new", Path(tmp) / "site")
    env = {"PYTHONPATH": str(site), "NPU_FSDP_PATCHES_ENABLE": "hp_fp32_main_params"}
    ckpt = str(Path(tmp) / "ckpt")
    two = run_ranks("tests.multirank.upstream_resume_cases:two_ranks", 2, args={"tmp": ckpt}, env=env,
                    timeout=420)
    three = run_ranks("tests.multirank.upstream_resume_cases:three_ranks", 3, args={"tmp": ckpt}, env=env,
                      timeout=420)
    return ckpt, two, three


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    return _launch(str(tmp_path_factory.mktemp("upstream_resume")))


@pytest.mark.parametrize("check", cases.TWO_RANK_CHECKS)
def test_two_ranks(launched, check):
    assert_check(launched[1], check, cases.TWO_RANK_CHECKS)


@pytest.mark.parametrize("check", cases.THREE_RANK_CHECKS)
def test_resharded_to_three_ranks(launched, check):
    assert_check(launched[2], check, cases.THREE_RANK_CHECKS)
