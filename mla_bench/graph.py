"""The CUDA-graph table (``bench.py --graph``; JSON rows of kind "graph"): a serving engine's replay of
``mla.flash_mla`` against an eager call planned for the same lengths.

Per shape and mode, over the same values in shuffled 64-token pages (cold L2 before each rep, median, as every
timing here):
  - ``eager_us``: ``flash_mla_with_kvcache`` with a ``get_mla_metadata()`` metadata, planned on an untimed first
    call from the exact lengths (the package's fastest call for those lengths);
  - ``graph_us``: SGLang's pattern: a start-up metadata from lengths of 1, the graph captured at other lengths
    (``CAPTURE_LENGTH``) with a slice of a wide block-table buffer, then per step ``get_mla_metadata(lengths)``
    ``copy_``-ed into the captured metadata and its ``num_splits`` (untimed, outside the graph, as the engine
    does), and ``graph.replay()`` timed;
  - ``graph_schedule_us``: vLLM's pattern: the graph also holds the split schedule (the call gets no
    ``num_splits`` and computes it from ``cache_seqlens`` inside the graph);
  - ``flashmla_replay_us`` (bf16, with FlashMLA's library): FlashMLA's own decode captured with its metadata kernel.
``ratio`` = graph_us / the faster of eager_us and flashmla_replay_us, against ``GRAPH_TARGET`` (issue 29).
"""

from __future__ import annotations

import statistics

import torch

from mla.constants import DEFAULT_SM_SCALE, KV_LORA_RANK
from mla.decode import harness_cache
from mla.flash_mla import flash_mla_with_kvcache, get_mla_metadata
from mla.inputs import make_harness_inputs, to_paged
from mla_bench import peers as peer_lib
from mla_bench import timing
from mla_bench.calls import INPUT_SEED, check_output, flash_mla_extras, reference_fns
from mla_bench.measure import Bench, error_text

GRAPH_SHAPES = "4x8192,32x8192,64x1024,128x4096"  # issue 29's table
GRAPH_TARGET = 1.10  # replay time / the faster of the eager planned call and FlashMLA's replay
CAPTURE_LENGTH = 1024  # the lengths the graphs are captured at (SGLang's fill value)
PAGE = 64


