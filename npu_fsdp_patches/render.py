"""Human text for doctor, explain and list; every line fits in 100 columns."""
from __future__ import annotations

import textwrap
from typing import Iterable

from .decide import check_condition
from .matrix import PatchSpec

WIDTH = 100


def fit(text: str, width: int = WIDTH) -> str:
    return text if len(text) <= width else text[: width - 1] + "…"


def _path(text: str | None, width: int) -> str:
    text = text or "-"
    return text if len(text) <= width else "…" + text[-(width - 1):]


def _why(record: dict) -> str:
    """What the reader needs after the state: the error, the stand-down, or the decision reason."""
    if record["state"] == "failed" and record["error"]:
        return record["error"]
    if record["state"] == "skipped" and record.get("note"):
        return record["note"]
    return record["reason"]


def _code(provenance: dict | None) -> str:
    if not provenance:
        return "none (see the error above)"
    where = f"{provenance['distribution'] or 'unknown distribution'} {provenance['version'] or '(unknown version)'}"
    return f"{where} built-in" if provenance["builtin"] else f"{where} entry point {provenance['value']}"


def doctor_text(report: dict) -> str:
    plugin, env = report["plugin"], report["environment"]
    npu = env["torch_npu"]
    npu_text = ("not installed" if not npu["installed"] else
                f"{npu['version']} " + ("importable" if npu["importable"] else "NOT importable (see Errors)"))
    torch_text = (env["torch"] or "not installed") + (" (import fails, see Warnings)" if env["device_error"]
                                                      and env["torch"] else "")
    lines = [f"npu-fsdp-patches {plugin['version']} doctor", "", "Environment",
             f"  python      {env['python']} ({env['platform']})",
             f"  torch       {torch_text}",
             f"  torch_npu   {npu_text}",
             f"  device      {env['device'] or '-'}", "", "Frameworks"]
    for name, fw in report["frameworks"].items():
        if not fw["installed"]:
            lines.append(fit(f"  {name:<19} " + (f"{fw['distribution']} {fw['version']}: meta package only"
                                                  if fw["source"] == "meta package only" else "not installed")))
            continue
        extra = f" [{fw['flavor']}]" if fw["flavor"] else ""
        extra += f" commit {fw['commit'][:8]}" if fw["commit"] else ""
        head = f"  {name:<19} {(fw['version'] or 'unknown version') + extra:<24} {fw['source']:<9} "
        lines.append(head + _path(fw["location"], WIDTH - len(head)))
    lines += ["", f"Patches (matrix: {_path(plugin['matrix'], WIDTH - 19)})"]
    if plugin["config_error"]:
        lines.append(fit(f"  INACTIVE: {plugin['config_error']}"))
    col = _name_width(report["patches"])
    for r in report["patches"]:
        lines.append(fit(f"  {r['name']:<{col}} {r['decision']:<9} {r['state']:<10} {_why(r)}"))
    lines += ["", "Patch code (distribution and version)"] + [
        fit(f"  {r['name']:<{col}} {_code(r.get('provenance'))}") for r in report["patches"]]
    if report.get("self_test") is not None:
        lines += ["", "Self-test"] + [fit("  " + line) for line in self_test_lines(report["self_test"])]
    for title, items in (("Errors", report.get("errors") or []), ("Warnings", report["warnings"])):
        if items:
            lines += ["", title] + [line for item in dict.fromkeys(items)
                                    for line in wrap(f"  - {item}", indent="    ")]
    counts = {}
    for r in report["patches"]:
        counts[r["state"]] = counts.get(r["state"], 0) + 1
    summary = ", ".join(f"{n} {s}" for s, n in sorted(counts.items())) or "no patches"
    lines += ["", fit(f"Summary: {summary}; exit code {report['exit_code']}")]
    return "\n".join(lines)


def self_test_lines(result: dict) -> list:
    """Schema of npu_fsdp_patches.optim.self_test.run_self_test (or {"passed": False, "error": ...})."""
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
        lines += [fit(f"  decision  {record['decision']}: {record['reason']}"),
                  fit(f"  state     {record['state']}" + (f": {_why(record)}" if record["state"] in
                                                             ("failed", "skipped") else ""))]
    if doc:
        lines += ["", "What it changes:"] + reflow(doc)
    lines += ["", "Targets (? = optional, absent in some framework generations):"]
    lines += [f"  {t.symbol}" + ("?" if t.optional else "") for t in spec.targets]
    lines += ["", "Gate (enabled when every condition of any one alternative holds):"]
    for i, alternative in enumerate(spec.gate, 1):
        for j, cond in enumerate(alternative):
            ok, text = check_condition(cond, frameworks[cond.framework])
            mark = "yes" if ok else "no "
            lines.append(fit(f"  {'[' + str(i) + ']' if j == 0 else '   '} {mark} {text}"))
    if spec.stand_down_probe:
        lines.append(f"Stand-down probe: {spec.stand_down_probe} (skipped when upstream already has the fix)")
    if spec.verified:
        lines += wrap("Verified: " + "; ".join(f"{fw} {', '.join(v)}" for fw, v in spec.verified.items()))
    for key, value in spec.upstream.items():
        value = ", ".join(value) if isinstance(value, list) else value
        lines += wrap(f"Upstream {key}: {value}")
    if spec.facts:
        lines += wrap(f"Facts: {spec.facts}")
    return "\n".join(lines)


def _name_width(records: Iterable[dict]) -> int:
    """The patch-name column: as wide as the longest name, so the columns after it line up."""
    return max((len(r["name"]) for r in records), default=0)


def list_text(records: Iterable[dict]) -> str:
    records = list(records)
    col = _name_width(records)
    return "\n".join(fit(f"{r['name']:<{col}} {r['decision']:<9} {r['summary']}") for r in records)
