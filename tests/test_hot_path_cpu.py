"""The op's hot path on the CPU (target forced to sm_90a, kernels replaced by recorders): a call signature seen
before skips the checks and the kernel selection, yet every bad argument still raises naming it; the launch
arguments of the fused-combine form (one launch per call); the buffers ``mla.workspace`` keeps; a8w8's one
reduction; ``import mla.decode`` registering the torch.library ops."""

import dataclasses
import math
import subprocess
import sys

import pytest
import torch

import mla.decode
import mla.launch
import mla.validate
from mla import workspace
from mla.decode import mla_decode, plan

from test_plan_cpu import Recorder, flat_inputs, offsets
from test_validation import CASES, call


@pytest.fixture(autouse=True)
def no_kernels(monkeypatch):
    """sm_90a on the CPU, and launchers that record instead of running (one Recorder per kernel config)."""
    monkeypatch.setenv("MLA_TARGET", "sm_90a")
    recorders = {}
    monkeypatch.setattr(mla.decode.jit, "get_launcher", lambda cfg, spec: recorders.setdefault(cfg, Recorder(cfg.name)))
    mla.decode.clear_caches()
    yield recorders
    mla.decode.clear_caches()


@pytest.fixture
def counted_checks(monkeypatch):
    """Counts the slow path: every run of ``validate.check_call``."""
    calls = []
    real = mla.validate.check_call

    def counting(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(mla.launch, "check_call", counting)
    monkeypatch.setattr(mla.validate, "check_call", counting)
    return calls


def launched(recorders):
    return [(r.name, args) for r in recorders.values() for args in r.calls]


# --- the signature cache -------------------------------------------------------------------------------------------


def test_a_signature_is_checked_once(no_kernels, counted_checks):
    q, kv, qo, kvp = flat_inputs([300, 0, 700])
    for _ in range(3):
        mla_decode(q, kv, qo, kvp)
    assert len(counted_checks) == 1, "the second and third call must skip the checks"
    mla_decode(torch.randn_like(q), kv.clone(), qo.clone(), kvp.clone())  # new tensors, same signature
    assert len(counted_checks) == 1
    mla_decode(q[:2], kv, qo[:3], kvp[:3])  # another batch: another signature
    assert len(counted_checks) == 2
    mla_decode(q, kv, qo, kvp, causal=True)
    mla_decode(q, kv, qo, kvp, num_splits=2)
    assert len(counted_checks) == 4
    mla_decode(q, kv, qo, kvp, config_overrides={"block_n": 32})  # tuning: never cached
    mla_decode(q, kv, qo, kvp, config_overrides={"block_n": 32})
    assert len(counted_checks) == 6


@pytest.mark.parametrize("overrides,error,message", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input_still_raises_after_a_good_call(overrides, error, message):
    """The same calls as test_validation, made after the good call of the same shapes is cached."""
    call()
    with pytest.raises(error) as info:
        call(**overrides)
    assert message in str(info.value), f"message {str(info.value)!r} lacks {message!r}"


def test_non_contiguous_tensors_of_a_cached_shape_raise():
    q, kv, qo, kvp = flat_inputs([5, 6, 7])
    mla_decode(q, kv, qo, kvp)
    strided_q = torch.randn(16, 3, 576).bfloat16().transpose(0, 1)  # same shape and dtype as q
    with pytest.raises(ValueError, match="q: expected a contiguous"):
        mla_decode(strided_q, kv, qo, kvp)
    strided_kvp = torch.zeros(8, dtype=torch.int32)[::2]
    with pytest.raises(ValueError, match="kv_indptr: expected a contiguous"):
        mla_decode(q, kv, qo, strided_kvp)
    with pytest.raises(ValueError, match="out: expected a contiguous"):
        mla_decode(q, kv, qo, kvp, out=torch.empty(3, 512, 16, dtype=torch.bfloat16).transpose(1, 2))


def test_a_cached_cpu_signature_rechecks_the_forced_target(monkeypatch):
    call()
    monkeypatch.delenv("MLA_TARGET")
    with pytest.raises(ValueError, match="q: expected a CUDA/ROCm tensor"):
        call()


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf, 0.0, -0.1], ids=str)
def test_sm_scale_must_be_positive_and_finite(bad):
    with pytest.raises(ValueError, match="sm_scale: expected a positive finite float"):
        call(sm_scale=bad)
    with pytest.raises(ValueError, match="sm_scale"):
        plan([0, 1], [0, 5], num_heads=16, kv_format="bf16", sm_scale=bad, device="cpu")


