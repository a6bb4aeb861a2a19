"""TurboQuant (niah/kv/methods/turbo_*.py, niah/kv/codebooks.py): codebooks against the paper, unbiasedness of the
inner-product variant, storage accounting, seeding, shapes and errors."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from niah.kv.base import KVQuantizer
from niah.kv.codebooks import coordinate_density, lloyd_max_codebook, unit_vector_mse
from niah.kv.methods.turbo_base import haar_rotation
from niah.kv.methods.turbo_mse import TurboQuantMSE
from niah.kv.methods.turbo_prod import TurboQuantProd
from niah.kv.methods.turbo_split import TurboQuantSplit
from niah.kv.registry import available, get_method

NAMES = ["turbo2", "turbo3", "turbo4", "turbo2_prod", "turbo3_prod", "turbo4_prod", "turbo2.5", "turbo3.5"]
# D_mse = E||u - u_hat||^2 of unit vectors at b = 1..4 bits, d = 128 (the paper rounds these to
# 0.36, 0.117, 0.03, 0.009; they are the d -> infinity Gaussian Lloyd-Max values 0.363, 0.1175, 0.0345, 0.0095)
PAPER_D128 = {1: 0.361, 2: 0.116, 3: 0.034, 4: 0.0093}


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Small matmuls: one thread is much faster than a contended pool (CI boxes have 2 cores)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _quantizer(name: str, layer: int = 0) -> KVQuantizer:
    return get_method(name).key.for_layer(layer)


def _unit(n: int, d: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=g)
    return x / x.norm(dim=-1, keepdim=True)


def test_registered():
    assert set(NAMES) <= set(available())


@pytest.mark.parametrize("bits", [1, 2, 3, 4])
def test_codebook_mse_matches_paper(bits):
    d = 128
    exact = unit_vector_mse(d, bits)
    assert exact == pytest.approx(PAPER_D128[bits], rel=0.02)
    # the paper's bounds (Theorem 1): 4^-b <= D_mse <= sqrt(3) pi / 2 * 4^-b
    assert 4.0**-bits <= exact <= math.sqrt(3) * math.pi / 2 * 4.0**-bits
    # Monte Carlo through the real quantizer: 4000 random unit vectors as (1 batch, 4 heads, 1000 tokens)
    q = TurboQuantMSE(f"turbo{bits}", bits=bits).for_layer(5)
    u = _unit(4000, d, seed=bits).view(1, 4, 1000, d)
    u_hat = q.dequantize(q.quantize(u))
    measured = (u_hat - u).square().sum(-1).mean().item()
    assert measured == pytest.approx(exact, rel=0.03)
    assert measured == pytest.approx(PAPER_D128[bits], rel=0.04)


@pytest.mark.parametrize("d", [16, 64, 128])
@pytest.mark.parametrize("bits", [1, 2, 3, 4])
def test_codebook_sorted_symmetric_centroids(d, bits):
    c = lloyd_max_codebook(d, bits)
    assert c.shape == (2**bits,) and c.dtype == np.float64
    assert np.all(np.diff(c) > 0)
    np.testing.assert_allclose(c, -c[::-1], atol=1e-15)
    assert np.all(np.abs(c) < 1)
    # Lloyd-Max fixed point: every centroid is the conditional mean of its cell (numerical quadrature check)
    bounds = np.concatenate([[-1.0], (c[1:] + c[:-1]) / 2, [1.0]])
    for k in range(len(c)):
        t = np.linspace(bounds[k], bounds[k + 1], 20001)
        f = coordinate_density(t, d)
        assert np.trapezoid(t * f, t) / np.trapezoid(f, t) == pytest.approx(c[k], rel=1e-4, abs=1e-7)


def test_density_integrates_to_one_and_has_variance_one_over_d():
    for d in (16, 128):
        t = np.linspace(-1, 1, 200001)
        f = coordinate_density(t, d)
        assert np.trapezoid(f, t) == pytest.approx(1.0, rel=1e-6)
        assert np.trapezoid(t * t * f, t) == pytest.approx(1.0 / d, rel=1e-6)


def test_codebook_disk_cache_is_plain_npy(tmp_path, monkeypatch):
    monkeypatch.setenv("NIAH_CACHE", str(tmp_path))
    c = lloyd_max_codebook.__wrapped__(48, 2)  # bypass the in-process cache
    files = list((tmp_path / "codebooks").glob("*.npy"))
    assert len(files) == 1
    np.testing.assert_array_equal(np.load(files[0], allow_pickle=False), c)
    np.testing.assert_array_equal(lloyd_max_codebook.__wrapped__(48, 2), c)  # read back


@pytest.mark.parametrize("bits", [1, 2, 3, 4])
def test_fast_nearest_centroid_equals_bucketize_and_argmin(bits):
    from niah.kv.methods.turbo_base import _codebook

    book = _codebook(64, bits, torch.device("cpu"))
    g = torch.Generator().manual_seed(bits)
    extra = [book.mids, torch.nextafter(book.mids, torch.tensor(1.0)), torch.nextafter(book.mids, torch.tensor(-1.0))]
    if bits > 2:  # the lookup grid's cell edges and their float32 neighbours
        edges = (torch.arange(book.cells + 1, dtype=torch.float64) * (2.0 / book.cells) - 1).float()
        extra += [edges, torch.nextafter(edges, torch.tensor(2.0)), torch.nextafter(edges, torch.tensor(-2.0))]
    extra = torch.cat(extra).clamp(-1, 1)
    y = torch.cat([torch.randn(5, 3, 4096, generator=g) / 8, extra.expand(5, 3, -1)], dim=-1)  # incl. ties
    codes = book.encode(y)
    assert codes.dtype == torch.uint8
    assert torch.equal(codes.long(), torch.bucketize(y, book.mids))
    dist = (y[..., :4096].unsqueeze(-1) - book.centroids).abs()  # away from exact ties: the nearest centroid
    assert torch.equal(dist.gather(-1, codes[..., :4096].long().unsqueeze(-1)).squeeze(-1), dist.min(-1).values)


def test_haar_rotation_is_sign_fixed_qr_of_a_gaussian():
    from niah.kv.methods.turbo_base import gaussian_matrix

    r = haar_rotation(64, 123)
    torch.testing.assert_close(r @ r.T, torch.eye(64, dtype=torch.float64), atol=1e-12, rtol=0)
    q, rr = np.linalg.qr(gaussian_matrix(64, 123).numpy())
    np.testing.assert_allclose(r.numpy(), q * np.sign(np.diag(rr)), atol=1e-12)


def _inner_product_errors(name: str, d: int = 64, layers: int = 40, heads: int = 8, tokens: int = 16):
    """``<q, x_hat> - <q, x>`` and ``<q, x>`` over many independent (rotation, QJL matrix) draws."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(1, heads, tokens, d, generator=g)
    q = x + torch.randn(1, heads, tokens, d, generator=g)  # queries correlated with the keys
    errs, ips = [], []
    for layer in range(layers):
        quant = _quantizer(name, layer)
        x_hat = quant.dequantize(quant.quantize(x))
        ips.append((q * x).sum(-1).flatten())
        errs.append((q * x_hat).sum(-1).flatten() - ips[-1])
    return torch.cat(errs).double(), torch.cat(ips).double()


