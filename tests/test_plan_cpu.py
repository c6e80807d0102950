"""``mla.decode.plan`` / ``DecodePlan.run`` on the CPU (target forced to sm_90a, kernels replaced by recorders):
what the plan decides, the block table it builds from FlashInfer-style CSR page lists, its checks, and that
``run`` launches exactly what ``mla_decode`` launches. The GPU tests run the real kernels through the plan
(tests/test_serving_gpu.py, entry "plan")."""

import itertools
import random

import pytest
import torch

import mla.decode
import mla.launch
from mla import schedule
from mla.decode import mla_decode, plan
from mla.target import spec_for_name


class Recorder:
    """Stands in for a compiled kernel: records the positional arguments of each launch."""

    def __init__(self, name):
        self.name, self.calls = name, []

    def __call__(self, *args):
        self.calls.append(args)


@pytest.fixture(autouse=True)
def no_kernels(monkeypatch):
    """sm_90a on the CPU, and launchers that record instead of running (one Recorder per kernel config)."""
    monkeypatch.setenv("MLA_TARGET", "sm_90a")
    recorders = {}

    def get_launcher(cfg, spec):
        return recorders.setdefault(cfg, Recorder(cfg.name))

    monkeypatch.setattr(mla.decode.jit, "get_launcher", get_launcher)
    mla.decode.clear_caches()
    yield recorders
    mla.decode.clear_caches()


def offsets(lengths):
    return [0, *itertools.accumulate(lengths)]


def flat_inputs(kv_lens, q_lens=None, heads=16, tail_rows=0):
    q_lens = q_lens or [1] * len(kv_lens)
    q = torch.randn(sum(q_lens), heads, 576).bfloat16()
    kv = torch.randn(sum(kv_lens) + tail_rows, 1, 576).bfloat16()
    return q, kv, torch.tensor(offsets(q_lens), dtype=torch.int32), torch.tensor(offsets(kv_lens), dtype=torch.int32)


# --- the block table built from CSR page lists -----------------------------------------------------------------


