"""Load and validate compat_matrix.yaml into immutable specs; errors carry file, key path and line."""
from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Mapping, NamedTuple

import yaml
from packaging.specifiers import InvalidSpecifier, SpecifierSet

from .errors import MatrixError

SCHEMA_VERSION = 1
SHIPPED_MATRIX = Path(__file__).resolve().parent / "compat_matrix.yaml"
_TARGET = re.compile(r"^(?P<module>[A-Za-z_][\w.]*):(?P<qualname>[A-Za-z_][\w.]*)(?P<optional>\?)?$")
_TOP_KEYS = {"schema_version", "frameworks", "patches"}
_FRAMEWORK_KEYS = {"distributions", "module", "flavors", "source_version_file", "commit_file"}
_FLAVOR_KEYS = {"flavor", "distribution_matches", "ships_module"}
_PATCH_KEYS = {"summary", "targets", "gate", "stand_down_probe", "verified", "upstream", "facts"}
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
    version: SpecifierSet | None = None
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


class PatchSpec(NamedTuple):
    name: str
    summary: str
    targets: tuple
    gate: tuple  # alternatives; each a tuple of Conditions that must all hold
    stand_down_probe: str | None = None
    verified: Mapping[str, tuple] = {}
    upstream: Mapping[str, Any] = {}
    facts: str = ""

    @property
    def target_modules(self) -> tuple:
        return tuple(dict.fromkeys(t.module for t in self.targets))


class Matrix(NamedTuple):
    path: str
    frameworks: Mapping[str, FrameworkSpec]
    patches: Mapping[str, PatchSpec]
    lines: Mapping[str, int] = {}

    def error(self, key_path: str, message: str) -> MatrixError:
        return MatrixError(message, path=self.path, key_path=key_path, line=self.lines.get(key_path))


class _Reader:
    """Turns the composed YAML node tree into plain data while remembering each key path's line."""

    def __init__(self, path: str):
        self.path = path
        self.lines: dict = {}
        self._scalars = yaml.constructor.SafeConstructor()

    def to_data(self, node: yaml.Node, key_path: str) -> Any:
        self.lines.setdefault(key_path, node.start_mark.line + 1)
        if isinstance(node, yaml.MappingNode):
            out = {}
            for key_node, value_node in node.value:
                key = self._scalars.construct_object(key_node, deep=True)
                child = f"{key_path}.{key}" if key_path else str(key)
                self.lines[child] = key_node.start_mark.line + 1
                out[key] = self.to_data(value_node, child)
            return out
        if isinstance(node, yaml.SequenceNode):
            return [self.to_data(item, f"{key_path}[{i}]") for i, item in enumerate(node.value)]
        return self._scalars.construct_object(node, deep=True)

    def fail(self, key_path: str, message: str) -> MatrixError:
        return MatrixError(message, path=self.path, key_path=key_path, line=self.lines.get(key_path))

    def expect(self, value: Any, kind: type, key_path: str, what: str) -> Any:
        if not isinstance(value, kind):
            raise self.fail(key_path, f"expected {what}, got {type(value).__name__}")
        return value

    def keys(self, mapping: dict, allowed: set, key_path: str, required: tuple = ()) -> None:
        for key in mapping:
            if key not in allowed:
                raise self.fail(f"{key_path}.{key}", f"unknown key {key!r}; allowed: {', '.join(sorted(allowed))}")
        for key in required:
            if key not in mapping:
                raise self.fail(key_path, f"missing required key {key!r}")


def _framework(r: _Reader, name: str, raw: Any, kp: str) -> FrameworkSpec:
    r.expect(raw, dict, kp, "a mapping")
    r.keys(raw, _FRAMEWORK_KEYS, kp)
    flavors = []
    for i, rule in enumerate(raw.get("flavors") or []):
        rkp = f"{kp}.flavors[{i}]"
        r.expect(rule, dict, rkp, "a mapping")
        r.keys(rule, _FLAVOR_KEYS, rkp, required=("flavor",))
        if rule.get("distribution_matches"):
            try:
                re.compile(rule["distribution_matches"])
            except re.error as exc:
                raise r.fail(f"{rkp}.distribution_matches", f"bad regular expression: {exc}") from None
        flavors.append(FlavorRule(str(rule["flavor"]), rule.get("distribution_matches"), rule.get("ships_module")))
    dists = tuple(str(d) for d in r.expect(raw.get("distributions") or [], list, f"{kp}.distributions", "a list"))
    return FrameworkSpec(name, dists, raw.get("module"), tuple(flavors),
                         raw.get("source_version_file"), raw.get("commit_file"))


