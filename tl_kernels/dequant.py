"""KV decode by bit placement: fp8 e4m3 and mxfp4 (e2m1 + e8m0) codes to bf16 MMA operands, with no conversion
instruction. The design, shared by every target (this module holds the CUDA device functions; the gfx942 program
uses the same bit layout and scale folding):

e4m3 -> bf16 (``mla_fp8x16_to_bf16``: 16 codes, four 32-bit words, to 16 bf16)
    The sign stays the top bit of its half-word; the 7 exponent + mantissa bits move right by 4 into bf16's
    exponent and top mantissa bits. The result is exactly ``code value * 2^-120`` (e4m3's bias 7 against bf16's
    127; its subnormals land on bf16 subnormals, also exact). The 2^120 is folded, with the per-tensor scale, into
    the score scale (K) and the output scale (V): see ``FP8_BF16_FACTOR``. Per pair of codes: one byte permute, one
    shift, one AND and one three-input logic op. e4m3fn's NaN codes (0x7f / 0xff) decode to +-480 (the cache never
    holds them: quantizers saturate).

e2m1 x e8m0 -> bf16 (``mla_e2m1x16_to_bf16``: 16 codes, two 32-bit words, plus the block's scale byte)
    The nibble's sign goes to bit 15, its two exponent bits and its mantissa bit to bits 8..6: bf16 exponent field
    0..3, so the half-word is exactly ``code value * 2^-126`` (the e2m1 subnormal 0.5 lands on a bf16 subnormal).
    One bf16x2 multiply per pair by 2^(e - 1) makes it ``code * 2^(e - 127)``, the stored value, exactly. bf16 holds
    2^(e - 1) only for e <= 128, so a block with e > 128 takes a second multiply by 2^(e - 128) (e == 255, NaN in
    e8m0, multiplies by NaN). Per pair: one byte permute, two shifts, two logic ops, one multiply.

Loads: ``mla_ld_global_16`` / ``_8`` read whole vectors of the cache into registers (read once: not kept in L1),
``mla_ld_global_u8`` one scale byte; they are inline PTX, so the compiler keeps them where the program issues them
(before the wait that follows), and nothing in them can be bounds-checked into a branch.
"""

import tilelang.language as T

from tl_kernels.steps import MXFP4_BLOCK

FP8_BF16_FACTOR = 2.0**120  # mla_fp8x16_to_bf16 yields code * 2^-120: scores and outputs are scaled back by this
CHUNK = 16  # codes per decode call (one 16-byte fp8 vector, one 8-byte mxfp4 vector)
FP8_CHUNK_WORDS = 4  # 32-bit words of one fp8 chunk
MXFP4_CHUNK_WORDS = 2  # 32-bit words of one mxfp4 chunk

