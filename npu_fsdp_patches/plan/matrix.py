"""Load and validate compat_matrix.yaml into immutable specs; errors carry file, key path and line."""
from __future__ import annotations

import os
import re
import stat
from pathlib import Path
from typing import Any, Mapping, NamedTuple

from ..errors import MatrixError
from .versions import VersionBounds

SCHEMA_VERSION = 1
#: bounds that keep a hostile or broken matrix from hanging `import torch` (YAML alias bombs)
MAX_MATRIX_BYTES = 1 << 20
MAX_NODES = 20_000
MAX_DEPTH = 32
SHIPPED_MATRIX = Path(__file__).resolve().parent.parent / "compat_matrix.yaml"   # the package root's
_TARGET = re.compile(r"^(?P<module>[A-Za-z_][\w.]*):(?P<qualname>[A-Za-z_][\w.]*)(?P<optional>\?)?$")
_TOP_KEYS = {"schema_version", "defaults", "frameworks", "patches"}
_DEFAULTS_KEYS = {"gate", "verified"}
_FRAMEWORK_KEYS = {"distributions", "module", "flavors", "source_version_file", "commit_file", "meta_packages",
                   "depends_on", "environment"}
_FLAVOR_KEYS = {"flavor", "distribution_matches", "ships_module"}
_PATCH_KEYS = {"summary", "targets", "gate", "stand_down_probe", "verified", "upstream", "facts", "why"}
_CONDITION_KEYS = {"installed", "version", "flavor", "note"}
_UPSTREAM_KEYS = {"fix", "issues", "notes"}


class Target(NamedTuple):
    module: str
    qualname: str
    optional: bool = False

    @property
    def symbol(self) -> str:
        return f"{self.module}:{self.qualname}"


class Condition(NamedTuple):
    framework: str
    installed: bool = True
    version: VersionBounds | None = None   # a validated PEP 440 specifier (versions.py)
    flavor: str | None = None
    note: str | None = None          # what the patch does differently where this condition holds


class FlavorRule(NamedTuple):
    flavor: str
    distribution_matches: str | None = None
    ships_module: str | None = None


class FrameworkSpec(NamedTuple):
    name: str
    distributions: tuple = ()
    module: str | None = None
    flavors: tuple = ()
    source_version_file: str | None = None
    commit_file: str | None = None
    meta_packages: Mapping[str, tuple] = {}   # meta distribution -> distributions, one of which must be there
    depends_on: tuple = ()      # distributions whose versions decide whether it imports and runs (report lists them)
    environment: tuple = ()     # environment variables that decide what it imports (doctor and report record them)


class PatchSpec(NamedTuple):
    name: str
    summary: str
    targets: tuple
    gate: tuple  # alternatives; each a tuple of Conditions that must all hold
    stand_down_probe: str | None = None
    verified: Mapping[str, tuple] = {}
    upstream: Mapping[str, Any] = {}
    facts: str = ""
    why: str = ""                # why the gate's edges and the targets are where they are

    @property
    def target_modules(self) -> tuple:
        return tuple(dict.fromkeys(t.module for t in self.targets))


class PatchDefaults(NamedTuple):
    """The matrix's ``defaults:``, already merged into every PatchSpec: one condition per framework
    that every gate alternative must also meet, and the verified versions of a framework a patch does
    not list itself (the torch floor and the verified torch live there once)."""
    gate: tuple = ()                      # Conditions
    verified: Mapping[str, tuple] = {}

    def condition(self, framework: str) -> Condition | None:
        return next((c for c in self.gate if c.framework == framework), None)


class Matrix(NamedTuple):
    path: str
    frameworks: Mapping[str, FrameworkSpec]
    patches: Mapping[str, PatchSpec]
    lines: Mapping[str, int] = {}
    defaults: PatchDefaults = PatchDefaults()

    def error(self, key_path: str, message: str) -> MatrixError:
        return MatrixError(message, path=self.path, key_path=key_path, line=self.lines.get(key_path))


