"""apply_model_init_dtype on a model holding hyper-parallel DTensors (issue 41), against the stand-in
tests/fixtures/hyper_parallel_new. hyper's fully_shard records each param's dtype and sharded storage when
it shards (fdd0a808 platform/torch/fully_shard/state.py:58, param.py:289-297), so a cast afterwards cannot
reach what it all-gathers; and Module.to asks each DTensor ``is_floating_point()``, which hyper's dispatch
rejects ("Operator is_floating_point dose not contain parallel layout infer func"). So a cast a hyper
DTensor would need is refused before anything is cast, naming the param and the order that works; a model
whose hyper DTensors already have the dtype gets its plain leaves cast."""
import json

from tests.support import run_python

CHILD = """
import json, torch
from torch import nn
import hyper_parallel as hp
from hyper_parallel.core.dtensor.placement_types import Shard
from npu_fsdp_patches.optim import apply_model_init_dtype
mesh = hp.init_device_mesh("cpu", (1,))
def model(hyper_dtype):
    m = nn.Module()
    m.first = nn.Linear(4, 4)                       # a plain child, cast first by Module.to
    m.register_buffer("steps", torch.zeros(2, dtype=torch.int64))
    h = hp.DTensor.from_local(torch.ones(8, 4, dtype=hyper_dtype).requires_grad_(True), mesh, (Shard(0),))
    h._is_param = True   # a parameter, as hyper's fully_shard registers its params
    m.h = h
    return m
out = {}
m = model(torch.float32)
try:
    apply_model_init_dtype(m, "bfloat16")
except TypeError as exc:
    out["error"] = str(exc)
out["untouched"] = [str(m.first.weight.dtype), str(m.h.to_local().dtype)]
m = model(torch.bfloat16)
h = m.h
apply_model_init_dtype(m, "bfloat16")
out["cast"] = [str(m.first.weight.dtype), str(m.first.bias.dtype), str(m.h.to_local().dtype),
               str(m.steps.dtype), m.h is h]
print(json.dumps(out))
"""


def test_a_hyper_dtensor_that_needs_a_cast_is_refused_before_anything_is_cast(hyper_site):
    out = json.loads(run_python(CHILD, paths=[hyper_site]).stdout.splitlines()[-1])
    assert out["error"].startswith("apply_model_init_dtype: 'h' is a hyper_parallel."), out
    assert "(torch.float32)" in out["error"] and "Cast the model first, then shard it: " \
        "apply_model_init_dtype(model, 'bfloat16') before fully_shard(model, ...). Nothing was cast" in out["error"]
    assert out["untouched"] == ["torch.float32", "torch.float32"]
    assert out["cast"] == ["torch.bfloat16", "torch.bfloat16", "torch.bfloat16", "torch.int64", True]
