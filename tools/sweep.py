"""Tuning sweep: time kernel-config variants (block_n, threads, staging) and split counts side by side, in one
GPU run, each checked against the fp32 reference. Without a GPU, ``--compile-only`` builds every variant (fill
TILELANG_CACHE_DIR on the CPU box, carry it to the GPU host).

    python tools/sweep.py --compile-only          # CPU box
    python tools/sweep.py --json sweep.json       # GPU: one line per (mode, shape, variant)
    python tools/sweep.py --serving [--compile-only]   # MTP (q_len 2, 4) and 64 / 128 heads instead
"""

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

import bench  # noqa: E402
from mla import jit, schedule  # noqa: E402
from mla.decode import run_harness  # noqa: E402
from mla.target import spec_for_name  # noqa: E402

SHAPES = [(4, 1024), (64, 8192), (256, 8192)]
SPLIT_SWEEP = False  # run 3 fitted the split model; set True to sweep split counts again
SPLIT_SHAPES = [(4, 1024), (4, 8192), (32, 1024), (32, 8192), (64, 1024)]
SPLIT_COUNTS = [1, 2, 4, 8, 16, 32, 64]


def variants(mode: str) -> list[dict]:
    """Config overrides to try for a mode (the first is the current default). Run 3 settled staging (off) and
    the grouped pipeline (no gain); run 4 compares the MMA orientation. (block_n 128 with the KV tile as M does
    not lower in TileLang 0.1.15: its reduce over the token axis rejects two 64-row wgmma blocks.)"""
    kv_rows_as_m = [
        dict(kv_rows_as_m=True, block_n=64, threads=128),
        dict(kv_rows_as_m=True, block_n=64, threads=128, num_stages=2, tiles_per_group=2),
        dict(kv_rows_as_m=True, block_n=64, threads=128, num_stages=2, tiles_per_group=4),
    ]
    if mode == "a8w8":
        return [{}, kv_rows_as_m[0]]  # the fp8 sweep decides the rest
    return [{}] + kv_rows_as_m


# Serving sweep (--serving): problem (q_len, heads) -> config overrides to try, the first being the default.
# Run 11 found MTP and 128 heads at 40-55% / 29% of the read ceiling with the defaults (1 CTA per SM); run 12
# swept these (32 rows now default to block_n=32, threads=128; block_n=64, threads=256 was the default before).
SERVING_PROBLEMS = {
    (2, 16): [{}, dict(block_n=64, threads=256)],
    (1, 32): [{}, dict(block_n=64, threads=256)],
    (4, 16): [{}, dict(block_n=32), dict(block_n=32, threads=128)],
    (1, 128): [{}, dict(block_n=32), dict(block_h=32), dict(block_h=32, block_n=32, threads=128),
               dict(block_h=16, threads=128)],
    (1, 64): [{}, dict(block_n=32), dict(block_h=32, block_n=32, threads=128), dict(block_h=16, threads=128)],
}
SERVING_SHAPES = [(4, 8192), (32, 8192), (256, 8192)]
# Paged sweep (--paged): how the dequantizing kernels address a paged cache's rows. Run 12: with the row table in
# dynamic shared memory and no staging (the variants below), fp8 / mxfp4 paged were 2.9x / 4.5x slower than flat;
# the defaults since then: a static row table, and compressed tiles staged asynchronously.
PAGED_VARIANTS = [{}, dict(stage_compressed=False), dict(row_table_scope="shared.dyn", stage_compressed=False)]
PAGED_SHAPES = [(4, 1024), (32, 8192), (256, 8192)]
PAGED_SIZES = (16, 64)
SERVING_MODES = ("bf16", "fp8")


def problem_kwargs(q_len: int, heads: int) -> dict:
    return dict(num_heads=heads, q_tile=schedule.query_tile(q_len, 1))


def fits(spec, mode: str, overrides: dict, q_len: int = 1, heads: int = 16) -> bool:
    kv_format, q_format = schedule.MODES[mode]
    try:
        schedule.decode_config(spec, kv_format=kv_format, q_format=q_format, **{**problem_kwargs(q_len, heads), **overrides})
        return True
    except ValueError:
        return False


