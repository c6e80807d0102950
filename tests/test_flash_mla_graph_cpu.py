"""The graph form of ``mla.flash_mla`` on the CPU (target forced, kernels replaced by recorders): the split model
the device schedule runs (against the host's ``choose_num_splits``), the metadata object as the serving engines use
it (``copy_``, one metadata for graphs of several batch sizes, ``num_splits`` in FlashMLA's layout, a block table
that is a slice of a wider buffer), what each call launches, and the errors, each naming its argument.
tests/test_flash_mla_gpu.py replays SGLang's and vLLM's graph sequences on the GPU."""

import math

import pytest
import torch

from mla import schedule, target
from mla.flash_mla import MLAMetadata, _GraphRun, _Run, flash_mla_with_kvcache, get_mla_metadata
from tl_kernels.mla_schedule import SplitScheduleConfig

from test_flash_mla_cpu import no_kernels, paged_inputs  # noqa: F401 - no_kernels: the autouse fixture

SM90 = target.spec_for_name("sm_90a")


def launched(recorders):
    calls = [(cfg, args) for cfg, r in recorders.items() for args in r.calls]
    for r in recorders.values():
        r.calls.clear()
    return calls


def call(q, cache, table, seqlens, meta, num_splits=None, **kw):
    return flash_mla_with_kvcache(q, cache, table, seqlens, 512, meta, num_splits, **kw)


# --- the split model of the device schedule -------------------------------------------------------------------------


@pytest.mark.parametrize("kv_format", ["bf16", "fp8", "mxfp4"])
@pytest.mark.parametrize("heads,s_q", [(16, 1), (16, 2), (64, 1), (128, 1), (16, 4)])
@pytest.mark.parametrize("batch", [1, 4, 8, 32, 64, 128, 512])
def test_uniform_lengths_split_as_the_host_plan(kv_format, heads, s_q, batch):
    """Equal lengths: each sequence's count is the one ``choose_num_splits`` picks for the split kernel (what an
    eager call planned for those lengths launches), wherever that count fits the graph grid."""
    cfg = schedule.graph_config(SM90, kv_format=kv_format, num_heads=heads, q_tile=schedule.query_tile(s_q, 1),
                                causal=s_q > 1)
    model = schedule.split_model(SM90, cfg, batch=batch)
    split_cfg = schedule.decode_config(SM90, kv_format=kv_format, num_heads=heads, q_tile=cfg.q_tile,
                                       causal=s_q > 1, split=True, page_size=64)
    for length in (0, 1, 63, 64, 65, 1000, 4096, 8192, 32768):
        counts = schedule.device_split_counts([length] * batch, model)
        assert counts == [per * b for per in [counts[1]] for b in range(batch + 1)], "equal lengths, equal counts"
        host = schedule.default_num_splits(SM90, split_cfg, batch=batch, total_kv=batch * length)
        if host <= model.max_splits:
            assert counts[1] == host, (length, counts[1], host)
        else:
            assert counts[1] <= model.max_splits


def test_ragged_lengths_split_in_proportion():
    """A long sequence among short ones takes more splits (chunks of about the mean length / the batch's count),
    every count within [1, max_splits]; negative lengths count as 0; FlashMLA's cumulative layout."""
    cfg = schedule.graph_config(SM90, kv_format="bf16")
    model = schedule.split_model(SM90, cfg, batch=4)
    counts = schedule.device_split_counts([16384, 64, 0, -5], model)
    per_seq = [b - a for a, b in zip(counts, counts[1:])]
    assert counts[0] == 0 and per_seq[1:] == [1, 1, 1] and 1 < per_seq[0] <= model.max_splits
    assert schedule.device_split_counts([], model) == [0]


@pytest.mark.parametrize("batch", [1, 2, 4, 8, 16, 32, 64, 128, 256, 1024])
def test_graph_grid_is_at_most_two_waves(batch):
    cfg = schedule.graph_config(SM90, kv_format="bf16")
    model = schedule.split_model(SM90, cfg, batch=batch)
    assert 1 <= model.max_splits <= schedule.MAX_SPLITS
    assert model.max_splits == 1 or batch * model.max_splits <= schedule.GRAPH_MAX_WAVES * model.slots + batch


