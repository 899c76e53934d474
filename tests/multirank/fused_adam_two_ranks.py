"""The one 2-rank launch of tests/test_fused_adam_multirank.py: FusedAdam's numerics matrix, its
low-precision and master-weight checkpoints and the DCP save (with the uninterrupted reference run)
that the 1- and 4-rank resumes load. Three launches of the same set-up were one launch each; the
cases are independent (each builds its own mesh, params and seeded generators)."""
from __future__ import annotations

from tests.multirank.fused_adam_cases import numerics_matrix, precision_checkpoints
from tests.multirank.fused_adam_dcp_cases import dcp_save_and_resume


def two_ranks(rank: int, world: int, ckpt: str, ref_path: str) -> dict:
    return {"numerics": numerics_matrix(rank, world), "precision": precision_checkpoints(rank, world),
            "dcp": dcp_save_and_resume(rank, world, ckpt, ref_path)}
