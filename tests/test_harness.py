import pytest

from tests.distributed import run_ranks

pytest.importorskip("torch")


def test_ranks_return_results():
    assert run_ranks("tests.multirank.smoke_cases:all_reduce_sum", 2) == [3.0, 3.0]


def test_failing_rank_fails_the_test():
    with pytest.raises(AssertionError, match="boom on rank 1"):
        run_ranks("tests.multirank.smoke_cases:raise_on_rank_one", 2, timeout=120)
