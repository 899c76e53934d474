"""What ``npu-fsdp-patches report`` records about the machine: OS, host, time, the stack's packages, and
the Ascend stack (CANN toolkit, driver, ``npu-smi info``). Nothing here imports torch or raises: a
fact that cannot be read says "not found" (or why) instead.

Where the Ascend facts live follows torch_npu's collect_env (Ascend/pytorch
torch_npu/utils/collect_env.py, get_cann_version: ``ascend_*_install.info`` under $ASCEND_HOME_PATH)
and the CANN installation layout (``<toolkit>/version.cfg`` with ``toolkit_running_version=[inner:x]``,
``/usr/local/Ascend/driver/version.info`` with ``Version=x``); the host facts follow torch's
torch/utils/collect_env.py and DeepSpeed's ds_report.
"""
from __future__ import annotations

import datetime
import glob
import os
import platform
import re
import shutil
import socket
import subprocess
import sys

from ..plan.detect import distribution_index, normalize

NOT_FOUND = "not found"
ASCEND_ROOT = "/usr/local/Ascend"
#: the plugin and what it (and its self-test) runs on; the frameworks and theirs come from the matrix
PLUGIN = "npu-fsdp-patches"
PLUGIN_PACKAGES = ("numpy", "wrapt", "pyyaml", "packaging")
NPU_SMI_TIMEOUT_S = 20


def system() -> dict:
    """OS, kernel, Python, host and the time of the report (UTC)."""
    os_name = platform.platform()
    try:
        with open("/etc/os-release", encoding="utf-8", errors="replace") as fh:
            pretty = re.search(r'^PRETTY_NAME="?([^"\n]*)"?', fh.read(), re.M)
        os_name = pretty.group(1) if pretty else os_name
    except OSError:
        pass
    return {"os": os_name, "kernel": f"{platform.system()} {platform.release()}", "machine": platform.machine(),
            "python": f"{platform.python_version()} ({platform.python_implementation()}, {sys.executable})",
            "host": socket.gethostname(),
            "time": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}


def packages(frameworks: dict, matrix) -> dict:
    """package -> {version, found, location, framework, needed_by, importable, import_error}, in report order:
    the plugin, then each framework of the matrix with what it depends on (its ``depends_on``), then the
    plugin's own packages. ``frameworks`` is doctor's section, so both sections tell one story: a framework
    that detection found in a source tree (no distribution metadata) is a row ``found`` there, never
    "not found"; ``importable`` is what doctor's import found (None: not imported)."""
    index = distribution_index()
    rows: dict = {}

    def add(name: str, needed_by: str | None = None, **fields) -> None:
        dist = index.get(normalize(name))
        row = rows.setdefault(name, {"version": dist.version if dist else None,
                                     "found": "metadata" if dist else NOT_FOUND,
                                     "location": (dist.root if dist else None), "framework": None,
                                     "needed_by": [], "importable": None, "import_error": None})
        row.update({k: v for k, v in fields.items() if v is not None})
        if needed_by and needed_by not in row["needed_by"]:
            row["needed_by"].append(needed_by)

    add(PLUGIN)
    for name, fw in frameworks.items():
        spec = matrix.frameworks.get(name) if matrix is not None else None
        dists = list({normalize(d): d for d in reversed(spec.distributions if spec else ())}.values())[::-1] or [name]
        mine = dict(framework=name, importable=fw.get("importable"), import_error=fw.get("import_error"))
        if fw.get("installed") and not fw.get("distribution"):      # a source tree: no metadata to read
            add(dists[0], version=fw.get("version") or "unknown version", found=fw.get("source"),
                location=fw.get("location"), **mine)
        else:
            for dist in [d for d in dists if normalize(d) in index] or dists:
                add(dist, **mine)
        for dep in fw.get("depends_on") or {}:
            add(dep, needed_by=name)
    for name in PLUGIN_PACKAGES:
        add(name, needed_by=PLUGIN)
    return rows


