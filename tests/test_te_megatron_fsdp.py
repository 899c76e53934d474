"""Megatron-FSDP's real call shapes (Megatron-Core core_v0.18.0) through TE's real FusedAdam.

One gloo launch per TE release and world size runs every layout ([Shard(0), tp], HSDP
[Shard(0), Shard(0), tp] and [Replicate(), Shard(0), tp], tp = Replicate()/Shard(0)/Shard(1)) x every
config (fp32; bf16 grads + fp16 moments; bf16 params + bf16 moments; grads in .grad), first on TE's
own code (every patch reverted: the negative controls), then with the patches the matrix applies plus
``te_initialize_state_compat`` (enabled as Megatron-Core's presence would). The rank side and the
upstream file:line it reproduces: tests/multirank/megatron_fsdp_cases.py.

2 ranks here; 4 ranks in .ci/steps/30-real-te.sh (NPU_FSDP_PATCHES_MEGATRON_FSDP_WORLDS=4).
"""
import os

import pytest

from tests.distributed import run_ranks
from tests.multirank import megatron_fsdp_cases as cases
from tests.support import assert_check
from tests.te_real import require_te_site

VERSIONS = ("2.11.0", "2.14.0")
WORLDS = [int(w) for w in os.environ.get("NPU_FSDP_PATCHES_MEGATRON_FSDP_WORLDS", "2").split(",")]
APPLIED = {"2.11.0": {"te_fused_adam_dtensor", "te_multi_tensor_apply_empty_tail", "te_initialize_state_compat",
                      "te_fused_adam_empty_scale", "te_fused_adam_empty_group_step"},
           "2.14.0": {"te_multi_tensor_apply_empty_tail", "te_fused_adam_empty_scale",
                      "te_initialize_state_compat", "te_fused_adam_empty_group_step"}}
_ENV = {"TORCH_DEVICE_BACKEND_AUTOLOAD": os.environ.get("TORCH_DEVICE_BACKEND_AUTOLOAD", "1"),
        "NPU_FSDP_PATCHES_ENABLE": "te_initialize_state_compat"}
_PARAMS = [(v, w) for v in VERSIONS for w in WORLDS]


@pytest.fixture(scope="module", params=_PARAMS, ids=[f"te{v}-{w}ranks" for v, w in _PARAMS])
def launch(request):
    version, world = request.param
    site = require_te_site(version)
    results = run_ranks("tests.multirank.megatron_fsdp_cases:case", world, timeout=900,
                        env={**_ENV, "PYTHONPATH": str(site)})
    return version, world, results


@pytest.mark.parametrize("check", cases.CHECKS)
def test_patched_on_megatron_fsdp_shapes(launch, check):
    assert_check(launch[2], check, cases.CHECKS)


def test_patches_applied_and_shards_uneven_and_empty(launch):
    version, world, results = launch
    for rank, r in enumerate(results):
        applied = {n for n, s in r["status"].items() if s == "applied" and n.startswith("te_")}
        assert applied == APPLIED[version], (rank, r["status"])
    sizes = [e - s for r in results for rows in r["rows"].values() for s, e in rows.values()]
    assert 0 in sizes and len(set(sizes)) > 3, sizes


def _runs(results, tag, config):
    return [(rank, lk, r[tag][(lk, c)]) for rank, r in enumerate(results) for (lk, c) in r[tag] if c == config]


def test_te_own_code_shows_the_known_failure(launch):
    """The negative controls: what each release's own code does with Megatron-FSDP's shapes."""
    version, world, results = launch
    if version == "2.11.0":  # global-shape states: resume does not continue the run
        for config in ("fp32", "grad_fp32", "bf16param_bf16m"):
            lost = [o["resume"]["mismatch"] for _, _, o in _runs(results, "unpatched", config) if not o["error"]]
            assert lost and all(lost), (config, lost)
    else:  # _apply_scale's aminmax on an empty shard, reached by load_state_dict after the dummy step
        errors = {o["error"] for _, _, o in _runs(results, "unpatched", "bf16grad_fp16m") if o["error"]}
        assert errors and all("cannot compute aminmax over an empty dimension" in e for e in errors), errors


def test_empty_shards_never_reach_te_kernel(launch):
    """TE's unlaunched-batch bug needs an empty tensor in a multi-tensor call; Megatron-FSDP hands None
    grads on empty shards (docs/te_fused_adam.md#23-megatron-fsdp-checkpoints), so its steps never give
    TE's kernel one:
    te_multi_tensor_apply_empty_tail is defensive for Megatron-FSDP (needed for torch FSDP2)."""
    version, world, results = launch
    seen = [o["kernel_smallest"] for tag in ("unpatched", "patched") for r in results
            for o in r[tag].values() if not o["error"] and o["kernel_smallest"] is not None]
    assert seen and min(seen) > 0, seen


def test_fp16_moments_do_not_round_trip_megatron_raw_state(launch):
    """Megatron's fsdp_dtensor state is the optimizer's raw ``state``
    (docs/te_fused_adam.md#23-megatron-fsdp-checkpoints):
    fp16 moments are saved scaled, without ``_scales``, and TE's load_state_dict reads them as unscaled.
    Upstream behaviour, the same with and without the patches; recorded so a change is noticed."""
    version, world, results = launch
    runs = [o for _, _, o in _runs(results, "patched", "bf16grad_fp16m")]
    assert all(o["error"] is None for o in runs)
    assert any(o["resume"]["mismatch"] for o in runs)
    print(f"TE {version} {world} ranks: fp16-moment resume max |diff| "
          f"{max(o['resume']['max_diff'] for o in runs):.3g}")


def test_flipped_master_weights_take_any_remainder_value():
    """TE's step calls initialize_state(p, store_param_remainders and bf16) after Megatron-Core set
    master_weights False on the built optimizer (docs/te_fused_adam.md#22-initialize_state-call-sites)."""
    import torch

    from npu_fsdp_patches.optim import FusedAdam
    p = torch.nn.Parameter(torch.randn(4).bfloat16())
    opt = FusedAdam([p], master_weights=True, store_param_remainders=True)
    opt.master_weights = False
    opt.initialize_state(p, True)
    assert set(opt.state[p]) == {"exp_avg", "exp_avg_sq"}


def test_grad_less_params_get_states_on_the_first_step():
    """As TE's step (initialize_state before the grad check): Megatron-FSDP's dummy step relies on it."""
    import torch

    from npu_fsdp_patches.optim import FusedAdam
    a, b = torch.nn.Parameter(torch.randn(3)), torch.nn.Parameter(torch.randn(2))
    before = b.detach().clone()
    a.grad = torch.randn(3)
    opt = FusedAdam([a, b], lr=0.1, weight_decay=0.1)
    opt.step()
    assert set(opt.state[b]) == {"exp_avg", "exp_avg_sq"} and not opt.state[b]["exp_avg"].any()
    assert torch.equal(b.detach(), before)