CUDA_SOURCE = r"""
__device__ __forceinline__ unsigned mla_prmt(unsigned a, unsigned b, unsigned sel) {
  unsigned d;
  asm("prmt.b32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(sel));
  return d;
}
__device__ __forceinline__ unsigned mla_mul_bf16x2(unsigned a, unsigned b) {
  unsigned d;
  asm("mul.rn.bf16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
  return d;
}
// Whole-vector loads of cache bytes into a thread's registers (dst: a local array of 32-bit words).
__device__ __forceinline__ void mla_ld_global_16(void* dst, const void* src) {
  unsigned* d = (unsigned*)dst;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(d[0]), "=r"(d[1]), "=r"(d[2]), "=r"(d[3]) : "l"(src));
}
__device__ __forceinline__ void mla_ld_global_8(void* dst, const void* src) {
  unsigned* d = (unsigned*)dst;
  asm volatile("ld.global.nc.L1::no_allocate.v2.u32 {%0, %1}, [%2];" : "=r"(d[0]), "=r"(d[1]) : "l"(src));
}
__device__ __forceinline__ unsigned mla_ld_global_u8(const void* src) {
  unsigned v;
  asm volatile("ld.global.nc.u8 %0, [%1];" : "=r"(v) : "l"(src));
  return v;
}
// A shared-memory address as the 32-bit offset st.shared takes.
__device__ __forceinline__ unsigned mla_smem_addr(const void* p) {
  return (unsigned)__cvta_generic_to_shared(p);
}
// 16 bf16 (8 words from src) into a 128-byte-swizzled shared tile: words 0-3 at addr, words 4-7 at addr ^ 16 (the
// swizzle keeps a 32-byte chunk's two 16-byte halves in slots that differ in address bit 4). By address, so the
// compiler's shared-memory analysis sees no buffer access to order with barriers.
__device__ __forceinline__ void mla_st_shared_swz32(unsigned addr, const void* src) {
  const unsigned* v = (const unsigned*)src;
  asm volatile("st.shared.v4.b32 [%0], {%1, %2, %3, %4};"
               :: "r"(addr), "r"(v[0]), "r"(v[1]), "r"(v[2]), "r"(v[3]) : "memory");
  asm volatile("st.shared.v4.b32 [%0], {%1, %2, %3, %4};"
               :: "r"(addr ^ 16u), "r"(v[4]), "r"(v[5]), "r"(v[6]), "r"(v[7]) : "memory");
}
// 16 e4m3 codes (4 words) -> 16 bf16 (8 words) holding code * 2^-120.
__device__ __forceinline__ void mla_fp8x16_to_bf16(void* dst, const void* src) {
  const unsigned* in = (const unsigned*)src;
  unsigned* out = (unsigned*)dst;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    unsigned lo = mla_prmt(in[i], 0u, 0x1404u);  // [b1, 0, b0, 0]: each code in the high byte of its half-word
    unsigned hi = mla_prmt(in[i], 0u, 0x3424u);  // [b3, 0, b2, 0]
    out[2 * i] = (lo & 0x80008000u) | ((lo >> 4) & 0x07F007F0u);
    out[2 * i + 1] = (hi & 0x80008000u) | ((hi >> 4) & 0x07F007F0u);
  }
}
// 16 e2m1 codes (2 words, low nibble first) with their block's e8m0 byte e -> 16 bf16 (8 words), code * 2^(e-127).
__device__ __forceinline__ void mla_e2m1x16_to_bf16(void* dst, const void* src, unsigned e) {
  const unsigned* in = (const unsigned*)src;
  unsigned* out = (unsigned*)dst;
  unsigned e_lo = e < 128u ? e : 128u;
  unsigned f = (e_lo + 126u) << 7;  // bf16 2^(e - 1) for e <= 128
  f |= f << 16;
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    unsigned odd = in[i] >> 4;  // byte k: the odd code of byte k of the word in its low nibble
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      // low half-word: code 2k (low nibble of byte k), high half-word: code 2k + 1
      unsigned s = mla_prmt(in[i], odd, (unsigned)(k | (k << 4) | ((k + 4) << 8) | ((k + 4) << 12)));
      unsigned v = ((s << 6) & 0x01C001C0u) | ((s << 12) & 0x80008000u);  // code * 2^-126
      out[4 * i + k] = mla_mul_bf16x2(v, f);
    }
  }
  if (e > 128u) {  // 2^(e - 1) is past bf16's range: the rest of the factor, 2^(e - 128) (NaN for e == 255)
    unsigned g = e == 255u ? 0x7FC07FC0u : (((e - 1u) << 7) | ((e - 1u) << 23));
#pragma unroll
    for (int j = 0; j < 8; ++j) out[j] = mla_mul_bf16x2(out[j], g);
  }
}
"""


# ``ordered_decode``: the decoders' free-stage wait returns a 0 that every decode takes as an operand.
ORDERED_CUDA_SOURCE = r"""
// Waits for phase ``parity`` of the mbarrier at ``bar``, then returns the word at ``zero_word`` (shared memory, always
// 0): decode instructions that take it as an operand stay below the wait (ptxas otherwise hoists them above it, and
// with them the wait for every outstanding load of the thread, which then no longer overlaps the wait for the
// stage). The 0 is a shared load ordered after the wait's acquire, not a value derived from the wait's predicate:
// ptxas 13.0 turned such a value into a uniform predicate that only the wait's retry path set, so a wait that
// succeeded at once returned garbage (docs/perf.md, run 33).
__device__ __forceinline__ unsigned mla_mbar_wait_zero(void* bar, unsigned parity, const void* zero_word) {
  unsigned addr = (unsigned)__cvta_generic_to_shared(bar);
  asm volatile("{\n .reg .pred p;\n LAB_WAIT:\n mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n"
               " @!p bra LAB_WAIT;\n}" :: "r"(addr), "r"(parity) : "memory");
  unsigned z;
  asm volatile("ld.shared.u32 %0, [%1];" : "=r"(z) : "r"((unsigned)__cvta_generic_to_shared(zero_word)) : "memory");
  return z;
}
// The decodes after such a wait: ``z`` (0) folded into the codes (and the scale byte), so they stay below it.
__device__ __forceinline__ void mla_fp8x16_to_bf16_z(void* dst, const void* src, unsigned z) {
  const unsigned* in = (const unsigned*)src;
  unsigned codes[4] = {in[0] | z, in[1] | z, in[2] | z, in[3] | z};
  mla_fp8x16_to_bf16(dst, codes);
}
__device__ __forceinline__ void mla_e2m1x16_to_bf16_z(void* dst, const void* src, unsigned e, unsigned z) {
  const unsigned* in = (const unsigned*)src;
  unsigned codes[2] = {in[0] | z, in[1] | z};
  mla_e2m1x16_to_bf16(dst, codes, e | z);
}
"""

