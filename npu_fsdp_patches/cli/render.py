"""Human text for doctor, explain and list; every line fits in 100 columns. Doctor wraps a long value
onto continuation lines and never cuts one (a path stays whole where a line can hold it)."""
from __future__ import annotations

import re
import textwrap
from typing import Iterable

from ..plan.decide import check_condition
from ..plan.matrix import Condition, PatchSpec

WIDTH = 100


def fit(text: str, width: int = WIDTH) -> str:
    return text if len(text) <= width else text[: width - 1] + "…"


#: where a value that does not fit on its row continues (as in :func:`_row` when the column is too narrow)
VALUE_INDENT = " " * 6


def _value(head: str, value: str | None) -> list:
    """``head`` then a value that must stay whole to be copied (a path): on the row when it fits, else
    whole on the next line; only a value longer than that line is split, after a ``/``. Never cut."""
    value = value or "-"
    if len(head) + len(value) <= WIDTH:
        return [head + value]
    width = WIDTH - len(VALUE_INDENT)
    # pieces end at a "/"; one name longer than a line is split too, still with nothing dropped
    pieces = [p[i:i + width] for p in re.findall(r"[^/]*/|[^/]+", value) for i in range(0, len(p), width)]
    lines = [""]
    for piece in pieces:
        if lines[-1] and len(lines[-1]) + len(piece) > width:
            lines.append("")
        lines[-1] += piece
    return [head.rstrip()] + [VALUE_INDENT + line for line in lines]


def _why(record: dict) -> str:
    """What the reader needs after the state: the error, the stand-down, or the decision reason."""
    if record["state"] == "failed" and record["error"]:
        return record["error"]
    if record["state"] == "skipped" and record.get("note"):
        return record["note"]
    return record["reason"]


def _code_lines(patches: list) -> list:
    """Where the patch code comes from, once: one line for the built-ins, then each patch whose code
    comes from a third-party entry point (or from nowhere) on its own line."""
    builtin = sorted({f"{p['distribution']} {p['version']}" for r in patches
                      if (p := r.get("provenance")) and p["builtin"]})
    others = not all((r.get("provenance") or {}).get("builtin") for r in patches)
    head = f" built into {', '.join(builtin)}" if builtin else ""
    out = ["", "Patch code:" + head + (", except:" if builtin and others else "")]
    col = _name_width(patches)
    for r in patches:
        p = r.get("provenance")
        if p is None:
            out.append(f"  {r['name']:<{col}} none (see its error)")
        elif not p["builtin"]:
            where = f"{p['distribution'] or 'unknown distribution'} {p['version'] or '(unknown version)'}"
            out += wrap(f"  {r['name']:<{col}} {where} entry point {p['value']}", indent="    ")
    return out


def _row(head: str, text: str) -> list:
    """``head`` then ``text``, wrapped under the row (aligned with the text while it has room)."""
    indent = " " * (len(head) if WIDTH - len(head) >= 30 else 6)
    lines = textwrap.wrap(text or "-", WIDTH, initial_indent=head, subsequent_indent=indent,
                          break_on_hyphens=False)
    return lines or [head.rstrip()]


def _frameworks(frameworks: dict) -> list:
    if not frameworks:
        return []
    lines = ["", "Frameworks", f"  {'name':<19} {'version':<24} {'source':<9} location"]
    for name, fw in frameworks.items():
        broken = "installed but not importable (see Errors)" if fw.get("importable") is False else None
        if not fw["installed"]:
            lines += _row(f"  {name:<19} ", f"{fw['distribution']} {fw['version']}: meta package only, "
                          + (broken or "not importable") if fw["source"] == "meta package only"
                          else "not installed")
            continue
        extra = f" [{fw['flavor']}]" if fw["flavor"] else ""
        extra += f" commit {fw['commit'][:8]}" if fw["commit"] else ""
        head = f"  {name:<19} {(fw['version'] or 'unknown version') + extra:<24} {fw['source']:<9} "
        lines += _value(head, fw["location"])
        if broken:
            lines += _row(f"  {'':<19} ", broken)
        if fw.get("source_id"):   # versions such as MindSpeed's do not tell its branches apart
            lines += _row(f"  {'':<19} ", f"source tree: {fw['source_id']}")
    return lines


def _patches(report: dict) -> list:
    patches = report["patches"]
    if not patches:
        return []
    col = max(_name_width(patches), len("patch"))
    matrix = report["plugin"]["matrix"] or "-"
    title = f"Patches (matrix: {matrix})"
    lines = ["", title] if len(title) <= WIDTH else ["", *_value("Patches (matrix below) ", matrix)]
    lines.append(f"  {'patch':<{col}} {'decision':<9} {'state':<10} reason")
    for r in patches:
        lines += _row(f"  {r['name']:<{col}} {r['decision']:<9} {r['state']:<10} ", _why(r))
    return lines + _code_lines(patches)


