"""Host cost of one op call. By default without a GPU: ``mla_decode`` and ``DecodePlan.run`` with the target forced to
sm_90a, the kernels replaced by no-op launchers and the tensors on the ``meta`` device (shape-only: allocating and
viewing them costs what it costs on the host, no data is touched). That is the host work the op adds around its
kernel launches (signature lookup, allocations, argument packing; a meta tensor also re-reads $MLA_TARGET, ~0.4 us);
on the GPU host a launch adds the tvm-ffi call itself and CUDA allocations cost more than meta ones, which
``--device cuda`` measures (real kernels, real tensors; the GPU may then be the limit: see bench.py's host table).

    python tools/host_cost.py                       # every mode, flat and paged (page 64), eager, plan and (paged)
                                                    # flash_mla_with_kvcache with reused metadata, 4 x 1024
    python tools/host_cost.py --calls 20000 --batch 64 --kv-len 8192
    python tools/host_cost.py --profile bf16        # cProfile of the eager bf16 call (top 25 by own time)
    python tools/host_cost.py --profile fp8 --call flash --page-size 64     # ... of another entry point
    python tools/host_cost.py --device cuda --profile bf16      # the same with real kernels (GPU host)
    python tools/host_cost.py --device cuda --primitives        # us per torch.empty / view / as_strided / launch ...
    python tools/host_cost.py --device cuda --a8w8              # the ways to compute a8w8's amax(|q|), host and GPU
    python tools/host_cost.py --device cuda --breakdown         # one plan.run per mode: its launches alone, its
                                                                # Python alone (launchers made no-ops)
    python tools/host_cost.py --device cuda --idle              # host time per call with the GPU held against
                                                                # with it idle (bench.py's host table), torch
                                                                # launches beside ours, and a torch.profiler summary

Each line: the median over 5 rounds of (wall time of ``--calls`` back-to-back calls / calls), in us; on cuda the
host's time alone: each round enqueues at most 200 calls while a sleep kernel holds the GPU (``per_call_us``).
"""

from __future__ import annotations

import argparse
import functools
import math
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("MLA_TARGET", "sm_90a")

import torch  # noqa: E402

from mla import jit  # noqa: E402
from mla.constants import MODES  # noqa: E402
from mla_bench import timing  # noqa: E402
from mla_bench.calls import flash_mla_extras  # noqa: E402

ROUNDS = 5
DEVICE = "meta"  # --device sets it


def no_op_launcher(cfg, spec):
    """Stands in for ``jit.get_launcher``: a launcher that takes the kernel's positional arguments and does nothing."""
    return lambda *args: None


