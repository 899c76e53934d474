"""examples/veomni_main_params.py with a bug planted in its resume, run as the torchrun script.

The example's ``veomni_resume`` (its module global) is wrapped: after veomni's real load, the fp32
main params are re-derived from the bf16 model params (``reload_model_params``), losing their low
bits as a resume that skipped them would. The resumed run then diverges from the uninterrupted one,
and the example must say so and exit 1 (the negative control of its own check).
"""
import veomni_main_params as example


def _load_then_lose_main_params(path, model, opt, device):
    extra = _original(path, model, opt, device)
    opt.reload_model_params()
    return extra


_original = example.veomni_resume
example.veomni_resume = _load_then_lose_main_params

if __name__ == "__main__":
    example.main()