def _see(report: dict, section: str, text: str | None) -> str:
    """"see Errors" when that section names ``text``; else ``text`` itself (never a dangling pointer)."""
    if text and any(text in item for item in report.get(section.lower()) or []):
        return f"see {section}"
    return text or "see the output above"


def _environment(report: dict) -> list:
    env = report["environment"]
    npu = env["torch_npu"]
    npu_text = ("not installed" if not npu["installed"] else f"{npu['version']} " + (
        "importable" if npu["importable"] else f"NOT importable ({_see(report, 'Errors', npu['import_error'])})"))
    torch_text = env["torch"] or "not installed: no patch can apply in this Python"
    if env["torch"] and env["device_error"]:
        torch_text += f" (import fails: {_see(report, 'Warnings', env['device_error'])})"
    return (["", "Environment"] + _row("  python      ", f"{env['python']} ({env['platform']})")
            + _row("  torch       ", torch_text) + _row("  torch_npu   ", npu_text)
            + _row("  device      ", env["device"] or "-") + _detection(env.get("detection") or {}))


def _detection(detection: dict) -> list:
    """What decides detection: each PYTHONPATH entry (a checkout's git id) and each variable the matrix's
    frameworks declare, set or not."""
    lines = []
    for entry in detection.get("pythonpath") or []:
        text = entry["path"] + (f" ({entry['git']})" if entry.get("git") else "")
        lines += _value("  PYTHONPATH  ", text + ("" if entry.get("exists") else " (not a folder)"))
    for name, value in (detection.get("variables") or {}).items():
        lines += _row("  variable    ", f"{name}={value}" if value is not None else f"{name} unset")
    return lines


def doctor_text(report: dict) -> str:
    plugin = report["plugin"]
    lines = [f"npu-fsdp-patches {plugin['version']} doctor"] + _environment(report)
    if plugin["config_error"]:
        lines += ["", "Configuration"] + wrap(f"  INACTIVE: {plugin['config_error']}", indent="    ")
    lines += _frameworks(report["frameworks"]) + _patches(report)
    if report.get("self_test") is not None:
        lines += ["", "Self-test"] + [part for line in self_test_lines(report["self_test"])
                                      for part in wrap("  " + line, indent="    ")]
    for title, items in (("Errors", report.get("errors") or []), ("Warnings", report["warnings"])):
        if items:
            lines += ["", title] + [line for item in dict.fromkeys(items)
                                    for line in wrap(f"  - {item}", indent="    ")]
    counts = {}
    for r in report["patches"]:
        counts[r["state"]] = counts.get(r["state"], 0) + 1
    summary = ", ".join(f"{n} {s}" for s, n in sorted(counts.items())) or "no patches"
    lines += [""] + wrap(f"Summary: {summary}; exit code {report['exit_code']}")
    return "\n".join(lines)


def self_test_lines(result: dict) -> list:
    """Schema of npu_fsdp_patches.selftest.checks.adamw_step.run_self_test (or {"passed": False, "error": ...})."""
    if result.get("error"):
        return [f"FAILED: {result['error']}"]
    out = [f"{result.get('device')}, {result.get('steps')} AdamW steps vs {result.get('reference')}: "
           f"{'PASS' if result.get('passed') else 'FAIL'}"]
    for dtype, item in (result.get("dtypes") or {}).items():
        text = f"{dtype}: {'pass' if item.get('passed') else 'FAIL'}, {item.get('mismatches')} mismatches"
        first = item.get("first_mismatch")
        if first:
            text += (f"; first at step {first.get('step')} {first.get('tensor')}{first.get('index')}: "
                     f"expected {first.get('expected')} got {first.get('got')}")
        out.append(text)
    return out


def wrap(text: str, indent: str = "  ") -> list:
    """Long prose wrapped at WIDTH instead of cut, continuation lines indented."""
    return textwrap.wrap(text, WIDTH, subsequent_indent=indent, break_on_hyphens=False) or [""]


def reflow(doc: str) -> list:
    """A docstring's paragraphs and bullet items re-wrapped at WIDTH, indented two spaces."""
    out, item = [], []

    def flush() -> None:
        if item:
            bullet = item[0].startswith(("* ", "- "))
            out.extend(textwrap.wrap(" ".join(item), WIDTH, initial_indent="  ",
                                     subsequent_indent="    " if bullet else "  ",
                                     break_long_words=False, break_on_hyphens=False))
            item.clear()

    for line in textwrap.dedent(doc).strip().splitlines():
        text = line.strip()
        if not text or text.startswith(("* ", "- ")):
            flush()
        if not text:
            out.append("")
        else:
            item.append(text)
    flush()
    return out


