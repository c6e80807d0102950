"""One decode call of the warp-specialised kernel ("ws"), of the 16/32/64-row kernel ("old") or of the op as it
dispatches ("op"), a few times: a target for ncu.  python tools/ws_ncu.py ws fp8 64 8192 [num_splits]
(Before run 15's fix, "op" ran the old kernel: its counts in docs/perf.md run 15 are the old kernel's.)"""

import sys

import torch

sys.path.insert(0, ".")
sys.path.insert(0, "tools")
from mla.inputs import make_harness_inputs  # noqa: E402
from mla.harness import run_harness  # noqa: E402
from ws_check import run_old, run_ws  # noqa: E402

impl, mode, batch, kv_len = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
splits = int(sys.argv[5]) if len(sys.argv) > 5 else 1
data = make_harness_inputs(batch, kv_len, seed=1)
for _ in range(3):
    if impl == "ws":
        run_ws({}, data, mode, splits)
    elif impl == "old":
        run_old(data, mode)
    else:
        run_harness(data, mode)
torch.cuda.synchronize()
print("done", impl, mode, batch, kv_len, splits)