def test_sm_scale_type():
    with pytest.raises(TypeError, match="sm_scale"):
        call(sm_scale=[0.1])


@pytest.fixture
def two_kernel_form(monkeypatch):
    """The decode kernel without its fused merge, then the combine kernel (gfx942's form; Hopper fuses the merge)."""
    monkeypatch.setattr(mla.launch.schedule, "FUSED_COMBINE_ON_CUDA", False)


def test_eager_split_partials_share_one_allocation(no_kernels, two_kernel_form):
    # 32 heads, the two-kernel form: decode, then combine
    q, kv, qo, kvp = flat_inputs([3000, 5000], heads=32)
    mla_decode(q, kv, qo, kvp, num_splits=4)
    (decode_args,) = [a for name, a in launched(no_kernels) if "combine" not in name]
    (combine_args,) = [a for name, a in launched(no_kernels) if "combine" in name]
    o_partial, lse_partial = decode_args[-2:]
    assert o_partial.shape == (4, 2, 32, 512) and lse_partial.shape == (4, 2, 32)
    assert o_partial.is_contiguous() and lse_partial.is_contiguous()
    assert o_partial.untyped_storage().data_ptr() == lse_partial.untyped_storage().data_ptr()
    assert (lse_partial.data_ptr() - o_partial.data_ptr()) % 256 == 0
    assert combine_args[0] is o_partial and combine_args[1] is lse_partial
    out, lse = combine_args[2:]
    assert lse.shape == (2, 32) and lse.is_contiguous(), "an LSE nobody asked for lives in the same allocation"
    _, returned = mla_decode(q, kv, qo, kvp, num_splits=4, return_lse=True)
    assert returned.untyped_storage().nbytes() == 2 * 32 * 4, "a returned LSE is its own allocation"


def test_eager_buffers_are_views_of_the_stream_scratch(no_kernels, two_kernel_form):
    """An eager call allocates only its output: its split partials (and a8w8's amax) are views of the stream's
    scratch (``workspace.scratch``), made once per buffer and launch; a scratch too small is replaced by a larger
    one, with no views yet."""
    q, kv, qo, kvp = flat_inputs([3000, 5000], heads=32)
    for _ in range(2):
        mla_decode(q, kv, qo, kvp, num_splits=4)
    first, second = [a for name, a in launched(no_kernels) if "combine" not in name]
    assert first[-2] is second[-2] and first[-1] is second[-1], "the views are made once"
    cpu = torch.device("cpu")
    scratch = workspace.scratch(cpu, 1)
    assert first[-2].untyped_storage().data_ptr() == scratch.buffer.untyped_storage().data_ptr()
    assert workspace.scratch(cpu, scratch.buffer.numel()) is scratch
    bigger = workspace.scratch(cpu, scratch.buffer.numel() + 1)
    assert bigger is not scratch and bigger.buffer.numel() > scratch.buffer.numel() and not bigger.views
    assert bigger.buffer.dtype == torch.float32 and bigger.buffer.numel() % workspace.SCRATCH_GRANULE == 0


def run_a8w8(entry, q, kv, qo, kvp, *, num_splits, calls):
    """``calls`` a8w8 calls over an fp8 copy of ``kv`` (scale 1), eager (``mla_decode``) or through a plan; returns
    the zeroed amax cell those calls were given (the stream's, or the plan's)."""
    kv8, scale = kv.to(torch.float8_e4m3fn), torch.ones(1)
    if entry == "eager":
        for _ in range(calls):
            mla_decode(q, kv8, qo, kvp, kv_scale=scale, q_format="fp8", num_splits=num_splits)
        return workspace.amax_cell(torch.device("cpu"))
    p = plan(qo, kvp, num_heads=16, kv_format="fp8", q_format="fp8", num_splits=num_splits, device="cpu")
    for _ in range(calls):
        p.run(q, kv8, kv_scale=scale)
    return p._ws.amax_cell


