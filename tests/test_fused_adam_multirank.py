"""FusedAdam on torch DTensor over gloo: the test matrix of docs/te_fused_adam.md#rfc-42-test-matrix,
docs/design.md#41-te_fused_adam_dtensor rules, DCP resharding.

Each launch runs once (module-scoped fixtures) and records its named checks; every check is its own
test below, and a check the rank code never ran fails as such. One 2-rank launch
(tests/multirank/fused_adam_two_ranks.py) runs the numerics, precision and DCP-save cases; the 1- and
4-rank launches resume its checkpoint.
"""
import os

import pytest

from tests.distributed import run_ranks
from tests.multirank import fused_adam_cases, fused_adam_dcp_cases
from tests.support import assert_check

_ENV = {"TORCH_DEVICE_BACKEND_AUTOLOAD": os.environ.get("TORCH_DEVICE_BACKEND_AUTOLOAD", "1")}
DCP = "tests.multirank.fused_adam_dcp_cases"


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    d = tmp_path_factory.mktemp("dcp")
    args = {"ckpt": str(d / "ckpt"), "ref_path": str(d / "reference.pt")}
    return args, run_ranks("tests.multirank.fused_adam_two_ranks:two_ranks", 2, args=args, timeout=600,
                           env=_ENV)


@pytest.fixture(scope="module")
def numerics(two_ranks):
    return [r["numerics"] for r in two_ranks[1]]


@pytest.fixture(scope="module")
def precision(two_ranks):
    return [r["precision"] for r in two_ranks[1]]


@pytest.mark.parametrize("check", fused_adam_cases.NUMERICS_CHECKS)
def test_numerics_layouts_empty_shards_collectives_and_rejections(numerics, check):
    assert_check(numerics, check, fused_adam_cases.NUMERICS_CHECKS)


def test_empty_shard_steps_along_and_step_has_no_collectives(numerics):
    rank0, rank1 = (r["facts"] for r in numerics)
    # numel 1 on 2 ranks: rank 1 holds an empty shard, feeds the kernel nothing, yet steps along
    assert rank0["empty"]["local_numel"] == 1 and rank1["empty"]["local_numel"] == 0
    assert rank1["empty"]["kernel_sizes"] == [] and rank0["empty"]["kernel_sizes"]
    assert rank0["empty"]["steps"] == rank1["empty"]["steps"] == [3, 3]
    assert rank1["empty"]["scale"] == 1.0
    assert rank0["collectives_in_step"] == rank1["collectives_in_step"] == []


@pytest.mark.parametrize("check", fused_adam_cases.PRECISION_CHECKS)
def test_low_precision_and_master_weight_checkpoints(precision, check):
    assert_check(precision, check, fused_adam_cases.PRECISION_CHECKS)


@pytest.fixture(scope="module")
def saved_checkpoint(two_ranks):
    args, results = two_ranks
    return args, [r["dcp"] for r in results]


@pytest.fixture(scope="module", params=[2, 1, 4], ids=lambda w: f"world{w}")
def resumed(request, saved_checkpoint):
    """Results of resuming the 2-rank checkpoint at 2 (same launch as the save), 1 and 4 ranks."""
    args, saved = saved_checkpoint
    if request.param == 2:
        return 2, saved
    return request.param, run_ranks(f"{DCP}:dcp_resume_other_world", request.param, args=args,
                                    timeout=240, env=_ENV)


@pytest.mark.parametrize("check", fused_adam_dcp_cases.CHECKS)
def test_dcp_resume_matches_the_uninterrupted_run(resumed, check):
    assert_check(resumed[1], check, fused_adam_dcp_cases.CHECKS)


def test_dcp_resume_continues_the_step_count_and_reshards(resumed):
    world, results = resumed
    assert all(r["steps_after_load"] == [3] for r in results)
    assert sum(r["local_numels"]["w7"] for r in results) == 7
    if world == 2:  # numel 1 on 2 ranks: rank 1 resumes an empty shard
        assert [r["local_numels"]["w1"] for r in results] == [1, 0]
