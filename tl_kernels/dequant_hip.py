"""KV decode for gfx942 (MI300X) as HIP device functions: fp8 e4m3fnuz and mxfp4 (e2m1 + e8m0) codes to bf16 MFMA
operands, on whole 32-bit words, exact. The same outputs as the CUDA module (``tl_kernels/dequant.py``), each by what
is cheapest on gfx942's VALU (a conversion instruction for fp8, byte tables for e2m1); this module is self-contained.

Bit layouts (a "pair" is one 32-bit word holding two bf16: element 0 in bits 0..15, element 1 in bits 16..31):

e4m3fnuz -> bf16 (``mla_hip_fp8x16_to_bf16``: 16 codes, four words, to 8 pairs, element order kept)
    MI300X has a packed conversion, ``v_cvt_pk_f32_fp8`` (two fnuz codes of a word's low or high half to two f32,
    exact), and a byte permute (``v_perm_b32``) that takes the top half-words of two f32: that top half is the bf16
    of the value, exactly (e4m3 has 3 mantissa bits). Two instructions per pair, no scale, fnuz's NaN code (0x80)
    stays NaN. The bit placement of the CUDA module (a half-word holding ``code value * 2^-119`` here: fnuz's exponent
    bias is 8, not e4m3fn's 7) costs four instructions per pair (permute, shift, AND, AND-OR), so on gfx942 the
    conversion instruction wins (docs/gfx942.md compares the two).

e2m1 x e8m0 -> bf16 (``mla_hip_e2m1x16_to_bf16``: 16 codes, two words, plus the block's e8m0 byte e)
    Nibble i of a word is element i. A byte permute (``v_perm_b32``) selects bytes of two words by selector bytes
    0-7, so the three magnitude bits of a code index an 8-entry byte table: per block, ``mla_hip_e2m1_tables``
    builds the high and the low bytes of bf16(c * 2^(e - 127)) for the 8 magnitudes c (f32 products, exact over
    the whole e8m0 range, e = 255 NaN; 4 packed multiplies and 8 permutes); per word, the magnitudes of the even
    and of the odd codes become selectors (3 VALU), four permutes look up their high and low bytes, the signs go
    into the high bytes (3), and four permutes pair the bytes into bf16 pairs: 14 VALU per 8 codes where the
    previous bit placement (shift, mask, widen, two f32 multiplies, repack) took ~36. Element order: output pairs
    4 w .. 4 w + 3 hold codes 8 w + (0, 2), (4, 6), (1, 3), (5, 7); ``E2M1_ORDER`` lists the code of each output
    element; Q is loaded in the same order (Q K^T is a reduction, and V^T rows are written by their true dim). The
    rope share's 4 codes (``mla_hip_e2m1x4_to_bf16``) keep the bit placement: a table costs more than 4 codes.

Helpers: ``mla_hip_pair_tokens`` transposes the 8 pairs of two tokens into 8 + 8 (dim: token 0, token 1) pairs for
the V^T slice (one permute per output word); ``mla_hip_pack_bf16x2`` rounds two f32 to a bf16 pair (to nearest,
ties away from zero) and ``mla_hip_round_bf16`` one f32 the same way (P of the P V MFMA, finite in [0, 1]: each wave
rounds its own P value). ``mla_hip_fp8x4_to_bf16`` and ``mla_hip_e2m1x4_to_bf16`` decode a lane's rope share (4
codes): fp8 as the 16-code function, e2m1 by bit placement (see its comment).

Instruction counts per element (gfx942 code objects, ``tools/gfx942_report.py``): see docs/gfx942.md.
"""

import tilelang.language as T

