"""KV / Q quantization formats for the MLA decode kernel: bf16, fp8 (per-tensor), mxfp4 (OCP MX, e2m1 + e8m0).

Everything here is plain torch: it runs on CPU and CUDA alike and never syncs the host with a device
tensor (no .item() / .tolist() / .cpu() on data); shape checks read only tensor metadata.

Formats of one KV cache of shape (total_kv, 1, 576):
  "bf16"   the bf16 tensor itself.
  "fp8"    (kv_q (total_kv, 1, 576) fp8, scale (1,) fp32); value = kv_q * scale.
  "mxfp4"  (packed (total_kv, 1, 288) uint8, scales (total_kv, 18) uint8); each run of 32 consecutive
           elements of the last dim shares one e8m0 scale byte b (value 2^(b - 127)); each element is a
           4-bit e2m1 code, two per byte, low nibble = even element, high nibble = odd element.

e2m1 code (4 bits): bit 3 = sign, bits 2..1 = exponent E, bit 0 = mantissa M;
magnitude = M / 2 if E == 0 else 2^(E - 1) * (1 + M / 2), i.e. codes 0..7 -> E2M1_VALUES.
The quantizer writes every zero as code 0 (never the "-0" code 8, not even for -0.0 or for small
negative values that round to zero); the dequantizer reads code 8 as zero too.
"""

from __future__ import annotations

import torch
from torch import Tensor

FP8_E4M3FN = torch.float8_e4m3fn  # finfo.max = 448
FP8_E4M3FNUZ = torch.float8_e4m3fnuz  # finfo.max = 240

# Magnitudes of e2m1 codes 0..7; code 8 + k is -E2M1_VALUES[k].
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)

MXFP4_BLOCK = 32  # elements per e8m0 scale
KV_FORMATS = ("bf16", "fp8", "mxfp4")

# Optional dtypes (newer torch); None where this torch lacks them.
_FLOAT4_X2 = getattr(torch, "float4_e2m1fn_x2", None)
_E8M0 = getattr(torch, "float8_e8m0fnu", None)

# float32 bit pattern constants used to choose the mxfp4 block exponent.
_AMAX_ROUND = 0x0020_0000  # 1 << 21: half of the lowest mantissa bit e2m1 keeps (float32 mantissa bit 22)
_SIGN_EXP_MASK = -0x0080_0000  # 0xFF800000 as int32: keeps sign + 8 exponent bits, drops the mantissa
_E2M1_EMAX = 2  # floor(log2(6)): exponent of the largest e2m1 magnitude
_E8M0_BIAS = 127

# Rounding |y| onto E2M1_VALUES, round to nearest, ties to even code: one threshold between each pair
# of neighbours (their midpoint); a tie goes up only when the upper code is even ("inclusive" = True).
_E2M1_THRESHOLDS = (
    (0.25, False),  # 0   | 0.5  -> tie to 0 (code 0)
    (0.75, True),  # 0.5 | 1.0  -> tie to 1.0 (code 2)
    (1.25, False),  # 1.0 | 1.5  -> tie to 1.0 (code 2)
    (1.75, True),  # 1.5 | 2.0  -> tie to 2.0 (code 4)
    (2.5, False),  # 2.0 | 3.0  -> tie to 2.0 (code 4)
    (3.5, True),  # 3.0 | 4.0  -> tie to 4.0 (code 6)
    (5.0, False),  # 4.0 | 6.0  -> tie to 4.0 (code 6); anything above 5 saturates to 6 (code 7)
)


# ----------------------------------------------------------------------------------------------- fp8


def quantize_fp8(x: Tensor, fp8_dtype: torch.dtype = FP8_E4M3FN) -> tuple[Tensor, Tensor]:
    """Per-tensor fp8 quantization, exactly as the competition harness does it.

    x: any shape, float dtype (bf16 in the product). Returns (x_q, scale):
      x_q   same shape as x, `fp8_dtype` (e4m3fn: |x_q| <= 448, e4m3fnuz: <= 240)
      scale (1,) float32, = amax(|x|) / finfo.max computed in x's dtype
    Dequantized value = x_q * scale.
    """
    finfo = torch.finfo(fp8_dtype)
    amax = x.abs().amax().clamp(min=1e-12)  # in x's dtype; the clamp keeps an all-zero x finite
    scale = amax / finfo.max
    # The clamp saturates values that x / scale rounding pushes past finfo.max (else NaN in e4m3fn).
    x_q = (x / scale).clamp(min=finfo.min, max=finfo.max).to(fp8_dtype)
    return x_q, scale.to(torch.float32).reshape(1)


