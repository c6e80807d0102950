"""The steps every MLA decode family shares, written once: the problem's constants, the split of a sequence's KV
tokens, Q rounding for a8w8, the scale folding, the online-softmax step, the writes of a pass's output or partial
with its LSE, and the fused split merge of the block-level kernel (behind a grid-wide barrier).

Expressions are plain functions (they build TIR expressions from their arguments); statements are ``@T.macro``s,
which TileLang inlines where they are called, so a family that calls them generates exactly the code it would with
the statements written out. They take the family's static context ``c`` (a namespace of config-derived constants
and dynamic dims) and the CTA's buffers ``k`` as plain Python objects.
"""

import tilelang.language as T

KV_LORA_RANK = 512  # latent dims: keys and values
ROPE_DIM = 64  # rope dims: keys only
QK_DIM = KV_LORA_RANK + ROPE_DIM  # 576
MXFP4_BLOCK = 32  # elements per e8m0 scale
MXFP4_SCALES_PER_TOKEN = QK_DIM // MXFP4_BLOCK  # 18
LOG2E = 1.4426950408889634  # log2(e): exp(x) == exp2(x * LOG2E)
LN2 = 0.6931471805599453  # ln(2): base-2 LSE -> natural log
KV_FORMATS = ("bf16", "fp8", "mxfp4")
# Q precision: "bf16" as given; "fp8": bf16 Q quantized to fp8 inside the kernel with one per-tensor scale derived
# from amax(|Q|) (a8w8, bit-exact with torch's per-tensor quantization); "fp8_codes": Q given as fp8 codes + scale.
Q_FORMATS = ("bf16", "fp8", "fp8_codes")
FP8_MAX = {"float8_e4m3fn": 448.0, "float8_e4m3fnuz": 240.0}
AMAX_FLOOR = 9.992007221626409e-13  # bf16(1e-12): torch's per-tensor quantizer clamps amax to 1e-12 in bf16


def kv_storage(kv_format: str, fp8_dtype: str) -> tuple[int, str]:
    """(elements per KV row in memory, storage dtype) of a cache format."""
    if kv_format == "bf16":
        return QK_DIM, "bfloat16"
    if kv_format == "fp8":
        return QK_DIM, fp8_dtype
    return QK_DIM // 2, "uint8"  # two e2m1 codes per byte


# ---- warp-specialised roles: their register budgets ---------------------------------------------------------------

WARP_GROUP = 128  # threads of one warp group (setmaxnreg and wgmma work per warp group)


def launch_registers(threads: int) -> int:
    """Registers per thread a CTA of ``threads`` is launched with when one CTA fills the SM (ptxas's cap for the
    block size, a multiple of 8): 168 for 384 threads."""
    return 65536 // threads // 8 * 8


def check_register_budgets(name: str, budgets: dict, threads: int) -> None:
    """Raises ValueError unless the roles' ``setmaxnreg`` budgets ({field: registers per thread}, one warp group
    each) can all be granted: each a multiple of 8 in [24, 256], and their sum at most the warp groups' launch
    registers (3 x 168 = 504 for 384 threads). A ``setmaxnreg.inc`` the SM's pool can never grant spins forever
    (``USETMAXREG.TRY_ALLOC`` in a loop) and the other roles then wait on their barriers: the 64-row kernel's
    r256 timing variant (256 + 160 + 96 = 512) hung every run (issue 30)."""
    for field, regs in budgets.items():
        if regs % 8 or not 24 <= regs <= 256:
            raise ValueError(f"{name}: {field}={regs}: setmaxnreg takes a multiple of 8 in [24, 256]")
    pool = threads // WARP_GROUP * launch_registers(threads)
    if sum(budgets.values()) > pool:
        fields = " + ".join(f"{f}={r}" for f, r in budgets.items())
        raise ValueError(f"{name}: {fields} = {sum(budgets.values())} registers per thread exceed the {pool} the "
                         f"{threads // WARP_GROUP} warp groups are launched with ({threads} threads at "
                         f"{launch_registers(threads)}): setmaxnreg.inc would wait forever")


# ---- Q: the per-tensor scale and the a8w8 rounding ----------------------------------------------------------------