@pytest.mark.parametrize("bits", [2, 3])
def test_prod_inner_products_unbiased_mse_shrinks(bits):
    err, ip = _inner_product_errors(f"turbo{bits}_prod")
    se = err.std() / math.sqrt(len(err))
    assert abs(err.mean()) < 3 * se, (err.mean().item(), se.item())

    # TurboQuant_mse at the same total bits is biased: E[u_hat] = (1 - D_mse) u (centroid condition plus
    # rotation symmetry), so inner products shrink by the factor 1 - D_mse(d, b)
    err_m, ip_m = _inner_product_errors(f"turbo{bits}")
    se_m = err_m.std() / math.sqrt(len(err_m))
    assert err_m.mean() < -10 * se_m
    slope = 1 + err_m.mean() / ip_m.mean()
    assert slope.item() == pytest.approx(1 - unit_vector_mse(64, bits), abs=0.01)


def _rel_err(name: str, x: torch.Tensor) -> float:
    q = _quantizer(name, 2)
    x_hat = q.dequantize(q.quantize(x))
    return ((x_hat - x).square().sum(-1) / x.square().sum(-1)).mean().item()


def test_error_decreases_with_bits():
    g = torch.Generator().manual_seed(2)
    # keys-like data: a few channels with much larger scale, so the outlier split matters
    scale = torch.ones(128)
    scale[torch.randperm(128, generator=g)[:8]] = 6.0
    x = torch.randn(2, 3, 256, 128, generator=g) * scale
    mse = [_rel_err(n, x) for n in ["turbo2", "turbo2.5", "turbo3", "turbo3.5", "turbo4"]]
    assert all(a > b for a, b in zip(mse, mse[1:])), mse
    prod = [_rel_err(n, x) for n in ["turbo2_prod", "turbo3_prod", "turbo4_prod"]]
    assert all(a > b for a, b in zip(prod, prod[1:])), prod
    # at equal bits the unbiased variant pays in MSE (its QJL part adds variance)
    assert prod[1] > mse[2]


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("d", [64, 128])
def test_measured_bits_match_analytical(name, d):
    q = _quantizer(name)
    p = q.quantize(torch.randn(1, 2, 512, d))
    assert KVQuantizer.bits_per_value(p) == pytest.approx(q.analytical_bits(d), rel=0.01)
    if "." not in name:  # no per-block metadata: exact
        assert KVQuantizer.bits_per_value(p) == q.analytical_bits(d)
    assert all(not t.is_floating_point() or t.dtype == torch.float16 for t in p.tensors.values())


