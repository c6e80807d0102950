"""The op's boundary: every check of a call's arguments, each raising ValueError / TypeError that names the
argument and what was expected.

``check_call`` runs the checks that need no device data (dtypes, devices, shapes, strides, format / scale pairing,
caller buffers) and returns what they establish as a ``CallSpec``: static facts only, no tensors, so the op can
cache it per call signature and skip every check on the next call with the same signature (``mla.decode``).
``validate_index_values`` checks index *values*; it needs a device-to-host copy, so the op runs it only when asked.
"""

from __future__ import annotations

import math
from typing import Literal, NamedTuple

import torch

from mla.constants import KV_LORA_RANK, QK_DIM
from mla.target import TargetSpec, spec_for_device
from tl_kernels.mla_decode import MXFP4_SCALES_PER_TOKEN

SUPPORTED_HEADS = (16, 32, 64, 128)
SUPPORTED_PAGE_SIZES = (1, 16, 32, 64, 128)
KVFormat = Literal["bf16", "fp8", "mxfp4"]
QFormat = Literal["bf16", "fp8"]
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e4m3fnuz)
PACKED_FP4_DTYPES = tuple(d for d in (torch.uint8, getattr(torch, "float4_e2m1fn_x2", None)) if d is not None)
E8M0_DTYPES = tuple(d for d in (torch.uint8, getattr(torch, "float8_e8m0fnu", None)) if d is not None)


class CallSpec(NamedTuple):
    """What the checks of one call establish: the problem as the kernels see it, and how to view the caller's
    tensors as the kernels take them. A function of the arguments' dtypes, shapes, strides and devices only."""

    spec: TargetSpec
    device: torch.device
    kv_format: str
    kernel_q_format: str  # "bf16", "fp8" (bf16 Q quantized inside the kernel: a8w8) or "fp8_codes"
    page_size: int  # 0: flat cache; else tokens per page (1 for a flat cache read through a page table)
    cache_rows: int
    row: int  # elements per cache row as the kernel reads them (576, or 288 packed mxfp4 bytes)
    kv_as_uint8: bool  # the cache's dtype (float4_e2m1fn_x2) is viewed as uint8 first
    block_scale_len: int  # mxfp4: elements of the flat uint8 view of the block scales; 0 for other formats
    block_scale_as_uint8: bool  # the block scales' dtype (float8_e8m0fnu) is viewed as uint8 first
    scale_stride: int  # mxfp4: row stride of the block scales
    reshape_q_scale: bool  # q_scale / kv_scale is not (1,) yet (e.g. 0-d): reshaped per call
    reshape_kv_scale: bool
    batch: int
    total_q: int
    num_heads: int