def sweep_plan(serving: bool, modes, paged: bool = False, problems=SERVING_PROBLEMS) -> list:
    """[(mode, q_len, heads, overrides)] to build and time."""
    if paged:
        return [(mode, 1, 16, dict(o, page_size=p)) for mode in modes for p in PAGED_SIZES for o in PAGED_VARIANTS]
    if not serving:
        return [(mode, 1, 16, o) for mode in modes for o in variants(mode)]
    return [(mode, q_len, heads, o) for mode in modes if mode in SERVING_MODES
            for (q_len, heads), options in problems.items() for o in options]


def compile_all(spec, plan) -> None:
    for mode, q_len, heads, overrides in plan:
        kv_format, q_format = schedule.MODES[mode]
        if not fits(spec, mode, overrides, q_len, heads):
            print("does not fit:", mode, q_len, heads, overrides, flush=True)
            continue
        for split in (True, False):
            cfg = schedule.decode_config(spec, kv_format=kv_format, q_format=q_format, split=split,
                                         **{**problem_kwargs(q_len, heads), **overrides})
            try:
                jit.get_kernel(cfg, spec)
            except Exception as exc:  # noqa: BLE001 - some tile shapes do not lower; report and go on
                print("FAILED", cfg.name, f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}", flush=True)
                continue
            print("built", cfg.name, flush=True)


