"""Bit-exactness contract of foreach_adamw_step vs torch FSDP2 (docs/design.md#44-hp_skip_dispatch_adamw;
issue 5 item 3).

One 2-rank gloo launch: real ``fully_shard`` params stepped by ``torch.optim.AdamW(foreach=True)`` vs
``foreach_adamw_step`` on the same local shards (torch DTensor, plain and hyper-parallel stand-in
params), 50 steps, bf16 and fp32, two param groups, uneven and empty shards, grads from 1e-10 to O(1).
"""
import pytest

from tests.distributed import run_ranks
from tests.support import install_fixture

KINDS = ("torch_dtensor", "plain", "hyper")


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    site = install_fixture("hyper_parallel_new", tmp_path_factory.mktemp("hp"))
    return run_ranks("tests.multirank.foreach_adamw_cases:contract", world_size=2,
                     args={"hyper_site": str(site), "steps": 50}, timeout=300)


@pytest.mark.parametrize("case", ["bf16", "fp32", "bf16_adam_l2_amsgrad_maximize"])
def test_bitwise_equal_to_torch_fsdp2_every_step(results, case):
    for rank, result in enumerate(results):
        res = result[case]
        assert res["steps_ok"], f"rank {rank}: optimizer step count is off"
        for kind in KINDS:
            assert kind in res["counts"], f"candidate {kind} did not run"
            assert sum(res["counts"][kind].values()) == 0, (
                f"rank {rank} {case} {kind}: {res['counts'][kind]}; first: {res['first']}")


def test_shards_are_uneven_and_empty(results):
    # 16x8 + 7 + 1 + 5x3 elements: rank 0 holds 8x8+4+1+3x3, rank 1 holds 8x8+3+0+2x3
    assert [r["bf16"]["elements"] for r in results] == [78, 73]


def test_state_keeps_torch_format(results):
    for result in results:
        types = result["bf16"]["state_types"]
        assert types["torch_dtensor"] == ["DTensor", "Tensor"]  # DTensor moments, CPU step tensor
        assert types["plain"] == ["Tensor"]
        assert types["hyper"] == ["Tensor"]  # what torch itself creates under SkipDTensorDispatch


def test_negative_control_fp32_math_then_round_mismatches(results):
    for rank, result in enumerate(results):
        assert result["bf16"]["control"] >= 1, f"rank {rank}: fp32-then-.to(bf16) matched bit for bit"
        assert result["bf16"]["first_control"].startswith("step 1 "), result["bf16"]["first_control"]


def test_comparator_detects_one_ulp(results):
    for result in results:
        assert result["one_ulp"] == {"torch.bfloat16": 1, "torch.float32": 1}


def test_grad_with_other_local_shape_is_rejected(results):
    for result in results:
        assert result["grad_layout_error"] == (
            "param_groups[0]['params'][0]: grad local shape (4,) differs from the param's (2,)")
