"""Architecture: the package's layers and their import graph, read from the source (issue 32;
docs/design.md#2-layout).

Every import counts: module level, inside functions (lazy) and under ``TYPE_CHECKING``. The graph has
no cycle, and each layer imports only itself and the layers below it (BELOW):

    base      errors, plugin_log, process_state, patch (the Patch contract for patch authors)
    plan      npu_fsdp_patches.plan: settings, matrix and its cache, versions, detection, decisions
    runtime   npu_fsdp_patches.runtime: activation, lifecycle, install, registry, hooks, records, ...
    api       npu_fsdp_patches itself (status/apply/revert/detect; activation on import)
    optim     npu_fsdp_patches.optim: the numerics, on base only (never the plugin's machinery)
    patches   npu_fsdp_patches.patches (the repository's patches/): adapters onto optim
    selftest  npu_fsdp_patches.selftest: the numerics checks, run through the api
    cli       npu_fsdp_patches.cli and ``python -m npu_fsdp_patches``: on everything
"""
from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest

from tests.support import run_python

REPO = Path(__file__).resolve().parent.parent
PACKAGE = "npu_fsdp_patches"
#: (layer, module prefixes), bottom first; a module belongs to the layer of its longest matching prefix
LAYERS = [
    ("base", ["npu_fsdp_patches.errors", "npu_fsdp_patches.plugin_log", "npu_fsdp_patches.process_state",
              "npu_fsdp_patches.patch"]),
    ("plan", ["npu_fsdp_patches.plan"]),
    ("runtime", ["npu_fsdp_patches.runtime"]),
    ("api", ["npu_fsdp_patches"]),
    ("optim", ["npu_fsdp_patches.optim"]),
    ("patches", ["npu_fsdp_patches.patches"]),
    ("selftest", ["npu_fsdp_patches.selftest"]),
    ("cli", ["npu_fsdp_patches.cli", "npu_fsdp_patches.__main__"]),
]
#: the layers each layer may import besides itself
BELOW = {
    "base": set(),
    "plan": {"base"},
    "runtime": {"base", "plan"},
    "api": {"base", "plan", "runtime"},
    "optim": {"base"},
    "patches": {"base", "optim"},
    "selftest": {"base", "plan", "runtime", "api", "optim"},
    "cli": {"base", "plan", "runtime", "api", "optim", "patches", "selftest"},
}


def layer_of(module: str) -> str:
    best, length = None, -1
    for name, prefixes in LAYERS:
        for prefix in prefixes:
            exact = module == prefix
            inside = module.startswith(prefix + ".") and name != "api"   # api is the package's __init__ only
            if (exact or inside) and len(prefix) > length:
                best, length = name, len(prefix)
    if best is None:
        raise AssertionError(f"{module} belongs to no layer: add it to LAYERS (and docs/design.md section 2)")
    return best


def sources() -> dict[str, Path]:
    """Module name -> file, for the package and the built-in patches (installed as its ``patches``)."""
    found = {}
    for root, name in ((REPO / PACKAGE, PACKAGE), (REPO / "patches", f"{PACKAGE}.patches")):
        for path in root.rglob("*.py"):
            parts = [name, *path.relative_to(root).with_suffix("").parts]
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
    return found


def imports_of(module: str, path: Path, known: set[str]) -> set[str]:
    """The package modules ``module`` imports anywhere in its source (``from x import y`` counts
    ``x.y`` when that is a module, else ``x``)."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[:len(package.split(".")) - node.level + 1]
                origin = ".".join(base + ([node.module] if node.module else []))
            else:
                origin = node.module or ""
            names = [f"{origin}.{a.name}" if f"{origin}.{a.name}" in known else origin for a in node.names]
        else:
            continue
        found.update(n for n in names if n == PACKAGE or n.startswith(PACKAGE + "."))
    found.discard(module)
    return {n if n in known else n.rpartition(".")[0] for n in found} - {module}


def graph() -> dict[str, set[str]]:
    files = sources()
    known = set(files)
    return {module: imports_of(module, path, known) for module, path in files.items()}


def upward(edges: dict[str, set[str]]) -> list[str]:
    return sorted(f"{a} ({layer_of(a)}) imports {b} ({layer_of(b)})"
                  for a, targets in edges.items() for b in targets
                  if layer_of(b) != layer_of(a) and layer_of(b) not in BELOW[layer_of(a)])


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), plus self-imports."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1 or v in edges.get(v, ()):
                out.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


EDGES = graph()


def test_every_module_has_a_layer():
    assert {m: layer_of(m) for m in EDGES}   # raises naming a module outside every layer


def test_each_layer_imports_only_the_layers_below_it():
    assert upward(EDGES) == []


def test_the_import_graph_has_no_cycle():
    assert cycles(EDGES) == []


def test_the_plugin_core_subpackages_are_the_layers():
    """The tree shows the layers: no plugin-core module is left beside them at the package root."""
    root = sorted(p.stem for p in (REPO / PACKAGE).glob("*.py"))
    assert root == ["__init__", "__main__", "errors", "patch", "plugin_log", "process_state"]


@pytest.mark.parametrize("edges, finds", [
    ({"npu_fsdp_patches.plan.matrix": {"npu_fsdp_patches.runtime.hooks"},
      "npu_fsdp_patches.runtime.hooks": set()}, "upward"),
    ({"npu_fsdp_patches.runtime.install": {"npu_fsdp_patches.runtime.lifecycle"},
      "npu_fsdp_patches.runtime.lifecycle": {"npu_fsdp_patches.runtime.install"}}, "cycle"),
    ({"npu_fsdp_patches.optim.tensors": {"npu_fsdp_patches"}, "npu_fsdp_patches": set()}, "upward"),
    ({"npu_fsdp_patches.optim.tensors": {"npu_fsdp_patches.plan.settings"},
      "npu_fsdp_patches.plan.settings": set()}, "upward"),
], ids=["plan imports runtime", "two runtime modules", "optim imports the api", "optim imports plan"])
def test_the_checks_catch_what_they_guard_against(edges, finds):
    """Negative controls: an upward import and a cycle (a lazy or typing-only one reads the same)."""
    assert (upward(edges) if finds == "upward" else cycles(edges)) != []


def test_lazy_and_typing_only_imports_are_counted(tmp_path):
    source = tmp_path / "m.py"
    source.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .a import X\n"
                      "def f():\n    from ..runtime import hooks\n")
    known = {"npu_fsdp_patches.plan.a", "npu_fsdp_patches.runtime.hooks", "npu_fsdp_patches.plan.m"}
    assert imports_of("npu_fsdp_patches.plan.m", source, known) == {
        "npu_fsdp_patches.plan.a", "npu_fsdp_patches.runtime.hooks"}


def test_activation_imports_only_the_foundations_plan_and_runtime():
    """``import npu_fsdp_patches`` (the activation path) stays light: no command, numerics or self-test
    module, and so no torch."""
    proc = run_python("import json, sys, npu_fsdp_patches\n"
                      "print(json.dumps(sorted(m for m in sys.modules if m.startswith('npu_fsdp_patches'))))")
    loaded = json.loads(proc.stdout.splitlines()[-1])
    assert {layer_of(m) for m in loaded} <= {"base", "plan", "runtime", "api", "patches"}
    assert not [m for m in loaded if m.startswith("npu_fsdp_patches.patches.")]   # the package only
