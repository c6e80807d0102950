"""FlashMLA's Python interface over this package's kernels: ``get_mla_metadata`` and ``flash_mla_with_kvcache``
with FlashMLA's argument names, shapes and return values (dense decode), so a serving stack that calls FlashMLA
switches by changing its import. Beyond FlashMLA, through keyword-only extras: an fp8 cache read with bf16 Q, a8w8
with per-tensor descales, an mxfp4 cache with its block scales, page sizes 1, 16, 32, 64 and 128, and gfx942.

Switching (Hopper; the inputs as in the README's example)::

    import torch
    # from flash_mla import get_mla_metadata, flash_mla_with_kvcache
    from mla.flash_mla import get_mla_metadata, flash_mla_with_kvcache

    num_layers, batch, s_q, h_q, page = 2, 4, 1, 16, 64
    cache_seqlens = torch.tensor([100, 0, 3000, 64], dtype=torch.int32, device="cuda")
    block_table = torch.randperm(batch * 47, device="cuda").int().view(batch, 47)  # 47 = 3000 // 64 + 1
    q = torch.randn(num_layers, batch, s_q, h_q, 576, dtype=torch.bfloat16, device="cuda")
    k_cache = torch.randn(num_layers, batch * 47, page, 1, 576, dtype=torch.bfloat16, device="cuda")

    metadata, num_splits = get_mla_metadata()                        # once per step (FlashMLA's current pattern)
    for layer in range(num_layers):
        out, lse = flash_mla_with_kvcache(q[layer], k_cache[layer], block_table, cache_seqlens, 512, metadata,
                                          num_splits, causal=True)
        # q (batch, s_q, h_q, 576) bf16; k_cache (num_blocks, page_block_size, 1, 576); block_table (batch,
        # max_blocks) int32; cache_seqlens (batch,) int32; out (batch, s_q, h_q, 512) bf16; lse (batch, h_q, s_q)

Semantics taken from FlashMLA (``flash_mla/flash_mla_interface.py`` and its SM90 dense decode, the spec where it and
this package's reference differ): the LSE is the natural log of the sum of exp(scaled scores), +inf (not -inf)
where a query sees no token, whose output is 0; ``causal`` is bottom-right aligned (query i of s_q sees KV
positions [0, L - s_q + i]) and ignored when s_q is 1; ``softmax_scale`` defaults to 1/sqrt(576).

How the metadata maps onto this package: the first ``flash_mla_with_kvcache`` call with a metadata object reads
``cache_seqlens`` to the host (one synchronisation; ``get_mla_metadata(cache_seqlens, ...)`` does it there instead)
and makes a ``mla.plan.DecodePlan``: the split count from the exact lengths, the kernels built, the split
workspace. Every later call with the same metadata and the same tensor signature only looks its prepared launch up,
allocates ``out`` and ``lse`` and launches (no synchronisation: it can be captured in a CUDA graph). Where the split
grid fits the GPU (Hopper; the small calls, whose host time shows) the one kernel launched takes FlashMLA's shapes
itself (``flash_io``): the caller's q, cache, block table and cache_seqlens go to it as they are, and it writes the
(batch, s_q, h_q, 512) output and the (batch, h_q, s_q) LSE with +inf. Otherwise the package's kernels run on views
of the caller's tensors, on the planned offsets, and the LSE is transposed and fixed by one more launch when s_q > 1.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import re

import torch

from mla import jit, schedule, validate
from mla.constants import DEFAULT_SM_SCALE, KV_LORA_RANK, QK_DIM
from mla.launch import Launch
from mla.plan import DecodePlan, plan
from mla.validate import FP8_DTYPES

__all__ = ["get_mla_metadata", "flash_mla_with_kvcache", "MLAMetadata"]

_INF, _NAN = math.inf, math.nan
_BF16, _FP32 = torch.bfloat16, torch.float32
# The package's argument names in its error messages -> the names of FlashMLA's (and this module's) arguments.
_FLASH_NAMES = {"kv_cache": "k_cache", "page_table": "block_table", "kv_scale": "descale_k", "q_scale": "descale_q"}
_NAMES = re.compile(r"\b(" + "|".join(_FLASH_NAMES) + r")\b")


@dataclasses.dataclass(frozen=True)
class MetadataConfig:
    """What a metadata object is made for (set by its first call); every call that reuses it must match."""

    batch: int
    s_q: int
    h_q: int
    page_block_size: int
    h_k: int
    causal: bool
    is_fp8_kvcache: bool
    kv_format: str  # "bf16" | "fp8" | "mxfp4"
    q_format: str  # "bf16" | "fp8" (a8w8: fp8 Q codes with descale_q, or bf16 Q quantized inside the kernel)
    device: torch.device


class MLAMetadata:
    """FlashMLA's tile-scheduler metadata, backed by a ``DecodePlan``: made empty by ``get_mla_metadata`` and filled
    by the first ``flash_mla_with_kvcache`` call that receives it.

    Reuse it for every call over one batch layout (all layers of a step). What must stay the same across those
    calls (checked on each new tensor signature, ValueError naming the argument): q's batch, s_q and h_q, the
    cache's page_block_size and its single KV head, ``causal``, ``is_fp8_kvcache``, the cache format and the Q
    format. The *values* of ``cache_seqlens`` must stay the same as well (FlashMLA's rule too); they are not
    checked, as that would need a host copy per call. The FlashMLA-shaped kernel of the small calls reads
    ``cache_seqlens`` at every call; the other forms read the lengths planned on the first call when eager, and
    ``cache_seqlens`` at every replay when captured in a CUDA graph. (So a graph follows in-place updates of the
    lengths; the split count stays the planned one, which only affects speed.) ``block_table``,
    ``softmax_scale`` and the tensors' data may change from call to call.
    """

    def __init__(self, lengths: list[int] | None = None, num_q_tokens_per_head_k: int | None = None,
                 num_heads_q: int | None = None, num_splits: torch.Tensor | None = None):
        self.have_initialized = False  # FlashMLA's name: set by the first call
        self.config: MetadataConfig | None = None
        self.plan: DecodePlan | None = None
        self.lengths = lengths  # host copy of cache_seqlens (given to get_mla_metadata, or read by the first call)
        self.num_splits = num_splits  # the old interface's (batch + 1,) int32 cumulative split counts, or None
        self._q_tokens = num_q_tokens_per_head_k
        self._heads_q = num_heads_q
        self._runs: dict = {}  # call signature -> _Run

    def __repr__(self) -> str:
        return f"MLAMetadata({self.config}, {self.plan})" if self.have_initialized else "MLAMetadata(empty)"


def get_mla_metadata(*args, **kwargs) -> tuple[MLAMetadata, torch.Tensor | None]:
    """The scheduler metadata for ``flash_mla_with_kvcache``, as a ``(metadata, num_splits)`` pair.

    Both of FlashMLA's calling patterns work:
      - ``get_mla_metadata()`` (its current release; any arguments ignored there are refused here only if they
        are not the old ones): returns ``(MLAMetadata(), None)``, filled by the first decode call, which then reads
        ``cache_seqlens`` to the host once;
      - ``get_mla_metadata(cache_seqlens, num_q_tokens_per_head_k, num_heads_k, num_heads_q=None,
        is_fp8_kvcache=False, topk=None)`` (the older one): reads ``cache_seqlens`` ((batch,) int32) to the host
        now (one synchronisation, so the decode calls do none) and returns ``(metadata, num_splits)`` with
        ``num_splits`` a (batch + 1,) int32 device tensor of cumulative split counts, filled by the first decode
        call (FlashMLA's layout; informative: pass it back, or None). ``num_q_tokens_per_head_k`` = s_q * h_q
        (one KV head); ``num_heads_k`` must be 1; ``topk`` (sparse attention) must be None.

    See ``MLAMetadata`` for what must stay the same across the calls that reuse it.
    """
    if not args and not kwargs:
        return MLAMetadata(), None
    return _legacy_metadata(*args, **kwargs)


def _legacy_metadata(cache_seqlens, num_q_tokens_per_head_k, num_heads_k, num_heads_q=None, is_fp8_kvcache=False,
                     topk=None) -> tuple[MLAMetadata, torch.Tensor]:
    validate.check_tensor("cache_seqlens", cache_seqlens, (torch.int32,), 1)
    if not isinstance(num_q_tokens_per_head_k, int) or num_q_tokens_per_head_k < 1:
        raise ValueError(f"num_q_tokens_per_head_k: expected a positive int (s_q * h_q), got {num_q_tokens_per_head_k!r}")
    if num_heads_k != 1:
        raise ValueError(f"num_heads_k: MLA decode has one KV head, got {num_heads_k!r}")
    if num_heads_q is not None and (not isinstance(num_heads_q, int) or num_q_tokens_per_head_k % num_heads_q):
        raise ValueError(f"num_heads_q: expected an int dividing num_q_tokens_per_head_k "
                         f"({num_q_tokens_per_head_k}), got {num_heads_q!r}")
    if not isinstance(is_fp8_kvcache, bool):
        raise TypeError(f"is_fp8_kvcache: expected a bool, got {type(is_fp8_kvcache).__name__}")
    if topk is not None:
        raise ValueError("topk: sparse attention is not supported (dense decode only); pass topk=None")
    lengths = _host_lengths(cache_seqlens)
    num_splits = torch.zeros(len(lengths) + 1, dtype=torch.int32, device=cache_seqlens.device)
    return MLAMetadata(lengths, num_q_tokens_per_head_k, num_heads_q, num_splits), num_splits


def flash_mla_with_kvcache(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    block_table: torch.Tensor,
    cache_seqlens: torch.Tensor,
    head_dim_v: int,
    tile_scheduler_metadata: MLAMetadata,
    num_splits: torch.Tensor | None = None,
    softmax_scale: float | None = None,
    causal: bool = False,
    is_fp8_kvcache: bool = False,
    *,
    descale_q: torch.Tensor | None = None,
    descale_k: torch.Tensor | None = None,
    kv_block_scale: torch.Tensor | None = None,
    q_format: str = "bf16",
) -> tuple[torch.Tensor, torch.Tensor]:
    """MLA decode attention over a paged latent cache, FlashMLA's dense decode call.

    Args:
      q: (batch, s_q, h_q, 576) bf16 (h_q 16, 32, 64 or 128), contiguous; or fp8 codes (float8_e4m3fn;
        float8_e4m3fnuz on gfx942) with ``descale_q`` (a8w8).
      k_cache: (num_blocks, page_block_size, 1, 576) bf16, or fp8 e4m3 codes (``is_fp8_kvcache=True`` and
        ``descale_k``), or (num_blocks, page_block_size, 1, 288) uint8 packed mxfp4 (``kv_block_scale``);
        page_block_size 1, 16, 32, 64 or 128 (FlashMLA: 64 only). All 576 dims are keys, the first 512 values.
      block_table: (batch, max_blocks) int32: token p of sequence b is slot p % page_block_size of block
        ``block_table[b, p // page_block_size]``; entries past a sequence's blocks are never read.
      cache_seqlens: (batch,) int32 KV lengths (the values planned with the metadata: see ``MLAMetadata``).
      head_dim_v: 512.
      tile_scheduler_metadata: from ``get_mla_metadata`` (reused across calls over one batch layout).
      num_splits: None, or the ``num_splits`` that ``get_mla_metadata`` returned with this metadata.
      softmax_scale: positive finite float; default 1/sqrt(576).
      causal: query i of s_q sees KV positions [0, L - s_q + i] (bottom-right aligned); no effect when s_q is 1.
      is_fp8_kvcache: True exactly when ``k_cache`` holds fp8 codes.
    Keyword-only extras (not in FlashMLA's signature):
      descale_q: (1,) float32 per-tensor scale of fp8 Q codes (value = code * descale_q).
      descale_k: (1,) float32 per-tensor scale of an fp8 cache (value = code * descale_k); with bf16 Q the cache
        is read without quantizing Q (FlashMLA's fp8 path needs fp8 Q).
      kv_block_scale: mxfp4 e8m0 block scales, (num_blocks, page_block_size, >= 18) or
        (num_blocks * page_block_size, >= 18) uint8, one per 32 elements (value = code * 2^(e - 127)).
      q_format: "fp8" quantizes bf16 Q per tensor inside the kernel (a8w8 from bf16 Q); default "bf16".

    Returns ``(out, lse)``: out (batch, s_q, h_q, 512) bf16; lse (batch, h_q, s_q) float32, natural log,
    +inf where a query sees no token (its output is 0). Bad arguments raise ValueError / TypeError naming them.
    """
    meta = tile_scheduler_metadata
    try:
        key = (q.dtype, q.shape, q.device, q.stride(),
               k_cache.dtype, k_cache.shape, k_cache.stride(), k_cache.device,
               block_table.dtype, block_table.shape, block_table.device, block_table.stride(),
               cache_seqlens.dtype, cache_seqlens.shape, cache_seqlens.device, cache_seqlens.stride(),
               None if descale_q is None else (descale_q.dtype, descale_q.shape, descale_q.device),
               None if descale_k is None else (descale_k.dtype, descale_k.shape, descale_k.device),
               None if kv_block_scale is None else (kv_block_scale.dtype, kv_block_scale.shape,
                                                    kv_block_scale.stride(), kv_block_scale.device),
               head_dim_v, causal, is_fp8_kvcache, q_format)
        run = meta._runs.get(key)
    except (AttributeError, TypeError):  # not a tensor / not our metadata / unhashable: the checks say which
        key = run = None
    if run is None:
        run = _prepare(key, q, k_cache, block_table, cache_seqlens, head_dim_v, meta, causal, is_fp8_kvcache,
                       descale_q, descale_k, kv_block_scale, q_format)
    if num_splits is not None and num_splits is not meta.num_splits:
        raise ValueError("num_splits: pass None or the num_splits that get_mla_metadata returned with this metadata")
    sm_scale = DEFAULT_SM_SCALE if softmax_scale is None else validate.check_sm_scale(softmax_scale)
    return run(q, k_cache, block_table, cache_seqlens, descale_q, descale_k, kv_block_scale, sm_scale)


class _DirectRun:
    """One call signature whose kernel takes FlashMLA's shapes (``flash_io``: the one-launch paged kernel, where
    the split grid fits the GPU): the call allocates ``out`` and ``lse`` and launches, with no view, no offsets
    (the kernel reads ``cache_seqlens``) and no LSE fix (the kernel writes +inf where nothing is seen)."""

    __slots__ = ("decode", "out_shape", "lse_shape", "device", "block_scales", "block_scale_len",
                 "block_scale_as_uint8", "scale_stride", "q_scale", "reshape_q_scale", "kv_scale", "reshape_kv_scale",
                 "num_splits", "o_partial", "lse_partial")

    def __init__(self, launch: Launch, the_plan: DecodePlan, batch: int, s_q: int, h_q: int):
        ws = the_plan.workspace
        self.decode = jit.get_launcher(schedule.flash_io_variant(launch.decode_cfg), launch.spec)
        self.out_shape, self.lse_shape, self.device = (batch, s_q, h_q, KV_LORA_RANK), (batch, h_q, s_q), launch.device
        self.block_scales, self.block_scale_len = launch.block_scales, launch.block_scale_len
        self.block_scale_as_uint8, self.scale_stride = launch.block_scale_as_uint8, launch.scale_stride
        # Q's scale argument: 1 (bf16 Q), the plan's zeroed amax cell (a8w8 from bf16 Q: the kernel reduces
        # amax(|q|) into it), or the caller's descale_q (fp8 Q codes: None here, given per call).
        self.q_scale = launch.q_scale if launch.q_mode == "bf16" else ws.amax_cell if launch.amax_in_kernel else None
        self.reshape_q_scale, self.kv_scale, self.reshape_kv_scale = (launch.reshape_q_scale, launch.kv_scale,
                                                                     launch.reshape_kv_scale)
        self.num_splits = launch.num_splits
        if launch.num_splits == 1:
            self.o_partial = self.lse_partial = launch.dummy_partials
        else:
            self.o_partial, self.lse_partial = ws.o_partial_flat, ws.lse_partial_flat

    @staticmethod
    def applies(launch: Launch, q, k_cache, block_table) -> bool:
        """Whether this call signature can take the direct kernel: the one-launch block-level paged kernel, a
        cache read in its own dtype, and row-major tensors (the kernel's argument checks want exact strides)."""
        return (schedule.flash_io_variant(launch.decode_cfg) is not None and not launch.kv_as_uint8
                and _row_major(q) and _row_major(k_cache) and _row_major(block_table))

    def __call__(self, q, k_cache, block_table, cache_seqlens, descale_q, descale_k, kv_block_scale, sm_scale):
        out = torch.empty(*self.out_shape, dtype=_BF16, device=self.device)
        lse = torch.empty(*self.lse_shape, dtype=_FP32, device=self.device)
        block_scales = self.block_scales
        if block_scales is None:
            block_scales = (kv_block_scale.view(torch.uint8) if self.block_scale_as_uint8 else kv_block_scale
                            ).as_strided((self.block_scale_len,), (1,))
        q_scale = self.q_scale
        if q_scale is None:
            q_scale = descale_q.reshape(1) if self.reshape_q_scale else descale_q
        kv_scale = self.kv_scale
        if kv_scale is None:
            kv_scale = descale_k.reshape(1) if self.reshape_kv_scale else descale_k
        self.decode(q, k_cache, block_scales, self.scale_stride, q_scale, kv_scale, cache_seqlens, block_table,
                    sm_scale, self.num_splits, self.o_partial, self.lse_partial, out, lse)
        return out, lse


def _row_major(t: torch.Tensor) -> bool:
    """Strides exactly those of a fresh tensor of its shape (size-1 dims included)."""
    step, strides = 1, []
    for size in reversed(t.shape):
        strides.append(step)
        step *= size
    return t.stride() == tuple(reversed(strides))


class _Run:
    """One call signature of one metadata object, prepared: views, the plan's launch and workspace."""

    __slots__ = ("launch", "ws", "qo_indptr", "kv_indptr", "q_rows_shape", "out_shape", "lse_rows_shape",
                 "lse_shape", "fix_lse", "s_q", "on_cuda")

    def __init__(self, launch: Launch, the_plan: DecodePlan, batch: int, s_q: int, h_q: int, lonely: bool):
        self.launch, self.ws = launch, the_plan.workspace
        self.qo_indptr, self.kv_indptr = the_plan.qo_indptr, the_plan.kv_indptr
        self.q_rows_shape = (batch * s_q, h_q, QK_DIM)
        self.out_shape = (batch, s_q, h_q, KV_LORA_RANK)
        self.lse_rows_shape = (batch, s_q, h_q)
        self.lse_shape = (batch, h_q, s_q)
        self.fix_lse = lonely  # some query sees no token: its LSE must read +inf (the kernels write -inf)
        self.s_q = s_q
        self.on_cuda = launch.device.type == "cuda"

    def __call__(self, q, k_cache, block_table, cache_seqlens, descale_q, descale_k, kv_block_scale, sm_scale):
        kv_indptr, fix_lse = self.kv_indptr, self.fix_lse
        if self.on_cuda and torch._C._cuda_isCurrentStreamCapturing():
            # A graph replays with whatever cache_seqlens holds then: its offsets are computed inside the graph.
            kv_indptr = torch.zeros_like(self.kv_indptr)
            torch.cumsum(cache_seqlens, 0, dtype=torch.int32, out=kv_indptr[1:])
            fix_lse = True
        q_rows = q.view(*self.q_rows_shape)
        if self.s_q == 1:  # (batch, h_q) rows are (batch, h_q, 1) already: one view
            out, lse = self.launch.run(q_rows, k_cache, self.qo_indptr, kv_indptr, block_table, descale_k,
                                       kv_block_scale, descale_q, sm_scale, None, None, True, self.ws)
            lse = lse.view(*self.lse_shape)
            if fix_lse:  # +inf where nothing is seen (nan_to_num keeps NaN and +inf)
                lse = torch.nan_to_num(lse, nan=_NAN, posinf=_INF, neginf=_INF)
        else:  # the kernels write the plan's LSE rows; one kernel: (batch, s_q, h_q) -> (batch, h_q, s_q), and
            # +inf where nothing is seen
            out = self.launch.run(q_rows, k_cache, self.qo_indptr, kv_indptr, block_table, descale_k, kv_block_scale,
                                  descale_q, sm_scale, None, None, False, self.ws)
            lse = torch.nan_to_num(self.ws.lse.view(*self.lse_rows_shape).transpose(1, 2), nan=_NAN, posinf=_INF,
                                   neginf=_INF, out=torch.empty(*self.lse_shape, dtype=torch.float32,
                                                                device=self.launch.device))
        return out.view(*self.out_shape), lse


def _prepare(*args) -> _Run:
    """A new call signature: every check (naming the argument), the plan on the metadata's first call, the
    reuse checks against its config, and the prepared launch (kept on the metadata)."""
    try:
        return _check_and_prepare(*args)
    except (ValueError, TypeError) as exc:  # the package's checks name its own arguments: say FlashMLA's names
        message = str(exc)
        renamed = _NAMES.sub(lambda m: _FLASH_NAMES[m.group(0)], message)
        if renamed == message:
            raise
        raise type(exc)(renamed) from None


def _check_and_prepare(key, q, k_cache, block_table, cache_seqlens, head_dim_v, meta, causal, is_fp8_kvcache,
                       descale_q, descale_k, kv_block_scale, q_format) -> _Run:
    if not isinstance(meta, MLAMetadata):
        raise TypeError(f"tile_scheduler_metadata: expected the metadata get_mla_metadata returns, got "
                        f"{type(meta).__name__}")
    validate.check_tensor("q", q, (torch.bfloat16, *FP8_DTYPES), 4)
    batch, s_q, h_q, dim = q.shape
    if dim != QK_DIM:
        raise ValueError(f"q: expected (batch, s_q, h_q, {QK_DIM}), got shape {tuple(q.shape)}")
    if batch < 1 or s_q < 1:
        raise ValueError(f"q: expected batch >= 1 and s_q >= 1, got shape {tuple(q.shape)}")
    if h_q not in validate.SUPPORTED_HEADS:
        raise ValueError(f"q: expected h_q (dim 2) in {validate.SUPPORTED_HEADS}, got shape {tuple(q.shape)}")
    if not q.is_contiguous():
        raise ValueError(f"q: expected a contiguous tensor, got strides {q.stride()}")
    if not isinstance(k_cache, torch.Tensor):
        raise TypeError(f"k_cache: expected a torch.Tensor, got {type(k_cache).__name__}")
    if k_cache.dim() != 4:
        raise ValueError(f"k_cache: expected (num_blocks, page_block_size, 1, 576) (288 uint8 for mxfp4), got "
                         f"shape {tuple(k_cache.shape)}")
    if k_cache.shape[2] != 1:
        raise ValueError(f"k_cache: MLA decode has one KV head (dim 2), got shape {tuple(k_cache.shape)}")
    if k_cache.shape[1] not in validate.SUPPORTED_PAGE_SIZES:
        raise ValueError(f"k_cache: page_block_size (dim 1) must be one of {validate.SUPPORTED_PAGE_SIZES}, got "
                         f"shape {tuple(k_cache.shape)}")
    if head_dim_v != KV_LORA_RANK:
        raise ValueError(f"head_dim_v: must be {KV_LORA_RANK}, got {head_dim_v!r}")
    if not isinstance(causal, bool):
        raise TypeError(f"causal: expected a bool, got {type(causal).__name__}")
    if not isinstance(is_fp8_kvcache, bool):
        raise TypeError(f"is_fp8_kvcache: expected a bool, got {type(is_fp8_kvcache).__name__}")
    kv_format = validate.infer_kv_format(k_cache, None)
    if is_fp8_kvcache != (kv_format == "fp8"):
        raise ValueError(f"is_fp8_kvcache: {is_fp8_kvcache} does not match k_cache's dtype {k_cache.dtype}")
    if kv_format == "fp8" and descale_k is None:
        raise ValueError("descale_k: required with an fp8 cache (a (1,) float32 per-tensor scale)")
    if q_format not in ("bf16", "fp8"):
        raise ValueError(f"q_format: expected 'bf16' or 'fp8', got {q_format!r}")
    fp8_q = q.dtype in FP8_DTYPES
    if fp8_q and descale_q is None:
        raise ValueError("descale_q: required with fp8 q (a (1,) float32 per-tensor scale)")
    if fp8_q or q_format == "fp8":
        if kv_format != "fp8":
            raise ValueError(f"q: fp8 Q (a8w8) needs an fp8 cache, got a {kv_format} one")
        plan_q_format = "fp8"
    else:
        plan_q_format = "bf16"
    validate.check_tensor("cache_seqlens", cache_seqlens, (torch.int32,), 1)
    if cache_seqlens.shape[0] != batch:
        raise ValueError(f"cache_seqlens: expected ({batch},) (q's batch), got shape {tuple(cache_seqlens.shape)}")
    validate.check_same_device("cache_seqlens", cache_seqlens, q.device)
    if not cache_seqlens.is_contiguous():
        raise ValueError("cache_seqlens: expected a contiguous tensor")
    if block_table is None:
        raise ValueError("block_table: required ((batch, max_blocks) int32)")
    page = k_cache.shape[1]
    config = MetadataConfig(batch, s_q, h_q, page, k_cache.shape[2], causal, is_fp8_kvcache, kv_format,
                            plan_q_format, q.device)

    return _prepare_run(key, q, k_cache, block_table, cache_seqlens, meta, config, descale_q, descale_k,
                        kv_block_scale)


def _prepare_run(key, q, k_cache, block_table, cache_seqlens, meta, config, descale_q, descale_k, kv_block_scale):
    batch, s_q, h_q, page = config.batch, config.s_q, config.h_q, config.page_block_size
    validate.check_page_table(block_table, batch, q.device)
    if not meta.have_initialized:
        _fill(meta, config, cache_seqlens, block_table)
    elif meta.config != config:
        raise ValueError("tile_scheduler_metadata: " + _mismatch(meta.config, config) + "; metadata is made for one "
                         "batch layout: call get_mla_metadata() again for another")
    the_plan, lengths = meta.plan, meta.lengths
    _check_capacity(block_table, page, lengths)
    launch = the_plan.prepare(q.view(batch * s_q, h_q, QK_DIM), k_cache, kv_scale=descale_k,
                              kv_block_scale=kv_block_scale, q_scale=descale_q)
    if _DirectRun.applies(launch, q, k_cache, block_table):
        run = _DirectRun(launch, the_plan, batch, s_q, h_q)
    else:
        lonely = any(n == 0 for n in lengths) or (config.causal and s_q > 1 and any(n < s_q for n in lengths))
        run = _Run(launch, the_plan, batch, s_q, h_q, lonely)
    if key is not None:
        meta._runs[key] = run
    return run


def _fill(meta: MLAMetadata, config: MetadataConfig, cache_seqlens: torch.Tensor, block_table: torch.Tensor) -> None:
    """The metadata's first call: the plan (split count from the exact lengths, kernels built, workspace)."""
    if meta.lengths is None:
        if config.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("tile_scheduler_metadata: its first call reads cache_seqlens to the host, which "
                               "CUDA-graph capture forbids: call flash_mla_with_kvcache once before capturing")
        meta.lengths = _host_lengths(cache_seqlens)
    lengths = meta.lengths
    if len(lengths) != config.batch:
        raise ValueError(f"cache_seqlens: get_mla_metadata was given {len(lengths)} lengths, q has batch "
                         f"{config.batch}")
    if meta._q_tokens is not None and meta._q_tokens != config.s_q * config.h_q:
        raise ValueError(f"q: get_mla_metadata was given num_q_tokens_per_head_k={meta._q_tokens}, q has s_q * h_q "
                         f"= {config.s_q * config.h_q}")
    if meta._heads_q is not None and meta._heads_q != config.h_q:
        raise ValueError(f"q: get_mla_metadata was given num_heads_q={meta._heads_q}, q has {config.h_q} heads")
    _check_capacity(block_table, config.page_block_size, lengths)
    the_plan = plan(list(range(0, (config.batch + 1) * config.s_q, config.s_q)),
                    [0, *itertools.accumulate(lengths)], num_heads=config.h_q, kv_format=config.kv_format,
                    q_format=config.q_format, causal=config.causal and config.s_q > 1,
                    page_size=config.page_block_size, page_table=block_table, device=config.device)
    if meta.num_splits is not None:  # the old interface's tensor: cumulative split counts, FlashMLA's layout
        meta.num_splits.copy_(torch.arange(config.batch + 1, dtype=torch.int32) * the_plan.num_splits)
    meta.plan, meta.config, meta.have_initialized = the_plan, config, True


def _check_capacity(block_table: torch.Tensor, page: int, lengths: list[int]) -> None:
    longest = max(lengths, default=0)
    if block_table.shape[1] * page < longest:
        raise ValueError(f"block_table: {block_table.shape[1]} blocks of {page} tokens hold fewer than the longest "
                         f"sequence's {longest} tokens")


def _mismatch(made: MetadataConfig, got: MetadataConfig) -> str:
    names = {"batch": "q's batch", "s_q": "q's s_q", "h_q": "q's h_q", "page_block_size": "k_cache's page_block_size",
             "h_k": "k_cache's KV heads", "causal": "causal", "is_fp8_kvcache": "is_fp8_kvcache",
             "kv_format": "k_cache's format", "q_format": "the Q format", "device": "the device"}
    for field in dataclasses.fields(MetadataConfig):
        a, b = getattr(made, field.name), getattr(got, field.name)
        if a != b:
            return f"made for {names[field.name]} {a!r}, this call has {b!r}"
    return "inconsistent call"


def _host_lengths(cache_seqlens: torch.Tensor) -> list[int]:
    """(batch,) lengths as a host list, checked non-negative (one device-to-host copy)."""
    lengths = cache_seqlens.tolist()
    if any(n < 0 for n in lengths):
        raise ValueError(f"cache_seqlens: lengths must be >= 0, got {lengths[:8]}")
    if sum(lengths) >= 2**31:
        raise ValueError("cache_seqlens: the total length must fit int32")
    return lengths
