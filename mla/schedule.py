"""Scheduling: which kernel config and how many KV splits. Pure functions of host-known sizes (no device data,
no host-device sync), so they are cheap, CUDA-graph safe and testable on the CPU."""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math

from mla import constants
from mla.target import TargetSpec
from tl_kernels.mla_amax import AmaxKernelConfig
from tl_kernels.mla_combine import CombineKernelConfig
from tl_kernels.mla_decode import DIM_SPLIT_SHAPE, DecodeKernelConfig
from tl_kernels.mla_decode_ws import WSDecodeKernelConfig
from tl_kernels.mla_decode_rows import ROWS_KV_FORMATS, RowsDecodeKernelConfig

MAX_SPLITS = 64
# Cost model of one CTA, in units of "one KV tile streamed": fixed work per CTA (Q load, output write, launch
# ramp) and the extra cost of the combine kernel when the KV is split. Tuned on the H200 (docs/perf.md).
CTA_OVERHEAD_TILES = 2.0
COMBINE_OVERHEAD_TILES = 2.0
COMBINE_TILES_PER_SPLIT = 0.1  # the combine reads every split's partial output: its cost grows with the count
# The warp-specialised kernel merges the splits itself (the last CTA of a sequence reads every partial): no second
# launch, only the reading. Tuned on the H200 (docs/perf.md, run 14).
WS_COMBINE_OVERHEAD_TILES = 0.5
WS_COMBINE_TILES_PER_SPLIT = 0.25
# Hopper's 16/32/64-row kernel can merge its splits itself (``fused_combine``: one launch per call instead of decode
# + combine, ~4-8 us less host time per call on the H200 host): the CTAs write their partials, meet at a grid-wide
# barrier, and each merges a share of its (sequence, head group)'s output. The barrier needs every CTA resident at
# once (the launch is cooperative), so the op picks this form only for grids of at most one CTA per SM
# (``fused_fits``): the small problems, where the host's launch time shows. Larger grids keep decode + combine.
# (Run 18's fused merge, by the last CTA of each group alone, cost more GPU time than the launch saves.)
# gfx942 always uses the combine kernel.
FUSED_COMBINE_ON_CUDA = True
# A fused grid of two CTAs per SM (where both surely fit: 128 threads, shared memory for two) was slower (run 52, H100,
# same run; the override that tried it, ``fused_ctas_per_sm``, is in commit a90a0fa): 32 x 1024 and 64 x 1024 as one
# fused launch of 256 CTAs instead of decode + combine, bf16 31.7 -> 33.8 and 47.7 -> 52.9 us, fp8 27.8 -> 32.4 and 38.4
# -> 44.6, mxfp4 27.2 -> 31.9 and 38.8 -> 45.6 (a8w8 38.7 -> 37.5 and 49.4 -> 50.8: its amax reduction launch goes); 4 x
# 8192 at 64 splits fused 38.5-63.3 against 31.2-36.0 at 32. So fused grids keep one CTA per SM.
# The 16/32/64-row kernel's compressed tiles on CUDA: whole 16-code chunks loaded into registers (a flat cache's one
# tile ahead) and decoded by bit placement (``DecodeKernelConfig.fast_decode``), not one element at a time.
FAST_DECODE_ON_CUDA = True
# Depth of the warp-specialised kernel's 16-bit ring: two 72 KiB stages, one CTA per SM (a third stage never helped
# bf16, docs/perf.md run 14; the fp8 / mxfp4 decoders hold exactly two tiles in registers).
WS_STAGES = 2


@dataclasses.dataclass(frozen=True)
class WSDefault:
    """Where and how the op's default runs the warp-specialised kernel for one cache format (16-row class on
    Hopper; Q formats: ``WS_Q_FORMATS``)."""

    min_tokens: int  # cached tokens from which the default picks it (bf16 Q, flat cache)
    fp8_q_min_tokens: int | None  # the same for fp8 Q (a8w8); None: a8w8 keeps the 16-row kernel
    paged_min_tokens: int | None  # the same for a paged cache (bf16 Q); None: paged caches keep the 16-row kernel
    l2_prefetch: int  # ``WSDecodeKernelConfig.l2_prefetch``: tiles ahead the producers ask L2 for (0: none)
    direct_stores: bool  # ``WSDecodeKernelConfig.direct_stores``: decoder stores by address (no decoder barriers)
    ordered_decode: bool  # ``WSDecodeKernelConfig.ordered_decode``: decodes kept below the free-stage wait
    fp8_mma: bool = False  # ``WSDecodeKernelConfig.fp8_mma``: fp8 codes straight into fp8 wgmma (no decoders)
    p_split: bool = False  # ``WSDecodeKernelConfig.p_split``: with fp8_mma, P as two e4m3 terms
    q_stack: bool = False  # ``WSDecodeKernelConfig.q_stack``: with fp8_mma and bf16 Q, both Q terms in one wgmma
    p_stack: bool = False  # ``WSDecodeKernelConfig.p_stack``: with p_split, both P terms in one wgmma
    # Q formats whose default ring is persistent: every role's tile step in one copy (``dynamic_stage``) and one CTA
    # per SM walking the work items (``persistent_ctas`` = the target's SM count)
    persistent_q_formats: tuple[str, ...] = ()


