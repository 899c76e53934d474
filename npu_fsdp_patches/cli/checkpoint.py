"""``npu-fsdp-patches checkpoint PATH``: what a checkpoint holds and what each consumer will do with it,
and ``--convert-to upstream|torch OUT`` (docs/cli.md#checkpoint).

The layout knowledge lives in ``npu_fsdp_patches.optim`` (checkpoint_report, checkpoint_convert),
imported when the command runs: importing the CLI never imports torch.
"""
from __future__ import annotations

import argparse
import json
import sys
import time

#: exit codes (docs/cli.md#exit-codes)
EXIT_COMPLETE = 0      # read (and converted): complete for the model, every fp32 main param loads
EXIT_INCOMPLETE = 1    # read, but main params are partial or absent for bf16/fp16 params, or model entries lack
EXIT_UNUSABLE = 2      # not a checkpoint this reads, a bad option or file, or OUT cannot be written


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("path", help="a DCP checkpoint folder or a torch.save file")
    parser.add_argument("--model-fqns", metavar="FILE",
                        help="the model's params, one 'FQN [DTYPE]' per line (default: listed from the checkpoint)")
    parser.add_argument("--convert-to", nargs=2, metavar=("LAYOUT", "OUT"),
                        help="write the checkpoint in hyper-parallel's layout (upstream) or torch's (torch) to "
                             "OUT, a new folder (a new file for a torch.save file)")
    parser.add_argument("--param-groups", choices=("auto", "flat", "nested"), default="auto",
                        help="with --convert-to upstream: flatten the param groups (default: when the "
                             "groups come from several optimizers, as upstream's chain does)")
    parser.add_argument("--json", action="store_true", help="one JSON object (schema npu-fsdp-patches/checkpoint)")


class _Progress:
    """One stderr line per step of long work, at most one a second (the last always)."""

    def __init__(self) -> None:
        self._last = 0.0

    def __call__(self, done: int, total: int, what: str) -> None:
        """``done`` of ``total`` bytes; ``what`` is being done."""
        now = time.monotonic()
        if done < total and now - self._last < 1.0:
            return
        self._last = now
        print(f"npu-fsdp-patches checkpoint: {100 * done // max(total, 1):3d}% of {total / 2**20:.1f} MiB, "
              f"{what}", file=sys.stderr, flush=True)


def _text(report: dict) -> str:
    lines = [f"Checkpoint {report['path']}",
             f"  format       {'DCP folder' if report['format'] == 'dcp' else 'torch.save file'}, saved at "
             f"{report['world_size'] or 'an unknown number of'} rank(s) (from {report['world_size_from']})",
             f"  layout       {report['layout']}" + (f", param groups {report['param_groups']}"
                                                     if report["param_groups"] != "none" else ""),
             f"  dtypes       {', '.join(d.replace('torch.', '') for d in report['dtypes']) or '-'}"]
    mains = report["main_params"]
    lines.append(f"  main params  {len(mains['saved'])} saved" + (f", at {mains['where']}" if mains["where"] else ""))
    model = report["model"]
    lines.append(f"  model        {model['params']} params from {model['from']}, "
                 f"{len(model['low_precision'])} of them bf16/fp16; "
                 + ("complete" if report["complete"] else "INCOMPLETE")
                 + (f"; missing in the checkpoint: {', '.join(model['missing_in_checkpoint'])}"
                    if model["missing_in_checkpoint"] else ""))
    lines.append("")
    lines.append(f"  {'param':<34} {'model dtype':<12} {'fp32 main param':<16} optimizer state")
    for p in report["params"]:
        dtype = (p["model_dtype"] or "-").replace("torch.", "")
        main = (p["main_param_dtype"] or "yes").replace("torch.", "") if p["fp32_main_param"] else "-"
        lines.append(f"  {p['fqn']:<34} {dtype:<12} {main:<16} {', '.join(p['optimizer_state']) or '-'}")
    lines.append("")
    lines.append("What each consumer will do:")
    for consumer in report["consumers"].values():
        lines.append(f"  {consumer['consumer']}")
        lines.append(f"      {consumer['outcome']}: {consumer['why']}")
        if consumer.get("param_groups"):
            lines.append(f"      param groups {consumer['param_groups']}")
    if report.get("converted"):
        c = report["converted"]
        lines.append("")
        lines.append(f"Wrote {c['out']} in the {c['layout']} layout ({c['items']} entries, {c['bytes']} bytes copied)")
    return "\n".join(lines)


def _emit(as_json: bool, report: dict | None, error: str | None, code: int) -> int:
    if as_json:
        print(json.dumps({"schema": "npu-fsdp-patches/checkpoint", "schema_version": 1, **(report or {}),
                          "error": error, "exit_code": code}, indent=2))
    elif error:
        print(f"npu-fsdp-patches checkpoint: {error}", file=sys.stderr)
    else:
        print(_text(report))
    return code


def main(args: argparse.Namespace) -> int:
    layout, out = args.convert_to or (None, None)
    if layout not in (None, "upstream", "torch"):
        return _emit(args.json, None, f"--convert-to takes upstream or torch, not {layout!r}", EXIT_UNUSABLE)
    try:
        from npu_fsdp_patches.optim.checkpoint_files import CheckpointError
        from npu_fsdp_patches.optim.checkpoint_report import inspect_checkpoint, read_model_fqns
    except Exception as exc:   # noqa: BLE001 - a broken torch is one line, not a traceback
        return _emit(args.json, None, f"cannot import torch to read checkpoints: {type(exc).__name__}: {exc}",
                     EXIT_UNUSABLE)
    try:
        model = read_model_fqns(args.model_fqns) if args.model_fqns else None
        report = inspect_checkpoint(args.path, model)
        if layout:
            from npu_fsdp_patches.optim.checkpoint_convert import convert_checkpoint
            report["converted"] = convert_checkpoint(args.path, out, layout, report,
                                                     param_groups=args.param_groups, progress=_Progress())
    except (CheckpointError, OSError) as exc:
        return _emit(args.json, None, str(exc), EXIT_UNUSABLE)
    except Exception as exc:   # noqa: BLE001 - a malformed checkpoint is one line, never a traceback
        return _emit(args.json, None, f"cannot read {args.path}: {type(exc).__name__}: {exc}", EXIT_UNUSABLE)
    return _emit(args.json, report, None, EXIT_COMPLETE if report["complete"] else EXIT_INCOMPLETE)