def dequantize_fp8(x_q: Tensor, scale: Tensor) -> Tensor:
    """x_q: any shape, fp8; scale: (1,) float32 (or anything broadcastable). Returns float32, x_q's shape."""
    return x_q.float() * scale


# --------------------------------------------------------------------------------------------- mxfp4


def as_uint8(t: Tensor) -> Tensor:
    """View a uint8 / float4_e2m1fn_x2 / float8_e8m0fnu tensor as uint8 (same shape, no copy).

    Raises TypeError naming the dtype for anything else.
    """
    if t.dtype == torch.uint8:
        return t
    if t.dtype in (_FLOAT4_X2, _E8M0):
        return t.view(torch.uint8)
    raise TypeError(f"expected uint8, float4_e2m1fn_x2 or float8_e8m0fnu, got {t.dtype}")


def _exp2_int(e: Tensor) -> Tensor:
    """int32 tensor e with -127 <= e <= 127 -> float32 2^e, built exactly from its bit pattern.

    e >= -126 is a normal float (biased exponent e + 127 in bits 30..23); e == -127 is the
    subnormal 2^-127 (bit 22 set, 0x00400000).
    """
    bits = torch.where(e > -127, (e + 127) << 23, torch.full_like(e, 0x0040_0000))
    return bits.view(torch.float32)


def _check_block(d: int, block: int) -> None:
    if block <= 0 or block % 2 or d % block:
        raise ValueError(f"last dim {d} must be a multiple of an even block size, got block={block}")