def q_scale_of(q_format: str, fp8_dtype: str, q_scale_arg):
    """The Q scale a kernel multiplies scores by, from its Q_scale argument: for "fp8" (a8w8 from bf16 Q) the
    argument is amax(|Q|) and the scale is amax / fp8_max rounded to bf16, as torch's per-tensor quantizer computes
    it; otherwise the argument is the scale (1 for bf16 Q)."""
    if q_format == "fp8":
        return T.cast(T.cast(T.max(q_scale_arg, AMAX_FLOOR) / FP8_MAX[fp8_dtype], "bfloat16"), "float32")
    return q_scale_arg


def q_inverse(q_scale):
    """a8w8: 1 / q_scale, divided once per thread: each Q element is then multiplied by it (``round_q_to_fp8``)."""
    return T.float32(1.0) / q_scale


def round_q_to_fp8(value, q_inv, fp8_dtype: str):
    """a8w8: one Q element rounded to fp8 exactly as torch's per-tensor quantizer does: bf16(q / scale), clamped to
    the format's range, to e4m3. The division is a multiply by ``q_inv`` (``q_inverse`` of the scale), with the same
    bf16 result for every bf16 q and scale: q * RN(1 / scale) is within 2^-23 (relative) of q / scale, while a
    quotient of two 8-bit significands is never a bf16 midpoint and never within 2^-17 of one (m1 / m2 = M / 2^k,
    M odd of 9 bits, needs M | m1 < M), so both round to the same bf16 (tests/test_dequant.py checks every bf16 q
    against a sweep of scales; a subnormal quotient, where the 2^-23 bound fails, rounds to fp8 0 either way). A scale of inf (an inf in Q) gives q * 0, which is q / inf (+-0; NaN for a
    non-finite q). IEEE division compiled to a reciprocal, a range check and a slow-path branch per element,
    serialising the a8w8 Q rows' rounding."""
    fp8_max = FP8_MAX[fp8_dtype]
    scaled = T.cast(T.cast(T.cast(value, "float32") * q_inv, "bfloat16"), "float32")
    return T.cast(T.clamp(scaled, -fp8_max, fp8_max), fp8_dtype)


def q_value(Q, q_begin, q_len, qi, head, d, q_inv, *, q_format: str, fp8_dtype: str, codes: bool = False):
    """Q[query qi of the sequence, head, dim d] as bf16, 0 past the sequence's queries (the row is clamped, so the
    load stays in bounds); a8w8 rounds it to fp8 values (``round_q_to_fp8``; ``q_inv``: ``q_inverse``, else unused).
    ``codes`` (a8w8 on fp8 MMA): the fp8 code itself, not its bf16 value."""
    value = Q[q_begin + T.min(qi, q_len - 1), head, d]
    if q_format == "fp8":
        value = round_q_to_fp8(value, q_inv, fp8_dtype)
    dtype = fp8_dtype if codes else "bfloat16"
    return T.if_then_else(qi < q_len, T.cast(value, dtype), T.cast(0, dtype))


# ---- the split of a sequence's KV tokens ---------------------------------------------------------------------------


def split_chunk(kv_len, num_splits, block_n):
    """Tokens per split: split s of a sequence covers [s * chunk, (s + 1) * chunk), chunk a multiple of block_n."""
    return T.ceildiv(T.ceildiv(kv_len, num_splits), block_n) * block_n


def tile_count(split_lo, split_hi, block_n):
    """KV tiles of a split (0 for a split past the sequence's end)."""
    return T.ceildiv(T.max(split_hi - split_lo, 0), block_n)


# ---- online softmax and the pass's results (fragment accumulators) -------------------------------------------------


def accumulator_index(transposed: bool, *index):
    """(query row, token / dim) in the order the accumulators store it: swapped where the KV tile is the MMA's M
    dimension (S^T, O^T). Given a shape (one list) or an index (two values)."""
    if len(index) == 1:  # a shape
        return list(reversed(index[0])) if transposed else list(index[0])
    return (index[1], index[0]) if transposed else index



@T.macro
def online_softmax_step(c, k):
    """One tile's online-softmax step in base 2 over the masked, scaled scores ``k.acc_s``: the row maxima, the
    rescale of the running sum ``k.denom`` and of the output ``k.acc_o``, and the probabilities (exp2, in place). A
    row with no visible token yet keeps max -inf; its safe max (0) keeps exp2 away from (-inf) - (-inf).
    ``c.tr`` maps a (row, token / dim) index to the accumulators' order; ``c.token_axis`` is their token axis;
    ``c.kv_major_loops`` iterates the element-wise loops token / dim first (the order TileLang vectorizes for
    S^T / O^T fragments; the loop order changes the generated code); ``c.out_dims`` are the output dims ``k.acc_o``
    holds (512, or a warp group's half)."""
    softmax_probabilities(c, k)
    rescale_output(c, k)


