"""Identify a framework's source tree by its git branch and commit, read from files (git is never run).

Versions do not tell source trees apart: MindSpeed's setup.py says 0.12.1 on master and on
core_r0.18.0 alike. The ``.git`` folder (or a worktree's ``.git`` file) names the branch and commit;
an install from a VCS url keeps both in the distribution's ``direct_url.json`` (PEP 610).
"""
from __future__ import annotations

import os
from pathlib import Path


def _text(path: Path) -> str | None:
    try:
        return path.read_text(encoding="utf-8", errors="replace").strip()
    except OSError:
        return None


def _git_dir(root: Path) -> Path | None:
    dot = root / ".git"
    if dot.is_dir():
        return dot
    pointer = _text(dot) if dot.is_file() else None          # a worktree or submodule: "gitdir: <path>"
    if pointer and pointer.startswith("gitdir:"):
        return (root / pointer[len("gitdir:"):].strip()).resolve()
    return None


def _resolve_ref(git_dir: Path, ref: str) -> str | None:
    common = _text(git_dir / "commondir")
    for folder in (git_dir, (git_dir / common).resolve() if common else None):
        if folder is None:
            continue
        loose = _text(folder / ref)
        if loose:
            return loose
        for line in (_text(folder / "packed-refs") or "").splitlines():
            sha, _, name = line.partition(" ")
            if name == ref:
                return sha
    return None


def describe(root: Path) -> str | None:
    """``git <commit> (branch <name>)`` for the checkout at ``root``, or None without a .git."""
    git_dir = _git_dir(root)
    head = _text(git_dir / "HEAD") if git_dir is not None else None
    if not head:
        return None
    if head.startswith("ref:"):
        ref = head[len("ref:"):].strip()
        commit = _resolve_ref(git_dir, ref)
        branch = ref[len("refs/heads/"):] if ref.startswith("refs/heads/") else ref
        return f"git {commit or '(no commit yet)'} (branch {branch})"
    return f"git {head} (detached HEAD)"


def from_direct_url(text: str | None) -> str | None:
    """``<vcs>+<url> <commit> (requested <rev>)`` from a direct_url.json, or the editable source folder."""
    if not text:
        return None
    import json   # only distributions installed from a url have the file
    try:
        data = json.loads(text)
    except ValueError:
        return None
    if not isinstance(data, dict):
        return None
    vcs = data.get("vcs_info")
    if isinstance(vcs, dict) and vcs.get("commit_id"):
        requested = f" (requested {vcs['requested_revision']})" if vcs.get("requested_revision") else ""
        return f"{vcs.get('vcs', 'vcs')}+{data.get('url')} {vcs['commit_id']}{requested}"
    url = str(data.get("url") or "")
    if isinstance(data.get("dir_info"), dict) and url.startswith("file://"):
        folder = Path(url[len("file://"):])
        return describe(folder) or f"source folder {os.fspath(folder)}"
    return None
