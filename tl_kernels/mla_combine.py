"""Combine step of split-KV decode: merge per-split partial outputs by their log-sum-exp.

For one (query token, head): with split LSEs l_s (base 2) and partial outputs o_s (each already normalised by its
own softmax denominator), the exact result is  sum_s 2^(l_s - L) o_s  with  L = log2(sum_s 2^l_s).
An empty split (no KV token, or none visible) has l_s = -inf and wrote no o_s: it is skipped, not read.
"""

from dataclasses import dataclass

import tilelang.language as T

from tl_kernels import steps
from tl_kernels.steps import KV_LORA_RANK, LN2, MERGE_SPLITS


@dataclass(frozen=True)
class CombineKernelConfig:
    """Everything that changes the generated code of the combine kernel."""

    num_heads: int = 16
    threads: int = 128
    split_lanes: int = 1  # flash form: threads that share one 4-dim chunk, each taking every split_lanes-th split
    # (the output row then spread over split_lanes CTAs of 512 / split_lanes dims): many splits per row take 4,
    # so a row's loads are all issued in one round over 4x the CTAs; few splits take 1 (no exchange, 4x fewer CTAs)
    flash_io: bool = False  # FlashMLA's shapes and the split count of each sequence read from Num_splits (the
    # partner of the decode kernel's ``split_counts`` form): flat partials, Out (batch, s_q, H, 512), LSE (batch, H,
    # s_q) with +inf where nothing is seen; a sequence of one split is skipped (its decode CTA wrote it)

    @property
    def name(self) -> str:
        lanes = f"_l{self.split_lanes}" if self.split_lanes > 1 else ""
        return f"mla_combine_h{self.num_heads}_t{self.threads}{'_flash' if self.flash_io else ''}{lanes}"

    def __post_init__(self):
        if self.split_lanes not in (1, 2, 4) or (self.split_lanes > 1 and not self.flash_io):
            raise ValueError(f"split_lanes must be 1, 2 or 4 (flash form only), got {self.split_lanes}")
        if self.flash_io and self.threads != FLASH_THREADS:
            raise ValueError(f"the flash form runs {FLASH_THREADS} threads (a 4-dim chunk per thread and lane)")


def mla_combine_kernel(cfg: CombineKernelConfig):
    """Returns the prim_func of the combine kernel for ``cfg``.

    Arguments (all dynamic dims symbolic):
      O_partial    (num_splits, total_q, num_heads, 512) fp32
      LSE_partial  (num_splits, total_q, num_heads) fp32, base 2, -inf for an empty split
      Out          (total_q, num_heads, 512) bf16
      LSE          (total_q, num_heads) fp32, natural log; -inf where no KV token was visible (Out is 0 there)
    flash_io: O_partial (o_len,), LSE_partial (l_len,) flat (split, batch * s_q, num_heads[, 512]), Num_splits
      (batch + 1,) int32 cumulative split counts, max_splits int32 (the partials' split dimension), Out (batch, s_q,
      num_heads, 512) bf16, LSE (batch, num_heads, s_q) fp32 with +inf where nothing was visible.
    """
    if cfg.flash_io:
        return _flash_combine(cfg)
    heads = cfg.num_heads
    accum_dtype = "float32"
    total_q = T.dynamic("total_q")
    num_splits = T.dynamic("num_splits")

    @T.prim_func
    def mla_combine(
        O_partial: T.Tensor([num_splits, total_q, heads, KV_LORA_RANK], accum_dtype),
        LSE_partial: T.Tensor([num_splits, total_q, heads], accum_dtype),
        Out: T.Tensor([total_q, heads, KV_LORA_RANK], "bfloat16"),
        LSE: T.Tensor([total_q, heads], accum_dtype),
    ):
        with T.Kernel(total_q, heads, threads=cfg.threads) as (q, h):
            acc = T.alloc_fragment([KV_LORA_RANK], accum_dtype)
            lse_max = T.alloc_var(accum_dtype, init=-T.infinity(accum_dtype))
            weight_sum = T.alloc_var(accum_dtype, init=0)
            weight = T.alloc_var(accum_dtype, init=0)

            # Pass 1: the largest split LSE, so every weight 2^(l_s - max) is <= 1.
            for s in T.serial(num_splits):
                lse_max = T.max(lse_max, LSE_partial[s, q, h])
            # Pass 2: weighted sum of the non-empty splits' partial outputs.
            T.clear(acc)
            for s in T.serial(num_splits):
                if LSE_partial[s, q, h] > -T.infinity(accum_dtype):
                    weight = T.exp2(LSE_partial[s, q, h] - lse_max)
                    weight_sum = weight_sum + weight
                    for d in T.Parallel(KV_LORA_RANK):
                        acc[d] += weight * O_partial[s, q, h, d]
            # Normalise; nothing visible at all gives output 0 and LSE -inf.
            for d in T.Parallel(KV_LORA_RANK):
                Out[q, h, d] = T.cast(T.if_then_else(weight_sum > 0, acc[d] / weight_sum, 0), "bfloat16")
            LSE[q, h] = T.if_then_else(weight_sum > 0, (T.log2(weight_sum) + lse_max) * LN2, -T.infinity(accum_dtype))

    return mla_combine


