"""No patch code runs under the runtime's lock: a stand-down probe or a replacement factory that waits
for another thread using the plugin completes (with the lock held across them, that thread blocked
until the wait timed out). What the unlocked code built is installed only if its target did not
change meanwhile."""
from tests.core_demo import run_demo
from tests.support import install_fixture

MATRIX = """schema_version: 1
frameworks:
  demo: {distributions: [demo-framework], module: demo_target}
patches:
  demo_waits:
    summary: its probe and its factory each wait for a thread that calls status()
    targets: ["demo_target:greet"]
    gate: [{demo: {installed: true}}]
    stand_down_probe: waits_for_status_in_another_thread
"""
PATCHES = '''
import threading

import npu_fsdp_patches
from npu_fsdp_patches.patch import Patch

SEEN = {}


def status_in_another_thread(key):
    """Let another thread call status() (it takes the runtime's lock); wait for it, at most 20 s."""
    done = threading.Event()

    def run():
        npu_fsdp_patches.status()
        done.set()

    threading.Thread(target=run, daemon=True).start()
    SEEN[key] = done.wait(20)


def _greet(original):
    status_in_another_thread("factory")

    def greet(name):
        return original(name) + "?"
    return greet


class Waits(Patch):
    name = "demo_waits"
    factories = {"greet": _greet}

    def waits_for_status_in_another_thread(self):
        status_in_another_thread("probe")
        return False
'''


def _third_party_site(tmp_path, module: str, code: str, patch: str, cls: str):
    """The core demo site plus a third-party distribution whose entry point registers ``patch``."""
    site = install_fixture("core_demo", tmp_path)
    (site / f"{module}.py").write_text(code)
    info = site / f"{module}-1.0.dist-info"
    info.mkdir()
    dist = module.replace("_", "-")
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text(f"[npu_fsdp_patches.patches]\n{patch} = {module}:{cls}\n")
    return site


def test_probe_and_factory_run_outside_the_runtime_lock(tmp_path):
    _third_party_site(tmp_path, "waiting_patches", PATCHES, "demo_waits", "Waits")
    (tmp_path / "waits.yaml").write_text(MATRIX)
    result, _ = run_demo(tmp_path, """
import npu_fsdp_patches, demo_target, waiting_patches
emit(seen=waiting_patches.SEEN, state=records()["demo_waits"]["state"], greet=demo_target.greet("x"))
""", NPU_FSDP_PATCHES_MATRIX=str(tmp_path / "waits.yaml"))
    assert result == {"seen": {"probe": True, "factory": True}, "state": "applied", "greet": "hello x?"}


CHANGING = '''
import demo_target
from npu_fsdp_patches.patch import Patch

BUILT = []


def _question(original):
    BUILT.append(original("x"))
    if len(BUILT) == 1:   # the target changes while this replacement is built (another thread's work)
        def greet(name):
            return "hi " + name
        demo_target.greet = greet

    def greet(name):
        return original(name) + "?"
    return greet


class Changes(Patch):
    name = "demo_changes"
    factories = {"greet": _question}
'''


def test_a_target_that_changes_while_its_replacement_is_built_is_built_again(tmp_path):
    _third_party_site(tmp_path, "changing_patches", CHANGING, "demo_changes", "Changes")
    (tmp_path / "changes.yaml").write_text(MATRIX.replace("demo_waits", "demo_changes").replace(
        "    stand_down_probe: waits_for_status_in_another_thread\n", ""))
    result, _ = run_demo(tmp_path, """
import npu_fsdp_patches, demo_target, changing_patches
patched = demo_target.greet("x")
npu_fsdp_patches.revert("demo_changes")
emit(built=changing_patches.BUILT, patched=patched, reverted=demo_target.greet("x"))
""", NPU_FSDP_PATCHES_MATRIX=str(tmp_path / "changes.yaml"))
    assert result == {"built": ["hello x", "hi x"], "patched": "hi x?", "reverted": "hi x"}
