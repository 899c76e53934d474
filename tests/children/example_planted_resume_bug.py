"""examples/fsdp2_main_params_muon.py with a bug planted in its resume, run as the torchrun script.

The example's ``load_checkpoint`` (its module global) is wrapped: after the real load, the learning
rate is doubled, so the resumed run diverges from the uninterrupted one after its first step. The
example must then say so and exit 1 (the negative control of its own check).
"""
import fsdp2_main_params_muon as example


def _load_then_break(path, model, opt):
    branch = _original(path, model, opt)
    for group in opt.param_groups:
        group["lr"] = group["lr"] * 2
    return branch


_original = example.load_checkpoint
example.load_checkpoint = _load_then_break

if __name__ == "__main__":
    example.main()
