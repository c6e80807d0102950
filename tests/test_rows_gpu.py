"""The 64-row warp-specialised Hopper kernel (tl_kernels/mla_decode_rows.py, issue 17) against the fp32 reference.

The grid (tools/rows_check.py's VARIANTS, so the kernels come prebuilt from the same cache): 16 / 32 / 64 / 128 heads,
query lengths 1-8 in one ragged batch (several query passes where a CTA's queries x its slots < 8), causal masking
whose horizons move by one token per query, so rows of one CTA (16 heads x 4 queries, 32 x 2) and tiles straddle them;
KV lengths 0, 1, 63 / 64 / 65, 129, 700, 2049 (tile and ring boundaries), paged caches (shuffled pages, NaN in every
unused slot), split counts 1 / 3 / 16 (16 reaches past the tile count of short sequences: empty splits must count in
the fused merge). Each call runs twice on the same buffers (the merge leaves its semaphores at zero). Rows past the
last sequence hold NaN, outputs start as NaN. Tolerances: tests/helpers.py.
"""

import math

import pytest
import torch

from conftest import requires_gpu
from helpers import check_against_reference, launches, poisoned, reference_for
from mla.decode import harness_cache, mla_decode, plan
from mla.inputs import make_ragged_inputs, to_paged
from tools.rows_check import KV_LENS, Q_LENS, SPLITS, TAIL, VARIANTS

pytestmark = requires_gpu


def inputs(heads, q_lens=Q_LENS, seed=17):
    data = make_ragged_inputs(KV_LENS, q_lens, num_heads=heads, seed=seed, tail_rows=TAIL)
    data[1]["bf16"][-TAIL:] = math.nan
    return data


def call(data, heads, overrides, causal, page_size, splits):
    q, kv_data, qo_indptr, kv_indptr, _ = data
    extra = {}
    if page_size:
        kv_data, page_table = to_paged(data, page_size=page_size)
        extra = dict(page_table=page_table)
    cache, kw = harness_cache(kv_data, "bf16")
    out = poisoned((q.shape[0], heads, 512), torch.bfloat16)
    lse = poisoned((q.shape[0], heads), torch.float32)
    mla_decode(q, cache, qo_indptr, kv_indptr, causal=causal, num_splits=splits, out=out, lse=lse, return_lse=True,
               config_overrides=overrides, **kw, **extra)
    return out, lse


@launches(lambda **_: [])  # opt-in kernels: built on first use (prebuilt by tools/rows_check.py --prebuild)
@pytest.mark.parametrize("splits", SPLITS)
@pytest.mark.parametrize("label", list(VARIANTS))
def test_variant_against_reference(label, splits):
    heads, ov, causal, page_size = VARIANTS[label]
    data = inputs(heads)
    ref_out, ref_lse = reference_for("bf16", data, causal=causal)
    for rep in range(2):
        out, lse = call(data, heads, {"rows": True, **ov}, causal, page_size, splits)
        check_against_reference(out, ref_out, "bf16", data[2], data[3], lse=lse, ref_lse=ref_lse,
                                context=f"{label} num_splits={splits} (call {rep + 1})")


@launches(lambda **_: [])
@pytest.mark.parametrize("heads,q_len,label", [(128, 4, "h128-qs4"), (64, 1, "h64-qs1")])
def test_scheduler_choice(heads, q_len, label):
    """Without a forced q_slots the scheduler picks the variant the timing runs (and the default split count)."""
    data = inputs(heads, q_lens=q_len, seed=3)
    ref_out, ref_lse = reference_for("bf16", data)
    out, lse = call(data, heads, {"rows": True}, False, 0, None)
    check_against_reference(out, ref_out, "bf16", data[2], data[3], lse=lse, ref_lse=ref_lse, context=label)


@launches(lambda **_: [])
def test_plan_run():
    """DecodePlan.run (its preallocated semaphores and flat partials) on the 64-row family."""
    heads, ov, causal, _ = VARIANTS["h64-qs2-causal"]
    data = inputs(heads, seed=5)
    q, kv_data, qo_indptr, kv_indptr, _ = data
    ref_out, ref_lse = reference_for("bf16", data, causal=causal)
    the_plan = plan(qo_indptr, kv_indptr, num_heads=heads, kv_format="bf16", causal=causal, num_splits=3,
                    config_overrides={"rows": True, **ov})
    for rep in range(2):
        out, lse = the_plan.run(q, kv_data["bf16"], return_lse=True)
        check_against_reference(out, ref_out, "bf16", qo_indptr, kv_indptr, lse=lse, ref_lse=ref_lse,
                                context=f"plan run {rep + 1}")


