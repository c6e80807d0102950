"""The FlashMLA peer of bench.py (mla_bench/peers.py) on the CPU, against a fake op library.

The fake registers, under its own torch.library namespace, the three ops of SGLang's FlashMLA fork with the schemas
the real library registers (see ../shared/device/make-flashmla.sh), so a wrong argument count or type fails in the
dispatcher; each records its calls, checks shapes and dtypes as the real kernels do (64-token pages, fp8 with
per-tensor descales), and computes the exact attention of what it reads through the block table, so the bench's
--check path is checked too. ``torch.ops.load_library`` is replaced by the fake's registration.
"""

import argparse
import math

import pytest
import torch

from mla.inputs import make_ragged_inputs, to_paged
from mla.reference import mla_decode_reference
from mla_bench import measure, peers, timing
from mla_bench.calls import reference_fns
from mla_bench.cases import Case, bytes_moved
from mla_bench.report import timed_impls

NAMESPACE = "flash_mla_legacy_fake"
SCHEMAS = {
    "dense_decode_fwd": "dense_decode_fwd(Tensor q, Tensor kcache, int head_size_v, Tensor seqlens_k, "
                        "Tensor block_table, float softmax_scale, bool is_causal, Tensor? tile_scheduler_metadata, "
                        "Tensor? num_splits) -> (Tensor, Tensor, Tensor?, Tensor?)",
    "get_mla_decoding_metadata_dense_fp8": "get_mla_decoding_metadata_dense_fp8(Tensor seqlens_k, "
                                           "int num_heads_per_head_k, int num_heads_k) -> Tensor[]",
    "fwd_kvcache_mla_fp8": "fwd_kvcache_mla_fp8(Tensor q, Tensor kcache, int head_size_v, Tensor seqlens_k, "
                           "Tensor block_table, float softmax_scale, bool is_causal, Tensor tile_scheduler_metadata, "
                           "Tensor num_splits, Tensor? descale_q, Tensor? descale_k) -> Tensor[]",
}
NUM_SM_PARTS = 8
CALLS = []  # (op name, its arguments), in order; cleared by the fixture
_LIBRARY = []  # keeps the fake library registered for the whole session


