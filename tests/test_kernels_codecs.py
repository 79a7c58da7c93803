"""Triton FP4 / FP8 codecs vs their pure-torch twins, bit for bit (interpreter on CPU)."""

import pytest
import torch

from cedar.kernels import fp4_ref, fp8_ref
from cedar.kernels.formats import GLOBAL_ROW, INDEX_ROW, WINDOW_ROW, Fp4Format, Fp8Format

pytestmark = pytest.mark.kernels
triton = pytest.importorskip("triton")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
ROWS = [1, 3, 127, 128, 129, 131]
DIMS = [32, 64, 96, 512]
FORMATS = {"global": GLOBAL_ROW, "index": INDEX_ROW, "window": WINDOW_ROW}


def codecs(fmt):
    """(reference quantize, reference dequantize, triton quantize, triton dequantize)."""
    from cedar.kernels import fp4_triton, fp8_triton  # NOTE: after conftest set TRITON_INTERPRET

    if isinstance(fmt, Fp4Format):
        return (fp4_ref.fp4_quantize, fp4_ref.fp4_dequantize,
                fp4_triton.fp4_quantize, fp4_triton.fp4_dequantize)
    return (fp8_ref.fp8_quantize, fp8_ref.fp8_dequantize,
            fp8_triton.fp8_quantize, fp8_triton.fp8_dequantize)


def assert_same_bits(what: str, got: torch.Tensor, want: torch.Tensor) -> None:
    """Equal bits; for floats any NaN matches any NaN (payloads differ between casts)."""
    assert got.shape == want.shape and got.dtype == want.dtype, what
    got, want = got.cpu(), want.cpu()
    if got.dtype.is_floating_point:
        int_ty = {4: torch.int32, 2: torch.int16}[got.element_size()]
        nan_g, nan_w = got.isnan(), want.isnan()
        bad = (nan_g != nan_w) | (~nan_w & (got.view(int_ty) != want.view(int_ty)))
    else:
        bad = got != want
    if bad.any():
        first = [(tuple(i), got[tuple(i)].item(), want[tuple(i)].item())
                 for i in bad.nonzero()[:6].tolist()]
        pytest.fail(f"{what}: {int(bad.sum())} of {bad.numel()} differ; first (index, got, "
                    f"want): {first}")


def near(t: torch.Tensor) -> torch.Tensor:
    """t and its fp32 neighbours on both sides."""
    up = torch.nextafter(t, torch.tensor(float("inf")))
    return torch.cat([t, up, torch.nextafter(t, torch.tensor(0.0))])


def e4m3_ties() -> torch.Tensor:
    """Positive finite E4M3 values (subnormals included) and the midpoints between them."""
    grid = torch.arange(0, 0x7F, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    return torch.cat([grid[1:], (grid[1:] + grid[:-1]) / 2])


E2M1_TIES = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])


def boundary_pool() -> torch.Tensor:
    """Positive fp32 values on and next to E4M3 / E2M1 rounding boundaries, subnormals included."""
    ties = e4m3_ties()
    return near(torch.cat([ties, 6 * ties, (E2M1_TIES[:, None] * ties[None, :]).flatten()]))


def boundary_rows(fmt) -> torch.Tensor:
    """(rows, 4 * group) fp32. Each group's first value pins the scale on or next to a rounding
    boundary; the others sit on and next to the value-code boundaries under that scale."""
    if isinstance(fmt, Fp4Format):
        scales = near(e4m3_ties())
        amax, body = 6 * scales, near(E2M1_TIES)[None, :] * scales[:, None]
    else:
        scales = near(torch.ldexp(torch.ones(25), torch.arange(-12, 13)))
        amax, body = 448 * scales, near(e4m3_ties())[None, :] * scales[:, None]
    body = body * (torch.arange(body.shape[1]) % 2 * 2.0 - 1.0)  # alternate signs
    width = fmt.group - 1
    body = torch.cat([body, torch.zeros(body.shape[0], -body.shape[1] % width)], dim=1)
    chunks = body.shape[1] // width
    groups = torch.cat([amax.repeat_interleave(chunks)[:, None], body.reshape(-1, width)], dim=1)
    groups = torch.cat([groups, torch.zeros(-groups.shape[0] % 4, fmt.group)])
    return groups.reshape(-1, 4 * fmt.group)