@pytest.mark.parametrize("entry", ["eager", "plan"])
def test_a8w8_reduces_q_once_per_call_in_its_own_kernel(monkeypatch, no_kernels, entry):
    """Where the decode kernel reads amax(|q|) (no fused merge): one launch of the amax kernel per call, before the
    decode, into the amax that the decode takes as q_scale; its partials and its ticket (the zeroed amax cell, the
    stream's or the plan's) the same buffers every call; no torch reduction."""
    monkeypatch.setattr(torch.linalg, "vector_norm", lambda *a, **k: pytest.fail("torch's reduction on CUDA"))
    q, kv, qo, kvp = flat_inputs([10, 20])
    cell = run_a8w8(entry, q, kv, qo, kvp, num_splits=1, calls=3)
    calls = {r.name: r.calls for r in no_kernels.values() if r.calls}
    (amax_name,) = [name for name in calls if name.startswith("mla_amax_")]
    (decode_name,) = [name for name in calls if name.startswith("mla_decode_")]
    assert len(calls[amax_name]) == 3 and len(calls[decode_name]) == 3
    for amax_args, decode_args in zip(calls[amax_name], calls[decode_name]):
        q_arg, amax, partials, ticket = amax_args
        assert q_arg is q and ticket is cell and decode_args[4] is amax, "amax -> the decode's q_scale"
        assert amax.shape == (1,) and amax.dtype == torch.float32
        assert partials.shape == (mla.launch.AMAX_CTAS,) and partials.dtype == torch.int32
    assert len({id(a[1]) for a in calls[amax_name]}) == 1 and len({id(a[2]) for a in calls[amax_name]}) == 1
    mla_decode(q, kv.to(torch.float8_e4m3fn), qo, kvp, kv_scale=torch.ones(1), num_splits=1)  # bf16 Q: no reduction
    assert len(calls[amax_name]) == 3


@pytest.mark.parametrize("off", ["flag", "override"])
def test_a8w8_without_the_amax_kernel_reduces_q_by_torch(monkeypatch, no_kernels, off):
    """``schedule.amax_config`` None (gfx942, or the kernel turned off), or the tuning override
    ``amax_kernel=False``: torch's one reduction per call, written where the decode reads q_scale; the value is
    amax(|q|); the override changes nothing else (the same decode kernel)."""
    overrides = None
    if off == "flag":
        monkeypatch.setattr(mla.launch.schedule, "AMAX_KERNEL_ON_CUDA", False)
    else:
        overrides = {"amax_kernel": False}
    norms = []
    real = torch.linalg.vector_norm

    def counting(*args, **kwargs):
        norms.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(torch.linalg, "vector_norm", counting)
    q, kv, qo, kvp = flat_inputs([10, 20])
    kv8, scale = kv.to(torch.float8_e4m3fn), torch.ones(1)
    for _ in range(3):
        mla_decode(q, kv8, qo, kvp, kv_scale=scale, q_format="fp8", num_splits=1, config_overrides=overrides)
    assert len(norms) == 3
    ((name, decode_args),) = {r.name: r.calls for r in no_kernels.values() if r.calls}.items()
    assert name == "mla_decode_direct_kvfp8_qfp8_h16_bh16_qt1_bn64_st1_t128_g1_nostage_fd_fn"
    assert torch.equal(decode_args[-1][4], q.abs().amax().float().reshape(1)), "q_scale argument = amax(|q|)"
    mla_decode(q, kv8, qo, kvp, kv_scale=scale)  # bf16 Q: no reduction
    assert len(norms) == 3


@pytest.mark.parametrize("entry", ["eager", "plan"])
def test_a8w8_with_the_merge_fused_reduces_q_inside_the_kernel(monkeypatch, no_kernels, entry):
    """Where the merge is fused (a split grid that fits the GPU), the kernel reduces amax(|q|) itself: no reduction
    launch, and the q_scale argument is a zeroed cell (the stream's, or the plan's) that the kernel leaves zero."""
    monkeypatch.setattr(torch.linalg, "vector_norm", lambda *a, **k: pytest.fail("a reduction launch"))
    q, kv, qo, kvp = flat_inputs([100, 200])
    cell = run_a8w8(entry, q, kv, qo, kvp, num_splits=2, calls=2)
    ((name, calls),) = [(r.name, r.calls) for r in no_kernels.values() if r.calls]
    assert "_fused_" in name and "_qfp8_" in name
    assert calls[0][4] is calls[1][4] is cell, "q_scale argument: the zeroed amax cell"
    assert cell.shape == (1,) and cell.dtype == torch.float32 and cell.item() == 0


# --- the fused-combine launch form ----------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class FusedConfig:
    """Stands in for a decode config with the split combine inside the kernel."""

    name: str
    block_h: int
    fused_combine: bool = True
    semaphores_per_seq: int = 8  # counters per sequence, as the families whose last CTA merges say


@pytest.fixture
def fused_schedule(monkeypatch):
    """schedule.select_kernels returns a fused config (combine None) with the schedule's split count."""
    real = mla.launch.schedule.select_kernels

    def select(spec, **kw):
        cfg, _, num_splits = real(spec, **kw)
        return FusedConfig(f"fused_{cfg.name}", block_h=cfg.block_h), None, num_splits

    monkeypatch.setattr(mla.launch.schedule, "select_kernels", select)


