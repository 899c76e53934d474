"""Site fixtures: fixture distributions laid out on a temporary path, ready for a child's PYTHONPATH.

Each returns the site folder (see tests/support.py ``install_fixture``). ``fixture_site`` installs any
other fixture by name; ``te_site`` gives a real TransformerEngine release (tests/te_real.py), or skips
when its wheel cannot be fetched (a failure under NPU_FSDP_TESTS_REQUIRE_TE_WHEELS=1).
"""
from __future__ import annotations

from pathlib import Path
from typing import Callable

import pytest

from tests.support import install_fixture
from tests.te_real import require_te_site, require_tenpu_site


@pytest.fixture
def fixture_site(tmp_path) -> Callable[[str], Path]:
    """Install fixture distributions by name under this test's tmp_path."""
    return lambda name: install_fixture(name, tmp_path)


@pytest.fixture
def demo_site(fixture_site) -> Path:
    """tests/fixtures/core_demo: a demo framework, its patches and matrices for the plugin core."""
    return fixture_site("core_demo")


@pytest.fixture
def hyper_site(fixture_site) -> Path:
    """tests/fixtures/hyper_parallel_new: the hyper-parallel stand-in, current generation."""
    return fixture_site("hyper_parallel_new")


@pytest.fixture
def tenpu_site() -> Path:
    """The TransformerEngine-NPU (TENPU) stand-in: NVTE's real base FusedAdam under
    tests/fixtures/te_npu_prefix's documented overlay (tests/te_real.py ``tenpu_site``)."""
    return require_tenpu_site()


@pytest.fixture
def te_site() -> Callable[[str], Path]:
    """Real TE optimizer sources of a release, on CPU: ``te_site("2.11.0")``."""
    return require_te_site
