"""Real TransformerEngine optimizer sources from registry wheels, runnable on CPU (tests only).

``te_site(version)`` returns a site folder to put on a child's PYTHONPATH. It holds:

* **real**, from the pinned ``transformer-engine==<version>`` wheel (pure Python, fetched with
  ``pip download --no-deps`` into a cache, never committed): ``transformer_engine/pytorch/
  optimizers/*.py`` (``FusedAdam``, ``FusedSGD``, ``multi_tensor_apply``), ``transformer_engine/
  pytorch/constants.py`` where the release has it (2.17+ imports ``DType`` from it) and the wheel's
  ``transformer_engine-<version>.dist-info`` (so the plugin detects the real version);
* **stand-in**, from ``tests/fixtures/te_real_shim``: the parent ``__init__`` modules (the real ones
  load CUDA libraries) and the quantized-tensor classes ``fused_adam.py`` imports for
  ``isinstance`` checks;
* **stand-in**, from ``tests/fixtures/te_torch_cpu``: the CUDA extension ``transformer_engine_torch``
  as CPU kernels written from TE's ``adam.cu`` (own tests in tests/test_te_cpu_kernels.py), told
  which release's launcher to reproduce.

``tenpu_site()`` returns the same for TENPU, which is not on the registry: NVTE ``TENPU_BASE``'s
real ``fused_adam.py`` (as ``_nvte_fused_adam.py``) under the overlay ``tests/fixtures/te_npu_prefix``
(TENPU's documented differences and its ``transformer_engine_npu`` .dist-info, which replaces NVTE's).

The cache is ``$NPU_FSDP_PATCHES_TE_WHEELS``, else ``$XDG_CACHE_HOME/npu_fsdp_patches/te-wheels``,
else ``~/.cache/npu_fsdp_patches/te-wheels``. ``require_te_site`` skips a test when a wheel cannot
be fetched (``require_tenpu_site`` likewise), unless ``NPU_FSDP_TESTS_REQUIRE_TE_WHEELS=1`` (CI),
which turns that into a failure.
"""
from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

FIXTURES = Path(__file__).resolve().parent / "fixtures"
_SHIMS = (FIXTURES / "te_real_shim", FIXTURES / "te_torch_cpu")
# The releases the suite verifies (docs/te_fused_adam.md#14-dtensor-handling): 1.13 (one-argument
# initialize_state), the DTensor regression (2.10, 2.11), implicit DTensor states (2.12, 2.13), the DTensor
# fix (2.14), the last release that leaves an empty last shard's batch unlaunched (2.17), the first that
# launches it (2.18) and the newest (2.20).
RELEASES = ("1.13.0", "2.10.0", "2.11.0", "2.12.0", "2.13.0", "2.14.0", "2.17.1", "2.18.0",
            "2.20.2")
# The NVTE release the TENPU stand-in overlays (docs/te_fused_adam.md#4-tenpu-distribution), and the
# git blob of its transformer_engine/pytorch/optimizers/fused_adam.py, checked on the wheel's copy.
TENPU_BASE = "2.15.0"
TENPU_BASE_BLOB = "437dfa829eb2bb82cab7bd12a974636f3b09dffd"
_TENPU_OVERLAY = FIXTURES / "te_npu_prefix"
_REAL_PREFIXES = ("transformer_engine/pytorch/optimizers/", "transformer_engine/pytorch/constants.py")


class TeWheelUnavailable(RuntimeError):
    pass


def cache_dir() -> Path:
    if os.environ.get("NPU_FSDP_PATCHES_TE_WHEELS"):
        return Path(os.environ["NPU_FSDP_PATCHES_TE_WHEELS"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "npu_fsdp_patches" / "te-wheels"


def wheel(version: str) -> Path:
    """The cached ``transformer-engine==version`` wheel, downloaded on first use."""
    cache = cache_dir()
    name = f"transformer_engine-{version}-py3-none-any.whl"
    path = cache / name
    if path.exists():
        return path
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache) as tmp:
        proc = subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
             "--disable-pip-version-check", "-q", "-d", tmp, f"transformer-engine=={version}"],
            capture_output=True, text=True, timeout=600)
        got = Path(tmp) / name
        if proc.returncode != 0 or not got.exists():
            raise TeWheelUnavailable(f"pip download transformer-engine=={version} failed: "
                                     f"{(proc.stderr or proc.stdout).strip()[-400:]}")
        os.replace(got, path)
    return path