def label(overrides: dict) -> str:
    return ",".join(f"{k}={v}" for k, v in overrides.items())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--compile-only", action="store_true")
    parser.add_argument("--modes", default="bf16,fp8,a8w8,mxfp4")
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--json")
    parser.add_argument("--serving", action="store_true", help="sweep MTP and head-count problems instead")
    parser.add_argument("--paged", action="store_true", help="sweep how paged caches are addressed instead")
    parser.add_argument("--problems", default=None,
                        help="with --serving: comma-separated QLENxHEADS subset of SERVING_PROBLEMS, e.g. 2x16,1x32")
    args = parser.parse_args()
    spec = spec_for_name("sm_90a")
    problems = SERVING_PROBLEMS
    if args.problems:
        keep = {tuple(int(x) for x in p.split("x")) for p in args.problems.split(",")}
        problems = {key: options for key, options in SERVING_PROBLEMS.items() if key in keep}
    plan = sweep_plan(args.serving, args.modes.split(","), args.paged, problems)
    if args.compile_only or not torch.cuda.is_available():
        compile_all(spec, plan)
        return 0
    modes = args.modes.split(",")
    flush = torch.empty(256 * 1024 * 1024, dtype=torch.uint8, device="cuda")
    rows = []

    def record(mode, shape, variant, splits, fn, ref, q_len=1, heads=16):
        try:
            out = fn()
        except Exception as exc:  # noqa: BLE001 - a variant that does not build: one line, go on
            print(f"{mode:6s} {shape[0]}x{shape[1]} q{q_len} h{heads} {variant}: FAILED {type(exc).__name__}", flush=True)
            return
        err = ((out.float() - ref).norm() / ref.norm()).item()
        times = sorted(bench.time_call_us(fn, reps=args.reps, warmup=3, flush=flush))
        time_us = times[len(times) // 2]
        gbps = bench.gbps_of(bench.bytes_moved(shape[0], shape[1], q_len, heads, mode), time_us)
        row = dict(mode=mode, shape=f"{shape[0]}x{shape[1]}", q_len=q_len, heads=heads, variant=variant,
                   splits=splits, time_us=time_us, gbps=gbps, rel_l2=err)
        rows.append(row)
        print(f"{mode:6s} {row['shape']:9s} q{q_len} h{heads:<3d} splits={str(splits):5s} {variant:45s} "
              f"{time_us:9.1f} us {gbps:7.0f} GB/s  err {err:.1e}", flush=True)

    if args.paged:
        for shape in PAGED_SHAPES:
            data = bench.make_inputs(bench.uniform_case(*shape), 1, 16, "cuda")
            refs = bench.reference_fns(data)
            for page_size in PAGED_SIZES:
                paged_kv, table = bench.to_paged(data, page_size, seed=0)
                paged_data = (data[0], paged_kv, *data[2:])
                for mode in modes:
                    for overrides in PAGED_VARIANTS:
                        record(mode, shape, f"page{page_size} " + (label(overrides) or "default"), "auto",
                               lambda o=overrides, p=paged_data, t=table: bench_call(mode, p, o, None, t),
                               refs[mode]())
                del paged_kv, table, paged_data
            del data, refs
            torch.cuda.empty_cache()
    elif args.serving:
        for (q_len, heads), options in problems.items():
            for shape in SERVING_SHAPES:
                data = bench.make_inputs(bench.uniform_case(*shape), q_len, heads, "cuda")
                refs = bench.reference_fns(data)
                for mode in modes:
                    for overrides in options if mode in SERVING_MODES else []:
                        if fits(spec, mode, overrides, q_len, heads):
                            record(mode, shape, label(overrides) or "default", "auto",
                                   lambda o=overrides: bench_call(mode, data, o, None), refs[mode](), q_len, heads)
                del data, refs
                torch.cuda.empty_cache()
    else:
        for mode in modes:
            for shape in SHAPES:
                data = bench.make_inputs(bench.uniform_case(*shape), 1, 16, "cuda")
                ref = bench.reference_fns(data)[mode]()
                for overrides in variants(mode):
                    if not fits(spec, mode, overrides):
                        continue
                    record(mode, shape, label(overrides), "auto",
                           lambda o=overrides: bench_call(mode, data, o, None), ref)
        for mode in modes if SPLIT_SWEEP else []:
            for shape in SPLIT_SHAPES:
                data = bench.make_inputs(bench.uniform_case(*shape), 1, 16, "cuda")
                ref = bench.reference_fns(data)[mode]()
                for splits in SPLIT_COUNTS:
                    if splits <= -(-shape[1] // 32):
                        record(mode, shape, "default", splits, lambda s=splits: bench_call(mode, data, {}, s), ref)
        host_overhead(rows)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


def host_overhead(rows) -> None:
    """Host cost of one eager call (the GPU is idle-bound for small shapes): wall time per call of back-to-back
    calls, vs CUDA-graph replay of the same call."""
    import time

    data = bench.make_inputs(bench.uniform_case(4, 1024), 1, 16, "cuda")
    for mode in ("bf16", "a8w8"):
        for splits in (None, 1):
            fn = lambda: bench_call(mode, data, {}, splits)  # noqa: E731
            fn()
            torch.cuda.synchronize()
            start = time.perf_counter()
            for _ in range(200):
                fn()
            host_us = (time.perf_counter() - start) / 200 * 1e6
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                fn()
            torch.cuda.synchronize()
            replay = bench.time_call_us(graph.replay, reps=50, warmup=3, flush=None)
            eager = bench.time_call_us(fn, reps=50, warmup=3, flush=None)
            row = dict(mode=mode, shape="4x1024", variant="host", splits=splits or "auto", host_us_per_call=host_us,
                       eager_us=sorted(eager)[25], graph_us=sorted(replay)[25])
            rows.append(row)
            print(f"host overhead {mode} splits={splits}: {host_us:.1f} us/call on the host; "
                  f"eager {row['eager_us']:.1f} us, graph replay {row['graph_us']:.1f} us (warm L2)", flush=True)
    import cProfile
    import pstats

    fn = lambda: bench_call("bf16", data, {}, None)  # noqa: E731
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(500):
        fn()
    profile.disable()
    torch.cuda.synchronize()
    pstats.Stats(profile).sort_stats("tottime").print_stats(14)


def bench_call(mode, data, overrides, num_splits, page_table=None):
    return run_harness(data, mode, num_splits=num_splits, config_overrides=overrides, page_table=page_table)


if __name__ == "__main__":
    sys.exit(main())