def quantize_mxfp4(x: Tensor, block: int = MXFP4_BLOCK) -> tuple[Tensor, Tensor]:
    """MX fp4 quantization: e2m1 codes with one e8m0 (power of two) scale per `block` elements.

    x: (..., D) any float dtype, D % block == 0 (D = 576 -> 18 blocks of 32). Returns (packed, scales):
      packed (..., D // 2) uint8, two e2m1 codes per byte: low nibble = even element, high = odd
      scales (..., D // block) uint8, e8m0 byte b = e + 127, value 2^e, 0 <= b <= 254
    Dequantized value = E2M1(code) * 2^e. Zeros (including -0.0) are written as code 0.
    NaN / inf inputs are not supported (no error; their block saturates or reads as 0).
    """
    d = x.shape[-1]
    _check_block(d, block)
    xb = x.float().reshape(*x.shape[:-1], d // block, block)  # (..., nblocks, block)

    # 1. Block amax, rounded on its float32 bits: adding 1 << 21 and dropping the mantissa rounds the
    #    amax up to the next power of two when its mantissa is >= 1.75 (where 1 mantissa bit would round
    #    it to 2.0, so amax / 2^e could round past 6), and down to its own power of two otherwise.
    amax = xb.abs().amax(dim=-1)  # (..., nblocks) float32, >= 0
    rounded = (amax.view(torch.int32) + _AMAX_ROUND) & _SIGN_EXP_MASK
    # 2. e = floor(log2(rounded)) - 2, clamped to [-127, 127]; read from the exponent field, so no log2:
    #    field 0 (amax == 0 or tiny) is -inf -> -127, field 255 (amax rounds to inf) is +inf -> 127.
    field = (rounded >> 23) & 0xFF
    e = torch.where(field == 255, torch.full_like(field, 127), field - _E8M0_BIAS - _E2M1_EMAX)
    e = e.clamp(-_E8M0_BIAS, _E8M0_BIAS)  # (..., nblocks) int32

    # 3. y = |x| / 2^e (exact: a power-of-two scaling), then RNE onto the e2m1 magnitudes, saturating at 6:
    #    the code is the number of thresholds y lies above (or on, for ties that go up to an even code).
    y = xb.abs() * _exp2_int(-e).unsqueeze(-1)
    mag = torch.zeros_like(y, dtype=torch.uint8)
    for threshold, inclusive in _E2M1_THRESHOLDS:
        mag += (y >= threshold) if inclusive else (y > threshold)
    # 4. Sign in bit 3, only for nonzero magnitudes (so every zero is code 0).
    codes = mag | (((xb < 0) & (mag > 0)).to(torch.uint8) << 3)

    # 5. Pack pairs: element 2i in the low nibble, element 2i + 1 in the high nibble.
    pairs = codes.reshape(*x.shape[:-1], d // 2, 2)
    packed = pairs[..., 0] | (pairs[..., 1] << 4)
    scales = (e + _E8M0_BIAS).to(torch.uint8)
    return packed, scales


def dequantize_mxfp4(packed: Tensor, scales: Tensor, block: int = MXFP4_BLOCK) -> Tensor:
    """Inverse of quantize_mxfp4. Returns float32 (..., D), D = 2 * packed.shape[-1].

    packed: (..., D // 2) uint8 or float4_e2m1fn_x2, low nibble = even element.
    scales: (..., S) uint8 or float8_e8m0fnu with S >= D // block; only the first D // block columns are
      read, so a padded layout (e.g. 24 columns for 18 blocks) or a strided view works as is. Scale byte
      b means 2^(b - 127) (b == 0 -> the float32 subnormal 2^-127, b == 255 -> NaN as in OCP e8m0).
    Leading dims of packed and scales must broadcast.
    """
    packed, scales = as_uint8(packed), as_uint8(scales)
    d = 2 * packed.shape[-1]
    _check_block(d, block)
    nblocks = d // block
    if scales.shape[-1] < nblocks:
        raise ValueError(f"scales has {scales.shape[-1]} columns, need at least {nblocks} for D = {d}")

    # Unpack nibbles: (..., D // 2) -> (..., D) with element 2i = low nibble of byte i.
    codes = torch.stack((packed & 0xF, packed >> 4), dim=-1).reshape(*packed.shape[:-1], d).int()
    # e2m1 magnitude from the code bits: E == 0 -> M / 2, else 2^(E - 1) * (1 + M / 2).
    exponent, mantissa = (codes >> 1) & 3, (codes & 1).float()
    normal = (1 << exponent).float() * 0.5 * (1.0 + 0.5 * mantissa)
    magnitude = torch.where(exponent == 0, 0.5 * mantissa, normal)
    values = torch.where(codes >= 8, -magnitude, magnitude)

    # Block scales 2^(b - 127), exact (bits built directly); b == 255 is NaN in e8m0.
    b = scales[..., :nblocks].int()
    block_scale = torch.where(b == 255, torch.nan, _exp2_int((b - _E8M0_BIAS).clamp(max=127)))
    values = values.reshape(*packed.shape[:-1], nblocks, block) * block_scale.unsqueeze(-1)
    return values.reshape(*values.shape[:-2], d)


# ------------------------------------------------------------------------------------------ KV cache


def quantize_kv(kv_bf16: Tensor, fmt: str, fp8_dtype: torch.dtype = FP8_E4M3FN):
    """Store a KV cache in format `fmt`. kv_bf16: (total_kv, 1, 576) bf16. Returns the "kv entry":

      "bf16"   kv_bf16 itself
      "fp8"    (kv_q (total_kv, 1, 576) fp8_dtype, scale (1,) float32)
      "mxfp4"  (packed (total_kv, 1, 288) uint8, scales (total_kv, 18) uint8)
    """
    if fmt == "bf16":
        return kv_bf16
    if fmt == "fp8":
        return quantize_fp8(kv_bf16, fp8_dtype)
    if fmt == "mxfp4":
        packed, scales = quantize_mxfp4(kv_bf16)
        return packed, scales.reshape(kv_bf16.shape[0], -1)  # (total_kv, 1, 18) -> (total_kv, 18)
    raise ValueError(f"unknown KV format {fmt!r}; expected one of {KV_FORMATS}")


def dequantize_kv(kv_entry, fmt: str) -> Tensor:
    """Inverse of quantize_kv: kv_entry as quantize_kv returned it -> float32 (total_kv, 1, 576).

    For "mxfp4" the scales may be padded / strided, (total_kv, >= 18) (see dequantize_mxfp4).
    """
    if fmt == "bf16":
        return kv_entry.float()
    if fmt == "fp8":
        return dequantize_fp8(*kv_entry)
    if fmt == "mxfp4":
        packed, scales = kv_entry
        return dequantize_mxfp4(packed, scales.unsqueeze(-2))  # scales (total_kv, S) -> (total_kv, 1, S)
    raise ValueError(f"unknown KV format {fmt!r}; expected one of {KV_FORMATS}")