@pytest.mark.parametrize("page_size", [1, 16, 64])
@pytest.mark.parametrize("spare", [False, True], ids=["exact", "spare_pages"])
def test_csr_page_lists_become_the_block_table(page_size, spare):
    rng = random.Random(page_size * 2 + spare)
    kv_lens = [rng.choice([0, 1, page_size, page_size + 1, rng.randint(1, 10 * page_size)]) for _ in range(9)]
    needed = [-(-n // page_size) for n in kv_lens]
    counts = [n + (rng.randint(0, 2) if spare else 0) for n in needed]
    num_pages = sum(counts) + 5
    kv_indices = torch.randperm(num_pages, dtype=torch.int64)[: sum(counts)].to(torch.int32)
    p = plan(offsets([1] * len(kv_lens)), offsets(kv_lens), num_heads=16, kv_format="bf16", page_size=page_size,
             kv_indices=kv_indices, kv_page_indptr=None if not spare else offsets(counts), device="cpu")
    table = p.page_table
    assert table.dtype == torch.int32 and table.is_contiguous() and table.shape == (len(kv_lens), max(needed + [1]))
    page_ptr = offsets(counts)
    for b, n in enumerate(needed):  # each sequence's first ceil(L / page_size) pages, in order
        assert table[b, :n].tolist() == kv_indices[page_ptr[b]: page_ptr[b] + n].tolist(), f"sequence {b}"
        assert (table[b, n:] == 0).all(), "columns past a sequence's pages hold page 0 (never read)"


def test_block_table_is_used_as_given():
    table = torch.tensor([[3, 1], [0, 2]], dtype=torch.int32)
    p = plan([0, 1, 2], [0, 17, 20], num_heads=16, kv_format="bf16", page_size=16, page_table=table, device="cpu")
    assert p.page_table is table


def test_device_offsets_are_kept_host_offsets_uploaded():
    qo = torch.arange(4, dtype=torch.int32)
    kvp = torch.tensor([0, 5, 5, 9], dtype=torch.int32)
    p = plan(qo, kvp, num_heads=16, kv_format="bf16", device="cpu")
    assert p.qo_indptr is qo and p.kv_indptr is kvp, "contiguous int32 tensors on the device: used in place"
    p = plan([0, 1, 2, 3], [0, 5, 5, 9], num_heads=16, kv_format="bf16", device="cpu")
    assert p.kv_indptr.tolist() == [0, 5, 5, 9] and p.kv_indptr.dtype == torch.int32
    assert p.kv_lens == [5, 0, 4] and p.batch == 3 and p.total_q == 3


# --- the schedule --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kv_lens", [[1024] * 4, [8192] * 64, [100, 32000, 5, 7000], [0, 0, 3]])
def test_splits_come_from_the_exact_lengths(kv_lens):
    """Unlike mla_decode, which only knows the cache's row count (a preallocated pool inflates it), a plan sees
    the lengths: its split count is the schedule's for the true total."""
    spec = spec_for_name("sm_90a")
    p = plan(offsets([1] * len(kv_lens)), offsets(kv_lens), num_heads=16, kv_format="fp8", device="cpu")

    def splits_for(total_kv):
        return schedule.select_kernels(spec, kv_format="fp8", q_format="bf16", num_heads=16, causal=False, page_size=0,
                                       batch=len(kv_lens), total_q=len(kv_lens), total_kv=total_kv)[2]

    assert p.num_splits == splits_for(sum(kv_lens))
    pool_guess = splits_for(1 << 22)
    if sum(kv_lens) < 1 << 16:
        assert p.num_splits != pool_guess or p.num_splits == 1, "the pool's row count would have misled the split"


def test_forced_split_count_and_workspace(no_kernels):
    p = plan([0, 2, 4], [0, 3000, 6000], num_heads=32, kv_format="bf16", num_splits=5, device="cpu")
    assert p.num_splits == 5
    (decode_cfg,) = [cfg for cfg in no_kernels if getattr(cfg, "split", False)]
    assert decode_cfg.q_tile == 2, "2 queries per sequence: the plan builds the kernel for 2 queries per pass"
    assert p._o_partial.shape == (5, 4, 32, 512) and p._lse_partial.shape == (5, 4, 32)
    assert plan([0, 1], [0, 10], num_heads=16, kv_format="bf16", num_splits=1, device="cpu")._o_partial is None


# --- run launches what mla_decode launches -------------------------------------------------------------------------


@pytest.mark.parametrize("fused", [True, False], ids=["fused-merge", "two-kernel"])
@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("paged", [False, True], ids=["flat", "paged"])
def test_run_launches_the_same_kernels_with_the_same_arguments(no_kernels, monkeypatch, num_splits, paged, fused):
    # Hopper fuses the split merge into the decode kernel (one launch); gfx942's form is decode, then combine.
    monkeypatch.setattr(mla.launch.schedule, "FUSED_COMBINE_ON_CUDA", fused)
    kv_lens = [5, 0, 40, 17]
    q, kv, qo, kvp = flat_inputs(kv_lens, q_lens=[1, 2, 1, 3])
    table, page_size = None, 0
    if paged:
        page_size = 16
        kv = torch.randn(12, 16, 1, 576).bfloat16()
        table = torch.randint(0, 12, (4, 3), dtype=torch.int32)
    direct = mla_decode(q, kv, qo, kvp, page_table=table, num_splits=num_splits, causal=True, sm_scale=0.1)
    direct_calls = {name: list(r.calls) for name, r in ((r.name, r) for r in no_kernels.values())}
    for r in no_kernels.values():
        r.calls.clear()
    p = plan(qo, kvp, num_heads=16, kv_format="bf16", causal=True, sm_scale=0.1, page_size=page_size,
             page_table=table, num_splits=num_splits, device="cpu")
    out = p.run(q, kv)
    assert out.shape == direct.shape == (7, 16, 512)
    plan_calls = {r.name: list(r.calls) for r in no_kernels.values()}
    launched = {name for name, calls in direct_calls.items() if calls}
    assert launched == {name for name, calls in plan_calls.items() if calls}, "different kernels"
    assert len(launched) == (1 if num_splits == 1 or fused else 2)
    for name in launched:
        (a,), (b,) = direct_calls[name], plan_calls[name]
        assert len(a) == len(b)
        # Outputs (the decode's last two arguments, with the fused merge its last five: partials, semaphores,
        # output, LSE; every argument of the combine) are buffers: same dtype, and same shape but for the
        # semaphores (the eager call's per-stream buffer, the plan's own). Inputs: the same values.
        outputs = range(len(a)) if "combine" in name else range(len(a) - (5 if fused else 2), len(a))
        semaphores = len(a) - 3 if fused else None
        for i, (x, y) in enumerate(zip(a, b)):
            if isinstance(x, torch.Tensor):
                assert x.dtype == y.dtype and (i == semaphores or x.shape == y.shape), f"{name} argument {i}"
                assert i in outputs or torch.equal(x, y), f"{name} argument {i}: different values"
            else:
                assert x == y, f"{name} argument {i}: {x!r} != {y!r}"


def test_run_reuses_the_plan_workspace(no_kernels, monkeypatch):
    monkeypatch.setattr(mla.launch.schedule, "FUSED_COMBINE_ON_CUDA", False)  # decode + combine (gfx942's form)
    q, kv, qo, kvp = flat_inputs([3000, 5000], heads=32)
    p = plan(qo, kvp, num_heads=32, kv_format="bf16", num_splits=4, device="cpu")
    p.run(q, kv)
    p.run(q, kv)
    (decode,) = [r for r in no_kernels.values() if r.calls and "combine" not in r.name]
    first, second = decode.calls
    assert first[-2].data_ptr() == second[-2].data_ptr() == p._o_partial.data_ptr()
    assert first[-1].data_ptr() == p._lse_partial.data_ptr()


def test_run_with_caller_buffers_and_lse(no_kernels):
    q, kv, qo, kvp = flat_inputs([10, 20])
    p = plan(qo, kvp, num_heads=16, kv_format="bf16", num_splits=1, device="cpu")
    out, lse = torch.empty(2, 16, 512, dtype=torch.bfloat16), torch.empty(2, 16)
    res = p.run(q, kv, out=out, lse=lse, return_lse=True)
    assert res[0] is out and res[1] is lse


def test_empty_batch_plans_and_runs_nothing(no_kernels):
    p = plan([0], [0], num_heads=16, kv_format="bf16", device="cpu")
    out = p.run(torch.empty(0, 16, 576, dtype=torch.bfloat16), torch.empty(0, 1, 576, dtype=torch.bfloat16))
    assert out.shape == (0, 16, 512)
    assert not any(r.calls for r in no_kernels.values())


# --- checks --------------------------------------------------------------------------------------------------------

PLAN_ERRORS = [
    ("indptr order", dict(kv_indptr=[0, 5, 3]), ValueError, "kv_indptr: expected non-decreasing"),
    ("indptr start", dict(qo_indptr=[1, 2, 3]), ValueError, "qo_indptr: expected non-decreasing offsets starting at 0"),
    ("indptr lengths", dict(qo_indptr=[0, 1]), ValueError, "qo_indptr and kv_indptr"),
    ("indptr type", dict(kv_indptr="0,5,9"), TypeError, "kv_indptr: expected a list of ints"),
    ("indptr float", dict(kv_indptr=torch.tensor([0.0, 5.0, 9.0])), ValueError, "kv_indptr: expected a 1-D int32/int64"),
    ("heads", dict(num_heads=8), ValueError, "num_heads: expected one of"),
    ("kv_format", dict(kv_format="int4"), ValueError, "kv_format must be"),
    ("q_format", dict(q_format="int8"), ValueError, "q_format must be"),
    ("num_splits", dict(num_splits=0), ValueError, "num_splits must be a positive int"),
    ("page size", dict(page_size=8, kv_indices=torch.zeros(2, dtype=torch.int32)), ValueError, "page_size: expected 0"),
    ("table without page size", dict(page_table=torch.zeros(2, 1, dtype=torch.int32)), ValueError, "page_size: pass"),
    ("paged without pages", dict(page_size=16), ValueError, "a paged plan needs exactly one of them"),
    ("table and indices", dict(page_size=16, page_table=torch.zeros(2, 1, dtype=torch.int32),
                               kv_indices=torch.zeros(2, dtype=torch.int32)), ValueError, "exactly one of them"),
    ("table rows", dict(page_size=16, page_table=torch.zeros(3, 1, dtype=torch.int32)), ValueError, "page_table: expected 2 rows"),
    ("table too narrow", dict(page_size=1, page_table=torch.zeros(2, 4, dtype=torch.int32)), ValueError,
     "page_table: sequence 0 has 5 tokens, more than 4 pages"),
    ("table dtype", dict(page_size=16, page_table=torch.zeros(2, 1, dtype=torch.int64)), TypeError, "page_table: expected dtype"),
    ("indices dtype", dict(page_size=16, kv_indices=torch.zeros(2, dtype=torch.int64)), TypeError, "kv_indices: expected dtype"),
    ("too few pages", dict(page_size=1, kv_indices=torch.zeros(9, dtype=torch.int32), kv_page_indptr=[0, 4, 9]),
     ValueError, "kv_page_indptr: sequence 0 has 5 tokens (5 pages of 1) but 4 pages"),
    ("indices too short", dict(page_size=1, kv_indices=torch.zeros(8, dtype=torch.int32)), ValueError,
     "kv_indices: expected at least 9 entries"),
    ("page indptr length", dict(page_size=16, kv_indices=torch.zeros(2, dtype=torch.int32), kv_page_indptr=[0, 1]),
     ValueError, "kv_page_indptr: expected 3 entries"),
    ("page indptr without indices", dict(page_size=16, page_table=torch.zeros(2, 1, dtype=torch.int32),
                                         kv_page_indptr=[0, 1, 2]), ValueError, "kv_page_indptr: only with kv_indices"),
]


@pytest.mark.parametrize("overrides,error,message", [c[1:] for c in PLAN_ERRORS], ids=[c[0] for c in PLAN_ERRORS])
def test_bad_plan_arguments_raise_naming_the_argument(overrides, error, message):
    args = dict(qo_indptr=[0, 1, 2], kv_indptr=[0, 5, 9], num_heads=16, kv_format="bf16", device="cpu")
    args.update(overrides)
    with pytest.raises(error) as info:
        plan(args.pop("qo_indptr"), args.pop("kv_indptr"), **args)
    assert message in str(info.value), f"message {str(info.value)!r} lacks {message!r}"


RUN_ERRORS = [
    ("heads", lambda q, kv: (torch.randn(3, 32, 576).bfloat16(), kv), ValueError, "q: this plan is for 16 heads"),
    ("rows of q", lambda q, kv: (q[:2], kv), ValueError, "q: the plan's qo_indptr holds 3 query rows, q has 2"),
    ("cache format", lambda q, kv: (q, kv.to(torch.float8_e4m3fn)), ValueError, "kv_cache: this plan is for a bf16 cache"),
    ("cache rows", lambda q, kv: (q, kv[:8]), ValueError, "kv_cache: the plan's kv_indptr reaches row 9, the cache has 8"),
    ("paged cache", lambda q, kv: (q, kv[:9].reshape(9, 1, 1, 576)), ValueError, "kv_cache: expected shape (total_kv, 1, 576)"),
]


@pytest.mark.parametrize("make,error,message", [c[1:] for c in RUN_ERRORS], ids=[c[0] for c in RUN_ERRORS])
def test_run_rejects_tensors_that_do_not_fit_the_plan(make, error, message):
    q, kv, qo, kvp = flat_inputs([5, 0, 4], tail_rows=1)
    p = plan(qo, kvp, num_heads=16, kv_format="bf16", device="cpu")
    q, kv = make(q, kv)
    kwargs = {"kv_scale": torch.ones(1)} if kv.dtype == torch.float8_e4m3fn else {}
    with pytest.raises(error) as info:
        p.run(q, kv, **kwargs)
    assert message in str(info.value), f"message {str(info.value)!r} lacks {message!r}"


def test_run_rejects_a_cache_of_another_page_size():
    table = torch.zeros(2, 1, dtype=torch.int32)
    p = plan([0, 1, 2], [0, 5, 9], num_heads=16, kv_format="bf16", page_size=16, page_table=table, device="cpu")
    with pytest.raises(ValueError, match="kv_cache: this plan is for page_size 16, the cache has 64"):
        p.run(torch.randn(2, 16, 576).bfloat16(), torch.randn(1, 64, 1, 576).bfloat16())
