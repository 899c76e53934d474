"""docs/contributing.md#adding-a-patch, done: a demo patch added in exactly the three places.

The places are a module in ``patches/`` (``DEMO_MODULE``), an entry in ``compat_matrix.yaml``
(``DEMO_FRAMEWORK`` + ``DEMO_ENTRY``) and this test; the module and the entry are the page's worked
example, read from docs/contributing.md. They are written into a copy of the checkout
(the core, ``patches/``, ``compat_matrix.yaml``), which a fresh interpreter imports first on its
path, as a plain checkout is imported; the target framework is the ``core_demo`` fixture. The plugin
must detect, decide, apply, explain, self-test and revert the patch with nothing else edited.
"""
import shutil

import pytest

from tests.support import REPO_ROOT, run_case

CASES = "tests.children.demo_patch_cases"
#: bytecode (and the derived built-in table) written, so the second run shows the stored table is re-derived
WRITE_CACHE = {"PYTHONDONTWRITEBYTECODE": ""}


def _worked_example(first_line: str) -> str:
    """The code block of docs/contributing.md#adding-a-patch that starts with ``first_line``."""
    text = (REPO_ROOT / "docs" / "contributing.md").read_text(encoding="utf-8")
    block = text[text.index(first_line + "\n") + len(first_line) + 1:]
    return block[:block.index("```")]


#: the worked example of the contributor page, exactly as it stands there
DEMO_MODULE = _worked_example("# patches/demo_exclaim.py")
DEMO_ENTRY = _worked_example("# compat_matrix.yaml, under patches:")
#: the demo framework is new to the shipped matrix, so its entry names it too
DEMO_FRAMEWORK = "  demo: {distributions: [demo-framework], module: demo_target}\n"


@pytest.fixture(scope="module")
def checkout(tmp_path_factory):
    """A copy of the checkout's core, patches/ and matrix, and the table it derives before the demo."""
    root = tmp_path_factory.mktemp("checkout")
    ignore = shutil.ignore_patterns("__pycache__")
    shutil.copytree(REPO_ROOT / "npu_fsdp_patches", root / "npu_fsdp_patches", symlinks=True, ignore=ignore)
    shutil.copytree(REPO_ROOT / "patches", root / "patches", ignore=ignore)
    shutil.copy(REPO_ROOT / "compat_matrix.yaml", root / "compat_matrix.yaml")
    before = run_case(f"{CASES}:builtins", paths=[root], env=WRITE_CACHE, cwd=root)
    (root / "patches" / "demo_exclaim.py").write_text(DEMO_MODULE)
    matrix = (root / "compat_matrix.yaml").read_text().replace("\nframeworks:\n", "\nframeworks:\n" + DEMO_FRAMEWORK)
    (root / "compat_matrix.yaml").write_text(matrix + DEMO_ENTRY)
    return root, before


def test_the_copy_derives_its_builtins_from_its_own_patches_folder(checkout):
    root, before = checkout
    assert before["table_from"] == [str(root / "patches")] and "demo_exclaim" not in before["table"]
    assert before["stored"], "the derived table was not stored: the next run could not prove it is re-derived"
    after = run_case(f"{CASES}:builtins", paths=[root], env=WRITE_CACHE, cwd=root)
    assert after["table"]["demo_exclaim"] == "npu_fsdp_patches.patches.demo_exclaim:DemoExclaim"
    assert set(after["table"]) - set(before["table"]) == {"demo_exclaim"}


def test_the_demo_patch_is_detected_decided_applied_explained_and_reverted(checkout, demo_site):
    root, _ = checkout
    out = run_case(f"{CASES}:lifecycle", paths=[root, demo_site], cwd=root)
    decision, reason = out["decision"]
    assert decision == "enabled" and reason.startswith("demo-framework 1.2.0 matches >=1.0"), reason
    assert out["provenance"]["builtin"] is True
    assert out["before_import"] == "pending"
    assert out["applied"] == ["applied", "hello x!"]
    assert out["reverted"] == ["reverted", "hello x"]
    explain = out["explain"]
    assert explain[0] == "demo_exclaim: demo_target.greet ends with an exclamation mark"
    assert "  `greet` ends its greeting with an exclamation mark." in explain
    assert "Upstream fix: demo 2.0 shouts by itself" in explain and "Upstream issues: demo#7" in explain
    assert out["doctor"] == {"name": "demo_exclaim", "decision": "enabled", "state": "pending"}


def test_the_demo_patch_stands_down_where_upstream_has_the_fix(checkout, demo_site):
    root, _ = checkout
    out = run_case(f"{CASES}:lifecycle", paths=[root, demo_site], env={"DEMO_TARGET_FIXED": "1"}, cwd=root)
    assert out["applied"] == ["skipped", "hello x"]


def test_the_demo_patch_self_test_check_runs_in_the_engine(checkout, demo_site):
    root, _ = checkout
    out = run_case(f"{CASES}:self_test", paths=[root, demo_site], timeout=300, cwd=root)
    assert out["declared"] == ["npu_fsdp_patches.patches.demo_exclaim:check_greet", "demo_exclaim"]
    assert out["exit_code"] == 0, out
    assert [(c["name"], c["status"], c["patches"]) for c in out["checks"]] == [
        ("demo_exclaim", "passed", ["demo_exclaim"])]
