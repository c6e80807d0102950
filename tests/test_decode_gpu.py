"""mla_decode on the GPU against the fp32 reference, on fresh random inputs, with poisoned outputs.

Tolerances (stated once): the kernel rounds P to bf16 before P V (8 significant bits) and rounds the output to
bf16; errors are unbiased, so the relative L2 error stays a few 1e-3 while single elements can reach about
2^-8 of the largest output. Quantized formats are compared with the reference run on the *dequantized* inputs,
so their kernels must be just as exact (dequantization inside the kernel is exact in bf16).
"""

import math
import random

import pytest
import torch

import mla.constants
from mla import formats
from mla.decode import custom_kernel, mla_decode, run_harness
from mla.inputs import HARNESS_SHAPES, make_harness_inputs, make_ragged_inputs, to_paged
from mla.reference import harness_reference, mla_decode_reference

from conftest import requires_gpu
from helpers import launches

pytestmark = requires_gpu

MODES = list(mla.constants.MODES)  # KV format (+ Q precision for a8w8)
REL_L2 = {"bf16": 1e-2, "fp8": 2e-2, "a8w8": 2e-2, "mxfp4": 2e-2}
MAX_ABS_FRACTION = 2e-2  # of max |ref|


def run_mode(mode, data, **kwargs):
    return run_harness(data, mode, **kwargs)


def reference_for(mode, data, causal=False):
    """fp32 reference on exactly the values the kernel sees (dequantized KV; quantized Q for a8w8)."""
    return harness_reference(data, mode, causal=causal)


def assert_close_to_reference(out, ref, mode):
    assert out.dtype == torch.bfloat16 and out.shape == ref.shape
    assert torch.isfinite(out).all(), "NaN/inf in the output: an element was not written or a poisoned row was read"
    err = out.float() - ref
    rel_l2 = (err.norm() / ref.norm().clamp_min(1e-30)).item()
    assert rel_l2 <= REL_L2[mode], f"{mode}: relative L2 error {rel_l2:.2e} > {REL_L2[mode]:.0e}"
    max_abs, bound = err.abs().max().item(), MAX_ABS_FRACTION * ref.abs().max().item() + 1e-6
    assert max_abs <= bound, f"{mode}: max abs error {max_abs:.3e} > {bound:.3e}"


def poisoned(shape, dtype):
    return torch.full(shape, math.nan, dtype=dtype, device="cuda")


@launches(lambda mode, **_: [(mode, 16, 1, False)])
@pytest.mark.parametrize("batch,kv_len", HARNESS_SHAPES)
@pytest.mark.parametrize("mode", MODES)
def test_harness_shapes(mode, batch, kv_len):
    data = make_harness_inputs(batch, kv_len, seed=random.randrange(1 << 30))
    total_q = data[0].shape[0]
    out = poisoned((total_q, 16, 512), torch.bfloat16)
    lse = poisoned((total_q, 16), torch.float32)
    run_mode(mode, data, out=out, lse=lse)
    ref_out, ref_lse = reference_for(mode, data)
    assert_close_to_reference(out, ref_out, mode)
    torch.testing.assert_close(lse, ref_lse, rtol=1e-3, atol=1e-3)


def ragged_case(seed, max_batch=300, max_len=9000):
    rng = random.Random(seed)
    batch = rng.randint(1, max_batch)
    kv_lens = [0 if rng.random() < 0.1 else rng.randint(1, max_len) for _ in range(batch)]
    return kv_lens


def poison_tail(data, tail_rows):
    """Fill the cache rows past the last sequence with NaN (fp8 NaN code, e8m0 NaN scale 0xFF)."""
    _, kv_data, _, _, _ = data
    kv_data["bf16"][-tail_rows:] = math.nan
    kv_data["fp8"][0].view(torch.uint8)[-tail_rows:] = 0x7F  # e4m3fn NaN
    kv_data["mxfp4"][1][-tail_rows:] = 0xFF


@launches(lambda mode, **_: [(mode, 16, 1, False)])
@pytest.mark.parametrize("seed", [1, 2, 3])
@pytest.mark.parametrize("mode", MODES)
def test_ragged_batches(mode, seed):
    kv_lens = ragged_case(seed * 7919 + random.randrange(1000))
    data = make_ragged_inputs(kv_lens, seed=seed, tail_rows=64)
    poison_tail(data, 64)
    total_q = data[0].shape[0]
    out = poisoned((total_q, 16, 512), torch.bfloat16)
    run_mode(mode, data, out=out)
    ref_out, _ = reference_for(mode, data)
    assert_close_to_reference(out, ref_out, mode)
    empty = [b for b, n in enumerate(kv_lens) if n == 0]
    assert (out[empty] == 0).all(), "a sequence with no KV tokens must output zeros"


