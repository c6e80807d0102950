"""Python cost of one op call, without a GPU: ``mla_decode`` and ``DecodePlan.run`` with the target forced to sm_90a,
the kernels replaced by no-op launchers and the tensors on the ``meta`` device (shape-only: allocating and viewing
them costs what it costs on the host, no data is touched). What it measures is the host work the op adds around
its kernel launches (validation, schedule lookup, allocations, argument packing): on the GPU host a real launch
adds the tvm-ffi call itself (about 3-5 us per kernel) and CUDA allocations cost a little more than meta ones.

    python tools/host_cost.py                       # every mode, flat and paged (page 64), eager and plan, 4 x 1024
    python tools/host_cost.py --calls 20000 --batch 64 --kv-len 8192
    python tools/host_cost.py --profile bf16        # cProfile of the eager bf16 call (top 25 by own time)

Each line: the median over 5 rounds of (wall time of ``--calls`` back-to-back calls / calls), in us.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("MLA_TARGET", "sm_90a")

import torch  # noqa: E402

from mla import jit  # noqa: E402
from mla.constants import MODES  # noqa: E402

DEVICE = "meta"
ROUNDS = 5


def no_op_launcher(cfg, spec):
    """Stands in for ``jit.get_launcher``: a launcher that takes the kernel's positional arguments and does nothing."""
    return lambda *args: None


def inputs(mode: str, batch: int, kv_len: int, heads: int, page_size: int):
    """(q, kv cache, qo_indptr, kv_indptr, cache keywords, page table or None) on the meta device."""
    kv_format, q_format = MODES[mode]
    total_kv = batch * kv_len
    q = torch.empty(batch, heads, 576, dtype=torch.bfloat16, device=DEVICE)
    qo = torch.empty(batch + 1, dtype=torch.int32, device=DEVICE)
    kvp = torch.empty(batch + 1, dtype=torch.int32, device=DEVICE)
    row = 288 if kv_format == "mxfp4" else 576
    dtype = {"bf16": torch.bfloat16, "fp8": torch.float8_e4m3fn, "mxfp4": torch.uint8}[kv_format]
    shape = (total_kv // page_size, page_size, 1, row) if page_size else (total_kv, 1, row)
    kv = torch.empty(shape, dtype=dtype, device=DEVICE)
    kwargs = dict(kv_format=kv_format, q_format=q_format)
    if kv_format == "fp8":
        kwargs["kv_scale"] = torch.empty(1, dtype=torch.float32, device=DEVICE)
    if kv_format == "mxfp4":
        kwargs["kv_block_scale"] = torch.empty(total_kv, 18, dtype=torch.uint8, device=DEVICE)
    table = None
    if page_size:
        table = torch.empty(batch, -(-kv_len // page_size), dtype=torch.int32, device=DEVICE)
    return q, kv, qo, kvp, kwargs, table


def per_call_us(fn, calls: int) -> float:
    for _ in range(min(calls, 200)):  # warm-up: builds the caches
        fn()
    rounds = []
    for _ in range(ROUNDS):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        rounds.append((time.perf_counter() - start) / calls * 1e6)
    return statistics.median(rounds)


def callables(mode: str, args, page_size: int):
    """{"eager": the mla_decode call, "plan": the DecodePlan.run call} for one mode."""
    from mla.decode import mla_decode, plan

    q, kv, qo, kvp, kwargs, table = inputs(mode, args.batch, args.kv_len, args.heads, page_size)
    kv_lens = [args.kv_len] * args.batch
    offsets = [i * args.kv_len for i in range(args.batch + 1)]
    paging = dict(page_size=page_size, page_table=table) if page_size else {}
    the_plan = plan(list(range(args.batch + 1)), offsets, num_heads=args.heads, kv_format=kwargs["kv_format"],
                    q_format=kwargs["q_format"], device=DEVICE, **paging)
    assert the_plan.batch == len(kv_lens)
    run_kwargs = {k: v for k, v in kwargs.items() if k in ("kv_scale", "kv_block_scale")}

    def eager():
        return mla_decode(q, kv, qo, kvp, page_table=table, **kwargs)

    def planned():
        return the_plan.run(q, kv, **run_kwargs)

    return {"eager": eager, "plan": planned}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--kv-len", type=int, default=1024)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--page-size", type=int, default=64, help="page size of the paged rows (0: flat only)")
    parser.add_argument("--calls", type=int, default=5000)
    parser.add_argument("--profile", metavar="MODE", help="cProfile the eager call of MODE instead")
    args = parser.parse_args(argv)
    jit.get_launcher = no_op_launcher  # before the op's first call: every kernel it selects is a no-op
    if args.profile:
        import cProfile
        import pstats

        fn = callables(args.profile, args, 0)["eager"]
        per_call_us(fn, 200)
        profiler = cProfile.Profile()
        profiler.enable()
        for _ in range(args.calls):
            fn()
        profiler.disable()
        pstats.Stats(profiler).sort_stats("tottime").print_stats(25)
        return 0
    print(f"host cost per call, us (meta tensors, no-op launchers; batch {args.batch} x kv {args.kv_len}, "
          f"{args.heads} heads, median of {ROUNDS} x {args.calls} calls)")
    print(f"  {'mode':<6} {'layout':<8} {'eager':>8} {'plan':>8}")
    for mode in args.modes.split(","):
        for page_size in (0, args.page_size) if args.page_size else (0,):
            fns = callables(mode, args, page_size)
            eager, planned = per_call_us(fns["eager"], args.calls), per_call_us(fns["plan"], args.calls)
            layout = f"page{page_size}" if page_size else "flat"
            print(f"  {mode:<6} {layout:<8} {eager:8.2f} {planned:8.2f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
