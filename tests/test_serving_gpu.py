"""What a serving stack needs from mla_decode, checked on the GPU against the fp32 reference (fresh random inputs
from fixed seeds, outputs poisoned with NaN before the call). Tolerances: see tests/helpers.py.

  * MTP: 1..8 query tokens per sequence (ragged qo_indptr), causal or not, every mode; with causal, a query i of
    a sequence with n queries and L tokens sees positions [0, L - n + i], so when n > L the first queries see
    nothing: output exactly 0, LSE -inf.
  * 16, 32, 64 and 128 heads.
  * LSE (natural log) and caller-supplied out= / lse= buffers, written in place and returned.
  * NaN / inf in one sequence's Q or KV rows stays in that sequence.
  * torch.compile(fullgraph=True) and CUDA graphs through the custom op (mla.ops).
  * A randomized sweep over all of it (500 fixed seeds).

The kernel variants these tests launch are built once, in parallel, before the first test (``prebuild``; about
200 variants over all tests, ~1.5 min on 16 cores; set MLA_TEST_PREBUILD=0 to build lazily instead).
"""

import dataclasses
import itertools
import math
import random
import zlib

import pytest
import torch

import mla.constants
import mla.decode
import mla.ops
from mla.inputs import make_ragged_inputs, to_paged

from conftest import requires_gpu
from helpers import (
    MODES,
    check_against_reference,
    describe_lengths,
    launches,
    plan_and_run,
    poisoned,
    q_tile_for,
    reference_for,
    run_mode,
)

pytestmark = requires_gpu

HEADS = [16, 32, 64, 128]
ENTRIES = {"mla.decode": mla.decode.mla_decode, "mla.ops": mla.ops.mla_decode, "plan": plan_and_run}


def seed_of(*params) -> int:
    """A fixed seed per test case (reproducible, different for every parameter combination)."""
    return zlib.crc32(repr(params).encode())


def run_and_check(mode, data, *, causal=False, decode=mla.decode.mla_decode, context="", run_kv_data=None, **kwargs):
    """Runs ``mode`` into NaN-poisoned out / lse buffers and checks both against the reference. ``run_kv_data``:
    the caches the op reads instead of data's (e.g. the same values in shuffled pages); the reference reads data's."""
    q, _, qo_indptr, kv_indptr, _ = data
    total_q, heads = q.shape[0], q.shape[1]
    out = poisoned((total_q, heads, 512), torch.bfloat16)
    lse = poisoned((total_q, heads), torch.float32)
    run_data = data if run_kv_data is None else (q, run_kv_data, *data[2:])
    run_mode(decode, mode, run_data, causal=causal, out=out, lse=lse, **kwargs)
    ref_out, ref_lse = reference_for(mode, data, causal=causal, sm_scale=kwargs.get("sm_scale"))
    check_against_reference(out, ref_out, mode, qo_indptr, kv_indptr, lse=lse, ref_lse=ref_lse, context=context)
    return out, lse, ref_out, ref_lse


# --- MTP: several query tokens per sequence ---------------------------------------------------------------------

# name -> (kv_lens, q_lens). Every layout has sequences with q_len > kv_len (their first queries see nothing when
# causal), e.g. "ragged": 5 > 3, 8 > 1, 8 > 7, 3 > 0; lengths straddle the 64-token KV tiles.
MTP_LAYOUTS = {
    # mean q_len 4.7 -> 4 query tokens per CTA pass; q_len 5..8 take two passes
    "ragged": ([517, 3, 4097, 1, 64, 6, 2000, 7, 0, 130, 65, 8], [1, 5, 2, 8, 4, 6, 3, 8, 3, 7, 1, 8]),
    # mean q_len <= 2 -> 2 per pass; q_len 3 and 5 take 2 and 3 passes
    "mostly_single": ([2 if i == 31 else 4 if i == 37 else 300 + 97 * i for i in range(40)],
                      [1] * 30 + [2, 3, 5, 2, 1, 3, 2, 5, 1, 3]),
    "uniform2": ([1024] * 48 + [1, 2, 63, 64, 65, 8192] * 2 + [4] * 4, 2),
    "uniform8": ([8192, 1, 5, 7, 8, 9, 100, 128, 129, 3000, 0, 2, 777, 64, 8, 16], 8),
}


