"""A torchrun job for tests/runtime/test_job_messages.py: each rank imports torch (autoload activates the plugin),
imports the demo target and reads a DataLoader with 2 spawned workers, each of which activates the plugin
again and imports the target too. The test counts the plugin's lines in the job's combined output."""
import os
import sys

import torch  # noqa: F401 - torch's autoload activates the plugin in this rank
from torch.utils.data import DataLoader, Dataset


class Patched(Dataset):
    """Item i: the demo target's patched ``Engine.run(i)`` ((i + 1) * 10), computed in a worker."""

    def __len__(self) -> int:
        return 4

    def __getitem__(self, index: int):
        import demo_target   # the worker imports a target: the patch applies there, silently
        return torch.tensor([demo_target.Engine().run(index), int("npu_fsdp_patches" in sys.modules),
                             os.getpid()])


def main() -> None:
    import demo_target
    loader = DataLoader(Patched(), batch_size=2, num_workers=2, multiprocessing_context="spawn")
    rows = torch.cat(list(loader))
    print(f"RANK_DONE rank={os.environ['RANK']} total={int(rows[:, 0].sum())} "
          f"plugin_in_workers={int(rows[:, 1].min())} workers={len(set(rows[:, 2].tolist()))} "
          f"greet={demo_target.greet('x')}", flush=True)


if __name__ == "__main__":
    main()
