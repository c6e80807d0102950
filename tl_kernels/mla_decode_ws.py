"""Warp-specialised split-KV MLA decode for Hopper (sm_90a), with the split combine fused in: one launch per call.

Each CTA owns one (KV split, sequence, head group) and runs two warp-group roles over a ring of ``num_stages``
shared-memory stages (mbarrier pairs "ready" / "free" per stage; the trip count varies per CTA, so the ring is a
plain serial loop over barrier parities, not ``T.Pipelined``):

  producer (one warp group, few registers)
    streams each KV tile's raw bytes, in the cache's own format (bf16 rows, fp8 codes, or mxfp4 nibbles), into
    the next free stage with cp.async, completing on the stage's "ready" barrier; mxfp4 scale bytes go through
    registers (their rows have any stride, so no aligned async copy), loaded before the producer waits for the
    stage, so their latency hides behind the wait.
  consumer (one warp group, most registers)
    1. Q rows of the current query pass, once, into shared memory (a8w8: rounded to fp8 here);
    2. per tile: fp8 / mxfp4 are dequantized from the stage into a bf16 tile (then the stage is released at once,
       so the producer refills it while the MMAs run); a bf16 stage is the MMA operand itself;
    3. S^T = K Q^T on wgmma with the 64 KV rows as M (16 query rows need no padding to 64);
    4. online softmax in base 2 (log2(e) folded into the score scale; fp8 per-tensor scales too);
    5. O^T += V^T P^T (V = the first 512 dims of the same tile);
    6. one split: normalise and write bf16 out + natural-log LSE. Several splits: write the fp32 partial and its
       base-2 LSE, count the split in a per-(sequence, head group) semaphore, and the CTA that arrives last merges
       every split's partial by LSE into the output and resets the semaphore to 0 for the next call.

Only what changes the generated code is static (``WSDecodeKernelConfig``); batch, lengths, token counts and the
number of splits are dynamic (the split count is a kernel argument), so a new shape never recompiles.
"""

from dataclasses import dataclass

import tilelang.language as T

from tl_kernels.mla_decode import (
    AMAX_FLOOR,
    FP8_MAX,
    KV_FORMATS,
    KV_LORA_RANK,
    LOG2E,
    MXFP4_BLOCK,
    MXFP4_SCALES_PER_TOKEN,
    Q_FORMATS,
    QK_DIM,
    ROPE_DIM,
)

LN2 = 0.6931471805599453  # ln(2): base-2 LSE -> natural log
E2M1_OFFSET = 16384.0  # 2^14: mxfp4 tiles hold value * 2^-14 (see e2m1), folded back into the score/output scales
CONSUMER_THREADS = 128  # one warp group
PRODUCER_THREADS = 128  # one warp group (setmaxnreg works per warp group)


