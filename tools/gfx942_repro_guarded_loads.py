"""Reproducer (TileLang 0.1.15, HIP): a gather load whose row TileLang cannot prove in range is wrapped in a branch.

The smallest program of the pattern the gfx942 decode kernel needs: each thread loads 16 bytes of a row it computed
(clamped into the tensor by ``T.min``/``T.max``, so always in range) into registers. TileLang's bounds-check
legalisation cannot prove ``0 <= row < n`` through the clamp of a runtime value and emits

    if (0 <= row && row < n) { condval = *(uint4*)(A + ...); } else { condval = make_uint4(0, ...); }

per load. On gfx942 the compiler then waits for each such load where the branches join (``s_waitcnt vmcnt(0)``), so
a tile's loads are serialised instead of in flight together. The kernel (``tl_kernels/mla_decode.py``, dim_split)
routes around it by loading through ``buffer.access_ptr(...)`` and a 16-byte copy helper (``T.import_source``),
which the legalisation does not touch; disabling the pass (``tl.disable_safe_memory_legalize``) would also do, but it
is a compile-wide switch that the project's JIT does not set per kernel.

Run: ``python tools/gfx942_repro_guarded_loads.py`` (lowering only: no GPU, no ROCm). Prints both HIP bodies.
"""

import tilelang
import tilelang.language as T
from tvm import target as tvm_target

TARGET = {"kind": "hip", "mcpu": "gfx942"}


def gather(use_access_ptr: bool):
    n, m = T.dynamic("n"), T.dynamic("m")

    @T.prim_func
    def main(A: T.Tensor([n, 64], "bfloat16"), Rows: T.Tensor([m], "int32"), Out: T.Tensor([m, 64], "bfloat16")):
        with T.Kernel(T.ceildiv(m, 8), threads=64) as bx:
            if use_access_ptr:
                T.import_source("static __device__ inline void copy16(void* d, const void* s) "
                                "{ *(uint4*)d = *(const uint4*)s; }")
            tx = T.get_thread_binding()
            regs = T.alloc_local([8], "bfloat16")
            i = T.min(bx * 8 + tx // 8, m - 1)
            row = T.max(T.min(Rows[i], n - 1), 0)  # clamped into A
            if use_access_ptr:
                T.evaluate(T.call_extern("handle", "copy16", T.address_of(regs[0]),
                                         A.access_ptr("r", offset=row * 64 + (tx % 8) * 8)))
            else:
                for v in T.vectorized(8):
                    regs[v] = A[row, (tx % 8) * 8 + v]
            for v in T.vectorized(8):
                Out[i, (tx % 8) * 8 + v] = regs[v]

    return main


if __name__ == "__main__":
    for use_access_ptr in (False, True):
        with tvm_target.Target(TARGET):
            src = str(tilelang.lower(gather(use_access_ptr), target=TARGET).kernel_source)
        body = src[src.index("__global__"):]
        print(f"----- {'access_ptr + copy helper' if use_access_ptr else 'plain T.vectorized load'}: "
              f"{'GUARDED' if 'row < n' in body else 'unconditional'} load of A")
        print(body)
