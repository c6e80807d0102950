"""GPU time of the split merge: the fused merge of the sm_90a decode kernel (``fused_combine``, forced) against the
decode + combine kernels (forced), through a plan, per split count (docs/perf.md, runs 17-19). GPU host only; a
fused cell whose grid does not fit the GPU at once (``schedule.fused_fits``) shows "-".

    python tools/merge_bench.py                                  # bf16, 16 heads, the run-17 shapes
    python tools/merge_bench.py --mode mxfp4 --shapes 4x1024,64x8192 --splits 1,4,8
    ncu --kernel-name regex:fused -c 1 python tools/merge_bench.py --shapes 4x1024 --splits 8 --calls 1

Each entry: the mean GPU time per call of ``--calls`` calls queued behind a sleep kernel (CUDA events around
them), in us; each plan is made once, untimed. Run 17's measurement (made there by a scratch script of the same
calls); this file ran on the H200 in run 18 (docs/perf.md).
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

import bench  # noqa: E402
from mla.constants import MODES  # noqa: E402
from mla.decode import plan  # noqa: E402
from mla.harness import harness_cache  # noqa: E402
from mla.inputs import make_harness_inputs  # noqa: E402

FUSED = {"fused_combine": True}
TWO_KERNELS = {"fused_combine": False}


def gpu_us_per_call(fn, calls: int, cycles_per_us: float) -> float:
    """GPU time per call of ``calls`` calls queued behind a sleep kernel (``bench.gpu_us_per_call``), after a
    warm-up; the sleep allows 150 us of host time per call."""
    for _ in range(3):
        fn()
    return bench.gpu_us_per_call(fn, calls, 150.0, cycles_per_us)["gpu_us"]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mode", choices=list(MODES), default="bf16")
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--shapes", type=bench.parse_shapes, default=bench.parse_shapes("4x1024,32x1024,4x8192,64x8192"))
    parser.add_argument("--splits", default="default,1,4,8,16", help="split counts ('default': the schedule's)")
    parser.add_argument("--calls", type=int, default=100)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("merge_bench: needs a CUDA GPU (sm_90a)")
        return 1
    cycles_per_us = bench.sleep_cycles_per_us()
    counts = [None if s == "default" else int(s) for s in args.splits.split(",")]
    print(f"{args.mode}, {args.heads} heads: GPU us per call, fused merge | decode + combine (splits used)")
    for batch, kv_len in args.shapes:
        q, kv_data, qo_indptr, kv_indptr, _ = make_harness_inputs(batch, kv_len, num_heads=args.heads, seed=1,
                                                                  device="cuda")
        kv, cache_kwargs = harness_cache(kv_data, args.mode)
        kv_format, q_format = cache_kwargs.pop("kv_format"), cache_kwargs.pop("q_format")
        cells = []
        for num_splits in counts:
            times = []
            for overrides in (FUSED, TWO_KERNELS):
                try:
                    p = plan(qo_indptr, kv_indptr, num_heads=args.heads, kv_format=kv_format, q_format=q_format,
                             num_splits=num_splits, config_overrides=overrides, device="cuda")
                except ValueError:  # a fused grid larger than the GPU (schedule.fused_fits)
                    times.append("-")
                    continue
                times.append(f"{gpu_us_per_call(lambda: p.run(q, kv, **cache_kwargs), args.calls, cycles_per_us):.1f}"
                             f" ({p.num_splits})")
            cells.append(f"{'default' if num_splits is None else num_splits}: {times[0]} | {times[1]}")
        print(f"  {batch}x{kv_len}  " + "   ".join(cells), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
