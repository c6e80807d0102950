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

The builder (``mla_decode_kernel``): ``_context`` (static dims), the CTA program (``_block_body``, whose stages are
``_load_q_rows``, ``_load_kv_tile``, ``_scores``, ``steps.online_softmax_step``, ``_accumulate_pv``, ``_write_output``
/ ``_write_partial`` and ``steps.merge_splits``; or gfx942's wave-level program, tl_kernels/mla_decode_gfx942.py),
then one of the signatures. Steps other families share live in tl_kernels/steps.py (docs/kernels.md).
"""

import functools
from dataclasses import dataclass
from types import SimpleNamespace

import tilelang.language as T

from tl_kernels import dequant, steps
from tl_kernels.mla_decode_gfx942 import (  # noqa: F401  (the lane maps: re-exported for the tests' NumPy model)
    DIM_SPLIT_SHAPE,
    DS_DIMS,
    DS_LANES,
    DS_SCORES,
    DS_WAVES,
    dim_split_body,
    ds_dim,
    ds_out_dim,
    ds_p_score,
    ds_score_token,
    ds_token,
    ds_vt_col,
)
from tl_kernels.steps import (  # noqa: F401  (AMAX_FLOOR, LOG2E, MERGE_SPLITS: re-exported for the other families)
    AMAX_FLOOR,
    FP8_MAX,
    KV_FORMATS,
    KV_LORA_RANK,
    LOG2E,
    MERGE_SPLITS,
    MXFP4_BLOCK,
    MXFP4_SCALES_PER_TOKEN,
    Q_FORMATS,
    QK_DIM,
    ROPE_DIM,
)


LATENT_CHUNKS = KV_LORA_RANK // dequant.CHUNK  # fast_decode: 16-code chunks per row, latent part (32)
ROPE_CHUNKS = ROPE_DIM // dequant.CHUNK  # and rope part (4)


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
    fast_decode: bool = False  # CUDA, compressed tile read from global memory: each thread loads whole 16-code
    # chunks into registers (all of the tile's loads in flight together; a flat cache's one tile ahead, during the
    # MMAs of the tile before) and decodes them by bit placement (tl_kernels/dequant.py, as the warp-specialised
    # kernel's decoders); False: one element at a time
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
    split_counts: bool = False  # flash_io without the fused merge, for CUDA graphs: each sequence's split count
    # is read on the device from Num_splits (FlashMLA's cumulative (batch + 1,) layout, written by
    # tl_kernels.mla_schedule from the lengths of the step); the grid's split dimension is only its cap. A split
    # past its sequence's count exits at once; a sequence of one split writes its output itself; the combine
    # kernel's flash form merges the others.

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
        if self.flash_io and not ((self.fused_combine or self.split_counts) and self.page_size):
            raise ValueError("flash_io needs fused_combine or split_counts, and a paged cache (page_size > 0)")
        if self.split_counts and not (self.flash_io and self.split and not self.fused_combine):
            raise ValueError("split_counts needs flash_io and split=True without fused_combine")
        if self.fast_decode:
            if self.kv_format == "bf16" or self.stage_compressed or self.dim_split:
                raise ValueError("fast_decode needs an fp8 / mxfp4 cache read from global memory (not "
                                 "stage_compressed) and the block-level program (not dim_split)")
            if (self.block_n * LATENT_CHUNKS) % self.threads or (self.block_n * ROPE_CHUNKS) % self.threads:
                raise ValueError(f"fast_decode needs threads={self.threads} to divide the tile's latent and rope "
                                 f"chunks ({self.block_n} x {LATENT_CHUNKS} and {self.block_n} x {ROPE_CHUNKS})")

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
        scales = (self.block_n * MXFP4_SCALES_PER_TOKEN * 4 * self.num_stages
                  if self.kv_format == "mxfp4" and not self.fast_decode else 0)
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
            f"{'_ds' if self.dim_split else ''}{'_f8mma' if self.fp8_mfma else ''}{'_fused' if self.fused_combine else ''}{'_flash' if self.flash_io else ''}"
            f"{'_counts' if self.split_counts else ''}{'_fd' if self.fast_decode else ''}_{fp8}"
        )


def _kv_storage(cfg: DecodeKernelConfig) -> tuple[int, str]:
    """(elements per KV row in memory, storage dtype) for a format."""
    return steps.kv_storage(cfg.kv_format, cfg.fp8_dtype)


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
      split_counts (flash_io, not fused): max_splits int32 (the grid's split dimension), Num_splits (batch + 1,)
                   int32 (cumulative split counts), the flat partials (>= max_splits * total_q * num_heads * 512 / *
                   1 elements), Out and LSE
    """
    c = _context(cfg)
    if cfg.dim_split:  # gfx942's wave-level program (tl_kernels/mla_decode_gfx942.py)
        body = dim_split_body(cfg, dict(total_q=c.total_q, indptr_len=c.indptr_len, scale_len=c.scale_len,
                                        num_splits=c.num_splits))
    else:
        body = _block_body(c)
    if cfg.split_counts:
        return _flash_counts_prim_func(c, body)
    if cfg.flash_io:
        return _flash_prim_func(c, body)
    if cfg.page_size:
        return _paged_prim_func(c, body)
    return _flat_prim_func(c, body)


def _context(cfg: DecodeKernelConfig) -> SimpleNamespace:
    """The kernel's static context: the config's derived constants and the prim_func's dynamic dims, which the
    stages below and the signatures share."""
    c = SimpleNamespace(cfg=cfg, heads=cfg.num_heads, block_h=cfg.block_h, block_n=cfg.block_n, block_m=cfg.block_m,
                        q_tile=cfg.q_tile, threads=cfg.threads, head_groups=cfg.num_heads // cfg.block_h,
                        fused=cfg.fused_combine, flash_io=cfg.flash_io,
                        flat_partials=cfg.fused_combine or cfg.split_counts,
                        staged=cfg.kv_format != "bf16" and cfg.stage_compressed, deferred_sum=False,
                        fast_decode=cfg.fast_decode,
                        fast_chunks=cfg.block_n * (LATENT_CHUNKS + ROPE_CHUNKS) // cfg.threads,
                        fast_latent_chunks=cfg.block_n * LATENT_CHUNKS // cfg.threads,
                        # a flat cache's next rows are known in place: its loads go one tile ahead
                        fast_prefetch=cfg.fast_decode and not cfg.page_size and cfg.tiles_per_group == 1)
    c.kv_cols, c.kv_dtype = _kv_storage(cfg)
    c.q_dtype = cfg.fp8_dtype if cfg.q_format == "fp8_codes" else "bfloat16"
    if cfg.flash_io:  # every sequence has s_q queries; rows are (sequence, query) pairs
        c.num_seqs, c.s_q = T.dynamic("batch"), T.dynamic("s_q")
        c.total_q = c.num_seqs * c.s_q
        c.indptr_len = None
    else:
        c.total_q = T.dynamic("total_q")
        c.indptr_len = T.dynamic("indptr_len")
        c.num_seqs = c.indptr_len - 1
        c.s_q = None
    c.total_kv = T.dynamic("total_kv")
    c.scale_len = T.dynamic("scale_len")
    c.num_splits = T.dynamic("num_splits") if cfg.split and not cfg.fused_combine else 1
    # Index order of the accumulators: (query row, token/dim), swapped when the KV tile is the MMA's M dimension.
    c.token_axis = 0 if cfg.kv_rows_as_m else 1  # the softmax reduces over tokens
    c.kv_major_loops = False  # the element-wise loops row first, in both orientations
    c.out_dims = KV_LORA_RANK
    c.tr = functools.partial(steps.accumulator_index, cfg.kv_rows_as_m)
    # The LSE of a query that sees no token: -inf, or FlashMLA's +inf (flash_io).
    c.empty_lse = T.infinity("float32") if cfg.flash_io else -T.infinity("float32")
    return c


# ---- stages of the block-level program (sm_90a; the default on CUDA) ----------------------------------------------


def _row_query(c, q_pass, r):
    """The query (within its sequence) of row r of query pass q_pass: rows are q_tile queries x block_h heads."""
    return q_pass * c.q_tile + r // c.block_h


def _row_head(c, hg, r):
    return hg * c.block_h + r % c.block_h


def _q_element(c, Q, v, q_pass, hg, r, d):
    """Q row r of the pass, dim d, as bf16 (``steps.q_value``: 0 past the queries, a8w8 rounded to fp8 values)."""
    return steps.q_value(Q, v.q_begin, v.q_len, _row_query(c, q_pass, r), _row_head(c, hg, r), d, v.q_inv,
                         q_format=c.cfg.q_format, fp8_dtype=c.cfg.fp8_dtype)


def _tile_rows(c, Group_rows, t_in, kv_begin, tile_lo, split_hi):
    """``row_of(i)``: the cache row of row i of the current tile. Rows past the split end repeat its last token
    (finite data, so P V stays finite; their scores are masked). Flat: computed in place. Paged: read from the
    group's row table that ``paged_row`` filled before the tile pipeline (so no dependent page-table load precedes
    each element load)."""
    if c.cfg.page_size:
        return lambda i: Group_rows[t_in, i]
    return lambda i: kv_begin + T.min(tile_lo + i, split_hi - 1)


def _paged_row(c, Page_table, seq_id, tile_lo, split_hi, i):
    """Paged cache row of row i of the current tile: token p of sequence b is slot p % page_size of page
    Page_table[b, p // page_size]."""
    page_size = c.cfg.page_size
    pos = T.min(tile_lo + i, split_hi - 1)
    return Page_table[seq_id, pos // page_size] * page_size + pos % page_size


def _compressed(c, src, row_of, i, col):
    """Element ``col`` of compressed row i of the current tile: from the staged shared copy, or from global memory
    (rows past the split end repeat its last token, as in the staged copy)."""
    if c.staged:
        return src[i, col]
    return src[row_of(i), col]


def _mxfp4_element(c, src, row_of, Block_scale, i, d):
    """Element d of mxfp4 row i as fp32. The e2m1 code's 3 magnitude bits placed at fp16 bits 11..9 form an fp16 of
    value code * 2^-14 (denormal for the e2m1 subnormals, exact after conversion to fp32)."""
    byte = T.cast(_compressed(c, src, row_of, i, d // 2), "int32")
    code = T.shift_right(byte, (d % 2) * 4) & 15  # low nibble = even element
    half_bits = T.shift_left(code & 8, 12) | T.shift_left(code & 7, 9)
    magnitude = T.cast(T.reinterpret(T.cast(half_bits, "uint16"), "float16"), "float32")
    return magnitude * 16384.0 * Block_scale[i, d // MXFP4_BLOCK]  # 16384 = 2^14


@T.macro
def _load_q_rows(c, k, v, Q, q_pass, hg):
    # Stage 1: the pass's Q rows (row r = query q_pass*q_tile + r // block_h, head hg*block_h + r % block_h).
    for r, d in T.Parallel(c.block_m, KV_LORA_RANK):
        k.Q_shared[r, d] = _q_element(c, Q, v, q_pass, hg, r, d)
    for r, d in T.Parallel(c.block_m, ROPE_DIM):
        k.Qpe_shared[r, d] = _q_element(c, Q, v, q_pass, hg, r, KV_LORA_RANK + d)


def _fast_chunk_place(c, tx, j):
    """fast_decode: (tile row, first dim) of thread ``tx``'s chunk j. Latent chunks first: a warp takes one row's 32
    chunks (its 512 latent dims, contiguous in the cache); then rope chunks, 4 per row."""
    if j < c.fast_latent_chunks:
        g = tx + j * c.threads
        return g // LATENT_CHUNKS, g % LATENT_CHUNKS * dequant.CHUNK
    g = tx + (j - c.fast_latent_chunks) * c.threads
    return g // ROPE_CHUNKS, KV_LORA_RANK + g % ROPE_CHUNKS * dequant.CHUNK


def _fast_decode_buffers(c) -> dict:
    """fast_decode's registers: the thread's chunks of a tile (32-bit code words; mxfp4 scale bytes), one decoded
    chunk, and the thread index."""
    mxfp4 = c.cfg.kv_format == "mxfp4"
    return dict(raw=T.alloc_local([c.fast_chunks * dequant.chunk_words(c.cfg.kv_format)], "uint32"),
                scale=T.alloc_local([c.fast_chunks], "uint32") if mxfp4 else None,
                vals=T.alloc_local([dequant.CHUNK], "bfloat16"), tx=T.get_thread_binding())


@T.macro
def _fast_fetch(c, k, KV, KV_scales, scale_stride, row_of):
    # Stage 2a (fast_decode): the thread's chunks of a tile into registers, every load issued before any is used.
    words = dequant.chunk_words(c.cfg.kv_format)
    for j in list(range(c.fast_chunks)):
        i, dim = _fast_chunk_place(c, k.tx, j)
        dequant.load_chunk(c.cfg.kv_format, k.raw[j * words], k.scale, j, KV, KV_scales, scale_stride, row_of(i), dim)


@T.macro
def _fast_store(c, k):
    # Stage 2b (fast_decode): each chunk decoded by bit placement and stored as 16 bf16. fp8 decodes to
    # code * 2^-120: the factor is folded into score_scale and out_scale.
    words = dequant.chunk_words(c.cfg.kv_format)
    for j in list(range(c.fast_chunks)):
        i, dim = _fast_chunk_place(c, k.tx, j)
        T.evaluate(dequant.decode_chunk(c.cfg.kv_format, k.vals[0], k.raw[j * words],
                                        k.scale[j] if c.cfg.kv_format == "mxfp4" else None))
        if j < c.fast_latent_chunks:
            for e in T.vectorized(dequant.CHUNK):
                k.KV_shared[i, dim + e] = k.vals[e]
        else:
            for e in T.vectorized(dequant.CHUNK):
                k.Kpe_shared[i, dim - KV_LORA_RANK + e] = k.vals[e]


@T.macro
def _load_kv_tile(c, k, KV, KV_scales, scale_stride, row_of, has_next, next_row_of):
    # Stage 2: the KV tile as bf16 in shared memory: a bf16 cache copied, fp8 / mxfp4 dequantized on the way.
    # fast_prefetch: this tile's chunks are already in registers; the next tile's loads (``has_next``: there is
    # one; ``next_row_of``: its rows) are issued as soon as they are decoded, so they fly during this tile's MMAs.
    cfg, block_n, bf16 = c.cfg, c.block_n, "bfloat16"
    if cfg.kv_format == "bf16":
        for i, d in T.Parallel(block_n, KV_LORA_RANK):
            k.KV_shared[i, d] = KV[row_of(i), d]
        for i, d in T.Parallel(block_n, ROPE_DIM):
            k.Kpe_shared[i, d] = KV[row_of(i), KV_LORA_RANK + d]
    elif c.fast_prefetch:
        _fast_store(c, k)
        if has_next:
            _fast_fetch(c, k, KV, KV_scales, scale_stride, next_row_of)
    elif c.fast_decode:
        _fast_fetch(c, k, KV, KV_scales, scale_stride, row_of)
        _fast_store(c, k)
    else:
        if c.staged:
            for i, col in T.Parallel(block_n, c.kv_cols):
                k.KV_raw[i, col] = KV[row_of(i), col]
        if cfg.kv_format == "fp8":
            # fp8 -> bf16 is exact; the per-tensor scale is applied to scores and output instead.
            for i, d in T.Parallel(block_n, KV_LORA_RANK):
                k.KV_shared[i, d] = T.cast(_compressed(c, k.KV_raw, row_of, i, d), bf16)
            for i, d in T.Parallel(block_n, ROPE_DIM):
                k.Kpe_shared[i, d] = T.cast(_compressed(c, k.KV_raw, row_of, i, KV_LORA_RANK + d), bf16)
        if cfg.kv_format == "mxfp4":
            # e8m0 byte e -> 2^(e - 127), built from its bits (e == 0 is the subnormal 2^-127; 255 is NaN).
            for i, b in T.Parallel(block_n, MXFP4_SCALES_PER_TOKEN):
                e = T.cast(KV_scales[row_of(i) * scale_stride + b], "int32")
                k.Block_scale[i, b] = T.if_then_else(
                    e == 0,
                    T.float32(5.877471754111438e-39),
                    T.reinterpret(T.if_then_else(e == 255, 0x7FC00000, T.shift_left(e, 23)), "float32"),
                )
            # Values = e2m1 code * power-of-two scale: exact in bf16. Latent and rope parts are separate loops (one
            # conditional store per element defeats TileLang's vectorizer).
            for i, d in T.Parallel(block_n, KV_LORA_RANK):
                k.KV_shared[i, d] = T.cast(_mxfp4_element(c, k.KV_raw, row_of, k.Block_scale, i, d), bf16)
            for i, d in T.Parallel(block_n, ROPE_DIM):
                k.Kpe_shared[i, d] = T.cast(
                    _mxfp4_element(c, k.KV_raw, row_of, k.Block_scale, i, KV_LORA_RANK + d), bf16
                )


@T.macro
def _scores(c, k, v, tile_lo, q_pass):
    # Stage 3: S = Q K^T over the 512 latent + 64 rope dims, scaled; tokens past the split end (causal: past each
    # query's horizon) get -inf.
    if c.cfg.kv_rows_as_m:
        T.gemm(k.KV_shared, k.Q_shared, k.acc_s, transpose_B=True, clear_accum=True)
        T.gemm(k.Kpe_shared, k.Qpe_shared, k.acc_s, transpose_B=True)
    else:
        T.gemm(k.Q_shared, k.KV_shared, k.acc_s, transpose_B=True, policy=T.GemmWarpPolicy.FullCol, clear_accum=True)
        T.gemm(k.Qpe_shared, k.Kpe_shared, k.acc_s, transpose_B=True, policy=T.GemmWarpPolicy.FullCol)
    for r, j in T.Parallel(c.block_m, c.block_n):
        qi = _row_query(c, q_pass, r)
        horizon = v.split_hi
        if c.cfg.causal:
            # query qi of q_len sees positions [0, kv_len - q_len + qi]
            horizon = T.min(v.split_hi, v.kv_len - v.q_len + qi + 1)
        k.acc_s[c.tr(r, j)] = T.if_then_else(
            tile_lo + j < horizon, k.acc_s[c.tr(r, j)] * v.score_scale, -T.infinity("float32")
        )


@T.macro
def _accumulate_pv(c, k):
    # Stage 5: P (bf16) to shared memory, O += P V.
    if c.cfg.kv_rows_as_m:
        for r, j in T.Parallel(c.block_m, c.block_n):
            k.P_shared[r, j] = T.cast(k.acc_s[j, r], "bfloat16")
    else:
        T.copy(k.acc_s, k.P_shared)
    if c.cfg.kv_rows_as_m:
        T.gemm(k.KV_shared, k.P_shared, k.acc_o, transpose_A=True, transpose_B=True)
    else:
        T.gemm(k.P_shared, k.KV_shared, k.acc_o, policy=T.GemmWarpPolicy.FullCol)


@T.macro
def _write_output(c, Out, LSE, acc_o, denom, row_max, factor, out_scale, q_begin, q_len, q_pass, hg):
    # Stage 6: the final bf16 output and natural-log LSE of one query pass. denom == 0 means nothing was visible:
    # output 0, LSE -inf (FlashMLA's +inf with flash_io). ``factor``: a free [block_m] fragment for the rows'
    # output factors.
    for r in T.Parallel(c.block_m):
        factor[r] = steps.output_factor(denom[r], out_scale)
    for r, d in T.Parallel(c.block_m, KV_LORA_RANK):
        qi = _row_query(c, q_pass, r)
        if qi < q_len:
            value = steps.normalised(acc_o[c.tr(r, d)], denom[r], factor[r])
            Out[q_begin + qi, _row_head(c, hg, r), d] = T.cast(value, "bfloat16")
    for r in T.Parallel(c.block_m):
        qi = _row_query(c, q_pass, r)
        if qi < q_len:
            lse2 = steps.lse_base2(denom[r], row_max[r], c.empty_lse)
            if c.flash_io:  # (sequence, head, query)
                LSE[(q_begin + qi) // c.s_q, _row_head(c, hg, r), (q_begin + qi) % c.s_q] = lse2 * steps.LN2
            else:
                LSE[q_begin + qi, _row_head(c, hg, r)] = lse2 * steps.LN2


@T.macro
def _write_partial(c, O_partial, LSE_partial, acc_o, denom, row_max, factor, out_scale, q_begin, q_len, q_pass, hg,
                   split_id):
    # Stage 6 (split): one split's normalised fp32 output and base-2 LSE (-inf for a split that saw nothing).
    for r in T.Parallel(c.block_m):
        factor[r] = steps.output_factor(denom[r], out_scale)
    for r, d in T.Parallel(c.block_m, KV_LORA_RANK):
        qi = _row_query(c, q_pass, r)
        if qi < q_len:
            value = steps.normalised(acc_o[c.tr(r, d)], denom[r], factor[r])
            if c.flat_partials:
                O_partial[steps.partial_row(c, split_id, q_begin + qi, _row_head(c, hg, r)) * KV_LORA_RANK + d] = value
            else:
                O_partial[split_id, q_begin + qi, _row_head(c, hg, r), d] = value
    for r in T.Parallel(c.block_m):
        qi = _row_query(c, q_pass, r)
        if qi < q_len:
            lse2 = steps.lse_base2(denom[r], row_max[r], -T.infinity("float32"))
            if c.flat_partials:
                LSE_partial[steps.partial_row(c, split_id, q_begin + qi, _row_head(c, hg, r))] = lse2
            else:
                LSE_partial[split_id, q_begin + qi, _row_head(c, hg, r)] = lse2


def _block_body(c):
    """The block-level program's CTA (``decode_body``): one (KV split, sequence, head group) per CTA; the per-CTA
    scalars once, then per query pass: Q rows (stage 1), the KV loop (stages 2-5: tile, scores, softmax step, P V),
    the pass's results (stage 6); with ``fused_combine`` the split merge (stage 7) and a8w8's in-kernel amax."""
    cfg, block_n, block_m = c.cfg, c.block_n, c.block_m
    f32, bf16 = "float32", "bfloat16"

    @T.macro
    def decode_body(Q, KV, KV_scales, scale_stride, Q_scale, KV_scale, qo_indptr, kv_indptr, Page_table, sm_scale,
                    n_splits, O_partial, LSE_partial, Out, LSE, Num_splits=None):
        with T.Kernel(n_splits, c.num_seqs, c.head_groups, threads=cfg.threads) as (split_id, seq_id, hg):
            Q_shared = T.alloc_shared([block_m, KV_LORA_RANK], bf16)
            Qpe_shared = T.alloc_shared([block_m, ROPE_DIM], bf16)
            KV_shared = T.alloc_shared([block_n, KV_LORA_RANK], bf16)
            Kpe_shared = T.alloc_shared([block_n, ROPE_DIM], bf16)
            if c.staged:
                KV_raw = T.alloc_shared([block_n, c.kv_cols], c.kv_dtype)
            else:
                KV_raw = KV  # not staged: _compressed() reads global memory
            Block_scale = None
            if cfg.kv_format == "mxfp4" and not c.fast_decode:
                Block_scale = T.alloc_shared([block_n, MXFP4_SCALES_PER_TOKEN], f32)
            P_shared = T.alloc_shared([block_m, block_n], bf16)
            # Paged: the cache rows of the current group of tiles (flat kernels compute rows in place).
            Group_rows = None
            if cfg.page_size:
                Group_rows = T.alloc_shared([cfg.tiles_per_group, block_n], "int32", scope=cfg.row_table_scope)
            # Scores and output accumulators, [query row, token] / [query row, dim], or transposed (kv_rows_as_m).
            acc_s = T.alloc_fragment(c.tr([block_m, block_n]), f32)
            acc_o = T.alloc_fragment(c.tr([block_m, KV_LORA_RANK]), f32)
            row_max = T.alloc_fragment([block_m], f32)
            row_max_prev = T.alloc_fragment([block_m], f32)
            row_max_safe = T.alloc_fragment([block_m], f32)
            rescale = T.alloc_fragment([block_m], f32)
            row_sum = T.alloc_fragment([block_m], f32)
            denom = T.alloc_fragment([block_m], f32)
            # One imported device source per kernel: the decoders' (fast_decode) with the merge's, or the merge's.
            if c.fast_decode:
                dequant.import_cuda_source(extra=steps.MERGE_CUDA_SOURCE if c.fused else "")
            elif c.fused:
                T.import_source(steps.MERGE_CUDA_SOURCE)
            fast = {}
            if c.fast_decode:  # the thread's chunks of a tile: codes (32-bit words), mxfp4 scale bytes, one decode
                fast = _fast_decode_buffers(c)
            if c.fused:
                merge_acc = T.alloc_local([4], f32)  # the merged chunk (weighted sum)
                merge_lse = T.alloc_local([MERGE_SPLITS], f32)  # a step's splits' LSEs
                merge_stage = T.alloc_local([MERGE_SPLITS * 4], f32)  # a step's splits' partial chunks
                merge_max = T.alloc_local([2], f32)  # running max LSE of the chunk's row; a step's max
                merge_denom = T.alloc_local([1], f32)  # running sum of weights
                if cfg.amax_in_kernel:
                    Amax_bits = T.alloc_shared([1], "int32")  # the CTA's amax(|Q|) slice, as float bits
                    # a thread's Q vectors in flight
                    Amax_vals = T.alloc_local([steps.AMAX_UNROLL * steps.AMAX_VECTOR], "bfloat16")
                tx = T.get_thread_binding()
            k = SimpleNamespace(Q_shared=Q_shared, Qpe_shared=Qpe_shared, KV_shared=KV_shared, Kpe_shared=Kpe_shared,
                                KV_raw=KV_raw, Block_scale=Block_scale, P_shared=P_shared, acc_s=acc_s, acc_o=acc_o,
                                row_max=row_max, row_max_prev=row_max_prev, row_max_safe=row_max_safe,
                                rescale=rescale, row_sum=row_sum, denom=denom, **fast)

            # Per-CTA scalars, computed once (registers), not re-derived in every index expression.
            if cfg.split_counts:
                # This sequence's split count, from the device schedule (clamped to the grid). A CTA past it has
                # no query rows: it loads nothing and writes nothing.
                seq_splits = T.alloc_var("int32", init=T.max(T.min(Num_splits[seq_id + 1] - Num_splits[seq_id],
                                                                   n_splits), 1))
            if cfg.flash_io:  # kv_indptr is cache_seqlens; s_q queries per sequence (the paged rows need no offset)
                kv_begin = T.alloc_var("int32", init=0)
                kv_len = T.alloc_var("int32", init=kv_indptr[seq_id])
                q_begin = T.alloc_var("int32", init=seq_id * c.s_q)
                if cfg.split_counts:
                    q_len = T.alloc_var("int32", init=T.if_then_else(split_id < seq_splits, c.s_q, 0))
                else:
                    q_len = T.alloc_var("int32", init=c.s_q)
            else:
                kv_begin = T.alloc_var("int32", init=kv_indptr[seq_id])
                kv_len = T.alloc_var("int32", init=kv_indptr[seq_id + 1] - kv_indptr[seq_id])
                q_begin = T.alloc_var("int32", init=qo_indptr[seq_id])
                q_len = T.alloc_var("int32", init=qo_indptr[seq_id + 1] - qo_indptr[seq_id])
            if cfg.split_counts:
                chunk = T.alloc_var("int32", init=steps.split_chunk(kv_len, seq_splits, block_n))
            else:
                chunk = T.alloc_var("int32", init=steps.split_chunk(kv_len, n_splits, block_n))
            split_lo = T.alloc_var("int32", init=split_id * chunk)
            split_hi = T.alloc_var("int32", init=T.min(split_lo + chunk, kv_len))
            num_tiles = T.alloc_var("int32", init=steps.tile_count(split_lo, split_hi, block_n))
            # a8w8: the per-tensor Q scale from amax, rounded to bf16 as torch computes it (amax / fp8_max in bf16);
            # with ``amax_in_kernel`` the amax this kernel reduces into Q_scale (read through L2 after the barrier).
            if cfg.amax_in_kernel:
                steps.reduce_amax(c, Q, Q_scale, Amax_bits, Amax_vals, n_splits, tx, split_id, seq_id, hg)
            q_scale = T.alloc_var(f32, init=steps.q_scale_of(
                cfg.q_format, cfg.fp8_dtype, steps.merge_load(Q_scale, 0) if cfg.amax_in_kernel else Q_scale[0]))
            # Scores are scaled once, in base 2; fp8 per-tensor scales of Q and K fold in here.
            # (fast_decode's fp8 tiles hold code * 2^-120: FP8_BF16_FACTOR folds in with the scale.)
            decode_factor = dequant.FP8_BF16_FACTOR if c.fast_decode and cfg.kv_format == "fp8" else 1.0
            score_scale = T.alloc_var(f32, init=sm_scale * LOG2E * q_scale * KV_scale[0] * decode_factor)
            out_scale = T.alloc_var(f32, init=KV_scale[0] * decode_factor)
            q_inv = T.alloc_var(f32, init=steps.q_inverse(q_scale)) if cfg.q_format == "fp8" else None
            v = SimpleNamespace(q_begin=q_begin, q_len=q_len, kv_len=kv_len, split_hi=split_hi, q_inv=q_inv,
                                score_scale=score_scale)

            for q_pass in T.serial(T.ceildiv(q_len, c.q_tile)):
                _load_q_rows(c, k, v, Q, q_pass, hg)
                T.fill(acc_o, 0)
                T.fill(denom, 0)
                T.fill(row_max, -T.infinity(f32))

                if c.fast_prefetch:  # the first tile's chunks into registers (the loop decodes, then fetches ahead)
                    if num_tiles > 0:
                        _fast_fetch(c, k, KV, KV_scales, scale_stride,
                                    _tile_rows(c, Group_rows, 0, kv_begin, split_lo, split_hi))
                # The KV loop: groups of ``tiles_per_group`` tiles, each group a software pipeline of static
                # length (TileLang 0.1.15 cannot pipeline a loop whose trip count varies per CTA). Tiles past the
                # split's end are fully masked and change nothing.
                for group in T.serial(T.ceildiv(num_tiles, cfg.tiles_per_group)):
                    if cfg.page_size:
                        # Stage 2a (paged): the group's cache rows from the page table, one lookup per row.
                        for t, i in T.Parallel(cfg.tiles_per_group, block_n):
                            Group_rows[t, i] = _paged_row(
                                c, Page_table, seq_id, split_lo + (group * cfg.tiles_per_group + t) * block_n,
                                split_hi, i
                            )
                    for t_in in T.Pipelined(cfg.tiles_per_group, num_stages=cfg.num_stages):
                        tile_lo = split_lo + (group * cfg.tiles_per_group + t_in) * block_n
                        row_of = _tile_rows(c, Group_rows, t_in, kv_begin, tile_lo, split_hi)
                        next_row_of = _tile_rows(c, Group_rows, t_in, kv_begin, tile_lo + block_n, split_hi)
                        _load_kv_tile(c, k, KV, KV_scales, scale_stride, row_of, tile_lo + block_n < split_hi,
                                      next_row_of)
                        _scores(c, k, v, tile_lo, q_pass)
                        # Stage 4: the online-softmax step (base 2).
                        steps.online_softmax_step(c, k)
                        _accumulate_pv(c, k)

                # Stage 6: normalise and write: the output (one split), or this split's partial.
                if c.fused:
                    if n_splits == 1:
                        _write_output(c, Out, LSE, acc_o, denom, row_max, rescale, out_scale, q_begin, q_len,
                                      q_pass, hg)
                    else:
                        _write_partial(c, O_partial, LSE_partial, acc_o, denom, row_max, rescale, out_scale,
                                       q_begin, q_len, q_pass, hg, split_id)
                elif cfg.split_counts:  # one split: the output itself; more: the partial the combine merges
                    if seq_splits == 1:
                        _write_output(c, Out, LSE, acc_o, denom, row_max, rescale, out_scale, q_begin, q_len,
                                      q_pass, hg)
                    else:
                        _write_partial(c, O_partial, LSE_partial, acc_o, denom, row_max, rescale, out_scale,
                                       q_begin, q_len, q_pass, hg, split_id)
                elif cfg.split:
                    _write_partial(c, O_partial, LSE_partial, acc_o, denom, row_max, rescale, out_scale,
                                   q_begin, q_len, q_pass, hg, split_id)
                else:
                    _write_output(c, Out, LSE, acc_o, denom, row_max, rescale, out_scale, q_begin, q_len, q_pass,
                                  hg)

            # Stage 7 (fused_combine, several splits; n_splits is the same in every CTA, so all reach the barrier).
            if c.fused:
                if n_splits > 1:
                    steps.merge_splits(c, O_partial, LSE_partial, Out, LSE, n_splits, merge_acc, merge_lse,
                                       merge_stage, merge_max, merge_denom, tx, q_begin, q_len, split_id, hg)
                if cfg.amax_in_kernel:
                    # Every CTA read amax(|Q|) before the merge's barrier (one split: this one): the cell goes back
                    # to zero for the next call.
                    if n_splits == 1:
                        T.sync_grid()
                    if split_id == 0 and seq_id == 0 and hg == 0 and tx == 0:
                        Q_scale[0] = 0

    return decode_body


# ---- the prim_func signatures ----------------------------------------------------------------------------------------
# TileLang parses each signature from its source, so the forms (flat / paged / FlashMLA-shaped x fused / split /
# direct) are written out; they differ only in the arguments named in mla_decode_kernel's docstring, and all pass
# them to the same body.


def _flat_prim_func(c, decode_body):
    """Flat cache: sequence b owns cache rows kv_indptr[b]:kv_indptr[b + 1]."""
    heads, q_dtype, kv_dtype, kv_cols = c.heads, c.q_dtype, c.kv_dtype, c.kv_cols
    total_q, total_kv, indptr_len, scale_len, num_splits = c.total_q, c.total_kv, c.indptr_len, c.scale_len, c.num_splits
    accum_dtype = "float32"
    if c.fused:
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
    if c.cfg.split:

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


def _paged_prim_func(c, decode_body):
    """The paged-cache variant: as the flat one plus ``Page_table (batch, max_pages) int32``; KV (and the mxfp4
    scales) are indexed by physical row = page * page_size + slot, i.e. the paged cache flattened to rows."""
    cfg, heads, q_dtype, kv_dtype, kv_cols, accum_dtype = c.cfg, c.heads, c.q_dtype, c.kv_dtype, c.kv_cols, "float32"
    total_q, cache_rows, indptr_len, scale_len = c.total_q, c.total_kv, c.indptr_len, c.scale_len
    num_splits = c.num_splits
    batch, max_pages = T.dynamic("batch, max_pages")

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


def _flash_prim_func(c, decode_body):
    """The paged fused kernel in FlashMLA's argument shapes (``flash_io``): the same body over row views of Q, the
    cache and Out (``T.reshape``: no copy), the lengths read from cache_seqlens, the LSE as (batch, H, s_q)."""
    cfg, heads, q_dtype, kv_dtype, kv_cols, accum_dtype = c.cfg, c.heads, c.q_dtype, c.kv_dtype, c.kv_cols, "float32"
    batch, s_q, scale_len = c.num_seqs, c.s_q, c.scale_len
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


def _flash_counts_prim_func(c, decode_body):
    """FlashMLA's argument shapes with the split count of each sequence read from ``Num_splits`` (``split_counts``):
    the CUDA-graph form of ``mla.flash_mla``, whose grid is fixed when captured and whose lengths change every
    step. ``max_splits`` is the grid's split dimension; the partials are flat; the combine kernel's flash form
    merges the sequences of more than one split."""
    cfg, heads, q_dtype, kv_dtype, kv_cols, accum_dtype = c.cfg, c.heads, c.q_dtype, c.kv_dtype, c.kv_cols, "float32"
    batch, s_q, scale_len = c.num_seqs, c.s_q, c.scale_len
    num_blocks, max_pages, table_stride = T.dynamic("num_blocks, max_pages, table_stride")
    o_len, l_len = T.dynamic("o_len"), T.dynamic("l_len")

    @T.prim_func
    def mla_decode_flash_counts(
        Q: T.Tensor([batch, s_q, heads, QK_DIM], q_dtype),
        KV: T.Tensor([num_blocks, cfg.page_size, 1, kv_cols], kv_dtype),
        KV_scales: T.Tensor([scale_len], "uint8"),
        scale_stride: T.int32,
        Q_scale: T.Tensor([1], accum_dtype),
        KV_scale: T.Tensor([1], accum_dtype),
        cache_seqlens: T.Tensor([batch], "int32"),
        Page_table: T.StridedTensor([batch, max_pages], [table_stride, 1], "int32"),  # a slice of a wider table
        sm_scale: T.float32,
        max_splits: T.int32,
        Num_splits: T.Tensor([batch + 1], "int32"),
        O_partial: T.Tensor([o_len], accum_dtype),
        LSE_partial: T.Tensor([l_len], accum_dtype),
        Out: T.Tensor([batch, s_q, heads, KV_LORA_RANK], "bfloat16"),
        LSE: T.Tensor([batch, heads, s_q], accum_dtype),
    ):
        Q_rows = T.reshape(Q, [batch * s_q, heads, QK_DIM])
        KV_rows = T.reshape(KV, [num_blocks * cfg.page_size, kv_cols])
        Out_rows = T.reshape(Out, [batch * s_q, heads, KV_LORA_RANK])
        decode_body(Q_rows, KV_rows, KV_scales, scale_stride, Q_scale, KV_scale, None, cache_seqlens, Page_table,
                    sm_scale, max_splits, O_partial, LSE_partial, Out_rows, LSE, Num_splits)

    return mla_decode_flash_counts
