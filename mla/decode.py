"""MLA decode (DeepSeek absorbed form) as a torch-callable op: validate, pick the kernel config, launch.

Example (H200)::

    import torch, mla.decode
    q = torch.randn(4, 16, 576, dtype=torch.bfloat16, device="cuda")             # 4 sequences, 1 query token each
    kv = torch.randn(4 * 1024, 1, 576, dtype=torch.bfloat16, device="cuda")      # 1024 cached tokens each
    qo_indptr = torch.arange(5, dtype=torch.int32, device="cuda")
    kv_indptr = torch.arange(5, dtype=torch.int32, device="cuda") * 1024
    out = mla.decode.mla_decode(q, kv, qo_indptr, kv_indptr)                    # (4, 16, 512) bf16
"""

from __future__ import annotations

import functools
import math
from typing import Literal, NamedTuple

import torch

from mla import formats, jit, schedule
from mla.constants import DEFAULT_SM_SCALE, KV_LORA_RANK, MODES, QK_DIM
from mla.target import TargetSpec, spec_for_device
from tl_kernels.mla_decode import MXFP4_SCALES_PER_TOKEN

SUPPORTED_HEADS = (16, 32, 64, 128)
SUPPORTED_PAGE_SIZES = (1, 16, 32, 64, 128)
KVFormat = Literal["bf16", "fp8", "mxfp4"]
QFormat = Literal["bf16", "fp8"]
_FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e4m3fnuz)
_PACKED_FP4_DTYPES = tuple(d for d in (torch.uint8, getattr(torch, "float4_e2m1fn_x2", None)) if d is not None)
_E8M0_DTYPES = tuple(d for d in (torch.uint8, getattr(torch, "float8_e8m0fnu", None)) if d is not None)


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
      sm_scale: softmax scale; default 1/sqrt(576).
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
    """
    call = _validate_call(q, kv_cache, qo_indptr, kv_indptr, kv_scale, kv_block_scale, kv_format, q_format, q_scale,
                          paged=page_table is not None)
    _check_num_splits(num_splits)
    sm_scale = DEFAULT_SM_SCALE if sm_scale is None else float(sm_scale)
    if page_table is not None:
        _check_page_table(page_table, call.batch, call.device)
    out, lse = _outputs(call, out, lse)
    if check_inputs:
        validate_index_values(qo_indptr, kv_indptr, call.cache_rows, call.total_q, page_table, call.page_size)
    if call.total_q == 0 or call.batch == 0:
        return (out, lse) if return_lse else out
    overrides = tuple(sorted(config_overrides.items())) if config_overrides else ()
    decode, combine, num_splits = _plan(
        call.spec, call.kv_format, call.kernel_q_format, call.num_heads, causal, call.page_size, call.batch,
        call.total_q, call.cache_rows, num_splits, overrides,
    )
    _launch(call, qo_indptr, kv_indptr, page_table, sm_scale, decode, combine, num_splits, out, lse)
    return (out, lse) if return_lse else out


class _Call(NamedTuple):
    """A validated call: the tensors as the kernels take them, and the sizes the schedule needs."""

    spec: TargetSpec
    device: torch.device
    q: torch.Tensor
    kv_rows: torch.Tensor  # (cache_rows, row elems): the cache as rows, a view
    kv_format: str
    kernel_q_format: str  # "bf16", "fp8" (quantized inside the kernel) or "fp8_codes"
    q_scale: torch.Tensor  # (1,) float32
    kv_scale: torch.Tensor  # (1,) float32
    block_scales: torch.Tensor  # flat uint8 view of the mxfp4 scales (a stand-in for other formats)
    scale_stride: int
    page_size: int  # 0: flat cache
    batch: int
    total_q: int
    num_heads: int

    @property
    def cache_rows(self) -> int:
        return self.kv_rows.shape[0]


def _validate_call(q, kv_cache, qo_indptr, kv_indptr, kv_scale, kv_block_scale, kv_format, q_format, q_scale, *,
                   paged: bool) -> _Call:
    """Every check that needs no device data (dtypes, devices, shapes, strides, format/scale pairing)."""
    _check_tensor("q", q, (torch.bfloat16, *_FP8_DTYPES), 3)
    device = q.device
    spec = spec_for_device(device)  # validates the device too (CUDA/ROCm, or $MLA_TARGET for lowering-only use)
    total_q, num_heads, q_dim = q.shape
    if q_dim != QK_DIM:
        raise ValueError(f"q: expected last dim {QK_DIM} (512 latent + 64 rope), got shape {tuple(q.shape)}")
    if num_heads not in SUPPORTED_HEADS:
        raise ValueError(f"q: expected {SUPPORTED_HEADS} heads (dim 1), got {num_heads}")
    _check_indptr("qo_indptr", qo_indptr, device)
    _check_indptr("kv_indptr", kv_indptr, device)
    if qo_indptr.shape != kv_indptr.shape:
        raise ValueError(
            f"qo_indptr and kv_indptr must both be (batch + 1,), got {tuple(qo_indptr.shape)} and {tuple(kv_indptr.shape)}"
        )
    kv_format = _infer_kv_format(kv_cache, kv_format)
    kv_rows, page_size = _check_kv(kv_cache, kv_format, device, spec, paged=paged)
    total_kv = kv_rows.shape[0]
    kv_scale_t = _unit_scale(device)
    block_scales, scale_stride = _no_block_scales(device), MXFP4_SCALES_PER_TOKEN
    if kv_format == "fp8":
        kv_scale_t = _check_scale("kv_scale", kv_scale, device)
    elif kv_scale is not None:
        raise ValueError(f"kv_scale is only for an fp8 cache; this cache is {kv_format}")
    if kv_format == "mxfp4":
        block_scales, scale_stride = _flat_block_scales(kv_block_scale, total_kv, device)
    elif kv_block_scale is not None:
        raise ValueError(f"kv_block_scale is only for an mxfp4 cache; this cache is {kv_format}")

    # Q: bf16; fp8 codes + their per-tensor scale; or bf16 quantized to fp8 inside the kernel (a8w8), from
    # amax(|q|) computed here on the device in one reduction (no host sync).
    if q.dtype in _FP8_DTYPES:
        if q.dtype != spec.fp8_torch_dtype:
            raise TypeError(f"q: {q.dtype} is not this target's fp8 flavour ({spec.name} reads {spec.fp8_torch_dtype})")
        q_scale_t, kernel_q_format = _check_scale("q_scale", q_scale, device), "fp8_codes"
    elif q_scale is not None:
        raise ValueError("q_scale: pass it only with q given as fp8 codes; bf16 q is quantized inside the kernel")
    elif q_format == "fp8":
        q_scale_t, kernel_q_format = torch.linalg.vector_norm(q, ord=math.inf, dtype=torch.float32).reshape(1), "fp8"
    elif q_format == "bf16":
        q_scale_t, kernel_q_format = _unit_scale(device), "bf16"
    else:
        raise ValueError(f"q_format must be 'bf16' or 'fp8', got {q_format!r}")
    if not q.is_contiguous():
        raise ValueError(f"q: expected a contiguous tensor, got strides {q.stride()}")
    return _Call(spec, device, q, kv_rows, kv_format, kernel_q_format, q_scale_t, kv_scale_t, block_scales,
                 scale_stride, page_size, qo_indptr.shape[0] - 1, total_q, num_heads)


def _outputs(call: _Call, out, lse) -> tuple[torch.Tensor, torch.Tensor]:
    """The caller's out / lse buffers (checked) or fresh ones. The kernels always write an LSE; without a caller
    buffer or return_lse nobody reads it."""
    out = _out_buffer("out", out, (call.total_q, call.num_heads, KV_LORA_RANK), torch.bfloat16, call.device)
    lse = _out_buffer("lse", lse, (call.total_q, call.num_heads), torch.float32, call.device)
    return out, lse


def _launch(call: _Call, qo_indptr, kv_indptr, page_table, sm_scale, decode, combine, num_splits, out, lse,
            o_partial=None, lse_partial=None) -> None:
    """Runs the decode kernel (and the combine kernel when the KV is split) into out / lse. ``o_partial`` /
    ``lse_partial``: a plan's preallocated split workspace (fresh buffers when None)."""
    paging = (page_table,) if call.page_size else ()
    args = (call.q, call.kv_rows, call.block_scales, call.scale_stride, call.q_scale, call.kv_scale, qo_indptr,
            kv_indptr, *paging, sm_scale)
    if combine is None:
        decode(*args, out, lse)
        return
    if o_partial is None:
        shape = (num_splits, call.total_q, call.num_heads)
        o_partial = torch.empty((*shape, KV_LORA_RANK), dtype=torch.float32, device=call.device)
        lse_partial = torch.empty(shape, dtype=torch.float32, device=call.device)
    decode(*args, o_partial, lse_partial)
    combine(o_partial, lse_partial, out, lse)


