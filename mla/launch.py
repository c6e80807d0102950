"""Launching: which compiled kernels a validated call runs (``kernels``: ``schedule.select_kernels``, compiled and
cached), and a ``Launch``, everything one call signature derives (kernels, split count, output and workspace shapes,
the views the kernels take, the constant arguments), made once so that a call only allocates its outputs and
launches.

Two launch forms, chosen by the decode config:
  - decode, then (when the KV is split) the combine kernel over fp32 partials:
      decode(q, kv_rows, block_scales, scale_stride, q_scale, kv_scale, qo_indptr, kv_indptr, [page_table], sm_scale,
             o_partial, lse_partial)  then  combine(o_partial, lse_partial, out, lse)
      (one split: decode(..., sm_scale, out, lse), no combine);
  - one launch when the config has ``fused_combine`` (the split combine inside the decode kernel):
      decode(q, kv_rows, block_scales, scale_stride, q_scale, kv_scale, qo_indptr, kv_indptr, [page_table], sm_scale,
             num_splits, o_partial, lse_partial, [semaphores], out, lse)
      with flat fp32 partials (1-element dummies for one split) and, for the families whose last CTA merges (the
      warp-specialised and 64-row kernels), zeroed int32 semaphores, at least batch * semaphores per sequence, that
      the kernel leaves at zero (``mla.workspace``). Hopper's 16/32/64-row decode kernel merges after a grid-wide
      barrier and takes none; its a8w8 variant (bf16 Q quantized inside) also reduces amax(|q|) itself, into the
      q_scale argument: a zeroed (1,) cell it leaves zero (``workspace.amax_cell``, or a plan's), so that call
      launches no reduction either.
"""

from __future__ import annotations

import functools
import math
import os
from typing import NamedTuple

import torch

from mla import jit, schedule, workspace
from mla.constants import DEFAULT_SM_SCALE, KV_LORA_RANK
from mla.target import TARGET_ENV
from mla.validate import CallSpec, KVFormat, QFormat, check_call, check_sm_scale, validate_index_values
from tl_kernels.mla_amax import AMAX_CTAS

_BF16, _FP32, _UINT8 = torch.bfloat16, torch.float32, torch.uint8
_INF = math.inf


class Kernels(NamedTuple):
    """What a problem runs: the decode config and launcher, the combine launcher (None: one split, or fused), the
    split count, and whether the decode kernel fuses the combine."""

    decode_cfg: object
    decode: object
    combine: object
    num_splits: int
    fused: bool
    amax: object = None  # a8w8 whose decode kernel reads amax(|q|): our reduction's launcher (None: torch's)


@functools.lru_cache(maxsize=4096)
def kernels(spec, kv_format, q_format, num_heads, causal, page_size, batch, total_q, total_kv, num_splits,
            overrides) -> Kernels:
    """``schedule.select_kernels`` for a problem, compiled (or loaded) now; cached, as serving repeats sizes.
    ``overrides`` may also hold ``amax_kernel`` (tuning: False gives a8w8 torch's amax reduction back)."""
    overrides = dict(overrides)
    amax_kernel = overrides.pop("amax_kernel", True)
    decode_cfg, combine_cfg, num_splits = schedule.select_kernels(
        spec, kv_format=kv_format, q_format=q_format, num_heads=num_heads, causal=causal, page_size=page_size,
        batch=batch, total_q=total_q, total_kv=total_kv, num_splits=num_splits, **overrides,
    )
    fused = bool(getattr(decode_cfg, "fused_combine", False))
    combine = None if combine_cfg is None or fused else jit.get_launcher(combine_cfg, spec)
    amax_cfg = schedule.amax_launch(spec, decode_cfg, q_format=q_format, num_heads=num_heads, amax_kernel=amax_kernel)
    amax = None if amax_cfg is None else jit.get_launcher(amax_cfg, spec)
    return Kernels(decode_cfg, jit.get_launcher(decode_cfg, spec), combine, num_splits, fused, amax)


