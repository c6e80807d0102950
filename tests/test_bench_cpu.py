"""bench.py on the CPU: the AMD aiter peer (mla_bench.peers) against a fake ``aiter`` (no ROCm machine here), the
measurement rows and the host-cost table (mla_bench.measure, mla_bench.host), and the command line.

The fake aiter has the signatures of amd-aiter's ``get_mla_metadata_info_v1``, ``get_mla_metadata_v1`` (aiter/ops/
attention.py) and ``aiter.mla.mla_decode_fwd`` (aiter/mla.py), so a wrong argument name or count fails here; it
records every call, checks the shapes and dtypes of what it is given, and its decode writes the exact attention of
the fp8 values it reads (so the bench's --check path can be checked too). ``torch.version.hip`` is monkeypatched.
"""

import argparse
import inspect
import math
import os
import subprocess
import sys
import time
import types

import pytest
import torch

import bench
from mla_bench import host, measure, peers, report, timing
from mla_bench.calls import reference_fns
from mla_bench.cases import Case, bytes_moved, uniform_case
from mla.inputs import make_ragged_inputs
from mla.reference import mla_decode_reference

REPO_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FAKE_CU_NUM = 80


# ------------------------------------------------------------------------------------------------ the fake aiter


class FakeAiter:
    """A fake amd-aiter: ``module`` (aiter) and ``mla`` (aiter.mla), the calls made, in order, in ``calls``."""

    def __init__(self, fp8=torch.float8_e4m3fnuz, fail_decode=False):
        self.fp8 = fp8
        self.fail_decode = fail_decode
        self.calls = []  # (name, inspect.BoundArguments)
        self.module = types.ModuleType("aiter")
        self.module.__path__ = []  # a package, like the real one
        self.module.__file__ = "/fake/aiter/__init__.py"
        self.module.dtypes = types.SimpleNamespace(fp8=fp8, bf16=torch.bfloat16)
        self.mla = types.ModuleType("aiter.mla")
        self.module.mla = self.mla
        for name in ("get_mla_metadata_info_v1", "get_mla_metadata_v1"):
            setattr(self.module, name, getattr(self, name))
        self.mla.mla_decode_fwd = self.mla_decode_fwd

    def install(self, monkeypatch):
        monkeypatch.setitem(sys.modules, "aiter", self.module)
        monkeypatch.setitem(sys.modules, "aiter.mla", self.mla)
        return self

    def record(self, name, fn, args, kwargs):
        bound = inspect.signature(fn).bind(*args, **kwargs)  # TypeError on a wrong name or count, as the real one
        bound.apply_defaults()
        self.calls.append((name, bound.arguments))
        return bound.arguments

    # Signatures as in ROCm/aiter (aiter/ops/attention.py, aiter/mla.py); the bodies are fakes.

    def get_mla_metadata_info_v1(self, *args, **kwargs):
        def signature(batch_size, max_seqlen_qo, num_head_qo, q_dtype, kv_dtype, is_sparse, fast_mode=True,
                      num_kv_splits=32, intra_batch_mode=False, max_split_per_batch=-1):
            pass

        a = self.record("get_mla_metadata_info_v1", signature, args, kwargs)
        assert a["num_head_qo"] % 8 == 0  # aiter asserts this
        tiles = a["batch_size"] * math.ceil(a["max_seqlen_qo"] * a["num_head_qo"] / 128)
        splits = a["num_kv_splits"]
        return (
            ((2), torch.uint64),  # work_metadata_ptrs
            (FAKE_CU_NUM + 1, torch.int32),  # work_indptr
            ((tiles * splits, 8), torch.int32),  # work_info_set
            ((tiles + 1), torch.int32),  # reduce_indptr
            ((tiles, 2), torch.int32),  # reduce_final_map
            (tiles * splits, torch.int32),  # reduce_partial_map
        )

    def get_mla_metadata_v1(self, *args, **kwargs):
        def signature(seqlens_qo_indptr, seqlens_kv_indptr, kv_last_page_lens, num_heads_per_head_k, num_heads_k,
                      is_causal, work_metadata_ptrs, work_info_set, work_indptr, reduce_indptr, reduce_final_map,
                      reduce_partial_map, page_size=1, kv_granularity=16, max_seqlen_qo=-1, uni_seqlen_qo=-1,
                      fast_mode=True, topk=-1, max_split_per_batch=-1, intra_batch_mode=False,
                      is_cp_round_robin=False, mla_version=0, dtype_q_nope=None, dtype_q_rope=None,
                      dtype_kv_nope=None, dtype_kv_rope=None, dtype_q=None, dtype_kv=None):
            pass

        a = self.record("get_mla_metadata_v1", signature, args, kwargs)
        # The buffers in the order this function takes them (work_info_set before work_indptr).
        assert a["work_metadata_ptrs"].shape == (2,) and a["work_metadata_ptrs"].dtype == torch.uint64
        assert a["work_info_set"].dim() == 2 and a["work_info_set"].shape[1] == 8
        assert a["work_indptr"].shape == (FAKE_CU_NUM + 1,)
        assert a["reduce_final_map"].dim() == 2 and a["reduce_final_map"].shape[1] == 2
        for name in ("work_info_set", "work_indptr", "reduce_indptr", "reduce_final_map", "reduce_partial_map"):
            a[name].fill_(7)  # "filled in place"

    def mla_decode_fwd(self, *args, **kwargs):
        def signature(q, kv_buffer, o, qo_indptr, kv_indptr, kv_indices, kv_last_page_lens, max_seqlen_q,
                      page_size=1, nhead_kv=1, sm_scale=None, logit_cap=0.0, num_kv_splits=None,
                      num_kv_splits_indptr=None, work_meta_data=None, work_indptr=None, work_info_set=None,
                      reduce_indptr=None, reduce_final_map=None, reduce_partial_map=None, q_scale=None,
                      kv_scale=None, intra_batch_mode=False, return_logits=False, return_lse=False,
                      g_kv_indptr=None, cp_world_size=1, cp_rank=0, causal=True):
            pass

        a = self.record("mla_decode_fwd", signature, args, kwargs)
        if self.fail_decode:
            raise RuntimeError("fake aiter: no kernel for this shape")
        q, kv, o = a["q"], a["kv_buffer"], a["o"]
        total_kv = kv.shape[0]
        assert q.dtype == self.fp8 and kv.dtype == self.fp8
        assert kv.dim() == 4 and kv.shape[1:] == (1, 1, 576)  # (pages, page_size 1, 1 kv head, 576)
        assert q.dim() == 3 and q.shape[2] == 576
        assert o.shape == (q.shape[0], q.shape[1], 512) and o.dtype == torch.bfloat16
        for name in ("q_scale", "kv_scale"):
            assert a[name].shape == (1,) and a[name].dtype == torch.float32
        assert torch.equal(a["kv_indices"], torch.arange(total_kv, dtype=torch.int32))
        ref, _ = mla_decode_reference(q.float() * a["q_scale"], kv.reshape(total_kv, 1, 576).float() * a["kv_scale"],
                                      a["qo_indptr"], a["kv_indptr"], sm_scale=a["sm_scale"], causal=True)
        o.copy_(ref)
        return None, None  # (logits, lse), unused by the bench

    def names(self):
        return [name for name, _ in self.calls]

    def call(self, name):
        return next(arguments for n, arguments in self.calls if n == name)


