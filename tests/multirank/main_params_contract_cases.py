"""Rank side of tests/test_main_params_torch_contract.py: the cases marked ``ranks`` of
tests/main_params_contract.py, plain and wrapped, over ``fully_shard`` (Shard(0) DTensor params) on every
rank. One launch runs them all; each returns the differences found (at most 3) per case and config."""
import torch
from torch.distributed.device_mesh import init_device_mesh

from tests import main_params_contract as contract


def case(rank, world, configs):
    mesh = init_device_mesh("cpu", (world,))
    results = {}
    for kind, dtype in configs:
        for name, item in contract.CASES.items():
            if not item.ranks:
                continue
            plain = contract.outcome(item, contract.Run(kind, contract.DTYPES[dtype], False, mesh))
            wrapped = contract.outcome(item, contract.Run(kind, contract.DTYPES[dtype], True, mesh))
            diffs = contract.differences(plain, wrapped)[:3]
            if plain[0] == "raises":   # a case both sides fail would prove nothing about the wrapper
                diffs.append(f"the plain optimizer raises {plain[1]} over fully_shard")
            results[f"{name}|{kind}|{dtype}"] = diffs
    torch.distributed.barrier()
    return results