@pytest.mark.parametrize("name", NAMES)
def test_shapes_dtypes_and_reproducibility(name):
    x = torch.randn(2, 3, 40, 64)  # batch 2, 3 KV heads (GQA)
    a, b = _quantizer(name, 7), _quantizer(name, 7)
    pa, pb = a.quantize(x), b.quantize(x)
    for k in pa.tensors:
        assert torch.equal(pa.tensors[k], pb.tensors[k]), k
    out = a.dequantize(pa)
    assert out.shape == x.shape and out.dtype == x.dtype
    assert torch.equal(out, b.dequantize(pb))  # a fresh instance regenerates the same rotation from the seed
    other = _quantizer(name, 8).quantize(x)
    code_key = "codes" if "codes" in pa.tensors else "codes_lo"
    assert not torch.equal(pa.tensors[code_key], other.tensors[code_key])
    xb = x.to(torch.bfloat16)
    assert a.dequantize(a.quantize(xb)).dtype == torch.bfloat16


def test_rotation_per_layer_and_head():
    q = _quantizer("turbo3", 0)
    assert q.for_layer(1) is not q and q.for_layer(1).layer_idx == 1 and q.layer_idx == 0
    r0 = q._matrices("rot", 64, 3, torch.device("cpu"))
    r1 = q.for_layer(1)._matrices("rot", 64, 3, torch.device("cpu"))
    assert not torch.allclose(r0[0], r1[0])  # different layer -> different rotation
    assert not torch.allclose(r0[0], r0[1])  # different head -> different rotation
    torch.testing.assert_close(r0, _quantizer("turbo3", 0)._matrices("rot", 64, 3, torch.device("cpu")))


def test_zero_vectors_and_large_norms():
    x = torch.zeros(1, 2, 4, 32)
    x[0, 1, 2] = 1e3 * torch.randn(32)
    for name in NAMES:
        q = _quantizer(name)
        out = q.dequantize(q.quantize(x))
        assert torch.isfinite(out).all(), name
        assert torch.equal(out[0, 0], torch.zeros(4, 32)), name


def test_split_picks_high_rms_channels():
    q = _quantizer("turbo2.5")
    g = torch.Generator().manual_seed(3)
    x = torch.randn(1, 2, 64, 32, generator=g)
    big = [1, 4, 9, 30]
    x[..., big] *= 20
    p = q.quantize(x)
    from niah.kv.packing import unpack_bits

    mask = unpack_bits(p.tensors["outlier_mask"], 1, 32)
    assert mask.shape == (1, 2, 32) and int(mask.sum()) == 2 * 16
    assert bool(mask[..., big].all())
    later = torch.randn(1, 2, 64, 32, generator=g)  # no outliers of its own: later blocks keep the first's channels
    after = q.quantize_after(later, p)
    assert after.tensors["outlier_mask"] is p.tensors["outlier_mask"]
    rel = ((q.dequantize(after) - later).norm(dim=-1) / later.norm(dim=-1)).square().mean()
    assert 0.02 < rel < 0.15, rel  # between the 3-bit and 2-bit MSE of a rotated unit vector (0.034, 0.116)


@pytest.mark.parametrize("name", NAMES)
def test_bad_head_dim_raises(name):
    q = _quantizer(name)
    for d in (8, 12, 20, 36):
        with pytest.raises(ValueError, match=name.replace(".", r"\.")):
            q.check_head_dim(d)
        with pytest.raises(ValueError, match="head_dim"):
            q.quantize(torch.randn(1, 1, 2, d))
    q.check_head_dim(64)
    q.check_head_dim(128)
    with pytest.raises(ValueError):
        q.quantize(torch.randn(2, 64))  # not (batch, kv_heads, tokens, head_dim)


def test_split_needs_multiple_of_16_prod_needs_two_bits():
    with pytest.raises(ValueError, match="multiple of 16"):
        TurboQuantSplit("turbo2.5").check_head_dim(24)
    TurboQuantMSE("turbo2", bits=2).check_head_dim(24)
    with pytest.raises(ValueError, match="bits >= 2"):
        TurboQuantProd("turbo1_prod", bits=1)
