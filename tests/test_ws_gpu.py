"""The warp-specialised Hopper kernel (tl_kernels/mla_decode_ws.py): its ring of shared-memory stages, its split
schedule and its fused merge of the splits, checked against the fp32 reference.

The ring walks ``ceil(tiles / stages)`` rounds of all stages, so the lengths below straddle every boundary: 0 and 1
token, one token short of / past a 64-token tile, tile counts that are and are not multiples of the ring depth (2). The split counts reach past the tile count (empty splits, which must count in the
merge), and make one-token splits (a sequence of 65 tokens over 2 splits). Each call runs twice on the same
buffers: the kernel leaves its semaphores at zero, so a second call (with another split count too) must be right.
Rows past the last sequence hold NaN (a read of them shows), outputs start as NaN (an unwritten element shows).
Tolerances: tests/helpers.py.
"""

import math

import pytest
import torch

from conftest import requires_gpu
from helpers import MODES, check_against_reference, launches, poisoned, reference_for
from mla import schedule
from mla.constants import MODES as MODE_FORMATS
from mla.decode import harness_cache, mla_decode
from mla.inputs import make_ragged_inputs, to_paged

pytestmark = requires_gpu

RING_LENGTHS = [0, 1, 63, 64, 65, 127, 128, 129, 191, 192, 193, 320, 1000, 0, 2049]
SPLITS = [1, 2, 3, 7, 64]
TAIL = 5  # poisoned cache rows past the last sequence
WS = {"ws": True}  # this family, whatever the schedule picks by default
# Modes whose default ring here is the decoder / copier ring. fp8 caches (a8w8, fp8) default to the fp8 wgmma ring,
# whose protocol once hung on the GPU (run 47): their cases run under the watchdog below, not here, where a hang
# would stall the suite.
RING_MODES = [m for m in MODES if not schedule.ws_ring_defaults(*MODE_FORMATS[m]).get("fp8_mma")]


def poison_tail(data):
    """NaN (fp8: NaN code; mxfp4: NaN scale 0xFF) in the cache rows past the last sequence."""
    kv_data = data[1]
    kv_data["bf16"][-TAIL:] = math.nan
    fp8, _ = kv_data["fp8"]
    fp8[-TAIL:] = torch.tensor(math.nan).to(fp8.dtype)
    _, scales = kv_data["mxfp4"]
    scales[-TAIL:] = 0xFF
    return data


def run(data, mode, **kwargs):
    q, kv_data, qo_indptr, kv_indptr, _ = data
    cache, extra = harness_cache(kv_data, mode)
    out = poisoned((q.shape[0], q.shape[1], 512), torch.bfloat16)
    lse = poisoned((q.shape[0], q.shape[1]), torch.float32)
    return mla_decode(q, cache, qo_indptr, kv_indptr, out=out, lse=lse, return_lse=True, config_overrides=WS,
                      **extra, **kwargs)