@pytest.fixture(autouse=True)
def no_flashmla(monkeypatch):
    """FlashMLA is a peer only with $FLASHMLA_LEGACY_LIB (set on the GPU host): not in these tests
    (tests/test_peers_flashmla_cpu.py has its own fake)."""
    monkeypatch.delenv(peers.FLASHMLA_LIB_ENV, raising=False)


@pytest.fixture
def on_rocm(monkeypatch):
    monkeypatch.setattr(torch.version, "hip", "6.3.0-fake")


def aiter_peer(fake):
    module, reason = peers.load_aiter()
    assert reason is None and module is fake.module
    return peers.Peer(peers.AITER, module=module)


# ------------------------------------------------------------------------------------------------ detection


def test_not_on_rocm_does_nothing(monkeypatch, capsys):
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setitem(sys.modules, "aiter", None)  # any attempt to import aiter would now raise ImportError
    assert peers.load_aiter() == (None, "not on ROCm")
    assert peers.setup_aiter_peer() is None
    assert peers.aiter_status(None) == "aiter: not on ROCm"
    monkeypatch.setattr(peers, "load_flashinfer", lambda: (None, "no flashinfer here"))
    found = peers.setup_peers("cpu")
    assert [p.name for p in found] == list(peers.FLASHINFER)
    report.print_peers(found, argparse.Namespace(no_peers=False))
    out = capsys.readouterr().out
    assert "aiter: not on ROCm" in out.splitlines()


