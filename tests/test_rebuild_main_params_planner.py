"""``RebuildMainParamsPlanner``: a plain AdamW run's DCP checkpoint resumes with fp32 masters
(docs/main_params.md#3-cross-loading, docs/integrations/torchtitan.md).

One launch on 2 gloo ranks with torch's own DCP and state-dict API, a bf16 ``fully_shard`` model with
uneven and empty shards (tests/multirank/rebuild_main_params_planner_cases.py): torch's default planner
refuses the plain checkpoint (``Missing key ... main_param``); the planner loads it with a warning, the
main params rebuilt from the loaded model and the moments and step the plain run's, and the next steps
equal the plain run switched to fp32 masters in memory, bit for bit. A wrapped run's checkpoint loads
exactly through it; a checkpoint holding some main params only is refused naming the others, and one
holding them in hyper-parallel's section is refused, both before anything is written; any other missing
key is still refused. The same planner through torchtitan's
``CheckpointManager``: tests/clients/test_torchtitan.py. The key rules alone, without ranks, below.
"""
import pytest

from npu_fsdp_patches.optim.rebuild_main_params_planner import main_param_fqn
from tests.distributed import run_ranks
from tests.multirank import rebuild_main_params_planner_cases as cases
from tests.support import assert_check


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return run_ranks("tests.multirank.rebuild_main_params_planner_cases:case", 2,
                     args={"root": str(tmp_path_factory.mktemp("planner"))}, timeout=300)


@pytest.mark.parametrize("check", cases.CHECKS)
def test_planner_on_two_ranks(results, check):
    assert_check(results, check, cases.CHECKS)


def test_the_launch_had_fp32_tails_to_lose(results):
    """A wrapped checkpoint whose main params equal the bf16 params would prove nothing."""
    assert all(r["fp32_tail_elements"] > 0 for r in results)
    assert results[0]["low_precision"] == ["embed.weight", "gain", "lm_head.weight", "proj1.bias",
                                           "proj1.weight", "proj2.weight"]


@pytest.mark.parametrize("path, fqn", [
    (("optimizer", "state", "layers.0.w", "main_param"), "layers.0.w"),      # torch's nested layout
    (("optimizer", "state.layers.0.w.main_param"), "layers.0.w"),           # torchtitan's flat layout
    (("optimizer", "state", "layers.0.w", "exp_avg"), None),
    (("optimizer", "param_groups.layers.0.w.main_param"), None),
    (("model", "main_param"), None),
    (("main_param",), None),
])
def test_which_keys_are_main_params(path, fqn):
    assert main_param_fqn(path) == fqn