@launches(lambda mode, **_: [(mode, 16, 1, False)])
@pytest.mark.parametrize("num_splits", SPLITS)
@pytest.mark.parametrize("mode", RING_MODES)
def test_ring_boundaries_and_split_counts(mode, num_splits):
    data = poison_tail(make_ragged_inputs(RING_LENGTHS, seed=num_splits, tail_rows=TAIL))
    ref_out, ref_lse = reference_for(mode, data)
    for call in range(2):
        splits = num_splits if call == 0 else max(1, num_splits // 2 + 1)
        out, lse = run(data, mode, num_splits=splits)
        check_against_reference(out, ref_out, mode, data[2], data[3], lse=lse, ref_lse=ref_lse,
                                context=f"num_splits={splits} (call {call + 1})")


@launches(lambda mode, **_: [(mode, 16, 1, False)])
@pytest.mark.parametrize("mode", RING_MODES)
def test_one_token_splits_and_single_sequences(mode):
    """A split holding one token (65 = 64 + 1 over 2 splits), batch 1, and the default split count."""
    for kv_lens, splits in (([65], 2), ([129, 65, 1], 3), ([1], 5), ([4096], None), ([5] * 300, None)):
        data = poison_tail(make_ragged_inputs(kv_lens, seed=len(kv_lens), tail_rows=TAIL))
        ref_out, ref_lse = reference_for(mode, data)
        out, lse = run(data, mode, num_splits=splits)
        check_against_reference(out, ref_out, mode, data[2], data[3], lse=lse, ref_lse=ref_lse,
                                context=f"kv_lens={kv_lens[:4]} num_splits={splits}")


@launches(lambda mode, **_: [(mode, 16, 1, True)])
@pytest.mark.parametrize("mode", RING_MODES)
def test_query_passes_causal(mode):
    """Several queries in one sequence take several passes over the ring (causal: each its own horizon); the mean
    query length stays <= 1 so the 16-row kernel serves them."""
    data = poison_tail(make_ragged_inputs([700, 0, 130, 64, 3], [3, 0, 1, 0, 1], seed=7, tail_rows=TAIL))
    ref_out, ref_lse = reference_for(mode, data, causal=True)
    for splits in (1, 4):
        out, lse = run(data, mode, causal=True, num_splits=splits)
        check_against_reference(out, ref_out, mode, data[2], data[3], lse=lse, ref_lse=ref_lse,
                                context=f"causal num_splits={splits}")


@launches(lambda mode, page_size, **_: [(mode, 16, 1, False, page_size)])
@pytest.mark.parametrize("page_size", [1, 16, 64])
@pytest.mark.parametrize("mode", RING_MODES)
def test_paged_ring(mode, page_size):
    """The producer gathers each row through the page table (shuffled pages, NaN in every unused slot)."""
    data = make_ragged_inputs([1, 65, 0, 500, 193], seed=page_size)
    paged, page_table = to_paged(data, page_size=page_size)
    ref_out, ref_lse = reference_for(mode, data)
    q, _, qo_indptr, kv_indptr, _ = data
    cache, extra = harness_cache(paged, mode)
    for splits in (1, 3):
        out = poisoned((q.shape[0], 16, 512), torch.bfloat16)
        lse = poisoned((q.shape[0], 16), torch.float32)
        mla_decode(q, cache, qo_indptr, kv_indptr, page_table=page_table, num_splits=splits, out=out, lse=lse,
                   config_overrides=WS, **extra)
        check_against_reference(out, ref_out, mode, qo_indptr, kv_indptr, lse=lse, ref_lse=ref_lse,
                                context=f"page_size={page_size} num_splits={splits}")


# ---- fp8 caches on fp8 wgmma (``fp8_mma``, issue 28 step 5: the default ring of a8w8 and fp8) and mxfp4 on it (step
# 4, opt-in, prebuilt by tools/ws_check.py --prebuild --check --modes mxfp4 --variants f8mmaps) ----------------------
# Its ring has four barriers per stage and three roles (copier, V^T transposer, MMA warp group); one version of that
# protocol hung on the GPU (docs/perf.md run 47: a barrier completing two phases ahead of its waiter). So every case
# runs in a child process under a watchdog: a hang fails the test instead of stalling the suite.
F8MMA_WATCHDOG_S = 240
# The default ring for fp8 caches (P as two e4m3 terms in one wgmma group, bf16 Q's two terms likewise:
# ``schedule.ws_ring_defaults``); mxfp4 opts in, with P as two terms (one misses the gate: runs 48-49).
# "mxfp4-2dec": mxfp4 with two decoder warp groups, one per stage (``schedule.MX_RING_2D``, opt-in).
# "-dyn": every role's tile step in one copy, the stage in a register (``dynamic_stage``, opt-in).
F8MMA = {"a8w8": WS, "fp8": WS, "mxfp4": {"ws": True, "fp8_mma": True, "p_split": True},
         "mxfp4-2dec": {"ws": True, **schedule.MX_RING_2D},
         "a8w8-dyn": {"ws": True, **schedule.ws_ring_defaults("fp8", "fp8"), "dynamic_stage": True},
         "fp8-dyn": {"ws": True, **schedule.ws_ring_defaults("fp8", "bf16"), "dynamic_stage": True},
         "mxfp4-2dec-dyn": {"ws": True, **schedule.MX_RING_2D, "dynamic_stage": True},
         # "-vt2": a deeper codes ring beside two V^T stages (``vt_stages``): fp8 three codes stages, a8w8 four
         "a8w8-vt2": {"ws": True, **schedule.ws_ring_defaults("fp8", "fp8"), "dynamic_stage": True, "num_stages": 4,
                      "vt_stages": 2},
         "fp8-vt2": {"ws": True, **schedule.ws_ring_defaults("fp8", "bf16"), "dynamic_stage": True, "num_stages": 3,
                     "vt_stages": 2},
         # "-pc5": persistent CTAs (``persistent_ctas``), five of them, so that every CTA walks many work items of
         # these small batches (empty splits, sequences without queries, several passes) through one ring
         "a8w8-pc5": {"ws": True, **schedule.ws_ring_defaults("fp8", "fp8"), "dynamic_stage": True,
                      "persistent_ctas": 5},
         "fp8-pc5": {"ws": True, **schedule.ws_ring_defaults("fp8", "bf16"), "dynamic_stage": True,
                     "persistent_ctas": 5}}
_F8MMA_CASES = r"""
import json, math, sys, traceback
import torch
sys.path.insert(0, "tests")
from helpers import check_against_reference, poisoned, reference_for
from test_ws_gpu import F8MMA, RING_LENGTHS, TAIL, poison_tail
from mla.decode import harness_cache, mla_decode
from mla.inputs import make_ragged_inputs, to_paged

def call(data, ring, causal=False, num_splits=None, page_size=0):
    mode = ring.split("-")[0]
    q, kv_data, qo_indptr, kv_indptr, _ = data
    extra = {}
    if page_size:
        kv_data, extra["page_table"] = to_paged(data, page_size=page_size)
    cache, kw = harness_cache(kv_data, mode)
    out = poisoned((q.shape[0], 16, 512), torch.bfloat16)
    lse = poisoned((q.shape[0], 16), torch.float32)
    mla_decode(q, cache, qo_indptr, kv_indptr, out=out, lse=lse, return_lse=True, causal=causal,
               num_splits=num_splits, config_overrides=F8MMA[ring], **kw, **extra)
    return out, lse

cases = []
for splits in (1, 2, 3, 7, 64):  # every ring boundary, odd and even tile counts, empty splits
    cases.append((f"ring splits={splits}", dict(kv_lens=RING_LENGTHS, q_lens=1, seed=splits), dict(num_splits=splits)))
for kv_lens, splits in (([65], 2), ([129, 65, 1], 3), ([1], 5), ([4096], None), ([5] * 300, None)):
    cases.append((f"kv_lens={kv_lens[:3]} splits={splits}", dict(kv_lens=kv_lens, q_lens=1, seed=len(kv_lens)),
                  dict(num_splits=splits)))
for splits in (1, 4):  # several query passes, each with its own causal horizon
    cases.append((f"causal passes splits={splits}", dict(kv_lens=[700, 0, 130, 64, 3], q_lens=[3, 0, 1, 0, 1], seed=7),
                  dict(causal=True, num_splits=splits)))
for page_size in (1, 16, 64):
    cases.append((f"paged {page_size}", dict(kv_lens=[1, 65, 0, 500, 193], q_lens=1, seed=page_size),
                  dict(page_size=page_size, num_splits=3)))
results = []
for ring in sys.argv[1].split(","):  # a8w8 (fp8 Q codes), fp8 and mxfp4 (bf16 Q as two e4m3 terms); F8MMA's keys
    mode = ring.split("-")[0]
    for label, inputs, kwargs in cases:
        label = f"{ring} {label}"
        try:
            data = poison_tail(make_ragged_inputs(inputs["kv_lens"], inputs["q_lens"], seed=inputs["seed"],
                                                  tail_rows=TAIL))
            ref_out, ref_lse = reference_for(mode, data, causal=kwargs.get("causal", False))
            for rep in range(2):  # twice: the fused merge leaves its semaphores at zero
                out, lse = call(data, ring, **kwargs)
                check_against_reference(out, ref_out, mode, data[2], data[3], lse=lse, ref_lse=ref_lse,
                                        context=f"{label} (call {rep + 1})")
            results.append(dict(case=label, ok=True))
        except AssertionError as err:
            results.append(dict(case=label, ok=False, error=str(err)[:1500]))
        print(f"case {label}: {'ok' if results[-1]['ok'] else 'FAIL'}", flush=True)
print("RESULT " + json.dumps(results))
"""


WATCHDOG_LAYOUTS = ((False, 0), (True, 0), (False, 1), (False, 16), (False, 64))  # (causal, page size) the cases use


def watchdog_configs(spec, rings):
    """Every kernel config the watchdog child launches for ``rings`` (F8MMA's keys): per ring its overrides (the
    default ring's where only "ws" is given) flat, causal and over pages of 1 / 16 / 64, as the op selects them
    (``schedule.select_kernels``; tests/test_ws_structure.py checks the two agree)."""
    configs = []
    for ring in rings:
        kv_format, q_format = MODE_FORMATS[ring.split("-")[0]]
        overrides = {key: value for key, value in F8MMA[ring].items() if key != "ws"}
        for causal, page_size in WATCHDOG_LAYOUTS:
            problem = dict(kv_format=kv_format, q_format=q_format, causal=causal, page_size=page_size)
            configs.append(schedule.ws_config(spec, **problem, **overrides) if overrides
                           else schedule.ws_default_config(spec, **problem))
    return configs


def carry_configs(spec):
    """The kernels this module's watchdog children launch, which its collected items do not declare
    (``launches`` names problem classes, the children take F8MMA's rings): every ring's ``watchdog_configs``, for
    tools/cache_keys.py to build and carry beside the items' kernels."""
    return watchdog_configs(spec, list(F8MMA))


def prebuild_rings(rings):
    """Compile here, before the watchdog starts, every kernel the child launches for ``rings``: a compile takes
    30-60 s on the GPU host and cannot hang, so it stays outside the watchdog, which then times the rings alone (a
    kernel in the disk cache loads in well under a second). Without this, an opt-in ring missing from a carried
    cache spent the watchdog's time compiling."""
    from mla import jit
    from mla.target import spec_for_device

    spec = spec_for_device(torch.device("cuda"))
    for cfg in watchdog_configs(spec, rings):
        jit.get_kernel(cfg, spec)


# a8w8 and fp8: their default ring, prebuilt (flat, causal, paged); the opt-in kernels (mxfp4's, "-dyn", "-vt2")
# are compiled by ``prebuild_rings`` before the watchdog starts, in 30-60 s each unless a carried cache has them
# (tools/ws_check.py --prebuild --check --pages 1,16,64 with --modes mxfp4 --variants f8mmaps,mxd2,mxd2dyn; --modes
# fp8 --variants f8mmaqpstdyn,f8mma3v2qpstdyn,f8mmaqpstdynpc5; --modes a8w8 --variants
# f8mmapstdyn,f8mma4v2pstdyn,f8mmapstdynpc5).
@launches(lambda modes, **_: [(mode, 16, 1, causal, page) for mode in modes.split(",") if mode in ("a8w8", "fp8")
                              for causal, page in ((False, 0), (True, 0), (False, 1), (False, 16), (False, 64))])
@pytest.mark.parametrize("modes", ["a8w8,fp8", "mxfp4", "mxfp4-2dec", "a8w8-dyn,fp8-dyn", "mxfp4-2dec-dyn",
                                   "a8w8-vt2,fp8-vt2", "a8w8-pc5,fp8-pc5"])
def test_fp8_mma_ring_under_a_watchdog(modes):
    """a8w8, fp8 (bf16 Q) and mxfp4 (its e4m3 decoder, issue 28 step 4) on fp8 wgmma against the fp32 reference:
    the ring's boundaries and split counts, one-token splits, causal query passes, paged caches; every call twice;
    all in one child process that must finish within F8MMA_WATCHDOG_S."""
    import json
    import os
    import subprocess
    import sys

    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    prebuild_rings(modes.split(","))
    try:
        proc = subprocess.run([sys.executable, "-c", _F8MMA_CASES, modes], cwd=repo, capture_output=True, text=True,
                              timeout=F8MMA_WATCHDOG_S)
    except subprocess.TimeoutExpired as err:
        done = (err.stdout or b"").decode() if isinstance(err.stdout, bytes) else (err.stdout or "")
        pytest.fail(f"fp8_mma: no result within {F8MMA_WATCHDOG_S} s (hung; killed). Cases finished:\n{done[-2000:]}")
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, f"child exited with {proc.returncode}:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
    failed = [r for r in json.loads(lines[-1][7:]) if not r["ok"]]
    assert not failed, "\n".join(f"{r['case']}: {r['error']}" for r in failed)
