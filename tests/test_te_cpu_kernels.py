"""The CPU ``transformer_engine_torch`` stand-in (tests/fixtures/te_torch_cpu) against float64 math, and the FP8
cast and ``Float8Tensor`` stand-ins (te_torch_cpu, te_real_shim) against FP8 E4M3 encodings.

Its Adam kernels must agree with a float64 AdamW/Adam to fp32 rounding, the int16-remainder kernel
must carry exactly the fp32 master of the master-weight kernel, and its launcher must drop a
pending batch behind an empty last tensor up to TE 2.17 and reject it from 2.18
(docs/te_fused_adam.md#14-dtensor-handling).
"""
from tests.support import install_fixture, run_python

_KERNELS = r"""
import torch
import transformer_engine_torch as tex

def ref(p, grads, lr, b1, b2, eps, wd, mode, bias_correction):
    # float64 math on the fp32 values the kernel receives (pybind float arguments)
    lr, b1, b2, eps, wd = (float(torch.tensor(x, dtype=torch.float32)) for x in (lr, b1, b2, eps, wd))
    p = p.double(); m = torch.zeros_like(p); v = torch.zeros_like(p)
    for t, g in enumerate(grads, 1):
        g = g.double()
        if mode == 0:
            g = g + wd * p
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g * g
        bc1, bc2 = (1 - b1 ** t, 1 - b2 ** t) if bias_correction else (1.0, 1.0)
        upd = (m / bc1) / ((v / bc2).sqrt() + eps)
        if mode == 1:
            upd = upd + wd * p
        p = p - lr * upd
    return p, m, v

gen = torch.Generator().manual_seed(0)
sizes = [1, 37, 5000]
fulls = [torch.randn(n, generator=gen) for n in sizes]
grads = [[torch.randn(n, generator=gen) for n in sizes] for _ in range(5)]
for mode in (0, 1):
    for bias_correction in (0, 1):
        ps = [f.clone() for f in fulls]
        ms = [torch.zeros(n) for n in sizes]; vs = [torch.zeros(n) for n in sizes]
        for t in range(5):
            tex.multi_tensor_adam(64, torch.zeros(1, dtype=torch.int), [grads[t], ps, ms, vs],
                                  1e-2, 0.9, 0.999, 1e-8, t + 1, mode, bias_correction, 0.1)
        for i in range(3):
            rp, rm, rv = ref(fulls[i], [g[i] for g in grads], 1e-2, 0.9, 0.999, 1e-8, 0.1, mode,
                             bias_correction)
            torch.testing.assert_close(ps[i].double(), rp, rtol=1e-6, atol=1e-7)
            torch.testing.assert_close(ms[i].double(), rm, rtol=1e-6, atol=1e-7)
            torch.testing.assert_close(vs[i].double(), rv, rtol=1e-6, atol=1e-9)
            assert not torch.equal(ps[i], fulls[i])

# bf16 params + fp32 master (5 lists) vs bf16 params + int16 remainders: the same fp32 master
masters = [f.clone() for f in fulls]
p16 = [f.bfloat16() for f in fulls]
p16r = [f.bfloat16() for f in fulls]
rems = [torch.zeros(n, dtype=torch.int16) for n in sizes]
# the remainder kernel starts from master == bf16 param (rem 0), so start the fp32 master there too
masters = [p.float() for p in p16]
st = [[torch.zeros(n) for n in sizes] for _ in range(4)]
for t in range(5):
    g = grads[t]
    tex.multi_tensor_adam(64, None, [g, p16, st[0], st[1], masters], 1e-2, 0.9, 0.999, 1e-8,
                          t + 1, 1, 1, 0.1)
    tex.multi_tensor_adam_param_remainder(64, None, [g, p16r, st[2], st[3], rems], 1e-2, 0.9,
                                          0.999, 1e-8, t + 1, 1, 1, 0.1)
    for i in range(3):
        joined = tex._join_bf16_remainder(p16r[i], rems[i])
        assert torch.equal(joined, masters[i]), (t, i)
        assert torch.equal(p16[i], masters[i].bfloat16())  # round to nearest even
        assert (p16r[i].float() - masters[i]).abs().le(masters[i].abs() * 2 ** -8).all()
for i in range(3):
    rp, _, _ = ref(fulls[i].bfloat16().float(), [g[i] for g in grads], 1e-2, 0.9, 0.999, 1e-8,
                   0.1, 1, 1)
    torch.testing.assert_close(masters[i].double(), rp, rtol=1e-6, atol=1e-7)

# bf16 moments are stored rounded; the math stays fp32
p = fulls[1].clone(); m = torch.zeros(37, dtype=torch.bfloat16); v = m.clone()
tex.multi_tensor_adam(64, None, [grads[0][1:2], [p], [m], [v]], 1e-2, 0.9, 0.999, 1e-8, 1, 1, 1,
                      0.1)
assert m.dtype == torch.bfloat16 and torch.equal(m, (0.1 * grads[0][1]).bfloat16())

# mixed fp32/bf16 moments are refused, as adam.cu's NVTE_CHECK does
try:
    tex.multi_tensor_adam(64, None, [[grads[0][0]], [fulls[0].clone()], [torch.zeros(1)],
                                     [torch.zeros(1, dtype=torch.bfloat16)]],
                          1e-2, 0.9, 0.999, 1e-8, 1, 1, 1, 0.1)
except RuntimeError as e:
    assert "both be Float32 or both be BFloat16" in str(e)
else:
    raise AssertionError("mixed moments accepted")

# launcher (multi_tensor_apply.cuh): an empty last tensor leaves the pending batch unlaunched
tex.RELEASE = (2, 17)
assert tex.launched_chunks([4, 0], 2, 4) == []
assert tex.launched_chunks([4, 3], 2, 4) == [(0, 0), (0, 1), (1, 0), (1, 1)]
assert tex.launched_chunks([0, 4], 2, 4) == [(1, 0), (1, 1)]
assert len(tex.launched_chunks([1] * 40 + [0], 8, 4)) == 36  # one full table of 36 launched
assert len(tex.launched_chunks([1] * 400 + [1], 1, 4)) == 401
p = torch.ones(4); before = p.clone()
tex.multi_tensor_adam(64, None, [[torch.ones(4), torch.ones(0)], [p, torch.ones(0)],
                                 [torch.zeros(4), torch.zeros(0)], [torch.zeros(4), torch.zeros(0)]],
                      1e-2, 0.9, 0.999, 1e-8, 1, 1, 1, 0.0)
assert torch.equal(p, before)  # batch dropped up to v2.17
tex.RELEASE = (2, 18)
try:
    tex.launched_chunks([4, 0], 2, 4)
except RuntimeError as e:
    assert "at least one chunk" in str(e)
else:
    raise AssertionError("v2.18 launcher accepted a zero-chunk tensor")

# the CUDA seam: device="cuda" goes to the CPU only for TE's optimizer modules
seam = {"torch": torch, "__name__": "transformer_engine.pytorch.optimizers.fused_adam"}
flag = eval('torch.tensor([0], dtype=torch.int, device="cuda")', seam)
assert flag.device.type == "cpu" and flag.dtype == torch.int
assert torch.tensor([1.5]).dtype == torch.float32
try:
    torch.tensor([1.0], device="cuda")
except (RuntimeError, AssertionError) as e:  # no CUDA here: anyone else still fails
    pass
else:
    assert torch.cuda.is_available(), "the seam leaked to a caller outside TE"
try:
    tex.multi_tensor_sgd()
except NotImplementedError as e:
    assert "multi_tensor_sgd" in str(e)
print("OK")
"""


