"""Decode benchmark: the warp-specialised kernel's producers alone, no MMA.

Streams a large cache (default 2 Mi tokens) through exactly the producer warp groups of tl_kernels/mla_decode_ws.py
(bf16: the cp.async copier; fp8 / mxfp4: the bit-placement decoders) into the same swizzled 16-bit ring in shared
memory, with a consumer that only releases each stage (``mla_decode_stream_kernel``, "bench"). One CTA per SM (the
decode kernel's occupancy), each streaming an equal share. Reports time and GB/s over the format's own bytes against
the read ceiling (bench.py's ``torch.sum``, timed as bench.py times), which separates "the decode is too expensive" from "the pipeline doesn't overlap".

  python tools/decode_bench.py                       # check every format's decode, then time bf16 / fp8 / mxfp4
  python tools/decode_bench.py --once fp8            # one launch, for ncu (instructions per element):
  ncu --clock-control none --metrics smsp__inst_executed.sum,sm__throughput.avg.pct_of_peak_sustained_elapsed \
      python tools/decode_bench.py --once fp8

"--check" mode (always run first) copies each decoded stage back out and compares it with mla.formats' dequantized
cache, bit for bit, over ragged per-CTA lengths and the whole e8m0 range.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch

sys.path.insert(0, ".")
from mla import formats  # noqa: E402
from mla_bench.timing import FLUSH_BYTES, measure_read_ceiling, time_call_us  # noqa: E402
from mla.target import spec_for_device, spec_for_name  # noqa: E402
from tl_kernels.mla_decode_ws import WSDecodeKernelConfig, mla_decode_stream_kernel  # noqa: E402

BYTES_PER_TOKEN = {"bf16": 1152, "fp8": 576, "mxfp4": 306}


def stream_kernel(kv_format: str, mode: str, spec=None, l2_prefetch: int = 0):
    import tilelang

    spec = spec or spec_for_device(torch.device("cuda"))
    cfg = WSDecodeKernelConfig(kv_format=kv_format, fp8_dtype=spec.fp8_tl_dtype, l2_prefetch=l2_prefetch)
    return tilelang.compile(mla_decode_stream_kernel(cfg, mode), target=spec.target_dict)


def _build(job):
    stream_kernel(job[0], job[1], spec_for_name("sm_90a"), job[2])
    return job


def prebuild(kv_formats, prefetches=(0,)):
    import concurrent.futures
    import multiprocessing

    jobs = [(f, mode, pf) for f in kv_formats for pf in prefetches for mode in ("check", "bench")]
    ctx = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(min(len(jobs), os.cpu_count() or 1), mp_context=ctx) as pool:
        for job in pool.map(_build, jobs):
            print("built", *job, flush=True)


def make_cache(kv_format: str, tokens: int, seed: int = 0):
    """(kv rows as the kernel reads them, flat e8m0 scales, scale stride, bf16 expected decode)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    kv = torch.randn(tokens, 576, generator=g, device="cuda", dtype=torch.float32).to(torch.bfloat16)
    empty = torch.zeros(1, dtype=torch.uint8, device="cuda")
    if kv_format == "bf16":
        return kv, empty, 18, kv
    if kv_format == "fp8":
        codes, _ = formats.quantize_fp8(kv)
        expected = formats.dequantize_fp8(codes, torch.ones(1, device="cuda")).to(torch.bfloat16)
        return codes, empty, 18, expected
    packed, scales = formats.quantize_mxfp4(kv)
    # The whole e8m0 range, 0 and 255 (NaN) included, in a row stride padded to 24 as some producers do.
    scales = scales.clone()
    scales.view(-1)[: 256 * 4 : 4] = torch.arange(256, device="cuda", dtype=torch.uint8)
    padded = torch.zeros(tokens, 24, dtype=torch.uint8, device="cuda")
    padded[:, :18] = scales
    expected = formats.dequantize_mxfp4(packed, scales).to(torch.bfloat16)
    return packed, padded.view(-1), 24, expected


