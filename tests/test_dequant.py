"""The bit-placement decode of tl_kernels/dequant.py, exhaustively, on the CPU: a NumPy model of its CUDA device
functions (same words, same byte permutes, shifts and masks, the same bf16 multiplies) against mla.formats'
dequantization, for every e4m3 code and every (e2m1 code, e8m0 byte) pair. The constants the model uses are read
from the CUDA source, so a change there without the model (or the reverse) fails here. The GPU runs the functions
themselves in tests/test_ws_gpu.py and tools/decode_bench.py's check."""

import re

import numpy as np
import pytest
import torch

from mla import formats
from tl_kernels import dequant


def prmt(a, b, sel):
    """PTX prmt.b32 (default mode): byte k of the result is byte (sel >> 4k) & 7 of the 8 bytes (a, b), or, where
    that selector nibble's bit 3 is set, the chosen byte's top bit replicated over the byte."""
    a = np.asarray(a, dtype=np.uint32)
    src = (np.asarray(b, dtype=np.uint64) << np.uint64(32)) | a.astype(np.uint64)
    sel = np.asarray(sel, dtype=np.uint32)
    out = np.zeros(np.broadcast(a, sel).shape, dtype=np.uint32)
    for k in range(4):
        nib = (sel >> np.uint32(4 * k)) & np.uint32(0xF)
        byte = ((src >> (np.uint64(8) * (nib & np.uint32(7)).astype(np.uint64))) & np.uint64(0xFF)).astype(np.uint32)
        byte = np.where(nib & np.uint32(8), np.where(byte & np.uint32(0x80), np.uint32(0xFF), np.uint32(0)), byte)
        out |= byte << np.uint32(8 * k)
    return out


def bf16_words_to_float(words):
    """uint32 words of two bf16 each (low half first) -> float32 values, in order."""
    halves = np.stack([words & 0xFFFF, words >> 16], axis=-1).reshape(*words.shape[:-1], -1)
    return (halves.astype(np.uint32) << 16).view(np.float32)


def float_to_bf16_bits(x):
    return torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32)).to(torch.bfloat16).view(torch.int16).numpy().astype(np.uint32) & 0xFFFF


def mul_bf16x2(a, b):
    """mul.rn.bf16x2: each half multiplied in fp32 (exact for these power-of-two factors), rounded to bf16."""
    # Overflow is intended: at e8m0 253 / 254 the large e2m1 codes times the scale exceed fp32's range and, as on the
    # GPU, the product is inf (as in mla.formats' dequantization, the expected values): the warning tells nothing.
    with np.errstate(over="ignore"):
        lo = bf16_words_to_float((a & 0xFFFF)[..., None])[..., 0] * bf16_words_to_float((b & 0xFFFF)[..., None])[..., 0]
        hi = bf16_words_to_float((a >> 16)[..., None])[..., 0] * bf16_words_to_float((b >> 16)[..., None])[..., 0]
    return float_to_bf16_bits(lo) | (float_to_bf16_bits(hi) << np.uint32(16))


def constants(fn: str) -> list[int]:
    body = dequant.CUDA_SOURCE[dequant.CUDA_SOURCE.index(fn):]
    body = body[: body.index("\n}\n")]
    return [int(c, 16) for c in re.findall(r"0x([0-9A-Fa-f]+)u", body)]


def model_fp8x16(words):
    """mla_fp8x16_to_bf16 on (n, 4) uint32 words -> (n, 8) words."""
    lo_sel, hi_sel, sign, field = constants("mla_fp8x16_to_bf16")[:4]
    out = []
    for i in range(4):
        for sel in (lo_sel, hi_sel):
            t = prmt(words[:, i], np.zeros_like(words[:, i]), sel)
            out.append((t & np.uint32(sign)) | ((t >> np.uint32(4)) & np.uint32(field)))
    return np.stack(out, axis=1)


def model_e2m1x16(words, e):
    """mla_e2m1x16_to_bf16 on (n, 2) uint32 words and (n,) scale bytes -> (n, 8) words."""
    mag, sign, nan = constants("mla_e2m1x16_to_bf16")[:3]
    e_lo = np.minimum(e, 128).astype(np.uint32)
    f = (e_lo + 126) << np.uint32(7)
    f |= f << np.uint32(16)
    out = []
    for i in range(2):
        odd = words[:, i] >> np.uint32(4)
        for k in range(4):
            s = prmt(words[:, i], odd, k | (k << 4) | ((k + 4) << 8) | ((k + 4) << 12))
            v = ((s << np.uint32(6)) & np.uint32(mag)) | ((s << np.uint32(12)) & np.uint32(sign))
            out.append(mul_bf16x2(v, f))
    out = np.stack(out, axis=1)
    big = e > 128
    g = np.where(e == 255, np.uint32(nan), ((e.astype(np.uint32) - 1) << 7) | ((e.astype(np.uint32) - 1) << 23))
    if big.any():
        out[big] = mul_bf16x2(out[big], g[big][:, None])
    return out