def check_call(q, kv_cache, qo_indptr, kv_indptr, kv_scale, kv_block_scale, kv_format, q_format, q_scale, *,
               page_table=None, paged=None, out=None, lse=None, num_splits=None) -> CallSpec:
    """Every check of ``mla_decode``'s arguments that needs no device data; raises naming the argument.
    ``paged``: read the cache through a page table (default: whether ``page_table`` is given; a plan passes it,
    holding the table itself)."""
    check_tensor("q", q, (torch.bfloat16, *FP8_DTYPES), 3)
    device = q.device
    spec = spec_for_device(device)  # validates the device too (CUDA/ROCm, or $MLA_TARGET for lowering-only use)
    total_q, num_heads, q_dim = q.shape
    if q_dim != QK_DIM:
        raise ValueError(f"q: expected last dim {QK_DIM} (512 latent + 64 rope), got shape {tuple(q.shape)}")
    if num_heads not in SUPPORTED_HEADS:
        raise ValueError(f"q: expected {SUPPORTED_HEADS} heads (dim 1), got {num_heads}")
    check_indptr("qo_indptr", qo_indptr, device)
    check_indptr("kv_indptr", kv_indptr, device)
    if qo_indptr.shape != kv_indptr.shape:
        raise ValueError(
            f"qo_indptr and kv_indptr must both be (batch + 1,), got {tuple(qo_indptr.shape)} and {tuple(kv_indptr.shape)}"
        )
    batch = qo_indptr.shape[0] - 1
    kv_format = infer_kv_format(kv_cache, kv_format)
    cache_rows, row, page_size = check_kv(kv_cache, kv_format, device, spec,
                                          paged=page_table is not None if paged is None else paged)
    reshape_kv_scale, block_len, block_u8, scale_stride = False, 0, False, MXFP4_SCALES_PER_TOKEN
    if kv_format == "fp8":
        reshape_kv_scale = check_scale("kv_scale", kv_scale, device)
    elif kv_scale is not None:
        raise ValueError(f"kv_scale is only for an fp8 cache; this cache is {kv_format}")
    if kv_format == "mxfp4":
        block_len, block_u8, scale_stride = check_block_scales(kv_block_scale, cache_rows, device)
    elif kv_block_scale is not None:
        raise ValueError(f"kv_block_scale is only for an mxfp4 cache; this cache is {kv_format}")

    # Q: bf16; fp8 codes + their per-tensor scale; or bf16 quantized to fp8 inside the kernel (a8w8) from amax(|q|).
    reshape_q_scale = False
    if q.dtype in FP8_DTYPES:
        if q.dtype != spec.fp8_torch_dtype:
            raise TypeError(f"q: {q.dtype} is not this target's fp8 flavour ({spec.name} reads {spec.fp8_torch_dtype})")
        reshape_q_scale, kernel_q_format = check_scale("q_scale", q_scale, device), "fp8_codes"
    elif q_scale is not None:
        raise ValueError("q_scale: pass it only with q given as fp8 codes; bf16 q is quantized inside the kernel")
    elif q_format in ("bf16", "fp8"):
        kernel_q_format = q_format
    else:
        raise ValueError(f"q_format must be 'bf16' or 'fp8', got {q_format!r}")
    if not q.is_contiguous():
        raise ValueError(f"q: expected a contiguous tensor, got strides {q.stride()}")
    check_num_splits(num_splits)
    if page_table is not None:
        check_page_table(page_table, batch, device)
    check_out_buffer("out", out, (total_q, num_heads, KV_LORA_RANK), torch.bfloat16, device)
    check_out_buffer("lse", lse, (total_q, num_heads), torch.float32, device)
    return CallSpec(spec, device, kv_format, kernel_q_format, page_size, cache_rows, row,
                    kv_cache.dtype != torch.uint8 and kv_format == "mxfp4", block_len, block_u8, scale_stride,
                    reshape_q_scale, reshape_kv_scale, batch, total_q, num_heads)


def check_sm_scale(sm_scale) -> float:
    """``sm_scale`` as a float: positive and finite (NaN, inf and <= 0 are ValueErrors)."""
    try:
        value = float(sm_scale)
    except (TypeError, ValueError):
        raise TypeError(f"sm_scale: expected a positive finite float, got {sm_scale!r}") from None
    if not 0.0 < value < math.inf:  # NaN fails both comparisons
        raise ValueError(f"sm_scale: expected a positive finite float, got {value}")
    return value


def check_tensor(name: str, t, dtypes: tuple, ndim: int) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in dtypes:
        raise TypeError(f"{name}: expected dtype in {[str(d) for d in dtypes]}, got {t.dtype}")
    if t.dim() != ndim:
        raise ValueError(f"{name}: expected {ndim} dims, got shape {tuple(t.shape)}")


def check_same_device(name: str, t: torch.Tensor, device: torch.device) -> None:
    if t.device != device:
        raise ValueError(f"{name}: expected device {device} (that of q), got {t.device}")


def check_indptr(name: str, t, device: torch.device) -> None:
    check_tensor(name, t, (torch.int32,), 1)
    check_same_device(name, t, device)
    if t.shape[0] < 1:
        raise ValueError(f"{name}: expected (batch + 1,) entries, got an empty tensor")
    if not t.is_contiguous():
        raise ValueError(f"{name}: expected a contiguous tensor")


def infer_kv_format(kv_cache, kv_format) -> str:
    if not isinstance(kv_cache, torch.Tensor):
        raise TypeError(f"kv_cache: expected a torch.Tensor, got {type(kv_cache).__name__}")
    inferred = (
        "bf16" if kv_cache.dtype == torch.bfloat16
        else "fp8" if kv_cache.dtype in FP8_DTYPES
        else "mxfp4" if kv_cache.dtype in PACKED_FP4_DTYPES
        else None
    )
    if inferred is None:
        raise TypeError(f"kv_cache: expected bf16, fp8 (e4m3) or packed mxfp4 (uint8) data, got {kv_cache.dtype}")
    if kv_format is not None and kv_format != inferred:
        raise ValueError(f"kv_format={kv_format!r} does not match kv_cache dtype {kv_cache.dtype} ({inferred})")
    return inferred


