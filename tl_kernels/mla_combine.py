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

    @property
    def name(self) -> str:
        return f"mla_combine_h{self.num_heads}_t{self.threads}"


def mla_combine_kernel(cfg: CombineKernelConfig):
    """Returns the prim_func of the combine kernel for ``cfg``.

    Arguments (all dynamic dims symbolic):
      O_partial    (num_splits, total_q, num_heads, 512) fp32
      LSE_partial  (num_splits, total_q, num_heads) fp32, base 2, -inf for an empty split
      Out          (total_q, num_heads, 512) bf16
      LSE          (total_q, num_heads) fp32, natural log; -inf where no KV token was visible (Out is 0 there)
    """
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
