"""``npu-fsdp-patches checkpoint PATH``: its report, exit codes, ``--model-fqns``, and ``--convert-to``
writing a new checkpoint atomically that loads bit for bit, without touching the input or reading
more than a block at a time (issue 39; docs/cli.md#checkpoint). What the report predicts is checked
against the loaders in tests/test_checkpoint_layouts.py and tests/test_upstream_resume.py.
"""
import hashlib
import importlib.util
import json
import os
import pickle
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from npu_fsdp_patches.cli.commands import main
from npu_fsdp_patches.optim import load_checkpoint, save_checkpoint, upstream_state_dict
from tests.support import REPO_ROOT, bit_mismatches, run_python

LAYOUTS = REPO_ROOT / "tests" / "fixtures" / "checkpoint_layouts"
_spec = importlib.util.spec_from_file_location("layout_writer_cli", LAYOUTS / "writer.py")
W = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(W)


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*(process group|ProcessGroup|single process).*")
        yield


def run(capsys, *argv):
    """The command in this process: (exit code, its JSON report, stderr)."""
    code = main(["checkpoint", *map(str, argv), "--json"])
    out, err = capsys.readouterr()
    report = json.loads(out)
    assert report["exit_code"] == code and report["schema"] == "npu-fsdp-patches/checkpoint"
    return code, report, err


def tree_digest(path):
    """Every file under ``path`` with its bytes' hash (the input must stay as it was)."""
    path = Path(path)
    files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
    return {str(p.relative_to(path.parent)): hashlib.sha256(p.read_bytes()).hexdigest() for p in files}


def trained(tmp_path, layout="torch", drop=(), stateless=()):
    """A checkpoint of the fixture model (2 AdamW leaves, bf16 a and b, fp32 c), ``stateless`` params
    without grads (no optimizer state), written by today's save_checkpoint or by hand with the RFC
    section lacking ``drop``."""
    model, opt = W.main_params_run()
    for step in range(2):
        W.set_grads(model, W.grads(model, step))
        for name in stateless:
            getattr(model, name).grad = None
        opt.step()
        opt.zero_grad()
    path = tmp_path / f"{layout}{'-'.join(('', *drop))}"
    if drop:
        sd = upstream_state_dict(model, opt)
        section = sd["_mixed_precision_optimizer"]["fp32_from_fp16_params"]
        sd["_mixed_precision_optimizer"]["fp32_from_fp16_params"] = {k: v for k, v in section.items() if k not in drop}
        dcp.save({"model": model.state_dict(), "optimizer": sd}, checkpoint_id=str(path))
    else:
        save_checkpoint(str(path), model, opt, layout=layout)
    return path, model


# ---- the report and its exit codes --------------------------------------------------------------------

def test_a_complete_checkpoint_exits_0_and_says_where_its_main_params_are(capsys):
    code, report, _ = run(capsys, LAYOUTS / "upstream_dcp" / "dcp")
    assert code == 0 and report["layout"] == "upstream" and report["param_groups"] == "flattened"
    assert report["main_params"]["where"] == "optimizer._mixed_precision_optimizer.fp32_from_fp16_params.<fqn>"
    assert {p["fqn"]: (p["model_dtype"], p["fp32_main_param"]) for p in report["params"]} == {
        "a": ("torch.bfloat16", True), "b": ("torch.bfloat16", True), "c": ("torch.float32", False)}
    assert report["world_size"] == 1 and report["model"]["low_precision"] == ["a", "b"]


def test_the_text_report_names_layout_params_and_consumers(capsys):
    assert main(["checkpoint", str(LAYOUTS / "torch_main_param" / "dcp")]) == 0
    text = capsys.readouterr().out
    for needle in ("layout       torch, param groups nested", "main params  2 saved, at optimizer.state.<fqn>.main_param",
                   "load_checkpoint", "exact: every fp32 main param is restored as saved",
                   "rebuilt: branch 2", "complete"):
        assert needle in text, (needle, text)


def test_a_partial_section_exits_1_and_names_the_missing_params(tmp_path, capsys):
    path, _ = trained(tmp_path, "upstream", drop=("b",))
    code, report, _ = run(capsys, path)
    assert code == 1 and not report["complete"]
    assert report["consumers"]["ours"]["outcome"] == "refused" and report["consumers"]["ours"]["missing"] == ["b"]
    assert report["consumers"]["upstream"]["branch"] == 3 and report["consumers"]["upstream"]["missing"] == ["b"]


def test_no_main_params_for_bf16_params_exits_1(tmp_path, capsys):
    path, _ = trained(tmp_path, "upstream", drop=("a", "b"))
    code, report, _ = run(capsys, path)
    assert code == 1 and report["layout"] == "plain"
    assert report["consumers"]["ours"]["outcome"] == "rebuilt" and report["consumers"]["upstream"]["branch"] == 2