def check(kv_format: str, l2_prefetch: int = 0) -> bool:
    kernel = stream_kernel(kv_format, "check", l2_prefetch=l2_prefetch)
    lengths = [0, 1, 63, 64, 65, 127, 128, 129, 1000, 4096, 7]
    indptr = torch.tensor([0] + lengths, device="cuda").cumsum(0).to(torch.int32)
    kv, scales, stride, expected = make_cache(kv_format, int(indptr[-1]), seed=1)
    out = torch.full((kv.shape[0], 576), float("nan"), dtype=torch.bfloat16, device="cuda")
    kernel(kv, scales, stride, indptr, out)
    torch.cuda.synchronize()
    same = (out.view(torch.int16) == expected.view(torch.int16)) | (out.isnan() & expected.isnan())
    bad = (~same).sum().item()
    print(f"check {kv_format:5s} pf{l2_prefetch}: {out.numel()} values, {bad} differ from mla.formats' decode "
          f"{'(OK)' if bad == 0 else '(FAIL)'}")
    if bad:
        idx = (~same).nonzero()[:5].tolist()
        for r, c in idx:
            print(f"   row {r} col {c}: kernel {out[r, c].item()} expected {expected[r, c].item()}")
    return bad == 0


def bench(kv_format: str, tokens: int, reps: int, ceiling: float | None, once: bool = False,
          l2_prefetch: int = 0) -> dict:
    kernel = stream_kernel(kv_format, "bench", l2_prefetch=l2_prefetch)
    ctas = torch.cuda.get_device_properties(0).multi_processor_count
    kv, scales, stride, _ = make_cache(kv_format, tokens)
    indptr = torch.linspace(0, tokens, ctas + 1, device="cuda").round().to(torch.int32)
    out = torch.empty(1, 576, dtype=torch.bfloat16, device="cuda")
    run = lambda: kernel(kv, scales, stride, indptr, out)  # noqa: E731
    if once:
        run()
        torch.cuda.synchronize()
        return {}
    flush = torch.empty(FLUSH_BYTES, dtype=torch.uint8, device="cuda")
    t = statistics.median(time_call_us(run, reps=reps, warmup=1, flush=flush))
    gbps = tokens * BYTES_PER_TOKEN[kv_format] / t / 1e3
    row = dict(format=kv_format, l2_prefetch=l2_prefetch, tokens=tokens, time_us=t, gbps=gbps,
               pct_ceiling=100 * gbps / ceiling if ceiling else None)
    print(f"stream {kv_format:5s} pf{l2_prefetch} {tokens} tokens: {t:8.1f} us  {gbps:6.0f} GB/s"
          + (f"  {row['pct_ceiling']:5.1f}% of the read ceiling" if ceiling else ""))
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--formats", default="bf16,fp8,mxfp4")
    ap.add_argument("--tokens", type=int, default=2 * 2**20)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--once", metavar="FORMAT", help="one launch of FORMAT's stream kernel (an ncu target)")
    ap.add_argument("--prebuild", action="store_true", help="only compile the kernels (in parallel processes)")
    ap.add_argument("--prefetch", default="0", help="L2 prefetch distances to time, tiles ahead (0: none), e.g. 0,3,4")
    ap.add_argument("--json", help="write the timed rows here")
    args = ap.parse_args()
    prefetches = [int(x) for x in args.prefetch.split(",")]
    if args.prebuild or not torch.cuda.is_available():
        print("decode_bench: compiling the stream kernels for sm_90a (into TILELANG_CACHE_DIR)"
              + ("" if torch.cuda.is_available() else "; no CUDA device: nothing runs"))
        prebuild(args.formats.split(","), prefetches)
        return 0
    if args.once:
        bench(args.once, args.tokens, 1, None, once=True, l2_prefetch=prefetches[0])
        return 0
    ok = all([check(f, pf) for f in args.formats.split(",") for pf in prefetches])
    ceiling = measure_read_ceiling("cuda")["gbps"]
    print(f"read ceiling (bench.py's torch.sum): {ceiling:.0f} GB/s")
    rows = [bench(f, args.tokens, args.reps, ceiling, l2_prefetch=pf) for f in args.formats.split(",") for pf in prefetches]
    if args.json:
        import json

        with open(args.json, "w") as fh:
            json.dump(dict(read_ceiling_gbps=ceiling, rows=rows, checks_ok=ok), fh, indent=1)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
