"""Check and time the 64-row decode kernel (tl_kernels/mla_decode_rows.py, issue 17) in one GPU call of a few minutes.

1. Correctness of every variant in ``VARIANTS`` against the fp32 reference (mla/reference.py): ragged batches with
   query lengths 1-8 and KV lengths that straddle the 64-token tiles, rows past the last sequence NaN, outputs
   poisoned, split counts 1 / 3 / 16, each call twice (the fused merge must leave its semaphores at zero).
2. Timing, cold L2 (256 MiB write before each rep), median, of the 64-row kernel against the current op (the 32/64-row
   kernel family, what the scheduler picks without ``rows``) at 32 x 8192 and 256 x 8192 for 128 heads x q_len 4 and
   64 heads x q_len 1, with the two outputs compared.

Every item runs in a child process that the parent watches: an item that raises is reported and the run goes on;
one that hangs (a deadlocked barrier) is killed after ``--item-timeout`` seconds, reported HUNG, and the remaining
items run in a fresh child. Before the items, the kernels are built (or loaded) in parallel worker processes for at
most ``--prebuild-cap`` seconds. Without a GPU, ``--prebuild`` compiles every kernel the run loads into
$TILELANG_CACHE_DIR (target sm_90a), so the GPU host loads them in about a second each.

    TILELANG_CACHE_DIR=/work/main/.device/tl-cache python tools/rows_check.py --prebuild     # CPU box
    TILELANG_CACHE_DIR=.device/tl-cache python tools/rows_check.py [--json rows.json]         # GPU host
"""

from __future__ import annotations

import argparse
import json
import math
import os
import queue
import statistics
import subprocess
import sys
import threading
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

# label -> (num_heads, config overrides of the 64-row family (q_slots), causal, page_size, q_lens, kv_lens).
# q_lens reach 8 (several passes when q_slots x queries per CTA < 8); the KV lengths straddle tile boundaries
# (63 / 64 / 65, 129) and include 0 and 1 token; causal cases include a query that sees nothing (q_len > kv_len).
Q_LENS = [1, 2, 3, 4, 5, 8, 0, 7, 2]
KV_LENS = [1, 63, 64, 65, 129, 700, 0, 2049, 1]
VARIANTS = {
    "h128-qs2-causal": (128, dict(q_slots=2), True, 0),
    "h128-qs2-causal-page16": (128, dict(q_slots=2), True, 16),
    "h64-qs2": (64, dict(q_slots=2), False, 0),
    "h64-qs2-causal": (64, dict(q_slots=2), True, 0),
    "h64-qs2-page64": (64, dict(q_slots=2), False, 64),
    "h32-qs1-causal": (32, dict(q_slots=1), True, 0),  # 32 heads x 2 queries per CTA: rows straddle queries
    "h16-qs1-causal": (16, dict(q_slots=1), True, 0),  # 16 heads x 4 queries per CTA
    "h128-qs4": (128, dict(q_slots=4), False, 0),  # what the scheduler picks for 128 heads x q_len 4
    "h64-qs1": (64, dict(q_slots=1), False, 0),  # ... and for 64 heads x q_len 1
}
SPLITS = (1, 3, 16)
TIMED = [  # (heads, q_len, batch, kv_len)
    (128, 4, 32, 8192), (128, 4, 256, 8192), (64, 1, 32, 8192), (64, 1, 256, 8192),
]
# Extra timings of the 64-row kernel at each timed point: label -> config overrides. "r248": warp group 0 at 248
# registers, the most the launch allows beside 160 + 96 (3 x 168 = 504 per thread). (The earlier "r256" asked for 512:
# its setmaxnreg.inc could never be granted and every timed item hung; RowsDecodeKernelConfig now refuses it.)
TIMED_VARIANTS = {"r248": dict(softmax_regs=248)}
TAIL = 5  # NaN cache rows past the last sequence
MODE = "bf16"  # the only cache format of the 64-row family so far


def rows_overrides(extra: dict | None = None) -> dict:
    return {"rows": True, **(extra or {})}


def variant_config(spec, label: str):
    """The 64-row config the op launches for a variant (what --prebuild compiles)."""
    from mla import schedule

    heads, ov, causal, page_size = VARIANTS[label]
    return schedule.rows_config(spec, kv_format="bf16", num_heads=heads, causal=causal, page_size=page_size, **ov)


