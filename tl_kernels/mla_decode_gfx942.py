"""The gfx942 (MI300X) decode program: the wave-level ``dim_split`` form of the split-KV decode kernel.

``tl_kernels.mla_decode`` builds it for a ``DecodeKernelConfig`` with ``dim_split`` (the schedule's choice on
gfx942); it has the same arguments and results as the block-level program, and a different work split: 8 wave64s
share one 32-token KV tile, each owning 64 of the 512 latent dims for Q K^T and P V on MFMA, with hand-placed
operands and tiles prefetched into registers one ahead. Its pipeline per query pass (``body``): Q slices into
registers (``load_q``), then per tile ``load_tile`` (the next tile's loads, issued first) and ``compute_tile``
(partial scores, their reduce-scatter in LDS, each wave's share of the online softmax, P V), then the pass's
results (the denominator's shares summed once per pass).

The lane maps below are shared by the program (with TIR expressions) and its NumPy model in
tests/test_gfx942.py (with integers).
"""

from types import SimpleNamespace

import tilelang.language as T

from tl_kernels.steps import (
    KV_LORA_RANK,
    LN2,
    LOG2E,
    MXFP4_SCALES_PER_TOKEN,
    kv_storage,
    normalised,
    output_factor,
    q_inverse,
    q_scale_of,
    round_q_to_fp8,
    split_chunk,
    tile_count,
)

# dim_split (gfx942): 8 wave64s share one 32-token KV tile; wave w owns latent dims [64w, 64w + 64); in a wave, lane
# (m, g) = (lane % 16, lane // 16) owns tokens 2m, 2m + 1 and dims [16g, 16g + 16) of the wave's 64, so its global
# loads are whole vectors (bf16 2 x 16 B, fp8 16 B, mxfp4 8 B per token). The 64 rope dims are shared out too:
# wave w takes tokens 2m + w // 4 and rope dims 16g + 4 (w % 4) .. + 3 (one MFMA k-step of 4 elements per lane), so
# every byte of the tile is loaded by exactly one lane (bf16 8 B, fp8 4 B, mxfp4 2 B of rope per lane).
DS_WAVES, DS_LANES, DS_DIMS = 8, 64, 64
DS_SCORES = 8  # scores per lane per tile: head m, tokens 8g + 2r + j (r < 4 MFMA rows, j < 2 token halves)
DIM_SPLIT_SHAPE = (16, 1, 32, DS_WAVES * DS_LANES)  # (block_h, q_tile, block_n, threads)
DS_PAGE_LOADS_PER_TILE = 2  # paged: page-table dwords each lane loads per tile (look_up_rows; tools/gfx942_report.py)


# The lane maps (m = lane % 16, g = lane // 16).
def ds_token(m, j):
    """Tile token whose K row lane (m, g) loads as its j-th token (the MFMA row of Q K^T's token slot m, n-tile j)."""
    return 2 * m + j


def ds_dim(chunk_lo, g, e):
    """Dim of element e (< 16) of lane group g's slice of the 64-dim chunk starting at chunk_lo."""
    return chunk_lo + 16 * g + e


