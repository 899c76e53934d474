"""MainParamsOptimizer against the plain optimizer through torch's optimizer contract (issue 42).

Every case of tests/main_params_contract.py (the project's own versions of torch's ``TestOptimRenewed``
families, plus the Optimizer API torch code uses) runs plain and wrapped, for AdamW, Adam and Muon over
bf16, fp16 and fp32 model params, and the two outcomes must be equal, tensors bit for bit; the cases
marked ``ranks`` also run on 2 gloo ranks over ``fully_shard``. What differs by design is a row of
docs/main_params.md#contract-with-torch-code, each tested below (``test_documented_*``).
"""
import copy

import pytest
import torch
from torch import nn

from npu_fsdp_patches.optim import MainParamsOptimizer
from tests import main_params_contract as contract
from tests.distributed import run_ranks
from tests.main_params_model import make
from tests.support import bit_mismatches

CONFIGS = [(kind, dtype) for kind in contract.KINDS for dtype in contract.DTYPES]
#: FSDP2 (fully_shard) trains on CPU from torch 2.7 (docs/contributing.md#running-the-tests)
FSDP_ON_CPU = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2]) >= (2, 7)


@pytest.mark.parametrize("config", CONFIGS, ids=[f"{k}-{d}" for k, d in CONFIGS])
@pytest.mark.parametrize("name", list(contract.CASES))
def test_the_wrapper_matches_the_plain_optimizer(name, config):
    kind, dtype = config
    if not contract.available(kind):
        pytest.skip(f"torch.optim.{contract.KINDS[kind][0]} needs torch >= 2.9; this is torch {torch.__version__}")
    case = contract.CASES[name]
    plain = contract.outcome(case, contract.Run(kind, contract.DTYPES[dtype], wrapped=False))
    wrapped = contract.outcome(case, contract.Run(kind, contract.DTYPES[dtype], wrapped=True))
    diffs = contract.differences(plain, wrapped)
    assert not diffs, f"{name} ({case.torch_test}) differs plain vs wrapped:\n  " + "\n  ".join(diffs[:6])


def test_the_comparison_catches_one_ulp_and_a_changed_outcome():
    """Negative control of the comparison: one element one ulp off, and a raise against a success."""
    x = torch.randn(4, 3)
    y = x.clone()
    y.view(-1)[5] = torch.nextafter(y.view(-1)[5], torch.tensor(float("inf")))
    assert contract.differences(("ok", {"t": [x]}), ("ok", {"t": [y]}))
    assert contract.differences(("ok", {"t": [x]}), ("raises", "KeyError"))
    assert not contract.differences(("ok", {"t": [x]}), ("ok", {"t": [x.clone()]}))


RANK_CASES = [name for name, case in contract.CASES.items() if case.ranks]


@pytest.fixture(scope="module")
def two_ranks():
    if not FSDP_ON_CPU:
        pytest.skip(f"fully_shard trains on CPU from torch 2.7; this is torch {torch.__version__}")
    configs = [c for c in CONFIGS if contract.available(c[0])]
    return run_ranks("tests.multirank.main_params_contract_cases:case", 2, args={"configs": configs},
                     timeout=900)


@pytest.mark.parametrize("config", CONFIGS, ids=[f"{k}-{d}" for k, d in CONFIGS])
@pytest.mark.parametrize("name", RANK_CASES)
def test_the_wrapper_matches_the_plain_optimizer_on_two_ranks(two_ranks, name, config):
    if not contract.available(config[0]):
        pytest.skip(f"torch.optim.{contract.KINDS[config[0]][0]} needs torch >= 2.9")
    for rank, result in enumerate(two_ranks):
        diffs = result[f"{name}|{config[0]}|{config[1]}"]
        assert not diffs, f"rank {rank}: {name} differs plain vs wrapped over fully_shard:\n  " + "\n  ".join(diffs)
