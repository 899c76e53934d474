"""examples/torchtitan_main_params.py with a bug planted after a checkpoint load, run as the torchrun script.

``TESTS_PLANTED_BUG`` picks it (the negative controls of the example's two checks):

* ``loses_main_params``: after torchtitan's own ``CheckpointManager.load``, the fp32 main params are
  re-derived from the bf16 model params (``reload_model_params``), losing their low bits as a resume
  that skipped them would: part 1's resume must differ from the uninterrupted run;
* ``loses_a_moment``: after ``RebuildMainParamsCheckpointManager.load`` (the plain -> fp32 masters
  route), one param's loaded ``exp_avg`` is zeroed, as a load that skipped it would leave it: part 2's
  resume must differ from the in-memory switch. (A nudged main param would not do: one still derived
  from the model is refreshed from it before the next step, and the example's "rebuilt" check catches
  that instead; a one-ulp nudge of a moment moves the update by less than an ulp of the main param.)

Either way the example must say so and exit 1.
"""
import os

import torch

import torchtitan_main_params as example


def _lose_main_params(optimizers) -> None:
    for opt in optimizers.optimizers:
        opt.reload_model_params()


def _lose_a_moment(optimizers) -> None:
    opt = optimizers.optimizers[0]
    with torch.no_grad():
        opt.state[next(iter(opt.param_groups[0]["params"]))]["exp_avg"].to_local().zero_()


BUGS = {"loses_main_params": (example.CheckpointManager, _lose_main_params),
        "loses_a_moment": (example.RebuildMainParamsCheckpointManager, _lose_a_moment)}


def _checkpointer(manager, folder, model, optimizers, lr_schedulers):
    made = _original(manager, folder, model, optimizers, lr_schedulers)
    target, bug = BUGS[os.environ["TESTS_PLANTED_BUG"]]
    if manager is target:
        load = made.load

        def load_then_bug(*args, **kwargs):
            loaded = load(*args, **kwargs)
            bug(optimizers)
            return loaded

        made.load = load_then_bug
    return made


_original = example.checkpointer
example.checkpointer = _checkpointer

if __name__ == "__main__":
    example.main()