def inputs(mode: str, batch: int, kv_len: int, heads: int, page_size: int):
    """(q, kv cache, qo_indptr, kv_indptr, cache keywords, page table or None) on the meta device."""
    kv_format, q_format = MODES[mode]
    total_kv = batch * kv_len
    q = torch.randn(batch, heads, 576, device=DEVICE).to(torch.bfloat16)
    qo = torch.arange(batch + 1, dtype=torch.int32, device=DEVICE)
    kvp = torch.arange(batch + 1, dtype=torch.int32, device=DEVICE) * kv_len
    row = 288 if kv_format == "mxfp4" else 576
    dtype = {"bf16": torch.bfloat16, "fp8": torch.float8_e4m3fn, "mxfp4": torch.uint8}[kv_format]
    shape = (batch * -(-kv_len // page_size), page_size, 1, row) if page_size else (total_kv, 1, row)
    kv = torch.zeros(shape, dtype=dtype, device=DEVICE)
    kwargs = dict(kv_format=kv_format, q_format=q_format)
    if kv_format == "fp8":
        kwargs["kv_scale"] = torch.ones(1, dtype=torch.float32, device=DEVICE)
    if kv_format == "mxfp4":
        kwargs["kv_block_scale"] = torch.full((total_kv, 18), 127, dtype=torch.uint8, device=DEVICE)
    table = None
    if page_size:  # sequence b owns pages b * pages_per_seq ...
        pages = -(-kv_len // page_size)
        table = torch.arange(batch * pages, dtype=torch.int32, device=DEVICE).view(batch, pages)
    return q, kv, qo, kvp, kwargs, table


def synchronize() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


HELD_CALLS = 200  # calls per round on cuda: their launches must fit the launch queue behind the sleep kernel
HELD_US_PER_CALL = 150.0  # sleep per queued call: longer than any call's host time here


def per_call_us(fn, calls: int) -> float:
    """Median over ROUNDS of the host time per call of ``calls`` back-to-back calls. On cuda the GPU is held by a
    sleep kernel while the host enqueues HELD_CALLS calls per round, so the time is the host's alone (not the GPU's,
    which back-to-back calls of a short kernel would otherwise measure); a round the sleep did not cover fails."""
    for _ in range(min(calls, 200)):  # warm-up: builds the caches
        fn()
    rounds = []
    for _ in range(ROUNDS):
        synchronize()
        if DEVICE == "cuda":
            calls = min(calls, HELD_CALLS)
            held_us = calls * HELD_US_PER_CALL
            torch.cuda._sleep(int(held_us * _cycles_per_us()))
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        elapsed_us = (time.perf_counter() - start) * 1e6
        if DEVICE == "cuda" and elapsed_us > held_us:
            raise RuntimeError(f"host_cost: {calls} calls took {elapsed_us:.0f} us, longer than the GPU was held")
        synchronize()
        rounds.append(elapsed_us / calls)
    return statistics.median(rounds)


@functools.lru_cache(maxsize=None)
def _cycles_per_us() -> float:
    return timing.sleep_cycles_per_us()


def callables(mode: str, args, page_size: int):
    """{"eager": the mla_decode call, "plan": the DecodePlan.run call, and for a paged cache "flash": the
    ``mla.flash_mla.flash_mla_with_kvcache`` call with reused metadata} for one mode."""
    from mla.decode import mla_decode, plan
    from mla.flash_mla import MLAMetadata, flash_mla_with_kvcache, get_mla_metadata

    q, kv, qo, kvp, kwargs, table = inputs(mode, args.batch, args.kv_len, args.heads, page_size)
    kv_lens = [args.kv_len] * args.batch
    offsets = [i * args.kv_len for i in range(args.batch + 1)]
    paging = dict(page_size=page_size, page_table=table) if page_size else {}
    the_plan = plan(list(range(args.batch + 1)), offsets, num_heads=args.heads, kv_format=kwargs["kv_format"],
                    q_format=kwargs["q_format"], device=DEVICE, **paging)
    assert the_plan.batch == len(kv_lens)
    run_kwargs = {k: v for k, v in kwargs.items() if k in ("kv_scale", "kv_block_scale")}

    def eager():
        return mla_decode(q, kv, qo, kvp, page_table=table, **kwargs)

    def planned():
        return the_plan.run(q, kv, **run_kwargs)

    planned.plan = the_plan  # for --breakdown
    fns = {"eager": eager, "plan": planned}
    if page_size:
        seqlens = torch.full((args.batch,), args.kv_len, dtype=torch.int32, device=DEVICE)
        # On meta tensors the lengths cannot be read back: the metadata is given them (as get_mla_metadata's old
        # pattern reads them); on cuda, FlashMLA's current pattern (filled by the first call).
        meta = MLAMetadata(kv_lens) if DEVICE == "meta" else get_mla_metadata()[0]
        q4 = q.view(args.batch, 1, args.heads, 576)
        flash_kw = flash_mla_extras(kwargs)

        def flash():
            return flash_mla_with_kvcache(q4, kv, table, seqlens, 512, meta, is_fp8_kvcache=kwargs["kv_format"] == "fp8",
                                          **flash_kw)

        fns["flash"] = flash
    return fns


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--kv-len", type=int, default=1024)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--page-size", type=int, default=64, help="page size of the paged rows (0: flat only)")
    parser.add_argument("--calls", type=int, default=5000)
    parser.add_argument("--profile", metavar="MODE", help="cProfile one call of MODE instead (--call)")
    parser.add_argument("--call", choices=("eager", "plan", "flash"), default="eager",
                        help="the entry point --profile profiles (flash: paged, with --page-size)")
    parser.add_argument("--device", choices=("meta", "cuda"), default="meta",
                        help="meta: no-op launchers (default); cuda: the real kernels")
    parser.add_argument("--primitives", action="store_true", help="time the torch / tvm-ffi primitives of a call")
    parser.add_argument("--a8w8", action="store_true", help="time the ways to compute a8w8's amax(|q|)")
    parser.add_argument("--idle", action="store_true",
                        help="cuda: per call, the host time with the GPU held vs idle, beside torch launches")
    parser.add_argument("--breakdown", action="store_true",
                        help="per mode: plan.run, each of its kernel launches alone, and plan.run with no-op launchers")
    args = parser.parse_args(argv)
    global DEVICE
    DEVICE = args.device
    if DEVICE == "meta":
        jit.get_launcher = no_op_launcher  # before the op's first call: every kernel it selects is a no-op
    else:
        os.environ.pop("MLA_TARGET", None)
    if args.primitives:
        return print_primitives(args)
    if args.a8w8:
        return print_a8w8_options(args)
    if args.breakdown:
        return print_breakdown(args)
    if args.idle:
        return print_idle(args)
    if args.profile:
        import cProfile
        import pstats

        fn = callables(args.profile, args, args.page_size if args.call == "flash" else 0)[args.call]
        per_call_us(fn, 200)
        profiler = cProfile.Profile()
        profiler.enable()
        for _ in range(args.calls):
            fn()
        profiler.disable()
        pstats.Stats(profiler).sort_stats("tottime").print_stats(25)
        return 0
    what = "meta tensors, no-op launchers" if DEVICE == "meta" else "CUDA tensors, real kernels"
    print(f"host cost per call, us ({what}; batch {args.batch} x kv {args.kv_len}, "
          f"{args.heads} heads, median of {ROUNDS} x {args.calls} calls)")
    print(f"  {'mode':<6} {'layout':<8} {'eager':>8} {'plan':>8} {'flash':>8}   (flash: flash_mla_with_kvcache, "
          "reused metadata; paged only)")
    for mode in args.modes.split(","):
        for page_size in (0, args.page_size) if args.page_size else (0,):
            fns = callables(mode, args, page_size)
            eager, planned = per_call_us(fns["eager"], args.calls), per_call_us(fns["plan"], args.calls)
            flash = f"{per_call_us(fns['flash'], args.calls):8.2f}" if "flash" in fns else f"{'-':>8}"
            layout = f"page{page_size}" if page_size else "flat"
            print(f"  {mode:<6} {layout:<8} {eager:8.2f} {planned:8.2f} {flash}", flush=True)
    return 0


def print_primitives(args) -> int:
    """us per call of the operations a call is made of, on --device."""
    q, kv, qo, kvp, _, _ = inputs("bf16", args.batch, args.kv_len, args.heads, 0)
    rows = args.batch * args.heads
    ops = {
        "torch.empty out (bf16)": lambda: torch.empty((args.batch, args.heads, 512), dtype=torch.bfloat16, device=DEVICE),
        "torch.empty partials (fp32)": lambda: torch.empty(16 * rows * 513, dtype=torch.float32, device=DEVICE),
        "torch.empty out, sizes unpacked": lambda: torch.empty(args.batch, args.heads, 512, dtype=torch.bfloat16,
                                                               device=DEVICE),
        "torch.empty_like out": lambda: torch.empty_like(q),
        "as_strided": lambda: kv.as_strided((rows, 512), (512, 1), 0),
        "unsqueeze": lambda: q.unsqueeze(1),
        "view": lambda: kv.view(kv.shape[0], 576),
        "signature key": lambda: (q.dtype, q.shape, q.device, q.is_contiguous(), kv.dtype, kv.shape, kv.stride(),
                                  kv.device, qo.dtype, qo.shape, qo.device, qo.is_contiguous()),
    }
    if DEVICE == "cuda":
        import tvm_ffi

        nop = tvm_ffi.get_global_func("testing.nop", allow_missing=True)
        if nop is not None:
            args12 = [q, kv, qo, kvp, q, kv, qo, kvp, q, kv, qo, kvp]
            ops["tvm-ffi call, no arguments"] = lambda: nop()
            ops["tvm-ffi call, 12 ints"] = lambda: nop(*range(12))
            ops["tvm-ffi call, 1 CUDA tensor"] = lambda: nop(q)
            ops["tvm-ffi call, 12 CUDA tensors (no launch)"] = lambda: nop(*args12)
        print(f"torch {torch.__version__}, tvm_ffi {tvm_ffi.__version__}; torch.Tensor has "
              f"__dlpack_c_exchange_api__: {hasattr(torch.Tensor, '__dlpack_c_exchange_api__')}")
        ops["raw current stream"] = lambda: torch._C._cuda_getCurrentRawStream(q.device.index)
        ops["torch.cuda.current_stream()"] = torch.cuda.current_stream
        ops["capture check (_cuda_isCurrentStreamCapturing)"] = torch._C._cuda_isCurrentStreamCapturing
        ops["q.view(4-D -> 3-D)"] = lambda: q.view(args.batch, args.heads, 576)
        lse_like = torch.zeros(args.batch, args.heads, device=DEVICE)
        ops["nan_to_num of an LSE (1 launch)"] = lambda: torch.nan_to_num(lse_like, nan=math.nan, posinf=math.inf,
                                                                         neginf=math.inf)
        from mla import jit as real_jit, schedule
        from mla.target import spec_for_device

        spec = spec_for_device(q.device)
        combine = real_jit.get_launcher(schedule.combine_config(spec, num_heads=args.heads), spec)
        o_part = torch.zeros(16, args.batch, args.heads, 512, device=DEVICE)
        l_part = torch.zeros(16, args.batch, args.heads, device=DEVICE)
        out = torch.empty(args.batch, args.heads, 512, dtype=torch.bfloat16, device=DEVICE)
        lse = torch.empty(args.batch, args.heads, device=DEVICE)
        ops["combine kernel launch (4 tensors)"] = lambda: combine(o_part, l_part, out, lse)
    print(f"us per call on {DEVICE} (median of {ROUNDS} x {args.calls})")
    for name, fn in ops.items():
        print(f"  {name:<44} {per_call_us(fn, args.calls):8.2f}", flush=True)
    return 0


def captured_launches(planned):
    """(the plan's Launch, its launchers by name, the positional arguments one ``planned()`` call passed each): the
    launchers are wrapped for one call, then put back."""
    planned()
    launch = next(iter(planned.plan._launches.values()))
    real = {name: getattr(launch, name) for name in ("decode", "combine") if getattr(launch, name) is not None}
    captured = {}
    for name, fn in real.items():
        setattr(launch, name, lambda *a, _n=name, _f=fn: (captured.__setitem__(_n, a), _f(*a)))
    planned()
    for name, fn in real.items():
        setattr(launch, name, fn)
    return launch, real, captured


def print_breakdown(args) -> int:
    """Where one ``DecodePlan.run`` spends its host time: the whole call, each kernel launcher called alone with the
    arguments the run passed it, and the run with its launchers replaced by no-ops (the op's Python and torch work)."""
    print(f"plan.run breakdown, us per call on {DEVICE} (batch {args.batch} x kv {args.kv_len}, {args.heads} heads, "
          f"median of {ROUNDS} x {args.calls})")
    print(f"  {'mode':<6} {'run':>8} {'no-op launchers':>16}   launches alone (positional tensors / other args)")
    for mode in args.modes.split(","):
        fns = callables(mode, args, 0)
        planned = fns["plan"]
        launch, real, captured = captured_launches(planned)
        for name in real:
            setattr(launch, name, lambda *a: None)
        python_only = per_call_us(planned, args.calls)
        for name, fn in real.items():
            setattr(launch, name, fn)
        whole = per_call_us(planned, args.calls)
        alone = []
        for name, fn in real.items():
            a = captured[name]
            tensors = sum(isinstance(x, torch.Tensor) for x in a)
            alone.append(f"{name} {per_call_us(lambda: fn(*a), args.calls):.2f} ({tensors}/{len(a) - tensors})")
        print(f"  {mode:<6} {whole:8.2f} {python_only:16.2f}   " + ", ".join(alone), flush=True)
    return 0


def _busy_wait_us(us: float) -> None:
    end = time.perf_counter() + us * 1e-6
    while time.perf_counter() < end:
        pass


def idle_per_call_us(fn, calls: int) -> tuple[float, float]:
    """(enqueue, total) us per call of ``calls`` back-to-back calls on an idle GPU, as bench.py's host table makes
    them: the host's time to return from the calls, and that plus the final synchronisation; medians of ROUNDS."""
    for _ in range(min(calls, 200)):
        fn()
    enqueued, total = [], []
    for _ in range(ROUNDS):
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        enqueued.append((time.perf_counter() - start) * 1e6 / calls)
        torch.cuda.synchronize()
        total.append((time.perf_counter() - start) * 1e6 / calls)
    return statistics.median(enqueued), statistics.median(total)


def print_idle(args) -> int:
    """Is a call's host time the same with the GPU held by a sleep kernel (``per_call_us``) and with it idle, each
    call's kernels starting at once (``idle_per_call_us``, what bench.py's host table sees)? For torch's own
    launches, our launchers alone (the arguments one plan.run passed them), plan.run (the default, and decode +
    combine forced), its Python alone and the eager call; then torch.profiler's CPU-side summary of idle plan.run calls
    (the CUDA driver and runtime calls, with their mean durations)."""
    if DEVICE != "cuda":
        print("--idle needs --device cuda")
        return 1
    from mla.decode import plan

    calls = min(args.calls, HELD_CALLS)
    cell = torch.zeros(1, device="cuda")
    fns = {"torch: x.add_(1), 1 launch": lambda: cell.add_(1),
           "torch: x.add_(1) twice, 2 launches": lambda: (cell.add_(1), cell.add_(1)),
           "torch.empty of the output": lambda: torch.empty(args.batch, args.heads, 512, dtype=torch.bfloat16,
                                                             device="cuda")}
    for mode in args.modes.split(","):
        base = callables(mode, args, 0)
        planned = base["plan"]
        _, real, captured = captured_launches(planned)
        for name, fn in real.items():
            fns[f"{mode}: {name} launch alone"] = lambda _f=fn, _a=captured[name]: _f(*_a)
        fns[f"{mode}: plan.run ({len(real)} launches)"] = planned
        the_plan = planned.plan
        q, kv, qo, kvp, kwargs, _ = inputs(mode, args.batch, args.kv_len, args.heads, 0)
        run_kwargs = {k: v for k, v in kwargs.items() if k in ("kv_scale", "kv_block_scale")}
        two_kernels = plan(list(range(args.batch + 1)), [i * args.kv_len for i in range(args.batch + 1)],
                           num_heads=args.heads, kv_format=kwargs["kv_format"], q_format=kwargs["q_format"],
                           device="cuda", num_splits=the_plan.num_splits, config_overrides={"fused_combine": False})
        fns[f"{mode}: plan.run, decode + combine forced"] = lambda _p=two_kernels, _q=q, _kv=kv, _k=run_kwargs: _p.run(
            _q, _kv, **_k)
        fns[f"{mode}: eager mla_decode"] = base["eager"]
        noop_plan = callables(mode, args, 0)["plan"]
        noop_launch, _, _ = captured_launches(noop_plan)
        for name in real:
            setattr(noop_launch, name, lambda *a: None)
        fns[f"{mode}: plan.run, launchers no-ops"] = noop_plan
    # A torch kernel of about the decode's GPU time, and the same calls with the host made slower than the GPU
    # (a busy wait): does a host-bound loop cost its host time, or more?
    a = torch.randn(1536, 1536, dtype=torch.bfloat16, device="cuda")
    fns["torch: 1536^3 bf16 matmul"] = lambda: a @ a
    fns["torch: matmul + 20 us host busy wait"] = lambda: (a @ a, _busy_wait_us(20.0))
    for name in [n for n in fns if n.endswith("decode launch alone") or ": plan.run (" in n]:
        fns[name + " + 20 us host busy wait"] = lambda _f=fns[name]: (_f(), _busy_wait_us(20.0))
    print(f"host us per call (batch {args.batch} x kv {args.kv_len}, {args.heads} heads, {calls} calls, median of "
          f"{ROUNDS}): GPU held | GPU idle: enqueue, and with the final synchronisation | GPU us per call, "
          "queued behind a sleep kernel")
    for name, fn in fns.items():
        held = per_call_us(fn, calls)
        enqueue, total = idle_per_call_us(fn, calls)
        gpu = statistics.median(timing.gpu_us_per_call(fn, 50, held, _cycles_per_us())["gpu_us"] for _ in range(3))
        print(f"  {name:<56} {held:8.2f} | {enqueue:8.2f} {total:8.2f} | {gpu:8.2f}", flush=True)
    from torch.profiler import ProfilerActivity, profile

    for name in [n for n in fns if "plan.run (" in n or "x.add_(1), 1" in n]:
        fn = fns[name]
        for held in (False, True):
            for _ in range(20):
                fn()
            torch.cuda.synchronize()
            if held:
                torch.cuda._sleep(int(100 * HELD_US_PER_CALL * _cycles_per_us()))
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                for _ in range(100):
                    fn()
                torch.cuda.synchronize()
            print(f"\ntorch.profiler, 100 calls of {name}, GPU {'held' if held else 'idle'}:")
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12, max_name_column_width=40))
    return 0