def test_every_e4m3_code_decodes_to_its_value_times_2_pow_minus_120():
    codes = torch.arange(256, dtype=torch.uint8)
    codes = codes[(codes & 0x7F) != 0x7F]  # e4m3fn NaN codes: never stored (quantizers saturate)
    codes = torch.cat([codes, codes.flip(0)])[: 16 * (len(codes) * 2 // 16)]  # whole 16-code chunks
    words = codes.numpy().view(np.uint32).reshape(-1, 4)
    got = bf16_words_to_float(model_fp8x16(words)).reshape(-1).astype(np.float64) * dequant.FP8_BF16_FACTOR
    expected = formats.dequantize_fp8(codes.view(torch.float8_e4m3fn), torch.ones(1)).double().numpy()
    np.testing.assert_array_equal(got, expected)


@pytest.mark.parametrize("e", list(range(256)))
def test_every_e2m1_code_at_every_e8m0_scale(e):
    nibbles = np.concatenate([np.arange(16), np.arange(16)[::-1]]).astype(np.uint8)  # every code, both nibbles
    packed = torch.from_numpy(nibbles[0::2] | (nibbles[1::2] << 4))  # 16 bytes: 32 codes
    scales = torch.full((1,), e, dtype=torch.uint8)
    expected = formats.dequantize_mxfp4(packed[None], scales[None]).to(torch.bfloat16).float().numpy()[0]
    words = packed.numpy().view(np.uint32).reshape(-1, 2)  # two 16-code chunks
    got = bf16_words_to_float(model_e2m1x16(words, np.full(len(words), e))).reshape(-1)
    np.testing.assert_array_equal(got, expected)  # NaN where expected NaN (e == 255), exact elsewhere


def test_a8w8_q_multiplied_by_the_reciprocal_rounds_to_bf16_as_division_does():
    """tl_kernels.steps.round_q_to_fp8 multiplies by inv = RN(1 / s) where torch's quantizer divides by s; both
    are then rounded to bf16 (and on to e4m3 from that bf16, the same step for both). The claim, in NumPy's IEEE
    float32: bf16(x * inv) == bf16(x / s) for every positive finite bf16 x up to amax (x < 0 mirrors it), with
    s = bf16(amax / 448) over amax of every bf16 exponent and random mantissas (all-ones ones included). Dropping
    the reciprocal's precision (inv rounded to bf16) breaks it: checked too, so this test can fail."""
    x = (np.arange(1, 0x7F80, dtype=np.uint32) << 16).view(np.float32)  # every positive finite bf16
    rng = np.random.default_rng(0)
    exponents = rng.integers(0x01, 0xFF, 3000, dtype=np.uint32) << 23
    mantissas = np.where(np.arange(3000) % 2 == 0, rng.integers(0, 0x80, 3000, dtype=np.uint32), 0x7F) << 16
    amax = np.maximum((exponents | mantissas).view(np.float32), np.float32(9.992007221626409e-13))  # AMAX_FLOOR

    def bf16(v):  # float32 -> bf16 (round to nearest even), as float32
        b = v.view(np.uint32).astype(np.uint64)
        return (((b + 0x7FFF + ((b >> 16) & 1)) >> 16) << 16).astype(np.uint32).view(np.float32)

    mismatches = {"inv": 0, "bf16 inv": 0}
    with np.errstate(over="ignore", under="ignore"):
        for s in np.unique(bf16((amax / np.float32(448.0)).astype(np.float32))):
            xs = x[x <= s * np.float32(448.0)]
            want = bf16(xs / s)
            inv = np.float32(1.0) / s
            mismatches["inv"] += int((bf16(xs * inv) != want).sum())
            mismatches["bf16 inv"] += int((bf16(xs * bf16(np.array([inv]))[0]) != want).sum())
    assert mismatches["inv"] == 0
    assert mismatches["bf16 inv"] > 0


def test_bf16_q_as_two_e4m3_terms_holds_it_to_2_pow_minus_8():
    """fp8_mma with bf16 Q (tl_kernels/mla_decode_ws.py, ``load_q_split``): row r times 2^(TOP - floor(log2 amax_r))
    is hi = e4m3(x) plus lo = e4m3((x - hi) * LO) / LO. Against the exact bf16 rows, over rows whose amax spans
    2^-20 .. 2^20 (and an all-zero row), every element is within 2^-8 of its row's amax and every score
    (against fp8-valued K) within 2^-8 of sum |k q|: bf16's own rounding of Q is 2^-9."""
    from tl_kernels.mla_decode_ws import Q_SPLIT_LO, Q_SPLIT_TOP

    gen = torch.Generator().manual_seed(5)
    rows = torch.randn(64, 576, generator=gen) * torch.logspace(-20, 20, 64, base=2.0)[:, None]
    rows[3] = 0
    rows[7, ::5] *= 1e-6  # small elements beside large ones (e4m3 subnormals and below)
    q = rows.to(torch.bfloat16).double()
    amax = q.abs().amax(dim=1, keepdim=True)
    scale = torch.exp2(Q_SPLIT_TOP - torch.floor(torch.log2(amax.clamp_min(1e-30))))
    x = q * scale
    assert (x.abs() < 256).all(), "amax_r lands in [2^7, 2^8)"
    e4m3 = lambda t: t.float().to(torch.float8_e4m3fn).double()  # noqa: E731  (round to nearest even)
    hi = e4m3(x)
    lo = e4m3((x - hi) * Q_SPLIT_LO)
    recon = (hi + lo / Q_SPLIT_LO) / scale
    assert ((recon - q).abs() <= 2.0**-8 * amax).all()
    k = e4m3(torch.randn(32, 576, generator=gen) * 8)
    scores, exact = recon @ k.T, q @ k.T
    assert ((scores - exact).abs() <= 2.0**-8 * (q.abs() @ k.abs().T)).all()


# ---- mxfp4 on the fp8 wgmma (dequant.MX_E4M3_CUDA_SOURCE; fp8_mma with an mxfp4 cache) ----------------------------


def mx_source_constants(fn: str) -> list[int]:
    body = dequant.MX_E4M3_CUDA_SOURCE[dequant.MX_E4M3_CUDA_SOURCE.index(fn):]
    body = body[: body.index("\n}\n")]
    return [int(c, 16) for c in re.findall(r"0x([0-9A-Fa-f]+)u", body)]


def model_e2m1x4_to_e4m3(w, t_lo, t_hi):
    """mla_e2m1x4_to_e4m3 on uint32 arrays (codes: the nibbles of w's low half-word)."""
    mag_sel, sgn_table, _, sign = mx_source_constants("mla_e2m1x4_to_e4m3")[:4]
    mag = prmt(t_lo, t_hi, w & np.uint32(mag_sel))
    sgn = prmt(np.full_like(w, sgn_table), np.full_like(w, sgn_table), w & np.uint32(0xFFFF))
    return mag | ((sgn << np.uint32(1)) & np.uint32(sign))


def model_token_exp(codes, scales):
    """mla_mx_token_exp for whole tokens: codes (n, 576) ints 0..15, scales (n, 18) ints -> (n,) E."""
    nonzero = ((codes.reshape(len(codes), 18, 32) & 7) != 0).any(axis=2)
    counted = np.where(nonzero | (scales == 255), scales, 0)
    return np.maximum(counted.max(axis=1), dequant.MX_E_FLOOR)


def model_mx_decode(codes, scales):
    """The decoder's e4m3 codes (as float64 values) and the tokens' exponents: codes (n, 576), scales (n, 18)."""
    table = np.array(dequant.mx_table_words(), dtype=np.uint32).reshape(dequant.MX_TABLES, 2)
    E = model_token_exp(codes, scales)
    t = np.clip(scales.astype(np.int64) - E[:, None] + 15, 0, 15)  # (n, 18)
    nib = codes.reshape(len(codes), -1, 4).astype(np.uint32)  # 4 codes per low half-word
    words = nib[..., 0] | nib[..., 1] << 4 | nib[..., 2] << 8 | nib[..., 3] << 12
    tt = np.repeat(t, 8, axis=1)  # the table of each group of 4 codes
    out = model_e2m1x4_to_e4m3(words, table[tt, 0], table[tt, 1])
    e4m3 = torch.from_numpy(out.view(np.uint8).copy()).view(torch.float8_e4m3fn).double().numpy()
    return e4m3.reshape(codes.shape), E


def mx_case(gen, n, spread):
    """n tokens of random e2m1 codes (some blocks all zero) and e8m0 bytes spread around 127 by +-spread."""
    codes = torch.randint(0, 16, (n, 576), generator=gen).numpy()
    codes.reshape(n, 18, 32)[torch.rand(n, 18, generator=gen).numpy() < 0.1] = 8  # all -0: no nonzero code
    scales = (127 + torch.randint(-spread, spread + 1, (n, 18), generator=gen)).clamp(0, 254).numpy()
    return codes, scales


def mx_reference(codes, scales):
    packed = torch.from_numpy((codes[:, 0::2] | (codes[:, 1::2] << 4)).astype(np.uint8))
    return formats.dequantize_mxfp4(packed, torch.from_numpy(scales.astype(np.uint8))).double().numpy()


@pytest.mark.parametrize("spread", [0, 3, 7])
def test_mxfp4_as_e4m3_under_the_token_exponent_is_exact(spread):
    """Within 14 binades of the token's exponent (every block here) the e4m3 codes times 2^(E - 133) are the
    stored values exactly; all-zero blocks (the exponent ignores them) and negative zeros included."""
    codes, scales = mx_case(torch.Generator().manual_seed(11 + spread), 512, spread)
    got, E = model_mx_decode(codes, scales)
    want = mx_reference(codes, scales)
    np.testing.assert_array_equal(got * np.exp2(E.astype(np.float64) - 133)[:, None], want)


def test_mxfp4_blocks_far_below_the_token_exponent_read_as_zero():
    """A block more than 14 binades below its token's largest (with a nonzero code) reads as zero; 14 below is
    still exact; a NaN block (255) makes the exponent 255 (the consumer's column values are then NaN)."""
    gen = torch.Generator().manual_seed(3)
    codes, scales = mx_case(gen, 64, 0)
    codes[:, :32] = 7  # block 0 nonzero everywhere
    scales[:, 0] = 140
    scales[:32, 1] = 140 - 14  # exact
    scales[32:, 1] = 140 - 15  # flushed
    got, E = model_mx_decode(codes, scales)
    want = mx_reference(codes, scales)
    assert (E[:63] == 140).all()
    scaled = got * np.exp2(E.astype(np.float64) - 133)[:, None]
    np.testing.assert_array_equal(scaled[:32, 32:64], want[:32, 32:64])
    assert (scaled[32:, 32:64] == 0).all() and (want[32:, 32:64] != 0).any()
    nan_scales = scales.copy()
    nan_scales[5, 9] = 255
    assert model_token_exp(codes, nan_scales)[5] == 255


def test_mxfp4_token_exponent_floor_keeps_tiny_tokens_exact():
    """Tokens whose blocks all lie far below 2^0 decode under the floor MX_E_FLOOR: exact down to 14 binades under
    it, and the column values 2^(E - 133), 2^(133 - E) stay within 2^+-64."""
    codes, scales = mx_case(torch.Generator().manual_seed(4), 64, 2)
    scales[:] = dequant.MX_E_FLOOR - 10 + np.arange(18)[None, :] % 5
    got, E = model_mx_decode(codes, scales)
    assert (E == dequant.MX_E_FLOOR).all()
    np.testing.assert_array_equal(got * np.exp2(E.astype(np.float64) - 133)[:, None], mx_reference(codes, scales))
    assert -64 <= dequant.MX_E_FLOOR - 133 and 254 - 133 <= 127


def test_mxfp4_table_words_are_e4m3_of_the_magnitudes():
    table = np.array(dequant.mx_table_words(), dtype=np.uint32).view(np.uint8).reshape(dequant.MX_TABLES, 8)
    values = torch.from_numpy(table.copy()).view(torch.float8_e4m3fn).double().numpy()
    mags = np.array(dequant.MX_MAGNITUDES)
    for t in range(1, dequant.MX_TABLES):
        np.testing.assert_array_equal(values[t], mags * 2.0 ** (t - 9))
    assert (values[0] == 0).all()


def test_p_as_two_e4m3_terms_holds_it_to_2_pow_minus_8():
    """``p_split`` (tl_kernels/mla_decode_ws.py, ``p_terms``): x = 256 P, hi = e4m3(x), lo = e4m3(x - hi). For every
    probability down to 2^-20 the pair is within 2^-8 of x (relative) or 2^-9 absolute (e4m3's smallest step, far
    below any probability that counts); one term alone is off by up to 2^-4 (run 48-49's gate failures)."""
    from tl_kernels.mla_decode_ws import P_FP8_SCALE

    p = torch.cat([torch.rand(100000, generator=torch.Generator().manual_seed(8)).double(),
                   torch.logspace(-20, 0, 5001, base=2.0, dtype=torch.float64)])
    x = p * P_FP8_SCALE
    e4m3 = lambda t: t.float().to(torch.float8_e4m3fn).double()  # noqa: E731
    hi = e4m3(x)
    lo = e4m3(x - hi)
    err = (hi + lo - x).abs()
    assert (err <= torch.maximum(2.0**-8 * x, torch.full_like(x, 2.0**-9))).all()
    assert ((hi - x).abs() / x).max() > 2.0**-5  # one term: e4m3's own rounding
