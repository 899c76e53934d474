"""Every optim path is layout-safe: non-contiguous and differently strided local shards, grads and
states of an uneven Shard(1) DTensor on 2 gloo ranks (rank code: tests/multirank/layout_cases.py).
One launch runs every case; each is its own test below."""
import os

import pytest

from tests.distributed import run_ranks
from tests.multirank import layout_cases
from tests.support import assert_check

_ENV = {"TORCH_DEVICE_BACKEND_AUTOLOAD": os.environ.get("TORCH_DEVICE_BACKEND_AUTOLOAD", "1")}


@pytest.fixture(scope="module")
def results():
    return run_ranks("tests.multirank.layout_cases:all_paths", 2, timeout=300, env=_ENV)


@pytest.mark.parametrize("check", layout_cases.CHECKS)
def test_every_optim_path_on_every_local_layout(results, check):
    assert_check(results, check, layout_cases.CHECKS)


def test_natural_local_shards_are_uneven(results):
    # (4, 5) Shard(1) on 2 ranks: 3 and 2 columns
    assert [r["natural_local"][0] for r in results] == [[4, 3], [4, 2]]