def mtp_data(layout, seed, num_heads=16):
    kv_lens, q_lens = MTP_LAYOUTS[layout]
    return make_ragged_inputs(kv_lens, q_lens, num_heads=num_heads, seed=seed)


def layout_q_lens(layout):
    kv_lens, q_lens = MTP_LAYOUTS[layout]
    return [q_lens] * len(kv_lens) if isinstance(q_lens, int) else q_lens


@launches(lambda mode, causal, layout, **_: [(mode, 16, q_tile_for(layout_q_lens(layout)), causal)])
@pytest.mark.parametrize("num_splits", [None, 1, 7])
@pytest.mark.parametrize("layout", list(MTP_LAYOUTS))
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("mode", MODES)
def test_mtp_multi_token_queries(mode, causal, layout, num_splits):
    data = mtp_data(layout, seed_of("mtp", mode, causal, layout, num_splits))
    ctx = f"MTP layout {layout}, causal={causal}, num_splits={num_splits}"
    _, lse, _, ref_lse = run_and_check(mode, data, causal=causal, num_splits=num_splits, context=ctx)
    if causal:
        # Spelled out (check_against_reference covers it too): queries past the visible horizon see nothing.
        kv_lens, q_lens = MTP_LAYOUTS[layout][0], layout_q_lens(layout)
        blind = [sum(q_lens[:b]) + i for b, (n, L) in enumerate(zip(q_lens, kv_lens)) for i in range(n) if L - n + i < 0]
        assert blind, "layout should contain queries that see no KV token"
        assert torch.isneginf(ref_lse[blind]).all() and torch.isneginf(lse[blind]).all(), f"{ctx}: LSE of blind queries"


# --- head counts -------------------------------------------------------------------------------------------------

HEAD_LAYOUTS = {
    "decode": ([1, 63, 64, 65, 1000, 4097, 0, 300, 12000, 5], 1),
    "mtp_causal": ([1, 63, 64, 65, 1000, 4097, 0, 300, 12000, 5], [1, 2, 3, 4, 5, 6, 7, 8, 2, 8]),
}


def head_layout_classes(mode, heads, layout, **_):
    kv_lens, q_lens = HEAD_LAYOUTS[layout]
    q_lens = [q_lens] * len(kv_lens) if isinstance(q_lens, int) else q_lens
    return [(mode, heads, q_tile_for(q_lens), layout == "mtp_causal")]


@launches(head_layout_classes)
@pytest.mark.parametrize("num_splits", [None, 1])
@pytest.mark.parametrize("layout", list(HEAD_LAYOUTS))
@pytest.mark.parametrize("mode", ["bf16", "fp8"])
@pytest.mark.parametrize("heads", HEADS)
def test_head_counts(heads, mode, layout, num_splits):
    kv_lens, q_lens = HEAD_LAYOUTS[layout]
    data = make_ragged_inputs(kv_lens, q_lens, num_heads=heads, seed=seed_of("heads", heads, mode, layout, num_splits))
    out, *_ = run_and_check(
        mode, data, causal=layout == "mtp_causal", num_splits=num_splits,
        context=f"{heads} heads, layout {layout}, num_splits={num_splits}",
    )
    assert out.shape == (data[0].shape[0], heads, 512)


# --- LSE and caller buffers ----------------------------------------------------------------------------------------