def test_import_failure_is_unavailable(monkeypatch, on_rocm):
    monkeypatch.setitem(sys.modules, "aiter", None)
    peer = peers.setup_aiter_peer()
    assert peer.name == "aiter" and peer.module is None
    assert peer.reason.startswith("unavailable: import aiter failed: ")
    assert peers.aiter_status(peer).startswith("aiter: unavailable: ")


def test_pypi_aiter_is_the_wrong_package(monkeypatch, on_rocm):
    unrelated = types.ModuleType("aiter")  # PyPI's aiter: a plain module, no aiter.mla
    unrelated.__file__ = "/site-packages/aiter.py"
    monkeypatch.setitem(sys.modules, "aiter", unrelated)
    monkeypatch.delitem(sys.modules, "aiter.mla", raising=False)
    peer = peers.setup_aiter_peer()
    assert peer.reason.startswith("wrong package")
    assert peers.aiter_status(peer).startswith("aiter: wrong package")


def test_aiter_without_persistent_metadata_is_unavailable(monkeypatch, on_rocm):
    fake = FakeAiter().install(monkeypatch)
    monkeypatch.delattr(fake.module, "get_mla_metadata_info_v1")
    _, reason = peers.load_aiter()
    assert reason.startswith("unavailable: amd-aiter too old") and "get_mla_metadata_info_v1" in reason


def test_amd_aiter_is_detected(monkeypatch, on_rocm, capsys):
    fake = FakeAiter().install(monkeypatch)
    monkeypatch.setattr(peers, "load_flashinfer", lambda: (None, "no flashinfer on ROCm"))
    found = peers.setup_peers("cpu")
    assert [p.name for p in found] == [*peers.FLASHINFER, "aiter"]
    assert found[-1].module is fake.module and found[-1].reason is None
    report.print_peers(found, argparse.Namespace(no_peers=False))
    assert "aiter: amd-aiter " in capsys.readouterr().out
    assert fake.calls == []  # detection calls nothing


# ------------------------------------------------------------------------------------------------ the call sequence