# The flash form's work split: a CTA per (output row, split_lanes-th of its 512 dims); in it, split_lanes adjacent
# threads share each 4-dim chunk, lane l taking splits l, l + split_lanes, ... and issuing MERGE_SPLITS of them
# (their LSEs and chunks; as the fused merge, ``steps.merge_splits``) before it adds any. With 4 lanes a row of 32 splits is one round of loads per thread,
# where a CTA per row walking the splits one by one waited on a load (and on a branch on its LSE) per split.
FLASH_THREADS = 128  # KV_LORA_RANK // 4 chunks per row, over split_lanes CTAs, times split_lanes lanes


def _flash_combine(cfg: CombineKernelConfig):
    """The combine in FlashMLA's shapes over a per-sequence split count (see ``mla_combine_kernel``). CUDA only (its
    loads and stores are ``steps.MERGE_CUDA_SOURCE``'s): the graph form is Hopper's."""
    heads, f32 = cfg.num_heads, "float32"
    batch, s_q = T.dynamic("batch, s_q")
    o_len, l_len = T.dynamic("o_len"), T.dynamic("l_len")
    total_q = batch * s_q
    lanes = cfg.split_lanes
    block_dims = KV_LORA_RANK // lanes  # dims per CTA
    neg_inf = -T.infinity(f32)

    @T.prim_func
    def mla_combine_flash(
        O_partial: T.Tensor([o_len], f32),
        LSE_partial: T.Tensor([l_len], f32),
        Num_splits: T.Tensor([batch + 1], "int32"),
        max_splits: T.int32,
        Out: T.Tensor([batch, s_q, heads, KV_LORA_RANK], "bfloat16"),
        LSE: T.Tensor([batch, heads, s_q], f32),
    ):
        with T.Kernel(total_q * heads, lanes, threads=FLASH_THREADS) as (row, dim_block):
            lse = T.alloc_local([MERGE_SPLITS], f32)  # a group's split LSEs (-inf: past the count, or empty)
            stage = T.alloc_local([MERGE_SPLITS * 4], f32)  # a group's partial chunks
            acc = T.alloc_local([4], f32)  # this thread's splits' weighted sum of its chunk
            run_max = T.alloc_local([2], f32)  # running max LSE of this thread's splits; a group's max
            denom = T.alloc_local([1], f32)  # running sum of weights
            share = T.alloc_shared([FLASH_THREADS, 6], f32) if lanes > 1 else None  # (max, denom, acc[4]) a thread
            T.import_source(steps.MERGE_CUDA_SOURCE)
            tx = T.get_thread_binding()
            lane, chunk = tx % lanes, tx // lanes
            q, h = row // heads, row % heads
            seq = q // s_q
            d = dim_block * block_dims + chunk * 4
            splits = T.alloc_var("int32", init=T.max(T.min(Num_splits[seq + 1] - Num_splits[seq], max_splits), 1))
            # One split: the decode kernel wrote this row's output and LSE itself.
            if splits > 1:
                run_max[0] = neg_inf
                denom[0] = 0
                for j in T.unroll(4):
                    acc[j] = 0
                for group in T.serial(T.ceildiv(splits, lanes * MERGE_SPLITS)):
                    # The group's loads, all issued before any is used.
                    for g in T.unroll(MERGE_SPLITS):
                        sp = (group * MERGE_SPLITS + g) * lanes + lane
                        lse[g] = neg_inf
                        if sp < splits:
                            lse[g] = steps.merge_load(LSE_partial, (sp * total_q + q) * heads + h)
                            T.call_extern("handle", "mla_merge_load4", stage.access_ptr("w", offset=g * 4),
                                          O_partial.access_ptr("r", offset=((sp * total_q + q) * heads + h)
                                                               * KV_LORA_RANK + d))
                    run_max[1] = run_max[0]
                    for g in T.unroll(MERGE_SPLITS):
                        run_max[1] = T.max(run_max[1], lse[g])
                    # Nothing seen so far (all -inf): keep the zeros, so no (-inf) - (-inf). An empty split wrote
                    # no partial: its chunk is never read into the sum.
                    if run_max[1] != neg_inf:
                        rescale = T.exp2(run_max[0] - run_max[1])
                        denom[0] = denom[0] * rescale
                        for j in T.unroll(4):
                            acc[j] = acc[j] * rescale
                        for g in T.unroll(MERGE_SPLITS):
                            seen = lse[g] != neg_inf
                            weight = T.if_then_else(seen, T.exp2(lse[g] - run_max[1]), 0)
                            denom[0] = denom[0] + weight
                            for j in T.unroll(4):
                                acc[j] = acc[j] + T.if_then_else(seen, weight * stage[g * 4 + j], 0)
                        run_max[0] = run_max[1]
                if lanes > 1:
                    # The lanes of a chunk meet in shared memory; the first writes the chunk.
                    share[tx, 0] = run_max[0]
                    share[tx, 1] = denom[0]
                    for j in T.unroll(4):
                        share[tx, 2 + j] = acc[j]
                    T.sync_threads()
                    if lane == 0:
                        run_max[1] = share[tx, 0]
                        for i in T.unroll(1, lanes):
                            run_max[1] = T.max(run_max[1], share[tx + i, 0])
                        denom[0] = 0
                        for j in T.unroll(4):
                            acc[j] = 0
                        if run_max[1] != neg_inf:
                            for i in T.unroll(lanes):
                                weight = T.if_then_else(share[tx + i, 0] != neg_inf,
                                                        T.exp2(share[tx + i, 0] - run_max[1]), 0)
                                denom[0] = denom[0] + weight * share[tx + i, 1]
                                for j in T.unroll(4):
                                    acc[j] = acc[j] + weight * share[tx + i, 2 + j]
                else:
                    run_max[1] = run_max[0]
                if lane == 0:
                    T.call_extern("handle", "mla_merge_store4",
                                  Out.access_ptr("w", offset=(q * heads + h) * KV_LORA_RANK + d),
                                  acc.access_ptr("r", offset=0), T.if_then_else(denom[0] > 0, 1.0 / denom[0], 0))
                    if d == 0:
                        LSE[seq, h, q % s_q] = T.if_then_else(denom[0] > 0, (T.log2(denom[0]) + run_max[1]) * LN2,
                                                              T.infinity(f32))

    return mla_combine_flash
