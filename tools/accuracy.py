"""Accuracy report per mode on harness-like inputs (GPU): the error the tests gate (vs the fp32 reference on the
values the kernel sees), the error vs exact attention on the original bf16 inputs (reported, not gated), and the
competition's check (|out - ref| <= 0.1 + 0.1 |ref| vs its a8w8 reference: fp8 Q and fp8 KV, fp32 math).

    python tools/accuracy.py [--shapes 4x1024,64x8192]
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


import mla.constants  # noqa: E402
from mla import formats  # noqa: E402
from mla.decode import run_harness  # noqa: E402
from mla.inputs import make_harness_inputs  # noqa: E402
from mla.reference import harness_reference, mla_decode_reference  # noqa: E402

MODES = tuple(mla.constants.MODES)


def rel_l2(out, ref):
    return ((out.float() - ref).norm() / ref.norm()).item()


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shapes", default="4x1024,64x8192")
    args = parser.parse_args()
    print(f"{'shape':9s} {'mode':6s} {'vs own-format ref':>18s} {'vs exact bf16':>14s} {'harness misses':>15s}")
    for shape in args.shapes.split(","):
        batch, kv_len = map(int, shape.split("x"))
        data = make_harness_inputs(batch, kv_len, seed=2026)
        q, kv_data, qo, kvp, _ = data
        exact, _ = mla_decode_reference(q, kv_data["bf16"], qo, kvp)
        q8 = formats.dequantize_fp8(*formats.quantize_fp8(q))
        harness_ref, _ = mla_decode_reference(q8, formats.dequantize_kv(kv_data["fp8"], "fp8"), qo, kvp)
        for mode in MODES:
            out = run_harness(data, mode).float()
            own_ref, _ = harness_reference(data, mode)
            misses = ((out - harness_ref).abs() > 0.1 + 0.1 * harness_ref.abs()).float().mean().item()
            print(f"{shape:9s} {mode:6s} {rel_l2(out, own_ref):18.2e} {rel_l2(out, exact):14.2e} {misses:15.2%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
