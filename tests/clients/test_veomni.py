"""veomni 0.1.12 as a real client of MainParamsOptimizer (issue 9 items 1-3), 2 gloo ranks.

veomni's own ``build_optimizer`` (AdamW; Muon = ``MultiOptimizer`` of ``DistributedMuon`` + AdamW)
on a bf16 ``fully_shard`` model, wrapped by ``MainParamsOptimizer``, trains and resumes through
``save_checkpoint``/``load_checkpoint`` bit for bit; veomni's own ``DistributedCheckpointer`` refuses
the wrapper up front (patch ``veomni_dcp_refuse_main_params``) and is unchanged for a plain optimizer.
Skips without veomni (see veomni_env.py).
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


def test_veomni_distributed_checkpointer_refuses_main_params_up_front(tmp_path):
    """veomni's checkpointer hands the optimizer to torch's get/set_optimizer_state_dict, which map
    params to model FQNs by identity; fp32 main params are not model params. The patch refuses
    before save creates the directory and before load touches model, optimizer or extra_state;
    revert brings back veomni's original (KeyError after writing extra_state), apply the refusal."""
    require_veomni()
    results = run_ranks("tests.multirank.veomni_cases:refuses_main_params", world_size=2,
                        args={"root": str(tmp_path)}, timeout=600)
    for result in results:
        assert result["patch"] == ("applied", "veomni_dcp_refuse_main_params")
        for action in ("save", "load"):
            error = result[f"{action}_error"]
            assert error.startswith(f"TypeError: veomni DistributedCheckpointer.{action} cannot "
                                    f"checkpoint the optimizer npu_fsdp_patches.optim.main_params."
                                    f"MainParamsOptimizer: its fp32 main params are not model "
                                    f"parameters"), error
            assert "get_optimizer_state_dict" in error and "npu_fsdp_patches.optim.save_checkpoint" in error
        assert result["save_wrote"] is False
        assert result["load_changed"] == {} and result["load_compared"] >= 15
        assert result["load_touched_files"] is False and result["state_untouched"] is True
        # revert: veomni's own path again, which fails after writing (the negative control)
        assert result["reverted"] == ("reverted", None)
        assert any(result["reverted_error"] == f"KeyError: '{fqn}'" for fqn in result["fqns"])
        assert [f for f, _, _ in result["reverted_wrote"]] == [
            "extra_state", "extra_state/extra_state_rank_0.pt", "extra_state/extra_state_rank_1.pt"]
        assert result["reapplied"] == ("applied", "veomni_dcp_refuse_main_params")
        assert result["reapplied_error"].startswith("TypeError: veomni DistributedCheckpointer.save")


def test_veomni_distributed_checkpointer_plain_optimizer_untouched(tmp_path):
    """A plain veomni AdamW through the patched checkpointer: identical to veomni's original."""
    require_veomni()
    results = run_ranks("tests.multirank.veomni_cases:plain_optimizer_untouched", world_size=2,
                        args={"root": str(tmp_path)}, timeout=600)
    for result in results:
        assert result["patch"] == (("applied", "veomni_dcp_refuse_main_params"), ("reverted", None))
        assert result["vs_saved"] == {} and result["vs_original"] == {}, result
        assert result["compared"] >= 15 and result["keys"] >= 15
        assert result["same_keys"] and result["same_extra"] and result["same_groups"], result
        assert result["control"] == {"state.q_proj.weight.exp_avg": 1}   # the comparison sees 1 ulp
