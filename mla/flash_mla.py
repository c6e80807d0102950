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

How the metadata maps onto this package (``MLAMetadata`` has the details): a ``get_mla_metadata()`` metadata is
filled by its first eager call, which reads ``cache_seqlens`` to the host once and makes a ``mla.plan.DecodePlan``
(the split count from the exact lengths, the kernels built, the split workspace); every later call with the same
tensor signature only looks its prepared launch up, allocates ``out`` and ``lse`` and launches. Where the split grid
fits the GPU (Hopper; the small calls, whose host time shows) that launch is one kernel in FlashMLA's shapes
(``flash_io``); otherwise the package's kernels run on views of the caller's tensors, and the LSE is transposed and
fixed by one more launch when s_q > 1. A ``get_mla_metadata(cache_seqlens, ...)`` metadata, a call given
``num_splits``, a call made during CUDA-graph capture and a call with a strided block table take the graph form
instead: the split count of each sequence chosen on the device (``tl_kernels.mla_schedule``), read by a split
kernel in FlashMLA's shapes over a grid fixed by the batch size, then the combine in FlashMLA's shapes; nothing is
read on the host, so a captured graph replays at the split counts of each step's lengths.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
import re

import torch

from mla import jit, schedule, validate, workspace
from mla.constants import DEFAULT_SM_SCALE, KV_LORA_RANK, QK_DIM
from mla.launch import Launch
from mla.plan import DecodePlan, plan
from mla.target import spec_for_device
from mla.validate import FP8_DTYPES
from tl_kernels.mla_amax import AMAX_CTAS
from tl_kernels.mla_schedule import SplitScheduleConfig

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
    """FlashMLA's tile-scheduler metadata. Two kinds, by how it was made:

    - ``get_mla_metadata(cache_seqlens, ...)`` (FlashMLA's older pattern, SGLang's and vLLM's): a schedule on the
      device. ``num_splits`` ((batch + 1,) int32, FlashMLA's cumulative layout) holds each sequence's split count,
      chosen on the device from ``cache_seqlens`` (``tl_kernels.mla_schedule``; no host synchronisation). Every
      call with it runs the graph form: the split kernel in FlashMLA's shapes over a grid fixed by the batch size,
      each sequence taking the split count the ``num_splits`` passed to the call says (or, passed None, the one
      the call's first run computes from ``cache_seqlens`` on the device, inside a CUDA graph when captured), then
      the combine. So one metadata serves graphs of every batch size up to its own, and a replay splits as a call
      planned for the lengths of that step. ``copy_`` takes another one's schedule (SGLang's graph pattern).
    - ``get_mla_metadata()`` (FlashMLA's current pattern): filled by its first eager call, which reads
      ``cache_seqlens`` to the host once and plans (``mla.plan.DecodePlan``: the split count from the exact lengths,
      one launch for the small calls). Reuse it for every call over one batch layout (all layers of a step): q's
      batch, s_q and h_q, the page size, ``causal``, the formats must stay the same, and so must the lengths'
      values (FlashMLA's rule; not checked: that needs a host copy). A call made while a CUDA graph is being
      captured, a call given ``num_splits`` and a call whose block table is a strided slice run the graph form
      instead, as above.

    In the graph form nothing is read on the host: lengths past the block table's pages are not detected (FlashMLA
    does not check them either), and negative lengths count as 0.
    """

    def __init__(self, cache_seqlens: torch.Tensor | None = None, num_q_tokens_per_head_k: int | None = None,
                 num_heads_q: int | None = None, num_splits: torch.Tensor | None = None):
        self.have_initialized = False  # FlashMLA's name: set by the first call
        self.config: MetadataConfig | None = None  # the host plan's (first eager call of a get_mla_metadata() one)
        self.plan: DecodePlan | None = None
        self.lengths: list[int] | None = None  # the host plan's lengths
        self.cache_seqlens = cache_seqlens  # the lengths it was made from (never read on the host), or None
        self.num_splits = num_splits  # (batch + 1,) int32 device schedule, or None
        self.max_batch = None if cache_seqlens is None else cache_seqlens.shape[0]
        self.graph_kind: MetadataConfig | None = None  # what its graph-form calls are made for (batch 0: any)
        self._q_tokens = num_q_tokens_per_head_k
        self._heads_q = num_heads_q
        self._runs: dict = {}  # call signature -> prepared run

    def copy_(self, other: "MLAMetadata") -> "MLAMetadata":
        """FlashMLA's ``metadata.copy_(new_metadata)``: this metadata takes ``other``'s schedule (a device copy of its
        ``num_splits`` into the front of this one's), so the graphs captured with this one replay at the split
        counts of ``other``'s lengths. Both must come from ``get_mla_metadata(cache_seqlens, ...)`` with the same
        ``num_q_tokens_per_head_k``, ``other`` for at most as many sequences. Returns self."""
        if not isinstance(other, MLAMetadata):
            raise TypeError(f"other: expected an MLAMetadata (from get_mla_metadata), got {type(other).__name__}")
        if self.num_splits is None or other.num_splits is None:
            raise ValueError("copy_: both metadata must come from get_mla_metadata(cache_seqlens, ...); one made by "
                             "get_mla_metadata() holds no schedule to copy")
        if other._q_tokens != self._q_tokens:
            raise ValueError(f"other: made for num_q_tokens_per_head_k={other._q_tokens}, this metadata for "
                             f"{self._q_tokens}")
        if other.num_splits.device != self.num_splits.device:
            raise ValueError(f"other: on {other.num_splits.device}, this metadata on {self.num_splits.device}")
        count = other.num_splits.shape[0]
        if count > self.num_splits.shape[0]:
            raise ValueError(f"other: made for {count - 1} sequences, this metadata for at most {self.max_batch}")
        self.num_splits[:count].copy_(other.num_splits)
        return self

    def __repr__(self) -> str:
        if self.plan is not None:
            return f"MLAMetadata({self.config}, {self.plan})"
        if self.max_batch is not None:
            return f"MLAMetadata(device schedule, up to {self.max_batch} sequences, {len(self._runs)} runs)"
        return f"MLAMetadata(graph form, {len(self._runs)} runs)" if self._runs else "MLAMetadata(empty)"