def test_gfx942_has_no_graph_form_kernel():
    assert schedule.graph_config(target.spec_for_name("gfx942"), kv_format="bf16") is None


# --- get_mla_metadata(cache_seqlens, ...) and copy_ ----------------------------------------------------------------


def test_old_pattern_schedules_without_reading_lengths_on_the_host():
    lengths = torch.tensor([5, 0, 9000, 64], dtype=torch.int32)
    meta, num_splits = get_mla_metadata(lengths, 16, 1)
    cfg = schedule.graph_config(SM90, kv_format="bf16")
    expected = schedule.device_split_counts(lengths.tolist(), schedule.split_model(SM90, cfg, batch=4))
    assert num_splits.tolist() == expected and meta.lengths is None and meta.max_batch == 4
    _, fp8_splits = get_mla_metadata(lengths, 16, 1, is_fp8_kvcache=True)
    fp8 = schedule.graph_config(SM90, kv_format="fp8")
    assert fp8_splits.tolist() == schedule.device_split_counts(lengths.tolist(),
                                                               schedule.split_model(SM90, fp8, batch=4))


def test_copy_takes_the_other_schedule():
    startup, startup_splits = get_mla_metadata(torch.ones(8, dtype=torch.int32), 16, 1)
    step, step_splits = get_mla_metadata(torch.tensor([9000, 7, 300], dtype=torch.int32), 16, 1)
    before = startup_splits.clone()
    assert startup.copy_(step) is startup
    assert torch.equal(startup_splits[:4], step_splits) and torch.equal(startup_splits[4:], before[4:])


COPY_ERRORS = [
    ("not metadata", lambda: torch.zeros(4, dtype=torch.int32), TypeError, "other: expected an MLAMetadata"),
    ("new pattern", lambda: get_mla_metadata()[0], ValueError, "copy_: both metadata must come from"),
    ("larger", lambda: get_mla_metadata(torch.ones(9, dtype=torch.int32), 16, 1)[0], ValueError,
     "other: made for 9 sequences, this metadata for at most 8"),
    ("tokens", lambda: get_mla_metadata(torch.ones(2, dtype=torch.int32), 32, 1)[0], ValueError,
     "other: made for num_q_tokens_per_head_k=32"),
]


@pytest.mark.parametrize("make,error,message", [c[1:] for c in COPY_ERRORS], ids=[c[0] for c in COPY_ERRORS])
def test_copy_errors_name_the_argument(make, error, message):
    startup, _ = get_mla_metadata(torch.ones(8, dtype=torch.int32), 16, 1)
    with pytest.raises(error, match=message):
        startup.copy_(make())
    with pytest.raises(ValueError, match="copy_: both metadata must come from"):
        get_mla_metadata()[0].copy_(startup)


# --- the calls ----------------------------------------------------------------------------------------------------


def test_one_metadata_serves_graphs_of_several_batch_sizes(no_kernels):
    """SGLang's pattern: one start-up metadata (lengths of 1 for the largest batch), calls at batch 1, 4 and 8 given
    slices of its num_splits and of one wide block-table buffer; each launches the split kernel over its batch's
    grid with exactly those tensors, then the combine."""
    max_bs, width = 8, 40
    startup, startup_splits = get_mla_metadata(torch.ones(max_bs, dtype=torch.int32), 16, 1)
    buffer = torch.zeros(max_bs, width, dtype=torch.int32)
    for bs in (1, 4, 8):
        q, cache, _, seqlens, _ = paged_inputs([100 * (b + 1) for b in range(bs)])
        table = buffer[:bs, :3]
        buffer[:bs, :2] = torch.arange(2 * bs, dtype=torch.int32).view(bs, 2) % cache.shape[0]
        step, step_splits = get_mla_metadata(seqlens, 16, 1)
        startup.copy_(step)
        num_splits = startup_splits[:bs + 1]
        out, lse = call(q, cache, table, seqlens, startup, num_splits, causal=True)
        assert out.shape == (bs, 1, 16, 512) and lse.shape == (bs, 16, 1)
        calls = launched(no_kernels)
        (decode_cfg, d), *combine = calls
        model = schedule.split_model(SM90, decode_cfg, batch=bs)
        # The table's rows go whole (a (bs, 40) view of the buffer): entries past the slice are read where needed.
        assert decode_cfg.split_counts and d[9] == model.max_splits and d[10] is num_splits
        assert d[7].shape == (bs, width) and d[7].data_ptr() == buffer.data_ptr() and d[7].is_contiguous()
        if model.max_splits > 1:
            ((combine_cfg, c),) = combine
            assert combine_cfg.flash_io and c[2] is num_splits and c[3] == model.max_splits
            assert c[0].numel() >= model.max_splits * bs * 16 * 512
        assert torch.equal(num_splits, step_splits)
    assert len(startup._runs) == 3
    with pytest.raises(ValueError, match="cache_seqlens: get_mla_metadata was given 8 lengths, q has batch 9"):
        q, cache, table, seqlens, _ = paged_inputs([5] * 9)
        call(q, cache, table, seqlens, startup)


