"""Import cost of ``import npu_fsdp_patches`` next to ``import torch`` (docs/design.md#6-performance-targets:
target <= 3%).

Each sample is a fresh interpreter timing only the import statement (interpreter start-up excluded).
torch is timed with TORCH_DEVICE_BACKEND_AUTOLOAD=0 so it does not include our own autoload.
Bytecode writing is on and one untimed import comes first, as after ``pip install`` plus one run: the
.pyc files and the compiled matrix (npu_fsdp_patches/plan/matrix_cache.py) exist. ``--dont-write-bytecode``
runs every interpreter with PYTHONDONTWRITEBYTECODE=1 instead, as many container images do (the .pyc
files pip compiled are still read; the compiled matrix lives in the user's cache folder).
Usage: python benchmarks/import_overhead.py [--runs N] [--dont-write-bytecode] [--json]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

TIMER = "import time; t = time.perf_counter(); import {module}; print(time.perf_counter() - t)"


def sample(module: str, runs: int, env: dict) -> list:
    out = []
    for _ in range(runs):
        proc = subprocess.run([sys.executable, "-c", TIMER.format(module=module)], capture_output=True,
                              text=True, env=env, check=True)
        out.append(float(proc.stdout.strip().splitlines()[-1]))
    return out


def importtime_top(module: str, env: dict, top: int = 8) -> list:
    """The heaviest entries of ``-X importtime`` (cumulative microseconds) for one import."""
    proc = subprocess.run([sys.executable, "-X", "importtime", "-c", f"import {module}"],
                          capture_output=True, text=True, env=env, check=True)
    rows = []
    for line in proc.stderr.splitlines():
        if line.startswith("import time:") and "|" in line and "cumulative" not in line:
            self_us, cumulative, name = line.replace("import time:", "").split("|")
            rows.append((int(cumulative), int(self_us), name.strip()))
    return [{"module": n, "cumulative_us": c, "self_us": s} for c, s, n in sorted(rows, reverse=True)[:top]]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--runs", type=int, default=7)
    parser.add_argument("--dont-write-bytecode", action="store_true", help="PYTHONDONTWRITEBYTECODE=1")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("NPU_FSDP_PATCHES") and k != "PYTHONDONTWRITEBYTECODE"}
    if args.dont_write_bytecode:
        env["PYTHONDONTWRITEBYTECODE"] = "1"
    torch_env = {**env, "TORCH_DEVICE_BACKEND_AUTOLOAD": "0"}
    sample("npu_fsdp_patches", 1, env)   # warm-up: .pyc files and the compiled matrix
    plugin = statistics.median(sample("npu_fsdp_patches", args.runs, env))
    torch = statistics.median(sample("torch", args.runs, torch_env))
    check = subprocess.run([sys.executable, "-c", "import sys, npu_fsdp_patches; print('torch' in sys.modules)"],
                           capture_output=True, text=True, env=env, check=True).stdout.strip()
    result = {"runs": args.runs, "dont_write_bytecode": args.dont_write_bytecode,
              "plugin_s": plugin, "torch_s": torch, "ratio": plugin / torch,
              "target_ratio": 0.03, "torch_imported_by_plugin": check == "True",
              "importtime_top": importtime_top("npu_fsdp_patches", env)}
    if args.json:
        print(json.dumps(result, indent=2))
        return
    print(f"import npu_fsdp_patches  median {plugin * 1e3:8.1f} ms  ({args.runs} fresh interpreters)")
    print(f"import torch             median {torch * 1e3:8.1f} ms")
    print(f"ratio                    {result['ratio']:.3f}  (target <= 0.03)   torch imported by plugin: {check}")
    print("\n-X importtime, heaviest cumulative entries of `import npu_fsdp_patches`:")
    for row in result["importtime_top"]:
        print(f"  {row['cumulative_us'] / 1e3:8.1f} ms cumulative  {row['self_us'] / 1e3:7.1f} ms self  {row['module']}")


if __name__ == "__main__":
    main()