# Flat fp8 and mxfp4 caches from 256 Ki tokens (bf16 Q; fp8 also with fp8 Q): below that the 16-row kernel with its
# bit-placement decode (``fast_decode``) is faster (run 33, H100, same-run A/B on the decoder ring: mxfp4 64 x 1024
# 40.3 vs 58.8 us; fp8's ring since: run 52 below). mxfp4 moved from 512 Ki to 256 Ki after its decoder ring had
# gained ``ordered_decode`` and stores by address (run 58, H100, same call: the ring forced at 32 x 8192 89.6 us and
# 256 x 1024 87.4, the 16-row kernel 107.5 / 103.8; run 33 had the ring behind there, 118.0 / 97.7 vs 107.7 / 103.6).
# Paged mxfp4 caches from 64 Ki tokens (run 15, H200, against the 16-row kernel's staged element-wise decode, which
# paged caches still take); paged fp8 is not timed on the WS kernel. mxfp4: bf16 Q only, no prefetch (faster with it
# on an H100, slower on an H200, runs 24-25), decoder stores by address with the decodes kept below the free-stage
# wait (run 34, H100: 217.7 -> 174.4 us at 64 x 8192, 607.6 -> 565.8 at 256 x 8192; fp8 is slower with the latter:
# 179.5 -> 197.3, 607.1 -> 625.0). fp8: prefetching 3 tiles ahead (its decoders: 88.5% of the read ceiling with 3,
# 79% without, 6 evicts before use; runs 24-25) and storing by address (run 30: 724 -> 606 us at 256 x 8192). bf16
# caches (whose cp.async copier the prefetch slows) keep the 16-row kernel.
WS_DEFAULTS = {
    "mxfp4": WSDefault(min_tokens=256 * 1024, fp8_q_min_tokens=None, paged_min_tokens=64 * 1024, l2_prefetch=0,
                       direct_stores=True, ordered_decode=True),
    "fp8": WSDefault(min_tokens=256 * 1024, fp8_q_min_tokens=256 * 1024, paged_min_tokens=None, l2_prefetch=3,
                     direct_stores=True, ordered_decode=False, fp8_mma=True, p_split=True, q_stack=True,
                     p_stack=True, persistent_q_formats=("bf16",)),
}
# fp8 caches (bf16 or fp8 Q) on the fp8 wgmma ring with P as two e4m3 terms (``fp8_mma``, ``p_split``; run 50, H100,
# 256 x 8192: a8w8 441.9 vs 616.5 us on the decoder ring, fp8 523.8 vs 609.7; 64 x 8192: 140.3 vs 188.7, 150.3 vs
# 172.1). P in one e4m3 term is 2-17% faster but misses the per-sequence gate on short sequences (runs 48-49); the
# fp8 decoder tunings above (l2_prefetch, direct_stores) are then the opt-out's (``fp8_mma=False``). Both terms of P
# (and bf16 Q's two terms) in one m64n32 wgmma group each (``p_stack``, ``q_stack``; run 51, H100, 256 x 8192: fp8
# 518.2 -> 428.0 us, a8w8 427.7 -> 420.1; 64 x 8192: fp8 130.8 against the bench's 148.1 for P split alone).
# That ring from 256 Ki tokens (run 52, H100, same run against the 16-row kernel: 32 x 8192 fp8 82.2 vs 97.3 us, a8w8
# 92.0 vs 108.9; 256 x 1024 83.5 vs 94.4, 89.6 vs 109.1); at 64 Ki tokens it ties (64 x 1024 fp8 38.8 vs 38.6) or
# loses (a8w8 51.3 vs 49.7; 4 x 8192 59.9 vs 31.6: four sequences fill few SMs with one CTA each).
# bf16 Q's ring persistent (``persistent_q_formats``; run 62b, H100, same-run A/B, GPU time alone, two passes within
# 1%): 256 x 8192 437.8 -> 414.4 us, 64 x 8192 131.9 -> 128.8, 256 x 1024 83.1 -> 81.0; 32 x 8192 (128 work items,
# one wave) 81.4 -> 81.7. a8w8's is 0.5-3% slower persistent (256 x 8192 415.7 -> 419.2, 256 x 1024 85.0 -> 87.0) and
# keeps one CTA per work item. (Q's rows in a loop, ``q_loop_rows``, was 1-4% slower for both: not taken.)
# Every format: the MMA warp group's softmax with one barrier per tile and its score wgmma waited for once
# (``fast_softmax``, ``score_group``; run 28, H100: the MMA warp group alone 525 -> 311 us at 256 x 8192).
WS_CONSUMER = dict(fast_softmax=True, score_group=True)
WS_FORMATS = tuple(WS_DEFAULTS)
WS_Q_FORMATS = ("bf16", "fp8")  # "fp8": a8w8 (bf16 Q rounded to fp8 in the kernel), where fp8_q_min_tokens says