def test_vllm_pattern_schedules_on_the_first_call_of_a_run(no_kernels):
    """vLLM's pattern: get_mla_metadata(seq_lens, ...) every step, the calls pass no num_splits: the first call of
    each run computes its own schedule from cache_seqlens on the device (a kernel; inside a CUDA graph when
    captured), the other layers reuse it."""
    q, cache, table, seqlens, _ = paged_inputs([700, 0, 2900, 64])
    meta, _ = get_mla_metadata(seqlens, 16, 1)
    for _ in range(3):
        call(q, cache, table, seqlens, meta, causal=True)
    calls = launched(no_kernels)
    schedules = [args for cfg, args in calls if isinstance(cfg, SplitScheduleConfig)]
    decodes = [args for cfg, args in calls if getattr(cfg, "split_counts", False)]
    (run,) = meta._runs.values()
    assert isinstance(run, _GraphRun) and len(schedules) == 1 and len(decodes) == 3
    assert schedules[0][0] is seqlens and schedules[0][1] is run.own_splits
    assert list(schedules[0][2:]) == list(run.model.args()) and all(d[10] is run.own_splits for d in decodes)


def test_new_pattern_eager_keeps_the_host_plan(no_kernels):
    """get_mla_metadata() and eager calls with a contiguous table: the plan from the exact lengths (one launch of
    the FlashMLA-shaped fused kernel for a small call), as before."""
    q, cache, table, seqlens, _ = paged_inputs([700, 0, 2900, 64])
    meta, _ = get_mla_metadata()
    call(q, cache, table, seqlens, meta, causal=True)
    ((cfg, _),) = launched(no_kernels)
    assert cfg.fused_combine and cfg.flash_io and meta.plan is not None


def test_strided_block_table_takes_the_graph_form(no_kernels):
    """A block table that is a slice of a wider buffer goes to the kernel as whole rows of that buffer (any row
    stride: TileLang's launcher would pass a compact copy of the slice, which ends at its width; seen on the H200);
    a slice whose buffer ends inside its last row goes as it is; a table whose entries are not consecutive within a
    row is refused."""
    q, cache, table, seqlens, _ = paged_inputs([700, 0, 2900, 64])
    wide = torch.zeros(6, 100, dtype=torch.int32)
    wide[:4, :table.shape[1]] = table
    meta, _ = get_mla_metadata()
    call(q, cache, wide[:4, :table.shape[1]], seqlens, meta, causal=True)
    ((decode_cfg, d),) = [(cfg, args) for cfg, args in launched(no_kernels) if getattr(cfg, "split_counts", False)]
    assert d[7].shape == (4, 100) and d[7].is_contiguous() and torch.equal(d[7][:, :table.shape[1]], table)
    tail = torch.zeros(4 * 100 - 100 + table.shape[1], dtype=torch.int32)  # the buffer ends inside its last row
    tail.as_strided(table.shape, (100, 1)).copy_(table)
    call(q, cache, tail.as_strided(table.shape, (100, 1)), seqlens, get_mla_metadata()[0], causal=True)
    ((_, d),) = [(cfg, args) for cfg, args in launched(no_kernels) if getattr(cfg, "split_counts", False)]
    assert d[7].shape == table.shape and d[7].stride() == (100, 1)
    with pytest.raises(ValueError, match="block_table: expected each row's entries consecutive"):
        call(q, cache, wide.t()[:4, :table.shape[1]], seqlens, get_mla_metadata()[0], causal=True)


