"""a8w8's amax(|Q|) in one launch of our own, for the calls whose decode kernel does not reduce it itself (every grid
that is not fused: the fused kernels have a grid barrier, ``steps.reduce_amax``).

torch's reduction (``torch.linalg.vector_norm(q, ord=inf)``) took 6.9 µs of GPU time at 32 x 1024 on a cold Q
(docs/perf.md, run 52, H100): about a third of the decode it feeds. Here a fixed grid of ``ctas`` CTAs each takes an
equal share of Q's 16-byte vectors (all of a thread's loads in flight before it reduces them), writes its maximum
into its own partial, and counts itself in a ticket; the CTA that takes the last ticket reads every partial through
L2 and writes the amax, then puts the ticket back to zero for the next call (calls on one stream are ordered). The
maximum is taken on the bits of |x| as int32 (for x >= 0 their order is the floats'; a NaN's bits exceed inf's, so
a NaN wins as in torch's amax): the same amax as torch's, bit for bit.
"""

from dataclasses import dataclass

import tilelang.language as T

from tl_kernels import steps
from tl_kernels.steps import AMAX_UNROLL, AMAX_VECTOR, QK_DIM
AMAX_CTAS = 64  # the grid (and the partials' length): enough CTAs that a cold Q's loads are in flight at once on
# the harness's sizes (32 x 1024: 36864 vectors, 576 a CTA)


@dataclass(frozen=True)
class AmaxKernelConfig:
    """Everything that changes the generated code of the amax kernel."""

    num_heads: int = 16
    ctas: int = AMAX_CTAS
    threads: int = 256

    def __post_init__(self):
        if not 1 <= self.ctas <= self.threads:
            raise ValueError(f"ctas must be in [1, threads] (the last CTA reads one partial per thread), got "
                             f"{self.ctas} with {self.threads} threads")

    @property
    def name(self) -> str:
        return f"mla_amax_h{self.num_heads}_c{self.ctas}_t{self.threads}"


def mla_amax_kernel(cfg: AmaxKernelConfig):
    """Returns the prim_func of the amax kernel for ``cfg``.

    Arguments (dynamic dims symbolic):
      Q           (total_q, num_heads, 576) bf16, contiguous
      Amax        (1,) fp32: amax(|Q|) (written)
      Partials    (ctas,) int32: CTA c's maximum as the bits of a float (scratch: written before it is read)
      Ticket      (1,) fp32, zero before the call and after it (the CTAs count themselves in it)
    """
    f32, i32, bf16 = "float32", "int32", "bfloat16"
    ctas, threads, heads = cfg.ctas, cfg.threads, cfg.num_heads
    total_q = T.dynamic("total_q")

    @T.prim_func
    def mla_amax(
        Q: T.Tensor([total_q, heads, QK_DIM], bf16),
        Amax: T.Tensor([1], f32),
        Partials: T.Tensor([ctas], i32),
        Ticket: T.Tensor([1], f32),
    ):
        with T.Kernel(ctas, threads=threads) as cta:
            vals = T.alloc_local([AMAX_UNROLL * AMAX_VECTOR], bf16)
            cta_bits = T.alloc_shared([1], i32)
            last = T.alloc_shared([1], f32)
            tx = T.get_thread_binding()
            # Stage 1: this CTA's maximum (the fused decode kernels' own reduction: ``steps.cta_amax_bits``).
            steps.cta_amax_bits(Q, heads, total_q, threads, ctas, cta, tx, cta_bits, vals)
            # Stage 2: the CTA's maximum into its partial, then its ticket (the partial fenced before it).
            if tx == 0:
                Partials[cta] = cta_bits[0]
                T.call_extern("handle", "__threadfence")
                last[0] = T.atomic_add(Ticket[0], T.float32(1), return_prev=True)
            T.sync_threads()
            # Stage 3: the last CTA reads every partial through L2 (an atomic max with 0 of values >= 0: a read that
            # never meets a stale L1 line) and writes the amax; the ticket goes back to zero.
            if last[0] == T.float32(ctas - 1):
                T.call_extern("handle", "__threadfence")
                if tx == 0:
                    cta_bits[0] = 0
                T.sync_threads()
                if tx < ctas:
                    T.atomic_max(cta_bits[0], T.atomic_max(Partials[tx], 0, return_prev=True))
                T.sync_threads()
                if tx == 0:
                    Amax[0] = T.reinterpret(cta_bits[0], f32)
                    Ticket[0] = T.float32(0)

    return mla_amax
