"""The stand-down probes of te_fused_adam_empty_group_step and te_fused_adam_empty_scale test the fix itself,
not the version: each runs on a copy of a real TE release's site whose fused_adam.py is edited to carry (part
of) the fix, in a fresh interpreter (tests/te_real.py)."""
import json
import os
import shutil

from tests.support import run_python
from tests.te_real import require_te_site

_ENV = {"TORCH_DEVICE_BACKEND_AUTOLOAD": os.environ.get("TORCH_DEVICE_BACKEND_AUTOLOAD", "1")}
_STATUS = """
import json, torch, npu_fsdp_patches
from transformer_engine.pytorch.optimizers import FusedAdam
p = torch.nn.Parameter(torch.zeros(3)); p.grad = torch.zeros(3)
opt = FusedAdam([{"params": [p]}, {"params": []}], exp_avg_dtype=torch.uint8, exp_avg_sq_dtype=torch.uint8)
opt.step(); opt.step()
print(json.dumps({"status": {r["name"]: [r["state"], r["note"] or r["error"]] for r in npu_fsdp_patches.status()},
                  "counters": [g.get("step") for g in opt.param_groups],
                  "moment_finite": bool(torch.isfinite(opt.get_unscaled_state(p, "exp_avg")).all())}))
"""
_SKIP = "upstream has it (probe {})"


def _edited(tmp_path, version, *edits):
    """A copy of ``version``'s site whose fused_adam.py has each (old, new) replacement made (old must be there)."""
    site = tmp_path / version
    shutil.copytree(require_te_site(version), site)
    path = site / "transformer_engine/pytorch/optimizers/fused_adam.py"
    text = path.read_text()
    for old, new in edits:
        assert old in text, old
        text = text.replace(old, new)
    path.write_text(text)
    return site


def _status(site, env=None):
    out = run_python(_STATUS, paths=[site], env={**_ENV, **(env or {})}).stdout
    return json.loads(out.strip().splitlines()[-1])


_SKIP_EMPTY_GROUP = '            if len(group["params"]) == 0:\n                continue\n'
_ADVANCE_FIRST = ('            if len(group["params"]) == 0:\n'
                  '                group["step"] = group.get("step", 0) + 1\n                continue\n')


def test_counter_probe_stands_down_on_the_fix_and_only_on_it(tmp_path):
    # 2.20.2 has 734ce31e; forced on past its gate, the probe stands it down: the fix is seen, not a version
    got = _status(require_te_site("2.20.2"), {"NPU_FSDP_PATCHES_ENABLE": "te_fused_adam_empty_group_step"})
    assert got["status"]["te_fused_adam_empty_group_step"] == [
        "skipped", _SKIP.format("upstream_advances_empty_groups")], got
    assert got["counters"] == [2, 2]
    # 2.18.0 with the group's counter advanced before the skip (the fix, backported): stands down too
    fixed = _edited(tmp_path, "2.18.0", (_SKIP_EMPTY_GROUP, _ADVANCE_FIRST))
    got = _status(fixed)
    assert got["status"]["te_fused_adam_empty_group_step"][0] == "skipped" and got["counters"] == [2, 2], got
    # (2.18.0 as released applies it: tests/test_te_real.py)


_ZERO_FP8 = ("            scaled_state._quantizer.scale.copy_(1 / scale)\n",
             "            scale.copy_(torch.where(scale == 0, torch.ones_like(scale), scale))\n"
             "            scaled_state._quantizer.scale.copy_(1 / scale)\n")
_EMPTY = ("        min_val, max_val = torch.aminmax(unscaled_state)\n",
          "        if unscaled_state.numel() == 0:\n            return\n"
          "        min_val, max_val = torch.aminmax(unscaled_state)\n")


def test_scale_probe_stands_down_only_when_both_fixes_are_there(tmp_path):
    got = _status(_edited(tmp_path / "both", "2.20.2", _ZERO_FP8, _EMPTY))
    assert got["status"]["te_fused_adam_empty_scale"] == ["skipped", _SKIP.format("upstream_scales_empty")], got
    assert got["moment_finite"], got
    # only the FP8 fix upstream: the patch applies (empty states) and keeps the release's own FP8 branch
    got = _status(_edited(tmp_path / "fp8", "2.20.2", _ZERO_FP8))
    assert got["status"]["te_fused_adam_empty_scale"] == ["applied", None] and got["moment_finite"], got


def test_scale_patch_fails_rather_than_report_an_fp8_write_it_does_not_know(tmp_path):
    """An FP8 branch written some other way: the patch cannot fix its zero states, so it fails, saying why."""
    other = ("            scaled_state._quantizer.scale.copy_(1 / scale)\n",
             "            scaled_state._quantizer.scale.copy_(scale.reciprocal())\n")
    got = _status(_edited(tmp_path, "2.20.2", other))
    state, why = got["status"]["te_fused_adam_empty_scale"]
    assert state == "failed" and "FP8" in why and "not applied" in why, got
    assert not got["moment_finite"], got      # TE's own code, as reported


_EARLY = """
import json, torch, npu_fsdp_patches
from transformer_engine.pytorch.optimizers import FusedAdam
p = torch.nn.Parameter(torch.ones(2)); p.grad = torch.ones(2)
early = FusedAdam([{"params": [p]}, {"params": []}])   # built while the patch is off
early.step()
npu_fsdp_patches.apply("te_fused_adam_empty_group_step")
early.step(); early.step()
print(json.dumps([g.get("step") for g in early.param_groups]))
"""


def test_counter_patch_also_covers_an_optimizer_built_before_it_was_applied():
    """The plugin applied late: the FusedAdam built before gets the hooks too (its first step is lost)."""
    out = run_python(_EARLY, paths=[require_te_site("2.18.0")],
                     env={**_ENV, "NPU_FSDP_PATCHES_DISABLE": "te_fused_adam_empty_group_step"}).stdout
    assert json.loads(out.strip().splitlines()[-1]) == [3, 2], out
