"""Find installed frameworks and their versions from distribution metadata and files, never by import.

MindSpeed replaces ``importlib.metadata.version`` to claim transformer-engine 2.2.0
(docs/hyper_parallel.md#32-version-identity), so versions are read from each
distribution's own METADATA file (dists.py), never through that helper. Source checkouts without metadata (common for Megatron and
MindSpeed) are found with ``importlib.util.find_spec`` on the top-level name, which imports nothing
below it, and their version file is parsed statically.
"""
from __future__ import annotations

import importlib.util
import re
from pathlib import Path
from typing import Iterable, Mapping, NamedTuple

from . import dists
from .matrix import FrameworkSpec


class Detected(NamedTuple):
    name: str
    installed: bool
    distribution: str | None = None
    version: str | None = None
    location: str | None = None
    source: str = "not found"
    flavor: str | None = None
    flavor_rule: str | None = None
    commit: str | None = None
    note: str | None = None
    source_id: str | None = None    # what identifies a source tree: git branch/commit, or the install's VCS url

    def as_dict(self) -> dict:
        return self._asdict()


normalize = dists.normalize


def distribution_index() -> dict:
    """Map normalized distribution name -> first installed distribution in sys.path order."""
    return dists.installed()


def _module_dir(module: str | None) -> Path | None:
    """The folder of ``module`` (dotted names allowed), found without importing anything.

    ``find_spec`` on the top-level name imports nothing; the rest of a dotted name is looked up as
    folders in every location of that package, so a namespace package such as ``megatron`` (shared by
    megatron-core and megatron-energon) is searched across all its locations.
    """
    if not module:
        return None
    top, *rest = module.split(".")
    try:
        spec = importlib.util.find_spec(top)
    except (ImportError, ValueError):
        return None
    if spec is None:
        return None
    if not spec.submodule_search_locations:
        return Path(spec.origin).parent if spec.origin and not rest else None
    for location in spec.submodule_search_locations:
        folder = Path(location, *rest)
        if not rest or (folder / "__init__.py").is_file():
            return folder
    return None


def read_version_file(path: Path) -> str | None:
    """Parse ``__version__ = "x"`` or MAJOR/MINOR/PATCH[/PRE_RELEASE] assignments without executing."""
    import ast  # only source checkouts need it

    try:
        tree = ast.parse(path.read_text(encoding="utf-8"))
    except (OSError, SyntaxError, ValueError):
        return None
    values = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant):
            for target in node.targets:
                if isinstance(target, ast.Name):
                    values[target.id] = node.value.value
    if isinstance(values.get("__version__"), str):
        return values["__version__"]
    for node in ast.walk(tree):   # setup.py: setup(version="x") / setuptools.setup(version="x")
        if isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", None)) == "setup":
            for keyword in node.keywords:
                if keyword.arg == "version" and isinstance(keyword.value, ast.Constant) \
                        and isinstance(keyword.value.value, str):
                    return keyword.value.value
    if all(k in values for k in ("MAJOR", "MINOR", "PATCH")):
        return f"{values['MAJOR']}.{values['MINOR']}.{values['PATCH']}{values.get('PRE_RELEASE') or ''}"
    return None


def _dist_root(dist) -> Path | None:
    return Path(dist.root).resolve() if dist.root else None


def _flavor(spec: FrameworkSpec, dist, dist_name: str | None) -> tuple:
    """(flavor, the rule that decided). A default rule needs distribution metadata: a bare source tree
    is not evidence of any flavour, so its flavour stays unknown."""
    for i, rule in enumerate(spec.flavors):
        if rule.distribution_matches:
            if dist_name and re.search(rule.distribution_matches, dist_name, re.IGNORECASE):
                return rule.flavor, f"rule {i}: distribution name {dist_name!r} matches {rule.distribution_matches!r}"
        elif rule.ships_module:
            top = (dist.read_text("top_level.txt") or "").split() if dist is not None else []
            if rule.ships_module in top or _module_dir(rule.ships_module) is not None:
                return rule.flavor, f"rule {i}: module {rule.ships_module!r} is installed"
        elif dist is None:
            return None, "no distribution metadata: flavour unknown"
        else:
            return rule.flavor, f"rule {i}: default"
    return None, None


def _read_commit(root: Path | None, relative: str | None) -> str | None:
    if root is None or not relative:
        return None
    try:
        return (root / relative).read_text(encoding="utf-8").strip() or None
    except (OSError, ValueError):
        return None