CHUNK = 16  # codes per decode call: one 16-byte fp8 vector, one 8-byte mxfp4 vector (one e8m0 block half)
# Output element e of mla_hip_e2m1x16_to_bf16 holds code E2M1_ORDER[e] of its 16 (pairs 4w .. 4w + 3: codes 8w + (0, 2),
# (4, 6), (1, 3), (5, 7)).
def e2m1_order(e):
    """Code (of 16) held by output element e of mla_hip_e2m1x16_to_bf16; ints or TIR expressions."""
    return 8 * (e // 8) + 4 * (e // 2 % 2) + e // 4 % 2 + 2 * (e % 2)


E2M1_ORDER = tuple(e2m1_order(e) for e in range(CHUNK))
def e2m1x4_order(e):
    """Code (of 4) held by output element e of mla_hip_e2m1x4_to_bf16 (pair k: codes k, k + 2); ints or TIR."""
    return (e % 2) * 2 + e // 2


E2M1X4_ORDER = tuple(e2m1x4_order(e) for e in range(4))  # (0, 2, 1, 3)

HIP_SOURCE = r"""
typedef float mla_hip_f32x2 __attribute__((ext_vector_type(2)));
// The top half-words of two f32 as one pair (a: bits 0..15), one v_perm_b32. Takes scalars: clang's
// __builtin_bit_cast of a vector element (v.y) reads element 0 (seen with clang 19), so elements are copied first.
static __device__ inline __attribute__((always_inline)) unsigned mla_hip_top_halves(float a, float b) {
  return __builtin_amdgcn_perm(__builtin_bit_cast(unsigned, b), __builtin_bit_cast(unsigned, a), 0x07060302u);
}
// 16 e4m3fnuz codes (4 words) -> 8 bf16 pairs, element order kept, exact: v_cvt_pk_f32_fp8 + v_perm_b32 per pair.
static __device__ inline __attribute__((always_inline)) void mla_hip_fp8x16_to_bf16(void* dst, const void* src) {
  const unsigned* in = (const unsigned*)src;
  unsigned* out = (unsigned*)dst;
#pragma unroll
  for (int w = 0; w < 4; ++w) {
    const mla_hip_f32x2 lo = __builtin_amdgcn_cvt_pk_f32_fp8((int)in[w], false);
    const mla_hip_f32x2 hi = __builtin_amdgcn_cvt_pk_f32_fp8((int)in[w], true);
    out[2 * w] = mla_hip_top_halves(lo.x, lo.y);
    out[2 * w + 1] = mla_hip_top_halves(hi.x, hi.y);
  }
}
// 4 e4m3fnuz codes (one word) -> 2 bf16 pairs, element order kept (a wave's share of a token's rope dims).
static __device__ inline __attribute__((always_inline)) void mla_hip_fp8x4_to_bf16(void* dst, const void* src) {
  const unsigned in = *(const unsigned*)src;
  unsigned* out = (unsigned*)dst;
  const mla_hip_f32x2 lo = __builtin_amdgcn_cvt_pk_f32_fp8((int)in, false);
  const mla_hip_f32x2 hi = __builtin_amdgcn_cvt_pk_f32_fp8((int)in, true);
  out[0] = mla_hip_top_halves(lo.x, lo.y);
  out[1] = mla_hip_top_halves(hi.x, hi.y);
}
// e8m0 byte -> 2^(e - 127) as f32, exact over the whole range: e = 0 -> 2^-127 (subnormal), e = 255 -> NaN.
static __device__ inline __attribute__((always_inline)) float mla_hip_e8m0_to_f32(unsigned e) {
  e &= 255u;
  return __builtin_bit_cast(float, (e << 23) | ((e == 0u || e == 255u) ? 0x00400000u : 0u));
}
// The two byte tables of one e8m0 block byte e: entry i (byte i % 4 of word i / 4) of hi / lo is the high / low
// byte of bf16(c_i * 2^(e - 127)) for the e2m1 magnitude c_i = 0, 0.5, 1, 1.5, 2, 3, 4, 6 of the code's three low
// bits i. The products are f32 (mla_hip_e8m0_to_f32's factor: the whole e8m0 range, e = 255 NaN also for code 0),
// exact, and their top halves are the bf16 values exactly (2 significant bits): 4 packed multiplies, 4 permutes
// to bf16 pairs, 4 to the byte tables. No branch: a fast integer path for the usual e with a fallback for the corners costs
// less when it runs but, as a branch in the KV loop, more code than this.
static __device__ inline __attribute__((always_inline)) void mla_hip_e2m1_tables(unsigned e, unsigned* hi, unsigned* lo) {
  const float f = mla_hip_e8m0_to_f32(e);
  const mla_hip_f32x2 scale = {f, f};
  const mla_hip_f32x2 mags[4] = {{0.0f, 0.5f}, {1.0f, 1.5f}, {2.0f, 3.0f}, {4.0f, 6.0f}};
  unsigned pair[4];  // bf16 of entries (2 q, 2 q + 1): one packed multiply and one permute each
#pragma unroll
  for (int q = 0; q < 4; ++q) {
    const mla_hip_f32x2 v = mags[q] * scale;
    pair[q] = mla_hip_top_halves(v.x, v.y);
  }
#pragma unroll
  for (int w = 0; w < 2; ++w) {
    hi[w] = __builtin_amdgcn_perm(pair[2 * w + 1], pair[2 * w], 0x07050301u);
    lo[w] = __builtin_amdgcn_perm(pair[2 * w + 1], pair[2 * w], 0x06040200u);
  }
}
// 16 e2m1 codes (2 words) with e8m0 block byte e -> 8 bf16 pairs of the stored values (code * 2^(e - 127)), exact,
// by table look-up (v_perm_b32 selects bytes of two words by a selector byte 0-7: a code's magnitude bits): per word
// the magnitudes of the even and the odd codes as selectors (3 VALU), the high and low bytes of their values (4),
// the signs into the high bytes (3), then bytes to pairs (4): 14 VALU per 8 codes, plus the tables per 16.
// Pair (4 w + k) holds codes 8 w + (0, 2), (4, 6), (1, 3), (5, 7) for k = 0 .. 3 (``E2M1_ORDER``).
static __device__ inline __attribute__((always_inline)) void mla_hip_e2m1x16_to_bf16(void* dst, const void* src, unsigned e) {
  const unsigned* in = (const unsigned*)src;
  unsigned* out = (unsigned*)dst;
  unsigned hi[2], lo[2];
  mla_hip_e2m1_tables(e, hi, lo);
#pragma unroll
  for (int w = 0; w < 2; ++w) {
    const unsigned x = in[w];
    const unsigned even = x & 0x07070707u, odd = (x >> 4) & 0x07070707u;  // byte k: codes 2k, 2k + 1
    const unsigned h_even = __builtin_amdgcn_perm(hi[1], hi[0], even) | ((x << 4) & 0x80808080u);
    const unsigned h_odd = __builtin_amdgcn_perm(hi[1], hi[0], odd) | (x & 0x80808080u);
    const unsigned l_even = __builtin_amdgcn_perm(lo[1], lo[0], even);
    const unsigned l_odd = __builtin_amdgcn_perm(lo[1], lo[0], odd);
    out[4 * w] = __builtin_amdgcn_perm(h_even, l_even, 0x05010400u);
    out[4 * w + 1] = __builtin_amdgcn_perm(h_even, l_even, 0x07030602u);
    out[4 * w + 2] = __builtin_amdgcn_perm(h_odd, l_odd, 0x05010400u);
    out[4 * w + 3] = __builtin_amdgcn_perm(h_odd, l_odd, 0x07030602u);
  }
}
// 4 e2m1 codes (the 16-bit half-word at src, code i = nibble i) with e8m0 block byte e -> 2 bf16 pairs of the
// stored values, pair k = codes (k, k + 2), by bit placement (for 4 codes a table costs more): the two bytes are
// moved 16 bits apart (one AND-OR), so one shift moves the magnitude bits of codes k and k + 2 to bits 8..6 / 24..22
// (bf16 exponent field 0..3: each half-word is exactly code * 2^-126, the subnormal 0.5 included) and their signs to
// bits 15 / 31; each half is widened to f32, multiplied by 2^126 and by 2^(e - 127) (exact: 2 significant bits),
// and the top halves are packed back.
static __device__ inline __attribute__((always_inline)) void mla_hip_e2m1x4_to_bf16(void* dst, const void* src, unsigned e) {
  const unsigned h = *(const unsigned short*)src;
  const unsigned x = (h & 0xffu) | ((h & 0xff00u) << 8);
  unsigned* out = (unsigned*)dst;
  const float f = mla_hip_e8m0_to_f32(e);
  const mla_hip_f32x2 scale = {f, f};
  const mla_hip_f32x2 unplace = {0x1p126f, 0x1p126f};
#pragma unroll
  for (int k = 0; k < 2; ++k) {
    const unsigned mag = (x << (6 - 4 * k)) & 0x01c001c0u;
    const unsigned sgn = (x << (12 - 4 * k)) & 0x80008000u;
    const unsigned p = mag | sgn;
    mla_hip_f32x2 v = {__builtin_bit_cast(float, p << 16), __builtin_bit_cast(float, p & 0xffff0000u)};
    v = v * unplace * scale;
    out[k] = mla_hip_top_halves(v.x, v.y);
  }
}
// Two tokens' 8 pairs each (t0, t1: elements 2i, 2i + 1 of pair i) -> 16 pairs (element e: token 0, token 1).
static __device__ inline __attribute__((always_inline)) void mla_hip_pair_tokens(void* dst, const void* t0, const void* t1) {
  const unsigned* a = (const unsigned*)t0;
  const unsigned* b = (const unsigned*)t1;
  unsigned* out = (unsigned*)dst;
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    out[2 * i] = __builtin_amdgcn_perm(b[i], a[i], 0x05040100u);
    out[2 * i + 1] = __builtin_amdgcn_perm(b[i], a[i], 0x07060302u);
  }
}
// One f32 -> bf16 at dst, rounded as mla_hip_pack_bf16x2 rounds (to nearest, ties away from zero).
static __device__ inline __attribute__((always_inline)) void mla_hip_round_bf16(void* dst, float a) {
  *(unsigned short*)dst = (unsigned short)((__builtin_bit_cast(unsigned, a) + 0x8000u) >> 16);
}
// Two f32 -> one bf16 pair, rounded to nearest (ties away from zero); for finite inputs and NaN (stays NaN).
static __device__ inline __attribute__((always_inline)) void mla_hip_pack_bf16x2(void* dst, float a, float b) {
  *(unsigned*)dst = __builtin_amdgcn_perm(__builtin_bit_cast(unsigned, b) + 0x8000u,
                                          __builtin_bit_cast(unsigned, a) + 0x8000u, 0x07060302u);
}
"""


def import_hip_source():
    """Adds the device functions to the kernel's HIP source (call once inside ``T.Kernel``)."""
    T.import_source(HIP_SOURCE)


def fp8x16_to_bf16(dst, src):
    """16 e4m3fnuz codes at ``src`` (address of a local fp8 / byte array) -> 16 bf16 at ``dst``, exact."""
    return T.evaluate(T.call_extern("handle", "mla_hip_fp8x16_to_bf16", dst, src))


def e2m1x16_to_bf16(dst, src, scale_byte):
    """16 e2m1 codes (8 bytes) at ``src`` with the block's e8m0 byte -> 16 bf16 at ``dst`` in ``E2M1_ORDER``."""
    return T.evaluate(T.call_extern("handle", "mla_hip_e2m1x16_to_bf16", dst, src, scale_byte))


def fp8x4_to_bf16(dst, src):
    """4 e4m3fnuz codes (one word) at ``src`` -> 4 bf16 at ``dst``, exact, order kept."""
    return T.evaluate(T.call_extern("handle", "mla_hip_fp8x4_to_bf16", dst, src))


def e2m1x4_to_bf16(dst, src, scale_byte):
    """4 e2m1 codes (2 bytes) at ``src`` with the block's e8m0 byte -> 4 bf16 at ``dst`` in ``E2M1X4_ORDER``."""
    return T.evaluate(T.call_extern("handle", "mla_hip_e2m1x4_to_bf16", dst, src, scale_byte))


def pair_tokens(dst, t0, t1):
    """16 bf16 of token 0 and of token 1 -> 16 (token 0, token 1) pairs at ``dst`` (32 bf16)."""
    return T.evaluate(T.call_extern("handle", "mla_hip_pair_tokens", dst, t0, t1))


def round_bf16(dst, a):
    """One f32 -> bf16 at ``dst`` (rounded to nearest, as ``pack_bf16x2``)."""
    return T.evaluate(T.call_extern("handle", "mla_hip_round_bf16", dst, a))


def pack_bf16x2(dst, a, b):
    """Two f32 -> a bf16 pair at ``dst`` (rounded to nearest)."""
    return T.evaluate(T.call_extern("handle", "mla_hip_pack_bf16x2", dst, a, b))
