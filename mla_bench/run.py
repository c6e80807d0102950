"""A whole benchmark run from the parsed command line (``bench.py``'s ``args``) and its cases.

``run_benchmark`` (a CUDA device): the header and the read ceiling, every case at every (heads, q_len) point, the
host-cost table, then the JSON / plot and the summary tables; exit status 1 when one of our calls failed.
``compile_only`` (no CUDA device): compiles, for sm_90a on the CPU, every kernel variant the same command line would
launch, after the table of modelled split counts; exit status 1 when a variant failed to compile.
"""

from __future__ import annotations

import torch

from mla import prebuild, schedule, target
from mla.constants import MODES as MODE_FORMATS
from mla_bench import peers as peer_lib
from mla_bench.cases import Case, at_point, grid_points, mode_overrides, selected_kernels, uniform_case
from mla_bench.graph import GRAPH_TARGET, bench_graph, print_graph_header
from mla_bench.host import bench_host, print_host_summary
from mla_bench.jsonio import write_json
from mla_bench.measure import Bench, bench_case
from mla_bench.plots import write_plot
from mla_bench.report import (print_ceiling, print_grid_summary, print_header, print_peers, print_split_table,
                              print_summary)
from mla_bench.timing import FLUSH_BYTES, measure_read_ceiling

DEVICE = "cuda"


def kernel_configs(args, cases: list[Case], spec) -> list:
    """Every kernel variant this command line would launch on ``spec`` (each case, mode and grid point), once; with
    ``--graph`` those of the graph table (``mla.prebuild.class_variants`` of mla.flash_mla's class)."""
    if getattr(args, "graph", False):
        return prebuild.unique(cfg for mode in args.modes for cfg in prebuild.class_variants(
            spec, mode=mode, num_heads=args.heads, page_size=64, flash_mla=True))
    configs = []
    for heads, q_len in grid_points(args):
        for case in cases:
            for mode in args.modes:
                decode, combine, _ = selected_kernels(spec, mode, case, at_point(args, heads, q_len))
                configs += [cfg for cfg in (decode, combine) if cfg is not None]
                amax = schedule.amax_launch(spec, decode, q_format=MODE_FORMATS[mode][1], num_heads=heads,
                                            amax_kernel=(mode_overrides(args) or {}).get("amax_kernel", True))
                configs += [amax] if amax is not None else []
    return list(dict.fromkeys(configs))


def _setup(args) -> tuple:
    """(Bench, read ceiling, device name) of a run on the GPU: the header, the ceiling, the flush buffer, the peers."""
    device_name = torch.cuda.get_device_name()
    spec = target.spec_for_device(torch.device(DEVICE))
    print_header(args, spec, device_name)
    ceiling = measure_read_ceiling(DEVICE)
    print_ceiling(ceiling)
    flush = torch.empty(FLUSH_BYTES, dtype=torch.uint8, device=DEVICE)
    peers = [] if args.no_peers else peer_lib.setup_peers(DEVICE)
    print_peers(peers, args)
    bench = Bench(args=args, spec=spec, device=DEVICE, flush=flush, ceiling_gbps=ceiling["gbps"], peers=peers)
    return bench, ceiling, device_name


def run_graph_table(args, cases: list[Case]) -> int:
    """``--graph``: the CUDA-graph table (mla_bench.graph) over the uniform shapes and the modes; JSON if asked."""
    bench, ceiling, device_name = _setup(args)
    print_graph_header(bench)
    rows = [bench_graph(bench, case.batch, case.kv_lens[0], mode) for case in cases if case.uniform
            for mode in args.modes]
    if args.json:
        write_json(args.json, rows, ceiling, args, device_name)
    failed = [r for r in rows if "error" in r or not r.get("meets_target", False)]
    print(f"graph table: {len(rows) - len(failed)} of {len(rows)} rows within {GRAPH_TARGET}x of the faster of the "
          f"eager planned call and FlashMLA's replay")
    return 1 if any("error" in r for r in rows) else 0


def compile_only(args, cases: list[Case]) -> int:
    """No GPU: build, for sm_90a, every kernel variant this command line would run, in parallel over the machine's
    cores (``mla.prebuild.build``); 0 when all compiled."""
    print("no CUDA device: timing skipped. Compiling the kernel variants this run would use, for sm_90a, on the CPU.")
    spec = target.spec_for_name("sm_90a")
    cases = list(dict.fromkeys(cases + [uniform_case(*shape) for shape in args.host_shape]))  # + the host table's
    print_split_table(spec, cases, args)
    configs = kernel_configs(args, cases, spec)
    results = prebuild.build(configs, spec, progress=True, label="bench.py")  # logs each failure
    failures = sum(1 for r in results if r.error)
    print(f"{len(configs) - failures} of {len(configs)} kernel variants compiled for {spec.name}")
    return 1 if failures else 0


def run_benchmark(args, cases: list[Case]) -> int:
    """Time every case at every grid point, then the host table; print, and write JSON / plot if asked."""
    bench, ceiling, device_name = _setup(args)
    rows = []
    points = grid_points(args)
    for heads, q_len in points:
        bench.args = at_point(args, heads, q_len)
        for case in cases:
            rows += bench_case(bench, case)
    bench.args = args
    for shape in args.host_shape:
        rows += bench_host(bench, uniform_case(*shape))
    if args.json:
        write_json(args.json, rows, ceiling, args, device_name)
    if args.plot:
        title = f"MLA decode, {device_name}, q_len {args.q_len}, {args.heads} heads"
        write_plot(args.plot, rows, cases, ceiling["gbps"], title)
    for heads, q_len in points:
        at = [r for r in rows if r["kind"] == "host" or (r.get("heads"), r.get("q_len")) == (heads, q_len)]
        print_summary(at, cases, ceiling["gbps"], at_point(args, heads, q_len))
    if len(points) > 1:
        print_grid_summary(rows, cases, points, args)
    print_host_summary(rows)
    return 1 if any(r["kind"] in ("mode", "host") and "error" in r and not r.get("peer") for r in rows) else 0