class _Reader:
    """Turns the composed YAML node tree into plain data while remembering each key path's line.

    Aliases are expanded here, so the number of nodes and the depth are bounded (an alias bomb is
    rejected instead of hanging the import); duplicate keys and non-string keys are rejected.
    """

    def __init__(self, path: str):
        import yaml   # activation reads the validated cache of the shipped matrix (matrix_cache.py)
        self.path = path
        self.lines: dict = {}
        self._scalars = yaml.constructor.SafeConstructor()
        self._yaml = yaml
        self._nodes = 0

    def to_data(self, node: "yaml.Node", key_path: str, depth: int = 0) -> Any:
        yaml = self._yaml
        self._nodes += 1
        if self._nodes > MAX_NODES or depth > MAX_DEPTH:
            raise MatrixError(f"more than {MAX_NODES} nodes or {MAX_DEPTH} levels after alias expansion "
                              "(an alias bomb?)", path=self.path, key_path=key_path,
                              line=node.start_mark.line + 1)
        self.lines.setdefault(key_path, node.start_mark.line + 1)
        if isinstance(node, yaml.MappingNode):
            out = {}
            for key_node, value_node in node.value:
                key = self._scalars.construct_object(key_node, deep=True)
                line = key_node.start_mark.line + 1
                if not isinstance(key, str):
                    raise MatrixError(f"keys must be strings, got {type(key).__name__} {key!r}",
                                      path=self.path, key_path=key_path, line=line)
                child = f"{key_path}.{key}" if key_path else key
                if key in out:
                    raise MatrixError(f"duplicate key {key!r} (first at line {self.lines[child]})",
                                      path=self.path, key_path=child, line=line)
                self.lines[child] = line
                out[key] = self.to_data(value_node, child, depth + 1)
            return out
        if isinstance(node, yaml.SequenceNode):
            return [self.to_data(item, f"{key_path}[{i}]", depth + 1) for i, item in enumerate(node.value)]
        return self._scalars.construct_object(node, deep=True)

    def fail(self, key_path: str, message: str) -> MatrixError:
        return MatrixError(message, path=self.path, key_path=key_path, line=self.lines.get(key_path))

    def expect(self, value: Any, kind: type, key_path: str, what: str) -> Any:
        if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            raise self.fail(key_path, f"expected {what}, got {type(value).__name__} {value!r}")
        return value

    def string(self, mapping: dict, key: str, key_path: str, default: Any = None) -> Any:
        """mapping[key] as a string (a missing or null key gives ``default``)."""
        value = mapping.get(key)
        if value is None:
            return default
        return self.expect(value, str, f"{key_path}.{key}", "a string (quote numbers)")

    def strings(self, value: Any, key_path: str) -> tuple:
        """A list of strings (null gives an empty tuple)."""
        items = self.expect(value if value is not None else [], list, key_path, "a list of strings")
        return tuple(self.expect(v, str, f"{key_path}[{i}]", "a string (quote numbers)")
                     for i, v in enumerate(items))

    def mapping(self, value: Any, key_path: str, what: str = "a mapping") -> dict:
        return self.expect(value if value is not None else {}, dict, key_path, what)

    def keys(self, mapping: dict, allowed: set, key_path: str, required: tuple = ()) -> None:
        for key in mapping:
            if key not in allowed:
                raise self.fail(f"{key_path}.{key}", f"unknown key {key!r}; allowed: {', '.join(sorted(allowed))}")
        for key in required:
            if key not in mapping:
                raise self.fail(key_path, f"missing required key {key!r}")


def _reject_tags(text: str, path: str) -> None:
    """Tags (``!!python/...``, ``!foo``, ``!!str``) have no meaning in the matrix: refuse them all."""
    import yaml
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    for event in yaml.parse(text, Loader=loader):
        tag = getattr(event, "tag", None)
        if tag is not None:
            raise MatrixError(f"YAML tag {tag!r} is not allowed in the matrix", path=path,
                              line=event.start_mark.line + 1)


