"""The test harness itself: rank and single-process runners, named checks, the bit comparator."""
import pytest

from tests.distributed import run_ranks
from tests.support import Checks, assert_check, bit_mismatches, run_case

torch = pytest.importorskip("torch")


def test_ranks_return_results():
    assert run_ranks("tests.multirank.smoke_cases:all_reduce_sum", 2) == [3.0, 3.0]


def test_failing_rank_fails_the_test():
    with pytest.raises(AssertionError, match="boom on rank 1"):
        run_ranks("tests.multirank.smoke_cases:raise_on_rank_one", 2, timeout=120)


def test_run_case_calls_the_function_in_a_child_and_returns_its_result():
    assert run_case("tests.multirank.smoke_cases:echo_args", args={"a": [1, "x"]}) == {"args": {"a": [1, "x"]}}


def test_run_case_fails_when_the_child_fails():
    with pytest.raises(AssertionError, match="boom on rank 1"):
        run_case("tests.multirank.smoke_cases:raise_on_rank_one", args={"rank": 1, "world": 1})


def _checks() -> dict:
    checks = Checks()
    checks.run("holds", lambda: None)

    @checks("fails")
    def fails():
        raise AssertionError("wrong value")
    return {"checks": checks.results}


def test_a_held_check_passes():
    assert_check([_checks()], "holds", ("holds", "fails"))


def test_a_failed_check_fails_with_its_reason():
    with pytest.raises(AssertionError, match="rank 0: fails: AssertionError: wrong value"):
        assert_check([_checks()], "fails", ("holds", "fails"))


def test_a_declared_check_never_run_fails():
    with pytest.raises(AssertionError, match="check 'forgotten' was never run"):
        assert_check([_checks()], "forgotten", ("holds", "fails", "forgotten"))


def test_a_check_without_a_test_of_its_own_fails():
    with pytest.raises(AssertionError, match=r"checks without a test of their own: \['fails'\]"):
        assert_check([_checks()], "holds", ("holds",))


def test_a_check_name_recorded_twice_is_refused():
    checks = Checks()
    checks.run("x", lambda: None)
    with pytest.raises(ValueError, match="recorded twice"):
        checks.run("x", lambda: None)


@pytest.mark.parametrize("dtype, int_type", [(torch.bfloat16, torch.int16), (torch.float32, torch.int32),
                                             (torch.float64, torch.int64)])
def test_bit_comparator_catches_one_ulp_and_names_the_element(dtype, int_type):
    a = torch.linspace(-1, 1, 9).to(dtype)
    assert bit_mismatches(a, a.clone()) == (0, "")
    b = a.clone()
    b.view(int_type)[4] += 1      # one unit in the last place of element 4
    count, first = bit_mismatches(a, b)
    assert count == 1 and first.startswith("flat index 4:"), first


def test_bit_comparator_is_nan_safe_and_tells_signed_zeros_apart():
    nan = torch.tensor([float("nan"), 1.0])
    assert bit_mismatches(nan, nan.clone())[0] == 0
    assert bit_mismatches(torch.tensor([0.0]), torch.tensor([-0.0]))[0] == 1


def test_bit_comparator_counts_every_element_on_shape_or_dtype_difference():
    a = torch.zeros(3)
    assert bit_mismatches(a, torch.zeros(4))[0] == 4
    assert bit_mismatches(a, a.double())[0] == 3