@pytest.mark.parametrize("fp8", [torch.float8_e4m3fnuz, torch.float8_e4m3fn], ids=["gfx942_fnuz", "gfx950_fn"])
@pytest.mark.parametrize("heads,q_len", [(16, 1), (128, 1), (16, 2)])
def test_call_sequence(monkeypatch, on_rocm, fp8, heads, q_len):
    fake = FakeAiter(fp8=fp8).install(monkeypatch)
    kv_lens = [5, 40, 17]
    data = make_ragged_inputs(kv_lens, q_len, num_heads=heads, seed=3, device="cpu")
    q, kv_data, qo_indptr, kv_indptr, _ = data
    batch, total_q, total_kv = len(kv_lens), q.shape[0], sum(kv_lens)

    fn, ref_fn = peers.aiter_callable(aiter_peer(fake), data, heads)
    assert fake.names() == ["get_mla_metadata_info_v1", "get_mla_metadata_v1"]  # setup, untimed

    info = fake.call("get_mla_metadata_info_v1")
    assert (info["batch_size"], info["max_seqlen_qo"], info["num_head_qo"]) == (batch, q_len, heads)
    assert info["q_dtype"] == fp8 and info["kv_dtype"] == fp8
    assert info["is_sparse"] is False and info["fast_mode"] is False
    assert info["num_kv_splits"] == 32 and info["intra_batch_mode"] is True

    meta = fake.call("get_mla_metadata_v1")
    assert torch.equal(meta["seqlens_qo_indptr"], qo_indptr) and torch.equal(meta["seqlens_kv_indptr"], kv_indptr)
    assert meta["seqlens_qo_indptr"].dtype == torch.int32 and meta["seqlens_kv_indptr"].dtype == torch.int32
    assert torch.equal(meta["kv_last_page_lens"], torch.ones(batch, dtype=torch.int32))  # page size 1
    assert (meta["num_heads_per_head_k"], meta["num_heads_k"], meta["is_causal"]) == (heads, 1, True)
    assert (meta["page_size"], meta["kv_granularity"]) == (1, 16)
    assert (meta["max_seqlen_qo"], meta["uni_seqlen_qo"]) == (q_len, q_len)
    assert meta["fast_mode"] is False and meta["max_split_per_batch"] == 32 and meta["intra_batch_mode"] is True
    assert meta["dtype_q"] == fp8 and meta["dtype_kv"] == fp8

    out = fn()  # the timed call
    assert fake.names()[-1] == "mla_decode_fwd" and len(fake.calls) == 3
    dec = fake.call("mla_decode_fwd")
    assert dec["q"].shape == (total_q, heads, 576) and dec["kv_buffer"].shape == (total_kv, 1, 1, 576)
    assert dec["o"] is out and out.shape == (total_q, heads, 512)
    assert dec["max_seqlen_q"] == q_len and dec["kv_last_page_lens"] is meta["kv_last_page_lens"]
    assert (dec["page_size"], dec["nhead_kv"], dec["num_kv_splits"]) == (1, 1, 32)
    assert dec["sm_scale"] == pytest.approx(1 / math.sqrt(576)) and dec["logit_cap"] == 0.0
    assert dec["intra_batch_mode"] is True
    # The work buffers are the very tensors get_mla_metadata_v1 filled.
    for dec_name, meta_name in (("work_meta_data", "work_metadata_ptrs"), ("work_indptr", "work_indptr"),
                                ("work_info_set", "work_info_set"), ("reduce_indptr", "reduce_indptr"),
                                ("reduce_final_map", "reduce_final_map"),
                                ("reduce_partial_map", "reduce_partial_map")):
        assert dec[dec_name] is meta[meta_name], dec_name
    # Per-tensor quantization to aiter's fp8 dtype: the scales are amax / finfo.max of the bf16 tensors.
    fp8_max = torch.finfo(fp8).max
    assert dec["q_scale"].item() == pytest.approx(q.abs().amax().float().item() / fp8_max, rel=1e-2)
    assert dec["kv_scale"].item() == pytest.approx(kv_data["bf16"].abs().amax().float().item() / fp8_max, rel=1e-2)
    if fp8 == kv_data["fp8"][0].dtype:  # the harness's fp8 cache is reused, not requantized
        assert dec["kv_buffer"].data_ptr() == kv_data["fp8"][0].data_ptr()

    fn()  # repeated calls reuse the setup: one more decode, no more metadata
    assert fake.names().count("mla_decode_fwd") == 2 and fake.names().count("get_mla_metadata_v1") == 1

    # The check's reference is on the same fp8 values; and close to the exact bf16 attention.
    ref = ref_fn()
    assert ref.shape == out.shape
    assert ((out.float() - ref).norm() / ref.norm()).item() < 1e-2
    exact, _ = mla_decode_reference(q, kv_data["bf16"], qo_indptr, kv_indptr, causal=True)
    assert ((ref - exact).norm() / exact.norm()).item() < 0.1


def test_heads_not_multiple_of_8_fail_in_setup(monkeypatch, on_rocm):
    fake = FakeAiter().install(monkeypatch)
    data = make_ragged_inputs([4, 4], 1, num_heads=16, device="cpu")
    with pytest.raises(ValueError, match="16"):
        peers.aiter_callable(aiter_peer(fake), data, heads=12)  # q has 16 heads


# ------------------------------------------------------------------------------------------------ rows


def cpu_timer(fn, *, reps, warmup, flush):
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e6)
    return times


def run_bench_peers(monkeypatch, fake, check=True):
    monkeypatch.setattr(timing, "time_call_us", cpu_timer)
    args = argparse.Namespace(q_len=1, heads=16, reps=3, check=check)
    found = [peers.Peer("fa3", reason="no flashinfer"), aiter_peer(fake)]
    b = measure.Bench(args=args, spec=None, device="cpu", flush=None, ceiling_gbps=1000.0, peers=found)
    case = Case("ragged3", (5, 40, 17))
    data = make_ragged_inputs(list(case.kv_lens), 1, num_heads=16, device="cpu")
    return case, measure.bench_peers(b, case, data, reference_fns(data))


def test_bench_peers_times_aiter(monkeypatch, on_rocm, capsys):
    fake = FakeAiter().install(monkeypatch)
    case, rows = run_bench_peers(monkeypatch, fake)
    assert [r["impl"] for r in rows] == ["aiter"]  # fa3 is unavailable: said once in the header, no row
    row = rows[0]
    assert row["kind"] == "peer" and row["reps"] == 3 and "error" not in row
    assert row["bytes_read"] == bytes_moved(case.batch, case.mean_kv_len, 1, 16, "a8w8")
    assert row["check_ok"] and row["rel_l2"] < 1e-2
    assert fake.names().count("get_mla_metadata_v1") == 1
    assert fake.names().count("mla_decode_fwd") == 1 + timing.WARMUP_CALLS + 3  # check call, warm-up, reps
    assert "aiter" in capsys.readouterr().out
    assert report.timed_impls(rows, ("peer",)) == ["aiter"]