@launches(lambda **_: [("bf16", 16, 1, False)])
@pytest.mark.parametrize("num_splits", [1, 2, 7, 33])
def test_split_counts_agree(num_splits):
    """Any split count computes the same function (edge: more splits than tiles leaves empty splits)."""
    data = make_ragged_inputs([1, 63, 64, 65, 1000, 4097, 0], seed=num_splits)
    ref_out, ref_lse = reference_for("bf16", data)
    out, lse = run_mode("bf16", data, num_splits=num_splits, return_lse=True)
    assert_close_to_reference(out, ref_out, "bf16")
    torch.testing.assert_close(lse, ref_lse, rtol=1e-3, atol=1e-3)
    assert torch.isinf(lse[-1]).all() and (lse[-1] < 0).all(), "empty sequence: LSE must be -inf"


# The fused split merge of the sm_90a decode kernel (``fused_combine``: one cooperative launch, no combine kernel;
# the default for grids of at most one CTA per SM, schedule.fused_fits), forced here for any split count. Its
# variants build in the test (not prebuilt) where the default schedule does not pick them.
FUSED = {"fused_combine": True}


def with_q(data, q):
    return (q, *data[1:])


def run_fused_twice(mode, data, flat_data, num_splits, causal=False, **kwargs):
    """Two calls (the grid barrier must work again), outputs poisoned before each, both against the fp32 reference.
    The second call's Q is 2^16 times smaller and its softmax scale 2^16 times larger (the same scores): a8w8's
    amax cell must have been left at zero, or the second call would quantize Q with the first call's amax and most
    of its codes would round to zero."""
    sm_scale = mla.constants.DEFAULT_SM_SCALE
    for call in range(2):
        if call == 1:
            q, sm_scale = data[0] * 2.0**-16, sm_scale * 2.0**16
            data, flat_data = with_q(data, q), with_q(flat_data, q)
        ref_out, ref_lse = harness_reference(flat_data, mode, causal=causal, sm_scale=sm_scale)
        heads = ref_out.shape[1]
        out = poisoned(tuple(ref_out.shape), torch.bfloat16)
        lse = poisoned((ref_out.shape[0], heads), torch.float32)
        run_mode(mode, data, num_splits=num_splits, causal=causal, out=out, lse=lse, return_lse=True,
                 sm_scale=sm_scale, config_overrides=FUSED, **kwargs)
        assert_close_to_reference(out, ref_out, mode)
        seen = torch.isfinite(ref_lse)
        assert torch.equal(torch.isfinite(lse), seen), "LSE: -inf exactly where a query sees nothing"
        torch.testing.assert_close(lse[seen], ref_lse[seen], rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("num_splits", [1, 3, 17])
@pytest.mark.parametrize("mode", MODES)
def test_fused_merge_any_split_count(mode, num_splits):
    """Every format, an empty sequence, sequences shorter than a split, more splits than tiles."""
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("fused_combine is an sm_90a variant")
    data = make_ragged_inputs([1, 63, 64, 65, 1000, 4097, 0], seed=40 + num_splits)
    run_fused_twice(mode, data, data, num_splits)


@pytest.mark.parametrize("heads,q_len,page_size,num_splits", [(64, 1, 0, 5), (16, 2, 64, 4), (128, 3, 16, 4)])
def test_fused_merge_heads_queries_pages(heads, q_len, page_size, num_splits):
    """Head groups (64 / 128 heads: 128 x 4 queries is 8 groups of 16 heads, 128 CTAs here), query passes (MTP,
    causal) and paged caches through the fused merge."""
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("fused_combine is an sm_90a variant")
    data = make_ragged_inputs([5, 700, 2049, 130], q_len, num_heads=heads, seed=heads + q_len)
    run_data, extra = data, {}
    if page_size:
        caches, table = to_paged(data, page_size, seed=3)
        run_data, extra = (data[0], caches, *data[2:]), {"page_table": table}
    run_fused_twice("bf16", run_data, data, num_splits, causal=q_len > 1, **extra)


def test_fused_merge_refuses_a_grid_larger_than_the_gpu():
    """The cooperative launch needs every CTA resident: a forced fused merge over more CTAs than SMs is refused
    before any launch (not a launch error, and never a hang at the barrier)."""
    data = make_ragged_inputs([300] * 10, seed=5)
    with pytest.raises(ValueError, match="fused_combine"):
        run_mode("bf16", data, num_splits=14, config_overrides=FUSED)


@launches(lambda mode, **_: [(mode, 16, 1, False)])
@pytest.mark.parametrize("mode", MODES)
def test_cuda_graph_replay_matches_eager(mode):
    data = make_harness_inputs(32, 1024, seed=11)
    eager = run_mode(mode, data).clone()
    static_out = torch.empty_like(eager)
    run_mode(mode, data, out=static_out)  # warm-up: compile and cache outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run_mode(mode, data, out=static_out)
    static_out.fill_(math.nan)
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(static_out, eager, rtol=0, atol=0)
    # New values in the same buffers must flow through the replay.
    data[0].copy_(torch.randn_like(data[0]))
    graph.replay()
    assert_close_to_reference(static_out, reference_for(mode, data)[0], mode)


@launches(lambda **_: [("bf16", 16, 1, False)])
def test_custom_kernel_harness_entry_point():
    data = make_harness_inputs(4, 1024, seed=5)
    out = custom_kernel(data)
    assert out.shape == (4, 16, 512) and out.dtype == torch.bfloat16
    assert_close_to_reference(out, reference_for("bf16", data)[0], "bf16")


def test_empty_batch_and_zero_queries():
    data = make_ragged_inputs([5, 7], seed=0)
    q, kv_data, qo, kvp, _ = data
    out = mla_decode(q[:0], kv_data["bf16"], torch.zeros(3, dtype=torch.int32, device="cuda"), kvp)
    assert out.shape == (0, 16, 512)
    one = torch.zeros(1, dtype=torch.int32, device="cuda")
    assert mla_decode(q[:0], kv_data["bf16"], one, one).shape == (0, 16, 512)


@launches(lambda mode, page_size, **_: [(mode, 16, 1, False, page_size)])
@pytest.mark.parametrize("page_size", [1, 16, 64])
@pytest.mark.parametrize("mode", MODES)
def test_paged_kv_with_shuffled_pages(mode, page_size):
    kv_lens = [1, 0, 63, 64, 65, 700, 2049]
    data = make_ragged_inputs(kv_lens, seed=page_size)
    paged, table = to_paged(data, page_size, seed=page_size)
    q, _, qo_indptr, kv_indptr, config = data
    out = poisoned((q.shape[0], 16, 512), torch.bfloat16)
    run_mode(mode, (q, paged, qo_indptr, kv_indptr, config), out=out, page_table=table, check_inputs=True)
    assert_close_to_reference(out, reference_for(mode, data)[0], mode)
    assert (out[1] == 0).all(), "empty sequence: zeros"


def test_check_inputs_catches_bad_page_numbers():
    kv_lens = [5, 40]
    data = make_ragged_inputs(kv_lens, seed=1)
    paged, table = to_paged(data, 16, seed=1)
    table[1, 0] = 10_000
    q, _, qo_indptr, kv_indptr, _ = data
    with pytest.raises(ValueError, match="page_table: sequence 1 uses page 10000"):
        mla_decode(q, paged["bf16"], qo_indptr, kv_indptr, page_table=table, check_inputs=True)


@launches(lambda mode, **_: [(mode, 16, 1, False)])
@pytest.mark.parametrize("mode", ["fp8", "a8w8", "mxfp4"])
def test_compressed_cache_is_never_expanded_in_memory(mode):
    """The kernels read the compressed cache directly: the call's peak allocation stays far below the size of a
    bf16 copy of the cache (here 604 MB)."""
    data = make_harness_inputs(64, 8192, seed=3)
    run_mode(mode, data)  # compile, create workspaces
    torch.cuda.synchronize()
    bf16_copy_bytes = data[1]["bf16"].numel() * 2
    baseline = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    run_mode(mode, data)
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - baseline
    assert extra < bf16_copy_bytes / 20, f"{mode}: {extra / 1e6:.1f} MB allocated during the call"


@launches(lambda mode, **_: [(mode, 16, 1, False)])
@pytest.mark.parametrize("batch,kv_len", [(4, 1024), (64, 8192)])
@pytest.mark.parametrize("mode", MODES)
def test_competition_check_passes(mode, batch, kv_len):
    """The competition's check: |out - ref| <= 0.1 + 0.1 |ref| elementwise against its a8w8 reference (fp8 Q and
    fp8 KV with per-tensor scales, exact math); it tolerates 5% misses, we require none."""
    data = make_harness_inputs(batch, kv_len, seed=random.randrange(1 << 30))
    q, kv_data, qo_indptr, kv_indptr, _ = data
    q8 = formats.dequantize_fp8(*formats.quantize_fp8(q))
    ref, _ = mla_decode_reference(q8, formats.dequantize_kv(kv_data["fp8"], "fp8"), qo_indptr, kv_indptr)
    out = run_mode(mode, data).float()
    misses = ((out - ref).abs() > 0.1 + 0.1 * ref.abs()).sum().item()
    assert misses == 0, f"{mode}: {misses} elements outside the competition tolerance"
