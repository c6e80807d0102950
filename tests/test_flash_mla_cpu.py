"""``mla.flash_mla`` on the CPU (target forced to sm_90a, kernels replaced by recorders): FlashMLA's signatures,
both metadata patterns, what a call launches (small calls: the kernel ``mla_decode`` picks, in FlashMLA's shapes,
on the caller's tensors; large ones: exactly what ``mla_decode`` launches on the equivalent CSR inputs), the LSE
layout and +inf, the reuse checks, and every bad argument raising ValueError / TypeError naming it.
The GPU tests (tests/test_flash_mla_gpu.py) run the real kernels."""

import dataclasses
import inspect
import math

import pytest
import torch

import mla.decode
import mla.launch
from mla.flash_mla import MLAMetadata, flash_mla_with_kvcache, get_mla_metadata

from test_plan_cpu import Recorder, offsets

FLASHMLA_PARAMS = ["q", "k_cache", "block_table", "cache_seqlens", "head_dim_v", "tile_scheduler_metadata",
                   "num_splits", "softmax_scale", "causal", "is_fp8_kvcache"]


class LseWriter(Recorder):
    """A recorder whose launch writes its last two arguments like a kernel that writes (out, lse): out 0, and
    lse = 100 * row + head, or on the rows in ``hidden`` (row indices of (total_q, H)) -inf, as the kernels in the
    package's shapes write it, or +inf, as those in FlashMLA's shapes do (lse (batch, H, s_q))."""

    hidden: set = set()

    def __call__(self, *args):
        super().__call__(*args)
        out, lse = args[-2], args[-1]
        if not isinstance(lse, torch.Tensor):  # the split schedule: its last arguments are the cost model's
            return
        if out.dtype == torch.bfloat16 and lse.dim() == 2:  # the direct kernel or the combine: the final outputs
            out.zero_()
            rows, heads = lse.shape
            lse.copy_(torch.arange(rows)[:, None] * 100.0 + torch.arange(heads)[None, :])
            for r in self.hidden:
                lse[r] = -math.inf
        elif out.dtype == torch.bfloat16 and lse.dim() == 3:  # flash_io: out (b, s_q, H, 512), lse (b, H, s_q)
            out.zero_()
            batch, heads, s_q = lse.shape
            rows = torch.arange(batch * s_q)[:, None] * 100.0 + torch.arange(heads)[None, :]
            for r in self.hidden:
                rows[r] = math.inf
            lse.copy_(rows.view(batch, s_q, heads).transpose(1, 2))


@pytest.fixture(autouse=True)
def no_kernels(monkeypatch):
    monkeypatch.setenv("MLA_TARGET", "sm_90a")
    recorders = {}
    monkeypatch.setattr(mla.decode.jit, "get_launcher", lambda cfg, spec: recorders.setdefault(cfg, LseWriter(cfg.name)))
    LseWriter.hidden = set()
    mla.decode.clear_caches()
    yield recorders
    mla.decode.clear_caches()