def timed_configs(spec, heads: int, q_len: int, batch: int, kv_len: int) -> list:
    """The kernels of one timed point: the 64-row kernel the scheduler picks, and the current op's."""
    from mla import schedule

    problem = dict(kv_format="bf16", q_format="bf16", num_heads=heads, causal=False, page_size=0, batch=batch,
                   total_q=batch * q_len, total_kv=batch * kv_len)
    rows_cfgs = [schedule.select_kernels(spec, **problem, rows=True, **ov)[0]
                 for ov in [{}] + list(TIMED_VARIANTS.values())]
    old = schedule.select_kernels(spec, **problem)
    return rows_cfgs + [c for c in old[:2] if c is not None]


# ------------------------------------------------------------------------------------------------- child: items


def check_item(label: str) -> str:
    import torch

    from mla.decode import mla_decode
    from mla.harness import harness_cache
    from mla.inputs import make_ragged_inputs, to_paged
    from mla.reference import harness_reference

    heads, ov, causal, page_size = VARIANTS[label]
    data = make_ragged_inputs(KV_LENS, Q_LENS, num_heads=heads, seed=17, tail_rows=TAIL)
    data[1]["bf16"][-TAIL:] = math.nan
    ref_out, ref_lse = harness_reference(data, MODE, causal=causal)
    q, kv_data, qo_indptr, kv_indptr, _ = data
    extra = {}
    if page_size:
        paged, page_table = to_paged(data, page_size=page_size)
        kv_data, extra = paged, dict(page_table=page_table)
    cache, kw = harness_cache(kv_data, MODE)
    worst, notes = 0.0, []
    for splits in SPLITS:
        for call in range(2):  # twice on the same buffers: the fused merge leaves its semaphores at zero
            out = torch.full((q.shape[0], heads, 512), math.nan, dtype=torch.bfloat16, device="cuda")
            lse = torch.full((q.shape[0], heads), math.nan, dtype=torch.float32, device="cuda")
            mla_decode(q, cache, qo_indptr, kv_indptr, causal=causal, num_splits=splits, out=out, lse=lse,
                       return_lse=True, config_overrides=rows_overrides(ov), **kw, **extra)
            torch.cuda.synchronize()
            o, r = out.float(), ref_out.float()
            rel = ((o.nan_to_num(0) - r).norm() / r.norm().clamp_min(1e-30)).item()
            worst = max(worst, rel)
            if not bool(torch.isfinite(o).all()):
                notes.append(f"splits {splits} call {call + 1}: {int((~torch.isfinite(o)).any(-1).sum())} non-finite rows")
            if rel > 1e-2:
                notes.append(f"splits {splits} call {call + 1}: rel L2 {rel:.2e}")
            hidden = torch.isneginf(ref_lse)
            if not bool((torch.isneginf(lse) == hidden).all()):
                notes.append(f"splits {splits} call {call + 1}: LSE -inf pattern differs")
            lse_err = torch.where(hidden, torch.zeros_like(lse), (lse - ref_lse).abs() - 1e-3 * ref_lse.abs())
            if bool((lse_err.nan_to_num(1.0) > 1e-3).any()):
                notes.append(f"splits {splits} call {call + 1}: LSE off (max {lse_err.nan_to_num(1.0).max().item():.2e})")
            if bool((out[hidden].float() != 0).any()):
                notes.append(f"splits {splits} call {call + 1}: rows that see nothing are not 0")
    status = "ok" if not notes else "FAIL"
    return json.dumps(dict(kind="check", label=label, status=status, worst_rel_l2=worst, notes=notes[:6]))


def time_us(fn, flush, reps: int) -> float:
    """Median us of ``fn()`` over ``reps`` cold-L2 reps: bench.py's timing (``mla_bench.timing.time_call_us``)."""
    from mla_bench.timing import time_call_us

    return statistics.median(time_call_us(fn, reps=reps, warmup=3, flush=flush))