def _read(path: str) -> str | None:
    try:
        with open(path, encoding="utf-8", errors="replace") as fh:
            return fh.read(65536)
    except OSError:
        return None


def _key(text: str, pattern: str) -> str | None:
    found = re.search(pattern, text, re.M | re.I)
    return found.group(1).strip() if found else None


def _toolkit_version(home: str) -> tuple:
    """(version, file it came from) in one toolkit folder, or (None, None)."""
    text = _read(os.path.join(home, "version.cfg"))
    version = text and _key(text, r"^toolkit_running_version=\[[^:\]]*:([^\]]+)\]")
    if version:
        return version, os.path.join(home, "version.cfg")
    for pattern in ("*/ascend_toolkit_install.info", "*/version.info", "version.info"):
        for path in sorted(glob.glob(os.path.join(home, pattern))):
            version = _key(_read(path) or "", r"^version=(.+)$")
            if version:
                return version, path
    return None, None


def cann_toolkit(environ=None) -> dict:
    """The CANN toolkit version from $ASCEND_TOOLKIT_HOME, $ASCEND_HOME_PATH, then the default install."""
    environ = os.environ if environ is None else environ
    homes = [environ.get("ASCEND_TOOLKIT_HOME"), environ.get("ASCEND_HOME_PATH"),
             os.path.join(ASCEND_ROOT, "ascend-toolkit", "latest")]
    searched = list(dict.fromkeys(h for h in homes if h))
    for home in searched:
        version, path = _toolkit_version(home)
        if version:
            return {"version": version, "source": path}
    return {"version": NOT_FOUND, "searched": searched}


def driver(root: str = ASCEND_ROOT) -> dict:
    """The NPU driver version from <root>/driver/version.info (``Version=x``)."""
    path = os.path.join(root, "driver", "version.info")
    version = _key(_read(path) or "", r"^Version=(.+)$")
    return {"version": version, "source": path} if version else {"version": NOT_FOUND, "searched": [path]}


def parse_npu_smi(text: str) -> list:
    """The device rows of ``npu-smi info``: the first row of each block after a ``+===`` rule reads
    ``| <npu> <name> | <health> | ...``; the process table that follows is ignored."""
    devices, expect = [], False
    for line in text.splitlines():
        if "Process id" in line:
            break
        if line.startswith("+="):
            expect = True
        elif expect and line.startswith("|"):
            expect = False
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            first = cells[0].split(None, 1)
            if len(first) == 2 and first[0].isdigit() and len(cells) > 1:
                devices.append({"npu": int(first[0]), "name": first[1], "health": cells[1]})
    return devices


def npu_smi(timeout: float = NPU_SMI_TIMEOUT_S) -> dict:
    """``npu-smi info``: the device list (model and count), or why there is none."""
    exe = shutil.which("npu-smi")
    if exe is None:
        return {"status": NOT_FOUND}
    try:
        proc = subprocess.run([exe, "info"], capture_output=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"status": f"timed out after {timeout:g}s", "command": f"{exe} info"}
    except OSError as exc:
        return {"status": f"cannot run: {exc}", "command": f"{exe} info"}
    text = proc.stdout.decode("utf-8", errors="replace")
    devices = parse_npu_smi(text)
    if proc.returncode != 0 or not devices:
        why = f"exit code {proc.returncode}" if proc.returncode else "no device rows recognised"
        tail = (text.strip() or proc.stderr.decode("utf-8", errors="replace").strip())[-2000:]
        return {"status": f"unreadable ({why})", "command": f"{exe} info", "output_tail": tail}
    models: dict = {}
    for device in devices:
        models[device["name"]] = models.get(device["name"], 0) + 1
    return {"status": "ok", "command": f"{exe} info", "count": len(devices), "models": models,
            "devices": devices, "version": _key(text, r"Version:\s*(\S+)")}


def ascend(environ=None) -> dict:
    return {"cann_toolkit": cann_toolkit(environ), "driver": driver(), "npu_smi": npu_smi()}
