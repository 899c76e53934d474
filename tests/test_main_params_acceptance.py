"""RFC 001 acceptance cases 2.1-2.5 (docs/hyper_parallel.md#5-hyper-parallel-rfc-001) on 2 gloo ranks with
real torch FSDP2 + DCP (docs/design.md#43-hp_fp32_main_params, #5-test-rules).

One 2-rank launch runs the five cases (plus the FSDP2 dtype-cast checks); a 4-rank launch then
loads case 2's checkpoint at the other world size. Rank code: tests/multirank/main_params_cases.py.
"""
from tests.distributed import run_ranks
from tests.torch_versions import needs_fsdp2_on_cpu


@needs_fsdp2_on_cpu
def test_acceptance_cases_and_reshard(tmp_path):
    root = str(tmp_path)
    results = run_ranks("tests.multirank.main_params_cases:acceptance", world_size=2,
                        args={"root": root}, timeout=300)
    for result in results:
        assert result["dtype_layout"] is True
        case1 = result["case1"]
        assert case1["main_update"] < 0.12
        assert result["case2"]["tail_elements"] > 0
        assert result["case2"]["lost_by_round_trip"] >= result["case2"]["tail_elements"]
        assert "proj2.weight" in result["case4"]["partial_error"]
        assert len(result["case5"]) == 2
    resharded = run_ranks("tests.multirank.main_params_cases:reshard_load", world_size=4,
                          args={"root": root}, timeout=300)
    # 7 rows over 4 ranks: 2/2/2/1 -- the 2-rank shards (4/3) were really resharded
    assert [r["proj1_local_rows"] for r in resharded] == [2, 2, 2, 1]
