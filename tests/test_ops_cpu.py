"""mla.ops on the CPU: the torch.library registration, the fake (shape-only) implementations, tracing by
torch.compile(fullgraph=True), and the forwarding of every argument to mla.decode.mla_decode.

No GPU here: shapes are checked with fake CUDA tensors (FakeTensorMode) and meta tensors; the real
implementation is exercised with ``mla.decode`` replaced by a stub that records its arguments (the kernels
themselves are tested on the GPU in test_serving_gpu.py).
"""

import subprocess
import sys

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

from mla.ops import mla_decode  # registers the ops

HEADS = (16, 32, 64, 128)


def make_args(kv_format="bf16", *, total_q=5, heads=16, batch=3, total_kv=100, device="cuda", q_fp8=False):
    """Arguments of mla_decode as empty tensors (contents never read by the fake implementation)."""
    q_dtype = torch.float8_e4m3fn if q_fp8 else torch.bfloat16
    q = torch.empty(total_q, heads, 576, dtype=q_dtype, device=device)
    qo = torch.zeros(batch + 1, dtype=torch.int32, device=device)
    kvp = torch.zeros(batch + 1, dtype=torch.int32, device=device)
    kw = {}
    if q_fp8:
        kw["q_scale"] = torch.ones(1, dtype=torch.float32, device=device)
    if kv_format == "bf16":
        kv = torch.empty(total_kv, 1, 576, dtype=torch.bfloat16, device=device)
    elif kv_format == "fp8":
        kv = torch.empty(total_kv, 1, 576, dtype=torch.float8_e4m3fn, device=device)
        kw["kv_scale"] = torch.ones(1, dtype=torch.float32, device=device)
    else:
        kv = torch.empty(total_kv, 1, 288, dtype=torch.uint8, device=device)
        # Padded scale rows (stride 24), as some caches store them (empty_strided: fake CUDA tensors cannot be sliced
        # without a CUDA build).
        kw["kv_block_scale"] = torch.empty_strided((total_kv, 18), (24, 1), dtype=torch.uint8, device=device)
    return (q, kv, qo, kvp), kw


# --- registration -----------------------------------------------------------------------------------------


def test_schemas():
    decode = str(torch.ops.mla.decode.default._schema)
    assert decode == (
        "mla::decode(Tensor q, Tensor kv_cache, Tensor qo_indptr, Tensor kv_indptr, Tensor? kv_scale, "
        "Tensor? kv_block_scale, Tensor? q_scale, Tensor? page_table, str? kv_format, str q_format, float? sm_scale, bool causal, "
        "SymInt num_splits) -> (Tensor, Tensor)"
    ), decode
    decode_out = torch.ops.mla.decode_out.default._schema
    mutated = [a.name for a in decode_out.arguments if a.alias_info is not None and a.alias_info.is_write]
    assert mutated == ["out", "lse"], str(decode_out)
    assert len(decode_out.returns) == 0, str(decode_out)
    assert all(a.alias_info is None for a in torch.ops.mla.decode.default._schema.arguments), "decode must be functional"