def check_kv(kv_cache: torch.Tensor, kv_format: str, device: torch.device, spec: TargetSpec, paged: bool):
    """Returns (cache rows, elements per row, tokens per page (0 for a flat cache)). The kernels read the cache as
    ``kv_cache.view(rows, row)``: this checks that the view exists."""
    row = QK_DIM // 2 if kv_format == "mxfp4" else QK_DIM
    if paged and kv_cache.dim() == 4:
        num_pages, page_size = kv_cache.shape[:2]
        if kv_cache.shape[2] != 1 or kv_cache.shape[3] != row:
            raise ValueError(
                f"kv_cache: expected shape (num_pages, page_size, 1, {row}) for a paged {kv_format} cache, "
                f"got {tuple(kv_cache.shape)}"
            )
        kv_cache = kv_cache.reshape(num_pages * page_size, 1, row) if kv_cache.is_contiguous() else kv_cache
        if page_size not in SUPPORTED_PAGE_SIZES:
            raise ValueError(f"kv_cache: page_size (dim 1) must be one of {SUPPORTED_PAGE_SIZES}, got {page_size}")
    else:
        page_size = 1 if paged else 0  # a flat cache with a page table is paged with one token per page
        if kv_cache.dim() != 3 or kv_cache.shape[1] != 1 or kv_cache.shape[2] != row:
            want = f"(total_kv, 1, {row}) or, with page_table, (num_pages, page_size, 1, {row})"
            raise ValueError(f"kv_cache: expected shape {want} for {kv_format}, got {tuple(kv_cache.shape)}")
    check_same_device("kv_cache", kv_cache, device)
    if kv_cache.dim() != 3 or kv_cache.stride(2) != 1 or kv_cache.stride(0) != row:
        raise ValueError(f"kv_cache: expected contiguous rows of {row} elements, got strides {kv_cache.stride()}")
    if kv_format == "fp8" and kv_cache.dtype != spec.fp8_torch_dtype:
        raise TypeError(
            f"kv_cache: {kv_cache.dtype} is not the fp8 flavour of {spec.name} ({spec.fp8_torch_dtype}); "
            "e4m3fn and e4m3fnuz codes differ, convert the cache instead of reinterpreting it"
        )
    return kv_cache.shape[0], row, page_size


def check_num_splits(num_splits) -> None:
    if num_splits is not None and (not isinstance(num_splits, int) or num_splits < 1):
        raise ValueError(f"num_splits must be a positive int, got {num_splits!r}")


def check_page_table(page_table, batch: int, device: torch.device) -> None:
    check_tensor("page_table", page_table, (torch.int32,), 2)
    check_same_device("page_table", page_table, device)
    if page_table.shape[0] != batch:
        raise ValueError(f"page_table: expected {batch} rows (one per sequence), got shape {tuple(page_table.shape)}")
    if not page_table.is_contiguous():
        raise ValueError("page_table: expected a contiguous tensor")


def check_scale(name: str, scale, device: torch.device) -> bool:
    """A per-tensor scale: one float32 element on the device. Returns whether it must be reshaped to (1,)."""
    if scale is None:
        raise ValueError(f"{name}: required (a (1,) float32 tensor on the device)")
    if not isinstance(scale, torch.Tensor) or scale.dtype != torch.float32 or scale.numel() != 1:
        what = f"{scale.dtype} tensor of shape {tuple(scale.shape)}" if isinstance(scale, torch.Tensor) else type(scale).__name__
        raise TypeError(f"{name}: expected a (1,) float32 tensor on the device, got {what}")
    check_same_device(name, scale, device)
    return tuple(scale.shape) != (1,)


