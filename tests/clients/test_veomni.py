"""veomni 0.1.12 as a real client of MainParamsOptimizer (issue 9 items 1-3, issue 19), 2 gloo ranks.

veomni's own ``build_optimizer`` (AdamW; Muon = ``MultiOptimizer`` of ``DistributedMuon`` + AdamW)
on a bf16 ``fully_shard`` model (uneven embedding shards, an empty ``gain`` shard), wrapped by
``MainParamsOptimizer``, trains and resumes bit for bit through ``save_checkpoint``/``load_checkpoint``
and through veomni's own ``DistributedCheckpointer`` (torch's get/set_optimizer_state_dict, with
``extra_state``). One launch per optimizer type. Skips without veomni (see veomni_env.py).
Rank code: tests/multirank/veomni_cases.py.
"""
import pytest

from tests.clients.veomni_env import require_veomni
from tests.distributed import run_ranks


@pytest.mark.parametrize("optimizer_type, leaves", [("adamw", ["AdamW"]),
                                                     ("muon", ["AdamW", "DistributedMuon"])])
def test_veomni_optimizer_trains_and_resumes_exactly(tmp_path, optimizer_type, leaves):
    require_veomni()
    results = run_ranks("tests.multirank.veomni_cases:train_and_resume", world_size=2,
                        args={"optimizer_type": optimizer_type, "root": str(tmp_path)}, timeout=600)
    for rank, result in enumerate(results):
        assert result["leaves"] == leaves
        assert result["branch"] == "main_params"
        for route in ("ours", "veomni"):
            assert result[route]["mismatched"] == {}, (route, result[route]["mismatched"])
            assert result[route]["same_losses"], route
        assert result["extra_state"] == {"global_step": 2, "rank": rank}
        assert result["compared"] >= 15 and result["fp32_tail_elements"] > 0
        assert result["control_mismatches"] == 1          # the comparison sees one ulp
    assert [r["local_embed_rows"] for r in results] == [6, 5]
    assert [r["local_gain_numel"] for r in results] == [1, 0]
