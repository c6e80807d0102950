"""Run one decode mode on one harness shape a few times (a target for ncu / compute-sanitizer).

    python tools/one_call.py fp8 256 8192                          # flat cache
    python tools/one_call.py mxfp4 4 1024 16                       # paged cache, 16 tokens per page (shuffled)
    python tools/one_call.py a8w8 4 1024 --q-len 8 --causal         # MTP
    python tools/one_call.py fp8 4 1024 64 --heads 64 --plan        # through mla.decode.plan(...).run(...)
    python tools/one_call.py bf16 4 1024 --heads 128 --q-len 2 --causal --rows --splits 3   # the 64-row kernel
    python tools/one_call.py fp8 64 8192 --config '{"ws": true}' --splits 1   # the warp-specialised kernel, forced
    python tools/one_call.py fp8 64 8192 --config '{"ws": false}'             # the 16/32/64-row kernel, forced

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
ref, _ = harness_reference(data, args.mode, causal=args.causal)
rel_l2 = ((out.float() - ref).norm() / ref.norm()).item()
finite = bool(torch.isfinite(out).all())
print(f"ran {vars(args)}: finite {finite}, relative L2 error {rel_l2:.2e}")
sys.exit(0 if finite and rel_l2 <= 2e-2 else 1)