def test_model_fqns_file_checks_completeness_for_that_model(tmp_path, capsys):
    listing = tmp_path / "fqns.txt"
    listing.write_text("# the model's params\na\nb bf16\nc\n")
    assert run(capsys, LAYOUTS / "fqn_section" / "dcp", "--model-fqns", listing)[0] == 0
    listing.write_text("a\nb\nc\nd bf16   # a param the checkpoint lacks\n")
    code, report, _ = run(capsys, LAYOUTS / "fqn_section" / "dcp", "--model-fqns", listing)
    assert code == 1 and report["model"]["missing_in_checkpoint"] == ["d"]
    assert report["consumers"]["ours"]["outcome"] == "refused" and "d" in report["consumers"]["ours"]["why"]
    listing.write_text("a float8\n")
    code, report, _ = run(capsys, LAYOUTS / "fqn_section" / "dcp", "--model-fqns", listing)
    assert code == 2 and "unknown dtype 'float8'" in report["error"]


@pytest.mark.parametrize("make", ["missing", "empty folder", "text file", "metadata of another kind"])
def test_what_is_no_checkpoint_exits_2_with_one_line(tmp_path, capsys, make):
    path = tmp_path / "x"
    if make == "empty folder":
        path.mkdir()
    elif make == "text file":
        path.write_text("not a checkpoint\n")
    elif make == "metadata of another kind":
        path.mkdir()
        (path / ".metadata").write_bytes(pickle.dumps({"a": 1}))
    code, report, _ = run(capsys, path)
    assert code == 2 and report["error"] and "Traceback" not in report["error"]


def test_metadata_that_would_run_code_is_refused_unrun(tmp_path, capsys):
    """DCP's .metadata is a pickle: the command builds only DCP's metadata types (docs/security.md)."""
    marker = tmp_path / "ran"

    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))
    (tmp_path / "ck").mkdir()
    (tmp_path / "ck" / ".metadata").write_bytes(pickle.dumps(Evil()))
    code, report, _ = run(capsys, tmp_path / "ck")
    assert code == 2 and "refusing to build it" in report["error"] and "system" in report["error"]
    assert not marker.exists()


def test_the_cli_imports_no_torch_until_the_command_runs():
    proc = run_python("import sys, npu_fsdp_patches.cli.commands, npu_fsdp_patches.cli.checkpoint\n"
                      "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))")
    assert proc.stdout.strip().splitlines()[-1] == "[]"


# ---- --convert-to ------------------------------------------------------------------------------------

def _snapshot_equal(model, opt, expected):
    bad = []
    for name, p in model.named_parameters():
        if bit_mismatches(p, expected["model"][name])[0] or bit_mismatches(p.main_param, expected["main"][name])[0]:
            bad.append(name)
    return bad


@pytest.mark.parametrize("name", ["fqn_section", "torch_main_param", "upstream_dcp"])
@pytest.mark.parametrize("to", ["torch", "upstream"])
def test_converted_dcp_loads_bit_for_bit_and_the_input_is_untouched(tmp_path, capsys, name, to):
    src = LAYOUTS / name / "dcp"
    before = tree_digest(src)
    out = tmp_path / "out"
    code, report, err = run(capsys, src, "--convert-to", to, out)
    assert code == 0 and report["converted"]["layout"] == to, report
    assert "100% of" in err and f"wrote {out}" in err   # progress on stderr
    assert tree_digest(src) == before
    assert [p.name for p in tmp_path.iterdir()] == ["out"]   # no temporary folder left
    converted = run(capsys, out)[1]
    assert converted["layout"] == to and converted["complete"]
    model, opt = W.main_params_run(seed=5)
    assert load_checkpoint(str(out), model, opt) == "main_params"
    expected = torch.load(LAYOUTS / name / "expected.pt", weights_only=True)["saved"]
    assert not _snapshot_equal(model, opt, expected)
    if to == "torch":   # torch's own recipe reads it
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
        model, opt = W.main_params_run(seed=5)
        msd, osd = get_state_dict(model, opt)
        state = {"model": msd, "optimizer": osd}
        dcp.load(state, checkpoint_id=str(out))
        set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
        assert not _snapshot_equal(model, opt, expected)


def test_to_upstream_adds_the_main_param_of_a_param_without_optimizer_state(tmp_path, capsys):
    """Upstream's section names every bf16 param; torch's layout has no main_param where a param has no
    state: its main param is its model param cast to fp32, cast chunk by chunk."""
    path, model = trained(tmp_path, "torch", stateless=("b",))
    code, report, _ = run(capsys, path, "--convert-to", "upstream", tmp_path / "up")
    assert code == 0
    converted = run(capsys, tmp_path / "up")[1]
    assert sorted(converted["main_params"]["saved"]) == ["a", "b"]
    assert converted["consumers"]["upstream"]["branch"] == 1
    state = {"b": torch.empty(3)}
    dcp.load({"optimizer": {"_mixed_precision_optimizer": {"fp32_from_fp16_params": state}}},
             checkpoint_id=str(tmp_path / "up"))
    assert bit_mismatches(state["b"], model.b.float())[0] == 0


