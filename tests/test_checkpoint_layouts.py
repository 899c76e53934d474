"""Every checkpoint layout the project has released still loads, bit for bit, next step included, and
the ``checkpoint`` command says what each loader does with it (issue 39;
docs/main_params.md#9-every-released-layout-still-loads).

The fixtures in tests/fixtures/checkpoint_layouts were written by the commits that produced each
layout (MANIFEST.json; ``regenerate.py`` writes them again from git history): the earlier FQN layout,
torch's per-param ``main_param``, the RFC section in ``state_dict()``, ``upstream_state_dict()``,
``save_checkpoint(layout="upstream")``, and ``FusedAdam``'s state with fp32 master weights and fp16
moments, and with bf16 remainders; as DCP folders and ``torch.save`` files. Each is loaded by today's
code into a model with other values; its ``expected.pt`` holds what was saved, the grads of one more
step and the result of that step, all compared bitwise. One process, plain tensors (DCP with no
process group).
"""
import importlib.util
import logging
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from npu_fsdp_patches.optim import load_checkpoint
from npu_fsdp_patches.optim.checkpoint_report import inspect_checkpoint
from tests.support import bit_mismatches

HERE = Path(__file__).resolve().parent / "fixtures"
LAYOUTS = HERE / "checkpoint_layouts"


def _by_path(path, name):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


W = _by_path(LAYOUTS / "writer.py", "checkpoint_layout_writer")
UP = _by_path(HERE / "upstream_fp32_wrapper" / "mixed_precision_optimizer.py", "upstream_mpo_layouts")
CKPT = _by_path(HERE / "upstream_fp32_wrapper" / "dcp_checkpointer.py", "upstream_dcp_layouts")
MAIN = ["fqn_section", "torch_main_param", "rfc_section_state_dict", "upstream_flat_state_dict", "upstream_dcp"]
FUSED = {"fused_adam_master_fp16": {"master_weights": True, "exp_avg_dtype": torch.float16,
                                    "exp_avg_sq_dtype": torch.float16},
         "fused_adam_remainders": {"master_weights": True, "store_param_remainders": True}}
CASES = [(name, fmt) for name in [*MAIN, *FUSED] for fmt in ("dcp", "optimizer.pt")
         if (LAYOUTS / name / fmt).exists()]


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*(process group|ProcessGroup|single process).*")
        yield


def expected(name):
    return torch.load(LAYOUTS / name / "expected.pt", weights_only=True)


def differences(a, b, where=""):
    """Paths of tensors (in nested dicts) whose bits differ, or whose keys differ."""
    if isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), (where, sorted(a), sorted(b) if isinstance(b, dict) else b)
        return [d for k in a for d in differences(a[k], b[k], f"{where}.{k}")]
    if isinstance(a, torch.Tensor):
        return [where] if bit_mismatches(a, b)[0] else []
    return [] if a == b else [where]


def load_ours(name, fmt):
    """Today's wrapper over a model with other values, loaded from the fixture: (model, optimizer,
    outcome) where outcome is load_checkpoint's branch, or load_state_dict's ("main_params"/"plain")."""
    model, opt = W.main_params_run(seed=5)
    path = LAYOUTS / name / fmt
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if fmt == "dcp":
            outcome = load_checkpoint(str(path), model, opt)
        else:
            model.load_state_dict(expected(name)["saved"]["model"])
            opt.load_state_dict(torch.load(path, weights_only=True))
            outcome = "plain" if [w for w in caught if "fp32 tails" in str(w.message)] else "main_params"
    return model, opt, outcome


def load_fused(name, fmt):
    model, opt = W.fused_run(seed=5, **FUSED[name])
    path = LAYOUTS / name / fmt
    if fmt == "dcp":   # as examples/fsdp2_fused_adam.py resumes
        for p in model.parameters():
            if p in {q for g in opt.param_groups for q in g["params"]}:
                opt.initialize_state(p)
        state = {"model": model.state_dict(), "optim": opt.state_dict()}
        dcp.load(state, checkpoint_id=str(path))
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optim"])
    else:
        model.load_state_dict(expected(name)["saved"]["model"])
        opt.load_state_dict(torch.load(path, weights_only=True))
    return model, opt


@pytest.mark.parametrize("name, fmt", CASES, ids=[f"{n}-{f}" for n, f in CASES])
def test_each_released_layout_loads_bit_for_bit_next_step_included(name, fmt):
    model, opt = (load_fused(name, fmt) if name in FUSED else load_ours(name, fmt)[:2])
    want = expected(name)
    bad = differences(want["saved"], W.snapshot(model, opt))
    assert not bad, f"loaded state differs: {bad}"
    W.set_grads(model, want["grads"])
    opt.step()
    bad = differences(want["next"], W.snapshot(model, opt))
    assert not bad, f"the next step differs: {bad}"