def test_bench_peers_reports_aiter_failure_and_goes_on(monkeypatch, on_rocm):
    fake = FakeAiter(fail_decode=True).install(monkeypatch)
    _, rows = run_bench_peers(monkeypatch, fake, check=False)
    assert rows[0]["error"].startswith("RuntimeError: fake aiter")
    assert "unavailable: RuntimeError: fake aiter" in report.format_row(rows[0])

    fake = FakeAiter().install(monkeypatch)

    def older_metadata(*args, page_size=1, kv_granularity=16, max_seqlen_qo=-1, uni_seqlen_qo=-1, fast_mode=True,
                       max_split_per_batch=-1, intra_batch_mode=False):  # an aiter without dtype_q / dtype_kv
        raise AssertionError("not reached")

    peer = aiter_peer(fake)
    monkeypatch.setattr(fake.module, "get_mla_metadata_v1", older_metadata)  # setup itself fails
    monkeypatch.setattr(peers, "load_aiter", lambda: (peer.module, None))
    _, rows = run_bench_peers(monkeypatch, fake, check=False)
    assert rows[0]["error"].startswith("setup failed: TypeError")
    assert report.format_row(rows[0]).split("aiter", 1)[1].strip().startswith("unavailable: setup failed")


# ---------------------------------------------------------------------------- FlashInfer reading our pages


class FakeMLAWrapper:
    """FlashInfer's BatchMLAPagedAttentionWrapper as bench.py calls it (plan / run keywords of flashinfer 0.2+);
    ``run`` gathers each sequence's pages from the CSR lists it was planned with and attends exactly."""

    def __init__(self, workspace, backend="auto"):
        self.backend = backend

    def plan(self, qo_indptr, kv_indptr, kv_indices, kv_len_arr, num_heads, head_dim_ckv, head_dim_kpe, page_size,
             causal, sm_scale, q_data_type, kv_data_type):
        self.qo, self.page_indptr = qo_indptr.tolist(), kv_indptr.tolist()
        self.kv_indices, self.kv_lens = kv_indices.tolist(), kv_len_arr.tolist()
        self.page_size, self.sm_scale = page_size, sm_scale

    def run(self, q_nope, q_pe, ckv_cache, kpe_cache):
        out = torch.zeros(q_nope.shape, dtype=torch.float32)
        for b, n in enumerate(self.kv_lens):
            pages = self.kv_indices[self.page_indptr[b]:self.page_indptr[b + 1]]
            if n == 0:
                continue
            ckv = torch.cat([ckv_cache[p].reshape(self.page_size, -1) for p in pages])[:n].float()
            kpe = torch.cat([kpe_cache[p].reshape(self.page_size, -1) for p in pages])[:n].float()
            lo, hi = self.qo[b], self.qo[b + 1]
            scores = (q_nope[lo:hi].float() @ ckv.T + q_pe[lo:hi].float() @ kpe.T) * self.sm_scale
            out[lo:hi] = torch.softmax(scores, dim=-1) @ ckv
        return out.bfloat16()


@pytest.mark.parametrize("page_size", [None, 1, 16])
def test_flashinfer_reads_the_same_pages_as_our_kernels(page_size):
    """With --page-size the FlashInfer peer is planned over our shuffled pages (CSR page lists, NaN in every
    unused slot): its exact stand-in must reproduce the flat reference, so the page lists describe the right rows."""
    from mla.inputs import to_paged

    data = make_ragged_inputs([5, 0, 40, 17, 1], 1, num_heads=16, device="cpu", seed=4)
    paging = to_paged(data, page_size, seed=2) if page_size else None
    peer = peers.Peer("fa3", module=types.SimpleNamespace(mla=types.SimpleNamespace(BatchMLAPagedAttentionWrapper=FakeMLAWrapper)),
                      workspace=None)
    out = peers.flashinfer_callable(peer, data, 16, paging)()
    ref, _ = mla_decode_reference(data[0], data[1]["bf16"], data[2], data[3])
    assert torch.isfinite(out).all(), "a NaN slot was read: the page lists point at the wrong rows"
    torch.testing.assert_close(out.float(), ref, rtol=2e-2, atol=2e-2)