GRAPH_MISMATCH = [
    ("s_q", dict(s_q=2), {}, "made for q's s_q 1, this call has 2"),
    ("heads", dict(heads=32), {}, "made for q's h_q 16, this call has 32"),
    ("page", dict(page=16), {}, "made for k_cache's page_block_size 64"),
    ("format", dict(kv_format="fp8"), {}, "made for is_fp8_kvcache False"),
]


@pytest.mark.parametrize("inputs,kw,message", [c[1:] for c in GRAPH_MISMATCH], ids=[c[0] for c in GRAPH_MISMATCH])
def test_graph_form_reuse_with_another_layout_raises(inputs, kw, message):
    meta, _ = get_mla_metadata()
    q, cache, table, seqlens, _ = paged_inputs([100, 3000])
    call(q, cache, table, seqlens, meta, torch.zeros(3, dtype=torch.int32))  # a graph-form call
    q, cache, table, seqlens, extras = paged_inputs([100, 3000], **inputs)
    with pytest.raises(ValueError, match="tile_scheduler_metadata: " + message):
        call(q, cache, table, seqlens, meta, torch.zeros(3, dtype=torch.int32), **extras, **kw)


@pytest.mark.parametrize("mode", ["bf16", "fp8", "a8w8", "mxfp4"])
def test_every_format_in_the_graph_form(no_kernels, mode):
    """fp8 with bf16 Q, a8w8 (bf16 Q quantized inside: amax(|q|) reduced first) and mxfp4 take the same form."""
    kv_format = "bf16" if mode == "bf16" else "mxfp4" if mode == "mxfp4" else "fp8"
    q, cache, table, seqlens, extras = paged_inputs([700, 0, 2900, 64], kv_format=kv_format)
    if mode == "a8w8":
        extras["q_format"] = "fp8"
    meta, num_splits = get_mla_metadata(seqlens, 16, 1, is_fp8_kvcache=kv_format == "fp8")
    call(q, cache, table, seqlens, meta, num_splits, **extras)
    all_calls = [(cfg, args) for cfg, r in no_kernels.items() for args in r.calls]
    kernels = [k for k in launched(no_kernels) if not k[0].name.startswith("mla_amax_")]
    (decode_cfg, d), (combine_cfg, _) = kernels
    if mode == "a8w8":  # our amax(|q|) reduction, on q's rows, into the amax the decode takes as q_scale
        ((_, a),) = [k for k in all_calls if k[0].name.startswith("mla_amax_")]
        assert a[0].shape == (4, 16, 576) and a[0].data_ptr() == q.data_ptr() and a[1] is d[4]
    assert decode_cfg.split_counts and decode_cfg.kv_format == kv_format and combine_cfg.flash_io
    assert decode_cfg.q_format == ("fp8" if mode == "a8w8" else "bf16")
    assert d[0] is q and d[6] is seqlens


def test_gfx942_graph_form_reads_lengths_at_every_call(monkeypatch, no_kernels):
    """gfx942 (no graph-form kernel): the package's kernels on views, split for the block table's capacity, the
    offsets computed from cache_seqlens at every call (so a captured graph reads the lengths of each replay)."""
    monkeypatch.setenv("MLA_TARGET", "gfx942")
    q, cache, table, seqlens, _ = paged_inputs([700, 0, 2900, 64])
    meta, num_splits = get_mla_metadata(seqlens, 16, 1)
    call(q, cache, table, seqlens, meta, num_splits)
    (run,) = meta._runs.values()
    assert isinstance(run, _Run) and run.lengths_on_device
    decode = [args for cfg, args in launched(no_kernels) if getattr(cfg, "dim_split", False)]
    assert decode and decode[0][7].tolist() == [0, 700, 700, 3600, 3664], "kv_indptr from cache_seqlens"
    seqlens[0] = 5
    call(q, cache, table, seqlens, meta, num_splits)
    decode = [args for cfg, args in launched(no_kernels) if getattr(cfg, "dim_split", False)]
    assert decode[0][7].tolist() == [0, 5, 5, 2905, 2969]
