"""Run one decode mode on one harness shape a few times (a target for ncu / compute-sanitizer).

    python tools/one_call.py fp8 256 8192                          # flat cache
    python tools/one_call.py mxfp4 4 1024 16                       # paged cache, 16 tokens per page (shuffled)
    python tools/one_call.py a8w8 4 1024 --q-len 8 --causal         # MTP
    python tools/one_call.py fp8 4 1024 64 --heads 64 --plan        # through mla.decode.plan(...).run(...)
    python tools/one_call.py bf16 4 1024 --heads 128 --q-len 2 --causal --rows --splits 3   # the 64-row kernel
    python tools/one_call.py fp8 64 8192 --config '{"ws": true}' --splits 1   # the warp-specialised kernel, forced
    python tools/one_call.py fp8 64 8192 --config '{"ws": false}'             # the 16/32/64-row kernel, forced
    python tools/one_call.py a8w8 32 1024 --profile 20              # where one call's GPU time goes: each kernel's
                                                                    # mean duration (torch.profiler) beside the
                                                                    # call's event time, L2 flushed before each call

Exits 1 when the output has a NaN/inf or is off the fp32 reference by more than the tests' tolerance.
"""

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from mla.constants import MODES  # noqa: E402
from mla.decode import run_harness  # noqa: E402
from mla.inputs import to_paged  # noqa: E402
from mla.reference import harness_reference  # noqa: E402
from mla_bench.calls import make_inputs, planned_call  # noqa: E402
from mla_bench.cases import uniform_case  # noqa: E402
from mla_bench.timing import FLUSH_BYTES, time_call_us  # noqa: E402


def profile_call(fn, calls: int) -> None:
    """Each kernel's mean GPU time per call (torch.profiler's device events) beside the median event time of the
    whole call (as bench.py times it: L2 flushed before each call); the gap is launch gaps and host waits."""
    from torch.profiler import ProfilerActivity, profile

    flush = torch.empty(FLUSH_BYTES, dtype=torch.uint8, device="cuda")
    event_us = sorted(time_call_us(fn, reps=calls, warmup=2, flush=flush))
    with profile(activities=[ProfilerActivity.CUDA]) as flush_prof:  # the flush's own kernels, to leave out
        flush.zero_()
        torch.cuda.synchronize()
    flush_kernels = {evt.name for evt in flush_prof.events() if evt.device_type.name == "CUDA"}
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            flush.zero_()
            fn()
            torch.cuda.synchronize()
    kernels = {}
    for evt in prof.events():
        if evt.device_type.name == "CUDA" and evt.name not in flush_kernels:
            kernels.setdefault(evt.name, []).append(evt.device_time)
    total_us = 0.0
    for name, times_us in sorted(kernels.items(), key=lambda kv: -sum(kv[1])):
        per_call_us = sum(times_us) / calls
        total_us += per_call_us
        print(f"  {per_call_us:8.2f} us/call  x{len(times_us) / calls:.1f}  {name[:110]}")
    print(f"  {total_us:8.2f} us/call in kernels; the call's event time: median {event_us[len(event_us) // 2]:.2f} us"
          f" (min {event_us[0]:.2f})")


parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
parser.add_argument("mode", choices=list(MODES))
parser.add_argument("batch", type=int)
parser.add_argument("kv_len", type=int)
parser.add_argument("page_size", type=int, nargs="?", default=0, help="0: flat cache")
parser.add_argument("--q-len", type=int, default=1)
parser.add_argument("--heads", type=int, default=16)
parser.add_argument("--causal", action="store_true")
parser.add_argument("--splits", type=int, default=None)
parser.add_argument("--plan", action="store_true", help="call mla.decode.plan(...).run(...) instead of mla_decode")
parser.add_argument("--reps", type=int, default=3)
parser.add_argument("--rows", action="store_true", help="opt into the 64-row kernel class (config_overrides rows=True)")
parser.add_argument("--profile", type=int, default=0, metavar="CALLS",
                    help="also time CALLS calls (L2 flushed before each) under torch.profiler: per-kernel GPU us")
parser.add_argument("--config", type=json.loads, default=None, metavar="JSON",
                    help='kernel config overrides (as bench.py --config), e.g. \'{"ws": true}\'')
args = parser.parse_args()
overrides = dict(args.config or {}, **({"rows": True} if args.rows else {})) or None

data = make_inputs(uniform_case(args.batch, args.kv_len), args.q_len, args.heads, "cuda")
run_data, page_table = data, None
if args.page_size:
    paged, page_table = to_paged(data, args.page_size)
    run_data = (data[0], paged, *data[2:])
if args.plan:
    call = planned_call(args.mode, run_data, args.splits, page_table, causal=args.causal, overrides=overrides)
else:
    def call():
        return run_harness(run_data, args.mode, page_table=page_table, num_splits=args.splits, causal=args.causal,
                           config_overrides=overrides)
for _ in range(args.reps):
    out = call()
torch.cuda.synchronize()
if args.profile:
    profile_call(call, args.profile)
ref, _ = harness_reference(data, args.mode, causal=args.causal)
rel_l2 = ((out.float() - ref).norm() / ref.norm()).item()
finite = bool(torch.isfinite(out).all())
print(f"ran {vars(args)}: finite {finite}, relative L2 error {rel_l2:.2e}")
sys.exit(0 if finite and rel_l2 <= 2e-2 else 1)
