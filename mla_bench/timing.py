"""GPU timing, as the competition harness times, and the host-cost timers.

``time_call_us``: CUDA events around ONE call, the L2 flushed (a ``FLUSH_BYTES`` write) before each rep and the host
synchronized after it: per-rep microseconds, of which the callers take the median. ``measure_read_ceiling``: the read
bandwidth ``torch.sum`` achieves over 4 GiB of bf16, the denominator of "% of the read ceiling".
``host_us_per_call``: wall time per call of calls back to back (warm L2); ``gpu_us_per_call``: their GPU time with
the GPU never waiting for the host (the calls queued behind a ``torch.cuda._sleep`` kernel). All times in us.
"""

from __future__ import annotations

import functools
import statistics
import time

import torch

WARMUP_CALLS = 5  # untimed calls before the reps of time_call_us
DEFAULT_REPS = 50
FLUSH_BYTES = 256 * 2**20  # >= 256 MB written before each rep: the H200's L2 is 50 MiB
CEILING_BYTES = 4 * 2**30  # torch.sum over this many bytes of bf16 (half of it when memory is short)
CEILING_REPS = 10
HOST_WARMUP_CALLS = 20  # untimed calls before a host_us_per_call loop
# The A/B tools' host_slack_us (tools/override_ab.py, tools/ws_check.py): their per-call config overrides make the
# op's host path 87-137 us, longer than the flush (docs/perf.md run 62: fp8 4 x 1024 timed 34-166 us for a ~17 us
# kernel), so they time each call behind a GPU sleep of this long.
AB_HOST_SLACK_US = 400.0


def time_call_us(fn, *, reps: int, warmup: int, flush: torch.Tensor | None,
                 host_slack_us: float = 0.0) -> list[float]:
    """Per-rep times (us) of ``fn()``: CUDA events around one call, the L2 flushed (``flush.zero_()``) before each
    rep and the host synchronized after each, as the competition harness does. ``host_slack_us`` > 0: a sleep kernel
    of that long between the flush and the start event, so a host path slower than the flush (the A/B tools'
    per-call config overrides: docs/perf.md run 62) is enqueued before the GPU reaches the call, and the time is the
    GPU's alone; 0 (the bench's and the harness's timing) leaves the host's cost in where it shows."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    sleep_cycles = int(host_slack_us * sleep_cycles_per_us()) if host_slack_us > 0 else 0
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times_us = []
    for _ in range(reps):
        if flush is not None:
            flush.zero_()
        if sleep_cycles:
            torch.cuda._sleep(sleep_cycles)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times_us.append(start.elapsed_time(end) * 1e3)
    return times_us


def spin_up(seconds: float = 1.0, device: str = "cuda") -> None:
    """Keep the GPU busy for about ``seconds`` (bf16 matmuls) before timing, so the first kernel timed does not pay
    for clocks still ramping up (docs/perf.md run 51: the first kernel ws_check timed came out ~35% slow at every
    split count, the same kernel in bench.py, after its read-ceiling measurement, did not)."""
    a = torch.randn(4096, 4096, device=device, dtype=torch.bfloat16)
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        for _ in range(8):
            a = (a @ a).clamp_(-1, 1)
        torch.cuda.synchronize()


def gbps_of(bytes_read: float, time_us: float) -> float:
    """GB/s (1e9 bytes per second) of ``bytes_read`` bytes in ``time_us`` us."""
    return bytes_read / time_us / 1e3


def measure_read_ceiling(device: str) -> dict:
    """Read bandwidth that torch.sum over a 4 GiB bf16 tensor (2 GiB if memory is short) achieves; median.
    ``{"bytes", "time_us", "gbps", "times_us"}``."""
    free_bytes, _ = torch.cuda.mem_get_info()
    nbytes = CEILING_BYTES if free_bytes > 2 * CEILING_BYTES else CEILING_BYTES // 2
    data = torch.ones(nbytes // 2, dtype=torch.bfloat16, device=device)  # 2 bytes per bf16
    times_us = time_call_us(functools.partial(torch.sum, data), reps=CEILING_REPS, warmup=2, flush=None)
    del data
    torch.cuda.empty_cache()
    time_us = statistics.median(times_us)
    return {"bytes": nbytes, "time_us": time_us, "gbps": gbps_of(nbytes, time_us), "times_us": times_us}


def host_us_per_call(fn, calls: int) -> float:
    """Wall time per call of ``calls`` calls back to back (the host enqueues them; one synchronisation at the end):
    what a caller that launches nothing else sees. When the host is faster than the GPU this is the GPU time."""
    for _ in range(HOST_WARMUP_CALLS):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / calls * 1e6


@functools.cache
def sleep_cycles_per_us() -> float:
    """GPU clock cycles per microsecond of ``torch.cuda._sleep`` (measured once with CUDA events)."""
    cycles = 20_000_000
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(cycles // 10)  # warm-up
    start.record()
    torch.cuda._sleep(cycles)
    end.record()
    torch.cuda.synchronize()
    return cycles / (start.elapsed_time(end) * 1e3)


def gpu_us_per_call(fn, calls: int, host_us: float, cycles_per_us: float) -> dict:
    """The GPU time of one call with the GPU never waiting for the host: a sleep kernel holds the stream while the
    host enqueues ``calls`` calls, and CUDA events around the calls time them back to back (launch gaps between a
    call's kernels included). ``queued``: the host finished enqueuing before the sleep ended (else the GPU may have
    waited, and the time is an upper bound)."""
    sleep_us = 2.0 * calls * host_us + 2000.0
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    torch.cuda._sleep(int(sleep_us * cycles_per_us))
    start.record()
    begin = time.perf_counter()
    for _ in range(calls):
        fn()
    enqueue_us = (time.perf_counter() - begin) * 1e6
    end.record()
    torch.cuda.synchronize()
    return {"gpu_us": start.elapsed_time(end) * 1e3 / calls, "queued": enqueue_us < sleep_us}


# A measurement whose reps spread wider than this (p90 - p10, % of the median) is flagged "noisy" in the report: on a
# quiet GPU the reps of one call lie within a few per cent (docs/perf.md); run 57's disturbed host spread them by
# 30-1000%, and only the flag tells such a run from a slow kernel.
NOISY_SPREAD_PCT = 20.0


def spread_pct(times_us: list[float]) -> float:
    """(p90 - p10) / median of the reps, in per cent (``statistics.quantiles``' inclusive deciles; 0 for fewer than
    2 reps)."""
    if len(times_us) < 2:
        return 0.0
    deciles = statistics.quantiles(times_us, n=10, method="inclusive")
    return 100.0 * (deciles[8] - deciles[0]) / statistics.median(times_us)


def is_noisy(row: dict) -> bool:
    """A timed row whose reps spread wider than ``NOISY_SPREAD_PCT``."""
    return row.get("spread_pct", 0.0) > NOISY_SPREAD_PCT