def _condition(r: _Reader, framework: str, raw: Any, kp: str, frameworks: Mapping) -> Condition:
    if framework not in frameworks:
        raise r.fail(kp, f"unknown framework {framework!r}; known: {', '.join(sorted(frameworks))}")
    r.expect(raw, dict, kp, "a mapping of installed/version/flavor/note")
    r.keys(raw, _CONDITION_KEYS, kp)
    installed = raw.get("installed", True)
    if not isinstance(installed, bool):
        raise r.fail(f"{kp}.installed", "expected true or false")
    version = None
    if raw.get("version") is not None:
        try:
            version = SpecifierSet(str(raw["version"]))
        except InvalidSpecifier:
            raise r.fail(f"{kp}.version", f"bad PEP 440 specifier {raw['version']!r}") from None
    note = raw.get("note")
    if note is not None and not isinstance(note, str):
        raise r.fail(f"{kp}.note", "expected a string")
    return Condition(framework, installed, version, raw.get("flavor"), note)


def _patch(r: _Reader, name: str, raw: Any, kp: str, frameworks: Mapping) -> PatchSpec:
    r.expect(raw, dict, kp, "a mapping")
    r.keys(raw, _PATCH_KEYS, kp, required=("summary", "targets", "gate"))
    targets = []
    for i, text in enumerate(r.expect(raw["targets"], list, f"{kp}.targets", "a list")):
        match = _TARGET.match(str(text))
        if not match:
            raise r.fail(f"{kp}.targets[{i}]", f"bad target {text!r}; expected 'module.path:Qual.name' (optional '?')")
        targets.append(Target(match["module"], match["qualname"], bool(match["optional"])))
    if not targets:
        raise r.fail(f"{kp}.targets", "a patch needs at least one target")
    gate = []
    for i, alternative in enumerate(r.expect(raw["gate"], list, f"{kp}.gate", "a list of alternatives")):
        akp = f"{kp}.gate[{i}]"
        r.expect(alternative, dict, akp, "a mapping of framework: condition")
        gate.append(tuple(_condition(r, fw, cond, f"{akp}.{fw}", frameworks) for fw, cond in alternative.items()))
    verified = {}
    for fw, versions in r.expect(raw.get("verified") or {}, dict, f"{kp}.verified", "a mapping").items():
        if fw not in frameworks:
            raise r.fail(f"{kp}.verified.{fw}", f"unknown framework {fw!r}")
        verified[fw] = tuple(str(v) for v in r.expect(versions, list, f"{kp}.verified.{fw}", "a list"))
    upstream = r.expect(raw.get("upstream") or {}, dict, f"{kp}.upstream", "a mapping")
    r.keys(upstream, _UPSTREAM_KEYS, f"{kp}.upstream")
    return PatchSpec(name, str(raw["summary"]), tuple(targets), tuple(gate), raw.get("stand_down_probe"),
                     verified, upstream, str(raw.get("facts") or ""))


def parse_matrix(text: str, path: str = "<string>") -> Matrix:
    """Validate matrix text; raise MatrixError with file, key path and line on any problem."""
    r = _Reader(path)
    try:
        root = yaml.compose(text, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        raise MatrixError(f"YAML error: {getattr(exc, 'problem', None) or exc}", path=path,
                          line=mark.line + 1 if mark else None) from None
    if root is None:
        raise MatrixError("empty matrix", path=path)
    data = r.expect(r.to_data(root, ""), dict, "", "a mapping at the top level")
    r.keys(data, _TOP_KEYS, "", required=("schema_version", "frameworks", "patches"))
    data = {k: v for k, v in data.items()}
    if data["schema_version"] != SCHEMA_VERSION:
        raise r.fail("schema_version", f"unsupported schema_version {data['schema_version']!r}; "
                                       f"this plugin reads {SCHEMA_VERSION}")
    frameworks = {name: _framework(r, name, raw, f"frameworks.{name}")
                  for name, raw in r.expect(data["frameworks"], dict, "frameworks", "a mapping").items()}
    patches = {name: _patch(r, name, raw, f"patches.{name}", frameworks)
               for name, raw in r.expect(data["patches"] or {}, dict, "patches", "a mapping").items()}
    return Matrix(path, frameworks, patches, dict(r.lines))


def load_matrix(path: str | Path | None = None) -> Matrix:
    """Read the given matrix file, or the shipped one."""
    file = Path(path) if path else SHIPPED_MATRIX
    try:
        text = file.read_text(encoding="utf-8")
    except OSError as exc:
        raise MatrixError(f"cannot read matrix: {exc.strerror or exc}", path=str(file)) from None
    return parse_matrix(text, str(file))