def attend(q4, kcache, seqlens, block_table, scale):
    """Exact attention of (b, s_q, h, 576) queries over 64-token pages: (out (b, s_q, h, 512), lse (b, h, s_q))."""
    b, s_q, h, _ = q4.shape
    out = torch.zeros(b, s_q, h, 512)
    lse = torch.full((b, h, s_q), -math.inf)
    for i in range(b):
        n = int(seqlens[i])
        if n == 0:
            continue
        pages = block_table[i, : -(-n // 64)].long()
        rows = kcache[pages].reshape(-1, 576)[:n].float()
        scores = torch.einsum("qhd,kd->qhk", q4[i].float(), rows) * scale
        out[i] = torch.einsum("qhk,kd->qhd", torch.softmax(scores, dim=-1), rows[:, :512])
        lse[i] = torch.logsumexp(scores, dim=-1).T
    return out, lse


def check_common(q, kcache, head_size_v, seqlens, block_table):
    assert q.dim() == 4 and q.shape[3] == 576, q.shape
    assert kcache.dim() == 4 and kcache.shape[1:] == (64, 1, 576), "FlashMLA reads pages of 64 tokens"
    assert head_size_v == 512
    assert seqlens.dtype == block_table.dtype == torch.int32 and seqlens.shape == (q.shape[0],)
    assert block_table.dim() == 2 and block_table.shape[0] == q.shape[0] and block_table.stride(-1) == 1


def dense_decode_fwd(q, kcache, head_size_v, seqlens_k, block_table, softmax_scale, is_causal, metadata, num_splits):
    CALLS.append(("dense_decode_fwd", (q, kcache, head_size_v, seqlens_k, block_table, softmax_scale, is_causal,
                                       metadata, num_splits)))
    assert q.dtype == kcache.dtype == torch.bfloat16
    check_common(q, kcache, head_size_v, seqlens_k, block_table)
    if metadata is None:  # the first call computes the scheduler metadata
        metadata = torch.full((NUM_SM_PARTS, 8), 7, dtype=torch.int32)
        num_splits = torch.ones(q.shape[0] + 1, dtype=torch.int32)
    out, lse = attend(q, kcache, seqlens_k, block_table, softmax_scale)
    return out.bfloat16(), lse, metadata.clone(), num_splits.clone()


def get_mla_decoding_metadata_dense_fp8(seqlens_k, num_heads_per_head_k, num_heads_k):
    CALLS.append(("get_mla_decoding_metadata_dense_fp8", (seqlens_k, num_heads_per_head_k, num_heads_k)))
    assert seqlens_k.dtype == torch.int32 and num_heads_k == 1
    return [torch.full((NUM_SM_PARTS, 8), 7, dtype=torch.int32),
            torch.ones(seqlens_k.shape[0] + 1, dtype=torch.int32)]


def fwd_kvcache_mla_fp8(q, kcache, head_size_v, seqlens_k, block_table, softmax_scale, is_causal, metadata,
                        num_splits, descale_q, descale_k):
    CALLS.append(("fwd_kvcache_mla_fp8", (q, kcache, head_size_v, seqlens_k, block_table, softmax_scale, is_causal,
                                          metadata, num_splits, descale_q, descale_k)))
    assert q.dtype == kcache.dtype == torch.float8_e4m3fn
    check_common(q, kcache, head_size_v, seqlens_k, block_table)
    assert descale_q.shape == descale_k.shape == (1,) and descale_q.dtype == descale_k.dtype == torch.float32
    out, lse = attend(q.float() * descale_q, kcache.float() * descale_k, seqlens_k, block_table, softmax_scale)
    return [out.bfloat16(), lse]


def register_fake_library():
    if not _LIBRARY:
        lib = torch.library.Library(NAMESPACE, "DEF")
        for name, schema in SCHEMAS.items():
            lib.define(schema)
            lib.impl(name, globals()[name], "CPU")
        _LIBRARY.append(lib)


@pytest.fixture
def fake_flashmla(monkeypatch):
    """$FLASHMLA_LEGACY_LIB set; loading it registers the fake ops (under their own namespace)."""
    loaded = []

    def load_library(path):
        loaded.append(path)
        register_fake_library()

    monkeypatch.setenv(peers.FLASHMLA_LIB_ENV, "/fake/_C_legacy.abi3.so")
    monkeypatch.setattr(peers, "FLASHMLA_NAMESPACE", NAMESPACE)
    monkeypatch.setattr(torch.ops, "load_library", load_library)
    monkeypatch.setattr(peers, "load_flashinfer", lambda: (None, "no flashinfer here"))
    CALLS.clear()
    yield loaded
    CALLS.clear()


def names():
    return [name for name, _ in CALLS]


# ------------------------------------------------------------------------------------------------ detection


def test_without_the_variable_there_is_no_flashmla_peer(monkeypatch):
    monkeypatch.delenv(peers.FLASHMLA_LIB_ENV, raising=False)
    monkeypatch.setattr(peers, "load_flashinfer", lambda: (None, "no flashinfer here"))
    found = peers.setup_peers("cpu")
    assert not any(p.name in peers.FLASHMLA for p in found)
    assert any("FLASHMLA_LEGACY_LIB not set" in line for line in peers.status_lines(found))


def test_the_library_is_loaded_and_both_kernels_are_peers(fake_flashmla):
    found = peers.setup_peers("cpu")
    flashmla = [p for p in found if p.name in peers.FLASHMLA]
    assert [p.name for p in flashmla] == ["flashmla-bf16", "flashmla-fp8"]
    assert all(p.reason is None and p.module is getattr(torch.ops, NAMESPACE) for p in flashmla)
    assert fake_flashmla == ["/fake/_C_legacy.abi3.so"]
    lines = peers.status_lines(found)
    assert "peer flashmla-bf16: FlashMLA SM90 from /fake/_C_legacy.abi3.so" in lines
    assert CALLS == [], "detection runs no op"


def test_a_library_that_does_not_load_is_unavailable(monkeypatch, fake_flashmla):
    def broken(path):
        raise OSError("undefined symbol: _ZN3c10")

    monkeypatch.setattr(torch.ops, "load_library", broken)
    found = [p for p in peers.setup_peers("cpu") if p.name in peers.FLASHMLA]
    assert len(found) == 2 and all(p.reason.startswith("loading /fake/_C_legacy.abi3.so failed: OSError") for p in found)
    assert "peer flashmla-fp8: unavailable: loading" in "\n".join(peers.status_lines(found))


def test_a_library_without_the_ops_is_unavailable(monkeypatch, fake_flashmla):
    monkeypatch.setattr(peers, "FLASHMLA_OPS", (*peers.FLASHMLA_OPS, "not_there"))
    ops, reason = peers.load_flashmla()
    assert ops is None and reason.endswith(f"has no torch.ops.{NAMESPACE}.not_there")


# ------------------------------------------------------------------------------------------------ the calls


def flashmla_peer(name):
    register_fake_library()
    return peers.Peer(name, module=getattr(torch.ops, NAMESPACE))


@pytest.mark.parametrize("layout", ["flat", "page64", "page16"])
@pytest.mark.parametrize("heads,q_len", [(16, 1), (64, 1), (16, 2)])
@pytest.mark.parametrize("name", ["flashmla-bf16", "flashmla-fp8"])
def test_call_sequence_and_output(fake_flashmla, name, heads, q_len, layout):
    kv_lens = [5, 200, 64, 130]
    data = make_ragged_inputs(kv_lens, q_len, num_heads=heads, seed=4, device="cpu")
    q, kv_data, qo_indptr, kv_indptr, _ = data
    paging = None if layout == "flat" else to_paged(data, int(layout[4:]), seed=2)
    ref_fns = reference_fns(data)
    shared = {}
    fn, ref_fn, bytes_mode = peers.peer_callable(flashmla_peer(name), data, heads, ref_fns, paging, shared)
    fp8 = name == "flashmla-fp8"
    setup = names()
    assert setup == (["get_mla_decoding_metadata_dense_fp8"] if fp8 else ["dense_decode_fwd"]), "the untimed plan"
    assert bytes_mode == ("a8w8" if fp8 else "bf16") and ref_fn is ref_fns["a8w8" if fp8 else "bf16"]

    out = fn()
    out2 = fn()
    timed = CALLS[len(setup):]
    assert [n for n, _ in timed] == ["fwd_kvcache_mla_fp8" if fp8 else "dense_decode_fwd"] * 2
    args = timed[0][1]
    q4, kcache, _, seqlens, table, scale, causal, metadata, splits = args[:9]
    assert q4.shape == (len(kv_lens), q_len, heads, 576)
    assert seqlens.tolist() == kv_lens and scale == pytest.approx(1 / math.sqrt(576)) and causal is False
    if layout == "page64":
        assert table.data_ptr() == paging[1].data_ptr() or torch.equal(table, paging[1]), "the bench's own pages"
    else:
        assert shared["flashmla_paging"][1].shape[0] == len(kv_lens), "pages of 64 laid out once per case"
    if fp8:
        meta_out = CALLS[0][1]
        assert meta_out[1:] == (q_len * heads, 1), "num_heads_per_head_k = q_len * heads, one KV head"
        assert metadata.shape == (NUM_SM_PARTS, 8) and splits.shape == (len(kv_lens) + 1,)
        assert args[9].shape == (1,) and args[10].shape == (1,)
        assert args[9].item() == pytest.approx(q.abs().amax().float().item() / 448, rel=1e-2)
    else:
        assert metadata is not None and splits is not None, "the plan's metadata is passed back"
    assert out.shape == (q.shape[0], heads, 512) and out.dtype == torch.bfloat16
    assert torch.equal(out, out2)
    ref = ref_fn()
    assert torch.isfinite(out).all(), "a NaN slot was read: the block table points at the wrong pages"
    assert ((out.float() - ref).norm() / ref.norm()).item() < (2e-2 if fp8 else 1e-2)
    if fp8:  # the a8w8 reference (fp8 Q and KV) is what FlashMLA's fp8 kernel computes, not the bf16 one
        exact, _ = mla_decode_reference(q, kv_data["bf16"], qo_indptr, kv_indptr)
        assert ((ref - exact).norm() / exact.norm()).item() < 0.1


def test_ragged_query_lengths_are_refused(fake_flashmla):
    data = make_ragged_inputs([5, 9], [1, 2], num_heads=16, device="cpu")
    with pytest.raises(ValueError, match="one q_len for every sequence"):
        peers.peer_callable(flashmla_peer("flashmla-bf16"), data, 16, reference_fns(data))


def cpu_timer(fn, *, reps, warmup, flush):
    for _ in range(warmup + reps):
        fn()
    return [1.0] * reps


def test_bench_peers_times_and_checks_both(monkeypatch, fake_flashmla):
    monkeypatch.setattr(timing, "time_call_us", cpu_timer)
    found = [p for p in peers.setup_peers("cpu") if p.reason is None]
    args = argparse.Namespace(q_len=1, heads=16, reps=3, check=True)
    b = measure.Bench(args=args, spec=None, device="cpu", flush=None, ceiling_gbps=1000.0, peers=found)
    case = Case("ragged3", (5, 40, 170))
    data = make_ragged_inputs(list(case.kv_lens), 1, num_heads=16, device="cpu")
    rows = measure.bench_peers(b, case, data, reference_fns(data))
    assert [r["impl"] for r in rows] == ["flashmla-bf16", "flashmla-fp8"]
    for row in rows:
        assert "error" not in row and row["check_ok"], row
    assert rows[1]["bytes_read"] == bytes_moved(case.batch, case.mean_kv_len, 1, 16, "a8w8")
    assert names().count("dense_decode_fwd") == 1 + 1 + timing.WARMUP_CALLS + 3  # plan, check, warm-up, reps
    assert timed_impls(rows + [{"impl": "bf16", "kind": "mode", "time_us": 1.0},
                               {"impl": "a8w8", "kind": "mode", "time_us": 1.0}], ("mode", "peer")) == [
        "bf16", "flashmla-bf16", "a8w8", "flashmla-fp8"], "each FlashMLA kernel beside the modes it compares with"