# ------------------------------------------------------------------------------------------------ command line


@pytest.mark.parametrize("argv", [["bench.py", "--help"], ["-c", "import bench"]], ids=["help", "import"])
def test_command_line(argv):
    result = subprocess.run([sys.executable, *argv], cwd=REPO_DIR, capture_output=True, text=True, timeout=120,
                            check=False)
    assert result.returncode == 0, result.stderr
    if "--help" in argv:
        assert "AMD aiter" in result.stdout and "--no-peers" in result.stdout


# ------------------------------------------------------------------------------------------------ the host-cost table


@pytest.mark.parametrize("paged", [False, True], ids=["flat", "paged"])
def test_host_table_rows(monkeypatch, paged):
    """mla_bench.host.bench_host on the CPU (target forced, kernels recorded, the CUDA timers replaced): a row per
    mode for mla_decode, one for DecodePlan.run and one for flash_mla_with_kvcache (64-token pages), one for the
    harness's custom_kernel (flat caches only: it reads the flat bf16 cache), and one per peer, each with the three
    JSON fields, and the host's reference row (one torch launch)."""
    import mla.decode
    from test_plan_cpu import Recorder

    monkeypatch.setenv("MLA_TARGET", "sm_90a")
    monkeypatch.setattr(mla.decode.jit, "get_launcher", lambda cfg, spec: Recorder(cfg.name))
    mla.decode.clear_caches()
    calls = []
    monkeypatch.setattr(timing, "sleep_cycles_per_us", lambda: 1000.0)
    monkeypatch.setattr(timing, "host_us_per_call", lambda fn, n: calls.append(fn()) or 20.0)
    monkeypatch.setattr(timing, "gpu_us_per_call", lambda fn, n, host_us, cycles: {"gpu_us": 12.5, "queued": True})
    flashinfer = types.SimpleNamespace(mla=types.SimpleNamespace(BatchMLAPagedAttentionWrapper=FakeMLAWrapper))
    args = bench.parse_args(["--modes", "bf16,a8w8", "--host-calls", "7"] + (["--page-size", "16"] if paged else []))
    found = [peers.Peer("fa3", module=flashinfer), peers.Peer("fa2", reason="not installed")]
    b = measure.Bench(args=args, spec=None, device="cpu", flush=None, ceiling_gbps=1000.0, peers=found)
    rows = host.bench_host(b, uniform_case(*args.host_shape[0]))
    mla.decode.clear_caches()
    assert [(r["impl"], r["call"], r["plan"], r["peer"]) for r in rows] == [
        ("bf16", "eager", False, False), ("bf16", "plan.run", True, False), ("a8w8", "eager", False, False),
        ("a8w8", "plan.run", True, False), ("bf16", "flash_mla", False, False), ("a8w8", "flash_mla", False, False)
    ] + ([] if paged else [("bf16", "custom_kernel", False, False)]) + [
        ("torch", "reference", False, False), ("fa3", "peer", False, True)]
    for row in rows:
        assert row["kind"] == "host" and row["case"] == "4x1024" and "error" not in row, row
        assert row["host_us_per_call"] == 20.0 and row["gpu_us_per_call"] == 12.5 and row["host_overhead_us"] == 7.5
        assert row["calls"] == 7 and row["gpu_time_queued"]
    assert len(calls) == len(rows) * host.HOST_ROUNDS
    flash = [c for c in calls if isinstance(c, tuple)]  # flash_mla_with_kvcache: (out, lse), FlashMLA's shapes
    assert len(flash) == 2 * host.HOST_ROUNDS
    assert all(out.shape == (4, 1, 16, 512) and lse.shape == (4, 16, 1) for out, lse in flash)
    reference = [c for c in calls if not isinstance(c, tuple) and c.shape == (1,)]  # the torch launch's cell
    assert len(reference) == host.HOST_ROUNDS
    assert all(out.shape == (4, 16, 512) for out in calls if not isinstance(out, tuple) and out.shape != (1,))
    host.print_host_summary(rows)


def test_host_shape_option():
    assert bench.parse_args([]).host_shape == [(4, 1024)]
    assert bench.parse_args(["--host-shape", "none"]).host_shape == []
    assert bench.parse_args(["--host-shape", "8x512"]).host_shape == [(8, 512)]
    with pytest.raises(SystemExit):
        bench.parse_args(["--host-shape", "4x1024,8x8"])
