"""What a run prints: the header (device, timing, read ceiling, peers), one line per measurement (``format_row``),
the modelled split counts, and the summary tables (achieved GB/s and % of the read ceiling, median us, the geometric
mean over the harness shapes, and with ``--grid`` one table of every (heads x q_len) point). The host-cost table's
lines are ``mla_bench.host``'s.
"""

from __future__ import annotations

import math

import torch

from mla_bench import peers as peer_lib
from mla_bench.baselines import BASELINE_MAX_REPS, BASELINES
from mla_bench.cases import Case, splits_for
from mla_bench.jsonio import git_commit
from mla_bench.peers import AITER, Peer
from mla_bench.timing import FLUSH_BYTES, NOISY_SPREAD_PCT, WARMUP_CALLS, is_noisy

# Column order of the tables: each FlashMLA kernel beside the modes it compares with, then the other peers.
IMPL_ORDER = ("bf16", peer_lib.FLASHMLA_BF16, "fp8", "a8w8", peer_lib.FLASHMLA_FP8, "mxfp4", *peer_lib.FLASHINFER,
              AITER, *BASELINES)


def format_row(row: dict) -> str:
    """One measurement's line: median and min us, GB/s and % of the ceiling, TFLOP/s, splits, speedups, check."""
    head = f"  {row['case']:<20} {row['impl']:<10}"
    if row.get("skipped"):
        return f"{head} skipped ({row['skipped']})"
    if row.get("error"):
        return f"{head} {'FAILED' if row['kind'] == 'mode' else 'unavailable'}: {row['error']}"
    text = f"{head} {row['time_us']:9.1f} us (min {row['min_us']:9.1f})"
    if is_noisy(row):
        text += f" NOISY ({row['spread_pct']:.0f}% spread)"
    if "gbps" in row:
        text += f" {row['gbps']:6.0f} GB/s {row['pct_ceiling']:5.1f}%"
    if "tflops" in row:
        text += f" {row['tflops']:6.1f} TFLOP/s"
    if "num_splits" in row:
        text += f"  splits {row['num_splits']:2d}"
    if row.get("speedup"):
        text += "  | " + " ".join(f"{ratio:6.2f}x {name}" for name, ratio in row["speedup"].items())
    if "rel_l2" in row:
        text += f"  | relL2 {row['rel_l2']:.1e} miss {100 * row['harness_miss_fraction']:.1f}%"
        text += "" if row["check_ok"] else " FAIL"
    if "check_error" in row:
        text += f"  | check not run: {row['check_error']}"
    return text


def noisy_rows(rows: list[dict]) -> list[str]:
    """"case/impl" of every timed row whose reps spread wider than ``NOISY_SPREAD_PCT`` (``timing.spread_pct``)."""
    return [f"{r['case']}/{r['impl']}" for r in rows if is_noisy(r)]


def geomean(values: list[float]) -> float:
    return math.exp(sum(math.log(v) for v in values) / len(values))


def timed_impls(rows: list[dict], kinds: tuple[str, ...]) -> list[str]:
    """Implementations of these kinds with at least one time: modes, then peers, then baselines."""
    timed = {r["impl"] for r in rows if r["kind"] in kinds and "time_us" in r}
    return [impl for impl in IMPL_ORDER if impl in timed]


def lookup(rows: list[dict], case_label: str, impl: str) -> dict | None:
    return next((r for r in rows if r["case"] == case_label and r["impl"] == impl and "time_us" in r), None)


def geomean_line(rows: list[dict], cases: list[Case], impls: list[str]) -> str | None:
    harness = [c.label for c in cases if c.harness]
    if not harness:
        return None
    parts = []
    for impl in impls:
        times_us = [r["time_us"] for r in (lookup(rows, label, impl) for label in harness) if r is not None]
        if times_us:
            partial = "" if len(times_us) == len(harness) else f" (over {len(times_us)})"
            parts.append(f"{impl} {geomean(times_us):.1f} us{partial}")
    return f"geomean time over {len(harness)} harness shape(s): " + " | ".join(parts)


def table(rows: list[dict], cases: list[Case], impls: list[str], cell, header_suffix: str) -> list[str]:
    """A compact table: one line per case, one column per implementation; ``cell(row) -> str``."""
    width = max([len(c.label) for c in cases] + [7])
    lines = [f"{'shape':<{width}} | " + " | ".join(f"{impl + header_suffix:>12}" for impl in impls)]
    for case in cases:
        cells = [lookup(rows, case.label, impl) for impl in impls]
        lines.append(f"{case.label:<{width}} | " + " | ".join(f"{cell(r) if r else '-':>12}" for r in cells))
    return lines


