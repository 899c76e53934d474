"""What ordinary torch training code does with a MainParamsOptimizer over a ``fully_shard`` model, on 2 gloo
ranks with uneven and empty shards, next to an fp32-master reference (issue 42): writes to the model between
steps, a checkpoint reload in either order, ``zero_grad`` against a plain AdamW, and torch's GradScaler recipe
with an inf/NaN grad on rank 0 only. One launch; the rank side and each check's statement:
tests/multirank/main_params_torch_code_cases.py.
"""
import pytest

from tests.distributed import run_ranks
from tests.multirank.main_params_torch_code_cases import CHECKS
from tests.support import assert_check
from tests.torch_versions import needs_fsdp2_on_cpu

pytestmark = needs_fsdp2_on_cpu


@pytest.fixture(scope="module")
def results():
    return run_ranks("tests.multirank.main_params_torch_code_cases:case", 2, timeout=900)


@pytest.mark.parametrize("check", CHECKS)
def test_on_two_fully_shard_ranks(results, check):
    assert_check(results, check, CHECKS)
