"""Child side of tests/plan/test_detect_installs.py: detection, status and doctor in a fresh interpreter
whose sys.path holds the fixture sites the test built."""
import importlib.metadata
import json
import sys

FRAMEWORK_MODULES = ("transformer_engine", "megatron", "torch_npu", "hyper_parallel", "mindspeed", "veomni")


def detect_like_importlib(distribution: str, framework: str) -> dict:
    """Our detection of ``framework`` next to what importlib.metadata reads for ``distribution``."""
    import npu_fsdp_patches
    found = npu_fsdp_patches.detect()[framework]
    try:
        theirs = importlib.metadata.version(distribution)
    except Exception as exc:  # noqa: BLE001 - reported, compared by the test
        theirs = f"{type(exc).__name__}"
    return {"ours": found, "importlib": theirs,
            "imported": sorted(m for m in FRAMEWORK_MODULES if m in sys.modules)}


def undecodable_metadata(autoload: bool) -> dict:
    """Activation, status() and doctor next to a framework whose METADATA is not UTF-8."""
    if autoload:
        import torch  # noqa: F401 - torch's autoload activates the plugin
    import npu_fsdp_patches
    from npu_fsdp_patches.cli.doctor import collect
    report = json.loads(json.dumps(collect(), default=str))
    return {"autoloaded": autoload and "npu_fsdp_patches" in sys.modules,
            "status": npu_fsdp_patches.status(), "te": npu_fsdp_patches.detect()["transformer_engine"],
            "doctor_frameworks": sorted(report["frameworks"])}
