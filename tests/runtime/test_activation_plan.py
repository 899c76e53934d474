"""Activation's plan (npu_fsdp_patches/runtime/activation.py): made from the matrix, the providers and the
detections without arming anything, one decision per patch, read-only."""
import sys

import pytest

from npu_fsdp_patches.runtime.activation import Sources, check_sources, load_sources, make_plan
from npu_fsdp_patches.plan.decide import decide
from npu_fsdp_patches.errors import MatrixError
from npu_fsdp_patches.plan.settings import Settings


def test_the_plan_decides_every_patch_and_arms_nothing():
    settings = Settings(disable=frozenset({"hp_fp32_main_params"}))
    sources = load_sources(settings)
    check_sources(sources)
    finders = list(sys.meta_path)
    plan = make_plan(settings, sources)
    assert sys.meta_path == finders                     # no post-import or lookup hook
    assert [entry.name for entry in plan.entries] == list(sources.matrix.patches)
    for entry in plan.entries:
        assert entry.decision == decide(entry.spec, plan.frameworks, settings)
        assert entry.provider == sources.providers[entry.name] and entry.conflict is None
    disabled = next(entry for entry in plan.entries if entry.name == "hp_fp32_main_params")
    assert not disabled.decision.enabled and "NPU_FSDP_PATCHES_DISABLE" in disabled.decision.reason


def test_the_plan_is_read_only():
    settings = Settings()
    plan = make_plan(settings, load_sources(settings))
    with pytest.raises(AttributeError, match="read-only"):
        plan.matrix = None
    with pytest.raises(AttributeError, match="read-only"):
        plan.entries[0].decision = None
    with pytest.raises(TypeError):
        plan.frameworks["torch"] = None
    with pytest.raises(TypeError):
        plan.providers["x"] = None


def test_a_matrix_patch_without_code_is_a_matrix_error():
    sources = load_sources(Settings())
    check_sources(sources)
    name = next(iter(sources.matrix.patches))
    without = Sources(matrix=sources.matrix, conflicts=sources.conflicts,
                      providers={n: p for n, p in sources.providers.items() if n != name})
    with pytest.raises(MatrixError, match=f"unknown patch '{name}': no implementation is registered"):
        check_sources(without)
