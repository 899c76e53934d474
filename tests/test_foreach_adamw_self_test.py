"""npu_fsdp_patches.optim.self_test (issue 5 item 4): schema, pass on this device, and that it fails
with the first mismatching element when the step under test is off by issue #700's rounding."""
import json

import pytest
import torch

from npu_fsdp_patches.optim import self_test


def test_passes_on_cpu_with_documented_schema():
    report = self_test.run_self_test("cpu")
    json.dumps(report)  # JSON-ready
    assert report["schema_version"] == 1 and report["device"] == "cpu" and report["steps"] == 50
    assert set(report["dtypes"]) == {"bfloat16", "float32"}
    for entry in report["dtypes"].values():
        assert set(entry) == {"passed", "elements", "mismatches", "first_mismatch",
                              "single_tensor_mismatches", "fp32_then_round_mismatches"}
        assert entry["passed"] and entry["mismatches"] == 0 and entry["first_mismatch"] is None
    assert report["passed"]
    # issue #700's rejected fix (fp32 maths then .to(bf16)) drifts on the same data
    assert report["dtypes"]["bfloat16"]["fp32_then_round_mismatches"] > 0


def test_reports_failure_with_first_mismatch(monkeypatch):
    monkeypatch.setattr(self_test, "foreach_adamw_step", self_test._fp32_then_round_step)
    report = self_test.run_self_test("cpu")
    bf16 = report["dtypes"]["bfloat16"]
    assert not report["passed"] and not bf16["passed"] and bf16["mismatches"] > 0
    first = bf16["first_mismatch"]
    assert first["step"] == 1 and first["tensor"].split("[")[0] in {"param", "exp_avg", "exp_avg_sq"}
    assert first["expected_bits"] != first["got_bits"]
    assert first["expected"] != first["got"]


def test_default_device_without_accelerator():
    if torch.cuda.is_available():
        pytest.skip("an accelerator is present")
    assert self_test.default_device() == "cpu"
