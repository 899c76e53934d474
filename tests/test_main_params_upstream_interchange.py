"""Checkpoints interchange with hyper-parallel's own fp32 main-param wrapper, both ways (issue 30).

2 gloo ranks, bf16 ``fully_shard`` models; the upstream wrapper is the stand-in
tests/fixtures/upstream_fp32_wrapper (written apart from our code, citing upstream file:line). Rank
code: tests/multirank/upstream_interchange_cases.py. One launch serves every test.
"""
import pytest

from tests.distributed import launch_once, run_ranks
from tests.torch_versions import needs_fsdp2_on_cpu

pytestmark = needs_fsdp2_on_cpu   # the ranks train fully_shard models


@launch_once
def _two_ranks(tmp):
    return run_ranks("tests.multirank.upstream_interchange_cases:two_ranks", world_size=2,
                     args={"tmp": tmp}, timeout=240)


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return _two_ranks(str(tmp_path_factory.mktemp("interchange")))


def test_rfc_section_on_state_dict_covers_the_bf16_params_once(results):
    """RFC 001 2.2 (docs/hyper_parallel.md#5-hyper-parallel-rfc-001): the section = every bf16 param, fp32,
    the main params themselves; 2.3: empty for fp32;
    torch's API and torch.save store each main param once; a partial section is refused."""
    for rank in results:
        rfc = rank["rfc"]
        assert isinstance(rfc, dict), rfc
        assert rfc["size_with"] - rfc["size_without"] < rfc["main_bytes"] / 2, rfc


def test_ours_loads_into_upstream_bit_for_bit(results):
    assert [r["ours_to_upstream"] for r in results] == ["ok", "ok"]


def test_upstream_loads_into_ours_bit_for_bit(results):
    assert [r["upstream_to_ours"] for r in results] == ["ok", "ok"]


def test_upstream_muon_adamw_flattened_state_loads_into_ours(results):
    """Upstream's ChainedOptimizer flattens a multi-optimizer state (state.<fqn>.<key>)."""
    outcome = [r["upstream_chain_to_ours"] for r in results]
    if all(o.startswith("skipped") for o in outcome):
        pytest.skip(outcome[0])
    assert outcome == ["ok", "ok"]


def test_ours_muon_adamw_loads_into_upstreams_through_the_documented_recipe(results):
    """Upstream's multi-leaf wrapper cannot take our index-keyed state (docs/main_params.md §2.1);
    torch's flattened FQN layout with the main params moved into the section loads bit for bit."""
    outcome = [r["ours_chain_to_upstream_chain"] for r in results]
    if all(o.startswith("skipped") for o in outcome):
        pytest.skip(outcome[0])
    assert outcome == ["ok", "ok"]