class Workspace(NamedTuple):
    """The buffers a launch writes besides the output: the split partials (shaped for the two-kernel form, flat
    for the fused one; None without splits), an LSE for runs that return none, semaphores (None unless fused) and,
    for a8w8 from bf16 Q, amax(|q|) as the reduction writes it (0-d) and as the kernel reads it ((1,), same
    memory), the amax kernel's per-CTA partials (int32), and the zeroed (1,) cell of the kernels that reduce it
    themselves, which the amax kernel takes as its ticket (both leave it zero; a plan's; the eager call's is
    ``workspace.amax_cell``). A plan owns one (``DecodePlan``); an eager call takes views of its stream's scratch
    (``Launch.eager_workspace``)."""

    o_partial: torch.Tensor | None
    lse_partial: torch.Tensor | None
    o_partial_flat: torch.Tensor | None
    lse_partial_flat: torch.Tensor | None
    lse: torch.Tensor
    semaphores: torch.Tensor | None
    q_amax: torch.Tensor | None = None
    q_amax_arg: torch.Tensor | None = None
    amax_cell: torch.Tensor | None = None
    amax_partials: torch.Tensor | None = None


class Launch:
    """One call signature, prepared: ``run`` allocates the output (unless given) and launches; everything else it
    writes is in a workspace (a plan's, or views of the eager call's per-stream scratch). Nothing in it depends on
    tensor values."""

    __slots__ = ("device", "spec", "decode_cfg", "forced_target", "cache_rows", "total_q", "page_size", "decode", "combine", "num_splits",
                 "fused", "semaphore_count", "dummy_partials", "out_shape", "lse_shape", "scratch_numel",
                 "o_partial_view", "lse_partial_view", "unread_lse_offset", "amax_offset", "amax",
                 "kv_rows_shape", "kv_as_uint8", "amax_in_kernel", "block_scale_len", "block_scale_as_uint8",
                 "block_scales", "scale_stride", "q_mode", "q_scale", "reshape_q_scale", "kv_scale", "reshape_kv_scale", "paged")

    def __init__(self, call: CallSpec, *, causal: bool, num_splits: int | None, total_kv: int, overrides: tuple):
        device = call.device
        self.device = device
        # The target of a device that is no GPU comes from $MLA_TARGET (lowering-only use, tests): re-read per call.
        self.forced_target = None if device.type == "cuda" else os.environ.get(TARGET_ENV)
        self.cache_rows, self.total_q, self.page_size = call.cache_rows, call.total_q, call.page_size
        self.out_shape = (call.total_q, call.num_heads, KV_LORA_RANK)
        self.lse_shape = (call.total_q, call.num_heads)
        self.spec, self.decode_cfg = call.spec, None
        self.decode = self.combine = self.amax = None
        self.num_splits, self.fused, self.semaphore_count, self.amax_in_kernel = 1, False, 0, False
        if call.total_q and call.batch:  # else nothing to launch: the outputs are empty
            k = kernels(call.spec, call.kv_format, call.kernel_q_format, call.num_heads, causal, call.page_size,
                        call.batch, call.total_q, total_kv, num_splits, overrides)
            self.decode, self.combine, self.num_splits, self.fused = k.decode, k.combine, k.num_splits, k.fused
            self.decode_cfg = k.decode_cfg
            self.amax = k.amax
            # a8w8 with the merge fused: the kernel reduces amax(|q|) itself, into a zeroed cell (no reduction launch)
            self.amax_in_kernel = bool(getattr(k.decode_cfg, "amax_in_kernel", False))
            if k.fused:
                # Each family says its count per sequence (warp-specialised: head groups; 64-row: row tiles; the
                # 16/32/64-row decode kernel, whose merge waits at a grid barrier: none).
                self.semaphore_count = call.batch * k.decode_cfg.semaphores_per_seq
        # The fused kernels' partial arguments with one split (never read), made here: not inside a graph capture.
        self.dummy_partials = workspace.dummy_fp32(device) if self.fused and self.num_splits == 1 else None
        self.q_mode = call.kernel_q_format  # "bf16": unit scale; "fp8": amax(|q|) per call; "fp8_codes": caller's
        # The eager call's scratch (``workspace.scratch``, float32): o_partial, lse_partial (when split), the LSE
        # nobody reads, amax(|q|) (a8w8); each part starts at a multiple of 64 elements (256 B). The fused kernels
        # take the partials flat.
        rows = call.total_q * call.num_heads
        o_numel, lse_partial_numel = self.num_splits * rows * KV_LORA_RANK, self.num_splits * rows
        lse_partial_shape = (self.num_splits, *self.lse_shape)
        o_shape = (*lse_partial_shape, KV_LORA_RANK)
        if self.num_splits == 1:
            self.o_partial_view = self.lse_partial_view = None
            self.unread_lse_offset = 0
        elif self.fused:
            self.o_partial_view = ((o_numel,), (1,), 0)
            self.lse_partial_view = ((lse_partial_numel,), (1,), _aligned(o_numel))
            self.unread_lse_offset = _aligned(o_numel) + _aligned(lse_partial_numel)
        else:
            self.o_partial_view = (o_shape, _contiguous_strides(o_shape), 0)
            self.lse_partial_view = (lse_partial_shape, _contiguous_strides(lse_partial_shape), _aligned(o_numel))
            self.unread_lse_offset = _aligned(o_numel) + _aligned(lse_partial_numel)
        # a8w8: amax(|q|), then the amax kernel's partials (int32 in the float32 scratch)
        self.amax_offset = self.unread_lse_offset + _aligned(rows) if self.q_mode == "fp8" else None
        amax_numel = 1 + AMAX_CTAS if self.q_mode == "fp8" else 0
        self.scratch_numel = self.unread_lse_offset + _aligned(rows) + amax_numel
        self.kv_rows_shape = (call.cache_rows, call.row)
        self.kv_as_uint8 = call.kv_as_uint8
        self.block_scale_len, self.block_scale_as_uint8 = call.block_scale_len, call.block_scale_as_uint8
        self.scale_stride = call.scale_stride
        self.block_scales = None if call.block_scale_len else workspace.no_block_scales(device)
        self.q_scale = workspace.unit_scale(device) if self.q_mode == "bf16" else None
        self.reshape_q_scale = call.reshape_q_scale
        self.kv_scale = None if call.kv_format == "fp8" else workspace.unit_scale(device)
        self.reshape_kv_scale = call.reshape_kv_scale
        self.paged = bool(call.page_size)

    def target_changed(self) -> bool:
        """Whether $MLA_TARGET changed since this launch was made for a device that is no GPU (tests)."""
        return self.forced_target is not None and os.environ.get(TARGET_ENV) != self.forced_target

    def eager_workspace(self) -> Workspace:
        """The eager call's workspace: views of the current stream's scratch (``workspace.scratch``), made once per
        scratch buffer and launch and kept with the buffer; inside CUDA-graph capture, views of this call's own
        allocation (from the graph's pool). Semaphores are not in it (``workspace.semaphores``, per call)."""
        scratch = workspace.scratch(self.device, self.scratch_numel)
        if scratch is None:
            return self._views(torch.empty(self.scratch_numel, dtype=_FP32, device=self.device))
        views = scratch.views.get(self)
        if views is None:
            if len(scratch.views) >= workspace.SCRATCH_VIEWS:
                scratch.views.clear()
            views = scratch.views[self] = self._views(scratch.buffer)
        return views

    def _views(self, buf: torch.Tensor) -> Workspace:
        o_partial = lse_partial = o_flat = lse_flat = amax = amax_arg = partials = None
        if self.o_partial_view is not None:
            o_partial, lse_partial = buf.as_strided(*self.o_partial_view), buf.as_strided(*self.lse_partial_view)
            if self.fused:
                o_partial, lse_partial, o_flat, lse_flat = None, None, o_partial, lse_partial
        lse = buf.as_strided(self.lse_shape, (self.lse_shape[1], 1), self.unread_lse_offset)
        if self.amax_offset is not None:
            amax, amax_arg = buf.as_strided((), (), self.amax_offset), buf.as_strided((1,), (1,), self.amax_offset)
            partials = buf.as_strided((AMAX_CTAS,), (1,), self.amax_offset + 1).view(torch.int32)
        return Workspace(o_partial, lse_partial, o_flat, lse_flat, lse, None, amax, amax_arg, None, partials)

    def run(self, q, kv_cache, qo_indptr, kv_indptr, page_table, kv_scale, kv_block_scale, q_scale, sm_scale, out,
            lse, return_lse, ws: Workspace | None = None):
        """Launches the kernels on the caller's tensors; returns ``out`` or ``(out, lse)``. ``ws``: a plan's
        workspace; None: the eager call's (``eager_workspace``)."""
        # Sizes are passed unpacked: torch parses them ~0.4 us (empty) to ~0.8 us (view) faster than a tuple.
        if out is None:
            out = torch.empty(*self.out_shape, dtype=_BF16, device=self.device)
        eager = ws is None
        if eager:
            ws = self.eager_workspace()
        if lse is None:
            lse = torch.empty(*self.lse_shape, dtype=_FP32, device=self.device) if return_lse else ws.lse
        if self.decode is None:  # no query or no sequence: nothing to compute
            return (out, lse) if return_lse else out

        kv_rows = (kv_cache.view(_UINT8) if self.kv_as_uint8 else kv_cache).view(*self.kv_rows_shape)
        block_scales = self.block_scales
        if block_scales is None:
            block_scales = (kv_block_scale.view(_UINT8) if self.block_scale_as_uint8 else kv_block_scale
                            ).as_strided((self.block_scale_len,), (1,))
        q_mode = self.q_mode
        if q_mode == "bf16":
            q_scale = self.q_scale
        elif q_mode == "fp8" and self.amax_in_kernel:
            # a8w8, merge fused: the kernel reduces amax(|q|) into this zeroed cell and leaves it zero.
            q_scale = workspace.amax_cell(self.device) if eager else ws.amax_cell
        elif q_mode == "fp8":
            # a8w8: amax(|q|), one reduction on the device (no host sync), written into the workspace; the kernel
            # rounds Q with it. Only the fused-merge kernels reduce it themselves (above: they have a grid barrier;
            # without one every CTA would need the amax over all of Q before its first score). On CUDA the
            # reduction is ours (``tl_kernels.mla_amax``: one launch, its CTAs counted in the zeroed amax cell,
            # which it leaves zero). Elsewhere torch's (tools/host_cost.py --a8w8 measures the ways, host and GPU):
            # vector_norm(ord=inf, dtype=fp32) is ONE reduction kernel that reads bf16 and writes the fp32 amax (|x|
            # and the max are exact, so it equals q.abs().amax().float() bit for bit, NaN included), where
            # q.abs().amax().float() is three launches and two allocations; out= drops the output allocation and
            # the (1,) reshape.
            if self.amax is not None:
                ticket = workspace.amax_cell(self.device) if eager else ws.amax_cell
                self.amax(q, ws.q_amax_arg, ws.amax_partials, ticket)
            else:
                torch.linalg.vector_norm(q, ord=_INF, dtype=_FP32, out=ws.q_amax)
            q_scale = ws.q_amax_arg
        elif self.reshape_q_scale:
            q_scale = q_scale.reshape(1)
        if self.kv_scale is not None:
            kv_scale = self.kv_scale
        elif self.reshape_kv_scale:
            kv_scale = kv_scale.reshape(1)
        if self.paged:
            args = (q, kv_rows, block_scales, self.scale_stride, q_scale, kv_scale, qo_indptr, kv_indptr, page_table,
                    sm_scale)
        else:
            args = (q, kv_rows, block_scales, self.scale_stride, q_scale, kv_scale, qo_indptr, kv_indptr, sm_scale)
        if self.fused:
            # One launch: the split combine runs inside the decode kernel (see the module docstring).
            if self.num_splits == 1:
                o_partial = lse_partial = self.dummy_partials
            else:
                o_partial, lse_partial = ws.o_partial_flat, ws.lse_partial_flat
            if self.semaphore_count:
                semaphores = workspace.semaphores(self.device, self.semaphore_count) if eager else ws.semaphores
                self.decode(*args, self.num_splits, o_partial, lse_partial, semaphores, out, lse)
            else:
                self.decode(*args, self.num_splits, o_partial, lse_partial, out, lse)
        elif self.num_splits == 1:
            self.decode(*args, out, lse)
        else:
            self.decode(*args, ws.o_partial, ws.lse_partial)
            self.combine(ws.o_partial, ws.lse_partial, out, lse)
        return (out, lse) if return_lse else out


def _aligned(numel: int) -> int:
    return -(-numel // 64) * 64


def _contiguous_strides(shape: tuple) -> tuple:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= size
    return tuple(reversed(strides))


# --- the eager call: a Launch per call signature --------------------------------------------------------------


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
        reference quantizer: amax(|q|) is one reduction on the device (inside the kernel where the split merge is
        fused), the rounding happens inside the kernel.
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
    """Forget every prepared call signature and compiled-kernel selection (tests that replace
    ``jit.get_launcher``). Plans keep their own prepared runs."""
    _LAUNCHES.clear()
    kernels.cache_clear()
