"""The single-process self-test (``adamw_step``, also ``doctor --self-test``; selftest/checks/adamw_step.py):
schema, pass on this device, and that the engine's negative control makes it fail naming the first
element one ulp off (planted through the engine's comparer, no product function swapped)."""
import json

import pytest
import torch

from npu_fsdp_patches.selftest.checks import adamw_step
from npu_fsdp_patches.selftest.options import detect_device


def test_passes_on_cpu_with_documented_schema():
    report = adamw_step.run_self_test("cpu", plant=False)
    json.dumps(report)  # JSON-ready
    assert report["schema_version"] == 1 and report["device"] == "cpu" and report["steps"] == 50
    assert set(report["dtypes"]) == {"bfloat16", "float32"}
    for entry in report["dtypes"].values():
        assert set(entry) == {"passed", "elements", "mismatches", "first_mismatch",
                              "single_tensor_mismatches", "fp32_then_round_mismatches"}
        assert entry["passed"] and entry["mismatches"] == 0 and entry["first_mismatch"] is None
    assert report["passed"]
    # the rejected fix (fp32 maths then .to(bf16), docs/hyper_parallel.md#18-issue-700) drifts on the same data
    assert report["dtypes"]["bfloat16"]["fp32_then_round_mismatches"] > 0


def test_the_engines_plant_fails_it_at_one_ulp(monkeypatch):
    monkeypatch.setenv("NPU_FSDP_PATCHES_SELF_TEST_PLANT", "adamw_step")
    report = adamw_step.run_self_test("cpu")
    bf16 = report["dtypes"]["bfloat16"]
    assert not report["passed"] and not bf16["passed"] and bf16["mismatches"] == 1
    assert report["dtypes"]["float32"]["passed"]
    first = bf16["first_mismatch"]
    assert (first["step"], first["tensor"], first["index"]) == (1, "param[0]", [0, 0])
    assert int(first["got_bits"], 16) - int(first["expected_bits"], 16) == 1
    assert first["expected"] != first["got"]


def test_default_device_without_accelerator():
    if torch.cuda.is_available():
        pytest.skip("an accelerator is present")
    assert adamw_step.run_self_test(plant=False)["device"] == detect_device(torch) == "cpu"
