"""Tuning sweep: time kernel-config variants (block_n, threads, staging) and split counts side by side, in one
GPU run, each checked against the fp32 reference. Without a GPU, ``--compile-only`` builds every variant (fill
TILELANG_CACHE_DIR on the CPU box, carry it to the GPU host).

    python tools/sweep.py --compile-only          # CPU box
    python tools/sweep.py --json sweep.json       # GPU: one line per (mode, shape, variant)
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


def fits(spec, mode: str, overrides: dict) -> bool:
    kv_format, q_format = schedule.MODES[mode]
    try:
        schedule.decode_config(spec, kv_format=kv_format, q_format=q_format, **overrides)
        return True
    except ValueError:
        return False


def compile_all(spec) -> None:
    for mode in ("bf16", "fp8", "a8w8", "mxfp4"):
        kv_format, q_format = schedule.MODES[mode]
        for overrides in variants(mode):
            if not fits(spec, mode, overrides):
                continue
            for split in (True, False):
                cfg = schedule.decode_config(spec, kv_format=kv_format, q_format=q_format, split=split, **overrides)
                jit.get_kernel(cfg, spec)
                print("built", cfg.name, flush=True)


def label(overrides: dict) -> str:
    return ",".join(f"{k}={v}" for k, v in overrides.items())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--compile-only", action="store_true")
    parser.add_argument("--modes", default="bf16,fp8,a8w8,mxfp4")
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--json")
    args = parser.parse_args()
    spec = spec_for_name("sm_90a")
    if args.compile_only or not torch.cuda.is_available():
        compile_all(spec)
        return 0
    modes = args.modes.split(",")
    flush = torch.empty(256 * 1024 * 1024, dtype=torch.uint8, device="cuda")
    rows = []

    def record(mode, shape, variant, splits, fn, ref):
        out = fn()
        err = ((out.float() - ref).norm() / ref.norm()).item()
        times = sorted(bench.time_call_us(fn, reps=args.reps, warmup=3, flush=flush))
        time_us = times[len(times) // 2]
        gbps = bench.gbps_of(bench.bytes_moved(shape[0], shape[1], 1, 16, mode), time_us)
        row = dict(mode=mode, shape=f"{shape[0]}x{shape[1]}", variant=variant, splits=splits, time_us=time_us,
                   gbps=gbps, rel_l2=err)
        rows.append(row)
        print(f"{mode:6s} {row['shape']:9s} splits={str(splits):5s} {variant:55s} {time_us:9.1f} us "
              f"{gbps:7.0f} GB/s  err {err:.1e}", flush=True)

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


def bench_call(mode, data, overrides, num_splits):
    return run_harness(data, mode, num_splits=num_splits, config_overrides=overrides)


if __name__ == "__main__":
    sys.exit(main())
