"""MLA decode (DeepSeek absorbed form) as a torch-callable op: the public call. It reads as validate
(``mla.validate``) -> plan (``mla.plan``, for many calls over one batch layout) -> launch (``mla.launch``); the
harness entry point is in ``mla.harness``. Importing it also registers the torch.library ops (``mla.ops``).

Example (H200)::

    import torch, mla.decode
    q = torch.randn(4, 16, 576, dtype=torch.bfloat16, device="cuda")             # 4 sequences, 1 query token each
    kv = torch.randn(4 * 1024, 1, 576, dtype=torch.bfloat16, device="cuda")      # 1024 cached tokens each
    qo_indptr = torch.arange(5, dtype=torch.int32, device="cuda")
    kv_indptr = torch.arange(5, dtype=torch.int32, device="cuda") * 1024
    out = mla.decode.mla_decode(q, kv, qo_indptr, kv_indptr)                    # (4, 16, 512) bf16
"""

from __future__ import annotations

import torch

from mla import jit, launch, ops  # noqa: F401 - ops: registers torch.ops.mla.decode / decode_out; jit: tests patch it
from mla.constants import DEFAULT_SM_SCALE
from mla.harness import CUSTOM_KERNEL_FORMAT, custom_kernel, harness_cache, page_size_of, run_harness
from mla.launch import Launch
from mla.plan import DecodePlan, plan
from mla.validate import (SUPPORTED_HEADS, SUPPORTED_PAGE_SIZES, KVFormat, QFormat, check_call, check_sm_scale,
                          validate_index_values)

__all__ = ["mla_decode", "plan", "DecodePlan", "custom_kernel", "run_harness", "harness_cache", "page_size_of",
           "validate_index_values", "CUSTOM_KERNEL_FORMAT", "DEFAULT_SM_SCALE", "SUPPORTED_HEADS",
           "SUPPORTED_PAGE_SIZES"]

MAX_SIGNATURES = 4096  # call signatures kept; all are dropped when full (a new batch size costs one slow call)
_LAUNCHES: dict = {}  # call signature -> Launch


