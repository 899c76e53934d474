"""Plant each mutant of ``optim/`` the generated cases were checked against, and run the tests that must
catch it (issue 40; tests/README.md#generated-cases-hypothesis).

    .venv/bin/python -m tests.mutants                 # every mutant, its catching tests
    .venv/bin/python -m tests.mutants M3 F1           # some of them
    .venv/bin/python -m tests.mutants --list          # what each one plants
    .venv/bin/python -m tests.mutants --tests "tests/test_fused_adam.py" F1   # other tests

Each mutant is a realistic bug written as one text replacement in a product file. It is planted in a
copy of the repository's tracked files under a temporary folder (never in this checkout, never importable
from it); the tests run there with this interpreter (the copy comes first on ``sys.path``, the ranks get it
on ``PYTHONPATH``). A mutant whose original text is gone (the code changed) is reported as stale: update
it. Exit status 0 when every mutant run was caught (the tests failed), 1 otherwise.
"""
from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import NamedTuple

REPO = Path(__file__).resolve().parent.parent
GENERATED = "tests/test_generated_cases.py"
TWO_RANKS = f"{GENERATED}::test_generated_cases_on_two_ranks_with_dtensors"
MAIN_PARAMS = f"{GENERATED}::test_main_params_matches_an_fp32_master_reference"


class Mutant(NamedTuple):
    what: str
    path: str
    old: str
    new: str
    tests: tuple[str, ...]


_PIECE = "    return full[tuple(slice(start, start + size) for start, size in zip(offset, shape))].clone()\n"
_CKPT = "npu_fsdp_patches/optim/fused_adam_checkpoint.py"
_STATE = "npu_fsdp_patches/optim/_main_params_state.py"

MUTANTS = {
    # ---- FusedAdam: a full (unsharded) saved state cut into a DTensor param's piece
    "F1": Mutant("the full state is cut along dim 0 only (Shard(1) gets whole rows)", _CKPT, _PIECE,
                 "    return (full[offset[0]:offset[0] + shape[0]] if full.dim() else full).clone()\n",
                 (TWO_RANKS,)),
    "F2": Mutant("every param is taken for Shard(0) over all ranks (Replicate, Shard(1) and 2-D meshes "
                 "cut wrongly)", _CKPT, _PIECE,
                 "    import torch.distributed as dist\n"
                 "    per = -(-full.shape[0] // dist.get_world_size()) if full.dim() else 0\n"
                 "    rank = dist.get_rank()\n"
                 "    return (full[rank * per:(rank + 1) * per] if full.dim() else full).clone()\n",
                 (TWO_RANKS,)),
    "F3": Mutant("only the first mesh dim's placement is applied (a 2-D mesh's second dim ignored)",
                 _CKPT, _PIECE,
                 "    first = param.placements[0]\n"
                 "    if not first.is_shard():\n"
                 "        return full.clone()\n"
                 "    pieces = torch.tensor_split(full, param.device_mesh.size(0), dim=first.dim)\n"
                 "    return pieces[param.device_mesh.get_coordinate()[0]].clone()\n",
                 (TWO_RANKS,)),
    "F4": Mutant("uneven shards split floor-first (the last rank takes the rest; torch gives the first "
                 "ranks ceil)", _CKPT, _PIECE,
                 "    coord = param.device_mesh.get_coordinate()\n"
                 "    index = [slice(None)] * full.dim()\n"
                 "    for mesh_dim, pl in enumerate(param.placements):\n"
                 "        if pl.is_shard():\n"
                 "            n, c = param.device_mesh.size(mesh_dim), coord[mesh_dim]\n"
                 "            lo, hi = index[pl.dim].start or 0, index[pl.dim].stop\n"
                 "            hi = full.shape[pl.dim] if hi is None else hi\n"
                 "            size = (hi - lo) // n\n"
                 "            index[pl.dim] = slice(lo + c * size, hi if c == n - 1 else lo + (c + 1) * size)\n"
                 "    return full[tuple(index)].clone()\n",
                 (TWO_RANKS,)),
    # ---- MainParamsOptimizer: leaves whose params have no state yet
    "M1": Mutant("state_dict numbers a later leaf's params after the states of the leaves before it, "
                 "not after their params", _STATE, "        offset += len(mains)\n",
                 "        offset += len(native[\"state\"])\n", (MAIN_PARAMS,)),
    "M2": Mutant("state_dict pairs a leaf's states with its params by enumeration (a param without "
                 "state shifts the later ones)", _STATE,
                 "            param_state = native[\"state\"].get(index)\n",
                 "            param_state = dict(enumerate(native[\"state\"].values())).get(index)\n",
                 (MAIN_PARAMS,)),
    "M3": Mutant("load_state_dict renumbers the loaded states densely (a param without state shifts the "
                 "later ones)", _STATE, "                state[index] = param_state\n",
                 "                state[len(state)] = param_state\n", (MAIN_PARAMS,)),
    "M4": Mutant("load_state_dict hands every leaf the first leaf's saved groups", _STATE,
                 "        leaf_groups = saved_groups[start:start + len(leaf.param_groups)]\n"
                 "        leaf_group_keys = group_keys[start:start + len(leaf.param_groups)]\n",
                 "        leaf_groups = saved_groups[:len(leaf.param_groups)]\n"
                 "        leaf_group_keys = group_keys[:len(leaf.param_groups)]\n", (MAIN_PARAMS,)),
    "M5": Mutant("load_state_dict skips the params without saved state, shifting the later ones", _STATE,
                 "        for index, (key, main) in enumerate(zip(leaf_keys, mains)):\n",
                 "        for index, (key, main) in enumerate(zip([k for k in leaf_keys if k in saved_state],"
                 " mains)):\n", (MAIN_PARAMS,)),
    "M6": Mutant("the state view counts params, not states (torch's API never primes a fresh wrapper)",
                 "npu_fsdp_patches/optim/_leaf_views.py",
                 "        return sum(len(leaf.state) for leaf in self._leaves) + len(self._extras)\n",
                 "        return sum(len(g[\"params\"]) for leaf in self._leaves for g in leaf.param_groups)"
                 " + len(self._extras)\n",
                 (MAIN_PARAMS,)),
    "M8": Mutant("load_checkpoint expects a main param also of a param the checkpoint has no state for "
                 "(a bug issue 40's cases found, fixed in main_params_checkpoint.main_params_branch)",
                 "npu_fsdp_patches/optim/main_params_checkpoint.py",
                 "        expected = [f for f in low_precision if f in saved.state]\n",
                 "        expected = low_precision\n",
                 ("tests/test_load_checks.py::test_a_param_without_optimizer_state_is_no_missing_main_param",)),
    "M9": Mutant("load_state_dict takes torch's flattened-load fillers ({}) for saved state (a bug fixed "
                 "in issue 40)", _STATE,
                 "    return {key: value for key, value in entry.items() if not (isinstance(value, Mapping) "
                 "and not value)}\n",
                 "    return entry\n", (MAIN_PARAMS,)),
    "M10": Mutant("state_dict saves main params only with the leaf's state (a bf16 param its leaf keeps no "
                  "state for loses its fp32 tail on resume: a bug fixed in issue 40)", _STATE,
                  "            if param_state is not None:\n",
                  "            if param_state is not None and set(param_state) != {MAIN_PARAM}:\n",
                  (MAIN_PARAMS,)),
}