@T.macro
def softmax_probabilities(c, k, tile_max_scratch=None, weight=None):
    """The first half of ``online_softmax_step``: row maxima, rescale factors, probabilities (exp2, in place in
    ``k.acc_s``) and the running sum; ``k.acc_o`` untouched (a kernel whose P V of the previous tile is still in
    flight on it rescales it later, ``rescale_output``).

    ``tile_max_scratch`` (the address of 64 floats of shared memory, one slot per ring stage): the row maxima by
    ``mla_ws_tile_max`` (one warp group's wgmma m64n16 S^T tile, one barrier) instead of TileLang's reduction (one
    cross-warp exchange per row value, two barriers each). ``c.deferred_sum``: the running sum is kept per score
    position in ``k.psum`` (rescaled like the output) and reduced once per pass (``deferred_denominator``), not per
    tile. ``weight`` (with ``c.deferred_sum``): a function of the token index whose value multiplies each
    probability in the running sum (a token whose values are carried in P by a factor: the sum takes it back out)."""
    T.copy(k.row_max, k.row_max_prev)
    if tile_max_scratch is None:
        T.reduce_max(k.acc_s, k.row_max, dim=c.token_axis, clear=False)
    else:
        T.call_extern("handle", "mla_ws_tile_max", k.row_max.access_ptr("rw"), k.acc_s.access_ptr("r"),
                      tile_max_scratch)
    for r in T.Parallel(c.block_m):
        k.row_max_safe[r] = T.if_then_else(k.row_max[r] == -T.infinity("float32"), 0, k.row_max[r])
        k.rescale[r] = T.exp2(k.row_max_prev[r] - k.row_max_safe[r])
    if c.kv_major_loops:
        for j, r in T.Parallel(c.block_n, c.block_m):
            k.acc_s[c.tr(r, j)] = T.exp2(k.acc_s[c.tr(r, j)] - k.row_max_safe[r])
    else:
        for r, j in T.Parallel(c.block_m, c.block_n):
            k.acc_s[c.tr(r, j)] = T.exp2(k.acc_s[c.tr(r, j)] - k.row_max_safe[r])
    if c.deferred_sum:
        if weight is not None:
            for j, r in T.Parallel(c.block_n, c.block_m):
                k.psum[c.tr(r, j)] = k.psum[c.tr(r, j)] * k.rescale[r] + k.acc_s[c.tr(r, j)] * weight(j)
        elif c.kv_major_loops:
            for j, r in T.Parallel(c.block_n, c.block_m):
                k.psum[c.tr(r, j)] = k.psum[c.tr(r, j)] * k.rescale[r] + k.acc_s[c.tr(r, j)]
        else:
            for r, j in T.Parallel(c.block_m, c.block_n):
                k.psum[c.tr(r, j)] = k.psum[c.tr(r, j)] * k.rescale[r] + k.acc_s[c.tr(r, j)]
    else:
        T.reduce_sum(k.acc_s, k.row_sum, dim=c.token_axis)
        for r in T.Parallel(c.block_m):
            k.denom[r] = k.denom[r] * k.rescale[r] + k.row_sum[r]


@T.macro
def deferred_denominator(c, k):
    """With ``c.deferred_sum``: the pass's softmax denominators, ``k.denom``, from the per-position sums."""
    T.reduce_sum(k.psum, k.denom, dim=c.token_axis)


@T.macro
def rescale_output(c, k):
    """The second half of ``online_softmax_step``: the output accumulator times this tile's rescale factors."""
    if c.kv_major_loops:
        for d, r in T.Parallel(c.out_dims, c.block_m):
            k.acc_o[c.tr(r, d)] *= k.rescale[r]
    else:
        for r, d in T.Parallel(c.block_m, c.out_dims):
            k.acc_o[c.tr(r, d)] *= k.rescale[r]


