"""The kernels one op call launches and their GPU durations, beside the event-timed call (GPU).

For each case ``mode:BATCHxKV_LEN[:overrides JSON]`` (harness inputs, seed 1): the call timed as bench.py times it
(``mla_bench.timing.time_call_us``: the L2 flushed before each rep, median of 20), then five calls under
torch.profiler, each after the flush, and per kernel name its launches per call and median duration (the flush's own
fill kernel left out). The mode ``flashmla-fp8`` profiles FlashMLA's fp8 call (its untimed setup as bench.py's)
where ``$FLASHMLA_LEGACY_LIB`` is set. Answers "is the fixed cost inside our kernel, in a second launch, or in the
gaps between launches" (docs/perf.md run 60).

    python tools/profile_call.py 'fp8:32x8192;a8w8:4x1024;fp8:4x1024:{"ws": true};flashmla-fp8:32x8192' --json p.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

FLUSH_MIN_US = 40  # a fill kernel longer than this is the L2 flush (256 MiB), not the op's


def parse_cases(text: str) -> list[tuple[str, int, int, dict | None]]:
    """``mode:BxN[:json]`` items separated by ';' -> (mode, batch, kv_len, overrides or None)."""
    cases = []
    for item in filter(None, (s.strip() for s in text.split(";"))):
        mode, shape, *rest = item.split(":", 2)
        batch, kv_len = (int(x) for x in shape.split("x"))
        cases.append((mode, batch, kv_len, json.loads(rest[0]) if rest and rest[0] else None))
    return cases


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("cases", help="'mode:BxN[:overrides];...'")
    ap.add_argument("--json")
    args = ap.parse_args()
    cases = parse_cases(args.cases)

    import torch
    from torch.profiler import ProfilerActivity, profile

    from mla.harness import run_harness
    from mla.inputs import make_harness_inputs
    from mla_bench import peers
    from mla_bench.timing import FLUSH_BYTES, time_call_us

    flush = torch.empty(FLUSH_BYTES // 4, dtype=torch.float32, device="cuda")
    flashmla = peers.load_flashmla()[0] if os.environ.get(peers.FLASHMLA_LIB_ENV) else None
    rows = []
    for mode, batch, kv_len, overrides in cases:
        data = make_harness_inputs(batch, kv_len, seed=1)
        if mode == peers.FLASHMLA_FP8:
            if flashmla is None:
                print(f"== {mode} {batch}x{kv_len}: FlashMLA not loaded (${peers.FLASHMLA_LIB_ENV})")
                continue
            peer = peers.Peer(peers.FLASHMLA_FP8, module=flashmla)
            fn = peers.flashmla_callable(peer, data, 16, fp8=True, paging=peers.flashmla_paging(data))
        else:
            fn = lambda: run_harness(data, mode, config_overrides=overrides)  # noqa: E731
        time_us = statistics.median(time_call_us(fn, reps=20, warmup=3, flush=flush))
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                flush.zero_()
                torch.cuda.synchronize()
                fn()
                torch.cuda.synchronize()
        kernels: dict[str, list[float]] = {}
        for ev in prof.events():
            name, dur = ev.name, ev.time_range.elapsed_us()
            if ev.device_type.name != "CUDA" or (("fill" in name.lower() or "zero" in name.lower())
                                                  and dur > FLUSH_MIN_US):
                continue
            kernels.setdefault(name[:100], []).append(dur)
        print(f"== {mode} {batch}x{kv_len} {overrides or ''}: event-timed median {time_us:.1f} us")
        for name, durs in kernels.items():
            print(f"   {len(durs) / 5:4.1f} per call  {statistics.median(durs):8.1f} us  {name}")
        rows.append(dict(mode=mode, batch=batch, kv_len=kv_len, overrides=overrides, time_us=time_us,
                         kernels={k: statistics.median(v) for k, v in kernels.items()},
                         launches_per_call={k: len(v) / 5 for k, v in kernels.items()}))
        del data
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
