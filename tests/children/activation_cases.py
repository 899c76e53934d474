"""Child side of tests/runtime/test_activation_environments.py: activation where the process changes under it
(a framework put on sys.path after activation, MindSpeed's placeholder modules, os.chdir before a
spawned worker, the plugin imported from a zip)."""
import os
import sys
import types


def _status() -> dict:
    import npu_fsdp_patches
    return {r["name"]: r for r in npu_fsdp_patches.status()}


def framework_added_after_activation(late_site: str, autoload: bool) -> dict:
    """A launcher puts the framework on sys.path after activation, then imports it."""
    if autoload:
        import torch  # noqa: F401 - torch's autoload activates the plugin
    import npu_fsdp_patches
    from npu_fsdp_patches.runtime.facade import RUNTIME
    autoloaded = "npu_fsdp_patches" in sys.modules
    before = _status()["demo_shout"]
    sys.path.insert(0, late_site)
    import demo_target
    after = _status()["demo_shout"]
    return {"autoloaded": autoloaded, "before": before, "after": after, "greet": demo_target.greet("x"),
            "late": list(RUNTIME.snapshot().late_detections), "demo": npu_fsdp_patches.detect()["demo"]}


def _create_dummy(path: str) -> None:
    """What MindSpeed's patch manager does for a module that is not installed (MindSpeed
    mindspeed/patch_utils.py ``Patch.parse_path`` with create_dummy=True): import fails, so every
    level becomes a ``types.ModuleType`` with ``ModuleSpec(path, None)``, bound on its parent."""
    import importlib
    from importlib.machinery import ModuleSpec
    parts = path.split(".")
    for i in range(1, len(parts) + 1):
        name, parent = ".".join(parts[:i]), ".".join(parts[:i - 1])
        try:
            importlib.import_module(name)
        except ModuleNotFoundError:
            module = types.ModuleType(name)
            module.__file__ = "mindspeed.dummy_module.py"
            module.__spec__ = ModuleSpec(name, None)
            sys.modules[name] = module
            if parent:
                setattr(sys.modules[parent], parts[i - 1], module)


def placeholder_frameworks(order: str) -> dict:
    """TE placeholders before or after activation (TE forced on with ENABLE): TE reads as not
    installed, no hook of ours runs on a placeholder, and MindSpeed's hasattr walk over sys.modules
    imports nothing."""
    fused_adam = "transformer_engine.pytorch.optimizers.fused_adam"
    if order == "before":
        _create_dummy(fused_adam)
        sys.modules[fused_adam].FusedAdam = type("FusedAdam", (), {"step": lambda self: "dummy"})
    import npu_fsdp_patches
    if order == "after":
        _create_dummy(fused_adam)
        sys.modules[fused_adam].FusedAdam = type("FusedAdam", (), {"step": lambda self: "dummy"})
    loaded = set(sys.modules)
    for _, module in sys.modules.copy().items():   # MindSpeed's Patch.apply_patch walk
        for name in ("FusedAdam", "save_checkpoint", "load_checkpoint", "MainParamsOptimizer", "adam"):
            hasattr(module, name)
    walk_imported = sorted(set(sys.modules) - loaded)   # before our own API calls below
    record = _status()["te_fused_adam_dtensor"]
    return {"te": npu_fsdp_patches.detect()["transformer_engine"], "state": record["state"],
            "waiting_for": record["waiting_for"], "applied": record["applied_targets"],
            "step_is_dummy": sys.modules[fused_adam].FusedAdam.step.__name__ == "<lambda>",
            "walk_imported": walk_imported}


def relative_matrix_spawned(workdir: str, elsewhere: str) -> dict:
    """NPU_FSDP_PATCHES_MATRIX relative to ``workdir``; the script then changes directory and spawns."""
    import multiprocessing
    os.chdir(workdir)
    import npu_fsdp_patches  # noqa: F401
    parent = matrix_state()
    os.chdir(elsewhere)
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        worker = pool.apply(matrix_state)
    return {"parent": parent, "worker": worker}


def matrix_state() -> dict:
    import npu_fsdp_patches  # noqa: F401
    from npu_fsdp_patches.runtime.facade import RUNTIME
    snap = RUNTIME.snapshot()
    return {"error": snap.config_error, "matrix": snap.matrix.path if snap.matrix else None,
            "patches": sorted(r["name"] for r in snap.records), "cwd": os.getcwd()}


def plugin_from_zip(checkout: str) -> dict:
    """Import the plugin from the zip that precedes the checkout on sys.path ('' is the checkout)."""
    sys.path[:] = [p for p in sys.path if p not in ("", checkout)]
    import npu_fsdp_patches
    from npu_fsdp_patches.runtime.facade import RUNTIME
    return {"file": npu_fsdp_patches.__file__, "error": RUNTIME.snapshot().config_error,
            "patches": {name: r["state"] for name, r in _status().items()}}