# One S^T tile's row maxima in the warp-specialised kernel (``softmax_probabilities``'s ``tile_max_scratch``). The
# MMA warp group's accumulator is wgmma's m64n16 fp32 layout: a thread's element e (0..7) is head
# 8 (e >> 2) + 2 (lane % 4) + (e & 1) of token 16 warp + lane / 4 + 8 ((e >> 1) & 1), and its 4 row values
# (``row_max``) are heads in the order i = 2 (e >> 2) + (e & 1). Per head: the thread's 2 tokens, the 8 lanes of
# the warp that share its heads (3 shuffles), then the 4 warps through shared memory: one named barrier (id 5, the
# 128 threads of the warp group; the kernel's other named barriers use 1-4). The scratch is one 64-float slot per
# ring stage, so a slot is written again only after the next tile's barrier, when every thread has read it.
TILE_MAX_CUDA_SOURCE = r"""
__device__ __forceinline__ void mla_ws_tile_max(float* row_max, const float* acc, void* scratch_ptr) {
  float* scratch = static_cast<float*>(scratch_ptr);
  float m[4];
  #pragma unroll
  for (int i = 0; i < 4; ++i) {
    m[i] = fmaxf(acc[(i >> 1) * 4 + (i & 1)], acc[(i >> 1) * 4 + 2 + (i & 1)]);
    m[i] = fmaxf(m[i], __shfl_xor_sync(0xffffffffu, m[i], 4));
    m[i] = fmaxf(m[i], __shfl_xor_sync(0xffffffffu, m[i], 8));
    m[i] = fmaxf(m[i], __shfl_xor_sync(0xffffffffu, m[i], 16));
  }
  const int lane = threadIdx.x & 31, warp = (threadIdx.x >> 5) & 3;
  if (lane < 4) {
    *reinterpret_cast<float4*>(scratch + (warp * 4 + lane) * 4) = make_float4(m[0], m[1], m[2], m[3]);
  }
  asm volatile("bar.sync 5, 128;" ::: "memory");
  #pragma unroll
  for (int w = 0; w < 4; ++w) {
    const float4 v = *reinterpret_cast<const float4*>(scratch + (w * 4 + (lane & 3)) * 4);
    row_max[0] = fmaxf(row_max[0], v.x);
    row_max[1] = fmaxf(row_max[1], v.y);
    row_max[2] = fmaxf(row_max[2], v.z);
    row_max[3] = fmaxf(row_max[3], v.w);
  }
}
"""


def output_factor(denom, scale):
    """A row's output factor scale / denom (0 where nothing was visible, denom == 0), divided once per row: an IEEE
    division per output element cost 1.3-4 us per call in the 16-row kernel (docs/perf.md, run 39)."""
    return T.if_then_else(denom > 0, scale / denom, 0)


def normalised(acc, denom, factor):
    """A finished accumulator element: acc times its row's ``output_factor``, 0 where nothing was visible."""
    return T.if_then_else(denom > 0, acc * factor, 0)


def lse_base2(denom, row_max, empty):
    """A row's base-2 log-sum-exp, ``empty`` where nothing was visible (denom == 0)."""
    return T.if_then_else(denom > 0, T.log2(denom) + row_max, empty)


# ---- the fused split merge (block-level kernel, Hopper) ------------------------------------------------------------

MERGE_SPLITS = 8  # splits whose partial chunks one thread loads together before adding them
# A CTA reads other CTAs' partials through L2 (ld.global.cg: never a stale L1 line), by address, so TileLang's
# bounds legalisation puts no branch around each load (the rows are clamped instead; with a branch per load the
# merge was 2-3x slower, docs/perf.md run 17). Loads are coalesced 16-byte chunks (a warp reads 512 contiguous
# bytes). The merge is spread over all the splits' CTAs after a grid-wide barrier (run 19): merged by the last CTA
# of each (sequence, head group) instead, one SM read every split's 32 KiB partial and the merge cost ~1 us per two
# splits plus ~3 us (run 18), more than the second launch it saves.
MERGE_CUDA_SOURCE = """
#include <cuda_bf16.h>
__device__ __forceinline__ float mla_merge_load(const float* p) { return __ldcg(p); }
// a8w8 with the merge fused: *cell = max(*cell, bits) on a float's bits (amax_in_kernel).
__device__ __forceinline__ void mla_amax_bits(float* cell, int bits) { atomicMax(reinterpret_cast<int*>(cell), bits); }

// dst[0, 4) = src[0, 4), 16-byte aligned, through L2.
__device__ __forceinline__ void mla_merge_load4(float* dst, const float* src) {
  *reinterpret_cast<float4*>(dst) = __ldcg(reinterpret_cast<const float4*>(src));
}

// out[0, 4) = bf16(src[0, 4) * scale); out 8-byte aligned.
__device__ __forceinline__ void mla_merge_store4(void* out, const float* src, float scale) {
  uint2 packed;
  reinterpret_cast<__nv_bfloat162*>(&packed)[0] = __floats2bfloat162_rn(src[0] * scale, src[1] * scale);
  reinterpret_cast<__nv_bfloat162*>(&packed)[1] = __floats2bfloat162_rn(src[2] * scale, src[3] * scale);
  *reinterpret_cast<uint2*>(out) = packed;
}
"""
ROW_CHUNKS = KV_LORA_RANK // 4  # 4-dim chunks of one output row


