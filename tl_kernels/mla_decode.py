"""Split-KV MLA decode (absorbed form): one TileLang program per static config.

Each CTA owns one (sequence, KV split, head group). Its stages:
  1. load the Q rows it serves (``q_tile`` query tokens x ``block_h`` heads, 576 dims) once per query pass;
  2. walk the split's KV tokens in tiles of ``block_n`` and put each tile into shared memory as bf16: a bf16 cache
     is copied; fp8 / mxfp4 are dequantized on the way (straight from global memory by default, or from a
     staged shared copy of the compressed tile with ``stage_compressed``);
  3. S = Q K^T over all 576 dims; tokens past the split end (or, causal, past each query's horizon) get -inf;
  4. online softmax in base 2: log2(e) is folded into the score scale, so one exp2 per score;
  5. O += P V, where V is the first 512 dims of the same tile (the latent part is both K and V);
  6. write the final bf16 output (``split=False``) or an fp32 partial output plus its base-2 log-sum-exp,
     which ``tl_kernels.mla_combine`` reduces over splits;
  7. ``fused_combine`` (Hopper): the split count is an argument; one split writes the output as in 6, several
     write their partials, wait at a grid-wide barrier, then each CTA of a (sequence, head group) merges its share
     of the group's output by LSE: one launch per call. The launch is cooperative (every CTA resident), so the
     grid must fit the GPU at once: ``mla.schedule`` picks this form only for grids of at most one CTA per SM.

Only what changes the generated code is static (``DecodeKernelConfig``); batch size, token counts, sequence
lengths and the number of splits are dynamic, so a new shape never recompiles.
"""

from dataclasses import dataclass
from types import SimpleNamespace

import tilelang.language as T

KV_LORA_RANK = 512  # latent dims: keys and values
ROPE_DIM = 64  # rope dims: keys only
QK_DIM = KV_LORA_RANK + ROPE_DIM  # 576
MXFP4_BLOCK = 32  # elements per e8m0 scale
MXFP4_SCALES_PER_TOKEN = QK_DIM // MXFP4_BLOCK  # 18
LOG2E = 1.4426950408889634  # log2(e): exp(x) == exp2(x * LOG2E)
MERGE_SPLITS = 8  # fused_combine: splits whose partial chunks one thread loads together before adding them
# fused_combine: a CTA reads other CTAs' partials through L2 (ld.global.cg: never a stale L1 line), by address, so
# TileLang's bounds legalisation puts no branch around each load (the rows are clamped instead; with a branch per
# load the merge was 2-3x slower, docs/perf.md run 17). Loads are coalesced 16-byte chunks (a warp reads 512
# contiguous bytes). The merge is spread over all the splits' CTAs after a grid-wide barrier (run 19): merged by the
# last CTA of each (sequence, head group) instead, one SM read every split's 32 KiB partial and the merge cost ~1 us
# per two splits plus ~3 us (run 18), more than the second launch it saves.
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

KV_FORMATS = ("bf16", "fp8", "mxfp4")
# Q precision: "bf16" as given; "fp8": bf16 Q quantized to fp8 inside the kernel with one per-tensor scale derived
# from amax(|Q|) (a8w8, bit-exact with torch's per-tensor quantization); "fp8_codes": Q given as fp8 codes + scale.
Q_FORMATS = ("bf16", "fp8", "fp8_codes")
FP8_MAX = {"float8_e4m3fn": 448.0, "float8_e4m3fnuz": 240.0}
AMAX_FLOOR = 9.992007221626409e-13  # bf16(1e-12): torch's per-tensor quantizer clamps amax to 1e-12 in bf16
# dim_split (gfx942): 8 wave64s share one 32-token KV tile; wave w owns latent dims [64w, 64w + 64) (wave 0 also the
# 64 rope dims); in a wave, lane (m, g) = (lane % 16, lane // 16) owns tokens 2m, 2m + 1 and dims [16g, 16g + 16)
# of each 64-dim chunk, so its global loads are whole vectors (bf16 2 x 16 B, fp8 16 B, mxfp4 8 B per token).
DS_WAVES, DS_LANES, DS_DIMS = 8, 64, 64
DS_SCORES = 8  # scores per lane per tile: head m, tokens 8g + 2r + j (r < 4 MFMA rows, j < 2 token halves)
DIM_SPLIT_SHAPE = (16, 1, 32, DS_WAVES * DS_LANES)  # (block_h, q_tile, block_n, threads)


# The lane maps of the dim_split program, shared by the kernel (with TIR expressions) and its NumPy model in
# tests/test_gfx942.py (with integers). m = lane % 16, g = lane // 16.
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


def ds_p_score(s, c):
    """Which of the lane's 8 scores is element c (< 4) of its P operand in P V k-step s (< 2): P V's k index
    4g + c of step s is token 8g + 4s + c (any order works as long as V^T uses the same)."""
    return (c % 2) * 4 + 2 * s + c // 2


