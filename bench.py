"""Benchmark of the TileLang MLA decode op (``mla.decode.mla_decode``), timed the way the competition harness times:
CUDA events around ONE call, the L2 flushed (a 256 MiB write) before each rep, median of many reps (the min too).
A measurement whose reps spread wider than ``mla_bench.timing.NOISY_SPREAD_PCT`` (p90 - p10 over the median) is
flagged NOISY on its line and in the summary: a disturbed GPU or host, to be timed again before it is compared.

Usage, from the repo root (``python bench.py`` finds the ``mla`` package next to this file):

    python bench.py                                  # 8 harness shapes x modes bf16 fp8 a8w8 mxfp4, + peers, baselines
    python bench.py --modes fp8,mxfp4 --shapes 4x1024,256x8192
    python bench.py --ragged --long --check          # + ragged batches and 32k contexts; verify vs the fp32 reference
    python bench.py --q-len 2 --no-baselines         # MTP: 2 query tokens per sequence
    python bench.py --page-size 16 --heads 128       # paged KV (FlashInfer reads the same pages), 128 heads
    python bench.py --grid 128x4,128x1,64x1,16x4,16x8 --modes bf16,fp8 --shapes 32x8192,256x8192
                                                     # one run over (heads x q_len) points: issue 17's whole table
    python bench.py --plan                           # time DecodePlan.run (planned once, untimed, like FlashInfer)
    python bench.py --graph --json graph.json        # CUDA-graph replays of mla.flash_mla vs eager planned calls
                                                     # (default shapes 4x8192,32x8192,64x1024,128x4096, bf16)
    python bench.py --splits 1 --no-peers --reps 100 # force one KV split (no combine kernel)
    python bench.py --json results.json --plot gbps.png
    python bench.py --shapes none --ragged           # only the ragged batches (and the host-cost table)
    python bench.py --shapes none --no-baselines     # only the host-cost table (4 x 1024)

Modes (what the op reads):
    bf16   bf16 Q, bf16 KV cache                      (1152 B per cached token)
    fp8    bf16 Q, fp8 e4m3 KV + per-tensor scale     (576 B per token)
    a8w8   Q quantized to fp8 inside the call, fp8 KV (576 B per token): the competition's reference configuration
    mxfp4  bf16 Q, mxfp4 KV (e2m1 + e8m0 per 32)      (288 + 18 = 306 B per token)
Peers (mla_bench/peers.py, when importable): FlashInfer's BatchMLAPagedAttentionWrapper, backends fa3 and fa2, bf16 Q and
KV, page size 1 (with --page-size: the same shuffled pages as ours, as CSR page lists); only its ``run`` is timed
(``plan`` is not; our --plan option times ``DecodePlan.run`` the same way). With $FLASHMLA_LEGACY_LIB set, FlashMLA's
SM90 decode: flashmla-bf16 (``dense_decode_fwd``, beside our bf16) and flashmla-fp8 (``fwd_kvcache_mla_fp8``, fp8 Q
quantized per tensor and the fp8 cache, beside our fp8 and a8w8), both over the same values in pages of 64 tokens with
a block table; its scheduler metadata is made once, untimed. On ROCm only, AMD aiter (package amd-aiter): its a8w8 persistent MLA decode
called as the competition reference calls it (fp8 Q and KV, per-tensor scales, page size 1, 32 KV splits); only
``aiter.mla.mla_decode_fwd`` is timed (metadata and the fp8 quantization of Q and KV are not). The aiter peer is
untested in this project (no ROCm machine): only its call sequence is checked, on the CPU, against a fake aiter.
Baselines: the harness template's two naive torch versions, re-implemented here: a per-sequence bf16 loop ("loop") and
fp8 Q/K through ``torch._scaled_mm`` ("scaled_mm"); skipped above BASELINE_MAX_TOKENS cached tokens (too slow).

Host cost (--host-shape, default 4x1024; JSON rows of kind "host"): the L2 flush before each timed call hides up to
~60-80 us of host time, so the host is measured apart, with a warm L2: ``host_us_per_call`` = wall time per call in a
loop of --host-calls (500) calls back to back, for every mode through ``mla_decode`` (its cache keywords taken from
the harness tuple once, as for the planned call), through ``DecodePlan.run`` (rows with ``"plan": true``) and through
``mla.flash_mla.flash_mla_with_kvcache`` with reused metadata on 64-token pages (``"call": "flash_mla"``), through the
harness's ``custom_kernel`` (bf16, flat cache: the tuple unpacked and checked per call, ``"call": "custom_kernel"``),
for every peer's timed call, and for one torch launch of a tiny kernel (``"call": "reference"``: this host's own
speed, as hosts differ ~2x); ``gpu_us_per_call`` = the call's GPU time with the GPU never waiting for the host (calls
queued behind a sleep kernel, CUDA events around them); ``host_overhead_us`` = their difference: what the host adds
per call beyond the kernels.

Achieved TFLOP/s = ``mla_bench.cases.flops_of(...)`` / median time (the two GEMMs of the absorbed decode,
2 x (576 + 512) flop per (query row, KV token)), beside the GB/s: with 64+ query rows per sequence (128 heads, MTP)
decode is compute-bound.
``--grid HEADSxQ_LEN,...`` runs every case at each (heads, query tokens) point and ends with one table of them all.

Achieved GB/s = ``mla_bench.cases.bytes_moved(...)`` / median time; the read ceiling (``torch.sum`` over a 4 GiB bf16
tensor) is measured in the same run. Without a CUDA device the script compiles, for sm_90a on the CPU, every kernel
variant the same command line would use, prints the modelled split counts, and exits.

This file is the command line only (its flags and ``main``); the timing, the cases, the peers, the tables, the JSON
and the plot live in the ``mla_bench`` package (its docstring lists the modules), which ``tools/`` imports too.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys

REPO_DIR = os.path.dirname(os.path.abspath(__file__))
if REPO_DIR not in sys.path:
    sys.path.insert(0, REPO_DIR)

import torch  # noqa: E402

from mla.decode import SUPPORTED_HEADS  # noqa: E402
from mla_bench.cases import (MODES, build_cases, parse_grid, parse_modes, parse_shapes,  # noqa: E402
                             positive_int)
from mla_bench.host import HOST_CALLS, HOST_SHAPE  # noqa: E402
from mla_bench.graph import GRAPH_SHAPES  # noqa: E402
from mla_bench.run import compile_only, run_benchmark, run_graph_table  # noqa: E402
from mla_bench.timing import DEFAULT_REPS, WARMUP_CALLS  # noqa: E402

log = logging.getLogger("mla")


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        description="Time the TileLang MLA decode kernels (H200) against torch baselines, FlashInfer and FlashMLA.",
        epilog="\n\n".join(__doc__.split("\n\n")[1:5]),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--modes", type=parse_modes, default=None,
                        help=f"comma-separated subset of {','.join(MODES)} (default: all; with --graph, bf16)")
    parser.add_argument("--shapes", type=parse_shapes, default=None,
                        help="comma-separated BATCHxKV_LEN, e.g. 4x1024,256x8192; 'none' for no uniform shape "
                             "(default: the 8 harness shapes, batch 4/32/64/256 x kv 1024/8192)")
    parser.add_argument("--ragged", action="store_true",
                        help="add ragged batches: 64 sequences of 1..8192 tokens, 128 of 1..2048 (fixed seed)")
    parser.add_argument("--long", action="store_true", help="add 32k contexts: batch 4 and 16 x 32768")
    parser.add_argument("--q-len", type=positive_int, default=1, help="query tokens per sequence (MTP; default 1)")
    parser.add_argument("--heads", type=int, choices=SUPPORTED_HEADS, default=16, help="query heads (default 16)")
    parser.add_argument("--grid", type=parse_grid, default=None,
                        help="comma-separated HEADSxQ_LEN points, e.g. 128x4,128x1,64x1,16x4,16x8: every case at each "
                             "point (replaces --heads / --q-len for the timed cases), then one table of all of them")
    parser.add_argument("--rows", action="store_true",
                        help="let the 64-row kernel class serve problems of 64+ query rows per sequence (opt-in while "
                             "mla.schedule.ROWS_BY_DEFAULT is False)")
    parser.add_argument("--page-size", type=positive_int, default=None,
                        help="read the KV through a page table: caches laid out in shuffled pages of this many tokens")
    parser.add_argument("--plan", action="store_true",
                        help="time DecodePlan.run (mla.decode.plan made once per shape, untimed, as FlashInfer's "
                             "plan is) instead of the one-shot mla_decode call")
    parser.add_argument("--graph", action="store_true",
                        help="only the CUDA-graph table (mla_bench/graph.py): SGLang's and vLLM's replay patterns of "
                             "mla.flash_mla against an eager call planned for the same lengths and FlashMLA's own "
                             f"replay; default shapes {GRAPH_SHAPES}, default mode bf16")
    parser.add_argument("--splits", type=positive_int, default=None,
                        help="force num_splits (default: the op's own choice, schedule.choose_num_splits)")
    parser.add_argument("--host-shape", type=parse_shapes, default=parse_shapes(HOST_SHAPE),
                        help=f"BATCHxKV_LEN of the host-cost table (default {HOST_SHAPE}; 'none' skips it): wall us "
                             f"per call in a loop of --host-calls eager calls, and that minus the call's GPU time, for "
                             f"every mode (mla_decode and DecodePlan.run) and peer")
    parser.add_argument("--host-calls", type=positive_int, default=HOST_CALLS,
                        help=f"calls per host-cost loop (default {HOST_CALLS})")
    parser.add_argument("--no-baselines", action="store_true", help="skip the naive torch baselines")
    parser.add_argument("--no-peers", action="store_true", help="skip the peers (FlashInfer, FlashMLA, AMD aiter)")
    parser.add_argument("--config", type=json.loads, default=None, metavar="JSON",
                        help='kernel config overrides for our op (tuning; e.g. \'{"ws": false}\' for the 16/32/64-row '
                             'kernel instead of the warp-specialised one)')
    parser.add_argument("--json", metavar="PATH", help="write every measurement to PATH as JSON")
    parser.add_argument("--plot", metavar="PATH", help="write a PNG bar chart of achieved GB/s (needs matplotlib)")
    parser.add_argument("--reps", type=positive_int, default=DEFAULT_REPS,
                        help=f"timed reps per measurement (default {DEFAULT_REPS}, after {WARMUP_CALLS} warm-up calls)")
    parser.add_argument("--check", action="store_true",
                        help="before timing, compare each implementation once per shape with the fp32 reference")
    args = parser.parse_args(argv)
    if args.modes is None:
        args.modes = ["bf16"] if args.graph else list(MODES)
    if args.graph:  # the graph table's own defaults
        if args.shapes is None:
            args.shapes = parse_shapes(GRAPH_SHAPES)
        args.host_shape = []
    if len(args.host_shape) > 1:
        parser.error("--host-shape takes one BATCHxKV_LEN")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    logging.basicConfig(format="%(message)s")
    log.setLevel(logging.INFO)  # the "mla: <kernel> ready in X s" lines
    try:
        sys.stdout.reconfigure(line_buffering=True)
    except AttributeError:
        pass
    cases = build_cases(args)
    if not cases and not args.host_shape:
        print("nothing to run: no shapes (add --ragged or --long, or give --shapes or --host-shape)")
        return 2
    if not torch.cuda.is_available():
        return compile_only(args, cases)
    if args.graph:
        return run_graph_table(args, cases)
    return run_benchmark(args, cases)


if __name__ == "__main__":
    sys.exit(main())
