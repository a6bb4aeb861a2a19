"""The numba row kernels (CPU) must give what each format's torch path gives."""

import numpy as np
import pytest
import torch

from niah.kv.kernels import rowkernels
from niah.kv.registry import get_method

TURBO_MSE = ["turbo2", "turbo3", "turbo4", "turbo2.5", "turbo3.5"]
TURBO = [*TURBO_MSE, "turbo2_prod", "turbo3_prod", "turbo4_prod"]  # read in their rotated basis (_CodeBlock)
ROWS = [
    "q8_0",
    "q4_0",
    "fp8_e4m3",
    "fp8_e5m2",
    "fp4_e2m1",
    "kivi2",
    "kivi4",
    "sliding_window_asym3",
    *TURBO,
]  # every format read by the row kernels


def _kv(tokens=37, seed=0):
    """``(2, 3, tokens, 64)``: batch 2, 3 KV heads, a few large channels, one all-zero vector."""
    x = torch.randn(2, 3, tokens, 64, generator=torch.Generator().manual_seed(seed))
    x[..., :3] *= 8.0
    x[1, 2, 4] = 0.0
    return x


def _torch_path(monkeypatch, fn):
    monkeypatch.setattr(rowkernels, "ENABLED", False)
    try:
        return fn()
    finally:
        monkeypatch.setattr(rowkernels, "ENABLED", True)


@pytest.mark.parametrize("role", ["key", "value"])
@pytest.mark.parametrize("method", ROWS)
def test_row_kernels_read_what_the_torch_path_reads(method, role, monkeypatch):
    q = getattr(get_method(method), role).for_layer(2)
    tokens = 37 if q.token_group == 1 else 2 * q.token_group  # KIVI keys come in whole groups of 32 tokens
    p = q.quantize(_kv(tokens))
    query = torch.randn(2, 3, 3, 64, generator=torch.Generator().manual_seed(1))
    w = torch.rand(2, 3, 3, tokens, generator=torch.Generator().manual_seed(2))
    assert q.reads_rows(p) or method in TURBO  # TurboQuant reads its codes in its rotated basis (_CodeBlock)
    got = q.dequantize(p), q.scores(p, query), q.weighted_sum(p, w)
    want = _torch_path(monkeypatch, lambda: (q.dequantize(p), q.scores(p, query), q.weighted_sum(p, w)))
    assert torch.equal(got[0], want[0]), "dequantize must be bit-exact: the same roundings either way"
    torch.testing.assert_close(got[1], want[1], rtol=1e-4, atol=1e-4)  # float32 sums in another order
    torch.testing.assert_close(got[2], want[2], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(
    "head_dim", [32, 96, 128]
)  # q8_0 reads and q4_0 codes an even block count two blocks at a time
@pytest.mark.parametrize("method", ["q8_0", "q4_0", "fp4_e2m1"])
def test_block_formats_code_and_read_odd_and_even_block_counts(method, head_dim, monkeypatch):
    q = get_method(method).key
    x = torch.randn(1, 2, 5, head_dim, generator=torch.Generator().manual_seed(4)) * 3
    p = q.quantize(x)
    want = _torch_path(monkeypatch, lambda: q.quantize(x)).tensors
    assert all(torch.equal(p.tensors[name], want[name]) for name in want)  # q4_0 encodes blocks in pairs on the CPU
    assert q.reads_rows(p)
    assert torch.equal(q.dequantize(p), _torch_path(monkeypatch, lambda: q.dequantize(p)))


@pytest.mark.parametrize("head_dim", [32, 96, 128])  # 1-bit codes: two 32-code runs per loop where d % 64 == 0
def test_one_bit_codes_read_at_any_head_dim(head_dim, monkeypatch):
    q = get_method("turbo2_prod").key  # a 1-bit MSE stage and the 1-bit QJL sketch
    p = q.quantize(torch.randn(1, 2, 5, head_dim, generator=torch.Generator().manual_seed(5)))
    assert torch.equal(q.dequantize(p), _torch_path(monkeypatch, lambda: q.dequantize(p)))


@pytest.mark.parametrize("method", ROWS)
def test_row_kernel_reads_never_dequantize(method, monkeypatch):
    q = get_method(method).key
    tokens = 5 if q.token_group == 1 else q.token_group
    p = q.quantize(_kv(tokens))
    monkeypatch.setattr(type(q), "dequantize", lambda *a: pytest.fail("a row-kernel read dequantized"))
    assert q.scores(p, torch.randn(2, 3, 2, 64)).shape == (2, 3, 2, tokens)
    assert q.weighted_sum(p, torch.rand(2, 3, 2, tokens)).shape == (2, 3, 2, 64)


@pytest.mark.parametrize(
    "method", ["q4_0", "fp4_e2m1", *TURBO, "kivi2", "sliding_window_asym3"]
)  # numba encoders or plane packer
def test_cpu_encoders_write_the_torch_path_bytes(method, monkeypatch):
    q = get_method(method).key.for_layer(1)
    x = _kv(tokens=320 if q.token_group == 32 else 300, seed=3)
    x[0, 1, 7, :32] = -0.0  # an all-zero block whose zeros are negative: the fp16 scale keeps a sign
    x[0, 1, 8, :32] = torch.tensor([2.0, -2.0] * 16)  # a tie in magnitude: the first value wins
    got = q.quantize(x).tensors
    want = _torch_path(monkeypatch, lambda: q.quantize(x).tensors)
    assert got.keys() == want.keys()
    for name in got:
        if "norm" in name:  # TurboQuant's CPU encoders sum the squares in their own order
            torch.testing.assert_close(got[name], want[name], rtol=2**-10, atol=0)  # one fp16 step at most
        else:
            assert torch.equal(got[name], want[name]), name


def test_inputs_that_require_grad_are_read_without_error():
    q = get_method("q4_0").key
    p = q.quantize(_kv())
    query = torch.randn(2, 3, 1, 64, requires_grad=True)
    assert q.scores(p, query).shape == (2, 3, 1, 37)


@pytest.mark.parametrize("tokens", [5, rowkernels._TORCH_HALF_FROM])  # numpy's cast, then torch's
def test_rows_convert_fp16_exactly(tokens):
    t = torch.randn(1, 3, tokens, 2, generator=torch.Generator().manual_seed(0)).half()
    t[0, 0, 0, 0] = -0.0
    a = rowkernels.rows(t)
    assert a.dtype == np.float32 and a.shape == (3 * tokens, 2)
    assert torch.equal(torch.from_numpy(a).view(torch.int32), t.float().reshape(-1, 2).view(torch.int32))
