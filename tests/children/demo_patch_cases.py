"""Child side of tests/test_contributor_demo_patch.py: the plugin from a copied checkout, first on the path."""
from __future__ import annotations

import contextlib
import io
import json
import os
import socket


def builtins() -> dict:
    """The built-in table the copy derives, where from, and whether it was stored for the next run."""
    import npu_fsdp_patches  # noqa: F401  (activation derives the table)
    from npu_fsdp_patches.plan import loader

    from npu_fsdp_patches.plan import matrix_cache

    locations = matrix_cache._locations("builtin_patches")  # pylint: disable=W0212  (where it is stored)
    return {"table": loader.builtin_table(), "table_from": loader._builtin_path(),  # pylint: disable=W0212
            "stored": any(os.path.isfile(location) for location in locations)}


def _record(name: str) -> dict:
    import npu_fsdp_patches
    return {r["name"]: r for r in npu_fsdp_patches.status()}[name]


def lifecycle() -> dict:
    """Decision, provenance, apply on import, explain, doctor, revert of ``demo_exclaim``."""
    import npu_fsdp_patches
    from npu_fsdp_patches.cli.commands import main
    from npu_fsdp_patches.cli.doctor import collect

    record = _record("demo_exclaim")
    out = {"decision": [record["decision"], record["reason"]], "provenance": record["provenance"],
           "before_import": record["state"]}
    doctor = next(p for p in collect()["patches"] if p["name"] == "demo_exclaim")
    out["doctor"] = {k: doctor[k] for k in ("name", "decision", "state")}
    text = io.StringIO()
    with contextlib.redirect_stdout(text):
        main(["explain", "demo_exclaim"])
    out["explain"] = text.getvalue().splitlines()
    import demo_target
    out["applied"] = [_record("demo_exclaim")["state"], demo_target.greet("x")]
    if out["applied"][0] == "applied":
        npu_fsdp_patches.revert("demo_exclaim")
    out["reverted"] = [_record("demo_exclaim")["state"], demo_target.greet("x")]
    return out


def self_test() -> dict:
    """``self-test --only demo_exclaim`` as rank 0 of a one-rank torchrun job: the engine in this process."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update({"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "TORCHELASTIC_RUN_ID": "demo",
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    from npu_fsdp_patches.cli.commands import main
    from npu_fsdp_patches.selftest.checks import CHECKS

    text = io.StringIO()
    with contextlib.redirect_stdout(text):
        code = main(["self-test", "--only", "demo_exclaim", "--device", "cpu", "--json"])
    report = json.loads(text.getvalue())
    return {"declared": list(CHECKS["demo_exclaim"]), "exit_code": code, "checks": report["checks"]}
