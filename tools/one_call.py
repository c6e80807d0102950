"""Run one decode mode on one harness shape a few times (a target for ncu / compute-sanitizer).

    python tools/one_call.py fp8 256 8192            # flat cache
    python tools/one_call.py mxfp4 4 1024 16         # paged cache, 16 tokens per page (shuffled pages)
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

import bench  # noqa: E402
from mla.decode import run_harness  # noqa: E402
from mla.inputs import to_paged  # noqa: E402

mode, batch, kv_len = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
page_size = int(sys.argv[4]) if len(sys.argv) > 4 else 0
data = bench.make_inputs(bench.uniform_case(batch, kv_len), 1, 16, "cuda")
page_table = None
if page_size:
    paged, page_table = to_paged(data, page_size)
    data = (data[0], paged, *data[2:])
for _ in range(3):
    out = run_harness(data, mode, page_table=page_table)
torch.cuda.synchronize()
print("ran", mode, batch, kv_len, "page_size", page_size, "finite:", bool(torch.isfinite(out).all()))
