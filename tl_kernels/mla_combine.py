"""Combine step of split-KV decode: merge per-split partial outputs by their log-sum-exp.

For one (query token, head): with split LSEs l_s (base 2) and partial outputs o_s (each already normalised by its
own softmax denominator), the exact result is  sum_s 2^(l_s - L) o_s  with  L = log2(sum_s 2^l_s).
An empty split (no KV token, or none visible) has l_s = -inf and wrote no o_s: it is skipped, not read.
"""

from dataclasses import dataclass

import tilelang.language as T

from tl_kernels.mla_decode import KV_LORA_RANK

LN2 = 0.6931471805599453  # ln(2): converts a base-2 LSE to natural log


@dataclass(frozen=True)
class CombineKernelConfig:
    """Everything that changes the generated code of the combine kernel."""

    num_heads: int = 16
    threads: int = 128
    flash_io: bool = False  # FlashMLA's shapes and the split count of each sequence read from Num_splits (the
    # partner of the decode kernel's ``split_counts`` form): flat partials, Out (batch, s_q, H, 512), LSE (batch, H,
    # s_q) with +inf where nothing is seen; a sequence of one split is skipped (its decode CTA wrote it)

    @property
    def name(self) -> str:
        return f"mla_combine_h{self.num_heads}_t{self.threads}{'_flash' if self.flash_io else ''}"


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


def _flash_combine(cfg: CombineKernelConfig):
    """The combine in FlashMLA's shapes over a per-sequence split count (see ``mla_combine_kernel``)."""
    heads, f32 = cfg.num_heads, "float32"
    batch, s_q = T.dynamic("batch, s_q")
    o_len, l_len = T.dynamic("o_len"), T.dynamic("l_len")
    total_q = batch * s_q

    @T.prim_func
    def mla_combine_flash(
        O_partial: T.Tensor([o_len], f32),
        LSE_partial: T.Tensor([l_len], f32),
        Num_splits: T.Tensor([batch + 1], "int32"),
        max_splits: T.int32,
        Out: T.Tensor([batch, s_q, heads, KV_LORA_RANK], "bfloat16"),
        LSE: T.Tensor([batch, heads, s_q], f32),
    ):
        with T.Kernel(total_q, heads, threads=cfg.threads) as (q, h):
            acc = T.alloc_fragment([KV_LORA_RANK], f32)
            lse_max = T.alloc_var(f32, init=-T.infinity(f32))
            weight_sum = T.alloc_var(f32, init=0)
            weight = T.alloc_var(f32, init=0)
            seq = q // s_q
            splits = T.alloc_var("int32", init=T.max(T.min(Num_splits[seq + 1] - Num_splits[seq], max_splits), 1))
            # One split: the decode kernel wrote this row's output and LSE itself.
            if splits > 1:
                # Pass 1: the largest split LSE; pass 2: the weighted sum of the splits that saw a token.
                for s in T.serial(splits):
                    lse_max = T.max(lse_max, LSE_partial[(s * total_q + q) * heads + h])
                T.clear(acc)
                for s in T.serial(splits):
                    if LSE_partial[(s * total_q + q) * heads + h] > -T.infinity(f32):
                        weight = T.exp2(LSE_partial[(s * total_q + q) * heads + h] - lse_max)
                        weight_sum = weight_sum + weight
                        for d in T.Parallel(KV_LORA_RANK):
                            acc[d] += weight * O_partial[((s * total_q + q) * heads + h) * KV_LORA_RANK + d]
                for d in T.Parallel(KV_LORA_RANK):
                    Out[seq, q % s_q, h, d] = T.cast(T.if_then_else(weight_sum > 0, acc[d] / weight_sum, 0),
                                                     "bfloat16")
                LSE[seq, h, q % s_q] = T.if_then_else(weight_sum > 0, (T.log2(weight_sum) + lse_max) * LN2,
                                                      T.infinity(f32))

    return mla_combine_flash
