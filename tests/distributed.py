"""Run a function on N gloo ranks, each in its own fresh interpreter, with a hard timeout.

Multi-rank tests call ``run_ranks("tests.multirank.some_module:case", world_size=2, args={...})``.
The target is imported inside every rank (the repo root is on ``sys.path``), called as
``case(rank, world_size, **args)`` after ``torch.distributed`` is initialised on gloo, and its
pickled return values come back as a list indexed by rank. Any rank failing, or the whole group
exceeding ``timeout`` seconds, fails the calling test with every rank's stderr tail.
"""
from __future__ import annotations

import json
import os
import pickle
import socket
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Callable

REPO_ROOT = Path(__file__).resolve().parent.parent


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(target: str, world_size: int = 2, *, args: dict | None = None,
              timeout: float = 300.0, env: dict | None = None, backend: str = "gloo") -> list[Any]:
    """Launch ``world_size`` ranks running ``target`` ("pkg.module:function"); return their results.
    ``backend`` is the process group's (gloo unless a benchmark runs on an accelerator)."""
    with tempfile.TemporaryDirectory(prefix="npu_fsdp_ranks_") as tmp:
        port = _free_port()
        procs = []
        for rank in range(world_size):
            rank_env = dict(os.environ)
            rank_env.update(env or {})
            rank_env.update({
                "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world_size),
                "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                "OMP_NUM_THREADS": "1",
                # not NPU_FSDP_*: the plugin warns about a variable of that prefix it does not know
                "TESTS_RANK_TARGET": target,
                "TESTS_RANK_ARGS": json.dumps(args or {}),
                "TESTS_RANK_BACKEND": backend,
                "TESTS_RANK_RESULT": os.path.join(tmp, f"rank{rank}.pkl"),
                "PYTHONPATH": os.pathsep.join(
                    [str(REPO_ROOT)] + [p for p in [rank_env.get("PYTHONPATH")] if p]),
            })
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "tests._rank_main"], cwd=str(REPO_ROOT), env=rank_env,
                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
        outputs = []
        timed_out = False
        for proc in procs:
            try:
                out, err = proc.communicate(timeout=timeout)
            except subprocess.TimeoutExpired:
                timed_out = True
                for p in procs:
                    p.kill()
                out, err = proc.communicate()
            outputs.append((proc.returncode, out, err))
        failed = [(r, o) for r, o in enumerate(outputs) if o[0] != 0]
        if timed_out or failed:
            report = "\n".join(
                f"--- rank {r} rc={rc}\nstdout:\n{out[-3000:]}\nstderr:\n{err[-6000:]}"
                for r, (rc, out, err) in enumerate(outputs))
            reason = f"timed out after {timeout}s" if timed_out else "a rank failed"
            raise AssertionError(f"{target} on {world_size} ranks: {reason}\n{report}")
        results = []
        for rank in range(world_size):
            with open(os.path.join(tmp, f"rank{rank}.pkl"), "rb") as fh:
                results.append(pickle.load(fh))
        return results


def launch_once(launch: Callable[..., Any]) -> Callable[..., Any]:
    """``launch`` memoized per arguments, for a module fixture whose one launch serves many tests: each
    launch runs once, and a failed one (AssertionError) fails every test that uses it with its report."""
    done: dict = {}

    def get(*key):
        if key not in done:
            try:
                done[key] = launch(*key)
            except AssertionError as exc:
                done[key] = exc
        if isinstance(done[key], AssertionError):
            raise done[key]
        return done[key]
    return get