def ds_vt_col(d, token):
    """LDS column of (dim d, token) in a wave's V^T slice: the four 8-token (16-byte) chunks of row d are swizzled by
    (d >> 1) & 3, so the P V operand reads (16 lanes: rows 16 nt + m, the same chunk g) spread over all 32 banks
    instead of 8 of them (rows are 64 bytes: without it, lanes m and m + 2 hit the same banks)."""
    return ((token // 8) ^ ((d // 2) % 4)) * 8 + token % 8


def ds_out_dim(wave, nt, g, r):
    """Output dim of the lane's P V result element r of dim block nt: O^T rows 16 nt + 4g + r of the wave's 64."""
    return wave * DS_DIMS + nt * 16 + g * 4 + r


@dataclass(frozen=True)
class DecodeKernelConfig:
    """Everything that changes the generated code of the decode kernel."""

    kv_format: str  # "bf16" | "fp8" | "mxfp4"
    q_format: str = "bf16"  # see Q_FORMATS
    num_heads: int = 16  # query heads of the op (16..128)
    block_h: int = 16  # heads per CTA
    q_tile: int = 1  # query tokens per CTA pass (rows = q_tile * block_h)
    block_n: int = 64  # KV tokens per tile
    num_stages: int = 1  # software-pipeline depth of the KV loop
    tiles_per_group: int = 1  # KV tiles per statically sized pipeline group (see the KV loop)
    threads: int = 128
    causal: bool = False
    split: bool = True  # True: write fp32 partials + LSE for the combine kernel; False: final output
    kv_rows_as_m: bool = False  # MMA orientation: True computes S^T = K Q^T and O^T = V^T P^T, so the KV tile is
    # the M dimension (64-row wgmma on Hopper; no padding of the 16 heads to 64 rows), False S = Q K^T, O = P V
    page_size: int = 0  # 0: flat cache (sequence b owns rows kv_indptr[b]:kv_indptr[b+1]); else tokens per page
    stage_compressed: bool = False  # True copies the compressed tile to shared memory (async) before dequantizing
    # it; False dequantizes straight from global memory (faster on the H200, docs/perf.md run 3; less LDS)
    fp8_dtype: str = "float8_e4m3fn"  # "float8_e4m3fnuz" on gfx942
    row_table_scope: str = "shared"  # paged: the row table as a static shared array, which the compiler knows
    # cannot alias the dynamic tile buffers, so it hoists the row loads ("shared.dyn": 10-40% slower, run 12)
    dim_split: bool = False  # gfx942: the wave-level program of ``_dim_split_body`` (8 wave64s share a 32-token
    # tile: each owns 64 of the 512 latent dims for Q K^T and P V, hand-placed MFMA operands, prefetched tiles)
    fp8_mfma: bool = False  # dim_split a8w8: Q K^T on the fp8 MFMA (e4m3fnuz operands straight from the cache)
    fused_combine: bool = False  # Hopper: the split count is an argument and the split merge runs inside the
    # kernel after a grid-wide barrier (one cooperative launch per call; the grid must fit the GPU at once)
    flash_io: bool = False  # paged + fused: FlashMLA's argument shapes (``mla.flash_mla``), so its call makes no
    # view: Q (batch, s_q, H, 576), the cache (num_blocks, page_size, 1, row), cache_seqlens (batch,) instead of
    # the CSR offsets, Out (batch, s_q, H, 512) and LSE (batch, H, s_q), +inf where a query sees no token

    def __post_init__(self):
        if self.kv_format not in KV_FORMATS:
            raise ValueError(f"kv_format must be one of {KV_FORMATS}, got {self.kv_format!r}")
        if self.q_format not in Q_FORMATS:
            raise ValueError(f"q_format must be one of {Q_FORMATS}, got {self.q_format!r}")
        if self.num_heads % self.block_h:
            raise ValueError(f"block_h={self.block_h} must divide num_heads={self.num_heads}")
        if self.dim_split and (self.block_h, self.q_tile, self.block_n, self.threads) != DIM_SPLIT_SHAPE:
            raise ValueError(f"dim_split takes (block_h, q_tile, block_n, threads) == {DIM_SPLIT_SHAPE}")
        if self.fused_combine and (not self.split or self.dim_split):
            raise ValueError("fused_combine needs split=True and the block-level program (not dim_split)")
        if self.fp8_mfma and not (self.dim_split and self.kv_format == "fp8" and self.q_format != "bf16"):
            raise ValueError("fp8_mfma needs dim_split, an fp8 cache and fp8 Q (a8w8)")
        if self.flash_io and not (self.fused_combine and self.page_size):
            raise ValueError("flash_io needs fused_combine and a paged cache (page_size > 0)")

    @property
    def block_m(self) -> int:
        return self.q_tile * self.block_h

    @property
    def amax_in_kernel(self) -> bool:
        """a8w8 from bf16 Q with the merge fused: the kernel reduces amax(|Q|) itself (a slice per CTA, combined
        by an atomic max before a grid barrier), so the call needs no reduction launch. Q_scale is then a zeroed
        cell the kernel accumulates into and leaves zero."""
        return self.fused_combine and self.q_format == "fp8"

    @property
    def semaphores_per_seq(self) -> int:
        """Split counters the launch passes per sequence: none (the fused merge waits at a grid-wide barrier)."""
        return 0

    @property
    def shared_bytes(self) -> int:
        """Shared memory (LDS) the kernel allocates, in bytes."""
        if self.dim_split:  # per wave: its V^T slice (64 dims x 32 tokens bf16) and its partial scores (fp32)
            return DS_WAVES * (DS_DIMS * self.block_n * 2 + DS_LANES * DS_SCORES * 4) + DS_LANES * DS_SCORES * 4
        kv_cols, _ = _kv_storage(self)
        bf16_tile = 2 * QK_DIM * self.block_n
        if self.kv_format == "bf16":
            kv = bf16_tile * self.num_stages  # the pipeline multi-buffers the tile it copies into
        else:
            staged = self.block_n * kv_cols * self.num_stages if self.stage_compressed else 0  # 1 byte / element
            kv = bf16_tile + staged
        scales = self.block_n * MXFP4_SCALES_PER_TOKEN * 4 * self.num_stages if self.kv_format == "mxfp4" else 0
        reduce_workspace = 3 * 1024  # row max / row sum scratch of the reductions
        tile_rows = 4 * self.block_n * self.tiles_per_group if self.page_size else 0  # paged: the group's cache rows
        return 2 * QK_DIM * self.block_m + kv + scales + 2 * self.block_m * self.block_n + reduce_workspace + tile_rows

    @property
    def name(self) -> str:
        """Readable variant name, unique per config."""
        fp8 = "fnuz" if self.fp8_dtype.endswith("fnuz") else "fn"
        return (
            f"mla_decode_{'split' if self.split else 'direct'}_kv{self.kv_format}_q{self.q_format}"
            f"_h{self.num_heads}_bh{self.block_h}_qt{self.q_tile}_bn{self.block_n}_st{self.num_stages}"
            f"_t{self.threads}_g{self.tiles_per_group}{'_causal' if self.causal else ''}"
            f"{'' if self.stage_compressed or self.kv_format == 'bf16' else '_nostage'}"
            f"{f'_page{self.page_size}' if self.page_size else ''}{'_kvm' if self.kv_rows_as_m else ''}"
            f"{'_rows' + self.row_table_scope.replace('.', '') if self.row_table_scope != 'shared' and self.page_size else ''}"
            f"{'_ds' if self.dim_split else ''}{'_f8mma' if self.fp8_mfma else ''}{'_fused' if self.fused_combine else ''}{'_flash' if self.flash_io else ''}_{fp8}"
        )


def _kv_storage(cfg: DecodeKernelConfig) -> tuple[int, str]:
    """(elements per KV row in memory, storage dtype) for a format."""
    if cfg.kv_format == "bf16":
        return QK_DIM, "bfloat16"
    if cfg.kv_format == "fp8":
        return QK_DIM, cfg.fp8_dtype
    return QK_DIM // 2, "uint8"  # two e2m1 codes per byte


def mla_decode_kernel(cfg: DecodeKernelConfig):
    """Returns the prim_func of the decode kernel for ``cfg``.

    Arguments of the prim_func (shapes in elements; all dynamic dims are symbolic):
      Q             (total_q, num_heads, 576)  bf16, or fp8 codes when q_format == "fp8_codes"
      KV            (total_kv, 576) bf16 | (total_kv, 576) fp8 | (total_kv, 288) uint8 (mxfp4 pairs)
      KV_scales     (scale_len,) uint8   mxfp4 e8m0 scales, flat; row t starts at t * scale_stride
      scale_stride  int32                 row stride of the mxfp4 scales (>= 18)
      Q_scale       (1,) fp32             "fp8_codes": the per-tensor Q scale; "fp8": amax(|Q|); "bf16": 1
      KV_scale      (1,) fp32             per-tensor KV scale (1 unless kv_format == "fp8")
      qo_indptr     (batch + 1,) int32
      kv_indptr     (batch + 1,) int32
      sm_scale      fp32                  softmax scale applied to Q K^T
      split=True:  O_partial (num_splits, total_q, num_heads, 512) fp32,
                   LSE_partial (num_splits, total_q, num_heads) fp32 (base 2; -inf for an empty split)
      split=False: Out (total_q, num_heads, 512) bf16, LSE (total_q, num_heads) fp32 (natural log)
      fused_combine: num_splits int32, O_partial (o_len,) fp32 and LSE_partial (l_len,) fp32 (the split=True
                   partials flattened, >= num_splits * total_q * num_heads * 512 / * 1 elements when num_splits
                   > 1, else unused), then Out and LSE as split=False
      paged: Page_table (batch, max_pages) int32 after kv_indptr; KV is the cache's rows (page * page_size + slot)
      flash_io (FlashMLA's shapes, total_q = batch * s_q): Q (batch, s_q, num_heads, 576), KV (num_blocks,
                   page_size, 1, row), cache_seqlens (batch,) int32 in place of qo_indptr and kv_indptr, Out (batch,
                   s_q, num_heads, 512), LSE (batch, num_heads, s_q) with +inf where a query sees nothing
    """
    heads = cfg.num_heads
    block_h, block_n, block_m, q_tile = cfg.block_h, cfg.block_n, cfg.block_m, cfg.q_tile
    head_groups = heads // block_h
    kv_cols, kv_dtype = _kv_storage(cfg)
    q_dtype = cfg.fp8_dtype if cfg.q_format == "fp8_codes" else "bfloat16"
    fp8_max = FP8_MAX[cfg.fp8_dtype]
    compute_dtype = "bfloat16"
    accum_dtype = "float32"
    ln2 = 0.6931471805599453

    if cfg.flash_io:  # every sequence has s_q queries; rows are (sequence, query) pairs
        q_seqs, s_q = T.dynamic("batch"), T.dynamic("s_q")
        total_q = q_seqs * s_q
        indptr_len = None
        num_seqs = q_seqs
    else:
        total_q = T.dynamic("total_q")
        indptr_len = T.dynamic("indptr_len")
        num_seqs = indptr_len - 1
    total_kv = T.dynamic("total_kv")
    scale_len = T.dynamic("scale_len")
    num_splits = T.dynamic("num_splits") if cfg.split and not cfg.fused_combine else 1
    fused = cfg.fused_combine
    staged = cfg.kv_format != "bf16" and cfg.stage_compressed

    def q_element(Q, q_begin, q_len, q_scale, q_pass, hg, r, d):
        """Q row r (query q_pass*q_tile + r // block_h, head hg*block_h + r % block_h), dim d, as bf16; 0 past the
        sequence's queries. a8w8 rounds it to fp8 exactly as torch does: bf16(q / scale), clamped, to e4m3."""
        qi = q_pass * q_tile + r // block_h
        value = Q[q_begin + T.min(qi, q_len - 1), hg * block_h + r % block_h, d]
        if cfg.q_format == "fp8":
            scaled = T.cast(T.cast(T.cast(value, accum_dtype) / q_scale, compute_dtype), accum_dtype)
            value = T.cast(T.clamp(scaled, -fp8_max, fp8_max), cfg.fp8_dtype)
        return T.if_then_else(qi < q_len, T.cast(value, compute_dtype), T.cast(0, compute_dtype))

    # Index order of the accumulators: (query row, token/dim), swapped when the KV tile is the MMA's M dimension.
    token_axis = 0 if cfg.kv_rows_as_m else 1  # the softmax reduces over tokens

    def tr(*index):
        """(query row, other) as the accumulators store it."""
        if len(index) == 1:  # a shape
            return list(reversed(index[0])) if cfg.kv_rows_as_m else list(index[0])
        return (index[1], index[0]) if cfg.kv_rows_as_m else index

    def tile_rows(Group_rows, t_in, kv_begin, tile_lo, split_hi):
        """``row_of(i)``: the cache row of row i of the current tile. Rows past the split end repeat its last token
        (finite data, so P V stays finite; their scores are masked). Flat: computed in place. Paged: read from the
        group's row table that ``paged_row`` filled before the tile pipeline (so no dependent page-table load
        precedes each element load)."""
        if cfg.page_size:
            return lambda i: Group_rows[t_in, i]
        return lambda i: kv_begin + T.min(tile_lo + i, split_hi - 1)

    def paged_row(Page_table, seq_id, tile_lo, split_hi, i):
        """Paged cache row of row i of the current tile: token p of sequence b is slot p % page_size of page
        Page_table[b, p // page_size]."""
        pos = T.min(tile_lo + i, split_hi - 1)
        return Page_table[seq_id, pos // cfg.page_size] * cfg.page_size + pos % cfg.page_size

    def mxfp4_element(src, row_of, Block_scale, i, d):
        """Element d of mxfp4 row i as fp32. The e2m1 code's 3 magnitude bits placed at fp16 bits 11..9 form an
        fp16 of value code * 2^-14 (denormal for the e2m1 subnormals, exact after conversion to fp32)."""
        byte = T.cast(compressed(src, row_of, i, d // 2), "int32")
        code = T.shift_right(byte, (d % 2) * 4) & 15  # low nibble = even element
        half_bits = T.shift_left(code & 8, 12) | T.shift_left(code & 7, 9)
        magnitude = T.cast(T.reinterpret(T.cast(half_bits, "uint16"), "float16"), accum_dtype)
        return magnitude * 16384.0 * Block_scale[i, d // MXFP4_BLOCK]  # 16384 = 2^14

    def compressed(src, row_of, i, c):
        """Element c of compressed row i of the current tile: from the staged shared copy, or from global memory
        (rows past the split end repeat its last token, as in the staged copy)."""
        if staged:
            return src[i, c]
        return src[row_of(i), c]

    def partial_row(split_id, q_row, head):
        """Flat (split, query row, head) index of the fused kernel's partials (the split=True layout)."""
        return (split_id * total_q + q_row) * heads + head

    def merge_load(buf, index):
        """buf[index] of a partial buffer, read by address through L2 (``MERGE_CUDA_SOURCE``)."""
        return T.call_extern(accum_dtype, "mla_merge_load", buf.access_ptr("r", offset=index))

    def q_scale_arg(Q_scale):
        """The Q_scale argument's value: the caller's (amax(|Q|) for a8w8, the scale of fp8 codes, 1 for bf16), or,
        with ``amax_in_kernel``, the amax this kernel reduced into it (read through L2, after the grid barrier)."""
        return merge_load(Q_scale, 0) if cfg.amax_in_kernel else Q_scale[0]

    # The LSE of a query that sees no token: -inf, or FlashMLA's +inf (flash_io).
    empty_lse = T.infinity(accum_dtype) if cfg.flash_io else -T.infinity(accum_dtype)

    @T.macro
    def write_output(Out, LSE, acc_o, denom, row_max, out_scale, q_begin, q_len, q_pass, hg):
        # The final bf16 output and natural-log LSE of one query pass. denom == 0 means nothing was visible:
        # output 0, LSE -inf.
        for r, d in T.Parallel(block_m, KV_LORA_RANK):
            qi = q_pass * q_tile + r // block_h
            if qi < q_len:
                value = T.if_then_else(denom[r] > 0, acc_o[tr(r, d)] * out_scale / denom[r], 0)
                Out[q_begin + qi, hg * block_h + r % block_h, d] = T.cast(value, "bfloat16")
        for r in T.Parallel(block_m):
            qi = q_pass * q_tile + r // block_h
            if qi < q_len:
                lse2 = T.if_then_else(denom[r] > 0, T.log2(denom[r]) + row_max[r], empty_lse)
                if cfg.flash_io:  # (sequence, head, query)
                    LSE[(q_begin + qi) // s_q, hg * block_h + r % block_h, (q_begin + qi) % s_q] = lse2 * ln2
                else:
                    LSE[q_begin + qi, hg * block_h + r % block_h] = lse2 * ln2

    @T.macro
    def write_partial(O_partial, LSE_partial, acc_o, denom, row_max, out_scale, q_begin, q_len, q_pass, hg, split_id):
        # One split's normalised fp32 output and base-2 LSE (-inf for a split that saw nothing).
        for r, d in T.Parallel(block_m, KV_LORA_RANK):
            qi = q_pass * q_tile + r // block_h
            if qi < q_len:
                value = T.if_then_else(denom[r] > 0, acc_o[tr(r, d)] * out_scale / denom[r], 0)
                if fused:
                    O_partial[partial_row(split_id, q_begin + qi, hg * block_h + r % block_h) * KV_LORA_RANK + d] = value
                else:
                    O_partial[split_id, q_begin + qi, hg * block_h + r % block_h, d] = value
        for r in T.Parallel(block_m):
            qi = q_pass * q_tile + r // block_h
            if qi < q_len:
                lse2 = T.if_then_else(denom[r] > 0, T.log2(denom[r]) + row_max[r], -T.infinity(accum_dtype))
                if fused:
                    LSE_partial[partial_row(split_id, q_begin + qi, hg * block_h + r % block_h)] = lse2
                else:
                    LSE_partial[split_id, q_begin + qi, hg * block_h + r % block_h] = lse2

    # fused_combine's merge: the output of a (sequence, head group) is q_len * block_h rows of 128 chunks of 4 dims;
    # its num_splits CTAs take equal contiguous ranges of those chunks, one chunk per thread per step, so a warp
    # reads 512 contiguous bytes of each split's partial.
    row_chunks = KV_LORA_RANK // 4

    @T.macro
    def merge_splits(O_partial, LSE_partial, Out, LSE, n_splits, merge_acc, merge_lse, merge_stage, merge_max,
                     merge_denom, tx, q_begin, q_len, split_id, hg):
        # Stage 7 (fused_combine): every CTA has written its split's partial; after the grid-wide barrier (the
        # kernel is launched cooperatively, so every CTA is resident and the barrier cannot wait on one that never
        # starts) each CTA merges its share of its (sequence, head group)'s output: for each of its chunks, the
        # splits' partials weighted by 2^(lse - max), MERGE_SPLITS splits per step with all their loads issued first
        # and the running max rescaled per step.
        T.sync_grid()
        total = q_len * block_h * row_chunks
        per_cta = T.ceildiv(total, n_splits)
        lo = split_id * per_cta
        hi = T.min(lo + per_cta, total)
        for step in T.serial(T.ceildiv(T.max(hi - lo, 0), cfg.threads)):
            at = lo + step * cfg.threads + tx
            if at < hi:
                row, d = at // row_chunks, at % row_chunks * 4
                q_row, head = q_begin + row // block_h, hg * block_h + row % block_h
                merge_max[0] = -T.infinity(accum_dtype)
                merge_denom[0] = 0
                for j in T.unroll(4):
                    merge_acc[j] = 0
                for group in T.serial(T.ceildiv(n_splits, MERGE_SPLITS)):
                    # The group's loads (a split past the last reads the last one's rows, with weight 0).
                    for g in T.unroll(MERGE_SPLITS):
                        sp = group * MERGE_SPLITS + g
                        prow = partial_row(T.min(sp, n_splits - 1), q_row, head)
                        merge_lse[g] = T.if_then_else(sp < n_splits, merge_load(LSE_partial, prow),
                                                      -T.infinity(accum_dtype))
                        T.call_extern("handle", "mla_merge_load4", merge_stage.access_ptr("w", offset=g * 4),
                                      O_partial.access_ptr("r", offset=prow * KV_LORA_RANK + d))
                    merge_max[1] = merge_max[0]
                    for g in T.unroll(MERGE_SPLITS):
                        merge_max[1] = T.max(merge_max[1], merge_lse[g])
                    # Nothing seen so far (all LSEs -inf): keep the zeros, so no (-inf) - (-inf).
                    if merge_max[1] != -T.infinity(accum_dtype):
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
                              Out.access_ptr("w", offset=(q_row * heads + head) * KV_LORA_RANK + d),
                              merge_acc.access_ptr("r", offset=0),
                              T.if_then_else(merge_denom[0] > 0, 1.0 / merge_denom[0], 0))
                if d == 0:
                    if cfg.flash_io:
                        lse = T.if_then_else(merge_denom[0] > 0, (T.log2(merge_denom[0]) + merge_max[0]) * ln2,
                                             empty_lse)
                        LSE[q_row // s_q, head, q_row % s_q] = lse
                    else:
                        LSE[q_row, head] = T.if_then_else(
                            merge_denom[0] > 0, (T.log2(merge_denom[0]) + merge_max[0]) * ln2, empty_lse
                        )

    @T.macro
    def reduce_amax(Q, Amax_cell, Amax_bits, n_splits, tx, split_id, seq_id, hg):
        # Stage 0 (amax_in_kernel): amax(|Q|) over the whole Q tensor: each CTA takes an equal slice of its elements,
        # the CTA's maximum goes into the zeroed cell by an integer atomic max on the float bits (|q| >= 0, so their
        # order is the floats'; a NaN's bits exceed inf's, so NaN wins as in torch's amax); after the grid barrier
        # every CTA reads the total through L2 (``merge_load``). Exact: the same amax as torch's reduction.
        n_ctas = n_splits * num_seqs * head_groups
        cta = (hg * num_seqs + seq_id) * n_splits + split_id
        total = total_q * heads * QK_DIM
        per_cta = T.ceildiv(total, n_ctas)
        lo = cta * per_cta
        hi = T.min(lo + per_cta, total)
        bits = T.alloc_var("int32", init=0)
        for step in T.serial(T.ceildiv(T.max(hi - lo, 0), cfg.threads)):
            at = lo + step * cfg.threads + tx
            if at < hi:
                value = T.abs(T.cast(Q[at // (heads * QK_DIM), at // QK_DIM % heads, at % QK_DIM], accum_dtype))
                bits = T.max(bits, T.reinterpret(value, "int32"))
        if tx == 0:
            Amax_bits[0] = 0
        T.sync_threads()
        T.atomic_max(Amax_bits[0], bits)
        T.sync_threads()
        if tx == 0:
            T.call_extern("handle", "mla_amax_bits", Amax_cell.access_ptr("rw", offset=0), Amax_bits[0])
        T.sync_grid()

    @T.macro
    def decode_body(Q, KV, KV_scales, scale_stride, Q_scale, KV_scale, qo_indptr, kv_indptr, Page_table, sm_scale,
                    n_splits, O_partial, LSE_partial, Out, LSE):
        with T.Kernel(n_splits, num_seqs, head_groups, threads=cfg.threads) as (split_id, seq_id, hg):
            Q_shared = T.alloc_shared([block_m, KV_LORA_RANK], compute_dtype)
            Qpe_shared = T.alloc_shared([block_m, ROPE_DIM], compute_dtype)
            KV_shared = T.alloc_shared([block_n, KV_LORA_RANK], compute_dtype)
            Kpe_shared = T.alloc_shared([block_n, ROPE_DIM], compute_dtype)
            if staged:
                KV_raw = T.alloc_shared([block_n, kv_cols], kv_dtype)
            else:
                KV_raw = KV  # not staged: compressed() reads global memory
            if cfg.kv_format == "mxfp4":
                Block_scale = T.alloc_shared([block_n, MXFP4_SCALES_PER_TOKEN], accum_dtype)
            P_shared = T.alloc_shared([block_m, block_n], compute_dtype)
            # Paged: the cache rows of the current group of tiles (flat kernels compute rows in place).
            if cfg.page_size:
                Group_rows = T.alloc_shared([cfg.tiles_per_group, block_n], "int32", scope=cfg.row_table_scope)
            # Scores and output accumulators, [query row, token] / [query row, dim], or transposed (kv_rows_as_m).
            acc_s = T.alloc_fragment(tr([block_m, block_n]), accum_dtype)
            acc_o = T.alloc_fragment(tr([block_m, KV_LORA_RANK]), accum_dtype)
            row_max = T.alloc_fragment([block_m], accum_dtype)
            row_max_prev = T.alloc_fragment([block_m], accum_dtype)
            row_max_safe = T.alloc_fragment([block_m], accum_dtype)
            rescale = T.alloc_fragment([block_m], accum_dtype)
            row_sum = T.alloc_fragment([block_m], accum_dtype)
            denom = T.alloc_fragment([block_m], accum_dtype)
            if fused:
                T.import_source(MERGE_CUDA_SOURCE)
                merge_acc = T.alloc_local([4], accum_dtype)  # the merged chunk (weighted sum)
                merge_lse = T.alloc_local([MERGE_SPLITS], accum_dtype)  # a step's splits' LSEs
                merge_stage = T.alloc_local([MERGE_SPLITS * 4], accum_dtype)  # a step's splits' partial chunks
                merge_max = T.alloc_local([2], accum_dtype)  # running max LSE of the chunk's row; a step's max
                merge_denom = T.alloc_local([1], accum_dtype)  # running sum of weights
                if cfg.amax_in_kernel:
                    Amax_bits = T.alloc_shared([1], "int32")  # the CTA's amax(|Q|) slice, as float bits
                tx = T.get_thread_binding()

            # Per-CTA scalars, computed once (registers), not re-derived in every index expression.
            if cfg.flash_io:  # kv_indptr is cache_seqlens; s_q queries per sequence (the paged rows need no offset)
                kv_begin = T.alloc_var("int32", init=0)
                kv_len = T.alloc_var("int32", init=kv_indptr[seq_id])
                q_begin = T.alloc_var("int32", init=seq_id * s_q)
                q_len = T.alloc_var("int32", init=s_q)
            else:
                kv_begin = T.alloc_var("int32", init=kv_indptr[seq_id])
                kv_len = T.alloc_var("int32", init=kv_indptr[seq_id + 1] - kv_indptr[seq_id])
                q_begin = T.alloc_var("int32", init=qo_indptr[seq_id])
                q_len = T.alloc_var("int32", init=qo_indptr[seq_id + 1] - qo_indptr[seq_id])
            # Split s of a sequence covers [s * chunk, (s + 1) * chunk) of its tokens, chunk a multiple of block_n.
            chunk = T.alloc_var("int32", init=T.ceildiv(T.ceildiv(kv_len, n_splits), block_n) * block_n)
            split_lo = T.alloc_var("int32", init=split_id * chunk)
            split_hi = T.alloc_var("int32", init=T.min(split_lo + chunk, kv_len))
            num_tiles = T.alloc_var("int32", init=T.ceildiv(T.max(split_hi - split_lo, 0), block_n))
            # a8w8: the per-tensor Q scale from amax, rounded to bf16 as torch computes it (amax / fp8_max in bf16).
            if cfg.amax_in_kernel:
                reduce_amax(Q, Q_scale, Amax_bits, n_splits, tx, split_id, seq_id, hg)
            q_scale = T.alloc_var(
                accum_dtype,
                init=T.cast(T.cast(T.max(q_scale_arg(Q_scale), AMAX_FLOOR) / fp8_max, "bfloat16"), accum_dtype)
                if cfg.q_format == "fp8"
                else q_scale_arg(Q_scale),
            )
            # Scores are scaled once, in base 2; fp8 per-tensor scales of Q and K fold in here.
            score_scale = T.alloc_var(accum_dtype, init=sm_scale * LOG2E * q_scale * KV_scale[0])
            out_scale = T.alloc_var(accum_dtype, init=KV_scale[0])

            for q_pass in T.serial(T.ceildiv(q_len, q_tile)):
                # Stage 1: Q rows (row r = query q_pass*q_tile + r // block_h, head hg*block_h + r % block_h).
                for r, d in T.Parallel(block_m, KV_LORA_RANK):
                    Q_shared[r, d] = q_element(Q, q_begin, q_len, q_scale, q_pass, hg, r, d)
                for r, d in T.Parallel(block_m, ROPE_DIM):
                    Qpe_shared[r, d] = q_element(Q, q_begin, q_len, q_scale, q_pass, hg, r, KV_LORA_RANK + d)
                T.fill(acc_o, 0)
                T.fill(denom, 0)
                T.fill(row_max, -T.infinity(accum_dtype))

                # The KV loop: groups of ``tiles_per_group`` tiles, each group a software pipeline of static
                # length (TileLang 0.1.15 cannot pipeline a loop whose trip count varies per CTA). Tiles past the
                # split's end are fully masked and change nothing.
                for group in T.serial(T.ceildiv(num_tiles, cfg.tiles_per_group)):
                    if cfg.page_size:
                        # Stage 2a (paged): the group's cache rows from the page table, one lookup per row.
                        for t, i in T.Parallel(cfg.tiles_per_group, block_n):
                            Group_rows[t, i] = paged_row(
                                Page_table, seq_id, split_lo + (group * cfg.tiles_per_group + t) * block_n, split_hi, i
                            )
                    for t_in in T.Pipelined(cfg.tiles_per_group, num_stages=cfg.num_stages):
                        tile_lo = split_lo + (group * cfg.tiles_per_group + t_in) * block_n
                        row_of = tile_rows(Group_rows if cfg.page_size else None, t_in, kv_begin, tile_lo, split_hi)
                        # Stage 2: the KV tile as bf16 in shared memory.
                        if cfg.kv_format == "bf16":
                            for i, d in T.Parallel(block_n, KV_LORA_RANK):
                                KV_shared[i, d] = KV[row_of(i), d]
                            for i, d in T.Parallel(block_n, ROPE_DIM):
                                Kpe_shared[i, d] = KV[row_of(i), KV_LORA_RANK + d]
                        elif staged:
                            for i, c in T.Parallel(block_n, kv_cols):
                                KV_raw[i, c] = KV[row_of(i), c]
                        if cfg.kv_format == "fp8":
                            # fp8 -> bf16 is exact; the per-tensor scale is applied to scores and output instead.
                            for i, d in T.Parallel(block_n, KV_LORA_RANK):
                                KV_shared[i, d] = T.cast(compressed(KV_raw, row_of, i, d), compute_dtype)
                            for i, d in T.Parallel(block_n, ROPE_DIM):
                                Kpe_shared[i, d] = T.cast(compressed(KV_raw, row_of, i, KV_LORA_RANK + d), compute_dtype)
                        if cfg.kv_format == "mxfp4":
                            # e8m0 byte e -> 2^(e - 127), built from its bits (e == 0 is the subnormal 2^-127; 255 is NaN).
                            for i, b in T.Parallel(block_n, MXFP4_SCALES_PER_TOKEN):
                                e = T.cast(KV_scales[row_of(i) * scale_stride + b], "int32")
                                Block_scale[i, b] = T.if_then_else(
                                    e == 0,
                                    T.float32(5.877471754111438e-39),
                                    T.reinterpret(T.if_then_else(e == 255, 0x7FC00000, T.shift_left(e, 23)), "float32"),
                                )
                            # Values = e2m1 code * power-of-two scale: exact in bf16. Latent and rope parts are separate
                            # loops (one conditional store per element defeats TileLang's vectorizer).
                            for i, d in T.Parallel(block_n, KV_LORA_RANK):
                                KV_shared[i, d] = T.cast(
                                    mxfp4_element(KV_raw, row_of, Block_scale, i, d), compute_dtype
                                )
                            for i, d in T.Parallel(block_n, ROPE_DIM):
                                Kpe_shared[i, d] = T.cast(
                                    mxfp4_element(KV_raw, row_of, Block_scale, i, KV_LORA_RANK + d),
                                    compute_dtype,
                                )

                        # Stage 3: S = Q K^T over the 512 latent + 64 rope dims.
                        if cfg.kv_rows_as_m:
                            T.gemm(KV_shared, Q_shared, acc_s, transpose_B=True, clear_accum=True)
                            T.gemm(Kpe_shared, Qpe_shared, acc_s, transpose_B=True)
                        else:
                            T.gemm(Q_shared, KV_shared, acc_s, transpose_B=True, policy=T.GemmWarpPolicy.FullCol, clear_accum=True)
                            T.gemm(Qpe_shared, Kpe_shared, acc_s, transpose_B=True, policy=T.GemmWarpPolicy.FullCol)
                        for r, j in T.Parallel(block_m, block_n):
                            qi = q_pass * q_tile + r // block_h
                            horizon = split_hi
                            if cfg.causal:
                                # query qi of q_len sees positions [0, kv_len - q_len + qi]
                                horizon = T.min(split_hi, kv_len - q_len + qi + 1)
                            acc_s[tr(r, j)] = T.if_then_else(
                                tile_lo + j < horizon, acc_s[tr(r, j)] * score_scale, -T.infinity(accum_dtype)
                            )

                        # Stage 4: online softmax (base 2). A row with no visible token yet keeps max -inf; the safe
                        # max (0) keeps exp2 away from (-inf) - (-inf).
                        T.copy(row_max, row_max_prev)
                        T.reduce_max(acc_s, row_max, dim=token_axis, clear=False)
                        for r in T.Parallel(block_m):
                            row_max_safe[r] = T.if_then_else(row_max[r] == -T.infinity(accum_dtype), 0, row_max[r])
                            rescale[r] = T.exp2(row_max_prev[r] - row_max_safe[r])
                        for r, j in T.Parallel(block_m, block_n):
                            acc_s[tr(r, j)] = T.exp2(acc_s[tr(r, j)] - row_max_safe[r])
                        T.reduce_sum(acc_s, row_sum, dim=token_axis)
                        for r in T.Parallel(block_m):
                            denom[r] = denom[r] * rescale[r] + row_sum[r]
                        for r, d in T.Parallel(block_m, KV_LORA_RANK):
                            acc_o[tr(r, d)] *= rescale[r]
                        if cfg.kv_rows_as_m:
                            for r, j in T.Parallel(block_m, block_n):
                                P_shared[r, j] = T.cast(acc_s[j, r], compute_dtype)
                        else:
                            T.copy(acc_s, P_shared)

                        # Stage 5: O += P V.
                        if cfg.kv_rows_as_m:
                            T.gemm(KV_shared, P_shared, acc_o, transpose_A=True, transpose_B=True)
                        else:
                            T.gemm(P_shared, KV_shared, acc_o, policy=T.GemmWarpPolicy.FullCol)

                # Stage 6: normalise and write: the output (one split), or this split's partial.
                if fused:
                    if n_splits == 1:
                        write_output(Out, LSE, acc_o, denom, row_max, out_scale, q_begin, q_len, q_pass, hg)
                    else:
                        write_partial(O_partial, LSE_partial, acc_o, denom, row_max, out_scale, q_begin, q_len,
                                      q_pass, hg, split_id)
                elif cfg.split:
                    write_partial(O_partial, LSE_partial, acc_o, denom, row_max, out_scale, q_begin, q_len, q_pass,
                                  hg, split_id)
                else:
                    write_output(Out, LSE, acc_o, denom, row_max, out_scale, q_begin, q_len, q_pass, hg)

            # Stage 7 (fused_combine, several splits; n_splits is the same in every CTA, so all reach the barrier).
            if fused:
                if n_splits > 1:
                    merge_splits(O_partial, LSE_partial, Out, LSE, n_splits, merge_acc, merge_lse, merge_stage,
                                 merge_max, merge_denom, tx, q_begin, q_len, split_id, hg)
                if cfg.amax_in_kernel:
                    # Every CTA read amax(|Q|) before the merge's barrier (one split: this one): the cell goes back
                    # to zero for the next call.
                    if n_splits == 1:
                        T.sync_grid()
                    if split_id == 0 and seq_id == 0 and hg == 0 and tx == 0:
                        Q_scale[0] = 0

    if cfg.dim_split:
        decode_body = _dim_split_body(
            cfg, dict(total_q=total_q, indptr_len=indptr_len, scale_len=scale_len, num_splits=num_splits)
        )
    if cfg.page_size:
        dims = dict(
            total_q=total_q, total_kv=total_kv, indptr_len=indptr_len, scale_len=scale_len, num_splits=num_splits
        )
        if cfg.flash_io:
            dims.update(batch=q_seqs, s_q=s_q)
        return _paged_prim_func(cfg, decode_body, q_dtype, kv_dtype, kv_cols, dims)
    if fused:
        o_len, l_len = T.dynamic("o_len"), T.dynamic("l_len")

        @T.prim_func
        def mla_decode_fused(
            Q: T.Tensor([total_q, heads, QK_DIM], q_dtype),
            KV: T.Tensor([total_kv, kv_cols], kv_dtype),
            KV_scales: T.Tensor([scale_len], "uint8"),
            scale_stride: T.int32,
            Q_scale: T.Tensor([1], accum_dtype),
            KV_scale: T.Tensor([1], accum_dtype),
            qo_indptr: T.Tensor([indptr_len], "int32"),
            kv_indptr: T.Tensor([indptr_len], "int32"),
            sm_scale: T.float32,
            num_splits: T.int32,
            O_partial: T.Tensor([o_len], accum_dtype),
            LSE_partial: T.Tensor([l_len], accum_dtype),
            Out: T.Tensor([total_q, heads, KV_LORA_RANK], "bfloat16"),
            LSE: T.Tensor([total_q, heads], accum_dtype),
        ):
            decode_body(Q, KV, KV_scales, scale_stride, Q_scale, KV_scale, qo_indptr, kv_indptr, None, sm_scale,
                        num_splits, O_partial, LSE_partial, Out, LSE)

        return mla_decode_fused
    if cfg.split:

        @T.prim_func
        def mla_decode_split(
            Q: T.Tensor([total_q, heads, QK_DIM], q_dtype),
            KV: T.Tensor([total_kv, kv_cols], kv_dtype),
            KV_scales: T.Tensor([scale_len], "uint8"),
            scale_stride: T.int32,
            Q_scale: T.Tensor([1], accum_dtype),
            KV_scale: T.Tensor([1], accum_dtype),
            qo_indptr: T.Tensor([indptr_len], "int32"),
            kv_indptr: T.Tensor([indptr_len], "int32"),
            sm_scale: T.float32,
            O_partial: T.Tensor([num_splits, total_q, heads, KV_LORA_RANK], accum_dtype),
            LSE_partial: T.Tensor([num_splits, total_q, heads], accum_dtype),
        ):
            decode_body(Q, KV, KV_scales, scale_stride, Q_scale, KV_scale, qo_indptr, kv_indptr, None, sm_scale,
                        num_splits, O_partial, LSE_partial, None, None)

        return mla_decode_split

    @T.prim_func
    def mla_decode_direct(
        Q: T.Tensor([total_q, heads, QK_DIM], q_dtype),
        KV: T.Tensor([total_kv, kv_cols], kv_dtype),
        KV_scales: T.Tensor([scale_len], "uint8"),
        scale_stride: T.int32,
        Q_scale: T.Tensor([1], accum_dtype),
        KV_scale: T.Tensor([1], accum_dtype),
        qo_indptr: T.Tensor([indptr_len], "int32"),
        kv_indptr: T.Tensor([indptr_len], "int32"),
        sm_scale: T.float32,
        Out: T.Tensor([total_q, heads, KV_LORA_RANK], "bfloat16"),
        LSE: T.Tensor([total_q, heads], accum_dtype),
    ):
        decode_body(Q, KV, KV_scales, scale_stride, Q_scale, KV_scale, qo_indptr, kv_indptr, None, sm_scale, 1, None,
                    None, Out, LSE)

    return mla_decode_direct


def _paged_prim_func(cfg: DecodeKernelConfig, decode_body, q_dtype: str, kv_dtype: str, kv_cols: int, dims: dict):
    """The paged-cache variant: as the flat one plus ``Page_table (batch, max_pages) int32``; KV (and the mxfp4
    scales) are indexed by physical row = page * page_size + slot, i.e. the paged cache flattened to rows.
    ``dims`` are the flat kernel's dynamic dims, which ``decode_body`` closes over."""
    heads, accum_dtype = cfg.num_heads, "float32"
    total_q, cache_rows, indptr_len, scale_len = dims["total_q"], dims["total_kv"], dims["indptr_len"], dims["scale_len"]
    num_splits = dims["num_splits"]
    batch, max_pages = T.dynamic("batch, max_pages")

    if cfg.flash_io:
        return _flash_prim_func(cfg, decode_body, q_dtype, kv_dtype, kv_cols, dims)
    if cfg.fused_combine:
        o_len, l_len = T.dynamic("o_len"), T.dynamic("l_len")

        @T.prim_func
        def mla_decode_fused_paged(
            Q: T.Tensor([total_q, heads, QK_DIM], q_dtype),
            KV: T.Tensor([cache_rows, kv_cols], kv_dtype),
            KV_scales: T.Tensor([scale_len], "uint8"),
            scale_stride: T.int32,
            Q_scale: T.Tensor([1], accum_dtype),
            KV_scale: T.Tensor([1], accum_dtype),
            qo_indptr: T.Tensor([indptr_len], "int32"),
            kv_indptr: T.Tensor([indptr_len], "int32"),
            Page_table: T.Tensor([batch, max_pages], "int32"),
            sm_scale: T.float32,
            num_splits: T.int32,
            O_partial: T.Tensor([o_len], accum_dtype),
            LSE_partial: T.Tensor([l_len], accum_dtype),
            Out: T.Tensor([total_q, heads, KV_LORA_RANK], "bfloat16"),
            LSE: T.Tensor([total_q, heads], accum_dtype),
        ):
            decode_body(Q, KV, KV_scales, scale_stride, Q_scale, KV_scale, qo_indptr, kv_indptr, Page_table, sm_scale,
                        num_splits, O_partial, LSE_partial, Out, LSE)

        return mla_decode_fused_paged

    if cfg.split:

        @T.prim_func
        def mla_decode_split_paged(
            Q: T.Tensor([total_q, heads, QK_DIM], q_dtype),
            KV: T.Tensor([cache_rows, kv_cols], kv_dtype),
            KV_scales: T.Tensor([scale_len], "uint8"),
            scale_stride: T.int32,
            Q_scale: T.Tensor([1], accum_dtype),
            KV_scale: T.Tensor([1], accum_dtype),
            qo_indptr: T.Tensor([indptr_len], "int32"),
            kv_indptr: T.Tensor([indptr_len], "int32"),
            Page_table: T.Tensor([batch, max_pages], "int32"),
            sm_scale: T.float32,
            O_partial: T.Tensor([num_splits, total_q, heads, KV_LORA_RANK], accum_dtype),
            LSE_partial: T.Tensor([num_splits, total_q, heads], accum_dtype),
        ):
            decode_body(Q, KV, KV_scales, scale_stride, Q_scale, KV_scale, qo_indptr, kv_indptr, Page_table, sm_scale,
                        num_splits, O_partial, LSE_partial, None, None)

        return mla_decode_split_paged

    @T.prim_func
    def mla_decode_direct_paged(
        Q: T.Tensor([total_q, heads, QK_DIM], q_dtype),
        KV: T.Tensor([cache_rows, kv_cols], kv_dtype),
        KV_scales: T.Tensor([scale_len], "uint8"),
        scale_stride: T.int32,
        Q_scale: T.Tensor([1], accum_dtype),
        KV_scale: T.Tensor([1], accum_dtype),
        qo_indptr: T.Tensor([indptr_len], "int32"),
        kv_indptr: T.Tensor([indptr_len], "int32"),
        Page_table: T.Tensor([batch, max_pages], "int32"),
        sm_scale: T.float32,
        Out: T.Tensor([total_q, heads, KV_LORA_RANK], "bfloat16"),
        LSE: T.Tensor([total_q, heads], accum_dtype),
    ):
        decode_body(Q, KV, KV_scales, scale_stride, Q_scale, KV_scale, qo_indptr, kv_indptr, Page_table, sm_scale, 1,
                    None, None, Out, LSE)

    return mla_decode_direct_paged


def _flash_prim_func(cfg: DecodeKernelConfig, decode_body, q_dtype: str, kv_dtype: str, kv_cols: int, dims: dict):
    """The paged fused kernel in FlashMLA's argument shapes (``flash_io``): the same body over row views of Q, the
    cache and Out (``T.reshape``: no copy), the lengths read from cache_seqlens, the LSE as (batch, H, s_q)."""
    heads, accum_dtype = cfg.num_heads, "float32"
    batch, s_q, scale_len = dims["batch"], dims["s_q"], dims["scale_len"]
    num_blocks, max_pages = T.dynamic("num_blocks, max_pages")
    o_len, l_len = T.dynamic("o_len"), T.dynamic("l_len")

    @T.prim_func
    def mla_decode_flash(
        Q: T.Tensor([batch, s_q, heads, QK_DIM], q_dtype),
        KV: T.Tensor([num_blocks, cfg.page_size, 1, kv_cols], kv_dtype),
        KV_scales: T.Tensor([scale_len], "uint8"),
        scale_stride: T.int32,
        Q_scale: T.Tensor([1], accum_dtype),
        KV_scale: T.Tensor([1], accum_dtype),
        cache_seqlens: T.Tensor([batch], "int32"),
        Page_table: T.Tensor([batch, max_pages], "int32"),
        sm_scale: T.float32,
        num_splits: T.int32,
        O_partial: T.Tensor([o_len], accum_dtype),
        LSE_partial: T.Tensor([l_len], accum_dtype),
        Out: T.Tensor([batch, s_q, heads, KV_LORA_RANK], "bfloat16"),
        LSE: T.Tensor([batch, heads, s_q], accum_dtype),
    ):
        Q_rows = T.reshape(Q, [batch * s_q, heads, QK_DIM])
        KV_rows = T.reshape(KV, [num_blocks * cfg.page_size, kv_cols])
        Out_rows = T.reshape(Out, [batch * s_q, heads, KV_LORA_RANK])
        decode_body(Q_rows, KV_rows, KV_scales, scale_stride, Q_scale, KV_scale, None, cache_seqlens, Page_table,
                    sm_scale, num_splits, O_partial, LSE_partial, Out_rows, LSE)

    return mla_decode_flash



# ------------------------------------------------------------------------------------------------ dim_split (gfx942)

# Device helpers of the dim_split program (HIP only):
# - mla_ds_copy16 / mla_ds_copy8 / mla_ds_load_i32: one whole-vector global load into the lane's registers (or one
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
static __device__ inline __attribute__((always_inline)) int mla_ds_load_i32(const int* p) {
  return *p;
}
static __device__ inline __attribute__((always_inline)) unsigned int mla_ds_load_u32(const unsigned char* p) {
  unsigned int v;
  __builtin_memcpy(&v, p, 4);
  return v;
}
"""


def _dim_split_body(cfg: DecodeKernelConfig, dims: dict):
    """The decode program for gfx942 as wave-level code (``cfg.dim_split``): same arguments and results as
    ``decode_body``, different work split. One workgroup = 8 wave64s sharing one 32-token KV tile per step, so one
    workgroup of 48 KiB LDS keeps 8 waves on a CU (2 per SIMD). Per tile:
      1. each lane already holds the tile in registers (issued one tile ahead, whole-vector loads, rows of a paged
         cache looked up two tiles ahead), and issues the loads of the next tile before computing this one;
      2. S^T partial = K Q^T over the wave's 64 latent dims (+ the 64 rope dims on wave 0) on MFMA, both operands
         from registers (the lane's 16 dims of two tokens; Q once per pass); the wave writes its V^T slice
         (64 dims x 32 tokens, bf16, tokens contiguous) to its own LDS region;
      3. the 8 partial score tiles meet in LDS (one barrier) and every wave sums them: lane (m, g) holds head m,
         tokens 8g + 2r + j, exactly the P operand of the P V MFMA, so P never goes through LDS;
      4. online softmax in base 2 per head (max / sum across the 4 lane groups with two xor shuffles);
      5. O^T += V^T P^T for the wave's 64 output dims: V^T read with 16-byte LDS reads, P from registers; lane
         (m, g) accumulates head m, dims 16 nt + 4g + r, so the softmax rescale is lane-local.
    The MFMA lane layouts (16x16x16 bf16; 16x16x32 fp8): operand A lane (i, kgroup) = (lane % 16, lane // 16),
    B lane (j, kgroup), result D[4 (lane // 16) + r][lane % 16]; the k order inside a step is free as long as
    both operands use the same one."""
    from tilelang.rocm.language.tir import tvm_mfma

    from tl_kernels import dequant_hip

    heads, block_h, block_n = cfg.num_heads, cfg.block_h, cfg.block_n
    head_groups = heads // block_h
    kv_cols, kv_dtype = _kv_storage(cfg)
    fp8_max = FP8_MAX[cfg.fp8_dtype]
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
    # Dim of element e of a lane's 16 decoded elements: the mxfp4 decode pairs codes (k, k + 4) of each word
    # (dequant_hip.E2M1_ORDER); Q is loaded in the same order and V^T rows are written by their true dim.
    order = dequant_hip.e2m1_order if mx else (lambda e: e)
    total_q, indptr_len, scale_len = dims["total_q"], dims["indptr_len"], dims["scale_len"]
    num_splits = dims["num_splits"]
    ln2 = 0.6931471805599453
    ninf = -T.infinity(f32)

    def chunk_col(st, ch):
        """First storage column of the lane's slice of chunk ch (0: the wave's latent dims, 1: rope): ds_dim(chunk,
        g, 0) in storage columns."""
        return (st.wave * chunk_cols if ch == 0 else (KV_LORA_RANK // DS_DIMS) * chunk_cols) + st.g * lane_cols

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

    @T.macro
    def load_scale(st, b, slot, t, j, ch):
        # e8m0 scale of the lane's 16 dims (one 32-element block): the dword that holds its byte, kept in bounds
        # at the end of the scale array (the scale rows have any stride and offset: no alignment to rely on).
        block = (st.wave * 2 if ch == 0 else MXFP4_SCALES_PER_TOKEN - 2) + st.g // 2
        pos = row_of(st, slot, t, j) * st.scale_stride + block
        start = T.min(pos, scale_len - 4)
        st.sc_word[b, ch, j] = T.call_extern("uint32", "mla_ds_load_u32", st.KV_scales.access_ptr("r", offset=start))
        st.sc_shift[b, ch, j] = (pos - start) * 8

    @T.macro
    def load_q(st, ch, Q, row, head):
        # The lane's Q slice of chunk ch (head m; dims 16g .. 16g + 15 of the chunk), once per query pass.
        if mx:  # in the decode's element order (a register permute of one vector load)
            for e in T.vectorized(16):
                st.q_tmp[e] = Q[row, head, chunk_col(st, ch) + e]
            for e in T.unroll(16):
                st.q_op[ch, e] = st.q_tmp[order(e)]
        else:
            for e in T.vectorized(16):
                value = Q[row, head, chunk_col(st, ch) + e]
                if cfg.q_format == "fp8":
                    scaled = T.cast(T.cast(T.cast(value, f32) / st.q_scale, bf16), f32)
                    value = T.cast(T.clamp(scaled, -fp8_max, fp8_max), cfg.fp8_dtype)
                st.q_op[ch, e] = T.cast(value, op_dtype)

    @T.macro
    def load_chunk(st, b, slot, t, j, ch):
        for v in T.unroll(max(lane_bytes // 16, 1)):
            T.evaluate(T.call_extern(
                "handle", copy_fn, T.address_of(st.kv_raw[b, ch, j, v * vec_elems]),
                st.KV.access_ptr("r", offset=row_of(st, slot, t, j) * kv_cols + chunk_col(st, ch) + v * vec_elems),
            ))

    @T.macro
    def load_tile(st, b, slot, t):
        # Whole-vector loads of the lane's two tokens, all issued before any is used. Every wave loads the rope slice
        # too (only wave 0 multiplies it; the other 7 read lines the CU has in L1): a load under a branch makes the
        # compiler wait for it at the join (vmcnt(0)), which would serialise the tile's loads.
        for j in T.unroll(2):
            load_chunk(st, b, slot, t, j, 0)
            load_chunk(st, b, slot, t, j, 1)
            if mx:
                load_scale(st, b, slot, t, j, 0)
                load_scale(st, b, slot, t, j, 1)
        # Keep the compiler's scheduler from sinking these loads below the compute that follows (it would then wait
        # for the previous tile with nothing else in flight).
        T.evaluate(T.call_extern("handle", "__builtin_amdgcn_sched_barrier", 0))

    def scale_byte(st, b, ch, j):
        """mxfp4: the e8m0 byte of the lane's 16 dims of chunk ch, token j."""
        return T.shift_right(st.sc_word[b, ch, j], T.cast(st.sc_shift[b, ch, j], "uint32"))

    @T.macro
    def decode(st, dst, b, ch, j):
        # The lane's 16 elements of chunk ch, token j, as bf16 (exact for every format): one device function call
        # on whole words (tl_kernels/dequant_hip.py).
        if mx:
            dequant_hip.e2m1x16_to_bf16(T.address_of(dst[j, 0]), T.address_of(st.kv_raw[b, ch, j, 0]), scale_byte(st, b, ch, j))
        else:
            dequant_hip.fp8x16_to_bf16(T.address_of(dst[j, 0]), T.address_of(st.kv_raw[b, ch, j, 0]))

    @T.macro
    def qk_chunk(st, b, ch):
        # S^T partial (token slot, head) += K Q^T over the 16 dims of each of the 4 lane groups.
        if not raw_operand:
            for j in T.unroll(2):
                decode(st, st.k_op, b, ch, j)
        for j in T.unroll(2):
            for a in T.unroll(qk_steps):
                if raw_operand:
                    tvm_mfma(qk_mfma, "row", "row", qk_vec, qk_vec, "float32x4",
                             st.kv_raw.data, ((b * 2 + ch) * 2 + j) * qk_steps + a, st.q_op.data, ch * qk_steps + a,
                             st.s_acc.data, j, dtype="float32x4")
                else:
                    tvm_mfma(qk_mfma, "row", "row", qk_vec, qk_vec, "float32x4",
                             st.k_op.data, j * qk_steps + a, st.q_op.data, ch * qk_steps + a, st.s_acc.data, j,
                             dtype="float32x4")

    @T.macro
    def compute_tile(st, b, t, q_pass):
        tile_lo = st.split_lo + t * block_n
        for i in T.unroll(DS_SCORES):
            st.s_acc[i] = 0
        qk_chunk(st, b, 0)
        # V^T of the wave's latent dims, bf16, tokens contiguous: 2 tokens per 4-byte write (one permute per pair).
        if cfg.kv_format == "bf16":
            dequant_hip.pair_tokens(T.address_of(st.v_pairs[0]), T.address_of(st.kv_raw[b, 0, 0, 0]), T.address_of(st.kv_raw[b, 0, 1, 0]))
        else:
            if raw_operand:  # a8w8: K went to the fp8 MFMA as loaded; V needs bf16
                for j in T.unroll(2):
                    decode(st, st.k_op, b, 0, j)
            dequant_hip.pair_tokens(T.address_of(st.v_pairs[0]), T.address_of(st.k_op[0, 0]), T.address_of(st.k_op[1, 0]))
        for e in T.unroll(16):
            for j in T.vectorized(2):
                st.VT[st.wave, st.g * 16 + order(e), ds_vt_col(st.g * 16 + order(e), ds_token(st.m, 0)) + j] = st.v_pairs[2 * e + j]
        if st.wave == 0:
            qk_chunk(st, b, 1)
        for i in T.vectorized(DS_SCORES):
            st.S_part[st.wave, st.lane, i] = st.s_acc[i]
        T.sync_threads()
        # Stage 3: the full scores, reduce-scattered: wave w sums score w of every lane over the 8 partials (7 adds
        # instead of 56 per wave), the 8 sums meet in LDS, every wave reads its lanes' 8 (two 16-byte reads).
        st.s_sum[0] = 0
        for w in T.unroll(DS_WAVES):
            st.s_sum[0] += st.S_part[w, st.lane, st.wave]
        st.S_tot[st.lane, st.wave] = st.s_sum[0]
        T.sync_threads()
        for i in T.vectorized(DS_SCORES):
            st.s_tot[i] = st.S_tot[st.lane, i]
        horizon = st.split_hi
        if cfg.causal:
            horizon = T.min(st.split_hi, st.kv_len - st.q_len + q_pass + 1)
        for i in T.unroll(DS_SCORES):
            st.s_tot[i] = T.if_then_else(tile_lo + ds_score_token(st.g, i) < horizon, st.s_tot[i] * st.score_scale, ninf)
        # Stage 4: online softmax (base 2) of head m: the tile's max and sum over 8 scores and 4 lane groups.
        st.row_max_new[0] = st.row_max[0]
        for i in T.unroll(DS_SCORES):
            st.row_max_new[0] = T.max(st.row_max_new[0], st.s_tot[i])
        st.row_max_new[0] = T.max(st.row_max_new[0], T.shfl_xor(st.row_max_new[0], 16, width=64))
        st.row_max_new[0] = T.max(st.row_max_new[0], T.shfl_xor(st.row_max_new[0], 32, width=64))
        st.row_safe[0] = T.if_then_else(st.row_max_new[0] == ninf, 0, st.row_max_new[0])
        st.rescale[0] = T.exp2(st.row_max[0] - st.row_safe[0])
        st.row_max[0] = st.row_max_new[0]
        st.row_sum[0] = 0
        for i in T.unroll(DS_SCORES):
            st.s_tot[i] = T.exp2(st.s_tot[i] - st.row_safe[0])
            st.row_sum[0] += st.s_tot[i]
        st.row_sum[0] += T.shfl_xor(st.row_sum[0], 16, width=64)
        st.row_sum[0] += T.shfl_xor(st.row_sum[0], 32, width=64)
        st.denom[0] = st.denom[0] * st.rescale[0] + st.row_sum[0]
        for i in T.unroll(16):
            st.acc_o[i] *= st.rescale[0]
        for s in T.unroll(2):
            for h in T.unroll(2):
                dequant_hip.pack_bf16x2(T.address_of(st.p_op[s * 4 + 2 * h]), st.s_tot[ds_p_score(s, 2 * h)], st.s_tot[ds_p_score(s, 2 * h + 1)])
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
            S_tot = T.alloc_shared([DS_LANES, DS_SCORES], f32)  # the tile's scores, [lane, score]
            s_sum = T.alloc_local([1], f32)
            kv_raw = T.alloc_local([2, 2, 2, lane_elems], kv_dtype)  # [ping-pong buffer, chunk, token j, element]
            sc_word = T.alloc_local([2, 2, 2], "uint32")  # mxfp4: dword holding the lane's scale byte
            sc_shift = T.alloc_local([2, 2, 2], "int32")  # mxfp4: bit offset of that byte in the dword
            rows = T.alloc_local([2, 2], "int32")  # paged: page numbers [tile parity, token j]
            q_op = T.alloc_local([2, 16], op_dtype)  # [chunk (latent, rope), dim]
            k_op = T.alloc_local([2, 16], bf16)  # decoded K (a8w8: V) elements [token j, element] of one chunk
            v_pairs = T.alloc_local([32], bf16)  # [2 e + j]: element e of token j (V^T pairs)
            q_tmp = T.alloc_local([16], bf16)  # mxfp4: Q slice before the permute into the decode's order
            s_acc = T.alloc_local([DS_SCORES], f32)  # MFMA result: [j * 4 + r] = S(head m, token 8g + 2r + j)
            s_tot = T.alloc_local([DS_SCORES], f32)
            p_op = T.alloc_local([8], bf16)  # [s * 4 + c] = P(head m, token 8g + 4s + c)
            v_op = T.alloc_local([8], bf16)  # V^T(dim, tokens 8g .. 8g + 7)
            acc_o = T.alloc_local([16], f32)  # [nt * 4 + r] = O(head m, dim 64 wave + 16 nt + 4g + r)
            row_max = T.alloc_local([1], f32)
            row_max_new = T.alloc_local([1], f32)
            row_safe = T.alloc_local([1], f32)
            rescale = T.alloc_local([1], f32)
            row_sum = T.alloc_local([1], f32)
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
            chunk = T.alloc_var("int32", init=T.ceildiv(T.ceildiv(kv_len, num_splits), block_n) * block_n)
            split_lo = T.alloc_var("int32", init=split_id * chunk)
            split_hi = T.alloc_var("int32", init=T.min(split_lo + chunk, kv_len))
            num_tiles = T.alloc_var("int32", init=T.ceildiv(T.max(split_hi - split_lo, 0), block_n))
            q_scale = T.alloc_var(
                f32,
                init=T.cast(T.cast(T.max(Q_scale[0], AMAX_FLOOR) / fp8_max, bf16), f32)
                if cfg.q_format == "fp8"
                else Q_scale[0],
            )
            score_scale = T.alloc_var(f32, init=sm_scale * LOG2E * q_scale * KV_scale[0])
            out_scale = T.alloc_var(f32, init=KV_scale[0])
            st = SimpleNamespace(
                wave=wave, g=g, m=m, lane=lane, kv_raw=kv_raw, sc_word=sc_word, sc_shift=sc_shift, rows=rows, q_op=q_op,
                k_op=k_op, v_pairs=v_pairs, q_tmp=q_tmp, s_acc=s_acc, s_tot=s_tot, p_op=p_op, v_op=v_op, acc_o=acc_o, split_lo=split_lo,
                split_hi=split_hi, kv_begin=kv_begin, kv_len=kv_len, q_len=q_len, seq_id=seq_id, Page_table=Page_table,
                KV=KV, KV_scales=KV_scales, scale_stride=scale_stride, score_scale=score_scale, q_scale=q_scale, VT=VT, S_part=S_part, S_tot=S_tot, s_sum=s_sum,
                row_max_new=row_max_new, row_max=row_max, row_safe=row_safe, rescale=rescale, row_sum=row_sum,
                denom=denom,
            )

            for q_pass in T.serial(q_len):
                # Stage 1: the lane's Q slices (head m; dims 16g .. 16g + 15 of its latent chunk and of the rope).
                load_q(st, 0, Q, q_begin + q_pass, hg * block_h + m)
                load_q(st, 1, Q, q_begin + q_pass, hg * block_h + m)
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
                    for it in T.serial(T.ceildiv(num_tiles, 2)):
                        load_tile(st, 1, 1, it * 2 + 1)
                        if cfg.page_size:
                            look_up_rows(st, 1, it * 2 + 3)
                        compute_tile(st, 0, it * 2, q_pass)
                        load_tile(st, 0, 0, it * 2 + 2)
                        if cfg.page_size:
                            look_up_rows(st, 0, it * 2 + 4)
                        if it * 2 + 1 < num_tiles:
                            compute_tile(st, 1, it * 2 + 1, q_pass)

                # Stage 6: normalise and write (head m, dims 64 wave + 16 nt + 4g .. + 3).
                for nt in T.unroll(4):
                    for r in T.vectorized(4):
                        value = T.if_then_else(denom[0] > 0, acc_o[nt * 4 + r] * out_scale / denom[0], 0)
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
                        LSE[q_begin + q_pass, hg * block_h + m] = lse2 * ln2

    return body