def _framework(r: _Reader, name: str, raw: Any, kp: str) -> FrameworkSpec:
    r.expect(raw, dict, kp, "a mapping")
    r.keys(raw, _FRAMEWORK_KEYS, kp)
    flavors = []
    for i, rule in enumerate(r.expect(raw.get("flavors") or [], list, f"{kp}.flavors", "a list")):
        rkp = f"{kp}.flavors[{i}]"
        r.expect(rule, dict, rkp, "a mapping")
        r.keys(rule, _FLAVOR_KEYS, rkp, required=("flavor",))
        pattern = r.string(rule, "distribution_matches", rkp)
        if pattern:
            try:
                re.compile(pattern)
            except re.error as exc:
                raise r.fail(f"{rkp}.distribution_matches", f"bad regular expression: {exc}") from None
        flavors.append(FlavorRule(r.string(rule, "flavor", rkp), pattern, r.string(rule, "ships_module", rkp)))
    module = r.string(raw, "module", kp)
    if module is not None and not re.match(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)*$", module):
        raise r.fail(f"{kp}.module", f"bad module name {module!r}")
    meta = {dist: r.strings(needs, f"{kp}.meta_packages.{dist}")
            for dist, needs in r.mapping(raw.get("meta_packages"), f"{kp}.meta_packages").items()}
    return FrameworkSpec(name, r.strings(raw.get("distributions"), f"{kp}.distributions"), module,
                         tuple(flavors), r.string(raw, "source_version_file", kp),
                         r.string(raw, "commit_file", kp), meta,
                         r.strings(raw.get("depends_on"), f"{kp}.depends_on"),
                         r.strings(raw.get("environment"), f"{kp}.environment"))


def _condition(r: _Reader, framework: str, raw: Any, kp: str, frameworks: Mapping) -> Condition:
    if framework not in frameworks:
        raise r.fail(kp, f"unknown framework {framework!r}; known: {', '.join(sorted(frameworks))}")
    r.expect(raw, dict, kp, "a mapping of installed/version/flavor/note")
    r.keys(raw, _CONDITION_KEYS, kp)
    installed = raw.get("installed", True)
    if not isinstance(installed, bool):
        raise r.fail(f"{kp}.installed", "expected true or false")
    version, text = None, r.string(raw, "version", kp)
    if text is not None:
        from packaging.specifiers import InvalidSpecifier, SpecifierSet
        try:
            version = VersionBounds(str(SpecifierSet(text)))
        except InvalidSpecifier:
            raise r.fail(f"{kp}.version", f"bad PEP 440 specifier {text!r}") from None
    return Condition(framework, installed, version, r.string(raw, "flavor", kp), r.string(raw, "note", kp))


def _verified(r: _Reader, raw: Any, kp: str, frameworks: Mapping) -> dict:
    """framework -> versions. A framework with flavours lists them per flavour
    (``{npu: ["0.1.0"], nvidia: ["2.13.0"]}``), kept as ``"0.1.0 [npu]"`` (verified_entry): TENPU 0.1.0
    and an NVIDIA TE 0.1.0 are different code. A plain list matches every flavour. A version the suite
    ran only as a test stand-in (a package it cannot install) is written ``"0.1.0 (stand-in)"``."""
    verified = {}
    for fw, versions in r.mapping(raw, kp).items():
        if fw not in frameworks:
            raise r.fail(f"{kp}.{fw}", f"unknown framework {fw!r}")
        if isinstance(versions, dict):
            known = {rule.flavor for rule in frameworks[fw].flavors}
            entries = []
            for flavor, listed in versions.items():
                if flavor not in known:
                    raise r.fail(f"{kp}.{fw}.{flavor}", f"unknown flavour {flavor!r} of {fw}; known: "
                                                        f"{', '.join(sorted(known)) or 'none'}")
                entries += [verified_entry(*_stand_in(v), flavor) for v in r.strings(listed, f"{kp}.{fw}.{flavor}")]
            verified[fw] = tuple(entries)
            continue
        listed = r.strings(r.expect(versions, list, f"{kp}.{fw}", "a list or a mapping of flavour: list"),
                           f"{kp}.{fw}")
        verified[fw] = tuple(verified_entry(*_stand_in(v), None) for v in listed)
    return verified


#: how the matrix marks a verified version that the suite ran only as a stand-in
STAND_IN = " (stand-in)"


def _stand_in(listed: str) -> tuple:
    """(version, ran only as a stand-in?) of one listed verified version."""
    return (listed[:-len(STAND_IN)], True) if listed.endswith(STAND_IN) else (listed, False)


def verified_entry(version: str, stand_in: bool, flavor: str | None) -> str:
    """How a verified version of one flavour is kept and shown: ``2.13.0 [nvidia]``, ``0.1.0 [npu] (stand-in)``."""
    return (f"{version} [{flavor}]" if flavor else version) + (STAND_IN if stand_in else "")


