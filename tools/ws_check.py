"""Check and time the warp-specialised decode kernel (tl_kernels/mla_decode_ws.py) beside the current op, in one
GPU call: correctness on ragged batches against the fp32 reference, then the 8 harness shapes per mode over a set
of split counts. Without a GPU (``--prebuild``, with MLA_TARGET=sm_90a) it only compiles the kernels, so a cache
built on a CPU box is carried to the GPU host.

    MLA_TARGET=sm_90a TILELANG_CACHE_DIR=.device/tl-cache python tools/ws_check.py --prebuild
    python tools/ws_check.py --check --time --json out.json          # on the GPU host
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import pathlib
import statistics
import sys
import time

import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from mla import jit, reference, schedule, workspace  # noqa: E402
from mla.constants import MODES  # noqa: E402
from mla.harness import run_harness  # noqa: E402
from mla.inputs import make_harness_inputs, make_ragged_inputs  # noqa: E402
from mla.target import spec_for_name  # noqa: E402
from mla_bench.timing import spin_up  # noqa: E402
from tl_kernels.mla_decode_ws import WSDecodeKernelConfig  # noqa: E402
sys.path.insert(0, str(ROOT / "tests"))
from helpers import REL_L2, check_against_reference, per_sequence_rel_l2  # noqa: E402  (the tests' gate, once)

SHAPES = [(4, 1024), (4, 8192), (32, 1024), (32, 8192), (64, 1024), (64, 8192), (256, 1024), (256, 8192)]
OLD_FAMILY = {"block_n": 64}  # any override of the old family's fields selects it (its default tile)
VARIANTS = {  # name -> config overrides (fp8 / mxfp4 take two stages only: their decoders hold two tiles)
    "st2": dict(num_stages=2),
    "st3": dict(num_stages=3),
    # issue 28: the L2 prefetch of the tile 2 / 3 / 4 / 6 ahead
    "pf2": dict(l2_prefetch=2),
    "pf3": dict(l2_prefetch=3),
    "pf4": dict(l2_prefetch=4),
    "pf6": dict(l2_prefetch=6),
    # the pipelined MMA warp group (score wgmma of tile t and P V of tile t - 1 in flight together)
    "ov": dict(overlap=True),
    "ovpf3": dict(overlap=True, l2_prefetch=3),
    # the MMA warp group alone (producers touch no memory): timing only, never checked
    "idle": dict(idle_producers=True),
    "ovidle": dict(overlap=True, idle_producers=True),
    # issue 28's consumer and decoder changes (defaults now: ``schedule.WS_CONSUMER`` / ``WS_DEFAULTS``), off
    "plain": dict(fast_softmax=False, score_group=False, direct_stores=False),
    "plainidle": dict(fast_softmax=False, score_group=False, direct_stores=False, idle_producers=True),
    "nodst": dict(direct_stores=False),
    # the decode kept below the free-stage wait (``ordered_decode``), and mxfp4 with the decoder stores by address
    "od": dict(ordered_decode=True),
    "dst": dict(direct_stores=True),
    "dstod": dict(direct_stores=True, ordered_decode=True),
    # a8w8 on fp8 wgmma: the fp8 codes copied as stored, V^T by a transposing warp group (issue 28, step 5)
    "f8mma": dict(fp8_mma=True),
    "f8mmapf3": dict(fp8_mma=True, l2_prefetch=3),
    "f8mma3": dict(fp8_mma=True, num_stages=3),
    "f8mmaps": dict(fp8_mma=True, p_split=True),  # P as two e4m3 terms
    "f8mma3ps": dict(fp8_mma=True, num_stages=3, p_split=True),
    "f8mmapsqs": dict(fp8_mma=True, p_split=True, q_stack=True),  # bf16 Q's two terms in one score wgmma
    "f8mmapst": dict(fp8_mma=True, p_split=True, p_stack=True),  # P's two terms in one P V wgmma group
    "f8mmaqpst": dict(fp8_mma=True, p_split=True, q_stack=True, p_stack=True),  # both
    "mxd2": schedule.MX_RING_2D,  # mxfp4: two decoder warp groups, one per stage, on f8mmaqpst's ring
    # every role's tile step in one copy, the stage in a register (``dynamic_stage``): fp8's and a8w8's default rings
    # (bf16 Q: f8mmaqpst; a8w8: f8mmapst), a8w8 with three stages, mxfp4's two-decoder ring
    "f8mmaqpstdyn": dict(fp8_mma=True, p_split=True, q_stack=True, p_stack=True, dynamic_stage=True),
    "f8mmapstdyn": dict(fp8_mma=True, p_split=True, p_stack=True, dynamic_stage=True),
    "f8mma3pstdyn": dict(fp8_mma=True, num_stages=3, p_split=True, p_stack=True, dynamic_stage=True),
    "mxd2dyn": dict(schedule.MX_RING_2D, dynamic_stage=True),
    # and the V^T ring at two stages beside three or four codes stages (``vt_stages``)
    "f8mma3v2qpstdyn": dict(fp8_mma=True, num_stages=3, vt_stages=2, p_split=True, q_stack=True, p_stack=True,
                            dynamic_stage=True),
    "f8mma3v2pstdyn": dict(fp8_mma=True, num_stages=3, vt_stages=2, p_split=True, p_stack=True, dynamic_stage=True),
    "f8mma4v2pstdyn": dict(fp8_mma=True, num_stages=4, vt_stages=2, p_split=True, p_stack=True, dynamic_stage=True),
    # persistent CTAs (``persistent_ctas``): one CTA per SM walking its work items, the ring carried across them;
    # "...pc5": five CTAs, so that the checks' small batches give every CTA many items
    "f8mmaqpstdynpc": dict(fp8_mma=True, p_split=True, q_stack=True, p_stack=True, dynamic_stage=True,
                           persistent_ctas=132),
    "f8mmapstdynpc": dict(fp8_mma=True, p_split=True, p_stack=True, dynamic_stage=True, persistent_ctas=132),
    "f8mmaqpstdynpc5": dict(fp8_mma=True, p_split=True, q_stack=True, p_stack=True, dynamic_stage=True,
                            persistent_ctas=5),
    "f8mmapstdynpc5": dict(fp8_mma=True, p_split=True, p_stack=True, dynamic_stage=True, persistent_ctas=5),
    # Q's shared rows written two rows per step of a loop (``q_loop_rows``), alone and with persistent CTAs
    "f8mmaqpstdynql2": dict(fp8_mma=True, p_split=True, q_stack=True, p_stack=True, dynamic_stage=True, q_loop_rows=2),
    "f8mmapstdynql2": dict(fp8_mma=True, p_split=True, p_stack=True, dynamic_stage=True, q_loop_rows=2),
    "f8mmaqpstdynpcql2": dict(fp8_mma=True, p_split=True, q_stack=True, p_stack=True, dynamic_stage=True,
                              persistent_ctas=132, q_loop_rows=2),
    "f8mmapstdynpcql2": dict(fp8_mma=True, p_split=True, p_stack=True, dynamic_stage=True, persistent_ctas=132,
                             q_loop_rows=2),
    # the MMA warp group one score ahead (S(t + 1) in flight during the softmax of t)
    "f8sa": dict(fp8_mma=True, score_ahead=True),
    "f8saps": dict(fp8_mma=True, score_ahead=True, p_split=True),
    "f8sa3ps": dict(fp8_mma=True, score_ahead=True, num_stages=3, p_split=True),
}
TIMING_ONLY = {"idle", "ovidle", "plainidle"}
DEFAULT_VARIANTS = "st2,st3"


def ws_config(spec, mode: str, *, causal=False, **overrides) -> WSDecodeKernelConfig:
    kv_format, q_format = MODES[mode]
    return schedule.ws_config(spec, kv_format=kv_format, q_format=q_format, causal=causal, **overrides)


def variants_for(mode: str, names: str = DEFAULT_VARIANTS, check: bool = False):
    out = []
    for name in names.split(","):
        ov = VARIANTS[name]
        if check and name in TIMING_ONLY:
            continue
        try:  # the config that is built and timed (the schedule's, with the variant's overrides)
            cfg = ws_config(spec_for_name("sm_90a"), mode, **ov)
        except ValueError:  # e.g. three stages for a decoded format
            continue
        if cfg.shared_bytes <= 227 * 1024:
            out.append((name, ov))
    return out


def run_ws(overrides, data, mode, num_splits, out=None, lse=None, causal=False):
    """The op on the warp-specialised kernel with tuning ``overrides`` (its config fields) and a forced split count."""
    return run_harness(data, mode, num_splits=num_splits, config_overrides={"ws": True, **overrides}, out=out, lse=lse,
                       return_lse=True, causal=causal)


def run_old(data, mode):
    """The op on the 32/64-row kernel family (decode + combine), as every call ran before the new family."""
    return run_harness(data, mode, config_overrides=OLD_FAMILY)


def check(spec, args) -> list[dict]:
    rows = []
    cases = [
        ("ragged", [0, 1, 63, 64, 65, 200, 1000, 3001], 1, False),
        ("one", [5], 1, False),
        ("mtp-causal", [700, 0, 130, 64], [2, 1, 3, 4], True),
        ("mtp", [129, 1, 2000], [3, 2, 0], False),
    ]
    for label, kv_lens, q_lens, causal in cases:
        data = make_ragged_inputs(kv_lens, q_lens, seed=hash(label) % 1000, tail_rows=7)
        # poison rows past the last sequence: the kernel must never read them
        for fmt, v in data[1].items():
            t = v if fmt == "bf16" else v[0]
            if fmt == "bf16":
                t[-7:] = float("nan")
            elif fmt == "fp8":
                t[-7:] = torch.tensor(float("nan")).to(t.dtype)
            else:
                t[-7:] = 0xFF
        q_tile = schedule.query_tile(int(data[2][-1]), len(kv_lens))
        if not schedule.uses_ws(spec_for_name("sm_90a"), num_heads=16, q_tile=q_tile):
            # MTP query tiles take the 32/64-row kernel: no warp-specialised variant to check (and the WS-only
            # fields of a variant would not fit that kernel's config)
            print(f"check {label:10s}: skipped (query tile {q_tile} is not the warp-specialised kernel's class)")
            continue
        for mode in args.modes.split(","):
            ref_out, ref_lse = reference.harness_reference(data, mode, causal=causal)
            for name, ov in variants_for(mode, args.variants, check=True):
                for splits in (1, 2, 5, 16):
                    out = torch.full((data[0].shape[0], 16, 512), float("nan"), dtype=torch.bfloat16, device="cuda")
                    lse = torch.full((data[0].shape[0], 16), float("nan"), dtype=torch.float32, device="cuda")
                    for rep in range(2):  # twice: the semaphores must be back at zero
                        run_ws(ov, data, mode, splits, out, lse, causal=causal)
                    torch.cuda.synchronize()
                    sem = workspace.semaphores(torch.device("cuda", torch.cuda.current_device()), len(kv_lens))
                    o, r = out.float(), ref_out.float()
                    err = ((o - r).norm() / r.norm().clamp_min(1e-30)).item()
                    finite = bool(torch.isfinite(o).all())
                    sem_zero = bool((sem == 0).all())
                    # The tests' gate (tests/helpers.py: finite, relative L2 of the batch and of each sequence, max
                    # abs, LSE): a batch-wide error alone passed P in one e4m3 term that the per-sequence gate failed
                    # (docs/perf.md runs 48-50).
                    seq_of_row = torch.repeat_interleave(torch.arange(len(kv_lens), device=o.device),
                                                         data[2].diff().to(o.device))
                    worst_seq = per_sequence_rel_l2(o, r, seq_of_row, len(kv_lens)).max().item()
                    try:
                        check_against_reference(out, ref_out, mode, data[2], data[3], lse=lse, ref_lse=ref_lse)
                        gate = ""
                    except AssertionError as failure:
                        gate = str(failure)[:500]
                    ok = sem_zero and not gate
                    rows.append(dict(kind="check", case=label, mode=mode, variant=name, splits=splits, rel_l2=err,
                                     worst_seq_rel_l2=worst_seq, finite=finite, sem_zero=sem_zero, gate=gate, ok=ok))
                    if not ok or args.verbose:
                        print(f"check {label:10s} {mode:5s} {name} splits={splits:2d} rel_l2={err:.2e} "
                              f"worst seq {worst_seq:.2e} sem_zero={sem_zero} {'OK' if ok else 'FAIL ' + gate}")
    n_bad = sum(not r["ok"] for r in rows)
    print(f"check: {len(rows) - n_bad} ok, {n_bad} failed")
    for mode in args.modes.split(","):
        for name in dict.fromkeys(r["variant"] for r in rows if r["mode"] == mode):
            worst = max(r["worst_seq_rel_l2"] for r in rows if r["mode"] == mode and r["variant"] == name)
            print(f"check {mode:5s} {name}: worst per-sequence relative L2 {worst:.2e} (gate {REL_L2[mode]:.0e})")
    return rows


def time_us(fn, flush, reps: int) -> float:
    """Median us of ``fn()`` over ``reps`` cold-L2 reps: bench.py's timing (``mla_bench.timing.time_call_us``), behind
    a GPU sleep of ``AB_HOST_SLACK_US`` so the per-call overrides' host path does not show (tools/override_ab.py)."""
    from mla_bench.timing import AB_HOST_SLACK_US, time_call_us

    return statistics.median(time_call_us(fn, reps=reps, warmup=3, flush=flush, host_slack_us=AB_HOST_SLACK_US))


