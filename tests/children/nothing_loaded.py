"""Child side of tests/test_nothing_loaded.py: which patch targets hold plugin code, and a digest of
three training steps of torch AdamW and TE FusedAdam. Never imports the plugin itself."""
import hashlib
import importlib
import sys

# torch first (its autoload loads the plugin unless switched off), then every target module
import torch
import transformer_engine.pytorch.optimizers.fused_adam as te_fused_adam
import hyper_parallel.trainer.base  # noqa: F401,E402
import hyper_parallel.core.dtensor.dtensor  # noqa: F401,E402


def resolve(symbol):   # no plugin import here: the baseline run must never load it
    module, qualname = symbol.split(":")
    owner = importlib.import_module(module)
    *path, attr = qualname.split(".")
    for part in path:
        owner = getattr(owner, part)
    for klass in getattr(owner, "__mro__", ()):
        if attr in vars(klass):
            return vars(klass)[attr]
    return getattr(owner, attr)


def scan(targets: list, plugin_dirs: list) -> dict:
    """Targets (``module:qualname``) that hold a replacement of ours (marked, or code under
    ``plugin_dirs``), and the training digest. A replacement's ``__wrapped__`` is the original (it is
    transparent), so a wrapper chain alone does not lead to our code."""
    ours = []
    for symbol in targets:
        try:
            obj = resolve(symbol)
        except (ImportError, AttributeError):
            continue
        for _ in range(8):   # follow functools.wraps chains (torch's step hook)
            code = getattr(getattr(obj, "__func__", obj), "__code__", None)
            marked = "__npu_fsdp_patch__" in getattr(obj, "__dict__", {})   # ours, whatever code it runs
            if marked or (code is not None and code.co_filename.startswith(tuple(plugin_dirs))):
                ours.append(symbol)
                break
            obj = getattr(obj, "__wrapped__", None)
            if obj is None:
                break

    torch.manual_seed(0)
    digest = hashlib.sha256()
    for make in (lambda ps: torch.optim.AdamW(ps, lr=1e-2, foreach=True),
                 lambda ps: te_fused_adam.FusedAdam(ps, lr=1e-2, weight_decay=0.01)):
        model = torch.nn.Linear(16, 8)
        opt = make(model.parameters())
        for step in range(3):
            model(torch.randn(4, 16)).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
        for p in model.parameters():
            digest.update(p.detach().numpy().tobytes())
    return {"ours": ours, "digest": digest.hexdigest(),
            "plugin_loaded_by_torch": "npu_fsdp_patches" in sys.modules}