def _defaults(r: _Reader, raw: Any, frameworks: Mapping) -> PatchDefaults:
    raw = r.mapping(raw, "defaults")
    r.keys(raw, _DEFAULTS_KEYS, "defaults")
    gate = r.mapping(raw.get("gate"), "defaults.gate", "a mapping of framework: condition")
    conditions = tuple(_condition(r, fw, cond, f"defaults.gate.{fw}", frameworks) for fw, cond in gate.items())
    return PatchDefaults(conditions, _verified(r, raw.get("verified"), "defaults.verified", frameworks))


def _both(default: VersionBounds | None, own: VersionBounds | None) -> VersionBounds | None:
    """The versions both sets allow; a default lower bound that one of ``own`` already implies is
    left out, so a gate reads ``>=2.7``, not ``>=2.6,>=2.7``."""
    if default is None or own is None:
        return own if default is None else default
    from packaging.specifiers import SpecifierSet
    from packaging.version import Version
    floors = [Version(s.version) for s in own if s.operator in (">=", ">")]
    kept = [s for s in default if not (s.operator == ">=" and any(f >= Version(s.version) for f in floors))]
    return VersionBounds(str(SpecifierSet(",".join(str(s) for s in (*own, *kept)))))


def _with_defaults(r: _Reader, alternative: tuple, defaults: tuple, kp: str) -> tuple:
    """One gate alternative that also meets every defaults.gate condition: a framework the alternative
    names itself gets both version sets (its own flavor and note), any other gets the default's."""
    own = {c.framework: c for c in alternative}
    merged = []
    for default in defaults:
        cond = own.get(default.framework)
        if cond is None:
            merged.append(default)
            continue
        flavors = {cond.flavor, default.flavor} - {None}
        if cond.installed != default.installed or len(flavors) > 1:
            raise r.fail(f"{kp}.{cond.framework}", f"contradicts defaults.gate.{cond.framework}")
        own[cond.framework] = cond._replace(version=_both(default.version, cond.version),
                                            flavor=next(iter(flavors), None), note=cond.note or default.note)
    return (*own.values(), *merged)


def _patch(r: _Reader, name: str, raw: Any, kp: str, frameworks: Mapping,
           defaults: PatchDefaults = PatchDefaults()) -> PatchSpec:
    r.expect(raw, dict, kp, "a mapping")
    r.keys(raw, _PATCH_KEYS, kp, required=("summary", "targets", "gate"))
    targets = []
    for i, text in enumerate(r.strings(r.expect(raw["targets"], list, f"{kp}.targets", "a list"), f"{kp}.targets")):
        match = _TARGET.match(text)
        if not match:
            raise r.fail(f"{kp}.targets[{i}]", f"bad target {text!r}; expected 'module.path:Qual.name' (optional '?')")
        targets.append(Target(match["module"], match["qualname"], bool(match["optional"])))
    if not targets:
        raise r.fail(f"{kp}.targets", "a patch needs at least one target")
    gate = []
    for i, alternative in enumerate(r.expect(raw["gate"], list, f"{kp}.gate", "a list of alternatives")):
        akp = f"{kp}.gate[{i}]"
        r.expect(alternative, dict, akp, "a mapping of framework: condition")
        own = tuple(_condition(r, fw, cond, f"{akp}.{fw}", frameworks) for fw, cond in alternative.items())
        gate.append(_with_defaults(r, own, defaults.gate, akp))
    verified = {**defaults.verified, **_verified(r, raw.get("verified"), f"{kp}.verified", frameworks)}
    upstream = r.mapping(raw.get("upstream"), f"{kp}.upstream")
    r.keys(upstream, _UPSTREAM_KEYS, f"{kp}.upstream")
    for key in ("fix", "notes"):
        r.string(upstream, key, f"{kp}.upstream")
    if "issues" in upstream:
        r.strings(upstream["issues"], f"{kp}.upstream.issues")
    probe = r.string(raw, "stand_down_probe", kp)
    if probe is not None and not probe.isidentifier():
        raise r.fail(f"{kp}.stand_down_probe", f"expected a method name, got {probe!r}")
    return PatchSpec(name, r.string(raw, "summary", kp, ""), tuple(targets), tuple(gate), probe,
                     verified, upstream, r.string(raw, "facts", kp, ""), r.string(raw, "why", kp, ""))