def paged_inputs(kv_lens, s_q=1, heads=16, page=64, kv_format="bf16", seed=0):
    """(q (b, s_q, h, 576), k_cache, block_table (shuffled pages), cache_seqlens, extras) on the CPU."""
    gen = torch.Generator().manual_seed(seed)
    pages = [-(-n // page) for n in kv_lens]
    num_pages = sum(pages) + 2
    order = torch.randperm(num_pages, generator=gen)
    table = torch.zeros(len(kv_lens), max(pages + [1]), dtype=torch.int32)
    used = 0
    for b, n in enumerate(pages):
        table[b, :n] = order[used:used + n]
        used += n
    q = torch.randn(len(kv_lens), s_q, heads, 576, generator=gen).bfloat16()
    extras = {}
    if kv_format == "bf16":
        cache = torch.randn(num_pages, page, 1, 576, generator=gen).bfloat16()
    elif kv_format == "fp8":
        cache = torch.randn(num_pages, page, 1, 576, generator=gen).to(torch.float8_e4m3fn)
        extras = dict(is_fp8_kvcache=True, descale_k=torch.ones(1))
    else:
        cache = torch.randint(0, 256, (num_pages, page, 1, 288), dtype=torch.uint8, generator=gen)
        extras = dict(kv_block_scale=torch.full((num_pages, page, 18), 127, dtype=torch.uint8))
    return q, cache, table, torch.tensor(kv_lens, dtype=torch.int32), extras


def call(q, cache, table, seqlens, meta, num_splits=None, **kw):
    return flash_mla_with_kvcache(q, cache, table, seqlens, 512, meta, num_splits, **kw)


# --- signatures -----------------------------------------------------------------------------------------------------


def test_signatures_are_flashmlas():
    params = inspect.signature(flash_mla_with_kvcache).parameters
    assert list(params)[:len(FLASHMLA_PARAMS)] == FLASHMLA_PARAMS
    defaults = {name: params[name].default for name in FLASHMLA_PARAMS[6:]}
    assert defaults == {"num_splits": None, "softmax_scale": None, "causal": False, "is_fp8_kvcache": False}
    extras = list(params)[len(FLASHMLA_PARAMS):]
    assert extras and all(params[name].kind is inspect.Parameter.KEYWORD_ONLY for name in extras), extras
    meta, splits = get_mla_metadata()
    assert isinstance(meta, MLAMetadata) and splits is None and not meta.have_initialized
    meta, splits = get_mla_metadata(torch.tensor([3, 0, 70], dtype=torch.int32), 16, 1)
    assert meta.max_batch == 3 and splits.dtype == torch.int32 and splits.shape == (4,) and splits is meta.num_splits
    meta, _ = get_mla_metadata(cache_seqlens=torch.tensor([1], dtype=torch.int32), num_q_tokens_per_head_k=32,
                               num_heads_k=1, num_heads_q=16, is_fp8_kvcache=False, topk=None)
    assert meta.max_batch == 1 and meta.lengths is None, "the old pattern reads no length on the host"


# --- what a call launches ---------------------------------------------------------------------------------------


def flash_and_eager_launches(no_kernels, kv_lens, s_q, causal, kv_format):
    """The launches of one ``flash_mla_with_kvcache`` call and of the ``mla_decode`` call on CSR offsets and the
    block table that computes the same (one query token: causal is FlashMLA's no-op, so the non-causal kernels),
    as [(config, args)]; with the call's tensors."""
    q, cache, table, seqlens, extras = paged_inputs(kv_lens, s_q=s_q, kv_format=kv_format)
    meta, _ = get_mla_metadata()
    call(q, cache, table, seqlens, meta, causal=causal, **extras)
    flash = [(cfg, args) for cfg, r in no_kernels.items() for args in r.calls]
    for r in no_kernels.values():
        r.calls.clear()
    op_kw = {"kv_scale": extras.get("descale_k"), "kv_block_scale": extras.get("kv_block_scale")}
    mla.decode.mla_decode(q.view(-1, 16, 576), cache, torch.tensor(offsets([s_q] * len(kv_lens)), dtype=torch.int32),
                          torch.tensor(offsets(kv_lens), dtype=torch.int32), page_table=table,
                          causal=causal and s_q > 1, num_splits=meta.plan.num_splits, **op_kw)
    eager = [(cfg, args) for cfg, r in no_kernels.items() for args in r.calls]
    return flash, eager, (q, cache, table, seqlens)


@pytest.mark.parametrize("kv_format", ["bf16", "fp8", "mxfp4"])
@pytest.mark.parametrize("s_q,causal", [(1, False), (1, True), (3, True), (2, False)])
def test_small_calls_launch_the_kernel_in_flashmlas_shapes(no_kernels, kv_format, s_q, causal):
    """Where the split grid fits the GPU (here 4 sequences) the call launches once: the kernel mla_decode picks, in
    its FlashMLA-shaped form (``flash_io``), given the caller's q, cache, cache_seqlens and block table themselves
    (no view, no offsets) and outputs in FlashMLA's shapes; every other argument as mla_decode passes it."""
    flash, eager, (q, cache, table, seqlens) = flash_and_eager_launches(no_kernels, [700, 0, 2900, 64], s_q, causal,
                                                                       kv_format)
    ((cfg, a),) = flash
    ((eager_cfg, b),) = eager
    assert eager_cfg.fused_combine and cfg == dataclasses.replace(eager_cfg, flash_io=True)
    assert len(a) == 14 and len(b) == 15, "flash_io: cache_seqlens in place of qo_indptr and kv_indptr"
    assert a[0] is q and a[1] is cache and a[6] is seqlens and a[7] is table
    for x, y in zip(a[2:6], b[2:6]):  # mxfp4 block scales, their row stride, the Q and KV scales
        assert torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y
    assert a[8:10] == b[9:11], "sm_scale, num_splits"
    for x, y in zip(a[10:12], b[11:13]):  # the split partials (the plan's; the eager call's scratch)
        assert x.dtype == y.dtype and x.shape == y.shape
    out, lse = a[12:]
    assert out.shape == (4, s_q, 16, 512) and lse.shape == (4, 16, s_q) and out.is_contiguous() and lse.is_contiguous()


@pytest.mark.parametrize("kv_format", ["bf16", "fp8", "mxfp4"])
@pytest.mark.parametrize("s_q,causal", [(1, False), (3, True)])
def test_large_calls_launch_what_mla_decode_launches(no_kernels, kv_format, s_q, causal):
    """A split grid larger than the GPU (200 sequences): the same kernels with the same arguments as
    ``mla_decode``, on views of the caller's tensors; the caller's block table is what is read."""
    flash, eager, (_, _, table, _) = flash_and_eager_launches(no_kernels, [700, 0, 2900, 64] * 50, s_q, causal,
                                                            kv_format)
    assert not any(getattr(cfg, "flash_io", False) for cfg, _ in flash)
    flash = [(cfg.name, args) for cfg, args in flash]
    eager = [(cfg.name, args) for cfg, args in eager]
    assert [n for n, _ in flash] == [n for n, _ in eager]
    for (name, a), (_, b) in zip(flash, eager):
        assert len(a) == len(b), name
        for i, (x, y) in enumerate(zip(a, b)):
            if isinstance(x, torch.Tensor):
                # Semaphores (fused families that count splits): the plan's own; the eager call's per stream.
                semaphores = x.dtype == torch.int32 and x.dim() == 1 and i == len(a) - 3
                assert x.dtype == y.dtype and (semaphores or x.shape == y.shape), (name, i)
                if x.dtype in (torch.int32, torch.bfloat16, torch.uint8) and i < len(a) - 5:  # inputs, not outputs
                    assert torch.equal(x, y), (name, i)
            else:
                assert x == y, (name, i)
    assert any(a[8] is table for _, a in flash if len(a) > 9), "the caller's block table goes to the kernel"


@pytest.mark.parametrize("repeat", [1, 70], ids=["flash-shaped-kernel", "views"])
@pytest.mark.parametrize("s_q", [1, 3])
def test_lse_layout_and_plus_inf(no_kernels, s_q, repeat):
    """lse (batch, h_q, s_q), contiguous, +inf where nothing is seen: as the FlashMLA-shaped kernel writes it
    (small calls), or from the package's kernels' (batch * s_q, h_q) with -inf there (a grid larger than the GPU)."""
    kv_lens = [0, 5, 900] * repeat
    batch = len(kv_lens)
    q, cache, table, seqlens, _ = paged_inputs(kv_lens, s_q=s_q)
    LseWriter.hidden = {3 * s_q * b + i for b in range(repeat) for i in range(s_q)}  # the empty sequences' rows
    meta, _ = get_mla_metadata()
    out, lse = call(q, cache, table, seqlens, meta, causal=True)
    assert any(getattr(cfg, "flash_io", False) for cfg in no_kernels) == (repeat == 1)
    assert out.shape == (batch, s_q, 16, 512) and lse.shape == (batch, 16, s_q) and lse.is_contiguous()
    expected = (torch.arange(batch * s_q)[:, None] * 100.0 + torch.arange(16)[None, :]).view(batch, s_q, 16)
    expected = expected.transpose(1, 2).contiguous()
    expected[0::3] = math.inf
    torch.testing.assert_close(lse, expected)


def test_reuse_checks_the_signature_once_and_plans_once(monkeypatch):
    q, cache, table, seqlens, _ = paged_inputs([100, 3000], s_q=2)
    meta, splits = get_mla_metadata()
    call(q, cache, table, seqlens, meta, splits, causal=True)
    the_plan = meta.plan
    checks = []
    real = mla.plan.validate.check_call
    monkeypatch.setattr(mla.plan.validate, "check_call", lambda *a, **k: checks.append(1) or real(*a, **k))
    for _ in range(3):
        call(torch.randn_like(q.float()).bfloat16(), cache.clone(), table.clone(), seqlens.clone(), meta, splits,
             causal=True, softmax_scale=0.05)
    assert not checks and meta.plan is the_plan
    call(q, cache, table[:, :].clone().contiguous(), seqlens, meta, causal=True)  # same signature
    assert not checks
    wider = torch.cat([table, table[:, :1]], dim=1).contiguous()  # a new block-table shape: checked, not re-planned
    call(q, cache, wider, seqlens, meta, causal=True)
    assert len(checks) == 1 and meta.plan is the_plan


def test_old_pattern_runs_the_graph_form(no_kernels):
    """get_mla_metadata(cache_seqlens, ...) -> the device schedule in num_splits; the call passes it to the split
    kernel in FlashMLA's shapes, then to the combine (tests/test_flash_mla_graph_cpu.py has the rest)."""
    kv_lens = [100, 3000, 7]
    q, cache, table, seqlens, _ = paged_inputs(kv_lens, s_q=2)
    meta, splits = get_mla_metadata(seqlens, 2 * 16, 1)
    call(q, cache, table, seqlens, meta, splits, causal=True)
    launched = [(cfg, args) for cfg, r in no_kernels.items() for args in r.calls]
    assert [type(cfg).__name__ for cfg, _ in launched] == ["DecodeKernelConfig", "CombineKernelConfig"]
    (decode_cfg, decode_args), (combine_cfg, combine_args) = launched
    assert decode_cfg.split_counts and combine_cfg.flash_io
    assert decode_args[10] is splits and combine_args[2] is splits and meta.plan is None


@pytest.mark.parametrize("page", [1, 16, 32, 64, 128])
def test_every_page_size(no_kernels, page):
    q, cache, table, seqlens, _ = paged_inputs([5, 300], page=page)
    meta, _ = get_mla_metadata()
    call(q, cache, table, seqlens, meta)
    assert meta.plan.page_size == page and any(r.calls for r in no_kernels.values())


# --- reuse mismatches and bad arguments ----------------------------------------------------------------------------


def made_meta(**kw):
    q, cache, table, seqlens, extras = paged_inputs([100, 3000], s_q=2)
    meta, _ = get_mla_metadata()
    call(q, cache, table, seqlens, meta, causal=True)
    return meta


REUSE = [
    ("batch", lambda: paged_inputs([100, 3000, 5], s_q=2), {}, "made for q's batch 2, this call has 3"),
    ("s_q", lambda: paged_inputs([100, 3000], s_q=1), {}, "made for q's s_q 2, this call has 1"),
    ("heads", lambda: paged_inputs([100, 3000], s_q=2, heads=32), {}, "made for q's h_q 16, this call has 32"),
    ("page", lambda: paged_inputs([100, 3000], s_q=2, page=16), {}, "made for k_cache's page_block_size 64"),
    ("causal", lambda: paged_inputs([100, 3000], s_q=2), {"causal": False}, "made for causal True"),
    ("format", lambda: paged_inputs([100, 3000], s_q=2, kv_format="fp8"), {}, "made for is_fp8_kvcache False"),
]


@pytest.mark.parametrize("make,kw,message", [c[1:] for c in REUSE], ids=[c[0] for c in REUSE])
def test_reuse_with_another_layout_raises(make, kw, message):
    meta = made_meta()
    q, cache, table, seqlens, extras = make()
    with pytest.raises(ValueError, match="tile_scheduler_metadata: " + message):
        call(q, cache, table, seqlens, meta, **{"causal": True, **extras, **kw})


def good():
    q, cache, table, seqlens, _ = paged_inputs([100, 3000], s_q=2)
    return dict(q=q, k_cache=cache, block_table=table, cache_seqlens=seqlens, head_dim_v=512)


def fp8():
    q, cache, table, seqlens, extras = paged_inputs([100, 3000], s_q=2, kv_format="fp8")
    return dict(q=q, k_cache=cache, block_table=table, cache_seqlens=seqlens, head_dim_v=512, **extras)


BAD = [
    ("q not a tensor", good, dict(q=[1.0]), TypeError, "q: expected a torch.Tensor"),
    ("q float32", good, dict(q=torch.randn(2, 2, 16, 576)), TypeError, "q: expected dtype"),
    ("q 3-D", good, dict(q=torch.randn(4, 16, 576).bfloat16()), ValueError, "q: expected 4 dims"),
    ("q dim 512", good, dict(q=torch.randn(2, 2, 16, 512).bfloat16()), ValueError, "q: expected (batch, s_q, h_q, 576)"),
    ("q 8 heads", good, dict(q=torch.randn(2, 2, 8, 576).bfloat16()), ValueError, "q: expected h_q (dim 2)"),
    ("q strided", good, dict(q=torch.randn(2, 16, 2, 576).bfloat16().transpose(1, 2)), ValueError,
     "q: expected a contiguous"),
    ("k_cache 3-D", good, dict(k_cache=torch.randn(100, 1, 576).bfloat16()), ValueError, "k_cache: expected (num_blocks"),
    ("k_cache 2 heads", good, dict(k_cache=torch.randn(60, 64, 2, 576).bfloat16()), ValueError, "k_cache: MLA decode has one KV head"),
    ("k_cache page 8", good, dict(k_cache=torch.randn(60, 8, 1, 576).bfloat16()), ValueError, "k_cache: page_block_size"),
    ("k_cache float32", good, dict(k_cache=torch.randn(60, 64, 1, 576)), TypeError, "k_cache: expected bf16"),
    ("k_cache row 512", good, dict(k_cache=torch.randn(60, 64, 1, 512).bfloat16()), ValueError, "k_cache: expected shape"),
    ("head_dim_v", good, dict(head_dim_v=576), ValueError, "head_dim_v: must be 512"),
    ("block_table None", good, dict(block_table=None), ValueError, "block_table: required"),
    ("block_table int64", good, dict(block_table=torch.zeros(2, 60, dtype=torch.int64)), TypeError, "block_table: expected dtype"),
    ("block_table rows", good, dict(block_table=torch.zeros(3, 60, dtype=torch.int32)), ValueError, "block_table: expected 2 rows"),
    ("block_table short", good, dict(block_table=torch.zeros(2, 3, dtype=torch.int32)), ValueError,
     "block_table: 3 blocks of 64 tokens hold fewer"),
    ("cache_seqlens int64", good, dict(cache_seqlens=torch.tensor([1, 2])), TypeError, "cache_seqlens: expected dtype"),
    ("cache_seqlens batch", good, dict(cache_seqlens=torch.tensor([1, 2, 3], dtype=torch.int32)), ValueError,
     "cache_seqlens: expected (2,)"),
    ("cache_seqlens negative", good, dict(cache_seqlens=torch.tensor([-1, 2], dtype=torch.int32)), ValueError,
     "cache_seqlens: lengths must be >= 0"),
    ("metadata tensor", good, dict(tile_scheduler_metadata=torch.zeros(132, 8, dtype=torch.int32)), TypeError,
     "tile_scheduler_metadata: expected the metadata"),
    ("num_splits shape", good, dict(num_splits=torch.zeros(4, dtype=torch.int32)), ValueError,
     "num_splits: expected (3,)"),
    ("num_splits int64", good, dict(num_splits=torch.zeros(3, dtype=torch.int64)), TypeError,
     "num_splits: expected dtype"),
    ("softmax_scale nan", good, dict(softmax_scale=math.nan), ValueError, "sm_scale: expected a positive finite"),
    ("causal str", good, dict(causal="yes"), TypeError, "causal: expected a bool"),
    ("is_fp8 with bf16", good, dict(is_fp8_kvcache=True), ValueError, "is_fp8_kvcache: True does not match"),
    ("fp8 without flag", fp8, dict(is_fp8_kvcache=False), ValueError, "is_fp8_kvcache: False does not match"),
    ("fp8 without descale", fp8, dict(descale_k=None), ValueError, "descale_k: required"),
    ("descale_k float64", fp8, dict(descale_k=torch.ones(1, dtype=torch.float64)), TypeError, "descale_k: expected a (1,) float32"),
    ("fp8 q without descale", fp8, dict(q=torch.randn(2, 2, 16, 576).to(torch.float8_e4m3fn)), ValueError,
     "descale_q: required"),
    ("fp8 q over bf16", good, dict(q=torch.randn(2, 2, 16, 576).to(torch.float8_e4m3fn), descale_q=torch.ones(1)),
     ValueError, "q: fp8 Q (a8w8) needs an fp8 cache"),
    ("q_format", good, dict(q_format="int8"), ValueError, "q_format: expected"),
    ("descale_k with bf16", good, dict(descale_k=torch.ones(1)), ValueError, "descale_k is only for an fp8 cache"),
    ("mxfp4 without scales", good, dict(k_cache=torch.zeros(60, 64, 1, 288, dtype=torch.uint8)), ValueError,
     "kv_block_scale: required"),
]


# Checked on a metadata's first call only: length values (reading them needs a host copy), and a cache of another
# format (a metadata filled for bf16 says so first).
FIRST_CALL_ONLY = {"cache_seqlens negative", "mxfp4 without scales"}


@pytest.mark.parametrize("name,make,overrides,error,message", BAD, ids=[c[0] for c in BAD])
@pytest.mark.parametrize("after_good_call", [False, True], ids=["fresh", "after_a_good_call"])
def test_bad_arguments_raise_naming_them(name, make, overrides, error, message, after_good_call):
    if after_good_call and name in FIRST_CALL_ONLY:
        pytest.skip("checked on the metadata's first call only")
    args = make()
    meta, _ = get_mla_metadata()
    if after_good_call:
        flash_mla_with_kvcache(**args, tile_scheduler_metadata=meta, causal=True)
    args.update(dict(tile_scheduler_metadata=meta, causal=True))
    args.update(overrides)
    with pytest.raises(error) as info:
        flash_mla_with_kvcache(**args)
    assert message in str(info.value), f"{str(info.value)!r} lacks {message!r}"


OLD_BAD = [
    ("seqlens int64", dict(cache_seqlens=torch.tensor([1, 2])), TypeError, "cache_seqlens: expected dtype"),
    ("two kv heads", dict(num_heads_k=2), ValueError, "num_heads_k: MLA decode has one KV head"),
    ("topk", dict(topk=2048), ValueError, "topk: sparse attention is not supported"),
    ("tokens", dict(num_q_tokens_per_head_k=0), ValueError, "num_q_tokens_per_head_k: expected a positive int"),
    ("heads_q", dict(num_heads_q=7), ValueError, "num_heads_q: expected an int dividing"),
]


@pytest.mark.parametrize("overrides,error,message", [c[1:] for c in OLD_BAD], ids=[c[0] for c in OLD_BAD])
def test_bad_old_metadata_arguments(overrides, error, message):
    args = dict(cache_seqlens=torch.tensor([1, 2], dtype=torch.int32), num_q_tokens_per_head_k=32, num_heads_k=1)
    args.update(overrides)
    with pytest.raises(error, match=message.replace("(", r"\(")):
        get_mla_metadata(**args)


def test_old_metadata_must_fit_the_call():
    q, cache, table, seqlens, _ = paged_inputs([100, 3000], s_q=2)
    meta, splits = get_mla_metadata(seqlens, 16, 1)  # says s_q * h_q = 16, the call has 32
    with pytest.raises(ValueError, match="num_q_tokens_per_head_k=16"):
        call(q, cache, table, seqlens, meta, splits, causal=True)
    meta, _ = get_mla_metadata(seqlens[:1], 32, 1)
    with pytest.raises(ValueError, match="cache_seqlens: get_mla_metadata was given 1 lengths, q has batch 2"):
        call(q, cache, table, seqlens, meta, causal=True)