def print_summary(rows: list[dict], cases: list[Case], ceiling_gbps: float, args) -> None:
    modes_and_peers = timed_impls(rows, ("mode", "peer"))
    all_impls = timed_impls(rows, ("mode", "peer", "baseline"))
    print(f"\n== summary: median of {args.reps} reps, cold L2; q_len {args.q_len}, {args.heads} heads; "
          f"read ceiling {ceiling_gbps:.0f} GB/s")
    failed = [f"{r['case']}/{r['impl']}" for r in rows if r["kind"] == "mode" and "error" in r]
    if failed:
        print("FAILED: " + ", ".join(failed))
    if args.check:
        bad = [f"{r['case']}/{r['impl']}" for r in rows if r.get("check_ok") is False or "check_error" in r]
        print("check: " + ("all within tolerance" if not bad else "FAIL " + ", ".join(bad)))
    noisy = noisy_rows(rows)
    if noisy:
        print(f"NOISY timings (reps spread over {NOISY_SPREAD_PCT:.0f}% of the median: a disturbed GPU or host; time "
              f"again before comparing): " + ", ".join(noisy))
    line = geomean_line(rows, cases, all_impls)
    if line:
        print(line)
    print("achieved GB/s (% of read ceiling):")
    print("\n".join(table(rows, cases, modes_and_peers,
                          lambda r: f"{r['gbps']:.0f} ({r['pct_ceiling']:.0f}%)", "")))
    print("time, us (median):")
    print("\n".join(table(rows, cases, all_impls, lambda r: f"{r['time_us']:.1f}", " us")), flush=True)


def grid_table(rows: list[dict], cases: list[Case], points: list[tuple[int, int]]) -> list[str]:
    """One line per (heads x q_len, shape), one column per mode / peer: median us and TFLOP/s."""
    impls = timed_impls(rows, ("mode", "peer"))
    width = max([len(c.label) for c in cases] + [5])
    lines = [f"{'heads x q':>9} {'shape':<{width}} | " + " | ".join(f"{impl + ' us (TFLOP/s)':>24}" for impl in impls)]
    for heads, q_len in points:
        at = [r for r in rows if r.get("heads") == heads and r.get("q_len") == q_len]
        for case in cases:
            cells = []
            for impl in impls:
                r = lookup(at, case.label, impl)
                cells.append("-" if r is None else f"{r['time_us']:.1f} ({r.get('tflops', 0.0):.0f})")
            lines.append(f"{f'{heads}x{q_len}':>9} {case.label:<{width}} | " + " | ".join(f"{c:>24}" for c in cells))
    return lines


def print_grid_summary(rows: list[dict], cases: list[Case], points: list[tuple[int, int]], args) -> None:
    print(f"\n== grid: median of {args.reps} reps, cold L2; us (achieved TFLOP/s) per (heads x q_len, shape)")
    print("\n".join(grid_table(rows, cases, points)), flush=True)


def print_split_table(spec, cases: list[Case], args) -> None:
    """The KV split count the op picks per (case, mode) on ``spec``."""
    forced = f" (forced by --splits {args.splits})" if args.splits else ""
    print(f"KV splits per sequence for {spec.name} ({spec.num_sms} SMs){forced}:")
    width = max([len(c.label) for c in cases] + [5])
    print(f"  {'shape':<{width}} " + " ".join(f"{m:>6}" for m in args.modes))
    for case in cases:
        print(f"  {case.label:<{width}} " + " ".join(f"{splits_for(spec, m, case, args):>6}" for m in args.modes))


def print_header(args, spec, device_name: str) -> None:
    print(f"device: {device_name} ({spec.name}, {spec.num_sms} SMs); torch {torch.__version__}; "
          f"git {git_commit() or '?'}")
    print(f"timing: CUDA events around one call, L2 flushed ({FLUSH_BYTES >> 20} MiB write) before each rep, "
          f"median of {args.reps} reps after {WARMUP_CALLS} warm-up calls "
          f"(baselines: {min(args.reps, BASELINE_MAX_REPS)})", flush=True)


def print_ceiling(ceiling: dict) -> None:
    print(f"read ceiling: torch.sum over {ceiling['bytes'] / 2**30:g} GiB bf16: {ceiling['gbps']:.0f} GB/s "
          f"({ceiling['time_us']:.0f} us)", flush=True)


def print_peers(peers: list[Peer], args) -> None:
    if not args.no_peers:
        print("\n".join(peer_lib.status_lines(peers)))
    print("kernels compile on first use (one 'ready in' line each; TileLang's disk cache makes reruns fast)",
          flush=True)