def get_mla_metadata(*args, **kwargs) -> tuple[MLAMetadata, torch.Tensor | None]:
    """The scheduler metadata for ``flash_mla_with_kvcache``, as a ``(metadata, num_splits)`` pair.

    Both of FlashMLA's calling patterns work (see ``MLAMetadata``):
      - ``get_mla_metadata()`` (its current release): returns ``(MLAMetadata(), None)``, filled by the first decode
        call, which then reads ``cache_seqlens`` to the host once (eager calls; a captured call schedules on the
        device instead);
      - ``get_mla_metadata(cache_seqlens, num_q_tokens_per_head_k, num_heads_k, num_heads_q=None,
        is_fp8_kvcache=False, topk=None)`` (the older one, which serving engines call every step): no host
        synchronisation. ``cache_seqlens`` ((batch,) int32, contiguous) stays on the device: one small kernel
        writes each sequence's split count into ``num_splits``, a (batch + 1,) int32 device tensor of cumulative
        counts (FlashMLA's layout), which the decode calls read when it is passed to them (or a copy of it: the
        engines' graph buffers). ``num_q_tokens_per_head_k`` = s_q * h_q (one KV head); ``num_heads_k`` must be 1;
        ``topk`` (sparse attention) must be None. The counts follow the cost model of a bf16 (or, with
        ``is_fp8_kvcache``, fp8) cache; other caches take them as they are (only speed depends on them).
    """
    if not args and not kwargs:
        return MLAMetadata(), None
    return _legacy_metadata(*args, **kwargs)


def _legacy_metadata(cache_seqlens, num_q_tokens_per_head_k, num_heads_k, num_heads_q=None, is_fp8_kvcache=False,
                     topk=None) -> tuple[MLAMetadata, torch.Tensor]:
    validate.check_tensor("cache_seqlens", cache_seqlens, (torch.int32,), 1)
    if not cache_seqlens.is_contiguous():
        raise ValueError("cache_seqlens: expected a contiguous tensor")
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
    batch = cache_seqlens.shape[0]
    num_splits = torch.empty(batch + 1, dtype=torch.int32, device=cache_seqlens.device)
    spec = spec_for_device(cache_seqlens.device)
    model = _legacy_model(spec, batch, num_q_tokens_per_head_k, num_heads_q, is_fp8_kvcache)
    _schedule(spec, cache_seqlens, num_splits, model)
    return MLAMetadata(cache_seqlens, num_q_tokens_per_head_k, num_heads_q, num_splits), num_splits


