"""``mla.flash_mla`` under CUDA graphs the way the serving engines run FlashMLA, on the GPU, against the fp32
reference: SGLang's sequence (one start-up metadata from lengths of 1, graphs captured at batch 1, 4 and 8 sharing
it, every step a fresh ``get_mla_metadata`` copied into it with ``copy_`` and into its ``num_splits`` buffer, a
block table that is a slice of one wide buffer) and vLLM's (a fresh metadata per step from the step's lengths, calls
without ``num_splits``, two layers per graph, persistent length and table buffers). Lengths grow from step to step,
from 0 to 32768, including 0, 1, 63, 64 and 65; the graphs were captured at other lengths. Each replay's output is
poisoned first and checked whole; its split schedule is compared with ``schedule.device_split_counts``.
Also: the schedule kernel against the host model on ragged batches up to 1000 sequences, and any ``num_splits``
(even nonsense counts) giving the right result, only the speed depending on it.
"""

from __future__ import annotations

import math
import random

import pytest
import torch

from mla import schedule
from mla.flash_mla import _GraphRun, flash_mla_with_kvcache, get_mla_metadata
from mla.inputs import make_ragged_inputs, to_paged
from mla.target import spec_for_device

from conftest import requires_gpu
from helpers import launches
from test_flash_mla_gpu import check

pytestmark = requires_gpu

PAGE = 64
MAX_BS = 8
MAX_CONTEXT = 32768
HEADS = 16
GRAPH_BATCHES = (1, 4, 8)
STEPS = 20
FORMATS = ("bf16", "fp8", "mxfp4")


