"""RFC 001 acceptance cases 2.1-2.5 (docs/hyper_parallel.md#5-hyper-parallel-rfc-001) and
MainParamsOptimizer through torch's distributed state-dict API (docs/main_params.md), with real
torch FSDP2 + DCP on gloo (docs/design.md#43-hp_fp32_main_params, #5-test-rules).

Three launches: 2 ranks run the five RFC cases and the torch-API cases (get/set_state_dict, DCP
resume bit for bit, full_state_dict + cpu_offload, flattened, cross-loading) and save; 3 ranks
load those checkpoints resharded 2->3 and rerun the torch-API cases; 2 ranks load the 3-rank
checkpoint (3->2). Rank code: tests/multirank/main_params_cases.py, main_params_api_cases.py.
The 2-rank launch is one test and the two resharding launches another, so that step 60's LEAN list
(.ci/steps/60-older-torch.sh) can run the cases without the resharding, which FULL torches run.
"""
import pytest

from tests.distributed import run_ranks
from tests.torch_versions import needs_fsdp2_on_cpu


def _check_api(api, world):
    assert api["tails"] > 0                      # the fp32 tails exist, so restoring them is visible
    assert api["rebuilt_mismatches"] > 0         # re-deriving the mains from bf16 would be caught
    assert api["plain_states_checked"] > 0
    assert "optimizer.state." in api["default_planner_error"], api["default_planner_error"]


@pytest.fixture(scope="module")
def saved_at_two_ranks(tmp_path_factory):
    """The 2-rank launch: its results and the folder of the checkpoints it saved."""
    root = str(tmp_path_factory.mktemp("main_params_acceptance"))
    return root, run_ranks("tests.multirank.main_params_api_cases:two_ranks", world_size=2,
                           args={"root": root}, timeout=600)


@needs_fsdp2_on_cpu
def test_acceptance_cases_and_torch_state_dict_api_on_two_ranks(saved_at_two_ranks):
    _, two = saved_at_two_ranks
    for result in two:
        acceptance = result["acceptance"]
        assert acceptance["dtype_layout"] is True
        assert acceptance["case1"]["main_update"] < 0.12
        assert acceptance["case2"]["tail_elements"] > 0
        assert acceptance["case2"]["lost_by_round_trip"] >= acceptance["case2"]["tail_elements"]
        assert "proj2.weight" in acceptance["case4"]["partial_error"]
        assert len(acceptance["case5"]) == 2
        _check_api(result["api"], 2)


@needs_fsdp2_on_cpu
def test_checkpoints_reshard_two_to_three_and_back(saved_at_two_ranks):
    root, _ = saved_at_two_ranks
    three = run_ranks("tests.multirank.main_params_api_cases:three_ranks", world_size=3,
                      args={"root": root}, timeout=600)
    # 7 rows over 3 ranks: 3/3/1 -- the 2-rank shards (4/3) were really resharded
    assert [r["case2_resharded_rows"] for r in three] == [3, 3, 1]
    assert [r["api"]["resharded"] for r in three] == [3, 3, 1]
    for result in three:
        _check_api(result["api"], 3)
    back = run_ranks("tests.multirank.main_params_api_cases:back_to_two", world_size=2,
                     args={"root": root}, timeout=300)
    assert [r["api3_resharded_rows"] for r in back] == [4, 3]
