"""Cache row formats: byte accounting and the pure-torch FP4 / FP8 codecs (the kernels' twins)."""

import pytest
import torch
import torch.nn.functional as F

from cedar.kernels.formats import (
    GLOBAL_ROW,
    INDEX_ROW,
    WINDOW_ROW,
    Fp4Format,
    Fp8Format,
    row_bytes,
)
from cedar.kernels.fp4_ref import E2M1_MAGNITUDES, fp4_dequantize, fp4_quantize
from cedar.kernels.fp8_ref import fp8_dequantize, fp8_quantize

# Per-row worst case over 256 rows x 512 values of N(0, 1) * exp(N(0, 1)) (fp32 and bf16 input).
# Measured over 20 seeds: global cos >= 0.9941, rel <= 0.108; index cos >= 0.9908, rel <= 0.135;
# window cos >= 0.99951, rel <= 0.0314.
TOLERANCES = {
    "global": {"min_cos": 0.990, "max_rel": 0.13},  # FP4, E4M3 scale per 16
    "index": {"min_cos": 0.985, "max_rel": 0.16},  # FP4, E8M0 scale per 32 (ceil: coarser)
    "window": {"min_cos": 0.999, "max_rel": 0.04},  # FP8 E4M3, E8M0 scale per 32
}

FP4_FORMATS = [GLOBAL_ROW, INDEX_ROW, Fp4Format(32, "e4m3"), Fp4Format(16, "e8m0")]
CODECS = {  # name -> (format, quantize, dequantize)
    "global": (GLOBAL_ROW, fp4_quantize, fp4_dequantize),
    "index": (INDEX_ROW, fp4_quantize, fp4_dequantize),
    "window": (WINDOW_ROW, fp8_quantize, fp8_dequantize),
}
NAN_SCALE = {"global": 0x7F, "index": 0xFF, "window": 0xFF}


def roundtrip(name: str, x: torch.Tensor) -> torch.Tensor:
    fmt, quantize, dequantize = CODECS[name]
    return dequantize(*quantize(x, fmt), fmt)


def test_row_bytes_match_spec():
    assert row_bytes(GLOBAL_ROW, 512) == 288
    assert row_bytes(INDEX_ROW, 128) == 68
    assert row_bytes(WINDOW_ROW, 512) == 528


@pytest.mark.parametrize("fmt, dim", [(GLOBAL_ROW, 100), (INDEX_ROW, 16), (WINDOW_ROW, 0)])
def test_row_bytes_rejects_indivisible_dims(fmt, dim):
    with pytest.raises(ValueError):
        row_bytes(fmt, dim)


def test_formats_validate_fields():
    with pytest.raises(ValueError):
        Fp4Format(16, "e5m2")
    with pytest.raises(ValueError):
        Fp4Format(15, "e4m3")  # odd group: a group would split a packed byte
    with pytest.raises(ValueError):
        Fp8Format(0)


def _fp4_representable(fmt: Fp4Format, n: int, d: int, gen: torch.Generator) -> torch.Tensor:
    """(n, d) values code * sign * s whose groups each hold a +-6 * s, so s is recovered exactly."""
    groups = d // fmt.group
    if fmt.scale == "e4m3":  # any positive finite E4M3 value, subnormals included
        s = torch.randint(1, 0x7F, (n, groups, 1), generator=gen, dtype=torch.uint8)
        s = s.view(torch.float8_e4m3fn).float()
    else:
        e = torch.randint(-100, 100, (n, groups, 1), generator=gen)
        s = torch.ldexp(torch.ones(n, groups, 1), e)
    codes = torch.randint(0, 8, (n, groups, fmt.group), generator=gen)
    codes[:, :, 0] = 7
    mags = torch.tensor(E2M1_MAGNITUDES)[codes]
    signs = torch.randint(0, 2, mags.shape, generator=gen) * 2.0 - 1.0
    return (mags * signs * s).reshape(n, d)


@pytest.mark.parametrize("fmt", FP4_FORMATS, ids=str)
def test_fp4_representable_values_roundtrip_exactly(fmt):
    x = _fp4_representable(fmt, 64, 128, torch.Generator().manual_seed(0))
    y = fp4_dequantize(*fp4_quantize(x, fmt), fmt)
    assert torch.equal(y, x)  # NOTE: -0.0 == 0.0 here; -0.0 encodes as +0 by design


