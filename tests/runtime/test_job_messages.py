"""One message per job (issue 28; docs/usage.md#messages, npu_fsdp_patches/runtime/job_log.py).

A real ``python -m torch.distributed.run --nproc_per_node=2`` job over the demo fixture: the agent,
2 ranks and 2 spawned DataLoader workers per rank all activate the plugin (7 processes). In the job's
combined output the configuration warning appears once, the summary once, the per-target INFO line
once. The smaller cases walk the marker's rules in fresh interpreters.
"""
import os
import subprocess
import sys

import pytest

from tests.core_demo import demo_env
from tests.support import REPO_ROOT, install_fixture, run_python

UNKNOWN = "name unknown patch(es) demo_shuot (did you mean demo_shout?)"
SUMMARY = "npu_fsdp_patches: 2 of 4 patches enabled"
APPLIED = "patch demo_shout applied at"


def _clean_env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("NPU_FSDP_PATCHES")}
    env.update(OMP_NUM_THREADS="1", PYTHONDONTWRITEBYTECODE="1", **extra)
    return env


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    site = install_fixture("core_demo", tmp_path_factory.mktemp("job"))
    env = _clean_env(PYTHONPATH=os.pathsep.join([str(site), str(REPO_ROOT)]), **demo_env(site),
                     NPU_FSDP_PATCHES_DISABLE="demo_shuot,demo_gated_off", NPU_FSDP_PATCHES_LOG="info")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           "--monitor-interval=0.5", str(REPO_ROOT / "tests" / "children" / "one_message_per_job.py")]
    proc = subprocess.run(cmd, env=env, cwd=str(REPO_ROOT), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-6000:]
    return proc.stdout


def test_every_process_of_the_job_ran_the_plugin(job):
    done = sorted(line for line in job.splitlines() if line.startswith("RANK_DONE"))
    assert done == [f"RANK_DONE rank={r} total=100 plugin_in_workers=1 workers=2 greet=hello x!" for r in (0, 1)], job


def test_a_configuration_warning_appears_once_per_job(job):
    assert sum(UNKNOWN in line for line in job.splitlines()) == 1, job


def test_the_summary_and_the_per_target_line_appear_once_per_job(job):
    lines = job.splitlines()
    assert sum(SUMMARY in line for line in lines) == 1, job
    assert [line for line in lines if SUMMARY in line][0].endswith("applied demo_shout, demo_child"), job
    assert sum(APPLIED in line for line in lines) == 1, job


PARENT = """
import os, subprocess, sys
import npu_fsdp_patches, demo_target
child = "import npu_fsdp_patches, demo_target"
for extra in ({{}}, {child_env}):
    sys.stderr.write("CHILD\\n"); sys.stderr.flush()
    subprocess.run([sys.executable, "-c", child], env={{**os.environ, **extra}}, check=True)
"""


def _parent(tmp_path, child_env: dict, **env) -> list:
    """stderr of a parent that activates and then starts two children: one with its environment, one
    with ``child_env`` added; split at each child's start."""
    site = install_fixture("core_demo", tmp_path)
    proc = run_python(PARENT.format(child_env=repr(child_env)), paths=[site],
                      env=demo_env(site, **{"NPU_FSDP_PATCHES_LOG": "info", **env}))
    return proc.stderr.split("CHILD\n")


def test_a_child_says_only_what_changed(tmp_path):
    parent, same, changed = _parent(tmp_path, {"NPU_FSDP_PATCHES_DISABLE": "demo_shuot,nope"},
                                    NPU_FSDP_PATCHES_DISABLE="demo_shuot")
    assert UNKNOWN in parent and SUMMARY in parent
    assert same.strip() == ""                               # the same configuration: nothing new
    assert "name unknown patch(es) demo_shuot (did you mean demo_shout?), nope" in changed
    assert SUMMARY not in changed and APPLIED not in changed


def test_a_copied_environment_of_a_finished_process_silences_nothing(tmp_path):
    """The marker names a dead writer (a finished job's environment copied into a new one)."""
    site = install_fixture("core_demo", tmp_path)
    code = "import npu_fsdp_patches, demo_target"
    first = run_python(code + "\nimport os; print(os.environ['NPU_FSDP_PATCHES_SAID'])", paths=[site],
                       env=demo_env(site, NPU_FSDP_PATCHES_DISABLE="demo_shuot"))
    marker = first.stdout.split()[-1]
    again = run_python(code, paths=[site], env=demo_env(site, NPU_FSDP_PATCHES_DISABLE="demo_shuot",
                                                        NPU_FSDP_PATCHES_SAID=marker, NPU_FSDP_PATCHES_LOG="info"))
    assert UNKNOWN in first.stderr and UNKNOWN in again.stderr and SUMMARY in again.stderr
    assert "is not a variable of npu_fsdp_patches" not in again.stderr   # the marker is ours


