"""Bad input raises a clear error naming the argument, before any kernel runs (CPU: the target is forced)."""

import pytest
import torch

from mla.decode import mla_decode


@pytest.fixture(autouse=True)
def forced_target(monkeypatch):
    monkeypatch.setenv("MLA_TARGET", "sm_90a")


def good_inputs(batch=3, kv_len=5):
    q = torch.randn(batch, 16, 576).bfloat16()
    kv = torch.randn(batch * kv_len, 1, 576).bfloat16()
    qo = torch.arange(batch + 1, dtype=torch.int32)
    kvp = torch.arange(batch + 1, dtype=torch.int32) * kv_len
    return q, kv, qo, kvp


def fp8_cache(batch=3, kv_len=5, dtype=torch.float8_e4m3fn):
    return torch.randn(batch * kv_len, 1, 576).to(dtype), torch.ones(1)


def mxfp4_cache(batch=3, kv_len=5, scale_cols=18):
    total = batch * kv_len
    return torch.randint(0, 256, (total, 1, 288), dtype=torch.uint8), torch.full((total, scale_cols), 127, dtype=torch.uint8)


def call(**overrides):
    q, kv, qo, kvp = good_inputs()
    args = {"q": q, "kv_cache": kv, "qo_indptr": qo, "kv_indptr": kvp}
    args.update(overrides)
    return mla_decode(args.pop("q"), args.pop("kv_cache"), args.pop("qo_indptr"), args.pop("kv_indptr"), **args)


CASES = [
    ("q wrong dtype", dict(q=torch.randn(3, 16, 576)), TypeError, "q: expected dtype"),
    ("q wrong rank", dict(q=torch.randn(3, 16 * 576).bfloat16()), ValueError, "q: expected 3 dims"),
    ("q head dim", dict(q=torch.randn(3, 16, 512).bfloat16()), ValueError, "q: expected last dim 576"),
    ("q head count", dict(q=torch.randn(3, 8, 576).bfloat16()), ValueError, "heads"),
    ("q not contiguous", dict(q=torch.randn(16, 3, 576).bfloat16().transpose(0, 1)), ValueError, "q: expected a contiguous"),
    ("indptr dtype", dict(kv_indptr=torch.arange(4) * 5), TypeError, "kv_indptr: expected dtype"),
    ("indptr rank", dict(qo_indptr=torch.zeros(2, 2, dtype=torch.int32)), ValueError, "qo_indptr: expected 1 dims"),
    ("indptr lengths", dict(qo_indptr=torch.arange(3, dtype=torch.int32)), ValueError, "qo_indptr and kv_indptr"),
    ("kv dtype", dict(kv_cache=torch.randn(15, 1, 576)), TypeError, "kv_cache: expected bf16, fp8"),
    ("kv shape", dict(kv_cache=torch.randn(15, 576).bfloat16()), ValueError, "kv_cache: expected shape (total_kv, 1, 576)"),
    ("kv heads", dict(kv_cache=torch.randn(15, 2, 576).bfloat16()), ValueError, "kv_cache: expected shape"),
    ("kv strided", dict(kv_cache=torch.randn(15, 1, 1152).bfloat16()[..., :576]), ValueError, "kv_cache: expected contiguous rows"),
    ("format mismatch", dict(kv_format="fp8"), ValueError, "kv_format='fp8' does not match"),
    ("fp8 without scale", dict(kv_cache=fp8_cache()[0]), ValueError, "kv_scale: required"),
    ("fp8 scale dtype", dict(kv_cache=fp8_cache()[0], kv_scale=torch.ones(1, dtype=torch.float64)), TypeError, "kv_scale: expected a (1,) float32"),
    ("fp8 scale as float", dict(kv_cache=fp8_cache()[0], kv_scale=1.0), TypeError, "kv_scale: expected a (1,) float32"),
    ("fnuz on NVIDIA", dict(kv_cache=fp8_cache(dtype=torch.float8_e4m3fnuz)[0], kv_scale=torch.ones(1)), TypeError, "not the fp8 flavour"),
    ("scale for bf16", dict(kv_scale=torch.ones(1)), ValueError, "kv_scale is only for an fp8 cache"),
    ("mxfp4 without scales", dict(kv_cache=mxfp4_cache()[0]), ValueError, "kv_block_scale: required"),
    ("mxfp4 too few scales", dict(kv_cache=mxfp4_cache()[0], kv_block_scale=mxfp4_cache(scale_cols=16)[1]), ValueError, "kv_block_scale: expected shape"),
    ("mxfp4 scale rows", dict(kv_cache=mxfp4_cache()[0], kv_block_scale=mxfp4_cache(batch=2)[1]), ValueError, "kv_block_scale: expected shape"),
    ("mxfp4 scale dtype", dict(kv_cache=mxfp4_cache()[0], kv_block_scale=torch.ones(15, 18)), TypeError, "kv_block_scale: expected uint8"),
    ("mxfp4 wrong row", dict(kv_cache=torch.zeros(15, 1, 576, dtype=torch.uint8), kv_block_scale=mxfp4_cache()[1]), ValueError, "kv_cache: expected shape (total_kv, 1, 288)"),
    ("q_format", dict(q_format="int8"), ValueError, "q_format must be"),
    ("num_splits", dict(num_splits=0), ValueError, "num_splits must be a positive int"),
    ("out shape", dict(out=torch.empty(3, 16, 576, dtype=torch.bfloat16)), ValueError, "out: expected"),
    ("lse dtype", dict(lse=torch.empty(3, 16, dtype=torch.bfloat16)), ValueError, "lse: expected"),
]


@pytest.mark.parametrize("overrides,error,message", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input_raises_naming_the_argument(overrides, error, message):
    with pytest.raises(error, match=None) as info:
        call(**overrides)
    assert message in str(info.value), f"message {str(info.value)!r} lacks {message!r}"


def test_cpu_tensors_without_forced_target(monkeypatch):
    monkeypatch.delenv("MLA_TARGET")
    with pytest.raises(ValueError, match="q: expected a CUDA/ROCm tensor"):
        call()


def test_non_tensor_argument():
    with pytest.raises(TypeError, match="q: expected a torch.Tensor"):
        call(q=[[1.0]])
