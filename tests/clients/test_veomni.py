"""veomni 0.1.12 as a real client of MainParamsOptimizer (issue 9 items 1-3), 2 gloo ranks.

veomni's own ``build_optimizer`` (AdamW; Muon = ``MultiOptimizer`` of ``DistributedMuon`` + AdamW)
on a bf16 ``fully_shard`` model, wrapped by ``MainParamsOptimizer``, trains and resumes through
``save_checkpoint``/``load_checkpoint`` bit for bit. Skips without veomni (see veomni_env.py).
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
    for result in results:
        assert result["leaves"] == leaves
        assert result["branch"] == "main_params"
        assert result["mismatched"] == {}, result["mismatched"]
        assert result["losses"][0] == result["losses"][1]
        assert result["compared"] >= 15 and result["fp32_tail_elements"] > 0
        assert result["control_mismatches"] == 1          # the comparison sees one ulp
    assert [r["local_embed_rows"] for r in results] == [6, 5]
    assert [r["local_gain_numel"] for r in results] == [1, 0]


def test_veomni_distributed_checkpointer_cannot_map_main_params(tmp_path):
    """Pins the README's limit: veomni's checkpointer goes through torch's get_optimizer_state_dict,
    which maps optimizer params to model params by identity; fp32 main params are not model params."""
    require_veomni()
    results = run_ranks("tests.multirank.veomni_cases:distributed_checkpointer", world_size=2,
                        args={"root": str(tmp_path)}, timeout=600)
    for result in results:
        assert result["error"] is not None and result["error"].startswith("KeyError"), result["error"]
        assert any(result["error"] == f"KeyError: '{fqn}'" for fqn in result["fqns"]), result["error"]
