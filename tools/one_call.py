"""Run one decode mode on one harness shape a few times (a target for ncu / compute-sanitizer).

    python tools/one_call.py fp8 256 8192
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

import bench  # noqa: E402

mode, batch, kv_len = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
data = bench.make_inputs(bench.uniform_case(batch, kv_len), 1, 16, "cuda")
for _ in range(3):
    bench.run_mode(mode, data)
torch.cuda.synchronize()
print("ran", mode, batch, kv_len)
