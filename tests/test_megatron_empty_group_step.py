"""te_fused_adam_empty_group_step with megatron-core 0.16.1's own param groups, distributed-optimizer shard
ranges and optimizer factory, on TE 2.13.0's real fused_adam.py (the README's stack), 2 gloo ranks.

What of Megatron runs on CPU, and what stands in for the CUDA-only rest:
tests/multirank/megatron_empty_group_cases.py. The same check runs on megatron-core 0.19.2 in
tests/clients/test_megatron_py312.py (.ci/steps/50-megatron-py312.sh).
"""
import os

import pytest

from tests.distributed import run_ranks
from tests.multirank import te_step_counter_cases as cases
from tests.te_real import require_te_site

pytest.importorskip("megatron.core.package_info")
TE_VERSION = "2.13.0"


def run_megatron_resume(site, tmp_path) -> list:
    env = {"TORCH_DEVICE_BACKEND_AUTOLOAD": os.environ.get("TORCH_DEVICE_BACKEND_AUTOLOAD", "1"),
           "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": str(site)}
    return run_ranks("tests.multirank.megatron_empty_group_cases:megatron_resume", 2,
                     args={"te_site": str(site), "ckpt": str(tmp_path)}, env=env, timeout=600)


def assert_megatron_resume(results, megatron_prefix: str) -> None:
    """Megatron's own groups and shard ranges are the case's; TE's own code loses the empty group's
    counter (the negative control); patched, every resumed rank counts right and matches a one-rank run."""
    for r in results:
        assert r["megatron"].startswith(megatron_prefix), r["megatron"]
        assert r["status"]["te_fused_adam_empty_group_step"] == "applied", r["status"]
        assert r["groups"] == [[w, list(names)] for w, names in cases.GROUPS], r["groups"]
        assert {int(w): v for w, v in r["layout"].items()} == {
            w: [[[list(s) for s in g] for g in ranks] for ranks in v] for w, v in cases.LAYOUT.items()}
        stop = r["factory_stop"]   # 0.16: DistributedOptimizer's CUDA tensor; 0.19: skip_megatron_wrapping
        assert stop is None or "cuda" in stop.lower() or "nvidia" in stop.lower(), stop
    own = {k: v for r in results for k, v in r["unpatched"]["resumed"].items()}
    assert own["2:1"]["after_load"] == [3, None] and not own["1:from1"]["matches_reference"], own
    got = {k: v for r in results for k, v in r["patched"]["resumed"].items()}
    for key, r in got.items():
        assert r["after_load"] == [3, 3] and r["after_step"] == [4, 4] and r["matches_reference"], (key, r)


def test_megatron_distributed_optimizer_groups_resume_with_the_patch(tmp_path):
    site = require_te_site(TE_VERSION)
    assert_megatron_resume(run_megatron_resume(site, tmp_path), "0.16.")