def growing_lengths(seed: int) -> list[list[int]]:
    """STEPS rows of MAX_BS lengths, each row >= the one before slot by slot: the first holds 0, 1, 63, 64 and 65
    (and two more small ones), the last reaches MAX_CONTEXT."""
    rng = random.Random(seed)
    row = [0, 1, 63, 64, 65, 2, 127, 300]
    rows = [row]
    for step in range(1, STEPS):
        target = int(MAX_CONTEXT ** (step / (STEPS - 1)))
        row = [min(MAX_CONTEXT, rng.randrange(max(n, target // 2), max(n, target) + 1)) for n in row]
        if step == STEPS - 1:
            row[rng.randrange(MAX_BS)] = MAX_CONTEXT
        rows.append(row)
    return rows


class Engine:
    """One model's KV state: MAX_BS request slots of MAX_CONTEXT tokens (fresh random values, shuffled pages, NaN
    wherever nothing may be read), in the three cache formats; the step's view of it as harness data."""

    def __init__(self, seed: int):
        fp8 = spec_for_device(torch.device("cuda")).fp8_torch_dtype
        self.full = make_ragged_inputs([MAX_CONTEXT] * MAX_BS, 1, num_heads=HEADS, seed=seed, device="cuda",
                                       fp8_dtype=fp8)
        self.paged, self.pages = to_paged(self.full, PAGE, seed=seed + 1)  # pages (MAX_BS, MAX_CONTEXT / 64 + 1)
        self.nan_page = int(self.pages[0, -1])  # to_paged's spare NaN page

    def cache(self, kv_format: str):
        """(k_cache (num_pages, 64, 1, row), keyword arguments of the call) for a format."""
        if kv_format == "bf16":
            return self.paged["bf16"], {}
        if kv_format == "fp8":
            codes, scale = self.paged["fp8"]
            return codes, dict(descale_k=scale)  # is_fp8_kvcache passed by the calls
        codes, scales = self.paged["mxfp4"]
        return codes, dict(kv_block_scale=scales)

    def step_data(self, q: torch.Tensor, lengths: list[int]):
        """Harness data of the first len(lengths) slots cut to ``lengths`` with ``q`` ((bs, 1, H, 576)), for the
        reference."""
        _, kv_data, _, kv_indptr, config = self.full
        starts = kv_indptr[:-1].tolist()
        rows = torch.cat([torch.arange(s, s + n, device="cuda") for s, n in zip(starts, lengths)] +
                         [torch.zeros(0, dtype=torch.long, device="cuda")])

        def cut(entry):
            if isinstance(entry, tuple):
                codes, scale = entry
                return codes[rows], (scale[rows] if scale.dim() > 1 else scale)
            return entry[rows]

        bs = len(lengths)
        qo = torch.arange(bs + 1, dtype=torch.int32, device="cuda")
        kv = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
        return q.reshape(bs, HEADS, 576), {k: cut(v) for k, v in kv_data.items()}, qo, kv, config


def mode_of(kv_format: str) -> str:
    return kv_format  # fp8 here is an fp8 cache read with bf16 Q (mla.constants.MODES["fp8"])


def expected_splits(kv_format: str, bs: int, lengths: list[int]) -> list[int]:
    spec = spec_for_device(torch.device("cuda"))
    cfg = schedule.graph_config(spec, kv_format=kv_format, num_heads=HEADS)
    return schedule.device_split_counts(lengths, schedule.split_model(spec, cfg, batch=bs))


# --- SGLang -------------------------------------------------------------------------------------------------------


@launches(lambda kv_format, **_: [(mode_of(kv_format), HEADS, 1, False, PAGE, True)])
@pytest.mark.parametrize("kv_format", FORMATS)
def test_sglang_graph_sequence(kv_format):
    """SGLang's FlashMLA backend, step by step (init_cuda_graph_state, init_forward_metadata_capture_cuda_graph,
    init_forward_metadata_replay_cuda_graph, forward_decode)."""
    engine = Engine(seed=100 + FORMATS.index(kv_format))
    k_cache, kw = engine.cache(kv_format)
    is_fp8 = kv_format == "fp8"
    # init_cuda_graph_state: the wide block-table buffer, the start-up metadata from lengths of 1.
    kv_indices = torch.full((MAX_BS, (MAX_CONTEXT + PAGE) // PAGE), engine.nan_page, dtype=torch.int32,
                            device="cuda")
    startup_meta, startup_splits = get_mla_metadata(torch.ones(MAX_BS, dtype=torch.int32, device="cuda"), HEADS, 1,
                                                    is_fp8_kvcache=is_fp8)
    seq_lens = torch.ones(MAX_BS, dtype=torch.int64, device="cuda")  # the runner's persistent int64 lengths
    q_buf = torch.randn(MAX_BS, 1, HEADS, 576, device="cuda").bfloat16()

    def fill_indices(bs, lengths):  # create_flashmla_kv_indices_triton: each row's first pages only
        for b, n in enumerate(lengths[:bs]):
            pages = -(-n // PAGE)
            kv_indices[b, :pages] = engine.pages[b, :pages]

    def refresh(bs, lengths):  # the per-step metadata, copied into the captured tensors
        seq_lens[:bs].copy_(torch.tensor(lengths[:bs], device="cuda"))
        fill_indices(bs, lengths)
        meta, splits = get_mla_metadata(seq_lens[:bs].to(torch.int32), HEADS, 1, is_fp8_kvcache=is_fp8)
        startup_meta.copy_(meta)
        startup_splits[:bs + 1].copy_(splits)
        return max(lengths[:bs])

    graphs, outputs = {}, {}
    capture_lengths = [1024] * MAX_BS  # SGLang's seq_len fill value for capture
    pool = torch.cuda.graph_pool_handle()
    for bs in GRAPH_BATCHES:
        max_len = refresh(bs, capture_lengths)
        block_table = kv_indices[:bs, :-(-max_len // PAGE)]  # a slice of the wide buffer: not contiguous
        assert bs == 1 or not block_table.is_contiguous()
        q = q_buf[:bs]
        graph = torch.cuda.CUDAGraph()
        flash_mla_with_kvcache(q, k_cache, block_table, seq_lens[:bs].to(torch.int32), 512, startup_meta,
                               startup_splits[:bs + 1], 576 ** -0.5, True, is_fp8, **kw)  # warm-up (builds)
        torch.cuda.synchronize()
        with torch.cuda.graph(graph, pool=pool):
            outputs[bs] = flash_mla_with_kvcache(q, k_cache, block_table, seq_lens[:bs].to(torch.int32), 512,
                                                 startup_meta, startup_splits[:bs + 1], 576 ** -0.5, True, is_fp8,
                                                 **kw)
        graphs[bs] = graph
    assert all(isinstance(run, _GraphRun) for run in startup_meta._runs.values())

    for step, lengths in enumerate(growing_lengths(seed=7 + FORMATS.index(kv_format))):
        bs = GRAPH_BATCHES[step % len(GRAPH_BATCHES)]
        refresh(bs, lengths)
        q_buf.copy_(torch.randn_like(q_buf, dtype=torch.float32))
        out, lse = outputs[bs]
        out.fill_(math.nan)
        lse.fill_(math.nan)
        graphs[bs].replay()
        torch.cuda.synchronize()
        assert startup_splits[:bs + 1].tolist() == expected_splits("fp8" if is_fp8 else "bf16", bs, lengths[:bs])
        check(mode_of(kv_format), engine.step_data(q_buf[:bs], lengths[:bs]), out, lse, causal=False,
              context=f"SGLang replay {step}, batch {bs}, lengths {lengths[:bs]}")


# --- vLLM ----------------------------------------------------------------------------------------------------------


@launches(lambda kv_format, **_: [(mode_of(kv_format), HEADS, 1, False, PAGE, True)])
@pytest.mark.parametrize("kv_format", FORMATS)
def test_vllm_graph_sequence(kv_format):
    """vLLM's FlashMLA backend (FlashMLAMetadataBuilder._build_decode, FlashMLAImpl._forward_decode) under full
    CUDA graphs: a fresh get_mla_metadata(seq_lens, ...) per step, the calls pass no num_splits, the cache as
    (num_blocks, 64, 576).unsqueeze(-2), persistent seq_lens / block-table buffers (rows of the whole table); two
    layers per graph (the first schedules on the device inside the graph, the second reuses it)."""
    engine = Engine(seed=200 + FORMATS.index(kv_format))
    k_cache, kw = engine.cache(kv_format)
    k_cache = k_cache.squeeze(2).unsqueeze(-2)  # vLLM's view of its (num_blocks, block_size, 576) cache
    is_fp8 = kv_format == "fp8"
    seq_lens = torch.ones(MAX_BS, dtype=torch.int32, device="cuda")
    block_table = torch.full((MAX_BS, MAX_CONTEXT // PAGE), engine.nan_page, dtype=torch.int32, device="cuda")
    block_table[:, :] = engine.pages[:, :MAX_CONTEXT // PAGE]
    q_buf = torch.randn(2, MAX_BS, 1, HEADS, 576, device="cuda").bfloat16()  # two layers' queries

    def forward(bs):
        meta, _ = get_mla_metadata(seq_lens[:bs], HEADS, 1, is_fp8_kvcache=is_fp8)  # the builder, per step
        return [flash_mla_with_kvcache(q_buf[layer, :bs], k_cache, block_table[:bs], seq_lens[:bs], 512, meta,
                                       softmax_scale=576 ** -0.5, causal=True, is_fp8_kvcache=is_fp8, **kw)
                for layer in range(2)]

    graphs, outputs = {}, {}
    pool = torch.cuda.graph_pool_handle()
    for bs in GRAPH_BATCHES:
        forward(bs)  # warm-up (builds)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            outputs[bs] = forward(bs)
        graphs[bs] = graph

    for step, lengths in enumerate(growing_lengths(seed=17 + FORMATS.index(kv_format))):
        bs = GRAPH_BATCHES[(step + 1) % len(GRAPH_BATCHES)]
        seq_lens[:bs].copy_(torch.tensor(lengths[:bs], dtype=torch.int32))
        get_mla_metadata(seq_lens[:bs], HEADS, 1, is_fp8_kvcache=is_fp8)  # the builder runs; the graph ignores it
        q_buf.copy_(torch.randn_like(q_buf, dtype=torch.float32))
        for out, lse in outputs[bs]:
            out.fill_(math.nan)
            lse.fill_(math.nan)
        graphs[bs].replay()
        torch.cuda.synchronize()
        for layer, (out, lse) in enumerate(outputs[bs]):
            check(mode_of(kv_format), engine.step_data(q_buf[layer, :bs], lengths[:bs]), out, lse, causal=False,
                  context=f"vLLM replay {step}, layer {layer}, batch {bs}, lengths {lengths[:bs]}")


# --- the schedule kernel, and any num_splits ------------------------------------------------------------------


@launches(lambda **_: [("bf16", HEADS, 1, False, PAGE, True)])
@pytest.mark.parametrize("batch", [1, 3, 8, 255, 256, 257, 1000])
def test_schedule_kernel_matches_the_host_model(batch):
    rng = random.Random(batch)
    for trial in range(4):
        top = [1, 64, 4096, 70000][trial]
        lengths = [rng.randrange(0, top + 1) for _ in range(batch)]
        if trial == 3:
            lengths[0] = -7  # counts as 0
        seqlens = torch.tensor(lengths, dtype=torch.int32, device="cuda")
        _, num_splits = get_mla_metadata(seqlens, HEADS, 1)
        assert num_splits.tolist() == expected_splits("bf16", batch, lengths), (batch, trial)


@launches(lambda **_: [("bf16", HEADS, 1, False, PAGE, True)])
@pytest.mark.parametrize("counts", ["zeros", "huge", "ragged"])
def test_any_num_splits_gives_the_right_result(counts):
    """The kernels clamp each count to [1, the grid's splits]: a num_splits of zeros, of huge counts or of random
    ones changes the speed, never the result."""
    engine = Engine(seed=300)
    lengths = [0, 1, 65, 5000, 20000, 64, 3, 32768]
    q = torch.randn(MAX_BS, 1, HEADS, 576, device="cuda").bfloat16()
    table = engine.pages.contiguous()
    seqlens = torch.tensor(lengths, dtype=torch.int32, device="cuda")
    per_seq = {"zeros": [0] * MAX_BS, "huge": [10 ** 6] * MAX_BS,
               "ragged": [random.Random(1).randrange(-3, 70) for _ in range(MAX_BS)]}[counts]
    num_splits = torch.tensor([0, *torch.tensor(per_seq).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    meta, _ = get_mla_metadata()
    out, lse = flash_mla_with_kvcache(q, engine.paged["bf16"], table, seqlens, 512, meta, num_splits)
    check("bf16", engine.step_data(q, lengths), out, lse, causal=False, context=f"num_splits {counts}")
