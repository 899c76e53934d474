"""hyper-parallel's own fp32 wrapper and DCP checkpointer resume the patched trainer's checkpoints, and
the patched trainer resumes theirs, bit for bit, next step included (issue 39;
docs/main_params.md#5-moving-a-run-to-upstreams-wrapper).

Ours: the config-lineage trainer stand-in tests/fixtures/hyper_parallel_new with ``hp_fp32_main_params``
applied through the plugin. Upstream: tests/fixtures/upstream_fp32_wrapper (its wrapper and its DCP
checkpointer's three load branches, written apart from our code). bf16 ``fully_shard``, Muon + AdamW
(AdamW alone on torch < 2.9: no ``torch.optim.Muon``). One 2-rank launch saves and cross-loads; one
3-rank launch loads the same checkpoints resharded, and two the ``checkpoint`` command converted offline
in between. The command's predictions for every checkpoint are compared with what each loader did.
Rank code: tests/multirank/upstream_resume_cases.py.
"""
import json
import subprocess
import sys

import pytest

from tests.distributed import launch_once, run_ranks
from tests.multirank import upstream_resume_cases as cases
from tests.support import assert_check, install_fixture
from tests.torch_versions import needs_fsdp2_on_cpu

pytestmark = needs_fsdp2_on_cpu   # the ranks train a fully_shard model


@launch_once
def _launch(tmp):
    from pathlib import Path
    site = install_fixture("hyper_parallel_new", Path(tmp) / "site")
    env = {"PYTHONPATH": str(site), "NPU_FSDP_PATCHES_ENABLE": "hp_fp32_main_params"}
    ckpt = str(Path(tmp) / "ckpt")
    two = run_ranks("tests.multirank.upstream_resume_cases:two_ranks", 2, args={"tmp": ckpt}, env=env,
                    timeout=420)
    for src, layout, out in (("ours", "torch", "ours_as_torch"), ("torch", "upstream", "torch_as_upstream")):
        command(f"{ckpt}/{src}", "--convert-to", layout, f"{ckpt}/{out}")
    three = run_ranks("tests.multirank.upstream_resume_cases:three_ranks", 3, args={"tmp": ckpt}, env=env,
                      timeout=420)
    return ckpt, two, three


def command(*argv):
    """``npu-fsdp-patches checkpoint ... --json``: the command as a user runs it."""
    proc = subprocess.run([sys.executable, "-m", "npu_fsdp_patches", "checkpoint", *argv, "--json"],
                          capture_output=True, text=True, timeout=120)
    report = json.loads(proc.stdout)
    assert report["exit_code"] == proc.returncode, (proc.returncode, report)
    return report


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    return _launch(str(tmp_path_factory.mktemp("upstream_resume")))


@pytest.mark.parametrize("check", cases.TWO_RANK_CHECKS)
def test_two_ranks(launched, check):
    assert_check(launched[1], check, cases.TWO_RANK_CHECKS)


@pytest.mark.parametrize("check", cases.THREE_RANK_CHECKS)
def test_resharded_to_three_ranks(launched, check):
    assert_check(launched[2], check, cases.THREE_RANK_CHECKS)


def _observed(outcome):
    """A loader's outcome as the command words it: exact, rebuilt or refused."""
    if outcome in (1, "main_params", "exact"):
        return "exact"
    if outcome in (2, "plain"):
        return "rebuilt"
    return "refused" if str(outcome).startswith("refused") else str(outcome)


@pytest.mark.parametrize("name", cases.CHECKPOINTS)
def test_the_command_predicts_what_each_loader_did(launched, name):
    """Every checkpoint of the launch, every consumer: the command's prediction is what the loader did
    (ours: the patched trainer's load_checkpoint; torch: dcp.load + set_state_dict; upstream: its DCP
    checkpointer's branch), and its exit code says whether our loader restores every main param."""
    ckpt, two, _ = launched
    report = command(f"{ckpt}/{name}")
    outcomes = two[0]["facts"]["outcomes"]
    observed = {consumer: _observed(outcomes[f"{name}:{consumer}"]) for consumer in ("ours", "upstream", "torch")
                if f"{name}:{consumer}" in outcomes}
    predicted = {consumer: report["consumers"][consumer]["outcome"] for consumer in observed}
    assert predicted == observed, (report["consumers"], outcomes)
    if name in ("ours", "upstream", "partial", "plain"):
        assert report["consumers"]["upstream"]["branch"] == {"ours": 1, "upstream": 1, "partial": 3, "plain": 2}[name]
    assert report["world_size"] == 2
    assert report["exit_code"] == (0 if name in ("ours", "upstream", "torch") else 1)
    if name == "partial":
        assert report["consumers"]["upstream"]["missing"] == sorted(cases.DROPPED)