def time_item(key: str, reps: int) -> str:
    import torch

    from mla import schedule
    from mla.decode import plan
    from mla.inputs import make_harness_inputs
    from mla.target import spec_for_device

    heads, q_len, batch, kv_len = (int(x) for x in key.split("x"))
    spec = spec_for_device(torch.device("cuda"))
    data = make_harness_inputs(batch, kv_len, q_len=q_len, num_heads=heads, seed=1)
    cfg, _, splits = schedule.select_kernels(spec, kv_format="bf16", q_format="bf16", num_heads=heads, causal=False,
                                             page_size=0, batch=batch, total_q=batch * q_len,
                                             total_kv=batch * kv_len, rows=True)
    flush = torch.empty(256 * 1024 * 1024 // 4, dtype=torch.float32, device="cuda")
    flops = 2.0 * batch * q_len * heads * kv_len * (576 + 512)
    result = dict(kind="time", key=key, heads=heads, q_len=q_len, batch=batch, kv_len=kv_len, rows_cfg=cfg.name,
                  rows_splits=splits)
    # Both through a plan made once (untimed): a call with config_overrides skips the op's per-signature launch
    # cache, and its host time would leak into the rows column where the L2 flush does not hide it.
    q, kv_data, qo_indptr, kv_indptr, _ = data
    old_plan = plan(qo_indptr, kv_indptr, num_heads=heads, kv_format="bf16")
    rows_plan = plan(qo_indptr, kv_indptr, num_heads=heads, kv_format="bf16", config_overrides=rows_overrides())
    result["rows_splits"] = rows_plan.num_splits
    out_old = old_plan.run(q, kv_data["bf16"])
    out_rows = rows_plan.run(q, kv_data["bf16"])
    torch.cuda.synchronize()
    result["rows_vs_old_rel_l2"] = ((out_rows.float() - out_old.float()).norm()
                                    / out_old.float().norm().clamp_min(1e-30)).item()
    result["rows_finite"] = bool(torch.isfinite(out_rows.float()).all())
    del out_old, out_rows
    # Each timing is printed as soon as it is taken, so a later one that hangs cannot take it with it.
    result["old_us"] = partial_timing(key, "old", time_us(lambda: old_plan.run(q, kv_data["bf16"]), flush, reps))
    result["rows_us"] = partial_timing(key, "rows", time_us(lambda: rows_plan.run(q, kv_data["bf16"]), flush, reps))
    for label, ov in TIMED_VARIANTS.items():
        try:
            variant = plan(qo_indptr, kv_indptr, num_heads=heads, kv_format="bf16", config_overrides=rows_overrides(ov))
            result[f"rows_{label}_us"] = partial_timing(
                key, f"rows {label}", time_us(lambda: variant.run(q, kv_data["bf16"]), flush, reps))
        except Exception as exc:  # noqa: BLE001 - the main columns stand without it
            result[f"rows_{label}_error"] = f"{type(exc).__name__}: {exc}".splitlines()[0][:200]
    result["status"] = "ok" if result["rows_finite"] and result["rows_vs_old_rel_l2"] < 2e-2 else "FAIL"
    result["old_tflops"] = flops / result["old_us"] / 1e6
    result["rows_tflops"] = flops / result["rows_us"] / 1e6
    return json.dumps(result)


def partial_timing(key: str, label: str, us: float) -> float:
    """Prints one timing of an item at once (the parent shows the line) and returns it."""
    print(f"{key} {label}: {us:.1f} us", flush=True)
    return us


def child(items: list[str], reps: int) -> int:
    """Runs items in order; one JSON line per item (BEGIN / RESULT markers for the parent)."""
    for item in items:
        print(f"BEGIN {item}", flush=True)
        kind, key = item.split(":", 1)
        try:
            if kind == "sleep":  # the watcher's own test (tests/test_rows_cpu.py): an item that takes ``key`` s
                time.sleep(float(key))
                line = json.dumps(dict(kind="sleep", status="ok"))
            else:
                line = check_item(key) if kind == "check" else time_item(key, reps)
        except Exception as exc:  # noqa: BLE001 - report and go on: a GPU run is too precious to lose to one item
            line = json.dumps(dict(kind=kind, label=key, key=key, status="ERROR",
                                   error=f"{type(exc).__name__}: {exc}".splitlines()[0][:300]))
        print(f"RESULT {line}", flush=True)
    return 0


# ------------------------------------------------------------------------------------------------ parent: watch


def run_watched(items: list[str], reps: int, item_timeout: float, deadline: float) -> list[dict]:
    """Runs ``items`` in child processes; kills a child whose item takes longer than ``item_timeout`` seconds (the
    first item of a child gets 60 s more: imports, kernel loads) or runs past ``deadline``, and goes on with the
    rest in a new child."""
    results, remaining = [], list(items)
    while remaining:
        if time.time() > deadline:
            results += [dict(item=i, status="SKIPPED", error="out of time") for i in remaining]
            print(f"  out of time: skipped {', '.join(remaining)}", flush=True)
            break
        proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--child", ",".join(remaining),
                                 "--reps", str(reps)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                cwd=REPO)
        lines: queue.Queue = queue.Queue()

        def pump(stream=proc.stdout, sink=lines):
            for x in stream:
                sink.put(x)
            sink.put(None)

        threading.Thread(target=pump, daemon=True).start()
        item_start, first = time.time(), True
        while True:
            allowed = item_timeout + (60.0 if first else 0.0)
            wait = min(item_start + allowed, deadline) - time.time()
            try:
                line = lines.get(timeout=max(0.5, wait))
            except queue.Empty:
                proc.kill()
                proc.wait()
                item = remaining.pop(0)
                results.append(dict(item=item, status="HUNG", error=f"no result within {time.time() - item_start:.0f} s"))
                print(f"  {item}: HUNG (killed after {time.time() - item_start:.0f} s)", flush=True)
                break
            if line is None:  # the child exited
                proc.wait()
                if remaining:  # it died inside the current item: report it, go on with the rest
                    item = remaining.pop(0)
                    results.append(dict(item=item, status="CRASHED", error=f"child exited with {proc.returncode}"))
                    print(f"  {item}: CRASHED (child exited with {proc.returncode})", flush=True)
                break
            line = line.rstrip("\n")
            if line.startswith("RESULT "):
                result = json.loads(line[7:])
                result["item"] = remaining.pop(0)
                results.append(result)
                print(describe(result), flush=True)
                item_start, first = time.time(), False
            elif line.strip() and not line.startswith("BEGIN "):
                print(f"    | {line}"[:400], flush=True)
    return results