@launches(lambda **_: [])
def test_plan_runs_captured_in_a_cuda_graph():
    """A plan's runs on the 64-row family captured in one CUDA graph (fused merge: the plan's semaphores must be back
    at zero after each replay), replayed with new Q values."""
    heads, ov, causal, _ = VARIANTS["h64-qs2-causal"]
    data = inputs(heads, seed=9)
    q, kv_data, qo_indptr, kv_indptr, _ = data
    the_plan = plan(qo_indptr, kv_indptr, num_heads=heads, kv_format="bf16", causal=causal, num_splits=3,
                    config_overrides={"rows": True, **ov})
    out = torch.empty((q.shape[0], heads, 512), dtype=torch.bfloat16, device="cuda")
    lse = torch.empty((q.shape[0], heads), dtype=torch.float32, device="cuda")
    the_plan.run(q, kv_data["bf16"], out=out, lse=lse)  # warm-up outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        the_plan.run(q, kv_data["bf16"], out=out, lse=lse)
    gen = torch.Generator(device="cuda").manual_seed(11)
    for replay in range(2):
        q.copy_(torch.randn(q.shape, dtype=q.dtype, device="cuda", generator=gen))
        out.fill_(math.nan)
        lse.fill_(math.nan)
        graph.replay()
        torch.cuda.synchronize()
        ref_out, ref_lse = reference_for("bf16", data, causal=causal)
        check_against_reference(out, ref_out, "bf16", qo_indptr, kv_indptr, lse=lse, ref_lse=ref_lse,
                                context=f"CUDA graph replay {replay + 1}")


# Issue 30: the timed sizes of tools/rows_check.py, each call in a child process with a time limit, so that a hang
# (a setmaxnreg budget the launch cannot grant, a barrier protocol that deadlocks at many tiles) fails this test
# instead of stalling the suite. The limit covers the child's imports and kernel loads (seconds from a warm cache; a
# cold compile of the two kernels ~1 min on the GPU host) and two calls of about a millisecond each.
WATCHDOG_S = 300
_LARGE_CALL = r"""
import json, sys
import torch
from mla import schedule
from mla.decode import plan
from mla.inputs import make_harness_inputs
from mla.reference import harness_reference
from mla.target import spec_for_device

heads, q_len, batch, kv_len = (int(x) for x in sys.argv[1:5])
cfg = schedule.select_kernels(spec_for_device(torch.device("cuda")), kv_format="bf16", q_format="bf16",
                              num_heads=heads, causal=False, page_size=0, batch=batch, total_q=batch * q_len,
                              total_kv=batch * kv_len, rows=True)[0]
data = make_harness_inputs(batch, kv_len, q_len=q_len, num_heads=heads, seed=23)
q, kv_data, qo_indptr, kv_indptr, _ = data
step = plan(qo_indptr, kv_indptr, num_heads=heads, kv_format="bf16", config_overrides={"rows": True})
ref_out, _ = harness_reference(data, "bf16")
worst_rel, worst_abs, finite = 0.0, 0.0, True
for _ in range(2):  # twice: the fused merge must leave its semaphores at zero
    out = torch.full((q.shape[0], heads, 512), float("nan"), dtype=torch.bfloat16, device="cuda")
    step.run(q, kv_data["bf16"], out=out)
    torch.cuda.synchronize()
    o = out.float()
    finite = finite and bool(torch.isfinite(o).all())
    worst_rel = max(worst_rel, ((o.nan_to_num(0) - ref_out).norm() / ref_out.norm()).item())
    worst_abs = max(worst_abs, ((o.nan_to_num(0) - ref_out).abs().max() / ref_out.abs().max()).item())
print("RESULT " + json.dumps(dict(kernel=cfg.name, splits=step.num_splits, finite=finite,
                                  rel_l2=worst_rel, max_abs_fraction=worst_abs)))
"""


@pytest.mark.parametrize("heads,q_len", [(128, 4), (64, 1)], ids=["h128-q4", "h64-q1"])
def test_large_batch_finishes_under_a_watchdog(heads, q_len):
    """The default 64-row kernel at 32 x 8192 (the size whose timing never finished in issue 17's runs) completes
    within WATCHDOG_S in a child process, twice, and matches the fp32 reference."""
    import json
    import os
    import subprocess
    import sys

    from helpers import MAX_ABS_FRACTION, REL_L2

    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    try:
        proc = subprocess.run([sys.executable, "-c", _LARGE_CALL, str(heads), str(q_len), "32", "8192"], cwd=repo,
                              capture_output=True, text=True, timeout=WATCHDOG_S)
    except subprocess.TimeoutExpired:
        pytest.fail(f"{heads} heads x q_len {q_len} at 32 x 8192: no result within {WATCHDOG_S} s (hung; killed)")
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, f"child exited with {proc.returncode}:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
    result = json.loads(lines[-1][7:])
    assert result["finite"], result
    assert result["rel_l2"] <= REL_L2["bf16"], result
    assert result["max_abs_fraction"] <= MAX_ABS_FRACTION, result