@functools.lru_cache(maxsize=4096)
def _legacy_model(spec, batch: int, num_q_tokens: int, num_heads_q: int | None, is_fp8: bool):
    """The split model ``get_mla_metadata(cache_seqlens, ...)`` schedules with (cached: engines call it every
    step, with few distinct batch sizes)."""
    heads, s_q = _heads_and_queries(num_q_tokens, num_heads_q)
    cfg = _model_config(spec, kv_format="fp8" if is_fp8 else "bf16", q_format="bf16", heads=heads, s_q=s_q,
                        causal=s_q > 1, page=64)
    return schedule.split_model(spec, cfg, batch=batch)


def _heads_and_queries(num_q_tokens: int, num_heads_q: int | None) -> tuple[int, int]:
    """(h_q, s_q) of ``num_q_tokens_per_head_k`` = s_q * h_q: ``num_heads_q`` when given, else the most heads the
    kernels take that divide it (the cost model only needs the rows of a CTA, which both readings share)."""
    if num_heads_q is not None:
        return num_heads_q, num_q_tokens // num_heads_q
    for heads in sorted(validate.SUPPORTED_HEADS, reverse=True):
        if num_q_tokens % heads == 0:
            return heads, num_q_tokens // heads
    raise ValueError(f"num_q_tokens_per_head_k: expected s_q * h_q with h_q in {validate.SUPPORTED_HEADS}, got "
                     f"{num_q_tokens}")


def _model_config(spec, *, kv_format: str, q_format: str, heads: int, s_q: int, causal: bool, page: int):
    """The decode config whose cost model schedules the graph form (gfx942, which has no graph-form kernel: its
    split kernel's)."""
    problem = dict(kv_format=kv_format, q_format=q_format, num_heads=heads, q_tile=schedule.query_tile(s_q, 1),
                   causal=causal, page_size=page)
    return schedule.graph_config(spec, **problem) or schedule.decode_config(spec, split=True, **problem)