def decode_config(
    spec: TargetSpec,
    *,
    kv_format: str,
    q_format: str = "bf16",
    num_heads: int = 16,
    q_tile: int = 1,
    causal: bool = False,
    split: bool = True,
    page_size: int = 0,
    **overrides,
) -> DecodeKernelConfig:
    """The decode kernel config for a target and a problem class (not a problem size). ``overrides``
    (DecodeKernelConfig fields) replace the defaults: for tuning sweeps."""
    if spec.is_hip:
        return _hip_decode_config(spec, kv_format=kv_format, q_format=q_format, num_heads=num_heads, causal=causal,
                                  split=split, page_size=page_size, overrides=overrides)
    block_h = min(num_heads, max(16, 64 // q_tile))
    block_m = block_h * q_tile
    # 128 threads for 16 rows (4 warps on Hopper, 2 wave64s on gfx942: each still owns a whole 16-wide MMA tile
    # of a 32-token KV tile); 256 for more rows, so a 64-row fp32 accumulator stays in registers (64 KiB over 256
    # lanes). KV tile: the largest that fits the shared memory / LDS budget.
    threads = 256 if block_m > 16 else 128
    block_ns = (64, 32)
    if block_m == 32 and not spec.is_hip:
        # 32 rows (16 heads x 2 queries, or 32 heads): a 32-token tile and 128 threads take 77 KB, so two CTAs share
        # an SM; with 64 tokens and 256 threads (118 KB) only one fits, and nothing overlaps its loads. 18-22%
        # faster on large batches, 5% slower at 4 x 8192 (docs/perf.md, run 12). (32 tokens with 256 threads does
        # not lower in TileLang 0.1.15: a layout conflict between the rescale vector and the output accumulator.)
        block_ns, threads = (32,), 128
    for block_n in block_ns:
        cfg = DecodeKernelConfig(
            kv_format=kv_format,
            q_format=q_format,
            num_heads=num_heads,
            block_h=block_h,
            q_tile=q_tile,
            block_n=block_n,
            num_stages=1,
            threads=threads,
            causal=causal,
            split=split,
            page_size=page_size,
            # Compressed tiles of a flat cache are dequantized straight from global memory: on the H200 that beat
            # staging them in shared memory first (docs/perf.md, run 3). A paged cache's rows are gathered, and
            # there staging them asynchronously first wins: fp8 1.7x, mxfp4 2.7x (run 12). gfx942 has no async
            # copy to LDS, so it never stages.
            stage_compressed=bool(page_size) and kv_format != "bf16" and not spec.is_hip,
            # Paged: the tile's row table as a static shared array on CUDA (run 12); in dynamic LDS on gfx942, where
            # every LDS byte is counted in the kernel's dynamic allocation (tests/test_gfx942.py) and nothing was
            # measured.
            row_table_scope="shared.dyn" if spec.is_hip else "shared",
            fp8_dtype=spec.fp8_tl_dtype,
        )
        cfg = dataclasses.replace(cfg, **overrides)
        if "fast_decode" not in overrides:
            # A compressed tile read from global memory on CUDA: whole 16-code chunks, decoded by bit placement.
            cfg = dataclasses.replace(cfg, fast_decode=FAST_DECODE_ON_CUDA and fast_decode_fits(cfg))
        if cfg.shared_bytes <= spec.smem_bytes:
            return cfg
    raise ValueError(f"no decode config fits {spec.smem_bytes} B of shared memory on {spec.name}")


def fast_decode_fits(cfg: DecodeKernelConfig) -> bool:
    """Whether ``cfg`` (with its fast_decode off) has a fast_decode form: a compressed cache read from global memory by
    the block-level program, whose threads split the tile's latent and rope chunks evenly."""
    try:
        dataclasses.replace(cfg, fast_decode=True)
    except ValueError:
        return False
    return True


def _hip_decode_config(spec: TargetSpec, *, kv_format: str, q_format: str, num_heads: int, causal: bool, split: bool,
                       page_size: int, overrides: dict) -> DecodeKernelConfig:
    """gfx942: the wave-level ``dim_split`` program (tl_kernels/mla_decode.py): 16 heads x 1 query per workgroup (more
    heads take more head groups, more queries more passes), 8 wave64s (512 threads) sharing one 32-token KV tile,
    48 KiB of LDS, so one workgroup fills a CU with 8 waves (2 per SIMD; the block-level kernel reached 2 waves per
    CU there, LDS-bound). Tiles are prefetched into registers one ahead (there is no async copy to LDS on gfx942
    besides 4-byte buffer loads), so nothing is staged. a8w8 runs Q K^T on the fp8 MFMA."""
    block_h, q_tile, block_n, threads = DIM_SPLIT_SHAPE
    cfg = DecodeKernelConfig(
        kv_format=kv_format,
        q_format=q_format,
        num_heads=num_heads,
        block_h=block_h,
        q_tile=q_tile,
        block_n=block_n,
        threads=threads,
        causal=causal,
        split=split,
        page_size=page_size,
        fp8_dtype=spec.fp8_tl_dtype,
        dim_split=True,
        fp8_mfma=kv_format == "fp8" and q_format != "bf16",
    )
    cfg = dataclasses.replace(cfg, **overrides)
    if cfg.shared_bytes > spec.smem_bytes:
        raise ValueError(f"no decode config fits {spec.smem_bytes} B of LDS on {spec.name}")
    return cfg


def query_tile(total_q: int, batch: int) -> int:
    """Query tokens per CTA pass, from the mean query length (queries beyond it take extra passes)."""
    return 1 if total_q <= batch else (2 if total_q <= 2 * batch else 4)


def default_num_splits(spec: TargetSpec, cfg: DecodeKernelConfig, *, batch: int, total_kv: int) -> int:
    """``choose_num_splits`` with the occupancy of ``cfg`` on ``spec`` and the merge it has (the combine kernel, or
    the fused merge): what the op uses when not told."""
    merge = {}
    occupancy = ctas_per_sm(spec, cfg)
    if cfg.fused_combine:  # forced (tuning): one CTA per SM at most (``fused_fits``)
        occupancy = 1
        merge = dict(combine_overhead=WS_COMBINE_OVERHEAD_TILES, combine_per_split=WS_COMBINE_TILES_PER_SPLIT,
                     max_splits=max(1, min(MAX_SPLITS, spec.num_sms // max(1, batch * (cfg.num_heads // cfg.block_h)))))
    return choose_num_splits(
        batch=batch,
        total_kv=total_kv,
        num_sms=spec.num_sms,
        ctas_per_sm=occupancy,
        block_n=cfg.block_n,
        head_groups=cfg.num_heads // cfg.block_h,
        **merge,
    )


def ws_class_default(spec: TargetSpec, *, kv_format: str, q_format: str, num_heads: int, q_tile: int,
                     page_size: int) -> bool:
    """Whether the op's default may pick the warp-specialised kernel for this problem class (large enough caches:
    ``ws_by_default``)."""
    return (ws_min_tokens(kv_format, q_format, page_size) is not None
            and uses_ws(spec, num_heads=num_heads, q_tile=q_tile))


def ws_min_tokens(kv_format: str, q_format: str, page_size: int = 0) -> int | None:
    """Cached tokens from which the default takes the warp-specialised kernel for this cache, Q format and cache
    layout (flat: ``page_size`` 0); None: never (``WS_DEFAULTS``, ``WS_Q_FORMATS``)."""
    default = WS_DEFAULTS.get(kv_format)
    if default is None or q_format not in WS_Q_FORMATS:
        return None
    if page_size:
        return default.paged_min_tokens if q_format == "bf16" else None
    return default.min_tokens if q_format == "bf16" else default.fp8_q_min_tokens


def ws_by_default(spec: TargetSpec, *, kv_format: str, q_format: str, num_heads: int, q_tile: int, page_size: int,
                  total_kv: int) -> bool:
    """Whether the op picks the warp-specialised kernel for this problem when not told (``WS_DEFAULTS``)."""
    return (ws_class_default(spec, kv_format=kv_format, q_format=q_format, num_heads=num_heads, q_tile=q_tile,
                             page_size=page_size) and total_kv >= ws_min_tokens(kv_format, q_format, page_size))


def flash_io_variant(decode_cfg):
    """The selected decode config in FlashMLA's argument shapes (``flash_io``), which ``mla.flash_mla`` launches
    with no view per call; None where the family has no such form. Only the block-level paged kernel with the merge
    fused has one: the one-launch calls (split grid within the GPU), where host time shows."""
    if (isinstance(decode_cfg, DecodeKernelConfig) and decode_cfg.fused_combine and decode_cfg.page_size
            and not decode_cfg.dim_split):
        return dataclasses.replace(decode_cfg, flash_io=True)
    return None


def uses_ws(spec: TargetSpec, *, num_heads: int, q_tile: int) -> bool:
    """Whether the warp-specialised kernel family serves this problem class: Hopper (wgmma, setmaxnreg) and 16
    query rows per CTA (16 heads, one query token per pass). Wider problems (more heads, MTP tiles of 2-4 queries)
    keep the 32/64-row kernel of ``tl_kernels.mla_decode``."""
    return spec.name == "sm_90a" and num_heads == 16 and q_tile == 1


def ws_config(
    spec: TargetSpec, *, kv_format: str, q_format: str = "bf16", num_heads: int = 16, causal: bool = False,
    page_size: int = 0, **overrides,
) -> WSDecodeKernelConfig:
    """The warp-specialised kernel's config for a problem class; ``overrides`` replace the defaults (tuning)."""
    cfg = WSDecodeKernelConfig(
        kv_format=kv_format, q_format=q_format, num_heads=num_heads, num_stages=WS_STAGES, causal=causal,
        page_size=page_size, fp8_dtype=spec.fp8_tl_dtype, **WS_CONSUMER,
    )
    if kv_format in WS_DEFAULTS and not overrides.get("fp8_mma", False):
        # (fp8_mma has no decoders: the format's decoder tunings do not apply, and its copier runs without the L2
        # prefetch, which was slower in run 46)
        tuned = WS_DEFAULTS[kv_format]
        # (ordered_decode has no form with the pipelined consumer: a tuning override of ``overlap`` drops it)
        cfg = dataclasses.replace(cfg, l2_prefetch=tuned.l2_prefetch, direct_stores=tuned.direct_stores,
                                  ordered_decode=tuned.ordered_decode and not overrides.get("overlap", False))
    cfg = dataclasses.replace(cfg, **overrides)
    if cfg.shared_bytes > spec.smem_bytes:
        raise ValueError(f"{cfg.name} needs {cfg.shared_bytes} B of shared memory; {spec.name} has {spec.smem_bytes}")
    return cfg


# mxfp4 on the fp8 wgmma ring with two decoder warp groups, one per stage (``WSDecodeKernelConfig.mx_decoders``; issue
# 28, opt-in until measured): e4m3 codes under per-token exponents, Q's and P's two terms stacked as fp8's default
# ring has them. 512 threads: consumer 224 registers, transposer 72, decoders 104 each (ptxas, CPU box: the fewest
# spills of 240/88/88, 240/72/96 and 224/72/104; 120 B, in per-pass setup and the wait loops).
MX_RING_2D = dict(fp8_mma=True, p_split=True, q_stack=True, p_stack=True, mx_decoders=2, consumer_regs=224)


def ws_ring_defaults(kv_format: str, q_format: str = "bf16") -> dict:
    """The ring the op's default takes for this cache and Q format (``ws_config`` overrides): ``fp8_mma`` (with
    ``p_split`` and ``p_stack``, and ``q_stack`` for bf16 Q) where ``WS_DEFAULTS`` says so, else none (the decoder
    ring)."""
    tuned = WS_DEFAULTS.get(kv_format)
    if tuned is None or not tuned.fp8_mma:
        return {}
    return dict(fp8_mma=True, p_split=tuned.p_split, q_stack=tuned.q_stack and q_format == "bf16",
                p_stack=tuned.p_stack)


def ws_persistent_defaults(spec: TargetSpec, kv_format: str, q_format: str = "bf16") -> dict:
    """The persistence the op's default adds to the ring of ``ws_ring_defaults`` (``ws_config`` overrides): one
    copy of each role's tile step and one CTA per SM (``dynamic_stage``, ``persistent_ctas``) where
    ``WS_DEFAULTS[kv_format].persistent_q_formats`` holds ``q_format``, else none."""
    tuned = WS_DEFAULTS.get(kv_format)
    if tuned is None or q_format not in tuned.persistent_q_formats:
        return {}
    return dict(dynamic_stage=True, persistent_ctas=spec.num_sms)


def ws_default_config(spec: TargetSpec, *, kv_format: str, q_format: str = "bf16", num_heads: int = 16,
                      causal: bool = False, page_size: int = 0) -> WSDecodeKernelConfig:
    """The warp-specialised config the op launches with no tuning overrides (``ws_config`` with
    ``ws_ring_defaults`` and ``ws_persistent_defaults``)."""
    return ws_config(spec, kv_format=kv_format, q_format=q_format, num_heads=num_heads, causal=causal,
                     page_size=page_size, **ws_ring_defaults(kv_format, q_format),
                     **ws_persistent_defaults(spec, kv_format, q_format))


def ws_num_splits(spec: TargetSpec, cfg: WSDecodeKernelConfig, *, batch: int, total_kv: int) -> int:
    """KV splits per sequence for the warp-specialised kernel (one CTA per SM; the merge is fused)."""
    return choose_num_splits(
        batch=batch, total_kv=total_kv, num_sms=spec.num_sms, ctas_per_sm=ctas_per_sm(spec, cfg), block_n=cfg.block_n,
        head_groups=cfg.num_heads // cfg.block_h, combine_overhead=WS_COMBINE_OVERHEAD_TILES,
        combine_per_split=WS_COMBINE_TILES_PER_SPLIT,
    )


def select_kernels(
    spec: TargetSpec,
    *,
    kv_format: str,
    q_format: str,
    num_heads: int,
    causal: bool,
    page_size: int,
    batch: int,
    total_q: int,
    total_kv: int,
    num_splits: int | None = None,
    **overrides,
) -> tuple[DecodeKernelConfig, CombineKernelConfig | None, int]:
    """What the op launches for a problem: (decode config, combine config or None, num_splits). ``total_kv`` is the
    token count the split model divides by ``batch`` (the op passes its cache's rows; a plan the exact sum);
    ``num_splits`` forces the split count; 1 means the direct kernel and no combine. Kernels that merge their
    splits themselves (the warp-specialised one, Hopper's ``fused_combine`` decode kernel, the 64-row family) come
    with no combine config whatever the count. ``overrides``: tuning only."""
    q_tile = query_tile(total_q, batch)
    overrides.pop("amax_kernel", None)  # a8w8's reduction, not a decode kernel's field (``launch.kernels`` reads it)
    # 64+ query rows per sequence on Hopper: the 64-row family (see "64-row class" below; opt-in while unmeasured).
    rows = overrides.pop("rows", ROWS_BY_DEFAULT and not overrides)
    if rows and uses_rows(spec, kv_format=kv_format, q_format=q_format, num_heads=num_heads, batch=batch,
                          total_q=total_q):
        cfg = rows_config(spec, kv_format=kv_format, q_format=q_format, num_heads=num_heads, batch=batch,
                          total_q=total_q, causal=causal, page_size=page_size, **overrides)
        if num_splits is None:
            num_splits = rows_num_splits(spec, cfg, batch=batch, total_kv=total_kv)
        return cfg, None, num_splits
    # Tuning overrides name the family's fields: the warp-specialised family's with ``ws=True``, else the
    # 32/64-row kernel's (which also serves a forced config of the 16-row class).
    default = not overrides and ws_by_default(spec, kv_format=kv_format, q_format=q_format, num_heads=num_heads,
                                              q_tile=q_tile, page_size=page_size, total_kv=total_kv)
    ws = overrides.pop("ws", default) and uses_ws(spec, num_heads=num_heads, q_tile=q_tile)
    if ws:
        # One launch whatever the split count: the kernel merges its splits (``combine`` is None).
        # No tuning overrides beyond ``ws``: the default's config; with any, the family's base config plus those
        # overrides, as tuning sweeps expect.
        problem = dict(kv_format=kv_format, q_format=q_format, num_heads=num_heads, causal=causal,
                       page_size=page_size)
        cfg = ws_config(spec, **problem, **overrides) if overrides else ws_default_config(spec, **problem)
        if num_splits is None:
            num_splits = ws_num_splits(spec, cfg, batch=batch, total_kv=total_kv)
        return cfg, None, num_splits
    problem = dict(kv_format=kv_format, q_format=q_format, num_heads=num_heads, q_tile=q_tile,
                   causal=causal, page_size=page_size, **overrides)
    split_cfg = decode_config(spec, split=True, **problem)
    if num_splits is None:
        num_splits = default_num_splits(spec, split_cfg, batch=batch, total_kv=total_kv)
    fits = fused_fits(spec, split_cfg, batch=batch, num_splits=num_splits)
    if split_cfg.fused_combine and not fits:
        raise ValueError(f"config_overrides: fused_combine needs a grid of at most {spec.num_sms} CTAs (one per SM; "
                         f"the launch is cooperative), got batch {batch} x {split_cfg.num_heads // split_cfg.block_h} "
                         f"head groups x {num_splits} splits")
    if "fused_combine" not in overrides and FUSED_COMBINE_ON_CUDA and num_splits > 1 and fits:
        split_cfg = dataclasses.replace(split_cfg, fused_combine=True)
    if split_cfg.fused_combine:  # one kernel for every split count: it writes the output itself
        return split_cfg, None, num_splits
    if num_splits == 1:
        return decode_config(spec, split=False, **problem), None, 1
    return split_cfg, combine_config(spec, num_heads=num_heads), num_splits


def fused_fits(spec: TargetSpec, cfg: DecodeKernelConfig, *, batch: int, num_splits: int) -> bool:
    """Whether the fused-merge decode kernel (``fused_combine``) may run this grid: a CUDA target (its grid-wide
    barrier is a cooperative launch there) and at most one CTA per SM, so every CTA is resident whatever else the
    kernel's registers and shared memory allow."""
    return can_fuse(spec, cfg) and batch * (cfg.num_heads // cfg.block_h) * num_splits <= spec.num_sms


def can_fuse(spec: TargetSpec, cfg: DecodeKernelConfig) -> bool:
    """Whether the decode kernel has a fused-merge form on ``spec``: CUDA's cooperative launch, and the block-level
    program (gfx942's dim_split program has none)."""
    return not spec.is_hip and not cfg.dim_split


def combine_config(spec: TargetSpec, *, num_heads: int = 16) -> CombineKernelConfig:
    return CombineKernelConfig(num_heads=num_heads, threads=128)


# a8w8 from bf16 Q where the decode kernel does not reduce amax(|q|) itself (``amax_in_kernel``: the fused grids):
# our own one-launch reduction (``tl_kernels.mla_amax``) on CUDA instead of torch's, which took 6.9 us of GPU time
# at 32 x 1024 (run 52, H100). gfx942 keeps torch's reduction (nothing here can time either there).
AMAX_KERNEL_ON_CUDA = True


def amax_config(spec: TargetSpec, *, num_heads: int = 16) -> AmaxKernelConfig | None:
    """The amax kernel a8w8 launches before a decode kernel that reads amax(|q|) (None: torch's reduction)."""
    if spec.is_hip or not AMAX_KERNEL_ON_CUDA:
        return None
    return AmaxKernelConfig(num_heads=num_heads)


def amax_launch(spec: TargetSpec, decode_cfg, *, q_format: str, num_heads: int,
                amax_kernel: bool = True) -> AmaxKernelConfig | None:
    """The amax kernel launched before ``decode_cfg``: a8w8 from bf16 Q (``q_format`` "fp8") whose decode kernel
    reads amax(|q|) rather than reducing it (``amax_in_kernel``). None: no such launch, or torch's reduction
    (``amax_config`` None, or the tuning override ``amax_kernel=False``)."""
    if q_format != "fp8" or not amax_kernel or getattr(decode_cfg, "amax_in_kernel", False):
        return None
    return amax_config(spec, num_heads=num_heads)


def ctas_per_sm(spec: TargetSpec, cfg: DecodeKernelConfig | WSDecodeKernelConfig) -> int:
    """How many decode CTAs fit on one SM / CU at once (shared memory is the binding limit)."""
    return max(1, min(spec.smem_bytes // max(cfg.shared_bytes, 1), 2048 // cfg.threads, 8))


def choose_num_splits(
    *,
    batch: int,
    total_kv: int,
    num_sms: int,
    ctas_per_sm: int,
    block_n: int,
    head_groups: int = 1,
    max_splits: int = MAX_SPLITS,
    combine_overhead: float = COMBINE_OVERHEAD_TILES,
    combine_per_split: float = COMBINE_TILES_PER_SPLIT,
) -> int:
    """KV splits per sequence for a batch whose mean KV length is total_kv / batch.

    Picks the split count with the lowest modelled time: the number of CTA waves times the tiles one CTA streams
    plus its fixed overhead, plus the merge of the splits (a combine kernel, or the fused merge of the
    warp-specialised kernel: ``combine_overhead`` + ``combine_per_split`` per split). 1 means no merge at all.
    """
    if batch <= 0 or total_kv <= 0:
        return 1
    tiles = math.ceil(total_kv / batch / block_n)  # KV tiles of an average sequence
    slots = num_sms * ctas_per_sm
    best, best_cost = 1, math.inf
    for splits in range(1, min(max_splits, tiles) + 1):
        waves = math.ceil(batch * head_groups * splits / slots)
        combine = combine_overhead + combine_per_split * splits if splits > 1 else 0.0
        cost = waves * (math.ceil(tiles / splits) + CTA_OVERHEAD_TILES) + combine
        if cost < best_cost - 1e-9:
            best, best_cost = splits, cost
    return best


# (kv_format, q_format) pairs the op runs: bf16 Q over every cache, and a8w8 (fp8 Q over an fp8 cache).
MODES = constants.MODES


def decode_variants(spec: TargetSpec, *, kv_format: str, q_format: str, num_heads: int, q_tile: int, causal: bool,
                    page_size: int = 0) -> list:
    """The 16/32/64-row family's kernels ``select_kernels`` may pick for one problem class: the split and the
    direct decode kernels and the combine kernel, and on CUDA (``FUSED_COMBINE_ON_CUDA``) the decode kernel with its
    merge fused, for grids that fit the GPU at once; for a8w8 on CUDA the amax kernel (``amax_config``)."""
    problem = dict(kv_format=kv_format, q_format=q_format, num_heads=num_heads, q_tile=q_tile, causal=causal,
                   page_size=page_size)
    split_cfg = decode_config(spec, split=True, **problem)
    variants = [split_cfg, decode_config(spec, split=False, **problem), combine_config(spec, num_heads=num_heads)]
    if FUSED_COMBINE_ON_CUDA and can_fuse(spec, split_cfg):
        variants.append(dataclasses.replace(split_cfg, fused_combine=True))
    amax_cfg = amax_config(spec, num_heads=num_heads) if q_format == "fp8" else None
    if amax_cfg is not None:
        variants.append(amax_cfg)
    return variants


def kernel_variants(spec: TargetSpec, *, num_heads: int = 16, q_tile: int = 1, causal: bool = False) -> list:
    """Every kernel the op may launch for one problem class: each mode's split and direct decode kernels, the
    combine kernel and, on CUDA (``FUSED_COMBINE_ON_CUDA``), the decode kernel with its merge fused; on
    Hopper's 16-row class also the warp-specialised kernel of each mode that has a WS default (``ws_min_tokens``).
    Used to pre-build (bench.py without a GPU) and to test that all of them compile."""
    variants = []
    for kv_format, q_format in MODES.values():
        variants += decode_variants(spec, kv_format=kv_format, q_format=q_format, num_heads=num_heads, q_tile=q_tile,
                                    causal=causal)
    variants = list(dict.fromkeys(variants))  # the combine kernel once
    if uses_ws(spec, num_heads=num_heads, q_tile=q_tile):  # the warp-specialised kernel, for large problems
        variants += [ws_default_config(spec, kv_format=kv, q_format=q, num_heads=num_heads, causal=causal)
                     for kv, q in MODES.values() if ws_min_tokens(kv, q) is not None]
    return variants


# ---- 64-row class (tl_kernels/mla_decode_rows.py, issue 17) -------------------------------------------------------
# 64+ query rows per sequence (heads x query tokens: 64 / 128 heads, MTP) on Hopper: 64-row wgmma tiles, a producer
# warp group and two consumer warp groups, the split merge fused. Opt-in (``config_overrides={"rows": True}``) until
# an H200 run has validated it (tools/rows_check.py, tests/test_rows_gpu.py); bf16 KV and bf16 Q only for now (fp8 /
# mxfp4 wait for the shared decode helpers, tl_kernels/dequant.py).
ROWS_BY_DEFAULT = False
ROWS_MIN = 64  # query rows per sequence (mean) from which the 64-row class serves a problem
ROWS_MAX_Q_SLOTS = 8  # CTAs along the queries per (sequence, head group); longer query runs take passes


def uses_rows(spec: TargetSpec, *, kv_format: str, q_format: str, num_heads: int, batch: int, total_q: int) -> bool:
    """Whether the 64-row family serves this problem: sm_90a (wgmma, setmaxnreg), a format it reads, and at least
    64 query rows per sequence on average (num_heads x mean query length)."""
    if spec.name != "sm_90a" or kv_format not in ROWS_KV_FORMATS or q_format != "bf16" or batch <= 0:
        return False
    return num_heads * math.ceil(total_q / batch) >= ROWS_MIN


def rows_config(
    spec: TargetSpec, *, kv_format: str, q_format: str = "bf16", num_heads: int = 128, batch: int = 1,
    total_q: int = 1, causal: bool = False, page_size: int = 0, **overrides,
) -> RowsDecodeKernelConfig:
    """The 64-row kernel's config for a problem class: 64 heads per CTA (fewer heads: several query tokens fill the
    64 rows), and as many CTAs along the queries as the mean query length needs (a power of two, at most
    ``ROWS_MAX_Q_SLOTS``, so few variants compile). ``overrides`` replace the defaults (tuning)."""
    block_h = min(num_heads, 64)
    q_group = 64 // block_h
    mean_q = max(1, math.ceil(total_q / max(batch, 1)))
    q_slots = 1
    while q_slots * q_group < mean_q and q_slots < ROWS_MAX_Q_SLOTS:
        q_slots *= 2
    cfg = RowsDecodeKernelConfig(
        kv_format=kv_format, q_format=q_format, num_heads=num_heads, block_h=block_h, q_slots=q_slots, causal=causal,
        page_size=page_size, fp8_dtype=spec.fp8_tl_dtype,
    )
    cfg = dataclasses.replace(cfg, **overrides)
    if cfg.shared_bytes > spec.smem_bytes:
        raise ValueError(f"{cfg.name} needs {cfg.shared_bytes} B of shared memory; {spec.name} has {spec.smem_bytes}")
    # mla.plan allocates batch x num_heads semaphores for every fused family.
    if cfg.semaphores_per_seq > num_heads:
        raise ValueError(f"{cfg.name}: {cfg.semaphores_per_seq} semaphores per sequence exceed num_heads={num_heads}")
    return cfg


def rows_num_splits(spec: TargetSpec, cfg: RowsDecodeKernelConfig, *, batch: int, total_kv: int) -> int:
    """KV splits per sequence for the 64-row kernel: one CTA per SM, ``row_tiles`` CTAs per (sequence, split), the
    merge fused (the warp-specialised family's merge costs)."""
    return choose_num_splits(
        batch=batch, total_kv=total_kv, num_sms=spec.num_sms, ctas_per_sm=ctas_per_sm(spec, cfg), block_n=cfg.block_n,
        head_groups=cfg.row_tiles, combine_overhead=WS_COMBINE_OVERHEAD_TILES,
        combine_per_split=WS_COMBINE_TILES_PER_SPLIT,
    )


# ---- CUDA graphs: each sequence's split count chosen on the device (mla.flash_mla) ------------------------------
# A captured graph keeps its grid and its kernels, while the lengths change every step. So the graph form of
# ``mla.flash_mla`` launches the 16/32/64-row split kernel in FlashMLA's shapes over a grid of ``graph_max_splits``
# splits per sequence (the most the cost model picks for the batch at any length), and the split count each
# sequence uses comes from ``Num_splits``: written on the device by tl_kernels.mla_schedule from the lengths of the
# step (FlashMLA's ``get_mla_metadata`` does the same), the same cost model as ``choose_num_splits``, so a replay
# splits as a call planned for its lengths would. Splits past a sequence's count exit at once.
GRAPH_MAX_TILES = 8192  # mean KV tiles per sequence up to which graph_max_splits looks (the choice is flat beyond)
# At most this many waves of CTAs in the graph form's grid: at long lengths the model finds many split counts within
# ~1% of each other (each that fills whole waves), and picks among them by rounding (128 sequences: 2, 4, ..., 33);
# the CTAs past a sequence's count still cost a launch slot each, so the grid stops at two waves.
GRAPH_MAX_WAVES = 2


def graph_config(spec: TargetSpec, *, kv_format: str, q_format: str = "bf16", num_heads: int = 16, q_tile: int = 1,
                 causal: bool = False, page_size: int = 64) -> DecodeKernelConfig | None:
    """The decode config of the graph form for a problem class: the split config ``decode_config`` picks, in
    FlashMLA's shapes, reading each sequence's split count (``split_counts``); its merge is the combine kernel's
    flash form (``graph_combine_config``). None on gfx942, whose dim_split program has no such form (mla.flash_mla
    then runs the package's kernels on views, their split count fixed when captured)."""
    if spec.is_hip or not page_size:
        return None
    cfg = decode_config(spec, kv_format=kv_format, q_format=q_format, num_heads=num_heads, q_tile=q_tile,
                        causal=causal, split=True, page_size=page_size)
    return dataclasses.replace(cfg, flash_io=True, split_counts=True)


GRAPH_WIDE_COMBINE_SPLITS = 16  # a graph whose split cap is at least this merges with 4 lanes per chunk


def graph_combine_config(spec: TargetSpec, *, num_heads: int = 16, max_splits: int = 1) -> CombineKernelConfig:
    """The combine's flash form for a graph whose grid caps the splits at ``max_splits``: 4 lanes per 4-dim chunk
    (each row's loads in one round, over 4 CTAs per row) from GRAPH_WIDE_COMBINE_SPLITS splits, else 1 (a CTA per
    row; at 2-8 splits 4x the CTAs cost more than the rounds they save: run 28, 64 x 1024 and 128 x 4096)."""
    lanes = 4 if max_splits >= GRAPH_WIDE_COMBINE_SPLITS else 1
    return dataclasses.replace(combine_config(spec, num_heads=num_heads), flash_io=True, split_lanes=lanes)


def graph_combine_configs(spec: TargetSpec, *, num_heads: int = 16) -> list[CombineKernelConfig]:
    """Both forms ``graph_combine_config`` may pick (ahead of the batch size, which sets the split cap)."""
    return [graph_combine_config(spec, num_heads=num_heads, max_splits=m) for m in (1, GRAPH_WIDE_COMBINE_SPLITS)]


@dataclasses.dataclass(frozen=True)
class SplitModel:
    """The cost model's inputs for one batch size and decode config: what tl_kernels.mla_schedule takes after the
    lengths (overheads in tenths of a tile, as integers)."""

    block_n: int
    head_groups: int
    slots: int
    max_splits: int
    cta_overhead: int = round(10 * CTA_OVERHEAD_TILES)
    combine_overhead: int = round(10 * COMBINE_OVERHEAD_TILES)
    combine_per_split: int = round(10 * COMBINE_TILES_PER_SPLIT)

    def args(self) -> tuple:
        return (self.block_n, self.head_groups, self.slots, self.max_splits, self.cta_overhead,
                self.combine_overhead, self.combine_per_split)


def split_model(spec: TargetSpec, cfg: DecodeKernelConfig, *, batch: int) -> SplitModel:
    """The split model of the graph form for ``batch`` sequences and the decode config ``cfg``."""
    head_groups = cfg.num_heads // cfg.block_h
    slots = spec.num_sms * ctas_per_sm(spec, cfg)
    return SplitModel(cfg.block_n, head_groups, slots, graph_max_splits(batch, head_groups, slots))


def _model_costs(batch: int, head_groups: int, slots: int, tiles, model: SplitModel | None = None):
    """Costs (tenths of a tile) of split counts 1..MAX_SPLITS at each mean tile count in ``tiles`` (a 1-D int64
    tensor): (len(tiles), MAX_SPLITS), with candidates past min(MAX_SPLITS, tiles) at int64 max."""
    import torch

    m = model or SplitModel(0, head_groups, slots, MAX_SPLITS)
    splits = torch.arange(1, MAX_SPLITS + 1, dtype=torch.int64)
    waves = (batch * head_groups * splits + slots - 1) // slots
    per_cta = 10 * ((tiles[:, None] + splits - 1) // splits) + m.cta_overhead
    merge = torch.where(splits > 1, m.combine_overhead + m.combine_per_split * splits, 0)
    cost = waves * per_cta + merge
    allowed = (splits <= tiles[:, None]) & (splits <= m.max_splits)
    return torch.where(allowed, cost, torch.iinfo(torch.int64).max)


@functools.lru_cache(maxsize=1024)
def graph_max_splits(batch: int, head_groups: int, slots: int) -> int:
    """The graph form's grid (splits per sequence): the most splits the cost model picks for ``batch`` sequences at
    any mean length (up to GRAPH_MAX_TILES tiles), at most GRAPH_MAX_WAVES waves of CTAs. The device model chooses
    among the counts up to it."""
    import torch

    if batch <= 0:
        return 1
    waves_cap = max(1, -(-GRAPH_MAX_WAVES * slots // (batch * head_groups)))
    tiles = torch.arange(1, GRAPH_MAX_TILES + 1, dtype=torch.int64)
    capped = SplitModel(0, head_groups, slots, min(MAX_SPLITS, waves_cap))
    best = _model_costs(batch, head_groups, slots, tiles, capped).argmin(dim=1) + 1  # argmin: the first minimum
    return int(best.max())


def device_split_counts(lengths: list[int], model: SplitModel) -> list[int]:
    """What tl_kernels.mla_schedule writes for ``lengths`` (FlashMLA's ``num_splits``: 0, then the running sum of
    each sequence's split count), computed on the host: for CPU tensors, and to test the device against."""
    import torch

    batch = len(lengths)
    lengths = [max(int(n), 0) for n in lengths]
    tiles = -(-sum(lengths) // (batch * model.block_n)) if batch else 0
    best = 1
    if tiles > 0:
        costs = _model_costs(batch, model.head_groups, model.slots, torch.tensor([tiles]), model)[0]
        if int(costs.min()) != torch.iinfo(torch.int64).max:
            best = int(costs.argmin()) + 1
    chunk = max(-(-tiles // best), 1)
    counts = [min(max(-(-(-(-n // model.block_n)) // chunk), 1), model.max_splits) for n in lengths]
    return [0, *itertools.accumulate(counts)]