# L2 prefetch of a byte range (TMA's bulk prefetch: one instruction per contiguous range, no register, no
# scoreboard; a hint, so nothing waits on it). The range is widened to 16-byte boundaries as the instruction needs:
# the caching allocator's 512-byte granules keep the widened range inside mapped memory.
PREFETCH_CUDA_SOURCE = r"""
__device__ __forceinline__ void mla_prefetch_l2(const void* src, unsigned nbytes) {
  unsigned long long lo = (unsigned long long)src & ~15ull;
  unsigned size = (unsigned)(((unsigned long long)src + nbytes + 15ull - lo) & ~15ull);
  if (nbytes) asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" :: "l"(lo), "r"(size) : "memory");
}
"""


# fp8 V^T for the fp8 wgmma (``WSDecodeKernelConfig.fp8_mma``): wgmma reads 8-bit operands K-major only, so P V
# needs V with the tile's tokens contiguous per latent dim. Thread p (0..127) of the transposing warp group moves 16
# blocks of 4 tokens x 4 dims of the tile's 64 x 512 latent codes: src is the ring stage ([64][512], TileLang's
# 128-byte swizzle: 8 KiB panels of 128 dims, 16-byte chunk c of row j at c ^ (j % 8)), dst the V^T stage ([512][64],
# 64-byte swizzle: chunk c of row d at c ^ (d / 2 % 4)). Per block: four 4-byte loads (4 tokens, 4 dims each), a
# byte transpose of three byte permutes per word, four 4-byte stores (4 dims, 4 tokens each). Lane l of warp w takes
# dims 4 dq .. 4 dq + 3 and tokens 4 jq .. 4 jq + 3 with dq = 8 (b % 16) + l % 8, jq = 4 (b / 16) + l / 8 in block
# group b = 4 it + w (it = 0..15, loads issued 8 blocks at a time); it loads its rows in the order i ^ g and stores
# its dims in the order k ^ f (g, f from the lane bits), which makes every load and store of a warp hit 32 distinct
# banks (tests/test_ws_structure.py models the mapping). The byte permutes take the orders as run-time selectors, so
# no register is picked by a lane's value. Every address is a per-lane part, computed once per call, plus (loads)
# or XOR-and-plus (stores) a part of the block group alone: an access costs at most one instruction besides itself
# (run 49: per-access swizzle arithmetic made the transposer ~1460 instructions per thread and tile, the ring's
# bound; now ~450). The XOR needs the V^T stage's address bits 4-5 clear (a 64-byte-swizzled operand's base is
# 512-byte aligned).
TRANSPOSE_CUDA_SOURCE = r"""
__device__ __forceinline__ void mla_transpose_v_fp8(unsigned src, unsigned dst, int p) {
  const int lane = p & 31, warp = p >> 5;
  const int g = ((lane >> 4) & 1) << 1;  // row order of the loads: i ^ g
  const int f = (lane >> 1) & 3;         // dim order of the stores: k ^ f
  const unsigned sel_out = g ? 0x1054u : 0x5410u;
  // Block group it = 0..15 (b = 4 it + warp) holds dims dq = 32 (it % 4) + 8 warp + lane % 8 and token quads
  // jq = 4 (it / 4) + lane / 8: every address is a per-lane part (below, once per call) plus a part of it alone.
  // Loads: + 8192 (it % 4) (the panel) + 2048 (it / 4) (16 rows), an immediate. Stores: + 8192 (it % 4) (128 V^T
  // rows), and (it / 4) << 4 XORed into the 64-byte swizzle's chunk bits (bits 4-5, zero in the rest).
  const int cq = (2 * warp + ((lane & 7) >> 2)) & 7;  // the lane's 16-byte chunk of a 128-byte row, unswizzled
  unsigned ld[4], st[4], sel_in[4];
  #pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int jj = 4 * (lane >> 3) + (i ^ g);  // row within the block group's 16
    ld[i] = src + jj * 128 + ((cq ^ (jj & 7)) << 4) + (lane & 3) * 4;
  }
  #pragma unroll
  for (int k = 0; k < 4; ++k) {
    const int m = k ^ f;  // this store's dim 4 dq + m: byte m of every row word
    const int dl = 32 * warp + 4 * (lane & 7) + m;  // V^T row within the block group's 128
    st[k] = dst + dl * 64 + (((dl >> 1) & 3) << 4) + ((lane >> 3) & 3) * 4;
    sel_in[k] = (unsigned)(m | ((m + 4) << 4));
  }
  #pragma unroll
  for (int half = 0; half < 2; ++half) {
    // 8 blocks' loads issued before the first permute: one shared-memory round trip per 8 blocks
    unsigned r[8][4];
    #pragma unroll
    for (int h = 0; h < 8; ++h) {
      const int it = half * 8 + h;
      #pragma unroll
      for (int i = 0; i < 4; ++i) {
        asm volatile("ld.shared.b32 %0, [%1];" : "=r"(r[h][i]) : "r"(ld[i] + (it & 3) * 8192 + (it >> 2) * 2048)
                     : "memory");
      }
    }
    #pragma unroll
    for (int h = 0; h < 8; ++h) {
      const int it = half * 8 + h;
      #pragma unroll
      for (int k = 0; k < 4; ++k) {
        const unsigned x = __byte_perm(r[h][0], r[h][1], sel_in[k]), y = __byte_perm(r[h][2], r[h][3], sel_in[k]);
        const unsigned w = __byte_perm(x, y, sel_out);  // tokens 4 jq .. 4 jq + 3 in order
        const unsigned a = (st[k] ^ (unsigned)(((it >> 2) & 3) << 4)) + (it & 3) * 8192;
        asm volatile("st.shared.b32 [%0], %1;" :: "r"(a), "r"(w) : "memory");
      }
    }
  }
}
"""