def parse_matrix(text: str, path: str = "<string>") -> Matrix:
    """Validate matrix text; raise MatrixError with file, key path and line on any problem."""
    r = _Reader(path)
    if len(text) > MAX_MATRIX_BYTES:
        raise MatrixError(f"matrix is larger than {MAX_MATRIX_BYTES} bytes", path=path)
    import yaml
    try:
        _reject_tags(text, path)
        root = yaml.compose(text, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        raise MatrixError(f"YAML error: {getattr(exc, 'problem', None) or exc}", path=path,
                          line=mark.line + 1 if mark else None) from None
    if root is None:
        raise MatrixError("empty matrix", path=path)
    data = r.expect(r.to_data(root, ""), dict, "", "a mapping at the top level")
    r.keys(data, _TOP_KEYS, "", required=("schema_version", "frameworks", "patches"))
    r.expect(data["schema_version"], int, "schema_version", "an integer")
    if data["schema_version"] != SCHEMA_VERSION:
        raise r.fail("schema_version", f"unsupported schema_version {data['schema_version']!r}; "
                                       f"this plugin reads {SCHEMA_VERSION}")
    frameworks = {name: _framework(r, name, raw, f"frameworks.{name}")
                  for name, raw in r.expect(data["frameworks"], dict, "frameworks", "a mapping").items()}
    defaults = _defaults(r, data.get("defaults"), frameworks)
    patches = {name: _patch(r, name, raw, f"patches.{name}", frameworks, defaults)
               for name, raw in r.expect(data["patches"] or {}, dict, "patches", "a mapping").items()}
    return Matrix(path, frameworks, patches, dict(r.lines), defaults)


#: the NamedTuples of a Matrix: the cache decodes these and no other type (matrix_cache.py)
_CACHED_TYPES = (Target, Condition, FlavorRule, FrameworkSpec, PatchSpec, PatchDefaults, Matrix)


def load_matrix(path: str | Path | None = None) -> Matrix:
    """Read the given matrix file, or the shipped one."""
    if not path:
        from . import matrix_cache
        return matrix_cache.load(shipped_text(), str(SHIPPED_MATRIX), parse_matrix, _CACHED_TYPES, __file__)
    file = Path(path)
    try:
        text = _read_regular_file(file).decode("utf-8")
    except UnicodeDecodeError as exc:
        raise MatrixError(f"cannot read matrix: not UTF-8 ({exc.reason})", path=str(file)) from None
    except OSError as exc:
        raise MatrixError(f"cannot read matrix: {exc.strerror or exc}", path=str(file)) from None
    return parse_matrix(text, str(file))


def _read_regular_file(file: Path) -> bytes:
    """The bytes of a regular file, opened without blocking: a FIFO or a device named by
    NPU_FSDP_PATCHES_MATRIX (``/dev/full``, ``/dev/zero``) would hang every ``import torch``."""
    fd = os.open(file, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise MatrixError("cannot read matrix: not a regular file", path=str(file))
        if st.st_size > MAX_MATRIX_BYTES:
            raise MatrixError(f"matrix is larger than {MAX_MATRIX_BYTES} bytes", path=str(file))
        with os.fdopen(os.dup(fd), "rb") as fh:
            return fh.read(MAX_MATRIX_BYTES + 1)
    finally:
        os.close(fd)


def shipped_text() -> str:
    """The shipped matrix's text; through the package's loader (importlib.resources) where it is not a
    plain file, so a plugin imported from a wheel or zip on sys.path reads it too."""
    try:
        if SHIPPED_MATRIX.is_file():   # an installed or checked-out package: no need for importlib.resources
            return SHIPPED_MATRIX.read_text(encoding="utf-8")
        from importlib.resources import files   # a zip or wheel on sys.path (costs 2 ms to import)
        return files(__package__.rpartition(".")[0]).joinpath(SHIPPED_MATRIX.name).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise MatrixError(f"cannot read the shipped matrix: {exc}", path=str(SHIPPED_MATRIX)) from None