def _graph_of(fn):
    """``fn`` captured in a CUDA graph (after one eager warm-up call); returns (graph, fn's outputs)."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outputs = fn()
    torch.cuda.synchronize()
    return graph, outputs


def bench_graph(bench: Bench, batch: int, kv_len: int, mode: str) -> dict:
    """One row of the graph table (see the module docstring)."""
    args = bench.args
    row = dict(kind="graph", shape=f"{batch}x{kv_len}", batch=batch, kv_len=kv_len, mode=mode, heads=args.heads)
    try:
        data = make_harness_inputs(batch, kv_len, q_len=1, num_heads=args.heads, seed=INPUT_SEED, device=bench.device)
        q = data[0]
        paged, table = to_paged(data, PAGE, seed=INPUT_SEED + 1)
        cache, cache_kwargs = harness_cache(paged, mode)  # the paged cache and its (paged) scales
        extras = flash_mla_extras(cache_kwargs)
        kv_format = cache_kwargs["kv_format"]
        q4 = q.view(batch, 1, args.heads, q.shape[-1])
        seqlens = torch.full((batch,), kv_len, dtype=torch.int32, device=bench.device)
        is_fp8 = kv_format == "fp8"
        time = lambda fn: statistics.median(  # noqa: E731
            timing.time_call_us(fn, reps=args.reps, warmup=timing.WARMUP_CALLS, flush=bench.flush))

        # Eager, planned from the exact lengths.
        eager_meta, _ = get_mla_metadata()
        eager = lambda: flash_mla_with_kvcache(q4, cache, table, seqlens, KV_LORA_RANK, eager_meta,  # noqa: E731
                                               is_fp8_kvcache=is_fp8, **extras)
        eager()
        row["eager_us"] = time(eager)

        # SGLang: start-up metadata, a wide block-table buffer, captured at CAPTURE_LENGTH, replayed at kv_len.
        wide = torch.zeros(batch, table.shape[1] + 64, dtype=torch.int32, device=bench.device)
        wide[:, :table.shape[1]] = table
        startup, startup_splits = get_mla_metadata(torch.ones(batch, dtype=torch.int32, device=bench.device),
                                                   args.heads, 1, is_fp8_kvcache=is_fp8)
        graph_lens = torch.full((batch,), CAPTURE_LENGTH, dtype=torch.int32, device=bench.device)

        def refresh():
            step, step_splits = get_mla_metadata(graph_lens, args.heads, 1, is_fp8_kvcache=is_fp8)
            startup.copy_(step)
            startup_splits[:batch + 1].copy_(step_splits)

        refresh()
        block_table = wide[:, :-(-CAPTURE_LENGTH // PAGE)]
        graph, (graph_out, _) = _graph_of(lambda: flash_mla_with_kvcache(
            q4, cache, block_table, graph_lens, KV_LORA_RANK, startup, startup_splits[:batch + 1],
            is_fp8_kvcache=is_fp8, **extras))
        graph_lens.fill_(kv_len)
        refresh()
        torch.cuda.synchronize()
        row["graph_us"] = time(graph.replay)
        row["graph_splits"] = int(startup_splits[1] - startup_splits[0])
        if args.check:
            ref = reference_fns(data)[mode]()
            row.update({f"graph_{k}": v for k, v in check_output(graph_out.view(-1, args.heads, KV_LORA_RANK),
                                                                 ref).items()})

        # vLLM: no num_splits, the schedule inside the graph.
        sched_lens = torch.full((batch,), CAPTURE_LENGTH, dtype=torch.int32, device=bench.device)
        sched_graph, _ = _graph_of(lambda: flash_mla_with_kvcache(
            q4, cache, table, sched_lens, KV_LORA_RANK,
            get_mla_metadata(sched_lens, args.heads, 1, is_fp8_kvcache=is_fp8)[0], is_fp8_kvcache=is_fp8, **extras))
        sched_lens.fill_(kv_len)
        row["graph_schedule_us"] = time(sched_graph.replay)

        # FlashMLA's own replay (its metadata kernel inside the graph), bf16.
        flashmla = next((p for p in bench.peers if p.name == peer_lib.FLASHMLA_BF16 and p.module is not None), None)
        if flashmla is not None and mode == "bf16":
            ops = flashmla.module
            fm_graph, _ = _graph_of(lambda: ops.dense_decode_fwd(q4, cache, KV_LORA_RANK, seqlens, table,
                                                                 DEFAULT_SM_SCALE, False, None, None)[:2])
            row["flashmla_replay_us"] = time(fm_graph.replay)
        best = min(row["eager_us"], row.get("flashmla_replay_us", float("inf")))
        row["ratio"] = row["graph_us"] / best
        row["meets_target"] = row["ratio"] <= GRAPH_TARGET
        del graph, sched_graph
    except Exception as exc:  # noqa: BLE001 - report and go on
        row["error"] = error_text(exc)
    print(format_graph_row(row), flush=True)
    return row


def format_graph_row(row: dict) -> str:
    head = f"{row['shape']:>10} {row['mode']:>6}"
    if "error" in row:
        return f"{head}  ERROR {row['error']}"
    cells = [f"{row.get(k, float('nan')):10.1f}" for k in ("eager_us", "graph_us", "graph_schedule_us",
                                                           "flashmla_replay_us")]
    check = "" if "graph_check_ok" not in row else ("  check ok" if row["graph_check_ok"] else "  CHECK FAILED")
    return (f"{head} {' '.join(cells)} {row['graph_splits']:>7} {row['ratio']:7.3f} "
            f"{'yes' if row['meets_target'] else 'NO':>5}{check}")


def print_graph_header(bench: Bench) -> None:
    print(f"\n== CUDA graphs (mla.flash_mla, {bench.args.heads} heads, pages of {PAGE}, captured at length "
          f"{CAPTURE_LENGTH}, replayed at the shape's lengths): us, median of {bench.args.reps}, cold L2", flush=True)
    print(f"{'shape':>10} {'mode':>6} {'eager':>10} {'graph':>10} {'graph+sch':>10} {'FlashMLA':>10} {'splits':>7} "
          f"{'ratio':>7} {'<=' + str(GRAPH_TARGET):>5}")