def print_a8w8_options(args) -> int:
    """a8w8 needs amax(|q|) over all of Q as a (1,) float32 before the decode kernel (the kernels cannot fuse it:
    every CTA would need the whole of Q). Host us per call, and on cuda the GPU time, of the ways to get it."""
    q = inputs("bf16", args.batch, args.kv_len, args.heads, 0)[0]
    slot = torch.empty(1, dtype=torch.float32, device=DEVICE)  # the workspace's amax: (1,) and a 0-d view
    slot_0d = slot.view(())

    def into_slot():
        torch.linalg.vector_norm(q, ord=math.inf, dtype=torch.float32, out=slot_0d)
        return slot

    options = {
        "vector_norm(q, inf, dtype=fp32, out=slot) [the op's]": into_slot,
        "vector_norm(q, inf, dtype=fp32).reshape(1)":
            lambda: torch.linalg.vector_norm(q, ord=math.inf, dtype=torch.float32).reshape(1),
        "vector_norm(q.view(1, -1), inf, dim=1, dtype=fp32)":
            lambda: torch.linalg.vector_norm(q.view(1, -1), ord=math.inf, dim=1, dtype=torch.float32),
        "q.abs().amax().float().reshape(1)": lambda: q.abs().amax().float().reshape(1),
        "torch.aminmax(q) -> max(-min, max)": lambda: torch.stack(torch.aminmax(q)).abs().amax().float().reshape(1),
    }
    reference = options["q.abs().amax().float().reshape(1)"]()
    gpu = None
    if DEVICE == "cuda":
        cycles = _cycles_per_us()
        gpu = lambda fn, host: timing.gpu_us_per_call(fn, 50, host, cycles)["gpu_us"]  # noqa: E731
    print(f"a8w8 amax(|q|) of q ({args.batch}, {args.heads}, 576) on {DEVICE}: host us per call"
          + (", GPU us per call" if gpu else ""))
    for name, fn in options.items():
        if DEVICE != "meta":
            assert torch.equal(fn(), reference), name
        host = per_call_us(fn, args.calls)
        print(f"  {name:<56} {host:8.2f}" + (f" {gpu(fn, host):8.2f}" if gpu else ""), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