def explain_text(spec: PatchSpec, record: dict | None, frameworks: dict, doc: str | None) -> str:
    lines = wrap(f"{spec.name}: {spec.summary}")
    if record is not None:
        lines += _row("  decision  ", f"{record['decision']}: {record['reason']}")
        lines += _row("  state     ", record["state"] + (f": {_why(record)}" if record["state"] in
                                                         ("failed", "skipped") else ""))
    lines += ["", "What it changes:"] + (reflow(doc) if doc else wrap(
        "  (missing: the patch's description is its class docstring, and neither its source nor the loaded "
        "class has one; python -OO strips docstrings from modules it runs without their source)", indent="  "))
    lines += ["", "Targets (? = optional, absent in some framework generations):"]
    lines += [f"  {t.symbol}" + ("?" if t.optional else "") for t in spec.targets]
    lines += ["", "Gate (enabled when every condition of any one alternative holds):"]
    for alternative in gate_data(spec, frameworks):
        for j, cond in enumerate(alternative["conditions"]):
            label = f"[{alternative['alternative']}]" if j == 0 else ""
            head = f"  {label:<3} {'yes' if cond['holds'] else 'no ':<3} {cond['requires']}: "
            lines += wrap(head + cond["found"], indent=" " * 10)
    if spec.why:
        lines += wrap(f"Why: {spec.why}")
    if spec.stand_down_probe:
        lines.append(f"Stand-down probe: {spec.stand_down_probe} (skipped when upstream already has the fix)")
    if spec.verified:
        lines += wrap("Verified: " + "; ".join(_verified_text(fw, v) for fw, v in spec.verified.items()))
    for key, value in spec.upstream.items():
        value = ", ".join(value) if isinstance(value, list) else value
        lines += wrap(f"Upstream {key}: {value}")
    if spec.facts:
        lines += wrap(f"Facts: {spec.facts}")
    return "\n".join(lines)


def _verified_text(framework: str, entries: tuple) -> str:
    """``transformer_engine [npu] 0.1.0 (stand-in), [nvidia] 2.10.0, 2.11.0``: each flavour once, before its
    versions; a version the suite ran only as a test stand-in says so."""
    groups: dict = {}
    for entry in entries:
        version, _, flavor = entry.partition(" [")
        flavor, _, mark = flavor.partition("]")
        groups.setdefault(flavor or None, []).append(version + mark)
    return framework + "".join(f" [{flavor}]" * bool(flavor) + " " + ", ".join(versions) + ","
                               for flavor, versions in groups.items()).rstrip(",")


def requirement(cond: Condition) -> str:
    """What one gate condition asks for, whatever is installed: framework, flavour, version range."""
    name = cond.framework.replace("_", "-")
    if not cond.installed:
        return f"{name} absent"
    text = name + (f" [{cond.flavor} flavour]" if cond.flavor else "")
    return text + (f" {cond.version}" if cond.version is not None else " (any version)")


def gate_data(spec: PatchSpec, frameworks: dict) -> list:
    """The gate as data (explain --json): per alternative, each condition's terms and verdict."""
    out = []
    for i, alternative in enumerate(spec.gate, 1):
        conditions = []
        for cond in alternative:
            holds, found = check_condition(cond, frameworks[cond.framework])
            conditions.append({"framework": cond.framework, "installed": cond.installed,
                               "flavor": cond.flavor,
                               "version": str(cond.version) if cond.version is not None else None,
                               "note": cond.note, "requires": requirement(cond), "holds": holds,
                               "found": found})
        out.append({"alternative": i, "holds": all(c["holds"] for c in conditions),
                    "conditions": conditions})
    return out


def unknown_patch_message(name: str, known: Iterable[str]) -> str:
    """``explain NAME`` of a name no patch has: the near names first (those containing NAME, any case,
    such as ``hp_fp32`` for ``hp_fp32_main_params``; then difflib's close ones; three at most), then every
    known one."""
    import difflib   # only a misspelled name pays for it
    known = sorted(known)
    key = name.strip().lower()
    near = [k for k in known if len(key) >= 3 and key in k.lower()]
    near += [k for k in difflib.get_close_matches(key, known, n=3, cutoff=0.6) if k not in near]
    near = near[:3]
    hint = f". Did you mean {' or '.join(near)}? Known" if near else "; known"
    return f"unknown patch {name!r}{hint}: {', '.join(known)}"


def _name_width(records: Iterable[dict]) -> int:
    """The patch-name column: as wide as the longest name, so the columns after it line up."""
    return max((len(r["name"]) for r in records), default=0)


def list_text(records: Iterable[dict]) -> str:
    records = list(records)
    col = _name_width(records)
    return "\n".join(fit(f"{r['name']:<{col}} {r['decision']:<9} {r['summary']}") for r in records)
