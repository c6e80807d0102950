"""Warp-specialised MLA decode for 64+ query rows per sequence on Hopper (sm_90a): 128 heads, MTP, one launch.

A CTA serves 64 query rows of one sequence (``block_h`` heads x ``64 // block_h`` query tokens: 64 heads x 1 query,
16 heads x 4 queries) and one KV split. The 64 rows are the wgmma M dimension, so each KV tile is loaded once per
CTA for all of its rows. More rows take more CTAs: the grid is (row tiles, splits, sequences), x fastest, so the
CTAs that read the same KV (one sequence's row tiles, same split) are launched next to each other and L2 serves
their re-reads.

Three warp-group roles over a ring of ``num_stages`` shared-memory KV tiles (mbarrier pairs "kv_ready" / "kv_free"
per stage; the trip count varies per CTA, so the ring is a serial loop over barrier parities):

  producer (warp group 2, few registers)
    streams each 64-token bf16 tile into the next free stage with cp.async (latent dims 0..255, 256..511 and the 64
    rope dims as three buffers), completing on the stage's "kv_ready" barrier; paged caches gather rows through
    the page table.
  softmax consumer (warp group 0)
    1. the pass's 64 Q rows into shared memory, once per pass;
    2. S = Q K^T (64 rows x 64 tokens over 512 + 64 dims) on wgmma, masked (split end, causal horizon per row);
    3. online softmax in base 2 (log2(e) folded into the score scale): P (bf16) and the rescale factors go to
       shared memory, handed to warp group 1 through "p_ready" (returned through "p_free");
    4. O[:, 0:256] += P V[:, 0:256].
  second consumer (warp group 1)
    4'. O[:, 256:512] = O * rescale + P V[:, 256:512], with the P and rescale of warp group 0.
  Both consumers release the stage ("kv_free", 256 arrivals). At the end of a pass warp group 0 publishes the row
  sums and maxima ("stats_ready" / "stats_free"). One split: each consumer normalises and writes its 256 output
  columns (warp group 0 the natural-log LSE). Several splits: fp32 partials + base-2 LSE, a per-(sequence, row
  tile) semaphore counts the splits, and the CTA that arrives last merges them and resets the semaphore to 0.

Only what changes the generated code is static (``RowsDecodeKernelConfig``); batch, lengths, token counts and the
number of splits are dynamic (the split count is a kernel argument), so a new shape never recompiles.
"""

from dataclasses import dataclass
from types import SimpleNamespace

import tilelang.language as T

from tl_kernels import steps
from tl_kernels.steps import KV_LORA_RANK, LN2, LOG2E, QK_DIM, ROPE_DIM
WG = 128  # threads per warp group (setmaxnreg and wgmma work per warp group)
ROWS = 64  # query rows per CTA: the wgmma M dimension
HALF = KV_LORA_RANK // 2  # output columns per consumer warp group
ROWS_KV_FORMATS = ("bf16",)  # fp8 / mxfp4 wait for the shared decode helpers (tl_kernels/dequant.py)