def split_candidates(batch, kv_len):
    tiles = math.ceil(kv_len / 64)
    cands = {1, 2, 4, 8, 16, 32, math.ceil(132 / batch), math.ceil(264 / batch), math.ceil(396 / batch)}
    return sorted(c for c in cands if 1 <= c <= tiles)


def bytes_per_token(mode):
    return {"bf16": 1152, "fp8": 576, "a8w8": 576, "mxfp4": 306}[mode]


def timing(spec, args) -> list[dict]:
    rows = []
    flush = torch.empty(256 * 1024 * 1024 // 4, dtype=torch.float32, device="cuda")
    spin_up()  # the first variant timed must not pay for the clocks' ramp (run 51)
    for batch, kv_len in parse_shapes(args.shapes):
        data = make_harness_inputs(batch, kv_len, seed=1)
        for mode in args.modes.split(","):
            ref_bytes = batch * kv_len * bytes_per_token(mode)
            line = [f"{batch:3d}x{kv_len:5d} {mode:5s}"]
            if not args.no_old:
                t_old = time_us(lambda: run_old(data, mode), flush, args.reps)
                line.append(f"old {t_old:8.1f}")
                rows.append(dict(kind="time", batch=batch, kv_len=kv_len, mode=mode, impl="old", time_us=t_old))
            for name, ov in variants_for(mode, args.variants):
                best = None
                for splits in split_candidates(batch, kv_len):
                    t = time_us(lambda: run_ws(ov, data, mode, splits), flush, args.reps)
                    rows.append(dict(kind="time", batch=batch, kv_len=kv_len, mode=mode, impl=f"ws-{name}",
                                     splits=splits, time_us=t, gbps=ref_bytes / t / 1e3))
                    if best is None or t < best[1]:
                        best = (splits, t)
                line.append(f"ws-{name} {best[1]:8.1f} (s={best[0]:2d}, {ref_bytes / best[1] / 1e3:5.0f} GB/s)")
            print("  ".join(line), flush=True)
        del data
        torch.cuda.empty_cache()
    return rows


def parse_shapes(text: str):
    return [tuple(int(x) for x in item.split("x")) for item in text.split(",")]


def prebuild(spec, args):
    t0 = time.time()
    for mode in args.modes.split(","):
        for name, ov in variants_for(mode, args.variants):
            for causal in ((False, True) if args.check else (False,)):
                jit.get_kernel(ws_config(spec, mode, causal=causal, **ov), spec)
            for page_size in (int(p) for p in args.pages.split(",") if p):  # paged caches (tests/test_ws_gpu.py)
                jit.get_kernel(ws_config(spec, mode, page_size=page_size, **ov), spec)
        # the current op's kernels for the timed shapes
        for batch, kv_len in ([] if args.no_old else parse_shapes(args.shapes)):
            kv_format, q_format = MODES[mode]
            kq = "fp8" if q_format == "fp8" else "bf16"
            dec, comb, n = schedule.select_kernels(spec, kv_format=kv_format, q_format=kq, num_heads=16, causal=False,
                                                   page_size=0, batch=batch, total_q=batch, total_kv=batch * kv_len,
                                                   **OLD_FAMILY)
            jit.get_kernel(dec, spec)
            if comb is not None:
                jit.get_kernel(comb, spec)
    print(f"prebuild done in {time.time() - t0:.0f} s")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--prebuild", action="store_true")
    ap.add_argument("--check", action="store_true")
    ap.add_argument("--time", action="store_true")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--json")
    ap.add_argument("--verbose", action="store_true")
    ap.add_argument("--no-old", action="store_true", help="time the warp-specialised variants only (not the op's "
                    "16/32/64-row kernels beside them)")
    ap.add_argument("--shapes", default=",".join(f"{b}x{n}" for b, n in SHAPES), help="timed shapes, e.g. 64x8192")
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--variants", default=DEFAULT_VARIANTS, help=f"of {', '.join(VARIANTS)}")
    ap.add_argument("--pages", default="", help="--prebuild: also the paged kernels of these page sizes, e.g. 1,16,64")
    args = ap.parse_args()
    if args.prebuild:
        prebuild(spec_for_name("sm_90a"), args)
        return
    spec = None
    rows = []
    if args.check:
        rows += check(spec, args)
    if args.time:
        rows += timing(spec, args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