def ds_score_token(g, i):
    """Tile token of score i (< 8) of lane group g: the Q K^T result D[4g + r][m] of n-tile j, i = 4j + r, is the
    score of token slot 4g + r, i.e. token ds_token(4g + r, j)."""
    return ds_token(4 * g + i % 4, i // 4)


def ds_rope_token(m, wave):
    """Tile token whose rope dims lane (m, g) of ``wave`` loads: ds_token(m, j) of n-tile j = wave // 4."""
    return ds_token(m, wave // 4)


def ds_rope_dim(g, wave, e):
    """Rope dim (0..63) of element e (< 4) of lane group g's rope share in ``wave``: the MFMA k-step wave % 4 of the
    16-dim lane slice 16g .. 16g + 15 (the k order of Q K^T is free; Q is loaded in the same order)."""
    return 16 * g + 4 * (wave % 4) + e


def ds_p_score(s, c):
    """Which of the lane's 8 scores is element c (< 4) of its P operand in P V k-step s (< 2): P V's k index
    4g + c of step s is token 8g + 4s + c (any order works as long as V^T uses the same)."""
    return (c % 2) * 4 + 2 * s + c // 2


def ds_p_slot(wave):
    """Slot (s * 4 + c) of a lane's P operand that holds score ``wave`` (the inverse of ds_p_score): wave w writes its
    P value there, so one 16-byte LDS read gives every wave its operand in order."""
    return 4 * ((wave % 4) // 2) + 2 * (wave % 2) + wave // 4


def ds_vt_col(d, token):
    """LDS column of (dim d, token) in a wave's V^T slice: the four 8-token (16-byte) chunks of row d are swizzled by
    (d >> 1) & 3, so the P V operand reads (16 lanes: rows 16 nt + m, the same chunk g) spread over all 32 banks
    instead of 8 of them (rows are 64 bytes: without it, lanes m and m + 2 hit the same banks)."""
    return ((token // 8) ^ ((d // 2) % 4)) * 8 + token % 8


def ds_out_dim(wave, nt, g, r):
    """Output dim of the lane's P V result element r of dim block nt: O^T rows 16 nt + 4g + r of the wave's 64."""
    return wave * DS_DIMS + nt * 16 + g * 4 + r


# Device helpers of the dim_split program (HIP only):
# - mla_ds_copy16 / 8 / 4 / 2 and mla_ds_load_i32: one whole-vector global load into the lane's registers (or one
#   page-table entry). Rows and pages are clamped into the cache by construction, which TileLang cannot prove, so its
#   bounds-check legalisation would put every load in a branch of its own; loads in branches make the compiler wait
#   for them at the join (s_waitcnt vmcnt(0)), which serialises the tile's loads. Going through the address keeps
#   them unconditional.
# - mla_ds_load_u32: unaligned 32-bit load of the e8m0 scale bytes (their rows have any stride and offset, so no
#   alignment holds; gfx942 under amdhsa reads a dword at any byte address with one global_load_dword).
# (The source lands above TileLang's includes: it uses compiler types only.)
_DS_HIP_HELPERS = """
typedef unsigned int mla_u32x4 __attribute__((ext_vector_type(4)));
typedef unsigned int mla_u32x2 __attribute__((ext_vector_type(2)));
static __device__ inline __attribute__((always_inline)) void mla_ds_copy16(void* dst, const void* src) {
  *(mla_u32x4*)dst = *(const mla_u32x4*)src;
}
static __device__ inline __attribute__((always_inline)) void mla_ds_copy8(void* dst, const void* src) {
  *(mla_u32x2*)dst = *(const mla_u32x2*)src;
}
static __device__ inline __attribute__((always_inline)) void mla_ds_copy4(void* dst, const void* src) {
  *(unsigned int*)dst = *(const unsigned int*)src;
}
static __device__ inline __attribute__((always_inline)) void mla_ds_copy2(void* dst, const void* src) {
  *(unsigned short*)dst = *(const unsigned short*)src;
}
static __device__ inline __attribute__((always_inline)) int mla_ds_load_i32(const int* p) {
  return *p;
}
static __device__ inline __attribute__((always_inline)) unsigned int mla_ds_load_u32(const unsigned char* p) {
  unsigned int v;
  __builtin_memcpy(&v, p, 4);
  return v;
}
"""


def dim_split_body(cfg, dims: dict):
    """The decode program for gfx942 as wave-level code (``cfg.dim_split``): same arguments and results as
    ``decode_body``, different work split. One workgroup = 8 wave64s sharing one 32-token KV tile per step, so one
    workgroup of 50 KiB LDS keeps 8 waves on a CU (2 per SIMD). Per tile:
      1. each lane already holds the tile in registers (issued one tile ahead, whole-vector loads, rows of a paged
         cache looked up two tiles ahead), and issues the loads of the next tile before computing this one;
      2. S^T partial = K Q^T over the wave's 64 latent dims and its eighth of the rope (two bf16 MFMAs, one per
         n-tile, Q zero in the n-tile the wave has no rope of) on MFMA, both operands from registers (the lane's 16
         dims of two tokens; Q once per pass); the wave writes its V^T slice
         (64 dims x 32 tokens, bf16, tokens contiguous) to its own LDS region;
      3. the 8 partial score tiles meet in LDS (one barrier) and wave w sums score w of every lane (head m, token
         ds_score_token(g, w)): each wave finishes an eighth of the scores;
      4. online softmax in base 2, shared out: each wave masks and scales its score, the head's tile max meets over
         the 4 lane groups (two xor shuffles) and the 8 waves (LDS, one barrier), each wave takes exp2 of its score
         only, keeps it in the lane's share of the denominator, and writes it as bf16 to the lane's P operand in LDS
         (ds_p_slot); after one more barrier every wave reads its P operand (one 16-byte read per lane);
      5. O^T += V^T P^T for the wave's 64 output dims: V^T read with 16-byte LDS reads; lane (m, g) accumulates
         head m, dims 16 nt + 4g + r, so the softmax rescale is lane-local.
    The MFMA lane layouts (16x16x16 bf16; 16x16x32 fp8): operand A lane (i, kgroup) = (lane % 16, lane // 16),
    B lane (j, kgroup), result D[4 (lane // 16) + r][lane % 16]; the k order inside a step is free as long as
    both operands use the same one."""
    from tilelang.rocm.language.tir import tvm_mfma

    from tl_kernels import dequant_hip

    heads, block_h, block_n = cfg.num_heads, cfg.block_h, cfg.block_n
    head_groups = heads // block_h
    kv_cols, kv_dtype = kv_storage(cfg.kv_format, cfg.fp8_dtype)
    bf16, f32 = "bfloat16", "float32"
    mx = cfg.kv_format == "mxfp4"
    lane_elems = 8 if mx else 16  # storage elements per lane, token and chunk (mxfp4: bytes of two codes)
    chunk_cols = DS_DIMS // 2 if mx else DS_DIMS  # storage columns of one 64-dim chunk
    lane_cols = lane_elems  # a lane's columns in a chunk start at g * lane_cols
    lane_bytes = {"bf16": 32, "fp8": 16, "mxfp4": 8}[cfg.kv_format]  # per lane, token and chunk
    copy_fn = "mla_ds_copy16" if lane_bytes >= 16 else "mla_ds_copy8"
    vec_elems = lane_elems * min(lane_bytes, 16) // lane_bytes  # elements of one load
    op_dtype = cfg.fp8_dtype if cfg.fp8_mfma else bf16  # Q K^T operand type
    if cfg.fp8_mfma:
        qk_mfma, qk_vec, qk_k = "f32_16x16x32_fp8_fp8", f"{cfg.fp8_dtype}x8", 8
    else:
        qk_mfma, qk_vec, qk_k = "f32_16x16x16bf16_1k", "bfloat16x4", 4
    qk_steps = 16 // qk_k  # MFMA k-steps per 16-dim lane slice
    raw_operand = cfg.kv_format == "bf16" or cfg.fp8_mfma  # the loaded bytes are the K operand as they are
    # Rope share per lane and token: 4 elements (bf16 8 B, fp8 4 B, mxfp4 2 B), always on the bf16 MFMA (a8w8: the
    # fp8 codes and the fp8-rounded Q are exact in bf16).
    rope_elems = 2 if mx else 4  # storage elements
    rope_copy = {"bf16": "mla_ds_copy8", "fp8": "mla_ds_copy4", "mxfp4": "mla_ds_copy2"}[cfg.kv_format]
    rope_order = dequant_hip.e2m1x4_order if mx else (lambda e: e)
    # Dim of element e of a lane's 16 decoded elements: the mxfp4 decode pairs even and odd codes of each word
    # (dequant_hip.E2M1_ORDER); Q is loaded in the same order and V^T rows are written by their true dim.
    order = dequant_hip.e2m1_order if mx else (lambda e: e)
    total_q, indptr_len, scale_len = dims["total_q"], dims["indptr_len"], dims["scale_len"]
    num_splits = dims["num_splits"]
    ninf = -T.infinity(f32)

    def chunk_col(st):
        """First storage column of the lane's slice of the wave's latent dims: ds_dim(64 wave, g, 0) in storage
        columns."""
        return st.wave * chunk_cols + st.g * lane_cols

    def rope_col(st):
        """First storage column of the lane's rope share: ds_rope_dim(g, wave, 0) after the latent columns."""
        first = KV_LORA_RANK + ds_rope_dim(st.g, st.wave, 0)
        return first // 2 if mx else first

    def token_pos(st, t, j):
        """Position in the sequence of token 2m + j of tile t, clamped to the split (finite data)."""
        return T.min(st.split_lo + t * block_n + ds_token(st.m, j), st.split_hi - 1)

    @T.macro
    def look_up_rows(st, slot, t):
        # Paged: token p is slot p % page_size of page Page_table[b, p // page_size].
        for j in T.unroll(2):
            pos = token_pos(st, t, j)
            page_entry = st.seq_id * st.Page_table.shape[1] + pos // cfg.page_size  # in the table (pos is clamped)
            # Only the page number is kept: the row is formed where the KV loads need it, so no arithmetic waits on
            # this load before then.
            st.rows[slot, j] = T.call_extern("int32", "mla_ds_load_i32", st.Page_table.access_ptr("r", offset=page_entry))

    def row_of(st, slot, t, j):
        if cfg.page_size:
            return st.rows[slot, j] * cfg.page_size + token_pos(st, t, j) % cfg.page_size
        return st.kv_begin + token_pos(st, t, j)

    def rope_row_of(st, slot, t):
        """Row of the lane's rope token (ds_rope_token: n-tile wave // 4; the page is a select, not an index, so the
        page numbers stay in registers)."""
        j = st.wave // 4
        if cfg.page_size:
            page = T.if_then_else(j == 0, st.rows[slot, 0], st.rows[slot, 1])
            return page * cfg.page_size + token_pos(st, t, j) % cfg.page_size
        return st.kv_begin + token_pos(st, t, j)

    @T.macro
    def load_scale(st, b, row, block, k):
        # e8m0 scale of one 32-element block: the dword that holds its byte, kept in bounds at the end of the scale
        # array (the scale rows have any stride and offset: no alignment to rely on). k: 0, 1 latent tokens, 2 rope.
        pos = row * st.scale_stride + block
        start = T.min(pos, scale_len - 4)
        st.sc_word[b, k] = T.call_extern("uint32", "mla_ds_load_u32", st.KV_scales.access_ptr("r", offset=start))
        st.sc_shift[b, k] = (pos - start) * 8

    def q_rounded(st, value):
        if cfg.q_format == "fp8":
            return round_q_to_fp8(value, st.q_inv, cfg.fp8_dtype)
        return value

    @T.macro
    def load_q(st, Q, row, head):
        # The lane's Q slice of the wave's latent dims (head m; dims 16g .. 16g + 15), once per query pass.
        if mx:  # in the decode's element order (a register permute of one vector load)
            for e in T.vectorized(16):
                st.q_tmp[e] = Q[row, head, st.wave * DS_DIMS + st.g * 16 + e]
            for e in T.unroll(16):
                st.q_op[e] = st.q_tmp[order(e)]
        else:
            for e in T.vectorized(16):
                st.q_op[e] = T.cast(q_rounded(st, Q[row, head, st.wave * DS_DIMS + st.g * 16 + e]), op_dtype)
        # The rope share (ds_rope_dim, in the rope decode's order) as the B operand of n-tile j: Q in the n-tile of
        # the wave's rope token, zero in the other, so the two MFMAs add the rope scores where they belong.
        for e in T.vectorized(4):
            st.q_tmp[e] = T.cast(q_rounded(st, Q[row, head, KV_LORA_RANK + ds_rope_dim(st.g, st.wave, 0) + e]), bf16)
        for j in T.unroll(2):
            for e in T.unroll(4):
                st.q_rope[j, e] = T.if_then_else(st.wave // 4 == j, st.q_tmp[rope_order(e)], T.cast(0, bf16))

    @T.macro
    def load_chunk(st, b, slot, t, j):
        for v in T.unroll(max(lane_bytes // 16, 1)):
            T.evaluate(T.call_extern(
                "handle", copy_fn, T.address_of(st.kv_raw[b, j, v * vec_elems]),
                st.KV.access_ptr("r", offset=row_of(st, slot, t, j) * kv_cols + chunk_col(st) + v * vec_elems),
            ))

    @T.macro
    def load_tile(st, b, slot, t):
        # Whole-vector loads of the lane's two latent tokens and its rope share, all issued before any is used; no
        # load is under a branch (the compiler would wait for it at the join: vmcnt(0) between the tile's loads).
        for j in T.unroll(2):
            load_chunk(st, b, slot, t, j)
            if mx:
                load_scale(st, b, row_of(st, slot, t, j), st.wave * 2 + st.g // 2, j)
        T.evaluate(T.call_extern(
            "handle", rope_copy, T.address_of(st.kv_rope[b, 0]),
            st.KV.access_ptr("r", offset=rope_row_of(st, slot, t) * kv_cols + rope_col(st)),
        ))
        if mx:
            load_scale(st, b, rope_row_of(st, slot, t), MXFP4_SCALES_PER_TOKEN - 2 + st.g // 2, 2)
        # Keep the compiler's scheduler from sinking these loads below the compute that follows (it would then wait
        # for the previous tile with nothing else in flight).
        T.evaluate(T.call_extern("handle", "__builtin_amdgcn_sched_barrier", 0))

    def scale_byte(st, b, k):
        """mxfp4: the e8m0 byte of the lane's block (k: 0, 1 latent token j, 2 the rope token)."""
        return T.shift_right(st.sc_word[b, k], T.cast(st.sc_shift[b, k], "uint32"))

    @T.macro
    def decode(st, dst, b, j):
        # The lane's 16 latent elements of token j as bf16 (exact for every format): one device function call on
        # whole words (tl_kernels/dequant_hip.py).
        if mx:
            dequant_hip.e2m1x16_to_bf16(T.address_of(dst[j, 0]), T.address_of(st.kv_raw[b, j, 0]), scale_byte(st, b, j))
        else:
            dequant_hip.fp8x16_to_bf16(T.address_of(dst[j, 0]), T.address_of(st.kv_raw[b, j, 0]))

    @T.macro
    def qk_latent(st, b):
        # S^T partial (token slot, head) += K Q^T over the 16 dims of each of the 4 lane groups.
        if not raw_operand:
            for j in T.unroll(2):
                decode(st, st.k_op, b, j)
        for j in T.unroll(2):
            for a in T.unroll(qk_steps):
                if raw_operand:
                    tvm_mfma(qk_mfma, "row", "row", qk_vec, qk_vec, "float32x4",
                             st.kv_raw.data, (b * 2 + j) * qk_steps + a, st.q_op.data, a,
                             st.s_acc.data, j, dtype="float32x4")
                else:
                    tvm_mfma(qk_mfma, "row", "row", qk_vec, qk_vec, "float32x4",
                             st.k_op.data, j * qk_steps + a, st.q_op.data, a, st.s_acc.data, j,
                             dtype="float32x4")

    @T.macro
    def qk_rope(st, b):
        # The wave's rope share: one bf16 k-step per n-tile; Q is zero in the n-tile that is not the rope token's.
        if cfg.kv_format == "bf16":
            for j in T.unroll(2):
                tvm_mfma("f32_16x16x16bf16_1k", "row", "row", "bfloat16x4", "bfloat16x4", "float32x4",
                         st.kv_rope.data, b, st.q_rope.data, j, st.s_acc.data, j, dtype="float32x4")
        else:
            if mx:
                dequant_hip.e2m1x4_to_bf16(T.address_of(st.k_rope[0]), T.address_of(st.kv_rope[b, 0]), scale_byte(st, b, 2))
            else:
                dequant_hip.fp8x4_to_bf16(T.address_of(st.k_rope[0]), T.address_of(st.kv_rope[b, 0]))
            for j in T.unroll(2):
                tvm_mfma("f32_16x16x16bf16_1k", "row", "row", "bfloat16x4", "bfloat16x4", "float32x4",
                         st.k_rope.data, 0, st.q_rope.data, j, st.s_acc.data, j, dtype="float32x4")

    @T.macro
    def compute_tile(st, b, t, q_pass):
        tile_lo = st.split_lo + t * block_n
        for i in T.unroll(DS_SCORES):
            st.s_acc[i] = 0
        qk_latent(st, b)
        qk_rope(st, b)
        # V^T of the wave's latent dims, bf16, tokens contiguous: 2 tokens per 4-byte write (one permute per pair).
        if cfg.kv_format == "bf16":
            dequant_hip.pair_tokens(T.address_of(st.v_pairs[0]), T.address_of(st.kv_raw[b, 0, 0]), T.address_of(st.kv_raw[b, 1, 0]))
        else:
            if raw_operand:  # a8w8: K went to the fp8 MFMA as loaded; V needs bf16
                for j in T.unroll(2):
                    decode(st, st.k_op, b, j)
            dequant_hip.pair_tokens(T.address_of(st.v_pairs[0]), T.address_of(st.k_op[0, 0]), T.address_of(st.k_op[1, 0]))
        for e in T.unroll(16):
            for j in T.vectorized(2):
                st.VT[st.wave, st.g * 16 + order(e), ds_vt_col(st.g * 16 + order(e), ds_token(st.m, 0)) + j] = st.v_pairs[2 * e + j]
        for i in T.vectorized(DS_SCORES):
            st.S_part[st.wave, st.lane, i] = st.s_acc[i]
        T.sync_threads()
        # Stage 3: the full scores, reduce-scattered: wave w sums score w of every lane over the 8 partials (7 adds
        # instead of 56 per wave) and does that score's share of the softmax (one score per lane, not eight).
        st.s_sum[0] = 0
        for w in T.unroll(DS_WAVES):
            st.s_sum[0] += st.S_part[w, st.lane, st.wave]
        horizon = st.split_hi
        if cfg.causal:
            horizon = T.min(st.split_hi, st.kv_len - st.q_len + q_pass + 1)
        st.s_sum[0] = T.if_then_else(tile_lo + ds_score_token(st.g, st.wave) < horizon, st.s_sum[0] * st.score_scale, ninf)
        # Stage 4: online softmax (base 2) of head m. The tile's max: over the wave's 4 tokens of the head (lane
        # groups, two xor shuffles), then over the 8 waves through LDS (every wave reads all 8: one 32-byte read).
        st.row_max_new[0] = T.max(st.s_sum[0], T.shfl_xor(st.s_sum[0], 16, width=64))
        st.row_max_new[0] = T.max(st.row_max_new[0], T.shfl_xor(st.row_max_new[0], 32, width=64))
        st.M_part[st.m, st.wave] = st.row_max_new[0]
        T.sync_threads()
        for w in T.vectorized(DS_WAVES):
            st.m_all[w] = st.M_part[st.m, w]
        st.row_max_new[0] = st.row_max[0]
        for w in T.unroll(DS_WAVES):
            st.row_max_new[0] = T.max(st.row_max_new[0], st.m_all[w])
        st.row_safe[0] = T.if_then_else(st.row_max_new[0] == ninf, 0, st.row_max_new[0])
        st.rescale[0] = T.exp2(st.row_max[0] - st.row_safe[0])
        st.row_max[0] = st.row_max_new[0]
        # The wave's P value: its f32 goes into the lane's share of the denominator (summed over lane groups and
        # waves once per pass), its bf16 (to nearest) to LDS, where every wave reads its P operand (one 16-byte read).
        st.s_sum[0] = T.exp2(st.s_sum[0] - st.row_safe[0])
        st.denom[0] = st.denom[0] * st.rescale[0] + st.s_sum[0]
        dequant_hip.round_bf16(T.address_of(st.p_one[0]), st.s_sum[0])
        st.P_tot[st.lane, ds_p_slot(st.wave)] = st.p_one[0]
        for i in T.unroll(16):
            st.acc_o[i] *= st.rescale[0]
        T.sync_threads()
        for k in T.vectorized(8):
            st.p_op[k] = st.P_tot[st.lane, k]
        # Stage 5: O^T (dims, heads) += V^T P^T, 4 blocks of 16 dims, 2 k-steps of 16 tokens.
        for nt in T.unroll(4):
            for v in T.vectorized(8):
                st.v_op[v] = st.VT[st.wave, nt * 16 + st.m, ds_vt_col(nt * 16 + st.m, st.g * 8) + v]
            for s in T.unroll(2):
                tvm_mfma("f32_16x16x16bf16_1k", "row", "row", "bfloat16x4", "bfloat16x4", "float32x4",
                         st.v_op.data, s, st.p_op.data, s, st.acc_o.data, nt, dtype="float32x4")
        # (TileLang's barrier pass adds the barrier that lets the next tile overwrite V^T and the partial scores.)


    @T.macro
    def body(Q, KV, KV_scales, scale_stride, Q_scale, KV_scale, qo_indptr, kv_indptr, Page_table, sm_scale, n_splits,
             O_partial, LSE_partial, Out, LSE):
        with T.Kernel(num_splits, indptr_len - 1, head_groups, threads=cfg.threads) as (split_id, seq_id, hg):
            T.import_source(_DS_HIP_HELPERS + dequant_hip.HIP_SOURCE)
            VT = T.alloc_shared([DS_WAVES, DS_DIMS, block_n], bf16)  # per wave: V^T of its 64 latent dims
            S_part = T.alloc_shared([DS_WAVES, DS_LANES, DS_SCORES], f32)  # per wave: its partial scores
            M_part = T.alloc_shared([16, DS_WAVES], f32)  # per head: each wave's tile max (end of pass: denominators)
            P_tot = T.alloc_shared([DS_LANES, 8], bf16)  # the tile's P operand of every lane (ds_p_slot order)
            s_sum = T.alloc_local([1], f32)
            kv_raw = T.alloc_local([2, 2, lane_elems], kv_dtype)  # latent: [ping-pong buffer, token j, element]
            kv_rope = T.alloc_local([2, rope_elems], kv_dtype)  # the lane's rope share: [ping-pong buffer, element]
            sc_word = T.alloc_local([2, 3], "uint32")  # mxfp4: dword holding the scale byte [buffer, token j / rope]
            sc_shift = T.alloc_local([2, 3], "int32")  # mxfp4: bit offset of that byte in the dword
            rows = T.alloc_local([2, 2], "int32")  # paged: page numbers [tile parity, token j]
            q_op = T.alloc_local([16], op_dtype)  # latent Q slice
            q_rope = T.alloc_local([2, 4], bf16)  # rope share of Q per n-tile j (zero where not the rope token's)
            k_rope = T.alloc_local([4], bf16)  # decoded rope share of K
            k_op = T.alloc_local([2, 16], bf16)  # decoded K (a8w8: V) elements [token j, element] of one chunk
            v_pairs = T.alloc_local([32], bf16)  # [2 e + j]: element e of token j (V^T pairs)
            q_tmp = T.alloc_local([16], bf16)  # mxfp4: Q slice before the permute into the decode's order
            s_acc = T.alloc_local([DS_SCORES], f32)  # MFMA result: [j * 4 + r] = S(head m, token 8g + 2r + j)
            m_all = T.alloc_local([DS_WAVES], f32)
            p_one = T.alloc_local([2], bf16)  # the wave's P value as bf16
            p_op = T.alloc_local([8], bf16)  # [s * 4 + c] = P(head m, token 8g + 4s + c)
            v_op = T.alloc_local([8], bf16)  # V^T(dim, tokens 8g .. 8g + 7)
            acc_o = T.alloc_local([16], f32)  # [nt * 4 + r] = O(head m, dim 64 wave + 16 nt + 4g + r)
            row_max = T.alloc_local([1], f32)
            row_max_new = T.alloc_local([1], f32)
            row_safe = T.alloc_local([1], f32)
            rescale = T.alloc_local([1], f32)
            denom = T.alloc_local([1], f32)

            tx = T.get_thread_binding()
            wave = tx // DS_LANES
            lane = tx % DS_LANES
            m = lane % 16
            g = lane // 16
            kv_begin = T.alloc_var("int32", init=kv_indptr[seq_id])
            kv_len = T.alloc_var("int32", init=kv_indptr[seq_id + 1] - kv_indptr[seq_id])
            q_begin = T.alloc_var("int32", init=qo_indptr[seq_id])
            q_len = T.alloc_var("int32", init=qo_indptr[seq_id + 1] - qo_indptr[seq_id])
            chunk = T.alloc_var("int32", init=split_chunk(kv_len, num_splits, block_n))
            split_lo = T.alloc_var("int32", init=split_id * chunk)
            split_hi = T.alloc_var("int32", init=T.min(split_lo + chunk, kv_len))
            num_tiles = T.alloc_var("int32", init=tile_count(split_lo, split_hi, block_n))
            q_scale = T.alloc_var(f32, init=q_scale_of(cfg.q_format, cfg.fp8_dtype, Q_scale[0]))
            q_inv = T.alloc_var(f32, init=q_inverse(q_scale)) if cfg.q_format == "fp8" else None
            score_scale = T.alloc_var(f32, init=sm_scale * LOG2E * q_scale * KV_scale[0])
            out_scale = T.alloc_var(f32, init=KV_scale[0])
            st = SimpleNamespace(
                wave=wave, g=g, m=m, lane=lane, kv_raw=kv_raw, kv_rope=kv_rope, q_rope=q_rope, k_rope=k_rope,
                sc_word=sc_word, sc_shift=sc_shift, rows=rows, q_op=q_op,
                k_op=k_op, v_pairs=v_pairs, q_tmp=q_tmp, s_acc=s_acc, m_all=m_all, p_one=p_one, p_op=p_op, v_op=v_op, acc_o=acc_o, split_lo=split_lo,
                split_hi=split_hi, kv_begin=kv_begin, kv_len=kv_len, q_len=q_len, seq_id=seq_id, Page_table=Page_table,
                KV=KV, KV_scales=KV_scales, scale_stride=scale_stride, score_scale=score_scale, q_inv=q_inv, VT=VT, S_part=S_part, M_part=M_part, P_tot=P_tot, s_sum=s_sum,
                row_max_new=row_max_new, row_max=row_max, row_safe=row_safe, rescale=rescale,
                denom=denom,
            )

            for q_pass in T.serial(q_len):
                # Stage 1: the lane's Q slices (head m; dims 16g .. 16g + 15 of its latent chunk, its rope share).
                load_q(st, Q, q_begin + q_pass, hg * block_h + m)
                for i in T.unroll(16):
                    acc_o[i] = 0
                denom[0] = 0
                row_max[0] = ninf
                # The KV loop, unrolled by two over a ping-pong register buffer: the loads of tile t + 1 are in
                # flight while tile t computes. Tiles past the split end are masked (finite clamped rows).
                if num_tiles > 0:
                    if cfg.page_size:
                        look_up_rows(st, 0, 0)
                        look_up_rows(st, 1, 1)
                    load_tile(st, 0, 0, 0)
                    if cfg.page_size:
                        look_up_rows(st, 0, 2)
                    load_tile(st, 1, 1, 1)
                    if cfg.page_size:
                        look_up_rows(st, 1, 3)
                    # Each buffer's next loads are issued right after its compute, at the same level of the loop
                    # body: a load of tile t + 1 issued before a branch that alone uses it is sunk into that branch
                    # by the compiler (then waited for at once, with the other buffer's loads in flight: vmcnt(0)).
                    for it in T.serial(T.ceildiv(num_tiles, 2)):
                        compute_tile(st, 0, it * 2, q_pass)
                        load_tile(st, 0, 0, it * 2 + 2)
                        if cfg.page_size:
                            look_up_rows(st, 0, it * 2 + 4)
                        if it * 2 + 1 < num_tiles:
                            compute_tile(st, 1, it * 2 + 1, q_pass)
                        load_tile(st, 1, 1, it * 2 + 3)
                        if cfg.page_size:
                            look_up_rows(st, 1, it * 2 + 5)

                # Stage 6: the denominator of head m from the lanes' shares (4 lane groups, then 8 waves through LDS;
                # every wave saw the same maxima, so the shares are on one scale), then normalise and write (head m,
                # dims 64 wave + 16 nt + 4g .. + 3).
                denom[0] += T.shfl_xor(denom[0], 16, width=64)
                denom[0] += T.shfl_xor(denom[0], 32, width=64)
                M_part[m, wave] = denom[0]
                T.sync_threads()
                for w in T.vectorized(DS_WAVES):
                    m_all[w] = M_part[m, w]
                denom[0] = 0
                for w in T.unroll(DS_WAVES):
                    denom[0] += m_all[w]
                rescale[0] = output_factor(denom[0], out_scale)  # the row's output factor, once (rescale is free)
                for nt in T.unroll(4):
                    for r in T.vectorized(4):
                        value = normalised(acc_o[nt * 4 + r], denom[0], rescale[0])
                        col = ds_out_dim(wave, nt, g, r)
                        if cfg.split:
                            O_partial[split_id, q_begin + q_pass, hg * block_h + m, col] = value
                        else:
                            Out[q_begin + q_pass, hg * block_h + m, col] = T.cast(value, bf16)
                if tx < 16:
                    lse2 = T.if_then_else(denom[0] > 0, T.log2(denom[0]) + row_max[0], ninf)
                    if cfg.split:
                        LSE_partial[split_id, q_begin + q_pass, hg * block_h + m] = lse2
                    else:
                        LSE[q_begin + q_pass, hg * block_h + m] = lse2 * LN2

    return body