@functools.lru_cache(maxsize=4096)
def _plan(spec, kv_format, q_format, num_heads, causal, page_size, batch, total_q, total_kv, num_splits, overrides):
    """(decode launcher, combine launcher or None, num_splits): ``schedule.select_kernels``, compiled; cached,
    since serving calls repeat the same sizes and the schedule is a pure function of them."""
    decode_cfg, combine_cfg, num_splits = schedule.select_kernels(
        spec, kv_format=kv_format, q_format=q_format, num_heads=num_heads, causal=causal, page_size=page_size,
        batch=batch, total_q=total_q, total_kv=total_kv, num_splits=num_splits, **dict(overrides),
    )
    combine = None if combine_cfg is None else jit.get_launcher(combine_cfg, spec)
    return jit.get_launcher(decode_cfg, spec), combine, num_splits


class DecodePlan:
    """The schedule of one decode batch, made once by ``plan(...)`` and run many times (e.g. by every layer of a
    model step): FlashInfer's plan/run split, FlashMLA's metadata. Holds the batch layout on the device
    (``qo_indptr``, ``kv_indptr``, ``page_table``), the split count chosen from the exact KV lengths, the compiled
    kernels and the split workspace, so ``run`` only validates its tensors and launches.

    ``run`` does no host-device synchronisation and allocates nothing but its outputs (none with ``out=`` and
    ``lse=``): it can be captured in a CUDA graph, and a graph replays it with whatever the plan's index tensors
    hold then. One plan's workspace serves one stream at a time: runs of the same plan on concurrent streams race.
    """

    def __init__(self, *, spec, device, kv_format, q_format, num_heads, causal, sm_scale, page_size, kv_lens,
                 total_q, num_splits, qo_indptr, kv_indptr, page_table, overrides):
        self.spec = spec
        self.device = device
        self.kv_format = kv_format
        self.q_format = q_format
        self.num_heads = num_heads
        self.causal = causal
        self.sm_scale = sm_scale
        self.page_size = page_size  # 0: flat cache; else tokens per page (1 for a flat cache read through a table)
        self.kv_lens = kv_lens  # host copy of the planned KV lengths
        self.kv_tokens = sum(kv_lens)
        self.batch = len(kv_lens)
        self.total_q = total_q
        self.num_splits = num_splits
        self.qo_indptr = qo_indptr  # (batch + 1,) int32 on the device
        self.kv_indptr = kv_indptr  # (batch + 1,) int32 on the device
        self.page_table = page_table  # (batch, max_pages) int32 on the device, or None
        self._overrides = overrides  # sorted (field, value) pairs, as _plan takes them
        self._o_partial = self._lse_partial = None
        if num_splits > 1 and total_q > 0:
            shape = (num_splits, total_q, num_heads)
            self._o_partial = torch.empty((*shape, KV_LORA_RANK), dtype=torch.float32, device=device)
            self._lse_partial = torch.empty(shape, dtype=torch.float32, device=device)

    def __repr__(self) -> str:
        paging = f", page_size={self.page_size}" if self.page_size else ""
        return (f"DecodePlan({self.kv_format}, q {self.q_format}, heads={self.num_heads}, batch={self.batch}, "
                f"total_q={self.total_q}, kv_tokens={self.kv_tokens}, num_splits={self.num_splits}, "
                f"causal={self.causal}{paging}, {self.spec.name})")

    def kernels(self, kernel_q_format: str):
        """(decode launcher, combine launcher or None) for the planned problem with Q read as
        ``kernel_q_format``: the one-shot op's selection (``_plan``) with the planned split count."""
        decode, combine, _ = _plan(self.spec, self.kv_format, kernel_q_format, self.num_heads, self.causal,
                                   self.page_size, self.batch, self.total_q, self.kv_tokens, self.num_splits,
                                   self._overrides)
        return decode, combine

    def run(
        self,
        q: torch.Tensor,
        kv_cache: torch.Tensor,
        *,
        kv_scale: torch.Tensor | None = None,
        kv_block_scale: torch.Tensor | None = None,
        q_scale: torch.Tensor | None = None,
        out: torch.Tensor | None = None,
        lse: torch.Tensor | None = None,
        return_lse: bool = False,
        check_inputs: bool = False,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Decode with this plan: ``q`` (total_q, H, 576) and the cache as in ``mla_decode`` (paged caches as
        (num_pages, page_size, 1, row)); returns ``out`` or ``(out, lse)``. ``check_inputs``: also check the page
        table's values against the cache (a device-to-host copy)."""
        call = _validate_call(q, kv_cache, self.qo_indptr, self.kv_indptr, kv_scale, kv_block_scale, None,
                              self.q_format, q_scale, paged=self.page_table is not None)
        if call.kv_format != self.kv_format:
            raise ValueError(f"kv_cache: this plan is for a {self.kv_format} cache, got a {call.kv_format} one")
        if call.num_heads != self.num_heads:
            raise ValueError(f"q: this plan is for {self.num_heads} heads, got shape {tuple(q.shape)}")
        if call.total_q != self.total_q:
            raise ValueError(f"q: the plan's qo_indptr holds {self.total_q} query rows, q has {call.total_q}")
        if call.page_size != self.page_size:
            raise ValueError(f"kv_cache: this plan is for page_size {self.page_size}, the cache has {call.page_size}")
        if not self.page_size and self.kv_tokens > call.cache_rows:
            raise ValueError(f"kv_cache: the plan's kv_indptr reaches row {self.kv_tokens}, the cache has {call.cache_rows}")
        out, lse = _outputs(call, out, lse)
        if check_inputs and self.page_table is not None:
            validate_index_values(self.qo_indptr, self.kv_indptr, call.cache_rows, call.total_q, self.page_table,
                                  self.page_size)
        if call.total_q == 0 or call.batch == 0:
            return (out, lse) if return_lse else out
        decode, combine = self.kernels(call.kernel_q_format)
        _launch(call, self.qo_indptr, self.kv_indptr, self.page_table, self.sm_scale, decode, combine,
                self.num_splits, out, lse, self._o_partial, self._lse_partial)
        return (out, lse) if return_lse else out


def plan(
    qo_indptr,
    kv_indptr,
    *,
    num_heads: int,
    kv_format: KVFormat,
    q_format: QFormat = "bf16",
    causal: bool = False,
    sm_scale: float | None = None,
    page_size: int = 0,
    page_table: torch.Tensor | None = None,
    kv_indices: torch.Tensor | None = None,
    kv_page_indptr=None,
    num_splits: int | None = None,
    device: torch.device | str | None = None,
    config_overrides: dict | None = None,
) -> DecodePlan:
    """Plans a decode batch once, for many ``DecodePlan.run`` calls (every layer of a step).

    Args:
      qo_indptr, kv_indptr: (batch + 1,) offsets as host data (a list, or a CPU int tensor: no synchronisation)
        or as int32 device tensors (read to the host once: a synchronisation, so plan outside CUDA-graph capture).
        ``kv_indptr`` gives each sequence's KV length; for a flat cache also its rows.
      num_heads: 16, 32, 64 or 128. kv_format: "bf16", "fp8" or "mxfp4". q_format: "bf16", or "fp8" (a8w8: bf16
        Q quantized inside the kernel, or Q passed to ``run`` as fp8 codes with ``q_scale``).
      causal, sm_scale: as in ``mla_decode``.
      page_size: 0 for a flat cache, else tokens per page of a paged cache (1, 16, 32, 64, 128) given with either
        page_table: (batch, max_pages) int32 on the device (FlashMLA's block table): token p of sequence b is slot
          p % page_size of page page_table[b, p // page_size]; or
        kv_indices: (num_used_pages,) int32 on the device, the pages of all sequences back to back (FlashInfer's
          CSR): sequence b's pages are kv_indices[kv_page_indptr[b]:kv_page_indptr[b+1]]. kv_page_indptr: host
          or device (batch + 1,) offsets; default: each sequence holds exactly ceil(length / page_size) pages.
          The plan turns them into a block table once, on the device.
      num_splits: KV splits per sequence; default ``schedule.choose_num_splits`` from the exact mean KV length.
      device: where the kernels run (default: the device of a tensor argument, else the current CUDA device).
      config_overrides: tuning only, as in ``mla_decode``.

    Index values are checked here, on the host (monotonic offsets from 0, page counts); page numbers are checked
    against the cache by ``run(check_inputs=True)``.
    """
    device = _plan_device(device, qo_indptr, kv_indptr, page_table, kv_indices)
    spec = spec_for_device(device)
    qo = _host_offsets("qo_indptr", qo_indptr)
    kvp = _host_offsets("kv_indptr", kv_indptr)
    if len(qo) != len(kvp):
        raise ValueError(f"qo_indptr and kv_indptr must both be (batch + 1,), got {len(qo)} and {len(kvp)} entries")
    if num_heads not in SUPPORTED_HEADS:
        raise ValueError(f"num_heads: expected one of {SUPPORTED_HEADS}, got {num_heads!r}")
    if kv_format not in ("bf16", "fp8", "mxfp4"):
        raise ValueError(f"kv_format must be 'bf16', 'fp8' or 'mxfp4', got {kv_format!r}")
    if q_format not in ("bf16", "fp8"):
        raise ValueError(f"q_format must be 'bf16' or 'fp8', got {q_format!r}")
    _check_num_splits(num_splits)
    kv_lens = [hi - lo for lo, hi in zip(kvp, kvp[1:])]
    batch, total_q = len(kv_lens), qo[-1]
    table = _plan_page_table(page_size, page_table, kv_indices, kv_page_indptr, kv_lens, device)
    overrides = tuple(sorted(config_overrides.items())) if config_overrides else ()
    causal = bool(causal)
    if total_q and batch:
        # The one-shot op's selection, with the exact token count; builds (or loads) the kernels now, not in the
        # first run.
        num_splits = _plan(spec, kv_format, q_format, num_heads, causal, page_size, batch, total_q, sum(kv_lens),
                           num_splits, overrides)[2]
    return DecodePlan(
        spec=spec, device=device, kv_format=kv_format, q_format=q_format, num_heads=num_heads, causal=causal,
        sm_scale=DEFAULT_SM_SCALE if sm_scale is None else float(sm_scale), page_size=page_size, kv_lens=kv_lens,
        total_q=total_q, num_splits=num_splits or 1, qo_indptr=_device_offsets(qo_indptr, qo, device),
        kv_indptr=_device_offsets(kv_indptr, kvp, device), page_table=table, overrides=overrides,
    )


def _plan_device(device, *tensors) -> torch.device:
    if device is not None:
        return torch.device(device)
    for t in tensors:
        if isinstance(t, torch.Tensor) and t.device.type != "cpu":
            return t.device
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    raise ValueError("device: no device tensor among the arguments and no CUDA/ROCm device; pass device=")


def _host_offsets(name: str, offsets) -> list[int]:
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


def _device_offsets(given, values: list[int], device: torch.device) -> torch.Tensor:
    """The offsets as the kernels read them: the caller's tensor when it already is contiguous int32 on the device
    (so a CUDA graph sees in-place updates), else a fresh copy."""
    if isinstance(given, torch.Tensor) and given.device == device and given.dtype == torch.int32 and given.is_contiguous():
        return given
    return torch.tensor(values, dtype=torch.int32, device=device)


def _plan_page_table(page_size, page_table, kv_indices, kv_page_indptr, kv_lens, device):
    """The (batch, max_pages) int32 block table the paged kernels read, or None for a flat cache."""
    if not isinstance(page_size, int) or (page_size and page_size not in SUPPORTED_PAGE_SIZES):
        raise ValueError(f"page_size: expected 0 (flat cache) or one of {SUPPORTED_PAGE_SIZES}, got {page_size!r}")
    needed = [-(-n // page_size) for n in kv_lens] if page_size else []
    if not page_size:
        if page_table is not None or kv_indices is not None or kv_page_indptr is not None:
            raise ValueError("page_size: pass the cache's page size (> 0) with page_table / kv_indices")
        return None
    if (page_table is None) == (kv_indices is None):
        raise ValueError("page_table / kv_indices: a paged plan needs exactly one of them")
    if page_table is not None:
        if kv_page_indptr is not None:
            raise ValueError("kv_page_indptr: only with kv_indices, not with page_table")
        _check_page_table(page_table, len(kv_lens), device)
        short = [b for b, n in enumerate(needed) if n > page_table.shape[1]]
        if short:
            raise ValueError(f"page_table: sequence {short[0]} has {kv_lens[short[0]]} tokens, more than "
                             f"{page_table.shape[1]} pages of {page_size} hold")
        return page_table
    _check_tensor("kv_indices", kv_indices, (torch.int32,), 1)
    _check_same_device("kv_indices", kv_indices, device)
    if kv_page_indptr is None:
        page_offsets = [0]
        for n in needed:
            page_offsets.append(page_offsets[-1] + n)
    else:
        page_offsets = _host_offsets("kv_page_indptr", kv_page_indptr)
        if len(page_offsets) != len(kv_lens) + 1:
            raise ValueError(f"kv_page_indptr: expected {len(kv_lens) + 1} entries (batch + 1), got {len(page_offsets)}")
    counts = [hi - lo for lo, hi in zip(page_offsets, page_offsets[1:])]
    short = [b for b, (n, c) in enumerate(zip(needed, counts)) if n > c]
    if short:
        b = short[0]
        raise ValueError(f"kv_page_indptr: sequence {b} has {kv_lens[b]} tokens ({needed[b]} pages of {page_size}) "
                         f"but {counts[b]} pages")
    if page_offsets[-1] > kv_indices.shape[0]:
        raise ValueError(f"kv_indices: expected at least {page_offsets[-1]} entries (kv_page_indptr[-1]), "
                         f"got {kv_indices.shape[0]}")
    # Gather each sequence's pages into its row of the block table; columns past its pages get page 0 (never read).
    max_pages = max(needed + [1])
    if kv_indices.shape[0] == 0:
        return torch.zeros((len(kv_lens), max_pages), dtype=torch.int32, device=device)
    starts = torch.tensor(page_offsets[:-1], dtype=torch.int64, device=device)
    columns = torch.arange(max_pages, dtype=torch.int64, device=device)
    used = columns[None, :] < torch.tensor(needed, dtype=torch.int64, device=device)[:, None]
    index = (starts[:, None] + columns[None, :]).clamp_(max=kv_indices.shape[0] - 1)
    return torch.where(used, kv_indices[index], 0).to(torch.int32).contiguous()


CUSTOM_KERNEL_FORMAT = "bf16"  # fastest format that passes the competition check (docs/perf.md, run 10): every
# format passes it with no miss, and today bf16 KV is the fastest (geomean 69.2 us vs fp8 93.2, mxfp4 147.4).


def run_harness(data, mode: str = "bf16", *, op=None, **kwargs):
    """``op`` (default ``mla_decode``; ``mla.ops.mla_decode`` works too) on a harness tuple
    ``(q, kv_data, qo_indptr, kv_indptr, config)`` in ``mode``: "bf16" (bf16 KV), "fp8" (bf16 Q, fp8 KV),
    "a8w8" (fp8 Q, fp8 KV) or "mxfp4" (bf16 Q, mxfp4 KV). ``kwargs`` go to the op."""
    op = mla_decode if op is None else op
    q, kv_data, qo_indptr, kv_indptr, _ = data
    kv, cache_kwargs = harness_cache(kv_data, mode)
    return op(q, kv, qo_indptr, kv_indptr, **cache_kwargs, **kwargs)


def harness_cache(kv_data, mode: str) -> tuple[torch.Tensor, dict]:
    """(the cache tensor, the op's keywords for it: kv_format, q_format and the cache's scales) of a harness
    ``kv_data`` dict in ``mode``."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {tuple(MODES)}, got {mode!r}")
    kv_format, q_format = MODES[mode]
    kwargs = dict(kv_format=kv_format, q_format=q_format)
    if kv_format == "bf16":
        return kv_data["bf16"], kwargs
    kv, scale = kv_data[kv_format]
    return kv, dict(kwargs, **{"kv_scale" if kv_format == "fp8" else "kv_block_scale": scale})


def page_size_of(kv_cache: torch.Tensor) -> int:
    """Tokens per page of a cache read through a page table: dim 1 of a (num_pages, page_size, 1, row) cache, 1 for
    a flat (total_kv, 1, row) one."""
    return kv_cache.shape[1] if kv_cache.dim() == 4 else 1


def custom_kernel(data):
    """Entry point of the competition harness: ``data = (q, kv_data, qo_indptr, kv_indptr, config)`` with
    ``kv_data = {"bf16": T, "fp8": (T, scale), "mxfp4": (T, scale)}``; returns (total_q, 16, 512) bf16.
    Reads ``kv_data[CUSTOM_KERNEL_FORMAT]``."""
    config = data[4]
    sm_scale = config.get("sm_scale", DEFAULT_SM_SCALE) if isinstance(config, dict) else DEFAULT_SM_SCALE
    return run_harness(data, CUSTOM_KERNEL_FORMAT, sm_scale=sm_scale)


# --- validation helpers: each raises naming the argument and what was expected --------------------------------


def _check_tensor(name: str, t, dtypes: tuple, ndim: int) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in dtypes:
        raise TypeError(f"{name}: expected dtype in {[str(d) for d in dtypes]}, got {t.dtype}")
    if t.dim() != ndim:
        raise ValueError(f"{name}: expected {ndim} dims, got shape {tuple(t.shape)}")


def _check_same_device(name: str, t: torch.Tensor, device: torch.device) -> None:
    if t.device != device:
        raise ValueError(f"{name}: expected device {device} (that of q), got {t.device}")


def _check_indptr(name: str, t, device: torch.device) -> None:
    _check_tensor(name, t, (torch.int32,), 1)
    _check_same_device(name, t, device)
    if t.shape[0] < 1:
        raise ValueError(f"{name}: expected (batch + 1,) entries, got an empty tensor")
    if not t.is_contiguous():
        raise ValueError(f"{name}: expected a contiguous tensor")


def _infer_kv_format(kv_cache, kv_format) -> str:
    if not isinstance(kv_cache, torch.Tensor):
        raise TypeError(f"kv_cache: expected a torch.Tensor, got {type(kv_cache).__name__}")
    inferred = (
        "bf16" if kv_cache.dtype == torch.bfloat16
        else "fp8" if kv_cache.dtype in _FP8_DTYPES
        else "mxfp4" if kv_cache.dtype in _PACKED_FP4_DTYPES
        else None
    )
    if inferred is None:
        raise TypeError(f"kv_cache: expected bf16, fp8 (e4m3) or packed mxfp4 (uint8) data, got {kv_cache.dtype}")
    if kv_format is not None and kv_format != inferred:
        raise ValueError(f"kv_format={kv_format!r} does not match kv_cache dtype {kv_cache.dtype} ({inferred})")
    return inferred


def _check_kv(kv_cache: torch.Tensor, kv_format: str, device: torch.device, spec: TargetSpec, paged: bool):
    """Returns (the cache as rows (cache_rows, row_elems), a view; tokens per page (0 for a flat cache))."""
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
    _check_same_device("kv_cache", kv_cache, device)
    if kv_cache.dim() != 3 or kv_cache.stride(2) != 1 or kv_cache.stride(0) != row:
        raise ValueError(f"kv_cache: expected contiguous rows of {row} elements, got strides {kv_cache.stride()}")
    if kv_format == "fp8" and kv_cache.dtype != spec.fp8_torch_dtype:
        raise TypeError(
            f"kv_cache: {kv_cache.dtype} is not the fp8 flavour of {spec.name} ({spec.fp8_torch_dtype}); "
            "e4m3fn and e4m3fnuz codes differ, convert the cache instead of reinterpreting it"
        )
    rows = kv_cache.view(kv_cache.shape[0], row)
    return (formats.as_uint8(rows) if kv_format == "mxfp4" else rows), page_size


def _check_num_splits(num_splits) -> None:
    if num_splits is not None and (not isinstance(num_splits, int) or num_splits < 1):
        raise ValueError(f"num_splits must be a positive int, got {num_splits!r}")


def _check_page_table(page_table, batch: int, device: torch.device) -> None:
    _check_tensor("page_table", page_table, (torch.int32,), 2)
    _check_same_device("page_table", page_table, device)
    if page_table.shape[0] != batch:
        raise ValueError(f"page_table: expected {batch} rows (one per sequence), got shape {tuple(page_table.shape)}")
    if not page_table.is_contiguous():
        raise ValueError("page_table: expected a contiguous tensor")


def validate_index_values(qo_indptr, kv_indptr, cache_rows: int, total_q: int, page_table=None, page_size: int = 0) -> None:
    """Host-side checks of index *values* (they need a device-to-host copy, so the op runs them only when asked:
    ``mla_decode(..., check_inputs=True)``). Raises ValueError naming the argument."""
    qo, kvp = _host_offsets("qo_indptr", qo_indptr), _host_offsets("kv_indptr", kv_indptr)
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


def _check_scale(name: str, scale, device: torch.device) -> torch.Tensor:
    if scale is None:
        raise ValueError(f"{name}: required (a (1,) float32 tensor on the device)")
    if not isinstance(scale, torch.Tensor) or scale.dtype != torch.float32 or scale.numel() != 1:
        what = f"{scale.dtype} tensor of shape {tuple(scale.shape)}" if isinstance(scale, torch.Tensor) else type(scale).__name__
        raise TypeError(f"{name}: expected a (1,) float32 tensor on the device, got {what}")
    _check_same_device(name, scale, device)
    return scale.reshape(1)


def _flat_block_scales(scales, total_kv: int, device: torch.device) -> tuple[torch.Tensor, int]:
    """mxfp4 scales as a flat uint8 view plus their row stride (padded rows are read in place, not copied)."""
    if scales is None:
        raise ValueError("kv_block_scale: required for an mxfp4 cache ((total_kv, >= 18) uint8 e8m0 scales)")
    if not isinstance(scales, torch.Tensor) or scales.dtype not in _E8M0_DTYPES:
        got = scales.dtype if isinstance(scales, torch.Tensor) else type(scales).__name__
        raise TypeError(f"kv_block_scale: expected uint8 or float8_e8m0fnu, got {got}")
    if scales.dim() == 3:  # (total_kv, 1, cols) or, paged, (num_pages, page_size, cols)
        scales = scales.flatten(0, 1)
    if scales.dim() != 2 or scales.shape[0] != total_kv or scales.shape[1] < MXFP4_SCALES_PER_TOKEN:
        raise ValueError(
            f"kv_block_scale: expected shape (total_kv={total_kv}, >= {MXFP4_SCALES_PER_TOKEN}), got {tuple(scales.shape)}"
        )
    _check_same_device("kv_block_scale", scales, device)
    if scales.stride(1) != 1:
        raise ValueError(f"kv_block_scale: expected unit stride along a row, got strides {scales.stride()}")
    scales = formats.as_uint8(scales)
    stride = scales.stride(0) if total_kv > 1 else MXFP4_SCALES_PER_TOKEN
    flat_len = max(total_kv - 1, 0) * stride + MXFP4_SCALES_PER_TOKEN
    return scales.as_strided((flat_len,), (1,)), stride


def _out_buffer(name: str, buf, shape: tuple, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    if buf is None:
        return torch.empty(shape, dtype=dtype, device=device)
    if not isinstance(buf, torch.Tensor) or buf.dtype != dtype or tuple(buf.shape) != shape:
        got = f"{buf.dtype} {tuple(buf.shape)}" if isinstance(buf, torch.Tensor) else type(buf).__name__
        raise ValueError(f"{name}: expected a {dtype} tensor of shape {shape}, got {got}")
    _check_same_device(name, buf, device)
    if not buf.is_contiguous():
        raise ValueError(f"{name}: expected a contiguous tensor")
    return buf


@functools.lru_cache(maxsize=None)
def _unit_scale(device: torch.device) -> torch.Tensor:
    """A (1,) float32 one on the device: the scale of formats that have none (made once per device)."""
    return torch.ones(1, dtype=torch.float32, device=device)


@functools.lru_cache(maxsize=None)
def _no_block_scales(device: torch.device) -> torch.Tensor:
    """A 1-byte stand-in for the mxfp4 scale argument of kernels that read none."""
    return torch.zeros(MXFP4_SCALES_PER_TOKEN, dtype=torch.uint8, device=device)