def describe(r: dict) -> str:
    if "error" in r:
        return f"  {r.get('item')}: {r.get('status')} {r.get('error')}"
    if r["kind"] == "sleep":
        return f"  {r['item']}: ok"
    if r["kind"] == "check":
        tail = "" if r["status"] == "ok" else "  " + "; ".join(r["notes"])
        return f"  check {r['label']:<24} {r['status']:<4} worst rel L2 {r['worst_rel_l2']:.2e}{tail}"
    return (f"  time {r['heads']:3d} heads x q {r['q_len']} at {r['batch']:3d} x {r['kv_len']}: old {r['old_us']:8.1f} us "
            f"({r['old_tflops']:5.0f} TFLOP/s)  rows {r['rows_us']:8.1f} us ({r['rows_tflops']:5.0f} TFLOP/s, "
            f"splits {r['rows_splits']})  speedup {r['old_us'] / r['rows_us']:.2f}x  rows vs old rel L2 "
            f"{r['rows_vs_old_rel_l2']:.1e}{'' if r['rows_finite'] else ' NON-FINITE'}"
            + "".join(f"  {k[5:-3]} {v:.1f} us" for k, v in r.items() if k.startswith("rows_r") and k.endswith("_us")))


def summary(results: list[dict]) -> None:
    checks = [r for r in results if r.get("item", "").startswith("check:")]
    ok = sum(r.get("status") == "ok" for r in checks)
    print(f"\n== rows_check: {ok} of {len(checks)} variants correct")
    bad = [f"{r.get('item', r.get('label'))}: {r.get('status')}" for r in results if r.get("status") not in (None, "ok")]
    if bad:
        print("problems: " + "; ".join(bad))
    timed = [r for r in results if r.get("kind") == "time" and "rows_us" in r]
    if timed:
        print(f"{'heads x q':>9} {'shape':>10} | {'old us':>9} {'TFLOP/s':>7} | {'rows us':>9} {'TFLOP/s':>7} | speedup")
        for r in timed:
            print(f"{r['heads']:>5} x {r['q_len']} {r['batch']:>4}x{r['kv_len']:<5} | {r['old_us']:9.1f} "
                  f"{r['old_tflops']:7.0f} | {r['rows_us']:9.1f} {r['rows_tflops']:7.0f} | "
                  f"{r['old_us'] / r['rows_us']:.2f}x")