@dataclass(frozen=True)
class RowsDecodeKernelConfig:
    """Everything that changes the generated code of the 64-row warp-specialised decode kernel."""

    kv_format: str = "bf16"
    q_format: str = "bf16"
    num_heads: int = 128
    block_h: int = 64  # heads per CTA; 64 // block_h query tokens fill the other rows
    q_slots: int = 1  # CTAs per (sequence, head group) along the queries: query groups beyond them take passes
    block_n: int = 64  # KV tokens per tile: the N of S = Q K^T, the K of O += P V
    num_stages: int = 2  # depth of the KV ring (2 x 72 KB + Q 72 KB: what fits 227 KB)
    causal: bool = False
    page_size: int = 0  # 0: flat cache; else tokens per page (Page_table argument)
    fp8_dtype: str = "float8_e4m3fn"  # unused until fp8 caches are served; kept for the family's naming
    softmax_regs: int = 240  # setmaxnreg per role: 240 + 160 + 96 <= 3 x 168, the launch count (384 threads)
    pv_regs: int = 160
    producer_regs: int = 96

    fused_combine = True  # the launch passes num_splits + split workspace + semaphores; no combine kernel

    def __post_init__(self):
        if self.kv_format not in ROWS_KV_FORMATS:
            raise ValueError(f"kv_format must be one of {ROWS_KV_FORMATS}, got {self.kv_format!r}")
        if self.q_format != "bf16":
            raise ValueError(f"the 64-row kernel reads bf16 Q, got q_format={self.q_format!r}")
        if self.block_h not in (16, 32, 64) or self.num_heads % self.block_h:
            raise ValueError(f"block_h={self.block_h} must be 16, 32 or 64 and divide num_heads={self.num_heads}")
        if self.q_slots < 1 or self.block_n != 64 or self.num_stages < 1:
            raise ValueError("q_slots >= 1, block_n == 64 and num_stages >= 1")
        steps.check_register_budgets(
            "RowsDecodeKernelConfig",
            dict(softmax_regs=self.softmax_regs, pv_regs=self.pv_regs, producer_regs=self.producer_regs), self.threads,
        )

    @property
    def q_group(self) -> int:
        """Query tokens per CTA pass (rows = block_h heads x q_group queries)."""
        return ROWS // self.block_h

    @property
    def q_tile(self) -> int:
        """Query tokens one (sequence, head group) serves per pass over all of its CTAs."""
        return self.q_group * self.q_slots

    @property
    def block_m(self) -> int:
        return ROWS

    @property
    def head_groups(self) -> int:
        return self.num_heads // self.block_h

    @property
    def row_tiles(self) -> int:
        """CTAs per (sequence, split): the grid's x dimension."""
        return self.head_groups * self.q_slots

    @property
    def semaphores_per_seq(self) -> int:
        """Fused-merge counters per sequence (one per row tile): the launch allocates batch x this many."""
        return self.row_tiles

    @property
    def threads(self) -> int:
        return 3 * WG

    @property
    def shared_bytes(self) -> int:
        """Shared memory the kernel allocates, in bytes (barriers and scratch approximated)."""
        stage = self.block_n * QK_DIM * 2
        q = ROWS * QK_DIM * 2
        p = ROWS * self.block_n * 2
        return self.num_stages * stage + q + p + 3 * ROWS * 4 + 256

    @property
    def name(self) -> str:
        return (
            f"mla_decode_rows_kv{self.kv_format}_q{self.q_format}_h{self.num_heads}_bh{self.block_h}"
            f"_qs{self.q_slots}_bn{self.block_n}_st{self.num_stages}"
            f"_r{self.softmax_regs}-{self.pv_regs}-{self.producer_regs}"
            f"{'_causal' if self.causal else ''}{f'_page{self.page_size}' if self.page_size else ''}"
        )