def mla_decode(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    qo_indptr: torch.Tensor,
    kv_indptr: torch.Tensor,
    *,
    kv_scale: torch.Tensor | None = None,
    kv_block_scale: torch.Tensor | None = None,
    kv_format: KVFormat | None = None,
    q_format: QFormat = "bf16",
    q_scale: torch.Tensor | None = None,
    sm_scale: float | None = None,
    causal: bool = False,
    page_table: torch.Tensor | None = None,
    num_splits: int | None = None,
    out: torch.Tensor | None = None,
    lse: torch.Tensor | None = None,
    return_lse: bool = False,
    config_overrides: dict | None = None,
    check_inputs: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Multi-head latent attention, decode phase, over a ragged batch.

    Args:
      q: (total_q, H, 576) bf16, H in {16, 32, 64, 128}; the queries of sequence b are rows
        ``qo_indptr[b]:qo_indptr[b+1]``. Or fp8 codes (the target's fp8 flavour) with ``q_scale``.
      kv_cache: the latent cache, one row per token; sequence b owns rows ``kv_indptr[b]:kv_indptr[b+1]``.
        All 576 dims are keys; the first 512 are also the values. Formats (inferred from the dtype unless
        ``kv_format`` is given):
          "bf16":  (total_kv, 1, 576) bfloat16.
          "fp8":   (total_kv, 1, 576) float8_e4m3fn (float8_e4m3fnuz on gfx942) + ``kv_scale``;
                   value = code * kv_scale.
          "mxfp4": (total_kv, 1, 288) uint8 (or float4_e2m1fn_x2), two e2m1 codes per byte, low nibble = even
                   element, + ``kv_block_scale``; value = code * 2^(scale - 127).
      qo_indptr, kv_indptr: (batch + 1,) int32 on the same device, non-decreasing, starting at 0.
      kv_scale: (1,) float32 per-tensor scale of an fp8 cache.
      kv_block_scale: (total_kv, >= 18) uint8 (or float8_e8m0fnu) e8m0 scales of an mxfp4 cache, one per 32
        elements; only the first 18 columns are read, so rows padded to 24 (or any row stride) work.
      q_format: "fp8" quantizes bf16 Q to fp8 with one per-tensor scale (a8w8), bit-exact with the competition's
        reference quantizer: amax(|q|) is one reduction on the device, the rounding happens inside the kernel.
      q_scale: (1,) float32, only with Q given as fp8 codes.
      sm_scale: softmax scale, positive and finite; default 1/sqrt(576).
      causal: query i of a sequence with n queries and L tokens sees KV positions [0, L - n + i] (MTP); without
        it every query sees all L tokens.
      page_table: (batch, max_pages) int32, for a paged cache: token p of sequence b is slot p % page_size of page
        ``page_table[b, p // page_size]`` of a cache shaped (num_pages, page_size, 1, row) (a flat 3-D cache counts
        as page_size 1); mxfp4 scales are then (num_pages * page_size, >= 18) or (num_pages, page_size, >= 18).
        ``kv_indptr`` still gives each sequence's length (kv_indptr[b+1] - kv_indptr[b]).
      num_splits: KV splits per sequence (default: ``schedule.choose_num_splits``); 1 runs no combine kernel.
      out: optional (total_q, H, 512) bf16 output buffer. lse: optional (total_q, H) float32 buffer.
      return_lse: also return the log-sum-exp of the scaled scores, natural log, -inf where nothing is visible.
      check_inputs: check index values on the host (monotonic indptrs, ranges, page numbers): a device-to-host
        copy, so off by default and never inside CUDA-graph capture. Out-of-range values are otherwise not detected.
      config_overrides: for tuning only: ``DecodeKernelConfig`` fields (block_n, threads, stage_compressed, ...)
        that replace the schedule's choice.

    Returns ``out`` (total_q, H, 512) bf16, or ``(out, lse)`` when ``return_lse``. A sequence with no KV
    tokens gets zeros. No host-device synchronisation: the call can be captured in a CUDA graph. For many calls
    over one batch layout (every layer of a step), ``plan(...)`` once and ``DecodePlan.run`` is the same
    computation with the schedule taken from the exact lengths and the split workspace made once.

    Cost on the host: the checks above run when a call signature (dtypes, shapes, strides and devices of the
    tensors, the format options, ``causal``, ``num_splits``) is first seen, together with the kernel selection;
    a later call with the same signature looks it up, allocates its outputs and launches.
    """
    sm_scale = DEFAULT_SM_SCALE if sm_scale is None else check_sm_scale(sm_scale)
    # The call signature: everything the checks and the kernel selection depend on. Every check passed for a
    # signature that is cached, so equality with it stands in for them.
    try:
        key = (q.dtype, q.shape, q.device, q.is_contiguous(),
               kv_cache.dtype, kv_cache.shape, kv_cache.stride(), kv_cache.device,
               qo_indptr.dtype, qo_indptr.shape, qo_indptr.device, qo_indptr.is_contiguous(),
               kv_indptr.dtype, kv_indptr.shape, kv_indptr.device, kv_indptr.is_contiguous(),
               None if kv_scale is None else (kv_scale.dtype, kv_scale.shape, kv_scale.device),
               None if kv_block_scale is None else (kv_block_scale.dtype, kv_block_scale.shape,
                                                    kv_block_scale.stride(), kv_block_scale.device),
               None if q_scale is None else (q_scale.dtype, q_scale.shape, q_scale.device),
               None if page_table is None else (page_table.dtype, page_table.shape, page_table.device,
                                                page_table.is_contiguous()),
               None if out is None else (out.dtype, out.shape, out.device, out.is_contiguous()),
               None if lse is None else (lse.dtype, lse.shape, lse.device, lse.is_contiguous()),
               kv_format, q_format, causal, num_splits)
        found = None if config_overrides else _LAUNCHES.get(key)
    except (AttributeError, TypeError):  # not a tensor, or an unhashable option: the checks say which argument
        key = found = None
    if found is None or found.forced_target is not None and found.target_changed():
        found = _prepare(key, q, kv_cache, qo_indptr, kv_indptr, kv_scale, kv_block_scale, kv_format, q_format,
                         q_scale, causal, page_table, num_splits, out, lse, config_overrides)
    if check_inputs:
        validate_index_values(qo_indptr, kv_indptr, found.cache_rows, found.total_q, page_table, found.page_size)
    return found.run(q, kv_cache, qo_indptr, kv_indptr, page_table, kv_scale, kv_block_scale, q_scale, sm_scale, out,
                     lse, return_lse)


def _prepare(key, q, kv_cache, qo_indptr, kv_indptr, kv_scale, kv_block_scale, kv_format, q_format, q_scale, causal,
             page_table, num_splits, out, lse, config_overrides) -> Launch:
    """The slow path, once per call signature: every check (raising naming the argument), the kernel selection,
    the launch prepared; cached under ``key`` (not with ``config_overrides``, a tuning-only dict)."""
    call = check_call(q, kv_cache, qo_indptr, kv_indptr, kv_scale, kv_block_scale, kv_format, q_format, q_scale,
                      page_table=page_table, out=out, lse=lse, num_splits=num_splits)
    overrides = tuple(sorted(config_overrides.items())) if config_overrides else ()
    prepared = Launch(call, causal=bool(causal), num_splits=num_splits, total_kv=call.cache_rows, overrides=overrides)
    if key is not None and not overrides:
        if len(_LAUNCHES) >= MAX_SIGNATURES:
            _LAUNCHES.clear()
        _LAUNCHES[key] = prepared
    return prepared


def clear_caches() -> None:
    """Forget every prepared call signature and kernel selection (for tests that replace ``jit.get_launcher``).
    Plans keep their own prepared runs."""
    _LAUNCHES.clear()
    launch.clear_caches()