def test_cpu_kernels_against_float64_and_the_launcher(tmp_path):
    site = install_fixture("te_torch_cpu", tmp_path)
    assert "OK" in run_python(_KERNELS, paths=[site]).stdout


_FP8 = r"""
import torch
import transformer_engine_torch as tex
from transformer_engine.pytorch.tensor.float8_tensor import Float8Quantizer, Float8Tensor

E4M3 = tex.DType.kFloat8E4M3
def cast(values, scale):
    data, scale_inv, amax = torch.empty(len(values), dtype=torch.uint8), torch.empty(1), torch.zeros(1)
    tex.cast_to_fp8(torch.tensor(values), torch.tensor([scale]), amax, data, scale_inv, E4M3)
    return data.tolist(), scale_inv.item(), amax.item()

# E4M3 bytes (OCP FP8, CUDA's __nv_fp8_e4m3): 1.0 = 0x38, -2.0 = 0xC0, 448 = 0x7E, NaN = 0x7F; SATFINITE
# saturates what exceeds 448, infinities included; round to nearest even (17 ties to 16 = 0x58, 18 = 0x59)
data, scale_inv, amax = cast([1.0, -2.0, 500.0, float("inf"), float("nan"), 17.0, 18.0, 0.0], 1.0)
assert data == [0x38, 0xC0, 0x7E, 0x7E, 0x7F, 0x58, 0x59, 0x00], [hex(b) for b in data]
assert scale_inv == 1.0 and amax == float("inf")            # amax skips NaN, keeps inf
data, scale_inv, amax = cast([3.0, -1.5], 0.5)             # x * scale is stored; scale_inv = 1 / scale
assert data == [0x3C, 0xB4] and scale_inv == 2.0 and amax == 3.0   # 1.5, -0.75
data, scale_inv, _ = cast([0.0, 0.0], float("inf"))          # 0 * inf: NaN bytes, scale_inv = 1 / inf = 0
assert data == [0x7F, 0x7F] and scale_inv == 0.0
assert torch.isnan(tex.cast_from_fp8(torch.tensor(data, dtype=torch.uint8), torch.zeros(1), E4M3,
                                     torch.float32)).all()   # NaN * 0: the all-zero moment's NaN

# the Float8Tensor stand-in, TE 2.x: quantizer scale in, 1/scale out; copy_ quantizes, float() dequantizes
q = Float8Quantizer(scale=torch.full([1], 4.0), amax=torch.zeros(1), fp8_dtype=E4M3)
t = q.make_empty((3,))
t.quantize_(torch.tensor([0.25, -1.0, 8.0]))
assert isinstance(t, Float8Tensor) and t.dtype == torch.float32 and t.shape == (3,)
assert t._scale_inv.item() == 0.25 and q.amax.item() == 8.0
assert t.float().tolist() == [0.25, -1.0, 8.0] and t.dequantize().dtype == torch.float32
t.copy_(torch.tensor([1.0, 2.0, 3.0]))
assert t.float().tolist() == [1.0, 2.0, 3.0]
u = Float8Quantizer(scale=torch.ones(1), amax=torch.zeros(1), fp8_dtype=E4M3).make_empty((3,))
u.copy_(t)                                                  # Float8Tensor to Float8Tensor: data and scale_inv
assert torch.equal(u._data, t._data) and u._scale_inv.item() == 0.25
# TE 1.13: no quantizer; quantize_ casts with 1 / _scale_inv and writes its reciprocal back
v = Float8Tensor(data=torch.zeros(2, dtype=torch.uint8), dtype=torch.float32, fp8_scale_inv=torch.full([1], 0.5))
v.copy_(torch.tensor([1.0, -3.0]))
assert v._scale_inv.item() == 0.5 and v.float().tolist() == [1.0, -3.0]
assert (v.float() * 2).tolist() == [2.0, -6.0]             # other ops run on the dequantized value
print("OK")
"""


def test_fp8_cast_and_float8_tensor_stand_ins(tmp_path):
    """The FP8 stand-ins (te_torch_cpu/_fp8.py, te_real_shim's Float8Tensor/Float8Quantizer) against FP8
    E4M3 encodings and TE's cast semantics: saturation, NaN, round to nearest even, scale_inv, amax."""
    sites = [install_fixture("te_torch_cpu", tmp_path), install_fixture("te_real_shim", tmp_path)]
    assert "OK" in run_python(_FP8, paths=sites).stdout