def test_registration_needs_no_tilelang_or_cuda_and_survives_reimport():
    code = (
        "import importlib, sys, torch\n"
        "import mla.ops\n"
        "importlib.reload(mla.ops)\n"  # runs the registration code again: must reuse the registered ops
        "importlib.reload(mla.ops)\n"
        "assert 'tilelang' not in sys.modules and 'mla.decode' not in sys.modules, sorted(sys.modules)\n"
        "assert not torch.cuda.is_initialized()\n"
        "print(torch.ops.mla.decode.default, torch.ops.mla.decode_out.default)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "mla.decode.default mla.decode_out.default" in result.stdout


# --- fake implementation: output shapes and dtypes without data ---------------------------------------------


@pytest.mark.parametrize("kv_format", ["bf16", "fp8", "mxfp4"])
@pytest.mark.parametrize("heads", HEADS)
def test_fake_outputs_on_fake_cuda_tensors(kv_format, heads):
    with FakeTensorMode():
        args, kw = make_args(kv_format, heads=heads, total_q=7)
        out, lse = torch.ops.mla.decode(*args, kw.get("kv_scale"), kw.get("kv_block_scale"), None, None, None,
                                         "bf16", None, True, 0)
        assert isinstance(out, FakeTensor) and isinstance(lse, FakeTensor)
        assert out.shape == (7, heads, 512) and out.dtype == torch.bfloat16 and out.device.type == "cuda"
        assert lse.shape == (7, heads) and lse.dtype == torch.float32 and lse.device.type == "cuda"
        assert out.is_contiguous() and lse.is_contiguous()


@pytest.mark.parametrize("q_fp8", [False, True])
def test_wrapper_under_fake_mode(q_fp8):
    with FakeTensorMode():
        args, kw = make_args("fp8", heads=32, total_q=9, q_fp8=q_fp8)
        q_format = "bf16" if q_fp8 else "fp8"  # fp8 codes carry their own q_scale; bf16 Q is quantized (a8w8)
        out = mla_decode(*args, q_format=q_format, **kw)
        assert out.shape == (9, 32, 512) and out.dtype == torch.bfloat16
        out, lse = mla_decode(*args, q_format=q_format, return_lse=True, num_splits=3, sm_scale=0.1, **kw)
        assert (out.shape, lse.shape, lse.dtype) == ((9, 32, 512), (9, 32), torch.float32)
        # Caller buffers come back as the very same tensors; a missing one of the two is allocated.
        buf_out = torch.empty(9, 32, 512, dtype=torch.bfloat16, device="cuda")
        buf_lse = torch.empty(9, 32, dtype=torch.float32, device="cuda")
        res_out, res_lse = mla_decode(*args, q_format=q_format, out=buf_out, lse=buf_lse, return_lse=True, **kw)
        assert res_out is buf_out and res_lse is buf_lse
        assert mla_decode(*args, q_format=q_format, out=buf_out, **kw) is buf_out
        res_out, res_lse = mla_decode(*args, q_format=q_format, lse=buf_lse, return_lse=True, **kw)
        assert res_lse is buf_lse and res_out.shape == (9, 32, 512)


def test_fake_rejects_bad_shapes():
    with FakeTensorMode():
        (q, kv, qo, kvp), _ = make_args()
        with pytest.raises(Exception, match="q: expected"):
            bad_q = torch.empty(5, 16, 512, dtype=torch.bfloat16, device="cuda")
            torch.ops.mla.decode(bad_q, kv, qo, kvp, None, None, None, None, None, "bf16", None, False, 0)
        bad_out = torch.empty(5, 16, 576, dtype=torch.bfloat16, device="cuda")
        lse = torch.empty(5, 16, dtype=torch.float32, device="cuda")
        with pytest.raises(Exception, match="out: expected"):
            torch.ops.mla.decode_out(q, kv, qo, kvp, None, None, None, None, None, "bf16", None, False, 0, bad_out, lse)


def test_zero_queries():
    with FakeTensorMode():
        args, _ = make_args(total_q=0, heads=64)
        out, lse = mla_decode(*args, return_lse=True)
        assert out.shape == (0, 64, 512) and lse.shape == (0, 64)


# --- torch.compile: the wrapper traces into one graph holding the op -------------------------------------------


class GraphRecorder:
    """A torch.compile backend that keeps every FX graph it is given and runs it as is."""

    def __init__(self):
        self.graphs = []

    def __call__(self, gm, example_inputs):
        self.graphs.append(gm)
        return gm.forward

    def targets(self, i=-1):
        return [n.target for n in self.graphs[i].graph.nodes if n.op == "call_function"]


def test_compile_fullgraph_functional_on_meta():
    """Meta tensors run the fake implementation for real, so the compiled graph executes end to end."""
    rec = GraphRecorder()

    def step(q_nope, q_pe, kv, qo, kvp):
        q = torch.cat([q_nope, q_pe], dim=-1)  # the usual absorbed-MLA prologue
        out, lse = mla_decode(q, kv, qo, kvp, causal=True, return_lse=True, sm_scale=0.05)
        return out.float() * 2, lse

    compiled = torch.compile(step, fullgraph=True, backend=rec)
    (q, kv, qo, kvp), _ = make_args(total_q=6, heads=16, device="meta")
    out, lse = compiled(q[..., :512].contiguous(), q[..., 512:].contiguous(), kv, qo, kvp)
    assert out.shape == (6, 16, 512) and out.dtype == torch.float32 and lse.shape == (6, 16)
    assert len(rec.graphs) == 1
    assert torch.ops.mla.decode.default in rec.targets() or torch.ops.mla.decode in rec.targets(), rec.graphs[0].code


def test_compile_fullgraph_out_buffers_on_meta():
    rec = GraphRecorder()

    def step(q, kv, scale, qo, kvp, out, lse):
        return mla_decode(q, kv, qo, kvp, kv_scale=scale, out=out, lse=lse, return_lse=True)

    compiled = torch.compile(step, fullgraph=True, backend=rec)
    (q, kv, qo, kvp), kw = make_args("fp8", total_q=4, heads=128, device="meta")
    out = torch.empty(4, 128, 512, dtype=torch.bfloat16, device="meta")
    lse = torch.empty(4, 128, dtype=torch.float32, device="meta")
    res_out, res_lse = compiled(q, kv, kw["kv_scale"], qo, kvp, out, lse)
    assert res_out.shape == out.shape and res_lse.shape == lse.shape
    assert torch.ops.mla.decode_out.default in rec.targets() or torch.ops.mla.decode_out in rec.targets()


@pytest.mark.parametrize("out_buffers", [False, True])
def test_compile_aot_eager_functionalizes(out_buffers):
    """aot_eager runs AOTAutograd (functionalization: decode_out becomes auto_functionalized) on the fake
    implementation, then executes the result on meta tensors."""

    def step(q, kv, qo, kvp, out, lse):
        if out_buffers:
            return mla_decode(q, kv, qo, kvp, out=out, lse=lse, return_lse=True)
        return mla_decode(q, kv, qo, kvp, return_lse=True)

    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    (q, kv, qo, kvp), _ = make_args(total_q=3, heads=64, device="meta")
    out = torch.empty(3, 64, 512, dtype=torch.bfloat16, device="meta")
    lse = torch.empty(3, 64, dtype=torch.float32, device="meta")
    res_out, res_lse = compiled(q, kv, qo, kvp, out, lse)
    assert res_out.shape == (3, 64, 512) and res_lse.shape == (3, 64)


def test_compile_dynamic_batch_one_graph():
    """With dynamic shapes one graph serves every token count (the fake implementation is symbolic)."""
    rec = GraphRecorder()
    torch._dynamo.reset()
    compiled = torch.compile(lambda q, kv, qo, kvp: mla_decode(q, kv, qo, kvp), fullgraph=True, dynamic=True, backend=rec)
    for total_q, batch in ((5, 3), (17, 9), (64, 64)):
        (q, kv, qo, kvp), _ = make_args(total_q=total_q, batch=batch, total_kv=10 * batch, device="meta")
        assert compiled(q, kv, qo, kvp).shape == (total_q, 16, 512)
    assert len(rec.graphs) == 1, f"recompiled: {len(rec.graphs)} graphs"


# --- the real implementation forwards every argument to mla.decode.mla_decode ----------------------------------


class DecodeStub:
    """Stands in for mla.decode.mla_decode on CPU tensors: records its call, writes deterministic outputs
    (a function of q only) the way the real op does (fresh tensors, or the caller's buffers)."""

    def __init__(self):
        self.calls = []

    def __call__(self, q, kv_cache, qo_indptr, kv_indptr, **kw):
        self.calls.append(kw)
        total_q, heads, _ = q.shape
        value = q.float()[..., :512]
        out, lse = kw.get("out"), kw.get("lse")
        out = torch.empty(total_q, heads, 512, dtype=torch.bfloat16) if out is None else out
        lse = torch.empty(total_q, heads, dtype=torch.float32) if lse is None else lse
        out.copy_(value)
        lse.copy_(value.sum(-1))
        return (out, lse) if kw.get("return_lse") else out


@pytest.fixture
def decode_stub(monkeypatch):
    stub = DecodeStub()
    import mla.launch  # the op's real implementation calls mla.launch.mla_decode

    monkeypatch.setattr(mla.launch, "mla_decode", stub)
    return stub


def cpu_args(kv_format="bf16"):
    args, kw = make_args(kv_format, total_q=4, heads=16, device="cpu")
    q = torch.randn(4, 16, 576).to(torch.bfloat16)
    return (q, *args[1:]), kw


def test_forwards_arguments_functional(decode_stub):
    (q, kv, qo, kvp), kw = cpu_args("mxfp4")
    out, lse = mla_decode(q, kv, qo, kvp, **kw, kv_format="mxfp4", sm_scale=0.125, causal=True, return_lse=True)
    (call,) = decode_stub.calls
    assert call["kv_block_scale"] is kw["kv_block_scale"] and call["kv_scale"] is None and call["q_scale"] is None
    assert call["kv_format"] == "mxfp4" and call["q_format"] == "bf16" and call["sm_scale"] == 0.125
    assert call["causal"] is True and call["num_splits"] is None and call["return_lse"] is True
    assert call["out"] is None and call["lse"] is None
    assert call["page_table"] is None, "no page table unless one is given"
    torch.testing.assert_close(out, q[..., :512])
    torch.testing.assert_close(lse, q.float()[..., :512].sum(-1))


def test_forwards_arguments_out_buffers(decode_stub):
    (q, kv, qo, kvp), kw = cpu_args("fp8")
    out = torch.full((4, 16, 512), float("nan"), dtype=torch.bfloat16)
    lse = torch.full((4, 16), float("nan"))
    res = mla_decode(q, kv, qo, kvp, **kw, q_format="fp8", num_splits=5, out=out, lse=lse)
    assert res is out
    (call,) = decode_stub.calls
    assert call["out"] is out and call["lse"] is lse, "the caller's buffers must reach the kernel (no copies)"
    assert call["kv_scale"] is kw["kv_scale"] and call["q_format"] == "fp8" and call["num_splits"] == 5
    assert call["sm_scale"] is None and call["kv_format"] is None and call["causal"] is False
    torch.testing.assert_close(out, q[..., :512])
    torch.testing.assert_close(lse, q.float()[..., :512].sum(-1))


def test_forwards_page_table(decode_stub):
    (q, kv, qo, kvp), _ = cpu_args()
    paged_kv = kv.view(25, 4, 1, 576)  # (num_pages, page_size, 1, 576)
    table = torch.zeros(3, 9, dtype=torch.int32)
    mla_decode(q, paged_kv, qo, kvp, page_table=table)
    (call,) = decode_stub.calls
    assert call["page_table"] is table


def test_paged_cache_under_fake_mode():
    with FakeTensorMode():
        (q, _, qo, kvp), _ = make_args("mxfp4", total_q=6, heads=32)
        cache = torch.empty(10, 64, 1, 288, dtype=torch.uint8, device="cuda")
        scales = torch.empty(640, 18, dtype=torch.uint8, device="cuda")
        table = torch.empty(3, 4, dtype=torch.int32, device="cuda")
        out, lse = mla_decode(q, cache, qo, kvp, kv_block_scale=scales, page_table=table, causal=True, return_lse=True)
        assert out.shape == (6, 32, 512) and lse.shape == (6, 32)


def test_opcheck(decode_stub):
    """torch.library.opcheck: schema (mutation declared exactly), fake vs real outputs, AOT dispatch."""
    (q, kv, qo, kvp), _ = cpu_args()
    common = (q, kv, qo, kvp, None, None, None, None, None, "bf16", None, False, 0)
    torch.library.opcheck(torch.ops.mla.decode.default, common)
    out = torch.empty(4, 16, 512, dtype=torch.bfloat16)
    lse = torch.empty(4, 16, dtype=torch.float32)
    torch.library.opcheck(torch.ops.mla.decode_out.default, (*common, out, lse))