def test_the_comparison_sees_one_ulp():
    """Negative control of the bitwise comparison above."""
    model, opt, _ = load_ours("upstream_dcp", "dcp")
    snap = W.snapshot(model, opt)
    main = snap["main"]["a"]
    main.view(-1)[0] = torch.nextafter(main.view(-1)[0], torch.tensor(float("inf")))
    assert differences(expected("upstream_dcp")["saved"], snap) == [".main.a"]


# ---- what each consumer does, against what the checkpoint command says -------------------------------

def _upstream_run(leaves):
    """Upstream's wrapper over the fixture model: one AdamW with both groups, or the two AdamW leaves."""
    model = W.Tiny(5)
    groups = [{"params": [model.a, model.c], "weight_decay": 0.01}, {"params": [model.b], "weight_decay": 0.0}]
    if leaves == 1:
        optimizers = {"adamw": torch.optim.AdamW(groups, lr=1e-2, foreach=False)}
    else:
        optimizers = {"decay": torch.optim.AdamW(groups[:1], lr=1e-2, foreach=False),
                      "no_decay": torch.optim.AdamW(groups[1:], lr=1e-2, foreach=False)}
    chain = UP.ChainedOptimizer(model, optimizers, flatten=leaves > 1)
    return model, UP.Float16OptimizerWithFloat16Params(chain, model)


def upstream_outcome(name, fmt, leaves):
    """What upstream's wrapper (and, for DCP, its checkpointer) did: exact, rebuilt or refused."""
    model, opt = _upstream_run(leaves)
    path = LAYOUTS / name / fmt
    fell_back = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: fell_back.append(record.getMessage())
    logging.getLogger(UP.logger.name).addHandler(handler)
    try:
        if fmt == "dcp":
            branch = CKPT.DistributedCheckpointer().load(str(path), model, opt)
        else:
            model.load_state_dict(expected(name)["saved"]["model"])
            opt.load_state_dict(torch.load(path, weights_only=True))
            branch = 2 if fell_back else 1
    except (RuntimeError, ValueError, KeyError):
        return "refused"
    finally:
        logging.getLogger(UP.logger.name).removeHandler(handler)
    if branch == 1:
        bad = [f for f, p in model.named_parameters() if p.dtype == torch.bfloat16 and bit_mismatches(
            p.main_param, expected(name)["saved"]["main"][f])[0]]
        assert not bad, f"branch 1 but main params differ: {bad}"
    return {1: "exact", 2: "rebuilt"}[branch]


def torch_api_outcome(name):
    """torch's own recipe into today's wrapper: dcp.load of get_state_dict's template, set_state_dict."""
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    model, opt = W.main_params_run(seed=5)
    msd, osd = get_state_dict(model, opt)
    state = {"model": msd, "optimizer": osd}
    try:
        dcp.load(state, checkpoint_id=str(LAYOUTS / name / "dcp"))
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException:   # noqa: BLE001 - DCP's CheckpointException is a BaseException
        return "refused"
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
    bad = differences(expected(name)["saved"], W.snapshot(model, opt))
    return "exact" if not bad else f"differs: {bad}"


MAIN_CASES = [(n, f) for n, f in CASES if n in MAIN]


@pytest.mark.parametrize("name, fmt", MAIN_CASES, ids=[f"{n}-{f}" for n, f in MAIN_CASES])
def test_the_command_says_what_each_loader_does(name, fmt):
    report = inspect_checkpoint(LAYOUTS / name / fmt)
    predicted = report["consumers"]
    observed = {"ours": {"main_params": "exact", "plain": "rebuilt"}[load_ours(name, fmt)[2]],
                "upstream": upstream_outcome(name, fmt, leaves=1)}
    if fmt == "dcp":
        observed["torch"] = torch_api_outcome(name)
    assert {k: predicted[k]["outcome"] for k in observed} == observed, predicted
    several = upstream_outcome(name, fmt, leaves=2)   # Muon + AdamW: a chain of several optimizers
    assert predicted["upstream"].get("several_optimizers", predicted["upstream"]["outcome"]) == several
    assert report["complete"] and report["world_size"] == (1 if fmt == "dcp" else None)
    # state keyed by position names its params only through the RFC section (or param_names)
    names = ["#0", "#2"] if (name, fmt) == ("torch_main_param", "optimizer.pt") else ["a", "b"]
    assert sorted(report["main_params"]["saved"]) == names


@pytest.mark.parametrize("name, fmt", [(n, f) for n, f in CASES if n in FUSED])
def test_the_command_names_fused_adam_state(name, fmt):
    report = inspect_checkpoint(LAYOUTS / name / fmt)
    assert report["layout"] == "fused_adam" and report["consumers"]["fused_adam"]["outcome"] == "exact"
    states = {p["fqn"]: p["optimizer_state"] for p in report["params"]}
    assert all("master_param" in names for names in states.values()), states
    dtypes = "torch.int16" if name == "fused_adam_remainders" else "torch.float32"
    assert dtypes in report["dtypes"]