def git_blob(path: Path) -> str:
    """The git blob id of ``path`` (``git hash-object``), to compare a wheel's file with a commit's."""
    data = path.read_bytes()
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def _digest(roots) -> str:
    h = hashlib.sha256()
    for root in roots:
        for f in sorted(root.rglob("*")):
            if f.is_file() and "__pycache__" not in f.parts:
                h.update(str(f.relative_to(root)).encode() + f.read_bytes())
    return h.hexdigest()[:12]


def _laid_out(site: Path, fill) -> Path:
    """``site``, built once by ``fill(folder)`` and moved into place atomically."""
    if site.exists():
        return site
    site.parent.mkdir(parents=True, exist_ok=True)
    prefix = site.name.rsplit("-", 1)[0]
    tmp = Path(tempfile.mkdtemp(prefix=f".{prefix}-", dir=site.parent))
    try:
        fill(tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    try:
        os.replace(tmp, site)
    except OSError:  # another process built it first
        shutil.rmtree(tmp, ignore_errors=True)
    for stale in site.parent.glob(f"{prefix}-*"):  # built from older stand-ins
        if stale != site:
            shutil.rmtree(stale, ignore_errors=True)
    return site


def te_site(version: str) -> Path:
    """A site folder with TE ``version``'s real optimizer sources and the CPU stand-ins."""
    def fill(tmp: Path) -> None:
        whl = wheel(version)
        for root in _SHIMS:
            shutil.copytree(root, tmp, dirs_exist_ok=True,
                            ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        with zipfile.ZipFile(whl) as zf:
            for member in zf.namelist():
                if member.startswith(_REAL_PREFIXES) or member.split("/")[0].endswith(".dist-info"):
                    zf.extract(member, tmp)
        release = tuple(int(x) for x in version.split(".")[:2])
        (tmp / "transformer_engine_torch" / "_release.py").write_text(f"RELEASE = {release!r}\n")
    return _laid_out(cache_dir() / "sites" / f"{version}-{_digest(_SHIMS)}", fill)


def tenpu_site() -> Path:
    """A site folder with the TENPU stand-in, derived from NVTE ``TENPU_BASE``'s real FusedAdam."""
    def fill(tmp: Path) -> None:
        # no NVTE .dist-info (TENPU ships its own); the CPU transformer_engine_torch module stays,
        # as NVTE's fused_adam.py imports it, but is not a distribution of this site
        shutil.copytree(te_site(TENPU_BASE), tmp, dirs_exist_ok=True,
                        ignore=shutil.ignore_patterns("*.dist-info", "__pycache__", "*.pyc"))
        optimizers = tmp / "transformer_engine" / "pytorch" / "optimizers"
        blob = git_blob(optimizers / "fused_adam.py")
        if blob != TENPU_BASE_BLOB:
            raise RuntimeError(f"TE {TENPU_BASE}'s fused_adam.py is blob {blob}, not the "
                               f"snapshot's {TENPU_BASE_BLOB}")
        os.replace(optimizers / "fused_adam.py", optimizers / "_nvte_fused_adam.py")
        shutil.copytree(_TENPU_OVERLAY, tmp, dirs_exist_ok=True,
                        ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    digest = _digest((*_SHIMS, _TENPU_OVERLAY))
    return _laid_out(cache_dir() / "sites" / f"tenpu-{TENPU_BASE}-{digest}", fill)


def _require(build, what: str, *args) -> Path:
    import pytest
    try:
        return build(*args)
    except (TeWheelUnavailable, OSError, subprocess.TimeoutExpired) as exc:
        if os.environ.get("NPU_FSDP_TESTS_REQUIRE_TE_WHEELS") == "1":
            raise
        pytest.skip(f"{what} wheel unavailable (no registry access?): {exc}")


def require_te_site(version: str) -> Path:
    """``te_site(version)``, or skip the calling test (fail under NPU_FSDP_TESTS_REQUIRE_TE_WHEELS=1)."""
    return _require(te_site, f"TE {version}", version)


def require_tenpu_site() -> Path:
    """``tenpu_site()``, or skip the calling test like ``require_te_site``."""
    return _require(tenpu_site, f"TENPU stand-in: its base TE {TENPU_BASE}")


def require_wheel(version: str) -> Path:
    """``wheel(version)``, or skip the calling test like ``require_te_site``."""
    return _require(wheel, f"TE {version}", version)
