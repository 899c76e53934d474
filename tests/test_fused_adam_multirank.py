"""FusedAdam on torch DTensor over gloo: the test matrix of docs/te_fused_adam.md#rfc-42-test-matrix,
docs/design.md#41-te_fused_adam_dtensor rules, DCP resharding."""
import os

import pytest

from tests.distributed import run_ranks

_ENV = {"TORCH_DEVICE_BACKEND_AUTOLOAD": os.environ.get("TORCH_DEVICE_BACKEND_AUTOLOAD", "1")}
CASES = "tests.multirank.fused_adam_cases"
DCP = "tests.multirank.fused_adam_dcp_cases"


def _no_failures(results):
    for rank, r in enumerate(results):
        assert r["failures"] == [], f"rank {rank}: " + "\n".join(r["failures"])


def test_numerics_layouts_empty_shards_collectives_and_rejections():
    results = run_ranks(f"{CASES}:numerics_matrix", 2, timeout=240, env=_ENV)
    _no_failures(results)
    rank0, rank1 = (r["facts"] for r in results)
    # numel 1 on 2 ranks: rank 1 holds an empty shard, feeds the kernel nothing, yet steps along
    assert rank0["empty"]["local_numel"] == 1 and rank1["empty"]["local_numel"] == 0
    assert rank1["empty"]["kernel_sizes"] == [] and rank0["empty"]["kernel_sizes"]
    assert rank0["empty"]["steps"] == rank1["empty"]["steps"] == [3, 3]
    assert rank1["empty"]["scale"] == 1.0
    assert rank0["collectives_in_step"] == rank1["collectives_in_step"] == []


def test_low_precision_and_master_weight_checkpoints():
    _no_failures(run_ranks(f"{CASES}:precision_checkpoints", 2, timeout=300, env=_ENV))


@pytest.fixture(scope="module")
def saved_checkpoint(tmp_path_factory):
    d = tmp_path_factory.mktemp("dcp")
    args = {"ckpt": str(d / "ckpt"), "ref_path": str(d / "reference.pt")}
    results = run_ranks(f"{DCP}:dcp_save_and_resume", 2, args=args, timeout=240, env=_ENV)
    return args, results


def test_dcp_save_at_2_load_at_2_and_continue(saved_checkpoint):
    _, results = saved_checkpoint
    _no_failures(results)
    assert [r["steps_after_load"] for r in results] == [[3], [3]]
    assert [r["local_numels"]["w1"] for r in results] == [1, 0]


@pytest.mark.parametrize("world", [1, 4])
def test_dcp_load_at_another_world_size_and_continue(saved_checkpoint, world):
    args, _ = saved_checkpoint
    results = run_ranks(f"{DCP}:dcp_resume_other_world", world, args=args, timeout=240,
                        env=_ENV)
    _no_failures(results)
    assert all(r["steps_after_load"] == [3] for r in results)
    assert sum(r["local_numels"]["w7"] for r in results) == 7