@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("paged", [False, True], ids=["flat", "paged"])
@pytest.mark.parametrize("entry", ["eager", "plan"])
def test_fused_kernel_is_launched_once_with_the_contract_arguments(no_kernels, fused_schedule, num_splits, paged,
                                                                    entry):
    kv_lens, q_lens, heads = [5, 0, 40, 17], [1, 2, 1, 3], 32
    q, kv, qo, kvp = flat_inputs(kv_lens, q_lens=q_lens, heads=heads)
    table = None
    if paged:
        kv = torch.randn(12, 16, 1, 576).bfloat16()
        table = torch.randint(0, 12, (4, 3), dtype=torch.int32)
    out = torch.full((7, heads, 512), math.nan, dtype=torch.bfloat16)
    lse = torch.full((7, heads), math.nan)
    if entry == "eager":
        mla_decode(q, kv, qo, kvp, page_table=table, num_splits=num_splits, sm_scale=0.1, out=out, lse=lse)
    else:
        the_plan = plan(qo, kvp, num_heads=heads, kv_format="bf16", sm_scale=0.1, page_size=16 if paged else 0,
                        page_table=table, num_splits=num_splits, device="cpu")
        the_plan.run(q, kv, out=out, lse=lse)
    ((name, args),) = launched(no_kernels)  # one launch, no combine kernel
    assert name.startswith("fused_")
    (cfg,) = no_kernels
    head_groups = heads // cfg.block_h
    paging = (table,) if paged else ()
    assert len(args) == 15 + len(paging)
    (a_q, a_kv, a_block, a_stride, a_qs, a_kvs, a_qo, a_kvp, *rest) = args
    assert a_q is q and a_kv.shape == (kv.numel() // 576, 576) and a_kv.data_ptr() == kv.data_ptr()
    assert a_block.dtype == torch.uint8 and a_stride == 18
    assert a_qs.tolist() == [1.0] and a_kvs.tolist() == [1.0]
    if entry == "eager":
        assert a_qo is qo and a_kvp is kvp
    else:
        assert torch.equal(a_qo, qo) and torch.equal(a_kvp, kvp)
    if paged:
        assert rest[0] is table or torch.equal(rest[0], table)
        rest = rest[1:]
    sm_scale, splits, o_partial, lse_partial, semaphores, a_out, a_lse = rest
    assert sm_scale == 0.1 and type(splits) is int and splits == num_splits
    if num_splits == 1:
        assert o_partial.numel() == lse_partial.numel() == 1 and o_partial.dtype == torch.float32
    else:
        assert o_partial.dim() == lse_partial.dim() == 1, "flat partials"
        assert o_partial.numel() == num_splits * 7 * heads * 512 and lse_partial.numel() == num_splits * 7 * heads
        assert o_partial.dtype == lse_partial.dtype == torch.float32
    assert semaphores.dtype == torch.int32 and semaphores.numel() >= 4 * head_groups
    assert not semaphores.any(), "semaphores must be zero before the call"
    assert a_out is out and a_lse is lse


def test_fused_buffers_are_reused_across_calls(no_kernels, fused_schedule):
    q, kv, qo, kvp = flat_inputs([5, 40, 17])
    for _ in range(2):
        mla_decode(q, kv, qo, kvp, num_splits=1)
        mla_decode(q, kv, qo, kvp, num_splits=3)
    # One fused kernel serves every split count (the 16-row class on sm_90a), or a direct and a split config.
    records = [r for r in no_kernels.values() if r.calls]
    if len(records) == 1:
        one_split, split, one_split_again, split_again = records[0].calls
        split_rec = records[0]
    else:
        direct, split_rec = records
        (one_split, one_split_again), (split, split_again) = direct.calls, split_rec.calls
    # (q, kv, block scales, stride, q_scale, kv_scale, qo, kvp, sm_scale, num_splits, o_partial [10],
    # lse_partial [11], semaphores [12], out, lse)
    assert one_split[10] is one_split_again[10], "the 1-split dummy partials are cached"
    assert one_split[12] is split[12] is split_again[12], "one semaphore buffer per (device, stream)"
    assert split[10].data_ptr() != one_split[10].data_ptr()
    p = plan([0, 1, 2, 3], offsets([5, 40, 17]), num_heads=16, kv_format="bf16", num_splits=3, device="cpu")
    p.run(q, kv)
    p.run(q, kv)
    plan_first, plan_second = split_rec.calls[-2:]
    assert plan_first[12] is plan_second[12] is p._ws.semaphores, "a plan owns its semaphores"
    assert plan_first[12] is not split[12]
    assert plan_first[10] is p._ws.o_partial_flat and plan_second[11] is p._ws.lse_partial_flat


def test_semaphores_grow_and_stay_zero():
    device = torch.device("cpu")
    small = workspace.semaphores(device, 10)
    assert small.dtype == torch.int32 and not small.any() and small.numel() >= 10
    assert workspace.semaphores(device, 10) is small
    big = workspace.semaphores(device, small.numel() + 1)
    assert big.numel() > small.numel() and not big.any()


# --- registration ---------------------------------------------------------------------------------------------------


def test_import_mla_decode_registers_the_ops():
    code = "import torch\nimport mla.decode\nprint(torch.ops.mla.decode.default, torch.ops.mla.decode_out.default)\n"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "mla.decode.default mla.decode_out.default" in result.stdout


# --- the harness entry point --------------------------------------------------------------------------------------


@pytest.mark.parametrize("bad,error,message", [
    (lambda d: (d[0], d[0], *d[2:]), TypeError, "data[1] (kv_data): expected a dict"),
    (lambda d: d[:4], TypeError, "data: expected the harness tuple"),
    (lambda d: (d[0], {"fp8": None}, *d[2:]), ValueError, "kv_data: no 'bf16' entry"),
], ids=["tensor_for_kv_data", "four_items", "no_bf16_entry"])
def test_custom_kernel_names_a_malformed_harness_tuple(bad, error, message):
    """A tensor where the kv_data dict belongs was a torch deprecation warning and an IndexError."""
    q, kv, qo, kvp = flat_inputs([5, 6, 7])
    data = (q, {"bf16": kv}, qo, kvp, {"sm_scale": 0.1})
    mla.decode.custom_kernel(data)  # the well-formed tuple runs
    with pytest.raises(error, match=message.replace("[", r"\[").replace("(", r"\(").replace(")", r"\)")):
        mla.decode.custom_kernel(bad(data))


def test_no_module_level_import_cycle():
    """mla.launch (the eager call) imports none of mla.decode / mla.harness / mla.ops / mla.plan; mla.harness and
    mla.plan import mla.launch at module level; no function of the package imports one of those four."""
    import ast
    import pathlib

    root = pathlib.Path(mla.decode.__file__).parent
    hub = {"mla.decode", "mla.harness", "mla.ops", "mla.plan", "mla.flash_mla"}
    for path in root.glob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                for inner in ast.walk(node):
                    if isinstance(inner, ast.ImportFrom) and inner.module:
                        names = {inner.module} | {f"{inner.module}.{a.name}" for a in inner.names}
                        assert not names & hub, f"{path.name}:{inner.lineno} imports {names & hub} inside a function"
    launch_src = (root / "launch.py").read_text()
    for name in ("mla.decode", "mla.harness", "mla.ops", "mla.plan", "mla.flash_mla"):
        assert f"from {name} " not in launch_src and f"import {name}" not in launch_src


@pytest.mark.parametrize("entry", ["eager", "plan"])
def test_the_grid_barrier_merge_is_one_launch_without_semaphores(no_kernels, entry):
    """Hopper's default for a split grid that fits the GPU (3 sequences x 3 splits): the real schedule picks the
    decode kernel with its merge fused behind a grid barrier, launched once with the flat partials and no
    semaphores (it counts nothing), and a plan allocates none."""
    q, kv, qo, kvp = flat_inputs([5, 40, 17])
    out = torch.full((3, 16, 512), math.nan, dtype=torch.bfloat16)
    if entry == "eager":
        mla_decode(q, kv, qo, kvp, num_splits=3, out=out)
    else:
        p = plan(qo, kvp, num_heads=16, kv_format="bf16", num_splits=3, device="cpu")
        p.run(q, kv, out=out)
        assert p._ws.semaphores is None
    ((name, args),) = launched(no_kernels)
    (cfg,) = no_kernels
    assert cfg.fused_combine and cfg.semaphores_per_seq == 0 and name.endswith("_fused_fn")
    assert len(args) == 14, "Q..sm_scale, num_splits, o_partial, lse_partial, out, lse"
    splits, o_partial, lse_partial, a_out = args[9:13]
    assert splits == 3 and o_partial.numel() == 3 * 3 * 16 * 512 and lse_partial.numel() == 3 * 3 * 16
    assert a_out is out
    assert not any(isinstance(a, torch.Tensor) and a.dtype == torch.int32 and a.dim() == 1 and a.numel() >= 1 << 16
                   for a in args), "no semaphore buffer"