def all_configs(spec) -> list:
    configs = [variant_config(spec, label) for label in VARIANTS]
    for heads, q_len, batch, kv_len in TIMED:
        configs += timed_configs(spec, heads, q_len, batch, kv_len)
    return list(dict.fromkeys(configs))


def _build(cfg):
    """Worker: compile (or load) one kernel into the disk cache; (name, seconds, error or None)."""
    from mla import jit
    from mla.target import spec_for_name

    start = time.time()
    try:
        jit.get_kernel(cfg, spec_for_name("sm_90a"))
        return cfg.name, time.time() - start, None
    except Exception as exc:  # noqa: BLE001
        return cfg.name, time.time() - start, f"{type(exc).__name__}: {exc}".splitlines()[0][:200]


def parallel_prebuild(cap_s: float) -> None:
    """Before the GPU items: compile every kernel in parallel worker processes (a warm cache takes ~1 s per kernel;
    a cold one ~30-60 s each, in parallel), for at most ``cap_s`` seconds; whatever is not built by then builds on
    first use inside its item."""
    import multiprocessing

    from mla.target import spec_for_name

    configs = all_configs(spec_for_name("sm_90a"))
    workers = max(1, min(len(configs), (os.cpu_count() or 2) - 1))
    start = time.time()
    pool = multiprocessing.get_context("spawn").Pool(workers)
    pending = [pool.apply_async(_build, (cfg,)) for cfg in configs]
    done, failed = 0, []
    for job in pending:
        try:
            name, _, err = job.get(timeout=max(0.1, start + cap_s - time.time()))
        except multiprocessing.TimeoutError:
            break
        done += 1
        if err:
            failed.append(f"{name}: {err}")
    pool.terminate()
    pool.join()
    print(f"prebuild: {done} of {len(configs)} kernels ready in {time.time() - start:.0f} s with {workers} workers"
          + (f"; FAILED: {'; '.join(failed)}" if failed else ""), flush=True)


def prebuild() -> int:
    """Compile (CPU, sm_90a) every kernel the run loads, into $TILELANG_CACHE_DIR."""
    from mla import jit
    from mla.target import spec_for_name

    spec = spec_for_name("sm_90a")
    configs = all_configs(spec)
    failures = 0
    for i, cfg in enumerate(configs, 1):
        start = time.time()
        try:
            jit.get_kernel(cfg, spec)
            print(f"[{i}/{len(configs)}] {cfg.name}: {time.time() - start:.0f} s", flush=True)
        except Exception as exc:  # noqa: BLE001
            failures += 1
            print(f"[{i}/{len(configs)}] {cfg.name}: FAILED {type(exc).__name__}: {exc}", flush=True)
    return 1 if failures else 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prebuild", action="store_true", help="compile the kernels (no GPU needed) and exit")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--only", help="comma-separated variant labels / timed keys (default: all)")
    ap.add_argument("--no-time", action="store_true", help="correctness only")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--item-timeout", type=float, default=60.0, help="seconds one item may take (default 60)")
    ap.add_argument("--budget", type=float, default=150.0,
                    help="seconds for the GPU items, after the prebuild (default 150)")
    ap.add_argument("--prebuild-cap", type=float, default=90.0,
                    help="seconds for the parallel prebuild before the GPU items (default 90; 0 skips it)")
    ap.add_argument("--json", help="write the results to this path")
    args = ap.parse_args(argv)
    if args.prebuild:
        return prebuild()
    if args.child is not None:
        return child(args.child.split(","), args.reps)
    items = [f"check:{label}" for label in VARIANTS]
    if not args.no_time:
        items += [f"time:{h}x{q}x{b}x{kv}" for h, q, b, kv in TIMED]
    if args.only:
        wanted = set(args.only.split(","))
        items = [i for i in items if i.split(":", 1)[1] in wanted]
    print(f"rows_check: {len(items)} items, {args.item_timeout:.0f} s each at most, {args.budget:.0f} s in all, "
          f"after a prebuild of at most {args.prebuild_cap:.0f} s", flush=True)
    if args.prebuild_cap > 0:
        parallel_prebuild(args.prebuild_cap)
    results = run_watched(items, args.reps, args.item_timeout, time.time() + args.budget)
    summary(results)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0 if all(r.get("status") in (None, "ok") for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