# ``score_ahead``: the transposer zeroes the V^T ring once per CTA, so that a P V over a slot without a tile (its P
# all zero) never multiplies bytes that were never written (e4m3's NaN codes would survive 0 * NaN).
ZERO_SHARED_CUDA_SOURCE = r"""
__device__ __forceinline__ void mla_zero_shared(unsigned addr, int nbytes, int p, int nthreads) {
  for (int off = 16 * p; off < nbytes; off += 16 * nthreads)
    asm volatile("st.shared.v4.u32 [%0], {%1, %1, %1, %1};" :: "r"(addr + off), "r"(0) : "memory");
}
"""


def zero_shared(addr, nbytes, p, nthreads):
    """Thread ``p`` of ``nthreads`` zeroes its 16-byte share of ``nbytes`` of shared memory at ``addr``
    (``ZERO_SHARED_CUDA_SOURCE``)."""
    return T.call_extern("handle", "mla_zero_shared", addr, nbytes, p, nthreads)


def import_cuda_source(prefetch: bool = False, ordered: bool = False, extra: str = ""):
    """Adds the device functions to the kernel being built (call once inside its ``T.Kernel``: a kernel takes one
    imported source); ``prefetch`` adds ``mla_prefetch_l2`` too, ``ordered`` ``ORDERED_CUDA_SOURCE``, ``extra`` any
    other device functions."""
    T.import_source(CUDA_SOURCE + (PREFETCH_CUDA_SOURCE if prefetch else "") + (ORDERED_CUDA_SOURCE if ordered else "")
                    + extra)


def prefetch_l2(src, nbytes):
    """Prefetch ``nbytes`` bytes from the address of ``src`` (a global buffer element) into L2."""
    return T.call_extern("handle", "mla_prefetch_l2", T.access_ptr(src, "r"), nbytes)