def awkward_rows(n: int, d: int, group: int, seed: int) -> torch.Tensor:
    """(n, d) fp32: each group is wide-range normal, boundary, subnormal, zero or non-finite."""
    gen = torch.Generator().manual_seed(seed)
    groups = d // group
    x = torch.randn(n, groups, group, generator=gen) * torch.exp(
        4 * torch.randn(n, groups, 1, generator=gen))
    x *= torch.where(torch.rand(x.shape, generator=gen) < 0.01, 1000.0, 1.0)  # outliers
    pool = boundary_pool()
    picks = pool[torch.randint(0, pool.numel(), x.shape, generator=gen)]
    shift = torch.randint(-6, 7, (n, groups, 1), generator=gen)
    picks *= torch.ldexp(torch.ones(n, groups, 1), shift)
    kind = torch.randint(0, 8, (n, groups, 1), generator=gen)
    x = torch.where(kind == 1, picks, x)
    x = torch.where(kind == 2, x * 1e-40, x)  # fp32 subnormals
    x = torch.where(kind == 3, 0.0, x)
    signs = torch.randint(0, 2, x.shape, generator=gen) * 2.0 - 1.0
    x = (x * signs).reshape(n, d)
    for r, g in torch.nonzero(kind[..., 0] == 4)[:16].tolist():  # one bad value poisons a group
        x[r, g * group + r % group] = (float("nan"), float("inf"), float("-inf"))[(r + g) % 3]
    return x


@pytest.mark.parametrize("name", sorted(FORMATS))
@pytest.mark.parametrize("d", DIMS)
@pytest.mark.parametrize("n", ROWS)
def test_quantize_and_dequantize_match_twin(name, n, d):
    fmt = FORMATS[name]
    ref_q, ref_dq, tri_q, tri_dq = codecs(fmt)
    x = awkward_rows(n, d, fmt.group, seed=n * 1000 + d).to(DEVICE)
    want_codes, want_scales = ref_q(x, fmt)
    got_codes, got_scales = tri_q(x, fmt)
    assert_same_bits(f"{name} codes {n}x{d}", got_codes, want_codes)
    assert_same_bits(f"{name} scales {n}x{d}", got_scales, want_scales)
    assert_same_bits(f"{name} dequantized {n}x{d}", tri_dq(want_codes, want_scales, fmt),
                     ref_dq(want_codes, want_scales, fmt))


@pytest.mark.parametrize("name", sorted(FORMATS))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_inputs_and_outputs_match_twin(name, dtype):
    fmt = FORMATS[name]
    ref_q, ref_dq, tri_q, tri_dq = codecs(fmt)
    x = awkward_rows(129, 96, fmt.group, seed=7).to(dtype).to(DEVICE)
    want = ref_q(x, fmt)
    for got, ref, part in zip(tri_q(x, fmt), want, ("codes", "scales")):
        assert_same_bits(f"{name} {dtype} {part}", got, ref)
    assert_same_bits(f"{name} dequantized to {dtype}", tri_dq(*want, fmt, dtype),
                     ref_dq(*want, fmt, dtype))


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_boundary_sweep_matches_twin(name):
    fmt = FORMATS[name]
    ref_q, _, tri_q, _ = codecs(fmt)
    x = boundary_rows(fmt).to(DEVICE)
    for got, want, part in zip(tri_q(x, fmt), ref_q(x, fmt), ("codes", "scales")):
        assert_same_bits(f"{name} boundary sweep {tuple(x.shape)} {part}", got, want)


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")  # big scales -> inf
@pytest.mark.parametrize("name", sorted(FORMATS))
def test_dequantize_every_byte_matches_twin(name):
    fmt = FORMATS[name]
    _, ref_dq, _, tri_dq = codecs(fmt)
    gen = torch.Generator().manual_seed(4)
    d = 512
    code_cols = d // 2 if isinstance(fmt, Fp4Format) else d
    codes = torch.randint(0, 256, (131, code_cols), generator=gen, dtype=torch.uint8)
    codes[0, :256] = torch.arange(256, dtype=torch.uint8)
    scales = torch.randint(0, 256, (131, d // fmt.group), generator=gen, dtype=torch.uint8)
    scales.view(-1)[:256] = torch.arange(256, dtype=torch.uint8)
    codes, scales = codes.to(DEVICE), scales.to(DEVICE)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        assert_same_bits(f"{name} every byte -> {dtype}", tri_dq(codes, scales, fmt, dtype),
                         ref_dq(codes, scales, fmt, dtype))


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_launchers_validate_arguments(name):
    fmt = FORMATS[name]
    _, _, tri_q, tri_dq = codecs(fmt)
    for bad in (torch.zeros(64), torch.zeros(2, 64, dtype=torch.int32), torch.zeros(2, 40),
                torch.zeros(64, 2).t()):
        with pytest.raises(ValueError):
            tri_q(bad.to(DEVICE), fmt)
    codes, scales = tri_q(torch.zeros(0, 64, device=DEVICE), fmt)  # empty batches are fine
    assert tri_dq(codes, scales, fmt).shape == (0, 64)
    with pytest.raises(ValueError):
        tri_dq(codes, scales[:, :1], fmt)
    odd_group = Fp4Format(24, "e4m3") if isinstance(fmt, Fp4Format) else Fp8Format(48)
    with pytest.raises(ValueError, match="power-of-two"):
        tri_q(torch.zeros(2, 96, device=DEVICE), odd_group)