@pytest.mark.parametrize("writer", ["{pid}", "{pid}.1.0123456789ab", "1"])
def test_a_copied_environment_naming_a_live_ancestor_silences_nothing(tmp_path, writer):
    """Issue 42: a marker copied from another job whose writer's pid is now held by a live ancestor (PID 1 of
    every container; pids repeat): here this test process, a live ancestor of the child that did not write it,
    by bare pid and by a stamp of another start time, and PID 1. The child logs as a new job."""
    site = install_fixture("core_demo", tmp_path)
    code = "import npu_fsdp_patches, demo_target"
    first = run_python(code + "\nimport os; print(os.environ['NPU_FSDP_PATCHES_SAID'])", paths=[site],
                       env=demo_env(site, NPU_FSDP_PATCHES_DISABLE="demo_shuot"))
    digests = first.stdout.split()[-1].split(";")[2]
    marker = f"{writer.format(pid=os.getpid())};{writer.format(pid=os.getpid())};{digests}"
    again = run_python(code, paths=[site], env=demo_env(site, NPU_FSDP_PATCHES_DISABLE="demo_shuot",
                                                        NPU_FSDP_PATCHES_SAID=marker, NPU_FSDP_PATCHES_LOG="info"))
    assert UNKNOWN in again.stderr and SUMMARY in again.stderr, again.stderr


def test_a_stamp_names_this_process_by_pid_start_time_and_boot():
    from npu_fsdp_patches.runtime.job_log import stamp, trusted
    mine = stamp(os.getpid())
    assert trusted(mine) == os.getpid()
    if os.path.exists("/proc/self/stat"):
        pid, start, boot = mine.split(".")
        assert int(pid) == os.getpid() and start.isdigit() and len(boot) == 12
        assert trusted(f"{pid}.{int(start) + 1}.{boot}") == 0 and trusted(pid) == 0


def test_ranks_other_than_local_rank_0_do_not_repeat_configuration(tmp_path):
    """Ranks started without a common Python parent (srun, mpirun): local rank 0 of the node says it."""
    site = install_fixture("core_demo", tmp_path)
    said = {}
    for rank in ("0", "1"):
        said[rank] = run_python("import npu_fsdp_patches, demo_target", paths=[site], env=demo_env(
            site, NPU_FSDP_PATCHES_DISABLE="demo_shuot", NPU_FSDP_PATCHES_LOG="info", RANK=rank,
            LOCAL_RANK=rank)).stderr
    assert UNKNOWN in said["0"] and SUMMARY in said["0"] and APPLIED in said["0"]
    assert UNKNOWN not in said["1"] and SUMMARY not in said["1"] and APPLIED not in said["1"]


def test_a_line_the_parent_did_not_log_is_logged_by_a_child_that_logs_it(tmp_path):
    """The kill switch's INFO line is dropped at the default level: a child at NPU_FSDP_PATCHES_LOG=info says it."""
    parent, same, changed = _parent(tmp_path, {"NPU_FSDP_PATCHES_LOG": "info"}, NPU_FSDP_PATCHES="0",
                                    NPU_FSDP_PATCHES_LOG="warning")
    assert "kill switch set" not in parent + same
    assert "NPU_FSDP_PATCHES=0: kill switch set, nothing registered or applied" in changed


@pytest.mark.parametrize("argv, orig_argv, expected", [
    (["/venv/bin/torchrun", "train.py"], ["/venv/bin/python", "/venv/bin/torchrun", "train.py"], True),
    (["-m"], ["python", "-m", "torch.distributed.run", "train.py"], True),
    (["-m"], ["python", "-u", "-mtorch.distributed.launch", "train.py"], True),
    (["train.py"], ["python", "train.py"], False),
    (["-m"], ["python", "-m", "torch.utils.collect_env"], False),
])
def test_a_launcher_is_recognised(argv, orig_argv, expected):
    from npu_fsdp_patches.runtime.job_log import is_launcher
    assert is_launcher(argv, orig_argv) is expected
