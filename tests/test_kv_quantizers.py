"""Scalar KV quantizers (niah/kv/methods/: q8_0, q4_0, fp4, fp8, kivi, sliding_window) and bit packing
(niah/kv/packing.py)."""

import gguf
import numpy as np
import pytest
import torch

from niah.kv.kernels import rowkernels
from niah.kv.packing import pack_bits, pack_planes, unpack_bits, unpack_planes
from niah.kv.registry import get_method

METHODS = [
    "int8_token",
    "q8_0",
    "q4_0",
    "fp8_e4m3",
    "fp8_e5m2",
    "fp4_e2m1",
    "kivi2_key",
    "kivi2_value",
    "kivi4_key",
    "kivi4_value",
    "sliding_window_asym3",
]
FP16_REL = 2.0**-11  # fp16 rounding, relative
FP16_ABS = 2.0**-25  # fp16 rounding of subnormal scales, absolute (half the smallest fp16 step)


def quantizer(name):
    return get_method(name).key


def randn(*shape, seed=0, dtype=torch.float32):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def round_trip(name, x):
    q = quantizer(name)
    return q.dequantize(q.quantize(x))


# ---------------------------------------------------------------- packing


@pytest.mark.parametrize("bits", [1, 2, 3, 4, 6, 8])
@pytest.mark.parametrize("n", [1, 7, 8, 24, 64, 67])
def test_pack_round_trip_is_exact(bits, n):
    codes = torch.randint(0, 2**bits, (2, 3, 5, n), dtype=torch.uint8, generator=torch.Generator().manual_seed(n))
    packed = pack_bits(codes, bits)
    group = {1: 8, 2: 4, 3: 8, 4: 2, 6: 4, 8: 1}[bits]
    assert packed.dtype == torch.uint8
    assert packed.shape == (2, 3, 5, -(-n // group) * group * bits // 8)
    assert torch.equal(unpack_bits(packed, bits, n), codes)


def test_pack_layout_is_a_little_endian_bit_stream():
    codes = torch.arange(8, dtype=torch.uint8)
    stream = sum(int(c) << (3 * i) for i, c in enumerate(codes))
    assert pack_bits(codes, 3).tolist() == [stream & 255, stream >> 8 & 255, stream >> 16]
    assert pack_bits(torch.tensor([1, 2, 3, 15], dtype=torch.uint8), 4).tolist() == [0x21, 0xF3]
    six = sum(c << (6 * i) for i, c in enumerate([1, 2, 3, 63]))  # 4 codes of 6 bits: one 24-bit word
    assert pack_bits(torch.tensor([1, 2, 3, 63], dtype=torch.uint8), 6).tolist() == [
        six & 255,
        six >> 8 & 255,
        six >> 16,
    ]
    assert pack_bits(torch.tensor([1, 0, 0, 0, 0, 0, 0, 1, 1], dtype=torch.uint8), 1).tolist() == [0x81, 0x01]


@pytest.mark.parametrize("bits", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("n", [8, 16, 24, 48, 64, 96])
def test_bit_planes_round_trip_in_the_same_bytes(bits, n, monkeypatch):
    codes = torch.randint(0, 2**bits, (2, 3, 5, n), dtype=torch.uint8, generator=torch.Generator().manual_seed(n))
    packed = pack_planes(codes, bits)
    assert packed.dtype == torch.uint8 and packed.shape == (2, 3, 5, n * bits // 8)
    assert torch.equal(unpack_planes(packed, bits, n), codes)
    if bits == 1:
        assert torch.equal(packed, pack_bits(codes, 1))
    monkeypatch.setattr(rowkernels, "ENABLED", False)  # the torch ops, which other devices run
    assert torch.equal(pack_planes(codes, bits), packed)


def test_bit_plane_layout():
    codes = torch.zeros(64, dtype=torch.uint8)
    codes[0], codes[9], codes[33] = 5, 2, 7  # runs of 32: code 33 is lane 1 of the second run
    planes = [1, 0, 0, 0, 0, 2, 0, 0, 1, 0, 0, 0] + [2, 0, 0, 0] * 3  # run 1: planes 0, 1, 2 of 4 bytes each
    assert pack_planes(codes, 3).tolist() == planes
    assert pack_planes(codes[:16], 3).tolist() == [1, 0, 0, 2, 1, 0]  # a 16-code row: runs of 16, 2 bytes a plane
    with pytest.raises(ValueError, match="multiple of 8"):
        pack_planes(torch.zeros(12, dtype=torch.uint8), 3)


def test_pack_rejects_bad_arguments():
    with pytest.raises(ValueError, match="bits"):
        pack_bits(torch.zeros(8, dtype=torch.uint8), 5)
    with pytest.raises(ValueError, match="uint8"):
        pack_bits(torch.zeros(8, dtype=torch.int32), 4)
    with pytest.raises(ValueError, match="do not hold"):
        unpack_bits(torch.zeros(3, dtype=torch.uint8), 4, 8)


# ---------------------------------------------------------------- every method


@pytest.mark.parametrize("name", METHODS)
@pytest.mark.parametrize("heads", [1, 2, 8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_shape_dtype_preserved_and_not_identity(name, heads, dtype):
    x = randn(2, heads, 64, 64, dtype=dtype)
    y = round_trip(name, x)
    assert y.shape == x.shape and y.dtype == dtype
    assert not torch.equal(y, x)
    assert torch.isfinite(y).all()


@pytest.mark.parametrize("name", METHODS)
def test_measured_bits_match_analytical(name):
    q = quantizer(name)
    for head_dim in (64, 128):
        p = q.quantize(randn(2, 4, 512, head_dim))
        assert q.bits_per_value(p) == pytest.approx(q.analytical_bits(head_dim), rel=0.01)


def test_analytical_bits():
    bits = {name: quantizer(name).analytical_bits(128) for name in METHODS}
    assert bits == {
        "int8_token": 8.125,
        "q8_0": 8.5,
        "q4_0": 4.5,
        "fp8_e4m3": 8.0,
        "fp8_e5m2": 8.0,
        "fp4_e2m1": 4.5,
        "kivi2_key": 3.0,
        "kivi2_value": 3.0,
        "kivi4_key": 5.0,
        "kivi4_value": 5.0,
        "sliding_window_asym3": 3.0625,
    }


@pytest.mark.parametrize("name", ["kivi2_key", "kivi4_key", "sliding_window_asym3"])
def test_min_max_formats_need_head_dim_a_multiple_of_8(name):
    with pytest.raises(ValueError, match=r"multiple of 8 .* head_dim=36"):
        quantizer(name).quantize(randn(1, 2, 512, 36))


@pytest.mark.parametrize("name", ["q8_0", "q4_0", "fp4_e2m1", "kivi2_value", "kivi4_value"])
def test_head_dim_not_a_multiple_of_32_is_refused(name):
    q = quantizer(name)
    q.check_head_dim(96)
    with pytest.raises(ValueError) as err:
        q.check_head_dim(48)
    assert name in str(err.value) and "48" in str(err.value) and "32, 64, 96, 128" in str(err.value)
    with pytest.raises(ValueError, match="head_dim=48"):
        q.quantize(randn(1, 1, 32, 48))


def test_q8_0_head_dim_48_error_names_valid_choices():
    with pytest.raises(ValueError, match=r"q8_0 .* multiple of 32 \(32, 64, 96, 128, \.\.\.\); got head_dim=48"):
        get_method("q8_0").check_head_dim(48)


@pytest.mark.parametrize("name", ["int8_token", "fp8_e4m3", "kivi2_key", "sliding_window_asym3"])
def test_methods_without_head_dim_blocks_take_any_head_dim(name):
    x = randn(1, 2, 64, 40)
    quantizer(name).check_head_dim(40)
    assert round_trip(name, x).shape == x.shape


# ---------------------------------------------------------------- error bounds


def test_q8_0_error_bound():
    x = randn(2, 3, 64, 128) * torch.logspace(-3, 2, 64).view(1, 1, 64, 1)
    blocks = x.unflatten(-1, (-1, 32))
    absmax = blocks.abs().amax(-1, keepdim=True)
    err = (round_trip("q8_0", x) - x).unflatten(-1, (-1, 32)).abs()
    assert (err <= absmax / 127 / 2 + absmax * FP16_REL + 127 * FP16_ABS).all()


def test_int8_token_error_bound_and_storage():
    x = randn(2, 3, 64, 40) * torch.logspace(-3, 2, 64).view(1, 1, 64, 1)
    x[0, 0, 0] = 0.0  # an all-zero vector gets scale 0 and reads back as zeros
    q = quantizer("int8_token")
    p = q.quantize(x)
    assert p.tensors["codes"].dtype == torch.int8 and p.tensors["scale"].shape == (2, 3, 64)
    assert int(p.tensors["codes"].abs().max()) == 127
    absmax = x.abs().amax(-1, keepdim=True)
    err = (q.dequantize(p) - x).abs()
    assert (err <= absmax / 127 / 2 + absmax * FP16_REL + 127 * FP16_ABS).all()
    assert torch.equal(q.dequantize(p)[0, 0, 0], torch.zeros(40))


def test_one_scale_per_vector_is_coarser_than_q8_0s_per_32_values():
    x = randn(1, 2, 256, 64)
    x[..., 3] *= 20.0  # an outlier channel, as real keys have: it sets int8_token's step for all 64 values
    err = {m: float((round_trip(m, x) - x).square().mean()) for m in ("int8_token", "q8_0")}
    assert err["int8_token"] > 1.5 * err["q8_0"]


def test_q4_0_error_bound():
    x = randn(2, 3, 64, 128).unflatten(-1, (-1, 32))
    d = x.abs().amax(-1, keepdim=True) / 8
    err = (round_trip("q4_0", x.flatten(-2)).unflatten(-1, (-1, 32)) - x).abs()
    slack = d * 8 * FP16_REL + 8 * FP16_ABS
    assert (err <= d + slack).all()  # code 15 is 7d: values near -m (opposite sign to m) clip, by up to d
    inside = x.abs() <= 7 * d
    assert (err[inside] <= (d / 2 + slack).expand_as(x)[inside]).all()


@pytest.mark.parametrize("name, rel, subnormal_step", [("fp8_e4m3", 2.0**-4, 2.0**-9), ("fp8_e5m2", 2.0**-3, 2.0**-16)])
def test_fp8_relative_error_bound(name, rel, subnormal_step):
    x = randn(2, 3, 64, 64) * torch.logspace(-4, 1, 64).view(1, 1, 64, 1)
    p = quantizer(name).quantize(x)
    scale = p.tensors["scales"][..., None, None]
    assert p.tensors["codes"].dtype == {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}[name]
    err = (quantizer(name).dequantize(p) - x).abs()
    assert (err <= rel * x.abs() * (1 + 1e-6) + subnormal_step / 2 * scale).all()


def test_fp8_e4m3_is_more_accurate_than_e5m2():
    x = randn(1, 4, 256, 128)
    mse = {m: (round_trip(m, x) - x).pow(2).mean() for m in ("fp8_e4m3", "fp8_e5m2")}
    assert mse["fp8_e4m3"] < mse["fp8_e5m2"]


@pytest.mark.parametrize("name", ["fp8_e4m3", "fp8_e5m2"])
def test_fp8_later_blocks_keep_the_first_scale_and_saturate(name):
    q = quantizer(name)
    first = q.quantize(randn(1, 2, 16, 64))
    later = randn(1, 2, 3, 64, seed=1) * 1e6  # far beyond the first block's absmax
    p = q.quantize_after(later, first)
    assert p.tensors["scales"] is first.tensors["scales"]
    big = torch.finfo(q.fp8).max * first.tensors["scales"][..., None, None]
    torch.testing.assert_close(q.dequantize(p), later.sign() * big.expand_as(later))


def test_fp8_all_zero_head():
    x = randn(1, 2, 8, 64)
    x[0, 1] = 0
    y = round_trip("fp8_e4m3", x)
    assert torch.equal(y[0, 1], x[0, 1]) and torch.isfinite(y).all()


E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def test_fp4_represents_its_grid_exactly_and_rounds_to_nearest():
    grid = torch.cat([E2M1, -E2M1])
    x = grid[torch.randint(0, 16, (1, 2, 8, 64), generator=torch.Generator().manual_seed(0))]
    x[..., ::32] = 6.0  # every block has absmax 6: scale 1
    assert torch.equal(round_trip("fp4_e2m1", x), x)

    y = (randn(1, 2, 64, 64) * 2).clamp(-6, 6)
    y[..., ::32] = 6.0
    nearest = grid[(y.unsqueeze(-1) - grid).abs().argmin(-1)]
    assert torch.equal(round_trip("fp4_e2m1", y), nearest)


def test_fp4_ties_go_to_the_smaller_magnitude():
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    x = torch.cat([torch.tensor([6.0]), ties, -ties, torch.zeros(17)]).view(1, 1, 1, 32)
    expected = torch.cat([torch.tensor([6.0]), E2M1[:-1], -E2M1[:-1], torch.zeros(17)]).view(1, 1, 1, 32)
    assert torch.equal(round_trip("fp4_e2m1", x), expected)


def test_fp4_error_bound():
    x = randn(2, 3, 64, 64)
    absmax = x.unflatten(-1, (-1, 32)).abs().amax(-1, keepdim=True)
    err = (round_trip("fp4_e2m1", x) - x).unflatten(-1, (-1, 32)).abs()
    assert (err <= absmax / 6 * (1 + 8 * FP16_REL) + 6 * FP16_ABS).all()  # half the widest gap (4 -> 6) in scale units


def minmax_bound(x, levels, dim, size):
    """Largest allowed |error| per value: half a step plus the fp16 rounding of the zero point and scale."""
    g = x.unflatten(dim, (-1, size))
    lo, hi = g.amin(dim, keepdim=True), g.amax(dim, keepdim=True)
    bound = (hi - lo) / levels / 2 + ((hi - lo) + lo.abs()) * FP16_REL + (levels + 1) * FP16_ABS
    return bound.expand_as(g).flatten(dim - 1, dim)


@pytest.mark.parametrize("bits", [2, 4])
@pytest.mark.parametrize("role, dim", [("key", -2), ("value", -1)])
def test_kivi_error_bound_per_group(bits, role, dim):
    x = randn(2, 3, 96, 64) + torch.linspace(-3, 3, 64)  # channel offsets, as real keys have
    err = (round_trip(f"kivi{bits}_{role}", x) - x).abs()
    assert (err <= minmax_bound(x, 2**bits - 1, dim, 32)).all()


def test_kivi_groups_and_storage():
    x = randn(1, 2, 64, 64)
    k, v = quantizer("kivi2_key"), quantizer("kivi2_value")
    pk, pv = k.quantize(x), v.quantize(x)
    assert pk.tensors["scales"].shape == (1, 2, 2, 64) and pk.tensors["zeros"].dtype == torch.float16  # per channel
    assert pv.tensors["scales"].shape == (1, 2, 64, 2)  # per token
    assert (k.residual, k.token_group, v.residual, v.token_group) == (128, 32, 128, 1)
    # per-channel key groups are independent: a huge value in one channel leaves the others as they were
    x2 = x.clone()
    x2[..., 5, 7] = 100.0
    assert torch.equal(round_trip("kivi2_key", x2)[..., 8:], round_trip("kivi2_key", x)[..., 8:])


def test_kivi_keys_need_whole_token_groups():
    with pytest.raises(ValueError, match="kivi2_key .*groups of 32 tokens; got 40 tokens"):
        quantizer("kivi2_key").quantize(randn(1, 2, 40, 64))
    quantizer("kivi2_value").quantize(randn(1, 2, 40, 64))  # per-token values take any count


def test_sliding_window_uses_512_token_windows_with_a_short_last_one():
    x = randn(1, 2, 700, 64)
    x[:, :, 600] += 50.0  # an outlier token in the second window
    p = quantizer("sliding_window_asym3").quantize(x)
    assert p.tensors["scales"].shape == (1, 2, 2, 64)
    assert torch.equal(p.tensors["zeros"][:, :, 0], x[:, :, :512].amin(-2).half())
    assert torch.equal(p.tensors["zeros"][:, :, 1], x[:, :, 512:].amin(-2).half())
    y = quantizer("sliding_window_asym3").dequantize(p)
    for window in (slice(0, 512), slice(512, 700)):
        xs = x[:, :, window]
        assert ((y[:, :, window] - xs).abs() <= minmax_bound(xs, 7, -2, xs.shape[-2])).all()
    assert torch.equal(y[:, :, :512], round_trip("sliding_window_asym3", x[:, :, :512]))  # windows independent


def test_error_ordering_on_gaussian_data():
    x = randn(1, 4, 1024, 128)
    names = ("q8_0", "fp8_e4m3", "q4_0", "kivi2_key", "kivi2_value")
    mse = {m: float((round_trip(m, x) - x).pow(2).mean()) for m in names}
    assert mse["q8_0"] < mse["fp8_e4m3"] < mse["q4_0"] < min(mse["kivi2_key"], mse["kivi2_value"])


# ---------------------------------------------------------------- bit-exact with gguf (llama.cpp)


def gguf_blocks(x, qtype):
    """gguf's bytes for ``x``'s rows, split into ``(..., blocks, scale bytes 2, payload)``."""
    raw = gguf.quants.quantize(x.numpy(), qtype)
    return raw.reshape(*x.shape[:-1], x.shape[-1] // 32, -1)


def hard_cases(seed):
    """Random rows, plus outliers, zeros, all-zero blocks, blocks with +-max ties, exact rounding ties."""
    x = randn(2, 3, 16, 64, seed=seed) * torch.logspace(-2, 2, 16).view(1, 1, 16, 1)
    x[0, 0, 0, :32] = 0.0  # all-zero block
    x[0, 0, 1, 5] = 1e4  # outlier
    x[0, 1, 2, ::3] = 0.0  # scattered zeros
    x[0, 1, 3, :32] = torch.tensor([-3.0, 3.0] * 16)  # |max| tie, negative first
    x[0, 1, 3, 32:] = torch.tensor([3.0, -3.0] * 16)  # |max| tie, positive first
    x[0, 1, 4] = torch.tensor([-0.0, 0.0] * 16 + [0.0, -0.0] * 16)  # signed zeros: the sign reaches q4_0's scale
    # absmax 127 gives d = 1, so these land on and next to rounding ties k + 0.5
    half = torch.arange(31, dtype=torch.float32) * 4 - 60.5
    x[1, 2, 4, :32] = torch.cat([torch.tensor([127.0]), half])
    x[1, 2, 5, :32] = torch.cat([torch.tensor([127.0]), torch.nextafter(half, torch.tensor(200.0))])
    x[1, 2, 6, :32] = torch.cat([torch.tensor([-127.0, 0.49999997, -0.49999997, 0.5, -0.5, 1.5, 2.5]), half[:25]])
    x[1, 2, 7, :32] = torch.linspace(-8, 8, 32)  # q4_0 with d = 1: x / d + 8.5 lands on k + 0.5
    x[1, 2, 8] = randn(64, seed=seed + 1).half().float()  # fp16-exact data, as from an fp16 model
    return x


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("tiles", [1, 4])  # 16 tokens run eagerly, 64 through the compiled encoder
def test_q8_0_is_bit_exact_with_gguf(seed, tiles):
    x = hard_cases(seed).repeat(1, 1, tiles, 1)
    p = quantizer("q8_0").quantize(x)
    ref = gguf_blocks(x, gguf.GGMLQuantizationType.Q8_0)
    np.testing.assert_array_equal(ref[..., :2], p.tensors["scales"].numpy().view(np.uint8).reshape(ref[..., :2].shape))
    np.testing.assert_array_equal(ref[..., 2:], p.tensors["codes"].numpy().view(np.uint8).reshape(ref[..., 2:].shape))
    deq = gguf.quants.dequantize(ref.reshape(*x.shape[:-1], -1), gguf.GGMLQuantizationType.Q8_0)
    np.testing.assert_array_equal(quantizer("q8_0").dequantize(p).numpy(), deq)


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("tiles", [1, 4])  # 16 tokens run eagerly, 64 through the compiled encoder
def test_q4_0_is_bit_exact_with_gguf(seed, tiles):
    x = hard_cases(seed).repeat(1, 1, tiles, 1)
    p = quantizer("q4_0").quantize(x)
    ref = gguf_blocks(x, gguf.GGMLQuantizationType.Q4_0)
    np.testing.assert_array_equal(ref[..., :2], p.tensors["scales"].numpy().view(np.uint8).reshape(ref[..., :2].shape))
    np.testing.assert_array_equal(ref[..., 2:], p.tensors["codes"].numpy().reshape(ref[..., 2:].shape))
    deq = gguf.quants.dequantize(ref.reshape(*x.shape[:-1], -1), gguf.GGMLQuantizationType.Q4_0)
    np.testing.assert_array_equal(quantizer("q4_0").dequantize(p).numpy(), deq)


def test_q8_0_rounding_matches_gguf_on_every_float_near_ties():
    """The ``|v| + (0.5 - 2**-25)`` rounding trick against gguf's ``np_roundf`` on 2**20 consecutive floats
    below and above 0.5 and on every k + 0.5 (and its neighbours) up to 127."""
    half_bits = int(np.float32(0.5).view(np.int32))
    near_half = torch.arange(half_bits - 2**19, half_bits + 2**19, dtype=torch.int32).view(torch.float32)
    ties = torch.arange(128, dtype=torch.float32) + 0.5
    ties = torch.cat([ties, torch.nextafter(ties, torch.tensor(0.0)), torch.nextafter(ties, torch.tensor(1e3))])
    v = torch.cat([near_half, ties]).clamp_max(127.0)
    v = torch.cat([v, -v])
    rows = torch.cat([v, torch.zeros(-v.numel() % 31)]).view(-1, 31)
    x = torch.cat([torch.full((rows.shape[0], 1), 127.0), rows], dim=1).view(1, 1, -1, 32)  # d = 1 per block
    codes = quantizer("q8_0").quantize(x).tensors["codes"]
    expected = gguf_blocks(x, gguf.GGMLQuantizationType.Q8_0)[..., 2:].view(np.int8).reshape(codes.shape)
    np.testing.assert_array_equal(codes.numpy(), expected)


@pytest.mark.parametrize("fp8", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_fp8_codes_decode_exactly(fp8):
    from niah.kv.methods.fp8 import _fp8_float

    codes = torch.arange(256, dtype=torch.uint8).view(fp8)
    want = codes.float()
    finite = want.isfinite()
    got = _fp8_float(codes)
    assert torch.equal(got[finite], want[finite]), fp8
    # the row decoder, every pattern once (scale 1): the same values, -0.0 included, and e5m2's inf and NaN
    name = "fp8_e4m3" if fp8 == torch.float8_e4m3fn else "fp8_e5m2"
    q = quantizer(name)
    p = q.quantize(torch.ones(1, 1, 4, 64) * torch.finfo(fp8).max)
    p.tensors["codes"] = codes.view(1, 1, 4, 64)
    rows = q.dequantize(p).flatten()
    assert torch.equal(rows.view(torch.int32)[finite], want.view(torch.int32)[finite]), fp8
    if fp8 == torch.float8_e5m2:
        assert torch.equal(rows[~finite].isnan(), want[~finite].isnan()) and torch.equal(
            rows[want.isinf()], want[want.isinf()]
        )