def _schedule(spec, cache_seqlens: torch.Tensor, num_splits: torch.Tensor, model: schedule.SplitModel) -> None:
    """Each sequence's split count from ``cache_seqlens`` into ``num_splits`` (cumulative): the schedule kernel on
    the GPU (asynchronous); on a CPU tensor (lowering-only tests) the same computation on the host."""
    if cache_seqlens.device.type == "cuda":
        jit.get_launcher(SplitScheduleConfig(), spec)(cache_seqlens, num_splits, *model.args())
    else:
        counts = schedule.device_split_counts(cache_seqlens.tolist(), model)
        num_splits.copy_(torch.tensor(counts, dtype=torch.int32))


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
        ``block_table[b, p // page_block_size]``; entries past a sequence's blocks are never read. Rows may be a
        slice of a wider buffer (any row stride, consecutive entries): its columns past max_blocks are read where
        a sequence needs them (the engines' graph pattern).
      cache_seqlens: (batch,) int32 KV lengths, contiguous (see ``MLAMetadata`` for what may change between calls).
      head_dim_v: 512.
      tile_scheduler_metadata: from ``get_mla_metadata`` (reused across calls: see ``MLAMetadata``).
      num_splits: None, or (batch + 1,) int32 cumulative split counts on the device, as ``get_mla_metadata``
        returns them (or a copy: an engine's graph buffer, refilled every step); the kernels read it.
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
        # The graph form (see MLAMetadata): a device schedule, a num_splits to read, or CUDA-graph capture.
        graph = (num_splits is not None or meta.num_splits is not None
                 or q.is_cuda and torch._C._cuda_isCurrentStreamCapturing())
        key = (graph, q.dtype, q.shape, q.device, q.stride(),
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
        run = _prepare(key, q, k_cache, block_table, cache_seqlens, head_dim_v, meta, num_splits, causal,
                       is_fp8_kvcache, descale_q, descale_k, kv_block_scale, q_format)
    sm_scale = DEFAULT_SM_SCALE if softmax_scale is None else validate.check_sm_scale(softmax_scale)
    return run(q, k_cache, block_table, cache_seqlens, descale_q, descale_k, kv_block_scale, sm_scale, num_splits)


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

    def __call__(self, q, k_cache, block_table, cache_seqlens, descale_q, descale_k, kv_block_scale, sm_scale,
                 num_splits):
        out = torch.empty(*self.out_shape, dtype=_BF16, device=self.device)
        lse = torch.empty(*self.lse_shape, dtype=_FP32, device=self.device)
        block_scales, q_scale, kv_scale = _scale_operands(self, kv_block_scale, descale_q, descale_k, self.q_scale)
        self.decode(q, k_cache, block_scales, self.scale_stride, q_scale, kv_scale, cache_seqlens, block_table,
                    sm_scale, self.num_splits, self.o_partial, self.lse_partial, out, lse)
        return out, lse


def _scale_operands(run, kv_block_scale, descale_q, descale_k, q_scale):
    """(block scales, Q scale, KV scale) arguments of a FlashMLA-shaped run's kernel: the run's constants, or the
    caller's tensors viewed as the kernel takes them (the mxfp4 scales flat, the descales as (1,)); ``q_scale`` None:
    the caller's descale_q."""
    block_scales = run.block_scales
    if block_scales is None:
        block_scales = (kv_block_scale.view(torch.uint8) if run.block_scale_as_uint8 else kv_block_scale
                        ).as_strided((run.block_scale_len,), (1,))
    if q_scale is None:
        q_scale = descale_q.reshape(1) if run.reshape_q_scale else descale_q
    kv_scale = run.kv_scale
    if kv_scale is None:
        kv_scale = descale_k.reshape(1) if run.reshape_kv_scale else descale_k
    return block_scales, q_scale, kv_scale


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
                 "lse_shape", "fix_lse", "s_q", "on_cuda", "lengths_on_device")

    def __init__(self, launch: Launch, the_plan: DecodePlan, batch: int, s_q: int, h_q: int, lonely: bool,
                 lengths_on_device: bool = False):
        self.launch, self.ws = launch, the_plan.workspace
        self.qo_indptr, self.kv_indptr = the_plan.qo_indptr, the_plan.kv_indptr
        self.q_rows_shape = (batch * s_q, h_q, QK_DIM)
        self.out_shape = (batch, s_q, h_q, KV_LORA_RANK)
        self.lse_rows_shape = (batch, s_q, h_q)
        self.lse_shape = (batch, h_q, s_q)
        self.fix_lse = lonely  # some query sees no token: its LSE must read +inf (the kernels write -inf)
        self.s_q = s_q
        self.on_cuda = launch.device.type == "cuda"
        # gfx942's graph form: a plan for the block table's capacity, the offsets from cache_seqlens at every call.
        self.lengths_on_device = lengths_on_device

    def __call__(self, q, k_cache, block_table, cache_seqlens, descale_q, descale_k, kv_block_scale, sm_scale,
                 num_splits):
        kv_indptr, fix_lse = self.kv_indptr, self.fix_lse
        if self.lengths_on_device or self.on_cuda and torch._C._cuda_isCurrentStreamCapturing():
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


def _check_and_prepare(key, q, k_cache, block_table, cache_seqlens, head_dim_v, meta, num_splits, causal,
                       is_fp8_kvcache, descale_q, descale_k, kv_block_scale, q_format) -> _Run:
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
    if num_splits is not None:
        validate.check_tensor("num_splits", num_splits, (torch.int32,), 1)
        if num_splits.shape[0] != batch + 1:
            raise ValueError(f"num_splits: expected ({batch + 1},) (batch + 1 cumulative split counts, as "
                             f"get_mla_metadata returns them), got shape {tuple(num_splits.shape)}")
        validate.check_same_device("num_splits", num_splits, q.device)
        if not num_splits.is_contiguous():
            raise ValueError("num_splits: expected a contiguous tensor")
    validate.check_tensor("block_table", block_table, (torch.int32,), 2)
    validate.check_same_device("block_table", block_table, q.device)
    if block_table.shape[0] != batch:
        raise ValueError(f"block_table: expected {batch} rows (one per sequence), got shape "
                         f"{tuple(block_table.shape)}")
    graph = (num_splits is not None or meta.num_splits is not None or not _row_major(block_table)
             or q.is_cuda and torch._C._cuda_isCurrentStreamCapturing())
    if graph:
        return _prepare_graph_run(key, q, k_cache, block_table, meta, config, descale_q, descale_k, kv_block_scale)
    return _prepare_run(key, q, k_cache, block_table, cache_seqlens, meta, config, descale_q, descale_k,
                        kv_block_scale)


def _prepare_run(key, q, k_cache, block_table, cache_seqlens, meta, config, descale_q, descale_k, kv_block_scale):
    batch, s_q, h_q, page = config.batch, config.s_q, config.h_q, config.page_block_size
    validate.check_page_table(block_table, batch, q.device)
    if meta.graph_kind is not None and meta.graph_kind != _kind(config):
        raise ValueError("tile_scheduler_metadata: " + _mismatch(meta.graph_kind, _kind(config)) + "; metadata is "
                         "made for one batch layout: call get_mla_metadata() again for another")
    if meta.plan is None:
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
    """The host plan (a get_mla_metadata() metadata's first eager call): the split count from the exact lengths,
    read to the host once, the kernels built, the workspace."""
    meta.lengths = lengths = _host_lengths(cache_seqlens)
    _check_capacity(block_table, config.page_block_size, lengths)
    the_plan = plan(list(range(0, (config.batch + 1) * config.s_q, config.s_q)),
                    [0, *itertools.accumulate(lengths)], num_heads=config.h_q, kv_format=config.kv_format,
                    q_format=config.q_format, causal=config.causal and config.s_q > 1,
                    page_size=config.page_block_size, page_table=block_table, device=config.device)
    meta.plan, meta.config, meta.have_initialized = the_plan, config, True


def _kind(config: MetadataConfig) -> MetadataConfig:
    """What must match across every call of a metadata in the graph form: all but the batch size (and ``causal``
    where s_q is 1: a no-op there, FlashMLA's rule)."""
    return dataclasses.replace(config, batch=0, causal=config.causal and config.s_q > 1)


def _prepare_graph_run(key, q, k_cache, block_table, meta, config, descale_q, descale_k, kv_block_scale):
    """A call signature in the graph form (see ``MLAMetadata``): the checks against what the metadata was made
    for, then the run (``_GraphRun``; gfx942: ``_Run`` over a plan for the block table's capacity)."""
    batch, s_q, h_q, page = config.batch, config.s_q, config.h_q, config.page_block_size
    kind = _kind(config)
    made = meta.graph_kind or (_kind(meta.config) if meta.config is not None else None)
    if made is not None and made != kind:
        raise ValueError("tile_scheduler_metadata: " + _mismatch(made, kind) + "; metadata is made for one batch "
                         "layout: call get_mla_metadata() again for another")
    if meta.max_batch is not None and batch > meta.max_batch:
        raise ValueError(f"cache_seqlens: get_mla_metadata was given {meta.max_batch} lengths, q has batch {batch} "
                         f"(a metadata serves batches up to the one it was made for)")
    if meta._q_tokens is not None and meta._q_tokens != s_q * h_q:
        raise ValueError(f"q: get_mla_metadata was given num_q_tokens_per_head_k={meta._q_tokens}, q has s_q * h_q "
                         f"= {s_q * h_q}")
    if meta._heads_q is not None and meta._heads_q != h_q:
        raise ValueError(f"q: get_mla_metadata was given num_heads_q={meta._heads_q}, q has {h_q} heads")
    if block_table.shape[1] > 1 and block_table.stride(1) != 1:
        raise ValueError(f"block_table: expected each row's entries consecutive (column stride 1), got strides "
                         f"{block_table.stride()}")
    if not _row_major(k_cache):
        raise ValueError(f"k_cache: expected a contiguous tensor, got strides {k_cache.stride()}")
    q_rows = q.view(batch * s_q, h_q, QK_DIM)
    indptr = torch.empty(batch + 1, dtype=torch.int32, device=q.device)  # shape only: the checks read no value
    call = validate.check_call(q_rows, k_cache, indptr, indptr, descale_k, kv_block_scale, None, config.q_format,
                               descale_q, paged=True)
    spec = call.spec
    cfg = schedule.graph_config(spec, kv_format=config.kv_format, q_format=call.kernel_q_format, num_heads=h_q,
                                q_tile=schedule.query_tile(s_q, 1), causal=config.causal and s_q > 1, page_size=page)
    if cfg is None:  # gfx942: the package's kernels on views, split for the block table's capacity
        if not _row_major(block_table):
            raise ValueError("block_table: gfx942's kernels read a contiguous table (no graph-form kernel there "
                             "yet); pass block_table.contiguous()")
        capacity = block_table.shape[1] * page
        the_plan = plan(list(range(0, (batch + 1) * s_q, s_q)), [capacity * b for b in range(batch + 1)],
                        num_heads=h_q, kv_format=config.kv_format, q_format=config.q_format,
                        causal=config.causal and s_q > 1, page_size=page, page_table=block_table, device=q.device)
        launch = the_plan.prepare(q_rows, k_cache, kv_scale=descale_k, kv_block_scale=kv_block_scale,
                                  q_scale=descale_q)
        run = _Run(launch, the_plan, batch, s_q, h_q, True, lengths_on_device=True)
    else:
        run = _GraphRun(call, cfg, batch, s_q, h_q)
    meta.graph_kind, meta.have_initialized = kind, True
    if key is not None:
        meta._runs[key] = run
    return run


class _GraphRun:
    """One call signature in the graph form: the split kernel in FlashMLA's shapes (``split_counts``) over a grid of
    ``max_splits`` splits per sequence (``schedule.split_model``), each sequence taking the count ``num_splits``
    gives it (the caller's, or the run's own, computed on the device from ``cache_seqlens`` by its first call and
    again by its first call inside each CUDA-graph capture), then the combine's flash form. Nothing is read on the
    host, so a captured graph replays at the split counts of the lengths of each step."""

    __slots__ = ("decode", "combine", "schedule", "model", "max_splits", "own_splits", "fresh", "in_capture",
                 "out_shape", "lse_shape", "device", "on_cuda", "o_numel", "lse_numel", "scratch_numel",
                 "block_scales", "block_scale_len", "block_scale_as_uint8", "scale_stride", "q_mode", "q_scale",
                 "reshape_q_scale", "kv_scale", "reshape_kv_scale", "kv_as_uint8", "dummy", "amax", "q_rows_shape")

    def __init__(self, call, cfg, batch: int, s_q: int, h_q: int):
        spec, device = call.spec, call.device
        self.decode = jit.get_launcher(cfg, spec)
        self.model = schedule.split_model(spec, cfg, batch=batch)
        self.max_splits = self.model.max_splits
        self.combine = (jit.get_launcher(schedule.graph_combine_config(spec, num_heads=h_q,
                                                                       max_splits=self.max_splits), spec)
                        if self.max_splits > 1 else None)
        self.schedule = jit.get_launcher(SplitScheduleConfig(), spec)
        # a8w8 from bf16 Q: amax(|q|) by our kernel where the target has it (``schedule.amax_config``), else torch's
        amax_cfg = schedule.amax_launch(spec, cfg, q_format=call.kernel_q_format, num_heads=h_q)
        self.amax = None if amax_cfg is None else jit.get_launcher(amax_cfg, spec)
        self.q_rows_shape = (batch * s_q, h_q, QK_DIM)
        self.own_splits = torch.zeros(batch + 1, dtype=torch.int32, device=device)
        self.fresh, self.in_capture = True, False
        self.out_shape, self.lse_shape = (batch, s_q, h_q, KV_LORA_RANK), (batch, h_q, s_q)
        self.device, self.on_cuda = device, device.type == "cuda"
        # Workspace (float32): the flat partials, then amax(|q|) for a8w8 from bf16 Q and the amax kernel's partials
        # (int32); each part 256 B aligned.
        rows = batch * s_q * h_q
        self.o_numel = self.max_splits * rows * KV_LORA_RANK if self.max_splits > 1 else 0
        self.lse_numel = self.max_splits * rows if self.max_splits > 1 else 0
        self.q_mode = call.kernel_q_format
        self.scratch_numel = _aligned(self.o_numel) + _aligned(self.lse_numel) + 1 + AMAX_CTAS
        self.dummy = workspace.dummy_fp32(device)
        self.block_scales = None if call.block_scale_len else workspace.no_block_scales(device)
        self.block_scale_len, self.block_scale_as_uint8 = call.block_scale_len, call.block_scale_as_uint8
        self.scale_stride = call.scale_stride
        self.q_scale = workspace.unit_scale(device) if self.q_mode == "bf16" else None
        self.reshape_q_scale = call.reshape_q_scale
        self.kv_scale = None if call.kv_format == "fp8" else workspace.unit_scale(device)
        self.reshape_kv_scale = call.reshape_kv_scale
        self.kv_as_uint8 = call.kv_as_uint8

    def _workspace(self):
        """(o_partial, lse_partial, amax (0-d), amax as (1,), the amax kernel's partials): views of the stream's
        scratch when eager, of an allocation that belongs to the graph inside capture."""
        found = workspace.scratch(self.device, self.scratch_numel)
        if found is not None:
            views = found.views.get(self)
            if views is None:
                if len(found.views) >= workspace.SCRATCH_VIEWS:
                    found.views.clear()
                views = found.views[self] = self._views(found.buffer)
            return views
        return self._views(torch.empty(self.scratch_numel, dtype=_FP32, device=self.device))

    def _views(self, buf):
        lse_at, amax_at = _aligned(self.o_numel), _aligned(self.o_numel) + _aligned(self.lse_numel)
        if self.max_splits > 1:
            o_partial, lse_partial = buf.narrow(0, 0, self.o_numel), buf.narrow(0, lse_at, self.lse_numel)
        else:  # every sequence runs one split, which writes the output itself
            o_partial = lse_partial = self.dummy
        partials = buf.narrow(0, amax_at + 1, AMAX_CTAS).view(torch.int32)
        return o_partial, lse_partial, buf.as_strided((), (), amax_at), buf.narrow(0, amax_at, 1), partials

    def __call__(self, q, k_cache, block_table, cache_seqlens, descale_q, descale_k, kv_block_scale, sm_scale,
                 num_splits):
        out = torch.empty(*self.out_shape, dtype=_BF16, device=self.device)
        lse = torch.empty(*self.lse_shape, dtype=_FP32, device=self.device)
        o_partial, lse_partial, amax, amax_arg, amax_partials = self._workspace()
        if num_splits is None:
            num_splits = self.own_splits
            capturing = self.on_cuda and torch._C._cuda_isCurrentStreamCapturing()
            if self.fresh or capturing and not self.in_capture:
                self.schedule(cache_seqlens, num_splits, *self.model.args())
                self.fresh = False
            self.in_capture = capturing
        q_scale = self.q_scale
        if self.q_mode == "fp8":  # a8w8 from bf16 Q: amax(|q|) on the device (see mla.launch), the kernel rounds Q
            if self.amax is not None:  # its ticket: the stream's zeroed cell (inside capture, the graph's own)
                self.amax(q.view(*self.q_rows_shape), amax_arg, amax_partials, workspace.amax_cell(self.device))
            else:
                torch.linalg.vector_norm(q, ord=_INF, dtype=_FP32, out=amax)
            q_scale = amax_arg
        block_scales, q_scale, kv_scale = _scale_operands(self, kv_block_scale, descale_q, descale_k, q_scale)
        if self.kv_as_uint8:
            k_cache = k_cache.view(torch.uint8)
        if block_table.stride(0) != block_table.shape[1]:  # a slice of a wider buffer (one row included)
            block_table = _whole_rows(block_table)
        self.decode(q, k_cache, block_scales, self.scale_stride, q_scale, kv_scale, cache_seqlens, block_table,
                    sm_scale, self.max_splits, num_splits, o_partial, lse_partial, out, lse)
        if self.combine is not None:
            self.combine(o_partial, lse_partial, num_splits, self.max_splits, out, lse)
        return out, lse


def _whole_rows(block_table: torch.Tensor) -> torch.Tensor:
    """A block table that is a slice of a wider buffer, as a compact (batch, row stride) view of that buffer (its
    rows read whole, so entries past the slice's width are there for the sequences that need them): the launcher
    would otherwise pass a compact copy of the slice, which ends at its width. Where the buffer ends within the last
    row, the slice as it is."""
    batch, stride = block_table.shape[0], block_table.stride(0)
    end = block_table.storage_offset() + batch * stride
    if block_table.stride(1) != 1 or end * block_table.element_size() > block_table.untyped_storage().nbytes():
        return block_table
    return block_table.as_strided((batch, stride), (stride, 1))


def _aligned(numel: int) -> int:
    return -(-numel // 64) * 64


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