@dataclass(frozen=True)
class WSDecodeKernelConfig:
    """Everything that changes the generated code of the warp-specialised decode kernel."""

    kv_format: str  # "bf16" | "fp8" | "mxfp4"
    q_format: str = "bf16"  # see tl_kernels.mla_decode.Q_FORMATS
    num_heads: int = 16
    block_h: int = 16  # heads per CTA: the wgmma N dimension (16 query rows)
    block_n: int = 64  # KV tokens per tile: the wgmma M dimension
    num_stages: int = 2  # depth of the raw-tile ring
    causal: bool = False
    page_size: int = 0  # 0: flat cache; else tokens per page (Page_table argument)
    fp8_dtype: str = "float8_e4m3fn"
    mma_dtype: str = "bfloat16"  # MMA operand type; "float16" for an fp8 cache (see ``mla_decode_ws_kernel``)
    consumer_regs: int = 240  # setmaxnreg per role (the two must fit 64K registers over 256 threads)
    producer_regs: int = 96

    fused_combine = True  # the launch passes num_splits + split workspace + semaphores; no combine kernel
    q_tile = 1  # one query token per pass (more queries take more passes)

    def __post_init__(self):
        if self.kv_format not in KV_FORMATS:
            raise ValueError(f"kv_format must be one of {KV_FORMATS}, got {self.kv_format!r}")
        if self.q_format not in Q_FORMATS:
            raise ValueError(f"q_format must be one of {Q_FORMATS}, got {self.q_format!r}")
        if self.num_heads % self.block_h:
            raise ValueError(f"block_h={self.block_h} must divide num_heads={self.num_heads}")
        if self.block_h != 16 or self.block_n != 64:
            raise ValueError("the warp-specialised kernel is built for 16 query rows x 64-token tiles")
        if self.mma_dtype not in ("bfloat16", "float16") or (self.mma_dtype == "float16" and self.kv_format != "fp8"):
            raise ValueError(f"mma_dtype {self.mma_dtype!r}: bfloat16, or float16 for an fp8 cache")

    @property
    def block_m(self) -> int:
        return self.block_h

    @property
    def threads(self) -> int:
        return CONSUMER_THREADS + PRODUCER_THREADS

    @property
    def raw_cols(self) -> int:
        """Elements per stored KV row: 576 (bf16 / fp8) or 288 packed bytes (mxfp4)."""
        return QK_DIM // 2 if self.kv_format == "mxfp4" else QK_DIM

    @property
    def shared_bytes(self) -> int:
        """Shared memory the kernel allocates, in bytes (barriers and reduction scratch approximated)."""
        elem = 2 if self.kv_format == "bf16" else 1
        stage = self.block_n * self.raw_cols * elem
        if self.kv_format == "mxfp4":
            stage += self.block_n * MXFP4_SCALES_PER_TOKEN
        bf16_tile = 0 if self.kv_format == "bf16" else 2 * QK_DIM * self.block_n
        q = 2 * QK_DIM * self.block_m
        p = 2 * self.block_m * self.block_n
        return self.num_stages * stage + bf16_tile + q + p + 2 * 1024

    @property
    def name(self) -> str:
        fp8 = "fnuz" if self.fp8_dtype.endswith("fnuz") else "fn"
        return (
            f"mla_decode_ws_kv{self.kv_format}_q{self.q_format}_h{self.num_heads}_bh{self.block_h}"
            f"_bn{self.block_n}_st{self.num_stages}_r{self.consumer_regs}-{self.producer_regs}"
            f"{'_f16' if self.mma_dtype == 'float16' else ''}"
            f"{'_causal' if self.causal else ''}{f'_page{self.page_size}' if self.page_size else ''}_{fp8}"
        )