@launches(lambda num_splits, **_: [("bf16", 16, 1, False)])
@pytest.mark.parametrize("num_splits", [None, 1, 3])
def test_lse_is_natural_log_of_scaled_scores(num_splits):
    """Sequence b repeats one KV row L_b times: every score is s = sm_scale * q.k, so LSE = s + ln(L_b) exactly
    and the output is that row's first 512 dims."""
    kv_lens = [1, 7, 64, 1000, 4097]
    gen = torch.Generator(device="cuda").manual_seed(seed_of("lse", num_splits))
    q = torch.randn(len(kv_lens), 16, 576, dtype=torch.bfloat16, device="cuda", generator=gen)
    rows = torch.randn(len(kv_lens), 1, 576, dtype=torch.bfloat16, device="cuda", generator=gen)
    kv = torch.repeat_interleave(rows, torch.tensor(kv_lens, device="cuda"), dim=0)
    qo = torch.arange(len(kv_lens) + 1, dtype=torch.int32, device="cuda")
    kvp = torch.tensor([0, *torch.tensor(kv_lens).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    sm_scale = 0.07
    out, lse = mla.ops.mla_decode(q, kv, qo, kvp, sm_scale=sm_scale, num_splits=num_splits, return_lse=True)
    scores = torch.einsum("bhd,bd->bh", q.double(), rows[:, 0].double()) * sm_scale
    expected = scores + torch.tensor(kv_lens, dtype=torch.float64, device="cuda").log()[:, None]
    torch.testing.assert_close(lse.double(), expected, rtol=1e-3, atol=1e-3, msg=lambda m: f"LSE != s + ln(L): {m}")
    torch.testing.assert_close(out, rows[:, :, :512].expand(-1, 16, -1), rtol=1e-2, atol=1e-2)


@launches(lambda mode, **_: [(mode, 16, q_tile_for(layout_q_lens("ragged")), True)])
@pytest.mark.parametrize("buffers", ["out", "lse", "out+lse"])
@pytest.mark.parametrize("entry", list(ENTRIES))
@pytest.mark.parametrize("mode", MODES)
def test_caller_buffers_are_written_in_place_and_returned(mode, entry, buffers):
    data = mtp_data("ragged", seed_of("buffers", mode, entry, buffers))
    total_q = data[0].shape[0]
    out = poisoned((total_q, 16, 512), torch.bfloat16) if "out" in buffers else None
    lse = poisoned((total_q, 16), torch.float32) if "lse" in buffers else None
    res_out, res_lse = run_mode(ENTRIES[entry], mode, data, causal=True, out=out, lse=lse, return_lse=True)
    assert out is None or res_out is out, f"{entry}: out= buffer not returned"
    assert lse is None or res_lse is lse, f"{entry}: lse= buffer not returned"
    ref_out, ref_lse = reference_for(mode, data, causal=True)
    check_against_reference(res_out, ref_out, mode, data[2], data[3], lse=res_lse, ref_lse=ref_lse,
                            context=f"{entry} with caller buffers {buffers}")
    if out is not None:  # return_lse=False returns the very buffer too
        again = run_mode(ENTRIES[entry], mode, data, causal=True, out=out)
        assert again is out


# --- a plan made once per step, run by every layer ----------------------------------------------------------------


def layer_inputs(mode, kv_lens, q_lens, layers, seed):
    """One harness tuple per layer: same batch layout, fresh Q and KV values."""
    return [make_ragged_inputs(kv_lens, q_lens, seed=seed + layer) for layer in range(layers)]


def kv_arguments(mode, kv_data):
    """(cache, its scale keywords) for DecodePlan.run."""
    kv, kwargs = mla.decode.harness_cache(kv_data, mode)
    return kv, {k: v for k, v in kwargs.items() if k not in ("kv_format", "q_format")}


PLAN_KV_LENS, PLAN_Q_LENS = [700, 0, 3, 2049, 64, 65, 5000, 1], [2, 1, 3, 2, 1, 2, 4, 1]


@launches(lambda mode, page_size, **_: [(mode, 16, q_tile_for(PLAN_Q_LENS), True, page_size)])
@pytest.mark.parametrize("page_size", [0, 16])
@pytest.mark.parametrize("mode", MODES)
def test_one_plan_serves_every_layer(mode, page_size):
    """plan() once (host offsets, CSR page lists for the paged cache), then run() for three layers' caches."""
    layers = layer_inputs(mode, PLAN_KV_LENS, PLAN_Q_LENS, 3, seed_of("plan_layers", mode, page_size))
    q_format = mla.constants.MODES[mode][1]
    paging, caches = {}, [layer[1] for layer in layers]
    if page_size:
        # Every layer's cache uses the same page list (as in a serving engine), so shuffle once.
        paged = [to_paged(layer, page_size, seed=7) for layer in layers]
        caches = [p[0] for p in paged]
        table = paged[0][1]
        needed = [-(-n // page_size) for n in PLAN_KV_LENS]
        paging = dict(page_size=page_size, kv_indices=torch.cat([table[b, :n] for b, n in enumerate(needed)]))
    qo = list(itertools.accumulate([0, *PLAN_Q_LENS]))
    kvp = list(itertools.accumulate([0, *PLAN_KV_LENS]))
    the_plan = mla.decode.plan(qo, kvp, num_heads=16, kv_format=mla.constants.MODES[mode][0], q_format=q_format,
                               causal=True, **paging)
    for layer, (data, cache) in enumerate(zip(layers, caches)):
        kv, extra = kv_arguments(mode, cache)
        total_q = data[0].shape[0]
        out = poisoned((total_q, 16, 512), torch.bfloat16)
        lse = poisoned((total_q, 16), torch.float32)
        the_plan.run(data[0], kv, out=out, lse=lse, **extra)
        ref_out, ref_lse = reference_for(mode, data, causal=True)
        check_against_reference(out, ref_out, mode, data[2], data[3], lse=lse, ref_lse=ref_lse,
                                context=f"{the_plan}, layer {layer}")


@launches(lambda mode, **_: [(mode, 16, q_tile_for(PLAN_Q_LENS), True, 16)])
@pytest.mark.parametrize("mode", ["bf16", "a8w8", "mxfp4"])
def test_plan_runs_captured_in_one_cuda_graph(mode):
    """Two layers' runs of one plan in one CUDA graph (the plan's split workspace is reused by both, in stream
    order); replayed with new Q values, both layers match the reference."""
    layers = layer_inputs(mode, PLAN_KV_LENS, PLAN_Q_LENS, 2, seed_of("plan_graph", mode))
    paged = [to_paged(layer, 16, seed=3) for layer in layers]
    table = paged[0][1]
    q_format = mla.constants.MODES[mode][1]
    the_plan = mla.decode.plan(layers[0][2], layers[0][3], num_heads=16, kv_format=mla.constants.MODES[mode][0],
                               q_format=q_format, causal=True, page_size=16, page_table=table, num_splits=3)
    outs = [torch.empty((layer[0].shape[0], 16, 512), dtype=torch.bfloat16, device="cuda") for layer in layers]
    lses = [torch.empty((layer[0].shape[0], 16), dtype=torch.float32, device="cuda") for layer in layers]

    def step():
        for data, (cache, _), out, lse in zip(layers, paged, outs, lses):
            kv, extra = kv_arguments(mode, cache)
            the_plan.run(data[0], kv, out=out, lse=lse, **extra)

    step()  # warm-up outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    gen = torch.Generator(device="cuda").manual_seed(seed_of("plan_graph_q", mode))
    for data, out, lse in zip(layers, outs, lses):
        data[0].copy_(torch.randn(data[0].shape, dtype=data[0].dtype, device="cuda", generator=gen))
        out.fill_(math.nan)
        lse.fill_(math.nan)
    graph.replay()
    torch.cuda.synchronize()
    for layer, (data, out, lse) in enumerate(zip(layers, outs, lses)):
        ref_out, ref_lse = reference_for(mode, data, causal=True)
        check_against_reference(out, ref_out, mode, data[2], data[3], lse=lse, ref_lse=ref_lse,
                                context=f"CUDA graph replay, layer {layer}")


# --- NaN / inf stays in its sequence -------------------------------------------------------------------------------

NAN_KV_LENS = [100, 37, 1000, 3, 2500, 70, 129]  # none a multiple of 64: tiles of neighbours straddle the boundary
NAN_Q_LENS = [1, 2, 3, 1, 4, 2, 8]
POISON_AT = {"first": 0, "middle": 2, "last": len(NAN_KV_LENS) - 1}


def poison_sequence(data, b, value):
    """Q rows and KV rows of sequence b := value (bf16); fp8 codes := NaN (e4m3fn has no inf); mxfp4 block scales
    := 0xFF (e8m0 NaN; e2m1 codes have no NaN)."""
    q, kv_data, qo_indptr, kv_indptr, _ = data
    q_lo, q_hi = qo_indptr[b].item(), qo_indptr[b + 1].item()
    kv_lo, kv_hi = kv_indptr[b].item(), kv_indptr[b + 1].item()
    q[q_lo:q_hi] = value
    kv_data["bf16"][kv_lo:kv_hi] = value
    kv_data["fp8"][0].view(torch.uint8)[kv_lo:kv_hi] = 0x7F
    kv_data["mxfp4"][1][kv_lo:kv_hi] = 0xFF


@launches(lambda mode, **_: [(mode, 16, q_tile_for(NAN_Q_LENS), True)])
@pytest.mark.parametrize("num_splits", [None, 4])
@pytest.mark.parametrize("value", [math.nan, math.inf], ids=["nan", "inf"])
@pytest.mark.parametrize("where", list(POISON_AT))
@pytest.mark.parametrize("mode", MODES)
def test_nonfinite_rows_stay_in_their_sequence(mode, where, value, num_splits):
    """a8w8 quantizes Q with ONE per-tensor scale (amax over all of Q), so a NaN anywhere in Q reaches every
    sequence by design: for a8w8 only the KV rows are poisoned (Q's reference is taken from the clean Q)."""
    data = make_ragged_inputs(NAN_KV_LENS, NAN_Q_LENS, seed=seed_of("nan", mode, where, value, num_splits))
    b = POISON_AT[where]
    q_clean = data[0].clone()
    poison_sequence(data, b, value)
    if mode == "a8w8":
        data[0].copy_(q_clean)
    total_q = data[0].shape[0]
    out = poisoned((total_q, 16, 512), torch.bfloat16)
    lse = poisoned((total_q, 16), torch.float32)
    run_mode(mla.decode.mla_decode, mode, data, causal=True, num_splits=num_splits, out=out, lse=lse)
    # Reference for the other sequences: the poisoned rows are theirs alone, so a reference on the poisoned data
    # is exact for every other sequence (a8w8: Q is clean).
    ref_out, ref_lse = reference_for(mode, data, causal=True)
    others = [s for s in range(len(NAN_KV_LENS)) if s != b]
    check_against_reference(out, ref_out, mode, data[2], data[3], lse=lse, ref_lse=ref_lse, seqs=others,
                            context=f"{value} in sequence {b} ({where}), num_splits={num_splits}")


# --- torch.compile and CUDA graphs through the custom op ----------------------------------------------------------


def op_inputs(mode, data):
    """(q, kv, kv_scale, kv_block_scale, qo, kvp) and the static keywords of ``mode`` for mla.ops.mla_decode."""
    q, kv_data, qo, kvp, _ = data
    if mode == "bf16":
        return (q, kv_data["bf16"], None, None, qo, kvp), {}
    if mode in ("fp8", "a8w8"):
        return (q, *kv_data["fp8"], None, qo, kvp), {"q_format": "fp8" if mode == "a8w8" else "bf16"}
    kv, block_scale = kv_data["mxfp4"]
    return (q, kv, None, block_scale, qo, kvp), {}


def serving_step(q_nope, q_pe, kv, kv_scale, kv_block_scale, qo, kvp, q_format="bf16", out=None, lse=None):
    """A decode step as a model would write it: concat the absorbed Q halves, attend, use the outputs."""
    q = torch.cat([q_nope, q_pe], dim=-1)
    o, l = mla.ops.mla_decode(q, kv, qo, kvp, kv_scale=kv_scale, kv_block_scale=kv_block_scale, q_format=q_format,
                              causal=True, out=out, lse=lse, return_lse=True)
    return o, l, o.float().sum(dim=1)


def split_q(args):
    q = args[0]
    return (q[..., :512].contiguous(), q[..., 512:].contiguous(), *args[1:])


@launches(lambda mode, **_: [(mode, 16, q_tile_for(layout_q_lens("ragged")), True)])
@pytest.mark.parametrize("buffers", [False, True], ids=["functional", "out_buffers"])
@pytest.mark.parametrize("mode", MODES)
def test_torch_compile_fullgraph_matches_eager(mode, buffers):
    torch._dynamo.reset()
    data = mtp_data("ragged", seed_of("compile", mode, buffers))
    args, kw = op_inputs(mode, data)
    args = split_q(args)
    total_q = data[0].shape[0]

    def bufs():
        return dict(out=poisoned((total_q, 16, 512), torch.bfloat16), lse=poisoned((total_q, 16), torch.float32)) if buffers else {}

    eager_kw, compiled_kw = bufs(), bufs()
    eager = serving_step(*args, **kw, **eager_kw)
    compiled = torch.compile(serving_step, fullgraph=True)(*args, **kw, **compiled_kw)
    # The op's outputs are bit-identical (same kernels, same inputs); the fused reduction after it may round differently.
    for name, e, c, tol in zip(("out", "lse", "sum"), eager, compiled, (0, 0, None)):
        torch.testing.assert_close(c, e, rtol=tol, atol=tol, msg=lambda m, name=name: f"compiled {name} != eager: {m}")
    if buffers:  # the caller's buffers hold the results after the compiled call too
        torch.testing.assert_close(compiled_kw["out"], eager[0], rtol=0, atol=0)
        torch.testing.assert_close(compiled_kw["lse"], eager[1], rtol=0, atol=0)
    ref_out, ref_lse = reference_for(mode, data, causal=True)
    check_against_reference(compiled[0], ref_out, mode, data[2], data[3], lse=compiled[1], ref_lse=ref_lse,
                            context="torch.compile(fullgraph=True)")


@launches(lambda **_: [("bf16", 16, 4, True), ("bf16", 16, 2, True), ("bf16", 16, 1, True)])
def test_torch_compile_dynamic_shapes():
    """One compiled function serves batches of different sizes (the fake implementation is shape-symbolic)."""
    torch._dynamo.reset()
    compiled = torch.compile(serving_step, fullgraph=True, dynamic=True)
    for layout in ("ragged", "mostly_single", "uniform8"):
        data = mtp_data(layout, seed_of("dynamic", layout))
        args, kw = op_inputs("bf16", data)
        out, lse, _ = compiled(*split_q(args), **kw)
        ref_out, ref_lse = reference_for("bf16", data, causal=True)
        check_against_reference(out, ref_out, "bf16", data[2], data[3], lse=lse, ref_lse=ref_lse,
                                context=f"torch.compile(dynamic=True), layout {layout}")
    data = make_ragged_inputs([5, 700], [1, 1], seed=3)  # q_len 1: a fourth shape, q_tile 1
    args, kw = op_inputs("bf16", data)
    out, _, _ = compiled(*split_q(args), **kw)
    check_against_reference(out, reference_for("bf16", data, causal=True)[0], "bf16", data[2], data[3],
                            context="torch.compile(dynamic=True), q_len 1")


@launches(lambda mode, **_: [(mode, 16, q_tile_for(layout_q_lens("ragged")), True)])
@pytest.mark.parametrize("buffers", [False, True], ids=["functional", "out_buffers"])
@pytest.mark.parametrize("mode", MODES)
def test_cuda_graph_capture_replay_matches_eager(mode, buffers):
    data = mtp_data("ragged", seed_of("graph", mode, buffers))
    q = data[0]
    total_q = q.shape[0]
    out = torch.empty((total_q, 16, 512), dtype=torch.bfloat16, device="cuda") if buffers else None
    lse = torch.empty((total_q, 16), dtype=torch.float32, device="cuda") if buffers else None

    def step():
        return run_mode(mla.ops.mla_decode, mode, data, causal=True, out=out, lse=lse, return_lse=True)

    eager_out, eager_lse = (t.clone() for t in step())  # also the warm-up: kernels built outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out, static_lse = step()
    if buffers:
        assert static_out is out and static_lse is lse
    static_out.fill_(math.nan)
    static_lse.fill_(math.nan)
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(static_out, eager_out, rtol=0, atol=0)
    torch.testing.assert_close(static_lse, eager_lse, rtol=0, atol=0)
    # New values in the same input buffers flow through the replay.
    q.copy_(torch.randn(q.shape, dtype=q.dtype, device="cuda", generator=torch.Generator(device="cuda").manual_seed(1)))
    graph.replay()
    ref_out, ref_lse = reference_for(mode, data, causal=True)
    check_against_reference(static_out, ref_out, mode, data[2], data[3], lse=static_lse, ref_lse=ref_lse,
                            context="CUDA graph replay with new Q")


@launches(lambda mode, **_: [(mode, 16, q_tile_for(layout_q_lens("ragged")), True)])
@pytest.mark.parametrize("mode", ["bf16", "a8w8"])
def test_torch_compile_reduce_overhead_cudagraphs(mode):
    """torch.compile(mode="reduce-overhead") records the op into CUDA graphs (no cudagraph skip) and replays it."""
    torch._dynamo.reset()
    from torch._dynamo.utils import counters

    counters.clear()
    data = mtp_data("ragged", seed_of("reduce-overhead", mode))
    args, kw = op_inputs(mode, data)
    args = split_q(args)
    compiled = torch.compile(serving_step, fullgraph=True, mode="reduce-overhead")
    for _ in range(3):  # warm-up, record, replay
        result = [t.clone() for t in compiled(*args, **kw)]
    assert counters["inductor"]["cudagraph_skips"] == 0, f"cudagraphs skipped: {dict(counters['inductor'])}"
    eager = serving_step(*args, **kw)
    for name, e, c, tol in zip(("out", "lse", "sum"), eager, result, (0, 0, None)):
        torch.testing.assert_close(c, e, rtol=tol, atol=tol, msg=lambda m, name=name: f"reduce-overhead {name} != eager: {m}")
    args[0].copy_(torch.randn_like(args[0]))  # new Q values through the replayed graph
    result = [t.clone() for t in compiled(*args, **kw)]
    eager = serving_step(*args, **kw)
    torch.testing.assert_close(result[0], eager[0], rtol=0, atol=0)


# --- randomized sweep ----------------------------------------------------------------------------------------------

SWEEP_SEEDS = list(range(1000, 1500))  # 500 fixed cases
# The first 96 seeds walk every flat kernel class (mode x heads x query tokens per CTA x causal) once, the next 24
# every paged class, so each kernel variant is checked at least once; the others draw the class at random (30% paged).
SWEEP_CLASSES = [(m, h, t, c, 0) for m in MODES for h in HEADS for t in (1, 2, 4) for c in (False, True)]
# Paged cases: every mode and page size, with two (heads, q_tile, causal) shapes (a paged kernel differs from the
# flat one only in how a row is addressed; the other dimensions are covered flat).
PAGED_CLASSES = [(m, h, t, c, p) for m in MODES for p in (1, 16, 64) for h, t, c in ((16, 1, False), (64, 4, True))]
MAX_ROWS = 1 << 16  # heads * total_q: bounds memory (fp32 reference, split partials) and reference time
MAX_PARTIAL_ROWS = 1 << 20  # heads * total_q * num_splits for a forced split count (2 GiB of fp32 partials)


@dataclasses.dataclass(frozen=True)
class SweepCase:
    seed: int
    mode: str
    heads: int
    causal: bool
    q_lens: tuple
    kv_lens: tuple
    num_splits: int | None
    sm_scale: float | None
    tail_rows: int  # NaN rows after the last sequence's KV: never to be read
    entry: str
    page_size: int  # 0: flat cache; else shuffled pages with NaN in every slot not to be read

    def describe(self) -> str:
        return (
            f"sweep seed {self.seed} (tests/test_serving_gpu.py::test_random_sweep[{self.seed}]): mode={self.mode} "
            f"heads={self.heads} causal={self.causal} batch={len(self.kv_lens)} num_splits={self.num_splits} "
            f"sm_scale={self.sm_scale} tail_rows={self.tail_rows} entry={self.entry} page_size={self.page_size} "
            f"q_tile={q_tile_for(self.q_lens)}\n"
            f"  q_lens={describe_lengths(list(self.q_lens))}\n  kv_lens={describe_lengths(list(self.kv_lens))}"
        )


def sweep_case(seed: int) -> SweepCase:
    """Most cases small (fast), a few large: batch up to 512, KV lengths up to 32k; q_len 1..8, ragged."""
    rng = random.Random(seed)
    index = seed - SWEEP_SEEDS[0]
    if 0 <= index < len(SWEEP_CLASSES):
        mode, heads, q_tile, causal, page_size = SWEEP_CLASSES[index]
    elif index < len(SWEEP_CLASSES) + len(PAGED_CLASSES):
        mode, heads, q_tile, causal, page_size = PAGED_CLASSES[index - len(SWEEP_CLASSES)]
    elif rng.random() < 0.3:
        mode, heads, q_tile, causal, page_size = rng.choice(PAGED_CLASSES)
    else:
        mode, heads, q_tile, causal, page_size = rng.choice(MODES), rng.choice(HEADS), rng.choice([1, 2, 4]), rng.random() < 0.5, 0
    size = rng.random()
    if size < 0.83:
        batch, max_len = rng.randint(1, 16), rng.choice([16, 256, 2048])
    elif size < 0.94:
        batch, max_len = rng.randint(17, 128), rng.choice([2048, 8192])
    elif size < 0.96:
        batch, max_len = rng.randint(256, 512), 2048
    else:
        batch, max_len = rng.randint(1, 8), 32768
    # Query lengths with the requested mean class (the op picks q_tile from the mean): 1 = all single tokens;
    # 2 = mean in (1, 2], mostly 1-2 with some longer; 4 = mean > 2.
    max_mean = {1: 1, 2: 2, 4: 8}[q_tile]
    batch = max(1, min(batch, MAX_ROWS // (heads * max_mean)))
    if q_tile == 1 or batch == 1 and q_tile == 2:
        q_lens = [1] * batch if q_tile == 1 else [2]
    elif q_tile == 2:
        q_lens = [rng.choice([1, 1, 1, 2, 2, rng.randint(3, 8)]) for _ in range(batch)]
        while sum(q_lens) > 2 * batch:
            q_lens[q_lens.index(max(q_lens))] = 1
        if sum(q_lens) == batch:
            q_lens[0] = 2
    elif rng.random() < 0.4:
        q_lens = [rng.randint(3, 8)] * batch
    else:
        q_lens = [rng.randint(1, 8) for _ in range(batch)]
        while sum(q_lens) <= 2 * batch:
            q_lens[q_lens.index(min(q_lens))] = 8
    assert q_tile_for(q_lens) == q_tile, (seed, q_lens)
    kv_lens = []
    for _ in q_lens:
        r = rng.random()
        kv_lens.append(0 if r < 0.05 else rng.randint(1, 8) if r < 0.2 else rng.randint(1, max_len))
    num_splits = None if rng.random() < 0.75 else rng.choice([1, 2, 3, 8, 32, 64])
    if num_splits and heads * sum(q_lens) * num_splits > MAX_PARTIAL_ROWS:
        num_splits = None
    sm_scale = None if rng.random() < 0.8 else round(rng.uniform(0.02, 0.12), 4)
    tail_rows = rng.choice([0, 0, 1, 37, 64])
    entry = list(ENTRIES)[seed % len(ENTRIES)]
    return SweepCase(seed, mode, heads, causal, tuple(q_lens), tuple(kv_lens), num_splits, sm_scale, tail_rows, entry,
                     page_size)


def poison_tail(data, tail_rows):
    """Cache rows past the last sequence := NaN (fp8 NaN code 0x7F, e8m0 NaN scale 0xFF)."""
    if tail_rows:
        _, kv_data, _, _, _ = data
        kv_data["bf16"][-tail_rows:] = math.nan
        kv_data["fp8"][0].view(torch.uint8)[-tail_rows:] = 0x7F
        kv_data["mxfp4"][1][-tail_rows:] = 0xFF


def sweep_classes(seed, **_):
    case = sweep_case(seed)
    return [(case.mode, case.heads, q_tile_for(case.q_lens), case.causal, case.page_size)]


@launches(sweep_classes)
@pytest.mark.parametrize("seed", SWEEP_SEEDS)
def test_random_sweep(seed):
    case = sweep_case(seed)
    data = make_ragged_inputs(list(case.kv_lens), list(case.q_lens), num_heads=case.heads, seed=seed,
                              tail_rows=case.tail_rows)
    poison_tail(data, case.tail_rows)
    paging = {}
    if case.page_size:
        paged, table = to_paged(data, case.page_size, seed=seed)
        paging = dict(run_kv_data=paged, page_table=table)
    try:
        run_and_check(case.mode, data, causal=case.causal, decode=ENTRIES[case.entry], num_splits=case.num_splits,
                      sm_scale=case.sm_scale, context=case.describe(), **paging)
    except AssertionError:
        raise
    except Exception as exc:  # a launch / build error: name the case too
        raise AssertionError(f"{type(exc).__name__}: {exc}\n{case.describe()}") from exc
