"""Print a stack page's command blocks, so CI runs exactly what the page says (issue 41).

Each page of docs/integrations/ starts with "## Install" and "## Check". The first ```bash block under
"## Install" is the install (run in a fresh venv, activated, from a checkout of this repository); the
first ```bash block under "## Check" proves it works; the first ```text block under "## Check" holds
lines the check prints when it works, each of which must appear in its output.

    python3 .ci/page_blocks.py PAGE install|check|expect
"""
from __future__ import annotations

import re
import sys
from pathlib import Path

SECTIONS = {"install": ("Install", "bash"), "check": ("Check", "bash"), "expect": ("Check", "text")}


def block(page: Path, which: str) -> str:
    """The first ``lang`` code block under the page's ``## heading``; raises naming what is missing."""
    heading, lang = SECTIONS[which]
    text = page.read_text(encoding="utf-8")
    section = re.search(rf"^## {heading}\s*$(.*?)(?=^## |\Z)", text, re.M | re.S)
    if section is None:
        raise SystemExit(f"{page}: no '## {heading}' section")
    found = re.search(rf"^```{lang}\s*$\n(.*?)^```\s*$", section.group(1), re.M | re.S)
    if found is None:
        raise SystemExit(f"{page}: no ```{lang} block under '## {heading}'")
    return found.group(1)


if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[2] not in SECTIONS:
        raise SystemExit(__doc__)
    sys.stdout.write(block(Path(sys.argv[1]), sys.argv[2]))
