"""One run's rows: for each case, the baselines, the peers and our modes, each timed (``mla_bench.timing``, cold L2,
median) and, with ``--check``, compared once with the fp32 reference. A row is a dict (the JSON's row): the case, the
implementation and its ``kind`` ("mode", "peer", "baseline"), then ``time_us`` / ``min_us`` / ``times_us`` /
``spread_pct`` (``timing.spread_pct``),
``gbps`` and ``pct_ceiling``, ``tflops``, our ``num_splits`` and ``speedup`` over the others, ``rel_l2`` and
``check_ok``; or ``error`` / ``skipped``. A failure fills its row and the run goes on.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics

import torch

from mla import target
from mla.decode import harness_cache, page_size_of
from mla.inputs import to_paged
from mla_bench import peers as peer_lib
from mla_bench import timing
from mla_bench.baselines import BASELINE_FUNCTIONS, BASELINE_MAX_REPS, BASELINE_MAX_TOKENS, BASELINES
from mla_bench.calls import INPUT_SEED, check_output, eager_call, make_inputs, planned_call, reference_fns
from mla_bench.cases import Case, bytes_moved, flops_of, mode_overrides, splits_for
from mla_bench.peers import AITER, Peer
from mla_bench.report import format_row

REL_L2_LIMIT = {"bf16": 1e-2, "fp8": 2e-2, "a8w8": 2e-2, "mxfp4": 2e-2, "fa3": 1e-2, "fa2": 1e-2, AITER: 2e-2,
                peer_lib.FLASHMLA_BF16: 1e-2, peer_lib.FLASHMLA_FP8: 2e-2,
                "loop": 1e-2, "scaled_mm": 5e-2}  # --check flags FAIL above these (vs the fp32 reference)


@dataclasses.dataclass
class Bench:
    """What every measurement of one run shares."""

    args: argparse.Namespace
    spec: target.TargetSpec
    device: str
    flush: torch.Tensor
    ceiling_gbps: float
    peers: list[Peer]
    notes_printed: set = dataclasses.field(default_factory=set)

    def note_once(self, key: str, text: str) -> None:
        if key not in self.notes_printed:
            self.notes_printed.add(key)
            print(text)


def base_row(case: Case, impl: str, kind: str, args) -> dict:
    return {"case": case.label, "batch": case.batch, "total_kv": case.total_kv, "mean_kv_len": case.mean_kv_len,
            "q_len": args.q_len, "heads": args.heads, "harness_shape": case.harness, "impl": impl, "kind": kind}


def error_text(exc: Exception) -> str:
    return f"{type(exc).__name__}: {exc}".splitlines()[0][:300]


def measure(bench: Bench, row: dict, fn, *, reps: int, bytes_read: float | None, ref_fn=None) -> dict:
    """Fill ``row`` with the timing of ``fn`` (and its check against ``ref_fn()``); any exception goes in ``error``."""
    try:
        out = fn()  # first call: compiles the kernels (mla) or loads the module (peers)
    except Exception as exc:  # noqa: BLE001 - report and go on: a GPU run is too precious to lose to one failure
        row["error"] = error_text(exc)
        return row
    if ref_fn is not None:
        try:
            row.update(check_output(out, ref_fn()))
            row["check_ok"] = row["rel_l2"] <= REL_L2_LIMIT[row["impl"]]
        except Exception as exc:  # noqa: BLE001 - e.g. the reference ran out of memory: still time the call
            row["check_error"] = error_text(exc)
    del out
    try:
        times_us = timing.time_call_us(fn, reps=reps, warmup=timing.WARMUP_CALLS, flush=bench.flush)
    except Exception as exc:  # noqa: BLE001
        row["error"] = error_text(exc)
        return row
    row.update(time_us=statistics.median(times_us), min_us=min(times_us), reps=reps, times_us=times_us,
               spread_pct=timing.spread_pct(times_us))
    if bytes_read is not None:
        row.update(bytes_read=bytes_read, gbps=timing.gbps_of(bytes_read, row["time_us"]))
        row["pct_ceiling"] = 100.0 * row["gbps"] / bench.ceiling_gbps
    if all(k in row for k in ("batch", "mean_kv_len", "q_len", "heads")):
        row["tflops"] = flops_of(row["batch"], row["mean_kv_len"], row["q_len"], row["heads"]) / row["time_us"] / 1e6
    return row


def bench_baselines(bench: Bench, case: Case, data, ref_fn) -> list[dict]:
    args, rows = bench.args, []
    for name in BASELINES:
        row = base_row(case, name, "baseline", args)
        if case.total_kv > BASELINE_MAX_TOKENS:
            bench.note_once("baseline_skip", f"  (torch baselines are skipped above {BASELINE_MAX_TOKENS} cached "
                                             "tokens: their per-sequence Python loop would take most of the run)")
            row["skipped"] = "slow"
        else:
            fn = lambda name=name: BASELINE_FUNCTIONS[name](data)  # noqa: E731
            measure(bench, row, fn, reps=min(args.reps, BASELINE_MAX_REPS), bytes_read=None,
                    ref_fn=ref_fn if args.check else None)
        print(format_row(row), flush=True)
        rows.append(row)
    return rows


def bench_peers(bench: Bench, case: Case, data, ref_fns: dict, paging=None) -> list[dict]:
    args, rows, shared = bench.args, [], {}
    for peer in bench.peers:
        if peer.reason is not None:
            continue  # said once in the header
        row = base_row(case, peer.name, "peer", args)
        try:
            fn, peer_ref_fn, bytes_mode = peer_lib.peer_callable(peer, data, args.heads, ref_fns, paging, shared)
        except Exception as exc:  # noqa: BLE001 - the row says "unavailable: ..." and the run goes on
            row["error"] = ("setup failed: " if peer.name == AITER else "plan failed: ") + error_text(exc)
        else:
            measure(bench, row, fn, reps=args.reps,
                    bytes_read=bytes_moved(case.batch, case.mean_kv_len, args.q_len, args.heads, bytes_mode),
                    ref_fn=peer_ref_fn if args.check else None)
        print(format_row(row), flush=True)
        rows.append(row)
    return rows


def bench_modes(bench: Bench, case: Case, data, ref_fns: dict, comparisons: list[dict], paging=None) -> list[dict]:
    args, rows = bench.args, []
    page_table = None
    if paging is not None:  # same values, read through a shuffled page table (the reference keeps the flat cache)
        paged_kv, page_table = paging
        data = (data[0], paged_kv, *data[2:])
    for mode in args.modes:
        row = base_row(case, mode, "mode", args)
        # What the call divides by the batch for its split count: a plan, the exact token count; the one-shot op,
        # the rows of the cache it is given.
        kv = harness_cache(data[1], mode)[0]
        cache_rows = None if args.plan else kv.shape[0] * (page_size_of(kv) if page_table is not None else 1)
        try:
            row["num_splits"] = splits_for(bench.spec, mode, case, args, cache_rows)
        except ValueError as exc:  # a forced config (--config, --splits) this case cannot take: its row says so
            row["error"] = error_text(exc)
            print(format_row(row), flush=True)
            rows.append(row)
            continue
        overrides = mode_overrides(args)
        if args.plan:
            fn = planned_call(mode, data, args.splits, page_table, overrides=overrides)
        else:
            fn = eager_call(mode, data, args.splits, page_table, overrides)
        measure(bench, row, fn, reps=args.reps,
                bytes_read=bytes_moved(case.batch, case.mean_kv_len, args.q_len, args.heads, mode),
                ref_fn=ref_fns[mode] if args.check else None)
        if "time_us" in row:
            row["speedup"] = {c["impl"]: c["time_us"] / row["time_us"] for c in comparisons
                              if "time_us" in c and mode in peer_lib.COMPARED_WITH.get(c["impl"], (mode,))}
        print(format_row(row), flush=True)
        rows.append(row)
    return rows


def bench_case(bench: Bench, case: Case) -> list[dict]:
    """Every row of one case at the run's (heads, q_len): baselines, peers, then our modes (with their speedups)."""
    args = bench.args
    print(f"\n== {case.label}: batch {case.batch}, {case.total_kv} cached tokens (mean {case.mean_kv_len:.0f}), "
          f"q_len {args.q_len}, {args.heads} heads", flush=True)
    data = make_inputs(case, args.q_len, args.heads, bench.device)
    ref_fns = reference_fns(data)
    rows = []
    if not args.no_baselines:
        rows += bench_baselines(bench, case, data, ref_fns["bf16"])
    paging = to_paged(data, args.page_size, seed=INPUT_SEED) if args.page_size else None
    if not args.no_peers:
        rows += bench_peers(bench, case, data, ref_fns, paging)
    rows += bench_modes(bench, case, data, ref_fns, comparisons=list(rows), paging=paging)
    del data, ref_fns
    torch.cuda.empty_cache()
    return rows
