"""Versions against gate bounds, by the release-segment rule (docs/design.md#341-versions-at-gate-edges).

A gate bound compares the release segment of the installed version: ``X.devN``, ``XaN``/``XbN``/
``XrcN``, ``X.postN`` and ``X+local`` all count as ``X``. The matrix's bounds are release numbers with
``>=``, ``<`` and the like, so activation decides with integer tuples and leaves packaging (a tenth of
activation to import) to the cases that need it: an epoch, a non-canonical version string, a ``~=``
or wildcard bound. Those go through ``packaging.specifiers.SpecifierSet``, which also validates every
bound when the matrix is parsed.
"""
from __future__ import annotations

import re
from typing import Iterator

#: canonical PEP 440 without epoch (what pip, torch, TE and friends write); anything else is parsed by packaging
_CANONICAL = re.compile(r"^(\d+(?:\.\d+)*)(?:(?:a|b|rc)\d+)?(?:\.post\d+)?(?:\.dev\d+)?(?:\+[a-z0-9]+(?:\.[a-z0-9]+)*)?$",
                        re.IGNORECASE)
_RELEASE_BOUND = re.compile(r"^(>=|<=|<|>|==|!=)(\d+(?:\.\d+)*)$")
_COMPARE = {">=": tuple.__ge__, "<=": tuple.__le__, "<": tuple.__lt__, ">": tuple.__gt__,
            "==": tuple.__eq__, "!=": tuple.__ne__}


def release_of(version: str) -> str:
    """The release segment of ``version`` (with its epoch, if any): ``2.14.0.dev0+g1`` -> ``2.14.0``.
    Raises ``packaging.version.InvalidVersion`` for a string that is not PEP 440."""
    match = _CANONICAL.match(version)
    if match:
        return match.group(1)
    from packaging.version import Version
    parsed = Version(version)
    release = ".".join(map(str, parsed.release))
    return f"{parsed.epoch}!{release}" if parsed.epoch else release


def _padded(release: tuple, length: int) -> tuple:
    return release + (0,) * (length - len(release))


class VersionBounds:
    """A gate's version specifier: ``str``, equality, iteration and ``contains`` as packaging's
    ``SpecifierSet`` (built on first need), and :meth:`holds_for` by the release-segment rule."""

    __slots__ = ("text", "_clauses", "_specifier_set")

    def __init__(self, text: str):
        self.text = text          # canonical (str of a validated SpecifierSet)
        clauses = [_RELEASE_BOUND.match(part.strip()) for part in text.split(",") if part.strip()]
        self._clauses = (tuple((m.group(1), tuple(int(p) for p in m.group(2).split("."))) for m in clauses)
                         if all(clauses) else None)
        self._specifier_set = None

    def specifier_set(self):
        if self._specifier_set is None:
            from packaging.specifiers import SpecifierSet
            self._specifier_set = SpecifierSet(self.text)
        return self._specifier_set

    def holds_for(self, release: str) -> bool:
        """Whether the release segment ``release`` (from :func:`release_of`) satisfies every bound."""
        if self._clauses is None or "!" in release:
            from packaging.version import Version
            return self.specifier_set().contains(Version(release), prereleases=True)
        have = tuple(int(p) for p in release.split("."))
        for op, bound in self._clauses:
            length = max(len(have), len(bound))
            if not _COMPARE[op](_padded(have, length), _padded(bound, length)):
                return False
        return True

    def contains(self, version, prereleases=None) -> bool:
        return self.specifier_set().contains(version, prereleases=prereleases)

    def __iter__(self) -> Iterator:
        return iter(self.specifier_set())

    def __len__(self) -> int:
        return len(self.specifier_set())

    def __str__(self) -> str:
        return self.text

    def __repr__(self) -> str:
        return f"<VersionBounds({self.text!r})>"

    def __eq__(self, other: object) -> bool:
        if isinstance(other, VersionBounds):
            return self.text == other.text
        if isinstance(other, str) and other == self.text:
            return True
        return self.specifier_set() == other

    def __hash__(self) -> int:
        return hash(self.text)
