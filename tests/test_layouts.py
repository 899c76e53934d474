"""Every optim path is layout-safe: non-contiguous and differently strided local shards, grads and
states of an uneven Shard(1) DTensor on 2 gloo ranks (rank code: tests/multirank/layout_cases.py)."""
import os

from tests.distributed import run_ranks

_ENV = {"TORCH_DEVICE_BACKEND_AUTOLOAD": os.environ.get("TORCH_DEVICE_BACKEND_AUTOLOAD", "1")}


def test_every_optim_path_on_every_local_layout():
    results = run_ranks("tests.multirank.layout_cases:all_paths", 2, timeout=300, env=_ENV)
    for rank, result in enumerate(results):
        assert result["failures"] == [], f"rank {rank}:\n" + "\n".join(result["failures"])
    # (4, 5) Shard(1) on 2 ranks: 3 and 2 columns
    assert [r["natural_local"][0] for r in results] == [[4, 3], [4, 2]]