def _copy_tree(dest: Path) -> None:
    files = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                           cwd=REPO, check=True, capture_output=True).stdout.decode().split("\0")
    for name in filter(None, files):
        src = REPO / name
        if src.is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / name)


def run(name: str, mutant: Mutant, tests: tuple[str, ...], timeout: float) -> str:
    with tempfile.TemporaryDirectory(prefix=f"mutant_{name}_") as tmp:
        root = Path(tmp)
        _copy_tree(root)
        target = root / mutant.path
        text = target.read_text()
        if text.count(mutant.old) != 1:
            return f"STALE (its original text occurs {text.count(mutant.old)} times in {mutant.path})"
        target.write_text(text.replace(mutant.old, mutant.new))
        start = time.monotonic()
        try:
            proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider",
                                   *tests], cwd=root, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            return f"caught? the tests ran past {timeout:.0f} s (a hang counts as a failure)"
        took = time.monotonic() - start
        last = (proc.stdout.strip().splitlines() or ["(no output)"])[-1]
        if proc.returncode == 0:
            return f"SURVIVED ({last}, {took:.0f} s)"
        failed = [line for line in proc.stdout.splitlines() if line.startswith("FAILED")]
        return f"caught: {failed[0] if failed else last} ({took:.0f} s)"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("names", nargs="*", help=f"mutants to run (default: all of {', '.join(MUTANTS)})")
    parser.add_argument("--list", action="store_true", help="describe the mutants and stop")
    parser.add_argument("--tests", help="pytest arguments to run instead of each mutant's own tests")
    parser.add_argument("--timeout", type=float, default=1200.0, help="seconds per mutant's test run")
    args = parser.parse_args(argv)
    names = args.names or list(MUTANTS)
    unknown = [n for n in names if n not in MUTANTS]
    if unknown:
        parser.error(f"unknown mutant(s) {', '.join(unknown)}; known: {', '.join(MUTANTS)}")
    if args.list:
        for n in names:
            print(f"{n}: {MUTANTS[n].what} ({MUTANTS[n].path}; caught by {', '.join(MUTANTS[n].tests)})")
        return 0
    survived = 0
    for n in names:
        tests = tuple(args.tests.split()) if args.tests else MUTANTS[n].tests
        outcome = run(n, MUTANTS[n], tests, args.timeout)
        survived += not outcome.startswith("caught")
        print(f"{n}: {MUTANTS[n].what}\n    {outcome}", flush=True)
    return 1 if survived else 0


if __name__ == "__main__":
    sys.exit(main())