def mla_decode_rows_kernel(cfg: RowsDecodeKernelConfig):
    """Returns the prim_func of the 64-row decode kernel for ``cfg``.

    Arguments: those of ``tl_kernels.mla_decode_ws.mla_decode_ws_kernel`` (the fused-combine launch form), with
      Semaphores    (sem_len,) int32      >= batch * cfg.semaphores_per_seq entries, zero before the call; left zero
      O_partial     (o_len,) fp32         num_splits * total_q * num_heads * 512 when num_splits > 1, laid out as
                                          [split, query, head, dim] (else unused)
      LSE_partial   (l_len,) fp32         num_splits * total_q * num_heads, [split, query, head] (else unused)
    KV_scales / scale_stride / Q_scale / KV_scale are accepted (one launch form for every family) and unused: the
    cache is bf16 and Q bf16.
    """
    heads, block_h, block_n = cfg.num_heads, cfg.block_h, cfg.block_n
    q_group, q_slots, row_tiles = cfg.q_group, cfg.q_slots, cfg.row_tiles
    stages = cfg.num_stages
    bf16, f32 = "bfloat16", "float32"
    chunk = 8  # bf16 elements per 16-byte cp.async
    # Registers per thread at launch (ptxas's cap for this block size, a multiple of 8). setmaxnreg.inc may only
    # raise a warp group's count and .dec only lower it: a budget below the launch count is a .dec (an .inc to a
    # smaller count is an illegal instruction on the H200).
    launch_regs = steps.launch_registers(cfg.threads)

    total_q = T.dynamic("total_q")
    cache_rows = T.dynamic("cache_rows")
    indptr_len = T.dynamic("indptr_len")
    scale_len = T.dynamic("scale_len")
    o_len = T.dynamic("o_len")
    l_len = T.dynamic("l_len")
    sem_len = T.dynamic("sem_len")
    batch, max_pages = T.dynamic("batch, max_pages")

    def cache_row(Page_table, seq_id, kv_begin, pos):
        """Cache row of token ``pos`` of sequence ``seq_id``, clamped into the cache (a bad offset or page number
        reads a wrong row, never outside the cache; the clamp also lets cp.async go without bounds checks)."""
        if cfg.page_size:
            row = Page_table[seq_id, pos // cfg.page_size] * cfg.page_size + pos % cfg.page_size
        else:
            row = kv_begin + pos
        return T.min(T.max(row, 0), cache_rows - 1)

    # The online-softmax step of warp group 0 runs on S [row, token] and its half of O [row, dim].
    softmax_ctx = SimpleNamespace(block_m=ROWS, block_n=block_n, token_axis=1, kv_major_loops=False,
                                  out_dims=HALF, deferred_sum=False,
                                  tr=lambda *index: list(index[0]) if len(index) == 1 else index)

    def o_index(split, qi, h, d):
        return ((split * total_q + qi) * heads + h) * KV_LORA_RANK + d

    def l_index(split, qi, h):
        return (split * total_q + qi) * heads + h

    @T.macro
    def merge_half(O_partial, LSE_partial, Out, LSE, acc, row_max, denom, weight, q_begin, q_base, q_len, hg, col0,
                   num_splits, write_lse):
        """Fused combine of one pass's rows over this consumer's 256 columns: weights 2^(lse_s - max) per split."""
        for r in T.Parallel(ROWS):
            qi = q_base + r // block_h
            row_max[r] = -T.infinity(f32)
            denom[r] = 0
            if qi < q_len:
                for sp in T.serial(num_splits):
                    row_max[r] = T.max(row_max[r], LSE_partial[l_index(sp, q_begin + qi, hg * block_h + r % block_h)])
        T.fill(acc, 0)
        for sp in T.serial(num_splits):
            for r in T.Parallel(ROWS):
                qi = q_base + r // block_h
                weight[r] = 0
                if qi < q_len and row_max[r] != -T.infinity(f32):
                    weight[r] = T.exp2(LSE_partial[l_index(sp, q_begin + qi, hg * block_h + r % block_h)] - row_max[r])
                denom[r] += weight[r]
            for r, d in T.Parallel(ROWS, HALF):
                qi = q_base + r // block_h
                if qi < q_len:
                    acc[r, d] += weight[r] * O_partial[o_index(sp, q_begin + qi, hg * block_h + r % block_h, col0 + d)]
        for r in T.Parallel(ROWS):  # the rows' output factors, in the merge's free weight fragment
            weight[r] = steps.output_factor(denom[r], 1.0)
        for r, d in T.Parallel(ROWS, HALF):
            qi = q_base + r // block_h
            if qi < q_len:
                Out[q_begin + qi, hg * block_h + r % block_h, col0 + d] = T.cast(
                    steps.normalised(acc[r, d], denom[r], weight[r]), bf16
                )
        if write_lse:
            for r in T.Parallel(ROWS):
                qi = q_base + r // block_h
                if qi < q_len:
                    LSE[q_begin + qi, hg * block_h + r % block_h] = T.if_then_else(
                        denom[r] > 0, (T.log2(denom[r]) + row_max[r]) * LN2, -T.infinity(f32)
                    )

    @T.macro
    def write_half(O_partial, Out, acc, stat_denom, factor, q_begin, q_base, q_len, hg, col0, split_id, num_splits):
        """This pass's rows over 256 columns: normalised bf16 output (one split) or the fp32 partial. ``factor``: a
        free row fragment, for the rows' output factors (``steps.output_factor``: one division per row, not per
        element)."""
        for r in T.Parallel(ROWS):
            factor[r] = steps.output_factor(stat_denom[r], 1.0)
        for r, d in T.Parallel(ROWS, HALF):
            qi = q_base + r // block_h
            value = steps.normalised(acc[r, d], stat_denom[r], factor[r])
            if qi < q_len:
                if num_splits == 1:
                    Out[q_begin + qi, hg * block_h + r % block_h, col0 + d] = T.cast(value, bf16)
                else:
                    O_partial[o_index(split_id, q_begin + qi, hg * block_h + r % block_h, col0 + d)] = value

    @T.macro
    def merge_if_last(st, O_partial, LSE_partial, Out, LSE, num_splits, acc, row_max, denom, weight, col0, first_half):
        # Stage 6 (fused combine), in each consumer: the CTA of the split that arrived last merges every split's
        # partial of its 256 columns; warp group 0 (``first_half``) also writes the LSE and resets the semaphore.
        if st.last_flag[0] == num_splits - 1:
            T.call_extern("handle", "__threadfence")
            for q_pass in T.serial(st.num_passes):
                q_base = (q_pass * q_slots + st.q_slot) * q_group
                merge_half(O_partial, LSE_partial, Out, LSE, acc, row_max, denom, weight, st.q_begin, q_base, st.q_len,
                           st.hg, col0, num_splits, first_half)
            if first_half:
                if st.tx == 0:
                    st.Semaphores[st.seq_id * row_tiles + st.rt] = 0

    # ---- warp group 0: S = Q K^T, the online softmax, O[:, :256] ----------------------------------------------

    @T.macro
    def load_q_rows(st, q_base):
        # Stage 1: the pass's rows; row r is head hg * block_h + r % block_h of query q_base + r // block_h (0 past
        # the sequence's queries).
        for r, d in T.Parallel(ROWS, QK_DIM):
            qi = q_base + r // block_h
            value = T.if_then_else(
                qi < st.q_len, st.Q[st.q_begin + T.min(qi, st.q_len - 1), st.hg * block_h + r % block_h, d],
                T.cast(0, bf16)
            )
            if d < HALF:
                st.Q_l[r, d] = value
            elif d < KV_LORA_RANK:
                st.Q_r[r, d - HALF] = value
            else:
                st.Q_rope[r, d - KV_LORA_RANK] = value
        T.fence_proxy_async()  # generic-proxy stores, read next by wgmma

    @T.macro
    def attend_tile(st, s, tile, tile_lo, q_pass, q_base, scales):
        # Stage 2: S = Q K^T over 256 + 256 latent + 64 rope dims, kept in flight together.
        T.wgmma_gemm(st.Q_l, st.KV_l[s], st.acc_s, transpose_B=True, clear_accum=True)
        T.wgmma_gemm(st.Q_r, st.KV_r[s], st.acc_s, transpose_B=True)
        T.wgmma_gemm(st.Q_rope, st.K_rope[s], st.acc_s, transpose_B=True)
        T.wait_wgmma(0)
        # Mask: past the split end; causal, query qi of q_len sees [0, kv_len - q_len + qi].
        for r, j in T.Parallel(ROWS, block_n):
            if cfg.causal:
                horizon = T.min(st.split_hi, st.kv_len - st.q_len + q_base + r // block_h + 1)
            else:
                horizon = st.split_hi
            st.acc_s[r, j] = T.if_then_else(tile_lo + j < horizon, st.acc_s[r, j] * scales.score_scale, -T.infinity(f32))
        # Stage 3: online softmax in base 2, on this warp group's half of O (``steps.online_softmax_step``).
        steps.online_softmax_step(softmax_ctx, st)
        # Hand P and the rescale to warp group 1 (once it has read the previous tile's).
        T.barrier_wait(st.p_free, ((q_pass * st.num_tiles + tile) & 1) ^ 1)
        T.copy(st.acc_s, st.P_shared)
        for r in T.Parallel(ROWS):
            st.rescale_shared[r] = st.rescale[r]
        T.fence_proxy_async()
        T.barrier_arrive(st.p_ready)
        # Stage 4: O[:, :256] += P V[:, :256].
        T.gemm(st.P_shared, st.KV_l[s], st.acc_o)

    @T.macro
    def softmax_consumer(st, sm_scale, O_partial, LSE_partial, Out, LSE, num_splits):
        T.set_max_nreg(cfg.softmax_regs, int(cfg.softmax_regs >= launch_regs))
        score_scale = T.alloc_var(f32, init=sm_scale * LOG2E)
        scales = SimpleNamespace(score_scale=score_scale)  # a macro argument would be copied: passed by name
        for q_pass in T.serial(st.num_passes):
            q_base = (q_pass * q_slots + st.q_slot) * q_group
            load_q_rows(st, q_base)
            T.fill(st.acc_o, 0)
            T.fill(st.denom, 0)
            T.fill(st.row_max, -T.infinity(f32))
            for rnd in T.serial(st.rounds):
                for s in list(range(stages)):  # static: the stage picks named buffers
                    tile = rnd * stages + s
                    tile_lo = st.split_lo + tile * block_n
                    T.barrier_wait(st.kv_ready[s], (q_pass * st.rounds + rnd) & 1)
                    if tile < st.num_tiles:
                        attend_tile(st, s, tile, tile_lo, q_pass, q_base, scales)
                        T.barrier_arrive(st.kv_free[s])
                    else:
                        T.barrier_arrive(st.kv_free[s])
            # Stage 5: publish the row sums (once warp group 1 has read the previous pass's), write.
            T.barrier_wait(st.stats_free, (q_pass & 1) ^ 1)
            for r in T.Parallel(ROWS):
                st.denom_shared[r] = st.denom[r]
            T.barrier_arrive(st.stats_ready)
            write_half(O_partial, Out, st.acc_o, st.denom, st.rescale, st.q_begin, q_base, st.q_len, st.hg, 0,
                       st.split_id, num_splits)
            for r in T.Parallel(ROWS):
                qi = q_base + r // block_h
                if qi < st.q_len:
                    if num_splits == 1:
                        LSE[st.q_begin + qi, st.hg * block_h + r % block_h] = T.if_then_else(
                            st.denom[r] > 0, (T.log2(st.denom[r]) + st.row_max[r]) * LN2, -T.infinity(f32)
                        )
                    else:
                        LSE_partial[l_index(st.split_id, st.q_begin + qi, st.hg * block_h + r % block_h)] = (
                            T.if_then_else(st.denom[r] > 0, T.log2(st.denom[r]) + st.row_max[r], -T.infinity(f32))
                        )
        if num_splits > 1:
            # Stage 6 (fused combine): publish, count this split; the last split to arrive merges.
            T.call_extern("handle", "__threadfence")
            T.barrier_arrive(st.published)
            if st.tx == 0:
                T.barrier_wait(st.published, 0)
                st.last_flag[0] = T.atomic_add(
                    st.Semaphores[st.seq_id * row_tiles + st.rt], 1, memory_order="acq_rel", return_prev=True
                )
                T.barrier_arrive(st.flag_ready)
            T.barrier_wait(st.flag_ready, 0)
            merge_if_last(st, O_partial, LSE_partial, Out, LSE, num_splits, st.acc_o, st.row_max, st.denom, st.rescale,
                          0, True)

    # ---- warp group 1: O[:, 256:] with warp group 0's P and rescale ----------------------------------------------

    @T.macro
    def pv_consumer(st, O_partial, LSE_partial, Out, LSE, num_splits):
        T.set_max_nreg(cfg.pv_regs, int(cfg.pv_regs >= launch_regs))
        for q_pass in T.serial(st.num_passes):
            q_base = (q_pass * q_slots + st.q_slot) * q_group
            T.fill(st.acc_o_r, 0)
            for rnd in T.serial(st.rounds):
                for s in list(range(stages)):
                    tile = rnd * stages + s
                    T.barrier_wait(st.kv_ready[s], (q_pass * st.rounds + rnd) & 1)
                    if tile < st.num_tiles:
                        T.barrier_wait(st.p_ready, (q_pass * st.num_tiles + tile) & 1)
                        for r, d in T.Parallel(ROWS, HALF):
                            st.acc_o_r[r, d] *= st.rescale_shared[r]
                        # Stage 4': O[:, 256:] += P V[:, 256:].
                        T.gemm(st.P_shared, st.KV_r[s], st.acc_o_r)
                        T.barrier_arrive(st.p_free)
                    T.barrier_arrive(st.kv_free[s])
            T.barrier_wait(st.stats_ready, q_pass & 1)
            for r in T.Parallel(ROWS):
                st.denom_r[r] = st.denom_shared[r]
            T.barrier_arrive(st.stats_free)
            write_half(O_partial, Out, st.acc_o_r, st.denom_r, st.weight_r, st.q_begin, q_base, st.q_len, st.hg, HALF,
                       st.split_id, num_splits)
        if num_splits > 1:
            T.call_extern("handle", "__threadfence")
            T.barrier_arrive(st.published)
            T.barrier_wait(st.flag_ready, 0)
            merge_if_last(st, O_partial, LSE_partial, Out, LSE, num_splits, st.acc_o_r, st.row_max_r, st.denom_r,
                          st.weight_r, HALF, False)

    # ---- warp group 2: the producer ----------------------------------------------------------------------------

    @T.macro
    def producer(st, KV, Page_table):
        # bf16 tiles into the ring, one stage ahead per free slot.
        T.set_max_nreg(cfg.producer_regs, int(cfg.producer_regs >= launch_regs))
        p = st.tx - 2 * WG
        for q_pass in T.serial(st.num_passes):
            for rnd in T.serial(st.rounds):
                for s in list(range(stages)):
                    tile = rnd * stages + s
                    tile_lo = st.split_lo + tile * block_n
                    T.barrier_wait(st.kv_free[s], ((q_pass * st.rounds + rnd) & 1) ^ 1)
                    if tile < st.num_tiles:
                        # 16-byte chunks, consecutive threads on consecutive chunks of a row. Rows past the split
                        # end repeat its last token: finite data whose scores are masked.
                        for dst, col0, cols in ((st.KV_l[s], 0, HALF), (st.KV_r[s], HALF, HALF),
                                                (st.K_rope[s], KV_LORA_RANK, ROPE_DIM)):
                            per_row = cols // chunk
                            for k in T.unroll(block_n * per_row // WG):
                                i = (p + k * WG) // per_row
                                c = (p + k * WG) % per_row * chunk
                                row = cache_row(Page_table, st.seq_id, st.kv_begin, T.min(tile_lo + i, st.split_hi - 1))
                                T.ptx_cp_async(
                                    T.access_ptr(dst[i, c], "w", chunk),
                                    T.access_ptr(KV[row, col0 + c], "r", chunk),
                                    chunk,
                                )
                    T.cp_async_barrier_noinc(st.kv_ready[s])

    # ---- the CTA -------------------------------------------------------------------------------------------------

    @T.macro
    def body(Q, KV, qo_indptr, kv_indptr, Page_table, sm_scale, num_splits, O_partial, LSE_partial, Semaphores, Out, LSE):
        with T.Kernel(row_tiles, num_splits, indptr_len - 1, threads=cfg.threads) as (rt, split_id, seq_id):
            # The KV ring: latent halves (the two consumers' V) and the rope dims, one set per stage.
            KV_l = [T.alloc_shared([block_n, HALF], bf16) for _ in range(stages)]
            KV_r = [T.alloc_shared([block_n, HALF], bf16) for _ in range(stages)]
            K_rope = [T.alloc_shared([block_n, ROPE_DIM], bf16) for _ in range(stages)]
            Q_l = T.alloc_shared([ROWS, HALF], bf16)
            Q_r = T.alloc_shared([ROWS, HALF], bf16)
            Q_rope = T.alloc_shared([ROWS, ROPE_DIM], bf16)
            P_shared = T.alloc_shared([ROWS, block_n], bf16)
            rescale_shared = T.alloc_shared([ROWS], f32)
            denom_shared = T.alloc_shared([ROWS], f32)
            last_flag = T.alloc_shared([1], "int32")

            kv_ready = T.alloc_barrier([WG] * stages)  # producer's cp.async landed (one arrival per thread)
            kv_free = T.alloc_barrier([2 * WG] * stages)  # both consumers are done with the stage
            p_ready = T.alloc_barrier(WG)  # P and the rescale factors of a tile are in shared memory
            p_free = T.alloc_barrier(WG)  # warp group 1 has read them
            stats_ready = T.alloc_barrier(WG)  # a pass's row sums are in shared memory
            stats_free = T.alloc_barrier(WG)  # warp group 1 has read them
            published = T.alloc_barrier(2 * WG)  # every consumer thread wrote (and fenced) its split partial
            flag_ready = T.alloc_barrier(1)  # the semaphore's previous count is in last_flag

            # Warp group 0: scores and softmax state, its half of O.
            acc_s = T.alloc_fragment([ROWS, block_n], f32)
            acc_o_l = T.alloc_fragment([ROWS, HALF], f32)
            row_max = T.alloc_fragment([ROWS], f32)
            row_max_prev = T.alloc_fragment([ROWS], f32)
            row_max_safe = T.alloc_fragment([ROWS], f32)
            rescale = T.alloc_fragment([ROWS], f32)
            row_sum = T.alloc_fragment([ROWS], f32)
            denom = T.alloc_fragment([ROWS], f32)
            # Warp group 1: its half of O, and what it reads back of warp group 0's state.
            acc_o_r = T.alloc_fragment([ROWS, HALF], f32)
            denom_r = T.alloc_fragment([ROWS], f32)
            row_max_r = T.alloc_fragment([ROWS], f32)
            weight_r = T.alloc_fragment([ROWS], f32)

            kv_begin = T.alloc_var("int32", init=kv_indptr[seq_id])
            kv_len = T.alloc_var("int32", init=kv_indptr[seq_id + 1] - kv_indptr[seq_id])
            q_begin = T.alloc_var("int32", init=qo_indptr[seq_id])
            q_len = T.alloc_var("int32", init=qo_indptr[seq_id + 1] - qo_indptr[seq_id])
            hg = rt // q_slots
            q_slot = rt % q_slots
            # Split s covers tokens [s * chunk, (s + 1) * chunk), a multiple of block_n.
            span = T.alloc_var("int32", init=steps.split_chunk(kv_len, num_splits, block_n))
            split_lo = T.alloc_var("int32", init=split_id * span)
            split_hi = T.alloc_var("int32", init=T.min(split_lo + span, kv_len))
            num_tiles = T.alloc_var("int32", init=steps.tile_count(split_lo, split_hi, block_n))
            # Every pass walks ceil(num_tiles / stages) rounds of all stages: the stage of a tile is static and a
            # round's ring parity is (pass * rounds + round) & 1.
            rounds = T.alloc_var("int32", init=T.ceildiv(num_tiles, stages))
            # Pass p serves queries [(p * q_slots + q_slot) * q_group, ... + q_group) of the sequence.
            num_passes = T.alloc_var(
                "int32", init=T.ceildiv(T.max(q_len - q_slot * q_group, 0), q_slots * q_group)
            )

            tx = T.get_thread_binding()
            st = SimpleNamespace(
                Q=Q, KV_l=KV_l, KV_r=KV_r, K_rope=K_rope, Q_l=Q_l, Q_r=Q_r, Q_rope=Q_rope, P_shared=P_shared,
                rescale_shared=rescale_shared, denom_shared=denom_shared, last_flag=last_flag, kv_ready=kv_ready,
                kv_free=kv_free, p_ready=p_ready, p_free=p_free, stats_ready=stats_ready, stats_free=stats_free,
                published=published, flag_ready=flag_ready, acc_s=acc_s, acc_o=acc_o_l, row_max=row_max,
                row_max_prev=row_max_prev, row_max_safe=row_max_safe, rescale=rescale, row_sum=row_sum, denom=denom,
                acc_o_r=acc_o_r, denom_r=denom_r, row_max_r=row_max_r, weight_r=weight_r, kv_begin=kv_begin,
                kv_len=kv_len, q_begin=q_begin, q_len=q_len, hg=hg, q_slot=q_slot, split_lo=split_lo,
                split_hi=split_hi, num_tiles=num_tiles, rounds=rounds, num_passes=num_passes, tx=tx, rt=rt,
                seq_id=seq_id, split_id=split_id, Semaphores=Semaphores,
            )
            if tx < WG:
                softmax_consumer(st, sm_scale, O_partial, LSE_partial, Out, LSE, num_splits)
            elif tx < 2 * WG:
                pv_consumer(st, O_partial, LSE_partial, Out, LSE, num_splits)
            else:
                producer(st, KV, Page_table)

    if cfg.page_size:

        @T.prim_func
        def mla_decode_rows_paged(
            Q: T.Tensor([total_q, heads, QK_DIM], bf16),
            KV: T.Tensor([cache_rows, QK_DIM], bf16),
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
            body(Q, KV, qo_indptr, kv_indptr, Page_table, sm_scale, num_splits, O_partial, LSE_partial, Semaphores, Out, LSE)

        return mla_decode_rows_paged

    @T.prim_func
    def mla_decode_rows(
        Q: T.Tensor([total_q, heads, QK_DIM], bf16),
        KV: T.Tensor([cache_rows, QK_DIM], bf16),
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
        body(Q, KV, qo_indptr, kv_indptr, None, sm_scale, num_splits, O_partial, LSE_partial, Semaphores, Out, LSE)

    return mla_decode_rows
