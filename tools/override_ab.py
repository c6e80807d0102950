"""A/B of kernel-config overrides through the op, in one GPU call: each variant (a set of ``config_overrides``, as
``mla_decode`` takes them for tuning) checked against the fp32 reference and timed beside the others on the same
inputs, per shape and mode, with the op's own split count. Without a GPU (``--prebuild``, MLA_TARGET=sm_90a) it
only compiles the kernels each variant selects, so a cache built on a CPU box is carried to the GPU host.

    MLA_TARGET=sm_90a TILELANG_CACHE_DIR=/work/tlcache python tools/override_ab.py --prebuild \\
        --variants 'base:deferred_sum=0;dsum:deferred_sum=1'
    python tools/override_ab.py --variants 'base:deferred_sum=0;dsum:deferred_sum=1' --json ab.json   # GPU host

A variant is ``name:field=value,field=value`` (ints; 0 / 1 for booleans); an empty field list is the op's default
selection. Note that any override turns the op's warp-specialised default off unless the variant says ``ws=1``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

sys.path.insert(0, ".")
from mla import jit, reference, schedule  # noqa: E402
from mla.constants import MODES  # noqa: E402
from mla.target import spec_for_name  # noqa: E402
from mla_bench.timing import AB_HOST_SLACK_US  # noqa: E402

SHAPES = "4x1024,4x8192,32x1024,32x8192,64x1024,64x8192,256x1024,256x8192"


def _bool_fields() -> set[str]:
    """The override fields that take 0 / 1 as booleans: the op's own switches and every bool field of the kernel
    configs (so ``fp8_mma=1`` builds the same config, name and cache key as ``fp8_mma=True``)."""
    import dataclasses

    from tl_kernels.mla_decode import DecodeKernelConfig
    from tl_kernels.mla_decode_ws import WSDecodeKernelConfig

    fields = {f.name for cls in (DecodeKernelConfig, WSDecodeKernelConfig) for f in dataclasses.fields(cls)
              if f.type in (bool, "bool")}
    return fields | {"deferred_sum", "fast_softmax", "ws", "overlap", "fused_combine", "rows", "fast_decode"}


BOOL_FIELDS = _bool_fields()


def parse_variants(text: str) -> list[tuple[str, dict]]:
    out = []
    for item in filter(None, (s.strip() for s in text.split(";"))):
        name, _, fields = item.partition(":")
        ov = {}
        for f in filter(None, fields.split(",")):
            key, _, value = f.partition("=")
            ov[key] = bool(int(value)) if key in BOOL_FIELDS else int(value)
        out.append((name, ov))
    return out


def parse_shapes(text: str):
    return [tuple(int(x) for x in item.split("x")) for item in text.split(",")]


def prebuild(args) -> None:
    spec = spec_for_name("sm_90a")
    built = set()
    for batch, kv_len in parse_shapes(args.shapes):
        for mode in args.modes.split(","):
            kv_format, q_format = MODES[mode]
            for _, ov in parse_variants(args.variants):
                dec, comb, _ = schedule.select_kernels(
                    spec, kv_format=kv_format, q_format="fp8" if q_format == "fp8" else "bf16", num_heads=16,
                    causal=False, page_size=0, batch=batch, total_q=batch, total_kv=batch * kv_len, **dict(ov))
                for cfg in (dec, comb):
                    if cfg is not None and cfg.name not in built:
                        jit.get_kernel(cfg, spec)
                        built.add(cfg.name)
                        print(f"built {cfg.name}", flush=True)


def run(args) -> list[dict]:
    import torch

    from mla.harness import run_harness
    from mla.inputs import make_harness_inputs
    from mla_bench.timing import time_call_us

    rows = []
    flush = torch.empty(256 * 1024 * 1024 // 4, dtype=torch.float32, device="cuda")
    variants = parse_variants(args.variants)
    print(f"{'shape':>9s} {'mode':5s} " + " ".join(f"{name:>12s}" for name, _ in variants) + "   (median us, cold L2)")
    for batch, kv_len in parse_shapes(args.shapes):
        data = make_harness_inputs(batch, kv_len, seed=1)
        for mode in args.modes.split(","):
            ref_out, _ = reference.harness_reference(data, mode)
            line = []
            for name, ov in variants:
                fn = lambda: run_harness(data, mode, config_overrides=dict(ov) or None)  # noqa: E731
                out = fn()
                torch.cuda.synchronize()
                err = ((out.float() - ref_out.float()).norm() / ref_out.float().norm()).item()
                ok = bool(torch.isfinite(out.float()).all()) and err < 2e-2
                times = time_call_us(fn, reps=args.reps, warmup=3, flush=flush, host_slack_us=args.host_slack_us)
                t = statistics.median(times)
                rows.append(dict(batch=batch, kv_len=kv_len, mode=mode, variant=name, overrides=ov, time_us=t,
                                 min_us=min(times), rel_l2=err, ok=ok))
                line.append(f"{t:10.1f}{'  ' if ok else ' !'}")
            print(f"{batch:4d}x{kv_len:<5d}{mode:>5s} " + " ".join(line), flush=True)
        del data
        torch.cuda.empty_cache()
    bad = [r for r in rows if not r["ok"]]
    print(f"override_ab: {len(rows) - len(bad)} ok, {len(bad)} outside tolerance (rel. L2 >= 2e-2 or not finite)")
    for name, _ in variants[1:]:
        ratios = [r["time_us"] / b["time_us"] for r in rows if r["variant"] == name
                  for b in rows if b["variant"] == variants[0][0] and (b["batch"], b["kv_len"], b["mode"])
                  == (r["batch"], r["kv_len"], r["mode"])]
        if ratios:
            geo = statistics.geometric_mean(ratios)
            print(f"  {name} / {variants[0][0]}: geomean {geo:.3f} (min {min(ratios):.3f}, max {max(ratios):.3f})")
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prebuild", action="store_true", help="compile only (no GPU needed)")
    ap.add_argument("--variants", required=True, help="'name:field=value,...;name2:...' (first = baseline)")
    ap.add_argument("--shapes", default=SHAPES)
    ap.add_argument("--modes", default="bf16,fp8,a8w8,mxfp4")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--host-slack-us", type=float, default=AB_HOST_SLACK_US,
                    help="a GPU sleep of this long before each timed call, so the time is the GPU's alone "
                         "(0: the harness's timing, host path included where it outlasts the L2 flush)")
    ap.add_argument("--json")
    args = ap.parse_args()
    if args.prebuild:
        prebuild(args)
        return
    rows = run(args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