def mla_decode_ws_kernel(cfg: WSDecodeKernelConfig):
    """Returns the prim_func of the warp-specialised decode kernel for ``cfg``.

    Arguments (shapes in elements; dynamic dims symbolic):
      Q             (total_q, num_heads, 576) bf16 (fp8 codes when q_format == "fp8_codes")
      KV            (cache_rows, 576) bf16 | (cache_rows, 576) fp8 | (cache_rows, 288) uint8 (mxfp4 pairs)
      KV_scales     (scale_len,) uint8    mxfp4 e8m0 scales, flat; row t starts at t * scale_stride
      scale_stride  int32
      Q_scale       (1,) fp32             "fp8_codes": the Q scale; "fp8": amax(|Q|); "bf16": 1
      KV_scale      (1,) fp32             per-tensor KV scale (1 unless fp8)
      qo_indptr     (batch + 1,) int32
      kv_indptr     (batch + 1,) int32
      Page_table    (batch, max_pages) int32   only when page_size > 0
      sm_scale      fp32
      num_splits    int32                 KV splits per sequence (the grid's x dimension)
      O_partial     (o_len,) fp32         num_splits * total_q * num_heads * 512 when num_splits > 1 (else unused;
                                          the kernel's own order, see ``partial_index``)
      LSE_partial   (l_len,) fp32         num_splits * total_q * num_heads when num_splits > 1 (else unused)
      Semaphores    (sem_len,) int32      >= batch * num_heads / block_h entries, zero before the call; left zero
      Out           (total_q, num_heads, 512) bf16
      LSE           (total_q, num_heads) fp32, natural log; -inf (and Out 0) where no KV token is visible
    """
    heads, block_h, block_n, block_m = cfg.num_heads, cfg.block_h, cfg.block_n, cfg.block_m
    head_groups = heads // block_h
    stages = cfg.num_stages
    kv_cols = cfg.raw_cols
    kv_dtype = {"bf16": "bfloat16", "fp8": cfg.fp8_dtype, "mxfp4": "uint8"}[cfg.kv_format]
    q_dtype = cfg.fp8_dtype if cfg.q_format == "fp8_codes" else "bfloat16"
    fp8_max = FP8_MAX[cfg.fp8_dtype]
    bf16, f32 = "bfloat16", "float32"
    mma = cfg.mma_dtype  # operand type of both GEMMs (Q, K/V tile, P)
    # fp16 operands (fp8 cache): e4m3 -> fp16 is exact and one instruction per pair (bf16 takes three), P and
    # Q keep 3 more mantissa bits. Q is scaled by 2^-Q_F16_SHIFT first so any bf16 |q| below 2^23 fits fp16's
    # range; the factor returns in the score scale. (Elements under 2^-6 then lose relative precision, with an
    # absolute error below 2^-16: nothing next to the O(1) terms of a 576-long dot product.)
    q_shift = 2.0 ** -8 if mma == "float16" and cfg.q_format == "bf16" else 1.0
    converts = cfg.kv_format != "bf16"
    # The producer's cp.async arrives on "ready" once per thread; mxfp4 scale stores add one plain arrive each.
    ready_count = PRODUCER_THREADS * (2 if cfg.kv_format == "mxfp4" else 1)
    scale_bytes = block_n * MXFP4_SCALES_PER_TOKEN
    scales_per_thread = -(-scale_bytes // PRODUCER_THREADS)
    # Producer copy plan: 16-byte chunks of each raw row, spread evenly over the producer threads.
    chunk_elems = 16 // (2 if cfg.kv_format == "bf16" else 1)

    total_q = T.dynamic("total_q")
    cache_rows = T.dynamic("cache_rows")
    indptr_len = T.dynamic("indptr_len")
    scale_len = T.dynamic("scale_len")
    o_len = T.dynamic("o_len")
    l_len = T.dynamic("l_len")
    sem_len = T.dynamic("sem_len")
    batch, max_pages = T.dynamic("batch, max_pages")

    def cache_row(Page_table, seq_id, kv_begin, pos, cache_rows):
        """Cache row of token ``pos`` of sequence ``seq_id``, clamped into the cache: offsets and page numbers are
        only checked on request (a host copy), so a bad one reads a wrong row, never outside the cache (and the
        clamp lets the compiler drop per-element bounds checks, which would block cp.async)."""
        if cfg.page_size:
            row = Page_table[seq_id, pos // cfg.page_size] * cfg.page_size + pos % cfg.page_size
        else:
            row = kv_begin + pos
        return T.min(T.max(row, 0), cache_rows - 1)

    def partial_index(split, qi, hg, d, r):
        """Element (dim d, row r) of a split's fp32 partial output: [split, query, head group, dim, row], the order
        of the accumulator's fragments, so each thread writes and reads back contiguous pairs of rows."""
        return (((split * total_q + qi) * head_groups + hg) * KV_LORA_RANK + d) * block_m + r

    def q_value(Q, q_begin, q_len, q_scale, qi, h, d):
        """Q[query qi, head h, dim d] as the MMA type (0 past the sequence's queries), times ``q_shift``; a8w8
        rounds it to fp8 exactly as torch's per-tensor quantizer does: bf16(q / scale), clamped, to e4m3."""
        value = Q[q_begin + T.min(qi, q_len - 1), h, d]
        if cfg.q_format == "fp8":
            scaled = T.cast(T.cast(T.cast(value, f32) / q_scale, bf16), f32)
            value = T.cast(T.clamp(scaled, -fp8_max, fp8_max), cfg.fp8_dtype)
        if q_shift != 1.0:
            value = T.cast(value, f32) * q_shift
        return T.if_then_else(qi < q_len, T.cast(value, mma), T.cast(0, mma))

    def e2m1(byte, odd):
        """The e2m1 code in the low (even element) or high (odd) nibble of ``byte``, times 2^-14, as fp32: its 3
        magnitude bits at fp16 bits 11..9 and its sign at bit 15 form that fp16 exactly (the e2m1 subnormal too).
        The 2^-14 is undone once, in the score and output scales (``E2M1_OFFSET``)."""
        code = T.shift_right(byte, odd * 4) & 15
        half_bits = T.shift_left(code & 8, 12) | T.shift_left(code & 7, 9)
        return T.cast(T.reinterpret(T.cast(half_bits, "uint16"), "float16"), f32)

    def e8m0(byte):
        """e8m0 scale byte e -> 2^(e - 127) as fp32, built from its bits; e == 0 is the subnormal 2^-127, 255 NaN."""
        e = T.cast(byte, "int32")
        return T.if_then_else(
            e == 0,
            T.float32(5.877471754111438e-39),
            T.reinterpret(T.if_then_else(e == 255, 0x7FC00000, T.shift_left(e, 23)), f32),
        )

    block_bytes = MXFP4_BLOCK // 2  # 16 packed bytes per 32-element scale block
    lat_blocks = KV_LORA_RANK // MXFP4_BLOCK  # 16 blocks per row: the latent part
    rope_blocks = ROPE_DIM // MXFP4_BLOCK  # 2 blocks per row: the rope part

    @T.macro
    def decode_mxfp4_blocks(raw, raw_scale, K_lat, K_rope, tx):
        """Consumer thread ``tx`` decodes whole 32-element blocks of the tile: one 16-byte shared load of the
        packed codes and one scale byte per block, then 32 bf16 values in contiguous runs."""
        packed = T.alloc_local([block_bytes], "uint8")
        for k in T.unroll(block_n * (lat_blocks + rope_blocks) // CONSUMER_THREADS):
            blk_id = tx + k * CONSUMER_THREADS
            i = blk_id // (lat_blocks + rope_blocks)
            b = blk_id % (lat_blocks + rope_blocks)
            scale = e8m0(raw_scale[i * MXFP4_SCALES_PER_TOKEN + b])
            for v in T.vectorized(block_bytes):
                packed[v] = raw[i, b * block_bytes + v]
            if b < lat_blocks:
                for e in T.vectorized(MXFP4_BLOCK):
                    K_lat[i, b * MXFP4_BLOCK + e] = T.cast(
                        e2m1(T.cast(packed[e // 2], "int32"), e % 2) * scale, bf16
                    )
            else:
                for e in T.vectorized(MXFP4_BLOCK):
                    K_rope[i, (b - lat_blocks) * MXFP4_BLOCK + e] = T.cast(
                        e2m1(T.cast(packed[e // 2], "int32"), e % 2) * scale, bf16
                    )

    @T.macro
    def body(Q, KV, KV_scales, scale_stride, Q_scale, KV_scale, qo_indptr, kv_indptr, Page_table, sm_scale,
             num_splits, O_partial, LSE_partial, Semaphores, Out, LSE):
        with T.Kernel(num_splits, indptr_len - 1, head_groups, threads=cfg.threads) as (split_id, seq_id, hg):
            # Ring of raw tiles (the cache's own bytes); a bf16 stage is the MMA operand itself.
            if converts:
                Raw = [T.alloc_shared([block_n, kv_cols], kv_dtype) for _ in range(stages)]
                K_lat = T.alloc_shared([block_n, KV_LORA_RANK], mma)
                K_rope = T.alloc_shared([block_n, ROPE_DIM], mma)
            else:
                Raw_lat = [T.alloc_shared([block_n, KV_LORA_RANK], bf16) for _ in range(stages)]
                Raw_rope = [T.alloc_shared([block_n, ROPE_DIM], bf16) for _ in range(stages)]
            if cfg.kv_format == "mxfp4":
                Raw_scale = [T.alloc_shared([scale_bytes], "uint8") for _ in range(stages)]
            Q_lat = T.alloc_shared([block_m, KV_LORA_RANK], mma)
            Q_rope = T.alloc_shared([block_m, ROPE_DIM], mma)
            P_shared = T.alloc_shared([block_m, block_n], mma)
            last_flag = T.alloc_shared([1], "int32")

            ready = T.alloc_barrier([ready_count] * stages)
            free = T.alloc_barrier([CONSUMER_THREADS] * stages)

            # S^T [token, row] and O^T [dim, row]: the KV tile is the wgmma M dimension.
            acc_s = T.alloc_fragment([block_n, block_m], f32)
            acc_o = T.alloc_fragment([KV_LORA_RANK, block_m], f32)
            row_max = T.alloc_fragment([block_m], f32)
            row_max_prev = T.alloc_fragment([block_m], f32)
            row_max_safe = T.alloc_fragment([block_m], f32)
            rescale = T.alloc_fragment([block_m], f32)
            row_sum = T.alloc_fragment([block_m], f32)
            denom = T.alloc_fragment([block_m], f32)

            kv_begin = T.alloc_var("int32", init=kv_indptr[seq_id])
            kv_len = T.alloc_var("int32", init=kv_indptr[seq_id + 1] - kv_indptr[seq_id])
            q_begin = T.alloc_var("int32", init=qo_indptr[seq_id])
            q_len = T.alloc_var("int32", init=qo_indptr[seq_id + 1] - qo_indptr[seq_id])
            # Split s covers tokens [s * chunk, (s + 1) * chunk), chunk a multiple of block_n.
            chunk = T.alloc_var("int32", init=T.ceildiv(T.ceildiv(kv_len, num_splits), block_n) * block_n)
            split_lo = T.alloc_var("int32", init=split_id * chunk)
            split_hi = T.alloc_var("int32", init=T.min(split_lo + chunk, kv_len))
            num_tiles = T.alloc_var("int32", init=T.ceildiv(T.max(split_hi - split_lo, 0), block_n))
            # Ring rounds per query pass: every pass walks ceil(num_tiles / stages) rounds of all stages, so the
            # stage of a tile is static and a round's barrier parity is (pass * rounds + round) & 1.
            rounds = T.alloc_var("int32", init=T.ceildiv(num_tiles, stages))
            num_passes = T.alloc_var("int32", init=T.max(q_len, 0))

            tx = T.get_thread_binding()

            if tx < CONSUMER_THREADS:
                T.set_max_nreg(cfg.consumer_regs, 1)
                q_scale = T.alloc_var(
                    f32,
                    init=T.cast(T.cast(T.max(Q_scale[0], AMAX_FLOOR) / fp8_max, bf16), f32)
                    if cfg.q_format == "fp8"
                    else Q_scale[0],
                )
                # One multiply per score: sm_scale, log2(e) and the fp8 per-tensor scales of Q and K.
                kv_scale = KV_scale[0] * E2M1_OFFSET if cfg.kv_format == "mxfp4" else KV_scale[0]
                score_scale = T.alloc_var(f32, init=sm_scale * LOG2E * q_scale * kv_scale / q_shift)
                out_scale = T.alloc_var(f32, init=kv_scale)
                for q_pass in T.serial(num_passes):
                    # Stage 1: this pass's Q rows (row r = head hg * block_h + r of query q_pass).
                    for r, d in T.Parallel(block_m, KV_LORA_RANK):
                        Q_lat[r, d] = q_value(Q, q_begin, q_len, q_scale, q_pass, hg * block_h + r, d)
                    for r, d in T.Parallel(block_m, ROPE_DIM):
                        Q_rope[r, d] = q_value(Q, q_begin, q_len, q_scale, q_pass, hg * block_h + r, KV_LORA_RANK + d)
                    T.fill(acc_o, 0)
                    T.fill(denom, 0)
                    T.fill(row_max, -T.infinity(f32))
                    horizon = split_hi
                    if cfg.causal:
                        # query q_pass of q_len sees positions [0, kv_len - q_len + q_pass]
                        horizon = T.min(split_hi, kv_len - q_len + q_pass + 1)
                    for rnd in T.serial(rounds):
                        for s in list(range(stages)):  # static: the stage picks named buffers
                            tile = rnd * stages + s
                            tile_lo = split_lo + tile * block_n
                            T.barrier_wait(ready[s], (q_pass * rounds + rnd) & 1)
                            if tile < num_tiles:
                                # Stage 2: the tile as MMA operands (bf16, or fp16 for fp8).
                                if converts:
                                    if cfg.kv_format == "fp8":
                                        # fp8 -> bf16 / fp16 is exact; the per-tensor scale sits in score/out scales.
                                        for i, d in T.Parallel(block_n, KV_LORA_RANK):
                                            K_lat[i, d] = T.cast(Raw[s][i, d], mma)
                                        for i, d in T.Parallel(block_n, ROPE_DIM):
                                            K_rope[i, d] = T.cast(Raw[s][i, KV_LORA_RANK + d], mma)
                                    else:
                                        # code * 2^(e - 127) (times 2^-14): exact in bf16.
                                        # (Element-wise decode, TileLang's own partition, was ~5% slower: run 14.)
                                        decode_mxfp4_blocks(Raw[s], Raw_scale[s], K_lat, K_rope, tx)
                                    T.fence_proxy_async()  # generic-proxy stores, read next by wgmma
                                    T.barrier_arrive(free[s])  # the producer may refill the stage now
                                    K_l, K_r = K_lat, K_rope
                                else:
                                    K_l, K_r = Raw_lat[s], Raw_rope[s]

                                # Stage 3: S^T = K Q^T over 512 latent + 64 rope dims.
                                T.gemm(K_l, Q_lat, acc_s, transpose_B=True, clear_accum=True)
                                T.gemm(K_r, Q_rope, acc_s, transpose_B=True)
                                for j, r in T.Parallel(block_n, block_m):
                                    acc_s[j, r] = T.if_then_else(
                                        tile_lo + j < horizon, acc_s[j, r] * score_scale, -T.infinity(f32)
                                    )
                                # Stage 4: online softmax in base 2; a row with nothing visible yet keeps max -inf
                                # and the safe max 0 keeps exp2 away from (-inf) - (-inf).
                                T.copy(row_max, row_max_prev)
                                T.reduce_max(acc_s, row_max, dim=0, clear=False)
                                for r in T.Parallel(block_m):
                                    row_max_safe[r] = T.if_then_else(row_max[r] == -T.infinity(f32), 0, row_max[r])
                                    rescale[r] = T.exp2(row_max_prev[r] - row_max_safe[r])
                                for j, r in T.Parallel(block_n, block_m):
                                    acc_s[j, r] = T.exp2(acc_s[j, r] - row_max_safe[r])
                                T.reduce_sum(acc_s, row_sum, dim=0)
                                for r in T.Parallel(block_m):
                                    denom[r] = denom[r] * rescale[r] + row_sum[r]
                                for d, r in T.Parallel(KV_LORA_RANK, block_m):
                                    acc_o[d, r] *= rescale[r]
                                for r, j in T.Parallel(block_m, block_n):
                                    P_shared[r, j] = T.cast(acc_s[j, r], mma)
                                # Stage 5: O^T += V^T P^T.
                                T.gemm(K_l, P_shared, acc_o, transpose_A=True, transpose_B=True)
                                if not converts:
                                    T.barrier_arrive(free[s])
                            else:
                                T.barrier_arrive(free[s])

                    # Stage 6: this pass's rows. denom == 0: nothing visible, output 0 and LSE -inf.
                    qi = q_begin + q_pass
                    if num_splits == 1:
                        for d, r in T.Parallel(KV_LORA_RANK, block_m):
                            Out[qi, hg * block_h + r, d] = T.cast(
                                T.if_then_else(denom[r] > 0, acc_o[d, r] * out_scale / denom[r], 0), bf16
                            )
                        for r in T.Parallel(block_m):
                            LSE[qi, hg * block_h + r] = T.if_then_else(
                                denom[r] > 0, (T.log2(denom[r]) + row_max[r]) * LN2, -T.infinity(f32)
                            )
                    else:
                        for d, r in T.Parallel(KV_LORA_RANK, block_m):
                            O_partial[partial_index(split_id, qi, hg, d, r)] = (
                                T.if_then_else(denom[r] > 0, acc_o[d, r] * out_scale / denom[r], 0)
                            )
                        for r in T.Parallel(block_m):
                            LSE_partial[(split_id * total_q + qi) * heads + hg * block_h + r] = T.if_then_else(
                                denom[r] > 0, T.log2(denom[r]) + row_max[r], -T.infinity(f32)
                            )

                if num_splits > 1:
                    # Stage 7 (fused combine): publish this split, count it; the last split to arrive merges all.
                    T.call_extern("handle", "__threadfence")
                    T.sync_threads(1, CONSUMER_THREADS)
                    if tx == 0:
                        last_flag[0] = T.atomic_add(
                            Semaphores[seq_id * head_groups + hg], 1, memory_order="acq_rel", return_prev=True
                        )
                    T.sync_threads(1, CONSUMER_THREADS)
                    if last_flag[0] == num_splits - 1:
                        T.call_extern("handle", "__threadfence")
                        for q_pass in T.serial(num_passes):
                            qi = q_begin + q_pass
                            for r in T.Parallel(block_m):
                                row_max[r] = -T.infinity(f32)
                                denom[r] = 0
                                for sp in T.serial(num_splits):
                                    row_max[r] = T.max(
                                        row_max[r], LSE_partial[(sp * total_q + qi) * heads + hg * block_h + r]
                                    )
                            T.fill(acc_o, 0)
                            for sp in T.serial(num_splits):
                                for r in T.Parallel(block_m):
                                    rescale[r] = T.if_then_else(
                                        row_max[r] == -T.infinity(f32),
                                        0,
                                        T.exp2(LSE_partial[(sp * total_q + qi) * heads + hg * block_h + r] - row_max[r]),
                                    )
                                    denom[r] += rescale[r]
                                for d, r in T.Parallel(KV_LORA_RANK, block_m):
                                    acc_o[d, r] += rescale[r] * O_partial[partial_index(sp, qi, hg, d, r)]
                            for d, r in T.Parallel(KV_LORA_RANK, block_m):
                                Out[qi, hg * block_h + r, d] = T.cast(
                                    T.if_then_else(denom[r] > 0, acc_o[d, r] / denom[r], 0), bf16
                                )
                            for r in T.Parallel(block_m):
                                LSE[qi, hg * block_h + r] = T.if_then_else(
                                    denom[r] > 0, (T.log2(denom[r]) + row_max[r]) * LN2, -T.infinity(f32)
                                )
                        if tx == 0:
                            Semaphores[seq_id * head_groups + hg] = 0
            else:
                # Producer: raw tile bytes into the ring, one stage ahead of the consumer per free slot.
                T.set_max_nreg(cfg.producer_regs, 0)
                p = tx - CONSUMER_THREADS
                if cfg.kv_format == "mxfp4":
                    scale_reg = T.alloc_local([scales_per_thread], "uint8")
                for q_pass in T.serial(num_passes):
                    for rnd in T.serial(rounds):
                        for s in list(range(stages)):  # static: the stage picks named buffers
                            tile = rnd * stages + s
                            tile_lo = split_lo + tile * block_n
                            if cfg.kv_format == "mxfp4":
                                # Scale bytes into registers first: their latency hides behind the wait below.
                                for k in T.unroll(scales_per_thread):
                                    idx = p + k * PRODUCER_THREADS
                                    row = cache_row(
                                        Page_table, seq_id, kv_begin,
                                        T.min(tile_lo + idx // MXFP4_SCALES_PER_TOKEN, T.max(split_hi - 1, 0)), cache_rows,
                                    )
                                    if tile < num_tiles and idx < scale_bytes:
                                        scale_reg[k] = KV_scales[row * scale_stride + idx % MXFP4_SCALES_PER_TOKEN]
                            T.barrier_wait(free[s], ((q_pass * rounds + rnd) & 1) ^ 1)
                            if tile < num_tiles:
                                # 16-byte cp.async chunks, consecutive threads on consecutive chunks of a row. Rows
                                # past the split end repeat its last token: finite data whose scores are masked.
                                segments = [(Raw[s], 0, kv_cols)] if converts else [
                                    (Raw_lat[s], 0, KV_LORA_RANK), (Raw_rope[s], KV_LORA_RANK, ROPE_DIM)]
                                for dst, col0, cols in segments:
                                    per_row = cols // chunk_elems
                                    for k in T.unroll(block_n * per_row // PRODUCER_THREADS):
                                        i = (p + k * PRODUCER_THREADS) // per_row
                                        c = (p + k * PRODUCER_THREADS) % per_row * chunk_elems
                                        row = cache_row(
                                            Page_table, seq_id, kv_begin, T.min(tile_lo + i, split_hi - 1), cache_rows
                                        )
                                        T.ptx_cp_async(
                                            T.access_ptr(dst[i, c], "w", chunk_elems),
                                            T.access_ptr(KV[row, col0 + c], "r", chunk_elems),
                                            chunk_elems,
                                        )
                                if cfg.kv_format == "mxfp4":
                                    for k in T.unroll(scales_per_thread):
                                        idx = p + k * PRODUCER_THREADS
                                        if idx < scale_bytes:
                                            Raw_scale[s][idx] = scale_reg[k]
                            T.cp_async_barrier_noinc(ready[s])
                            if cfg.kv_format == "mxfp4":
                                T.barrier_arrive(ready[s])

    if cfg.page_size:

        @T.prim_func
        def mla_decode_ws_paged(
            Q: T.Tensor([total_q, heads, QK_DIM], q_dtype),
            KV: T.Tensor([cache_rows, kv_cols], kv_dtype),
            KV_scales: T.Tensor([scale_len], "uint8"),
            scale_stride: T.int32,
            Q_scale: T.Tensor([1], f32),
            KV_scale: T.Tensor([1], f32),
            qo_indptr: T.Tensor([indptr_len], "int32"),
            kv_indptr: T.Tensor([indptr_len], "int32"),
            Page_table: T.Tensor([batch, max_pages], "int32"),
            sm_scale: T.float32,
            num_splits: T.int32,
            O_partial: T.Tensor([o_len], f32),
            LSE_partial: T.Tensor([l_len], f32),
            Semaphores: T.Tensor([sem_len], "int32"),
            Out: T.Tensor([total_q, heads, KV_LORA_RANK], bf16),
            LSE: T.Tensor([total_q, heads], f32),
        ):
            body(Q, KV, KV_scales, scale_stride, Q_scale, KV_scale, qo_indptr, kv_indptr, Page_table, sm_scale,
                 num_splits, O_partial, LSE_partial, Semaphores, Out, LSE)

        return mla_decode_ws_paged

    @T.prim_func
    def mla_decode_ws(
        Q: T.Tensor([total_q, heads, QK_DIM], q_dtype),
        KV: T.Tensor([cache_rows, kv_cols], kv_dtype),
        KV_scales: T.Tensor([scale_len], "uint8"),
        scale_stride: T.int32,
        Q_scale: T.Tensor([1], f32),
        KV_scale: T.Tensor([1], f32),
        qo_indptr: T.Tensor([indptr_len], "int32"),
        kv_indptr: T.Tensor([indptr_len], "int32"),
        sm_scale: T.float32,
        num_splits: T.int32,
        O_partial: T.Tensor([o_len], f32),
        LSE_partial: T.Tensor([l_len], f32),
        Semaphores: T.Tensor([sem_len], "int32"),
        Out: T.Tensor([total_q, heads, KV_LORA_RANK], bf16),
        LSE: T.Tensor([total_q, heads], f32),
    ):
        body(Q, KV, KV_scales, scale_stride, Q_scale, KV_scale, qo_indptr, kv_indptr, None, sm_scale,
             num_splits, O_partial, LSE_partial, Semaphores, Out, LSE)

    return mla_decode_ws