@pytest.mark.parametrize("where", ["exists", "link", "inside the input"])
def test_an_unusable_out_exits_2_and_writes_nothing(tmp_path, capsys, where):
    src = tmp_path / "src"
    import shutil
    shutil.copytree(LAYOUTS / "upstream_dcp" / "dcp", src)
    before = tree_digest(src)
    out = {"exists": tmp_path / "taken", "link": tmp_path / "link", "inside the input": src / "out"}[where]
    if where == "exists":
        out.mkdir()
    if where == "link":
        out.symlink_to(tmp_path / "elsewhere")
    listing = sorted(p.name for p in tmp_path.iterdir())
    code, report, _ = run(capsys, src, "--convert-to", "torch", out)
    assert code == 2 and report["error"], report
    assert sorted(p.name for p in tmp_path.iterdir()) == listing and tree_digest(src) == before
    assert not (tmp_path / "elsewhere").exists()


def test_a_partial_checkpoint_is_not_converted(tmp_path, capsys):
    path, _ = trained(tmp_path, "upstream", drop=("a",))
    code, report, _ = run(capsys, path, "--convert-to", "torch", tmp_path / "out")
    assert code == 2 and "not converted" in report["error"] and "a" in report["error"]
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("name, refused", [("fqn_section", None), ("rfc_section_state_dict", "#1"),
                                           ("upstream_flat_state_dict", "flattened")])
@pytest.mark.parametrize("to", ["torch", "upstream"])
def test_a_torch_save_file_converts_to_a_new_file(tmp_path, capsys, name, refused, to):
    """Both layouts key by FQN: a file keyed by position converts only where it names every param
    (the fp32 param #1 is in no RFC section), never by position."""
    src = LAYOUTS / name / "optimizer.pt"
    code, report, _ = run(capsys, src, "--convert-to", to, tmp_path / "o.pt")
    if refused:
        assert code == 2 and refused in report["error"] and not list(tmp_path.iterdir())
        return
    assert code == 0 and sorted(p.name for p in tmp_path.iterdir()) == ["o.pt"]
    converted = run(capsys, tmp_path / "o.pt")[1]
    assert converted["layout"] == ("torch" if to == "torch" else "upstream") and converted["state_keys"] == "fqn"
    expected = torch.load(LAYOUTS / name / "expected.pt", weights_only=True)["saved"]
    model, opt = W.main_params_run(seed=5)
    model.load_state_dict(expected["model"])
    opt.load_state_dict(torch.load(tmp_path / "o.pt", weights_only=True))
    assert not _snapshot_equal(model, opt, expected)


def test_a_checkpoint_larger_than_the_memory_it_uses_converts(tmp_path):
    """The rank files are copied a block at a time: the converting process grows by far less than the
    checkpoint's size (measured as its peak resident memory, in a fresh interpreter)."""
    code = f"""
        import resource, warnings, torch
        warnings.filterwarnings("ignore")
        from torch import nn
        from npu_fsdp_patches.optim import MainParamsOptimizer, save_checkpoint
        model = nn.Module()
        for i in range(4):
            setattr(model, f"w{{i}}", nn.Parameter(torch.rand(1 << 19).to(torch.bfloat16)))
        opt = MainParamsOptimizer(torch.optim.AdamW(model.parameters()), model)
        for p in model.parameters():
            p.grad = torch.rand_like(p)
        opt.step()
        save_checkpoint("{tmp_path / 'big'}", model, opt)
        del model, opt
    """
    run_python(code, timeout=300)
    size = sum(p.stat().st_size for p in (tmp_path / "big").iterdir())
    probe = f"""
        import gc, resource, sys
        from npu_fsdp_patches.optim import checkpoint_convert, checkpoint_report   # torch and the readers
        gc.collect()
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        from npu_fsdp_patches.cli.commands import main
        code = main(["checkpoint", "{tmp_path / 'big'}", "--convert-to", "upstream", "{tmp_path / 'out'}"])
        grown = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) * 1024
        print("GROWN", code, grown)
    """
    proc = run_python(probe, timeout=300)
    code_, grown = proc.stdout.split("GROWN")[-1].split()
    assert int(code_) == 0 and size > 20 << 20, size
    assert int(grown) < size // 4, f"grew {int(grown) >> 20} MiB converting {size >> 20} MiB"
    print(f"converting {size >> 20} MiB grew the process by {int(grown) >> 20} MiB")


def test_the_command_as_a_user_runs_it(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "npu_fsdp_patches", "checkpoint",
                           str(LAYOUTS / "fqn_section" / "dcp"), "--convert-to", "upstream", str(tmp_path / "o")],
                          capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr
    assert "layout       upstream, param groups nested" in proc.stdout and f"Wrote {tmp_path / 'o'}" in proc.stdout