def load_vector(dst, src, nbytes: int):
    """``nbytes`` (16 or 8) bytes at the address of ``src`` (a global buffer element, e.g. ``KV[row, col]``) into
    the local 32-bit words starting at ``dst`` (a local buffer element)."""
    fn = {16: "mla_ld_global_16", 8: "mla_ld_global_8"}[nbytes]
    return T.call_extern("handle", fn, T.access_ptr(dst, "w"), T.access_ptr(src, "r"))


def load_byte(src):
    """One byte of a global buffer (e.g. an e8m0 scale) as uint32."""
    return T.call_extern("uint32", "mla_ld_global_u8", T.access_ptr(src, "r"))


def chunk_words(kv_format: str) -> int:
    """32-bit words of one 16-code chunk of ``kv_format`` ("fp8" or "mxfp4")."""
    return MXFP4_CHUNK_WORDS if kv_format == "mxfp4" else FP8_CHUNK_WORDS


@T.macro
def load_chunk(kv_format, raw, scale, scale_index, KV, KV_scales, scale_stride, row, dim):
    """Issue the loads of the 16-code chunk at (cache ``row``, element ``dim``) into the local words from ``raw``
    (a local buffer element) and, for mxfp4, its block's scale byte into ``scale[scale_index]``."""
    if kv_format == "mxfp4":
        T.evaluate(load_vector(raw, KV[row, dim // 2], 8))
        scale[scale_index] = load_byte(KV_scales[row * scale_stride + dim // MXFP4_BLOCK])
    else:
        T.evaluate(load_vector(raw, KV[row, dim], 16))


def decode_chunk(kv_format, dst, src, scale_byte=None, z=None):
    """One chunk of ``kv_format`` decoded: ``fp8x16_to_bf16`` or ``e2m1x16_to_bf16`` (``scale_byte``: mxfp4's)."""
    if kv_format == "mxfp4":
        return e2m1x16_to_bf16(dst, src, scale_byte, z)
    return fp8x16_to_bf16(dst, src, z)


def fp8x16_to_bf16(dst, src, z=None):
    """16 e4m3 codes in the four local words from ``src`` -> 16 bf16 from ``dst`` (a local bf16 buffer element),
    each ``code * 2^-120`` (see the module docstring). ``z``: the 0 of ``mbar_wait_zero``, which keeps the decode
    below that wait (``ORDERED_CUDA_SOURCE``)."""
    if z is None:
        return T.call_extern("handle", "mla_fp8x16_to_bf16", T.access_ptr(dst, "w"), T.access_ptr(src, "r"))
    return T.call_extern("handle", "mla_fp8x16_to_bf16_z", T.access_ptr(dst, "w"), T.access_ptr(src, "r"), z)


def mbar_wait_zero(barrier, parity, zero_word):
    """Wait for phase ``parity`` of ``barrier`` (a barrier buffer element); returns ``zero_word`` (a shared uint32
    element holding 0), read after the wait, a 0 the decodes take (their ``z``) so that the compiler keeps them below
    the wait (``mla_mbar_wait_zero``)."""
    return T.call_extern("uint32", "mla_mbar_wait_zero", T.access_ptr(barrier, "rw"), parity,
                         T.access_ptr(zero_word, "r"))


def smem_addr(elem):
    """The 32-bit shared-memory address of ``elem`` (a shared buffer element, after its layout)."""
    return T.call_extern("uint32", "mla_smem_addr", T.access_ptr(elem, "w"))


def store_swizzled_32(addr, src):
    """The 16 bf16 from ``src`` (a local buffer element) into a 128-byte-swizzled shared tile at ``addr``
    (``mla_st_shared_swz32``)."""
    return T.call_extern("handle", "mla_st_shared_swz32", addr, T.access_ptr(src, "r"))


def transpose_v_fp8(src_addr, dst_addr, p):
    """Thread ``p`` (0..127) of the transposing warp group's share of one tile's fp8 V^T: from the ring stage at
    shared address ``src_addr`` to the V^T stage at ``dst_addr`` (``TRANSPOSE_CUDA_SOURCE``)."""
    return T.call_extern("handle", "mla_transpose_v_fp8", src_addr, dst_addr, p)


def e2m1x16_to_bf16(dst, src, scale_byte, z=None):
    """16 e2m1 codes in the two local words from ``src`` with their block's e8m0 byte -> 16 bf16 from ``dst``,
    each exactly ``code * 2^(e - 127)``. ``z``: as for ``fp8x16_to_bf16``."""
    if z is None:
        return T.call_extern("handle", "mla_e2m1x16_to_bf16", T.access_ptr(dst, "w"), T.access_ptr(src, "r"),
                             scale_byte)
    return T.call_extern("handle", "mla_e2m1x16_to_bf16_z", T.access_ptr(dst, "w"), T.access_ptr(src, "r"),
                         scale_byte, z)


# mxfp4 on the fp8 wgmma (``WSDecodeKernelConfig.fp8_mma`` with an mxfp4 cache; issue 28 step 4). e2m1 codes are
# exact in e4m3 under a power of two, but a token's 18 blocks have their own: the decoder writes each code as the
# e4m3 of ``code * 2^(e_b - E + MX_HEADROOM)``, E the token's exponent (its largest e8m0 byte among blocks holding a
# nonzero code, at least MX_E_FLOOR; 255 if any byte is 255, e8m0's NaN), and hands the consumer 2^(E - 133) per
# token: a column factor of the scores and, for P V, an offset of the softmax argument (``mx_columns``).
# Exact while E - e_b <= 14 (e2m1's 0.5 .. 6 times 2^-8 .. 2^6 over e4m3fn's 2^-9 .. 448); a block further below
# its token's largest reads as zero (for a quantizer that scales each block to its amax, < 2^-14 of the token's
# largest magnitude); blocks below 2^(MX_E_FLOOR - 14 - 127) likewise.
MX_HEADROOM = 6  # the token's largest block lands on e4m3's top binades (6 * 2^6 = 384 <= 448)
MX_E_FLOOR = 69  # E >= 69: the column values 2^(E - 133) and 2^(133 - E) stay within 2^+-64
MX_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # e2m1 magnitude codes 0..7
MX_TABLES = 16  # table t: magnitudes times 2^(t - 9); t = 0 (2^-9): all zero (flushed)


def e4m3fn_byte(value: float) -> int:
    """The e4m3fn code of a nonnegative value that e4m3fn holds exactly (raises otherwise)."""
    if value == 0:
        return 0
    for code in range(0x7F):
        exp, man = code >> 3, code & 7
        v = (man / 8) * 2.0**-6 if exp == 0 else (1 + man / 8) * 2.0 ** (exp - 7)
        if v == value:
            return code
    raise ValueError(f"{value} is not exact in e4m3fn")


def mx_table_words() -> tuple[int, ...]:
    """The decode tables, two 32-bit words each (table t's byte m: e4m3fn of magnitude m times 2^(t - 9)); table 0
    is all zero (a block more than 14 binades below its token's exponent)."""
    words = []
    for t in range(MX_TABLES):
        scale = 2.0 ** (t - 9)
        b = [0] * 8 if t == 0 else [e4m3fn_byte(m * scale) for m in MX_MAGNITUDES]
        words += [b[0] | b[1] << 8 | b[2] << 16 | b[3] << 24, b[4] | b[5] << 8 | b[6] << 16 | b[7] << 24]
    return tuple(words)


MX_E4M3_CUDA_SOURCE = r"""
// 4 e2m1 codes (the nibbles of w's low half-word, code k in nibble k) -> 4 e4m3fn codes (byte k), from the 8-byte
// table t of the magnitudes' codes: one permute picks the magnitudes (selector nibbles = the codes' 3 low bits);
// a second, with the codes as they are, gives 0x80 where the code is positive and 0xFF (sign replicated) where it
// is negative; its bit 6, moved up, is the sign. 5 instructions.
__device__ __forceinline__ unsigned mla_e2m1x4_to_e4m3(unsigned w, unsigned t_lo, unsigned t_hi) {
  const unsigned mag = mla_prmt(t_lo, t_hi, w & 0x7777u);
  const unsigned sgn = mla_prmt(0x80808080u, 0x80808080u, w);
  return mag | ((sgn << 1) & 0x80808080u);
}
// The token exponent E of the decoder thread pair (p, p ^ 1) that holds a token's two halves: the largest e8m0
// byte among its 9 blocks (4 words of codes each, at raw) that hold a nonzero code or are NaN (255), at least
// MLA_MX_E_FLOOR, the larger of the pair's (one shuffle; every lane of the warp takes part).
__device__ __forceinline__ unsigned mla_mx_token_exp(const void* raw_ptr, const void* scale_ptr) {
  const unsigned* raw = (const unsigned*)raw_ptr;
  const unsigned* sc = (const unsigned*)scale_ptr;
  unsigned e = MLA_MX_E_FLOOR;
#pragma unroll
  for (int b = 0; b < 9; ++b) {
    const unsigned any = (raw[4 * b] | raw[4 * b + 1] | raw[4 * b + 2] | raw[4 * b + 3]) & 0x77777777u;
    e = max(e, (any != 0u || sc[b] == 255u) ? sc[b] : 0u);
  }
  return max(e, __shfl_xor_sync(0xffffffffu, e, 1));
}
// The consumer's values of a token of exponent E, at addr (this token's float of the slot's first array; the
// three arrays 256 bytes apart): the score factor 2^(E - 133), the softmax offset E - 133 and the denominator
// weight 2^(133 - E) (all NaN for E == 255).
__device__ __forceinline__ void mla_mx_store_columns(unsigned addr, unsigned E) {
  const bool nan = E == 255u;
  const unsigned f = nan ? 0x7FC00000u : (E - 6u) << 23;
  const unsigned w = nan ? 0x7FC00000u : (260u - E) << 23;
  const float c = nan ? __int_as_float(0x7FC00000) : (float)((int)E - 133);
  asm volatile("st.shared.b32 [%0], %1;" :: "r"(addr), "r"(f) : "memory");
  asm volatile("st.shared.f32 [%0], %1;" :: "r"(addr + 256u), "f"(c) : "memory");
  asm volatile("st.shared.b32 [%0], %1;" :: "r"(addr + 512u), "r"(w) : "memory");
}
// One 32-code block (4 words at raw) with e8m0 byte e under token exponent E -> 32 e4m3fn codes, stored as two
// 16-byte chunks at shared addresses a0 (codes 0..15) and a1 (16..31). The table (MLA_MX_TABLES pairs of words at
// table_addr): e - E + 15, clamped to 0 .. 15 (a block with no nonzero code may lie above E: any table decodes it).
__device__ __forceinline__ void mla_mx_block_to_e4m3(unsigned a0, unsigned a1, const void* raw_ptr, unsigned e,
                                                     unsigned E, unsigned table_addr) {
  const unsigned* raw = (const unsigned*)raw_ptr;
  const int t = min(max((int)e - (int)E + 15, 0), 15);
  unsigned t_lo, t_hi;
  asm volatile("ld.shared.v2.u32 {%0, %1}, [%2];" : "=r"(t_lo), "=r"(t_hi) : "r"(table_addr + 8u * t) : "memory");
  unsigned o[8];
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    o[2 * k] = mla_e2m1x4_to_e4m3(raw[k], t_lo, t_hi);
    o[2 * k + 1] = mla_e2m1x4_to_e4m3(raw[k] >> 16, t_lo, t_hi);
  }
  asm volatile("st.shared.v4.b32 [%0], {%1, %2, %3, %4};" :: "r"(a0), "r"(o[0]), "r"(o[1]), "r"(o[2]), "r"(o[3])
               : "memory");
  asm volatile("st.shared.v4.b32 [%0], {%1, %2, %3, %4};" :: "r"(a1), "r"(o[4]), "r"(o[5]), "r"(o[6]), "r"(o[7])
               : "memory");
}
""".replace("MLA_MX_E_FLOOR", f"{MX_E_FLOOR}u")


def mx_token_exp(raw, scale):
    """The token exponent of the decoder thread pair (``mla_mx_token_exp``): ``raw`` the thread's 36 code words,
    ``scale`` its 9 scale words (local buffer elements)."""
    return T.call_extern("uint32", "mla_mx_token_exp", T.access_ptr(raw, "r"), T.access_ptr(scale, "r"))


def mx_store_columns(addr, token_exp):
    """The consumer's column values of a token at shared address ``addr`` (``mla_mx_store_columns``)."""
    return T.call_extern("handle", "mla_mx_store_columns", addr, token_exp)


def mx_block_to_e4m3(addr0, addr1, raw, scale_byte, token_exp, table_addr):
    """One 32-code block from ``raw`` (a local word) into the e4m3 ring at two chunk addresses
    (``mla_mx_block_to_e4m3``)."""
    return T.call_extern("handle", "mla_mx_block_to_e4m3", addr0, addr1, T.access_ptr(raw, "r"), scale_byte,
                         token_exp, table_addr)