def check_block_scales(scales, total_kv: int, device: torch.device) -> tuple[int, bool, int]:
    """mxfp4 scales, read in place as a flat uint8 view (padded rows are not copied). Returns (elements of that
    view, whether the dtype is viewed as uint8 first, row stride)."""
    if scales is None:
        raise ValueError("kv_block_scale: required for an mxfp4 cache ((total_kv, >= 18) uint8 e8m0 scales)")
    if not isinstance(scales, torch.Tensor) or scales.dtype not in E8M0_DTYPES:
        got = scales.dtype if isinstance(scales, torch.Tensor) else type(scales).__name__
        raise TypeError(f"kv_block_scale: expected uint8 or float8_e8m0fnu, got {got}")
    as_uint8 = scales.dtype != torch.uint8
    if scales.dim() == 3:  # (total_kv, 1, cols) or, paged, (num_pages, page_size, cols)
        scales = scales.flatten(0, 1)
    if scales.dim() != 2 or scales.shape[0] != total_kv or scales.shape[1] < MXFP4_SCALES_PER_TOKEN:
        raise ValueError(
            f"kv_block_scale: expected shape (total_kv={total_kv}, >= {MXFP4_SCALES_PER_TOKEN}), got {tuple(scales.shape)}"
        )
    check_same_device("kv_block_scale", scales, device)
    if scales.stride(1) != 1:
        raise ValueError(f"kv_block_scale: expected unit stride along a row, got strides {scales.stride()}")
    stride = scales.stride(0) if total_kv > 1 else MXFP4_SCALES_PER_TOKEN
    return max(total_kv - 1, 0) * stride + MXFP4_SCALES_PER_TOKEN, as_uint8, stride


def check_out_buffer(name: str, buf, shape: tuple, dtype: torch.dtype, device: torch.device) -> None:
    if buf is None:
        return
    if not isinstance(buf, torch.Tensor) or buf.dtype != dtype or tuple(buf.shape) != shape:
        got = f"{buf.dtype} {tuple(buf.shape)}" if isinstance(buf, torch.Tensor) else type(buf).__name__
        raise ValueError(f"{name}: expected a {dtype} tensor of shape {shape}, got {got}")
    check_same_device(name, buf, device)
    if not buf.is_contiguous():
        raise ValueError(f"{name}: expected a contiguous tensor")


# --- index values: a device-to-host copy, only on request --------------------------------------------------------


def validate_index_values(qo_indptr, kv_indptr, cache_rows: int, total_q: int, page_table=None, page_size: int = 0) -> None:
    """Host-side checks of index *values* (they need a device-to-host copy, so the op runs them only when asked:
    ``mla_decode(..., check_inputs=True)``). Raises ValueError naming the argument."""
    qo, kvp = host_offsets("qo_indptr", qo_indptr), host_offsets("kv_indptr", kv_indptr)
    if qo[-1] != total_q:
        raise ValueError(f"qo_indptr: last offset {qo[-1]} must equal the number of rows of q ({total_q})")
    if page_table is None:
        if kvp[-1] > cache_rows:
            raise ValueError(f"kv_indptr: last offset {kvp[-1]} exceeds the cache's {cache_rows} rows")
        return
    num_pages = cache_rows // page_size
    table = page_table.tolist()
    for b, (lo, hi) in enumerate(zip(kvp, kvp[1:])):
        used = -(-(hi - lo) // page_size)
        if used > len(table[b]):
            raise ValueError(f"page_table: sequence {b} has {hi - lo} tokens, more than {len(table[b])} pages hold")
        bad = [p for p in table[b][:used] if not 0 <= p < num_pages]
        if bad:
            raise ValueError(f"page_table: sequence {b} uses page {bad[0]}, outside [0, {num_pages})")


def host_offsets(name: str, offsets) -> list[int]:
    """(batch + 1,) offsets as a host list of ints, checked: non-decreasing from 0."""
    if isinstance(offsets, torch.Tensor):
        if offsets.dim() != 1 or offsets.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"{name}: expected a 1-D int32/int64 tensor, got {offsets.dtype} of shape {tuple(offsets.shape)}")
        values = offsets.tolist()
    elif isinstance(offsets, (list, tuple, range)) and all(isinstance(v, int) for v in offsets):
        values = list(offsets)
    else:
        raise TypeError(f"{name}: expected a list of ints or an int tensor, got {type(offsets).__name__}")
    if not values:
        raise ValueError(f"{name}: expected (batch + 1,) entries, got none")
    if values[0] != 0 or any(b < a for a, b in zip(values, values[1:])):
        raise ValueError(f"{name}: expected non-decreasing offsets starting at 0, got {values[:8]}...")
    if values[-1] >= 2**31:
        raise ValueError(f"{name}: offsets must fit int32, got {values[-1]}")
    return values