def _extension_present(dist, needed: str) -> bool:
    """Whether the part ``needed`` (a distribution name) that a meta package needs is there without its
    own distribution: a source build ships it among the meta package's own files (TE's
    ``transformer_engine_torch*.so``), or its module is found on sys.path (find_spec of a top-level
    name imports nothing). The module name is the distribution's (``transformer-engine-torch`` ->
    ``transformer_engine_torch``)."""
    module = normalize(needed).replace("-", "_")
    for path in dist.files() or ():
        if path.rsplit("/", 1)[-1].startswith((module + ".", module + "/")) or f"/{module}/" in f"/{path}":
            return True
    return _module_dir(module) is not None


def _notes(*parts: str | None) -> str | None:
    return "; ".join(p for p in parts if p) or None


def _metadata_notes(dist) -> str | None:
    """What the reader of a version should know about its metadata: undecodable files, and a second
    metadata folder of the same distribution (the first, as importlib.metadata picks, is used)."""
    others = "".join(f" and {o.info_path} ({o.version or 'no version'})" for o in dist.others)
    return _notes(*dist.problems, f"several metadata folders for {dist.name}: {dist.info_path} "
                                  f"({dist.version}, used: first on sys.path, as importlib.metadata "
                                  f"reads it){others}; remove the stale one" if others else None)


def detect_framework(spec: FrameworkSpec, index: Mapping) -> Detected:
    """Detect one framework: metadata first, then a source checkout found on sys.path."""
    dist = next((index[normalize(n)] for n in spec.distributions if normalize(n) in index), None)
    module_dir = _module_dir(spec.module)
    depth = len(spec.module.split(".")) if spec.module else 1
    source_root = module_dir.parents[depth - 1] if module_dir is not None else None
    dist_root = _dist_root(dist) if dist is not None else None
    outside = (dist is not None and module_dir is not None and dist_root is not None
               and not str(module_dir.resolve()).startswith(str(dist_root)))
    source_version = (read_version_file(source_root / spec.source_version_file)   # a tree: parsed
                      if source_root is not None and spec.source_version_file and (dist is None or outside)
                      else None)
    shadowed = outside and source_version is not None and source_version != dist.version
    if dist is not None and not shadowed:
        name = dist.name
        needs = next((n for meta, n in spec.meta_packages.items() if normalize(meta) == normalize(name)), None)
        if needs and not any(normalize(d) in index or _extension_present(dist, d) for d in needs):
            # the registry's meta package ships the framework's Python files too (transformer-engine
            # 2.13.0: 181 files), yet it cannot be imported without the part it names
            return Detected(spec.name, False, name, dist.version, str(dist_root), "meta package only",
                            note=_notes(f"{name} {dist.version} is only the meta package: "
                                        f"{' or '.join(needs)} is not installed, so the framework "
                                        "cannot be imported", _metadata_notes(dist)))
        flavor, rule = _flavor(spec, dist, name)
        return Detected(spec.name, True, name, dist.version,
                        str(module_dir or dist_root), "metadata", flavor, rule,
                        _read_commit(source_root or dist_root, spec.commit_file), _metadata_notes(dist),
                        source_identity(source_root if outside else None, dist))
    if module_dir is None:
        return Detected(spec.name, False)
    flavor, rule = _flavor(spec, None, None)
    note = (f"imported from a source tree that shadows installed distribution "
            f"{dist.name} {dist.version}" if shadowed else None)
    if spec.flavors and flavor is None:
        note = _notes(note, f"flavour unknown: no distribution metadata for {module_dir}; "
                            "patches gated on a flavour stay off")
    source = "source-tree version file" if source_version else "find_spec (no version found)"
    return Detected(spec.name, True, None, source_version, str(module_dir), source, flavor, rule,
                    _read_commit(source_root, spec.commit_file), note, source_identity(source_root, None))


def source_identity(source_root: Path | None, dist) -> str | None:
    """What tells two source trees of one version apart (MindSpeed says 0.12.1 on master and on
    core_r0.18.0): the git branch and commit of the tree, else the VCS url and commit pip recorded in
    the distribution's direct_url.json (PEP 610). Read from files; git is never run."""
    from . import git_tree   # only a tree with a .git or a dist with direct_url.json pays for it
    found = git_tree.describe(source_root) if source_root is not None else None
    if found is None and dist is not None:
        found = git_tree.from_direct_url(dist.read_text("direct_url.json"))
    return found


def detect_all(specs: Iterable[FrameworkSpec]) -> dict:
    specs = list(specs)
    index = distribution_index()
    return {spec.name: detect_framework(spec, index) for spec in specs}