def test_fp8_representable_values_roundtrip_exactly():
    gen = torch.Generator().manual_seed(0)
    codes = torch.randint(0, 0x7F, (64, 4, 32), generator=gen, dtype=torch.uint8)
    codes |= (torch.randint(0, 2, codes.shape, generator=gen, dtype=torch.uint8) << 7)
    codes[:, :, 0] = 0x7E  # 448: pins the scale to exactly 2**e
    e = torch.randint(-110, 110, (64, 4, 1), generator=gen)
    x = (codes.view(torch.float8_e4m3fn).float() * torch.ldexp(torch.ones(64, 4, 1), e))
    x = x.reshape(64, 128)
    assert torch.equal(fp8_dequantize(*fp8_quantize(x, WINDOW_ROW), WINDOW_ROW), x)


@pytest.mark.parametrize("name", sorted(CODECS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_random_normal_error_within_tolerance(name, dtype):
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(256, 512, generator=gen) * torch.exp(torch.randn(256, 1, generator=gen))
    x = x.to(dtype).float()
    y = roundtrip(name, x)
    cos = F.cosine_similarity(x, y, dim=1)
    rel = (y - x).norm(dim=1) / x.norm(dim=1)
    tol = TOLERANCES[name]
    assert cos.min() >= tol["min_cos"], f"{name}: min cos {cos.min():.5f} (mean {cos.mean():.5f})"
    assert rel.max() <= tol["max_rel"], f"{name}: max rel {rel.max():.4f} (mean {rel.mean():.4f})"


@pytest.mark.parametrize("name", sorted(CODECS))
def test_zeros_encode_as_zero_bytes(name):
    fmt, quantize, dequantize = CODECS[name]
    x = torch.zeros(3, 64)
    x[1] = -0.0
    codes, scales = quantize(x, fmt)
    assert not codes.any() and not scales.any()
    y = dequantize(codes, scales, fmt)
    assert torch.equal(y.view(torch.int32), torch.zeros(3, 64, dtype=torch.int32))  # +0.0 only


def test_fp4_e4m3_largest_value_roundtrips_and_larger_saturate():
    x = torch.full((1, 32), 2688.0)
    x[0, 1::2] = -2688.0
    packed, scales = fp4_quantize(x, GLOBAL_ROW)
    assert scales.eq(0x7E).all() and packed.eq(0xF7).all()  # 448 scale, codes +6 / -6
    assert torch.equal(fp4_dequantize(packed, scales, GLOBAL_ROW), x)
    big = torch.tensor([[1e4, -3e38, torch.finfo(torch.float32).max, 2689.0] * 4])
    assert torch.equal(roundtrip("global", big), big.sign() * 2688.0)


@pytest.mark.parametrize("name", ["index", "window"])
def test_e8m0_formats_roundtrip_large_aligned_values(name):
    top = 6.0 if name == "index" else 448.0
    x = torch.full((1, 64), top * 2.0**100)
    x[0, 1::2] *= -0.5
    assert torch.equal(roundtrip(name, x), x)


def test_fp4_value_ties_round_to_even_code():
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    up = torch.nextafter(ties, torch.tensor(9.0))
    down = torch.nextafter(ties, torch.tensor(0.0))
    x = torch.zeros(3, 32)
    x[:, 0] = 6.0  # E8M0 scale exactly 1
    for row, vals in enumerate((ties, up, down)):
        x[row, 1:8] = vals
    y = fp4_dequantize(*fp4_quantize(x, INDEX_ROW), INDEX_ROW)
    assert y[0, 1:8].tolist() == [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0]
    assert y[1, 1:8].tolist() == [0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
    assert y[2, 1:8].tolist() == [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0]


def test_fp4_e4m3_scale_rounds_to_even_and_saturates_codes():
    x = torch.zeros(4, 16)
    x[:, 0] = torch.tensor([6 * 1.0625, 6 * 1.1875, 0.005, 6 * 2.0**-10])
    packed, scales = fp4_quantize(x, GLOBAL_ROW)
    # 1.0625 ties down to 1.0 (0x38) and 6.375 / 1.0 saturates to code 7; 1.1875 ties up to 1.25.
    assert scales[:, 0].tolist() == [0x38, 0x3A, 0, 0]
    assert packed[:, 0].tolist() == [0x07, 0x07, 0, 0]  # scale underflow flushes the group


def test_fp8_value_ties_round_to_even():
    x = torch.zeros(1, 32)
    x[0, :6] = torch.tensor([448.0, 1.0625, 1.1875, 2.0**-10, 3 * 2.0**-10, -(2.0**-11)])
    codes, scales = fp8_quantize(x, WINDOW_ROW)
    assert scales[0, 0] == 127  # scale 1
    y = fp8_dequantize(codes, scales, WINDOW_ROW)
    assert y[0, :6].tolist() == [448.0, 1.0, 1.25, 0.0, 2.0**-8, 0.0]
    assert codes[0, 5] == 0x80  # a negative value that rounds to zero keeps its sign bit


@pytest.mark.parametrize("name", sorted(CODECS))
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_poisons_exactly_one_group(name, bad):
    fmt, quantize, dequantize = CODECS[name]
    x = torch.randn(2, 4 * fmt.group, generator=torch.Generator().manual_seed(2))
    clean = x.clone()
    clean[1, fmt.group : 2 * fmt.group] = 0.0
    x[1, fmt.group + 3] = bad
    codes, scales = quantize(x, fmt)
    want_codes, want_scales = quantize(clean, fmt)
    assert scales[1, 1] == NAN_SCALE[name]
    assert scales[1, [0, 2, 3]].equal(want_scales[1, [0, 2, 3]]) and scales[0].equal(want_scales[0])
    assert codes.equal(want_codes)  # the poisoned group's codes are 0, like the zeroed group's
    y = dequantize(codes, scales, fmt)
    poisoned = torch.zeros_like(x, dtype=torch.bool)
    poisoned[1, fmt.group : 2 * fmt.group] = True
    assert torch.equal(y.isnan(), poisoned)


def test_fp4_packing_order_low_nibble_first():
    x = torch.zeros(1, 32)
    x[0, :8] = torch.tensor([0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -6.0])
    packed, scales = fp4_quantize(x, INDEX_ROW)
    assert scales.tolist() == [[127]]
    assert packed[0, :4].tolist() == [0x21, 0x43, 0x65, 0xF7] and not packed[0, 4:].any()


def test_negative_zero_in_a_nonzero_group_encodes_as_plus_zero():
    x = torch.zeros(1, 32)
    x[0, 0], x[0, 1] = 6.0, -0.0
    assert fp4_quantize(x, INDEX_ROW)[0][0, 0] == 0x07
    assert fp8_quantize(x, WINDOW_ROW)[0][0, 1] == 0x00


@pytest.mark.parametrize("name", sorted(CODECS))
def test_quantize_rejects_bad_inputs(name):
    fmt, quantize, _ = CODECS[name]
    for bad in (torch.zeros(64), torch.zeros(2, 64, dtype=torch.int32), torch.zeros(2, 40),
                torch.zeros(64, 2).t()):
        with pytest.raises(ValueError):
            quantize(bad, fmt)
    with pytest.raises(ValueError):
        quantize(torch.zeros(2, 64), "e4m3")


@pytest.mark.parametrize("name", sorted(CODECS))
def test_dequantize_rejects_bad_inputs(name):
    fmt, quantize, dequantize = CODECS[name]
    codes, scales = quantize(torch.randn(2, 64), fmt)
    cases = [
        (codes, scales[:, :1]),  # scale count does not match the row
        (codes[:1], scales),  # row counts differ
        (codes.int(), scales),  # not uint8
        (codes[:, ::2], scales[:, :1]),  # not contiguous
    ]
    for bad_codes, bad_scales in cases:
        with pytest.raises(ValueError):
            dequantize(bad_codes, bad_scales, fmt)
    with pytest.raises(ValueError):
        dequantize(codes, scales, fmt, torch.int8)