def merge_load(buf, index):
    """buf[index] of a partial buffer (or the amax cell), read by address through L2 (``MERGE_CUDA_SOURCE``)."""
    return T.call_extern("float32", "mla_merge_load", buf.access_ptr("r", offset=index))


def partial_row(c, split_id, q_row, head):
    """Flat (split, query row, head) index of the fused kernel's partials (the split=True layout)."""
    return (split_id * c.total_q + q_row) * c.heads + head


@T.macro
def merge_splits(c, O_partial, LSE_partial, Out, LSE, n_splits, merge_acc, merge_lse, merge_stage, merge_max,
                 merge_denom, tx, q_begin, q_len, split_id, hg):
    # Every CTA has written its split's partial; after the grid-wide barrier (the kernel is launched cooperatively,
    # so every CTA is resident and the barrier cannot wait on one that never starts) each CTA merges its share of
    # its (sequence, head group)'s output: q_len * block_h rows of ROW_CHUNKS chunks, equal contiguous ranges per
    # CTA, one chunk per thread per step (a warp reads 512 contiguous bytes of each split's partial); per chunk, the
    # splits' partials weighted by 2^(lse - max), MERGE_SPLITS splits per step with all their loads issued first
    # and the running max rescaled per step.
    f32, block_h = "float32", c.block_h
    T.sync_grid()
    total = q_len * block_h * ROW_CHUNKS
    per_cta = T.ceildiv(total, n_splits)
    lo = split_id * per_cta
    hi = T.min(lo + per_cta, total)
    for step in T.serial(T.ceildiv(T.max(hi - lo, 0), c.threads)):
        at = lo + step * c.threads + tx
        if at < hi:
            row, d = at // ROW_CHUNKS, at % ROW_CHUNKS * 4
            q_row, head = q_begin + row // block_h, hg * block_h + row % block_h
            merge_max[0] = -T.infinity(f32)
            merge_denom[0] = 0
            for j in T.unroll(4):
                merge_acc[j] = 0
            for group in T.serial(T.ceildiv(n_splits, MERGE_SPLITS)):
                # The group's loads (a split past the last reads the last one's rows, with weight 0).
                for g in T.unroll(MERGE_SPLITS):
                    sp = group * MERGE_SPLITS + g
                    prow = partial_row(c, T.min(sp, n_splits - 1), q_row, head)
                    merge_lse[g] = T.if_then_else(sp < n_splits, merge_load(LSE_partial, prow), -T.infinity(f32))
                    T.call_extern("handle", "mla_merge_load4", merge_stage.access_ptr("w", offset=g * 4),
                                  O_partial.access_ptr("r", offset=prow * KV_LORA_RANK + d))
                merge_max[1] = merge_max[0]
                for g in T.unroll(MERGE_SPLITS):
                    merge_max[1] = T.max(merge_max[1], merge_lse[g])
                # Nothing seen so far (all LSEs -inf): keep the zeros, so no (-inf) - (-inf).
                if merge_max[1] != -T.infinity(f32):
                    rescale = T.exp2(merge_max[0] - merge_max[1])
                    merge_denom[0] = merge_denom[0] * rescale
                    for j in T.unroll(4):
                        merge_acc[j] = merge_acc[j] * rescale
                    for g in T.unroll(MERGE_SPLITS):
                        weight = T.exp2(merge_lse[g] - merge_max[1])
                        merge_denom[0] = merge_denom[0] + weight
                        for j in T.unroll(4):
                            merge_acc[j] = merge_acc[j] + weight * merge_stage[g * 4 + j]
                    merge_max[0] = merge_max[1]
            # The chunk of the output (0 where nothing was seen) and, once per row, its natural-log LSE.
            T.call_extern("handle", "mla_merge_store4",
                          Out.access_ptr("w", offset=(q_row * c.heads + head) * KV_LORA_RANK + d),
                          merge_acc.access_ptr("r", offset=0),
                          T.if_then_else(merge_denom[0] > 0, 1.0 / merge_denom[0], 0))
            if d == 0:
                if c.flash_io:
                    lse = T.if_then_else(merge_denom[0] > 0, (T.log2(merge_denom[0]) + merge_max[0]) * LN2,
                                         c.empty_lse)
                    LSE[q_row // c.s_q, head, q_row % c.s_q] = lse
                else:
                    LSE[q_row, head] = T.if_then_else(
                        merge_denom[0] > 0, (T.log2(merge_denom[0]) + merge_max[0]) * LN2, c.empty_lse
                    )


AMAX_VECTOR = 8  # bf16 elements per 16-byte load (576 = 72 x 8: a vector never crosses a Q row)
AMAX_UNROLL = 4  # vectors a thread loads before it reduces them: a CTA's slice of <= 4 x threads vectors in one trip


@T.macro
def cta_amax_bits(Q, heads, total_q, threads, n_ctas, cta, tx, Amax_bits, Amax_vals):
    # amax(|Q|) over this CTA's share of Q (total_q x heads x 576 bf16), into Amax_bits[0] as the bits of a float
    # (for every thread, after a barrier): the CTA takes an equal slice of Q's 16-byte vectors, each thread loads
    # AMAX_UNROLL of them into ``Amax_vals`` before reducing (all its loads in flight at once: one memory round trip
    # at the harness's sizes, not one per element step), and the maximum is an integer max on the bits of |q| (>= 0,
    # so their order is the floats'; a NaN's bits exceed inf's, so NaN wins as in torch's amax). Vectors past the
    # slice or the tensor (clamped to its last one) join the maximum harmlessly. Exact: the same amax as torch's.
    total = total_q * (heads * QK_DIM // AMAX_VECTOR)  # vectors
    per_cta = T.ceildiv(total, n_ctas)
    bits = T.alloc_var("int32", init=0)
    for step in T.serial(T.ceildiv(per_cta, threads * AMAX_UNROLL)):
        for u in T.unroll(AMAX_UNROLL):
            vec = T.min(cta * per_cta + (step * AMAX_UNROLL + u) * threads + tx, total - 1)
            row_vecs = QK_DIM // AMAX_VECTOR
            for e in T.vectorized(AMAX_VECTOR):
                Amax_vals[u * AMAX_VECTOR + e] = Q[vec // (heads * row_vecs), vec // row_vecs % heads,
                                                   vec % row_vecs * AMAX_VECTOR + e]
        for i in T.unroll(AMAX_UNROLL * AMAX_VECTOR):
            bits = T.max(bits, T.reinterpret(T.abs(T.cast(Amax_vals[i], "float32")), "int32"))
    if tx == 0:
        Amax_bits[0] = 0
    T.sync_threads()
    T.atomic_max(Amax_bits[0], bits)
    T.sync_threads()


@T.macro
def reduce_amax(c, Q, Amax_cell, Amax_bits, Amax_vals, n_splits, tx, split_id, seq_id, hg):
    # a8w8 with the merge fused (``amax_in_kernel``): amax(|Q|) over the whole Q tensor: each CTA's share
    # (``cta_amax_bits``) goes into the zeroed cell by an integer atomic max on the float bits; after the grid
    # barrier every CTA reads the total through L2 (``merge_load``). (Without a grid barrier: tl_kernels/mla_amax.py.)
    cta_amax_bits(Q, c.heads, c.total_q, c.threads, n_splits * c.num_seqs * c.head_groups,
                  (hg * c.num_seqs + seq_id) * n_splits + split_id, tx, Amax_bits, Amax_vals)
    if tx == 0:
        T.call_extern("handle", "mla_amax_bits", Amax_cell.access_ptr("rw", offset=0), Amax_bits[0])
    T.sync_grid()
