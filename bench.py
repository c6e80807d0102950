"""Benchmark of the TileLang MLA decode op (``mla.decode.mla_decode``), timed the way the competition harness times:
CUDA events around ONE call, the L2 flushed (a 256 MiB write) before each rep, median of many reps (the min too).

Usage, from the repo root (``python bench.py`` finds the ``mla`` package next to this file):

    python bench.py                                  # 8 harness shapes x modes bf16 fp8 a8w8 mxfp4, + peers, baselines
    python bench.py --modes fp8,mxfp4 --shapes 4x1024,256x8192
    python bench.py --ragged --long --check          # + ragged batches and 32k contexts; verify vs the fp32 reference
    python bench.py --q-len 2 --no-baselines         # MTP: 2 query tokens per sequence
    python bench.py --page-size 16 --heads 128       # paged KV (FlashInfer reads the same pages), 128 heads
    python bench.py --grid 128x4,128x1,64x1,16x4,16x8 --modes bf16,fp8 --shapes 32x8192,256x8192
                                                     # one run over (heads x q_len) points: issue 17's whole table
    python bench.py --plan                           # time DecodePlan.run (planned once, untimed, like FlashInfer)
    python bench.py --splits 1 --no-peers --reps 100 # force one KV split (no combine kernel)
    python bench.py --json results.json --plot gbps.png
    python bench.py --shapes none --ragged           # only the ragged batches (and the host-cost table)
    python bench.py --shapes none --no-baselines     # only the host-cost table (4 x 1024)

Modes (what the op reads):
    bf16   bf16 Q, bf16 KV cache                      (1152 B per cached token)
    fp8    bf16 Q, fp8 e4m3 KV + per-tensor scale     (576 B per token)
    a8w8   Q quantized to fp8 inside the call, fp8 KV (576 B per token): the competition's reference configuration
    mxfp4  bf16 Q, mxfp4 KV (e2m1 + e8m0 per 32)      (288 + 18 = 306 B per token)
Peers (tools/peers.py, when importable): FlashInfer's BatchMLAPagedAttentionWrapper, backends fa3 and fa2, bf16 Q and
KV, page size 1 (with --page-size: the same shuffled pages as ours, as CSR page lists); only its ``run`` is timed
(``plan`` is not; our --plan option times ``DecodePlan.run`` the same way). With $FLASHMLA_LEGACY_LIB set, FlashMLA's
SM90 decode: flashmla-bf16 (``dense_decode_fwd``, beside our bf16) and flashmla-fp8 (``fwd_kvcache_mla_fp8``, fp8 Q
quantized per tensor and the fp8 cache, beside our fp8 and a8w8), both over the same values in pages of 64 tokens with
a block table; its scheduler metadata is made once, untimed. On ROCm only, AMD aiter (package amd-aiter): its a8w8 persistent MLA decode
called as the competition reference calls it (fp8 Q and KV, per-tensor scales, page size 1, 32 KV splits); only
``aiter.mla.mla_decode_fwd`` is timed (metadata and the fp8 quantization of Q and KV are not). The aiter peer is
untested in this project (no ROCm machine): only its call sequence is checked, on the CPU, against a fake aiter.
Baselines: the harness template's two naive torch versions, re-implemented here: a per-sequence bf16 loop ("loop") and
fp8 Q/K through ``torch._scaled_mm`` ("scaled_mm"); skipped above BASELINE_MAX_TOKENS cached tokens (too slow).

Host cost (--host-shape, default 4x1024; JSON rows of kind "host"): the L2 flush before each timed call hides up to
~60-80 us of host time, so the host is measured apart, with a warm L2: ``host_us_per_call`` = wall time per call in a
loop of --host-calls (500) calls back to back, for every mode through ``mla_decode`` (its cache keywords taken from
the harness tuple once, as for the planned call), through ``DecodePlan.run`` (rows with ``"plan": true``) and through
``mla.flash_mla.flash_mla_with_kvcache`` with reused metadata on 64-token pages (``"call": "flash_mla"``), through the
harness's ``custom_kernel`` (bf16, flat cache: the tuple unpacked and checked per call, ``"call": "custom_kernel"``),
for every peer's timed call, and for one torch launch of a tiny kernel (``"call": "reference"``: this host's own
speed, as hosts differ ~2x); ``gpu_us_per_call`` = the call's GPU time with the GPU never waiting for the host (calls
queued behind a sleep kernel, CUDA events around them); ``host_overhead_us`` = their difference: what the host adds
per call beyond the kernels.

Achieved TFLOP/s = ``flops_of(...)`` / median time (the two GEMMs of the absorbed decode, 2 x (576 + 512) flop per
(query row, KV token)), beside the GB/s: with 64+ query rows per sequence (128 heads, MTP) decode is compute-bound.
``--grid HEADSxQ_LEN,...`` runs every case at each (heads, query tokens) point and ends with one table of them all.

Achieved GB/s = ``bytes_moved(...)`` / median time; the read ceiling (``torch.sum`` over a 4 GiB bf16 tensor) is
measured in the same run. Without a CUDA device the script compiles, for sm_90a on the CPU, every kernel variant the
same command line would use, prints the modelled split counts, and exits.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import json
import logging
import math
import os
import random
import statistics
import subprocess
import sys
import time

REPO_DIR = os.path.dirname(os.path.abspath(__file__))
if REPO_DIR not in sys.path:
    sys.path.insert(0, REPO_DIR)

import torch  # noqa: E402

from mla import formats, jit, schedule, target  # noqa: E402
from mla.decode import (DEFAULT_SM_SCALE, SUPPORTED_HEADS, custom_kernel, harness_cache, mla_decode,  # noqa: E402
                        page_size_of, plan)
from mla.flash_mla import flash_mla_with_kvcache, get_mla_metadata  # noqa: E402
from mla.inputs import HARNESS_SHAPES, make_harness_inputs, make_ragged_inputs, to_paged  # noqa: E402
from mla.constants import KV_LORA_RANK, QK_DIM  # noqa: E402
from mla.constants import MODES as MODE_FORMATS  # noqa: E402
from mla.reference import harness_reference  # noqa: E402
from tools import peers as peer_lib  # noqa: E402
from tools.peers import AITER, Peer  # noqa: E402

DEVICE = "cuda"
BF16_BYTES = 2

MODES = tuple(MODE_FORMATS)
KV_BYTES_PER_TOKEN = {
    "bf16": QK_DIM * BF16_BYTES,  # 1152
    "fp8": QK_DIM,  # 576 (the one 4-byte per-tensor scale is not counted)
    "a8w8": QK_DIM,
    "mxfp4": QK_DIM // 2 + QK_DIM // 32,  # 288 packed e2m1 + 18 e8m0 scales = 306
}
PEERS = peer_lib.ALL  # FlashInfer fa3 / fa2, FlashMLA bf16 / fp8, AMD aiter: tools/peers.py
BASELINES = ("loop", "scaled_mm")  # the harness template's naive torch versions
# Column order of the tables: each FlashMLA kernel beside the modes it compares with, then the other peers.
IMPL_ORDER = ("bf16", peer_lib.FLASHMLA_BF16, "fp8", "a8w8", peer_lib.FLASHMLA_FP8, "mxfp4", *peer_lib.FLASHINFER, AITER,
              *BASELINES)
BASELINE_MAX_TOKENS = 64 * 8192  # cached tokens (batch * kv_len) above which the baselines are skipped
REL_L2_LIMIT = {"bf16": 1e-2, "fp8": 2e-2, "a8w8": 2e-2, "mxfp4": 2e-2, "fa3": 1e-2, "fa2": 1e-2, AITER: 2e-2,
                peer_lib.FLASHMLA_BF16: 1e-2, peer_lib.FLASHMLA_FP8: 2e-2,
                "loop": 1e-2, "scaled_mm": 5e-2}  # --check flags FAIL above these (vs the fp32 reference)

WARMUP_CALLS = 5
DEFAULT_REPS = 50
BASELINE_MAX_REPS = 20  # the baselines are slow and only set the scale; fewer reps
FLUSH_BYTES = 256 * 2**20  # >= 256 MB written before each rep: the H200's L2 is 50 MiB
CEILING_BYTES = 4 * 2**30  # torch.sum over this many bytes of bf16 (half of it when memory is short)
CEILING_REPS = 10
INPUT_SEED = 0
RAGGED_SEED = 1234
RAGGED_BATCHES = ((64, 8192), (128, 2048))  # (sequences, max kv_len): lengths uniform in 1..max
LONG_SHAPES = ((4, 32768), (16, 32768))
HOST_SHAPE = "4x1024"  # the host-cost table's batch: small enough that the host, not the GPU, can be the limit
HOST_CALLS = 500  # eager calls per host-cost loop
FLASH_PAGE_SIZE = 64  # the host table's flash_mla rows: FlashMLA's page size
# Host overhead targets per call kind, us beyond the call's GPU time (issue 18): the planned calls a serving step
# makes per layer, and the one-shot op.
HOST_TARGETS_US = {"plan.run": 8.0, "flash_mla": 8.0, "eager": 15.0}
HOST_ROUNDS = 3  # loops per measurement (median)
HOST_WARMUP_CALLS = 20
GPU_TIME_CALLS = 50  # calls queued behind a sleep kernel to time their GPU execution

log = logging.getLogger("mla")


# ----------------------------------------------------------------------------------------------- cases and CLI


@dataclasses.dataclass(frozen=True)
class Case:
    """One benchmarked batch: the KV length of every sequence."""

    label: str
    kv_lens: tuple[int, ...]
    harness: bool = False  # one of the 8 harness shapes (they make the geometric mean)

    @property
    def batch(self) -> int:
        return len(self.kv_lens)

    @property
    def total_kv(self) -> int:
        return sum(self.kv_lens)

    @property
    def mean_kv_len(self) -> float:
        return self.total_kv / max(self.batch, 1)

    @property
    def uniform(self) -> bool:
        return len(set(self.kv_lens)) <= 1


def uniform_case(batch: int, kv_len: int) -> Case:
    return Case(f"{batch}x{kv_len}", (kv_len,) * batch, harness=(batch, kv_len) in HARNESS_SHAPES)


def ragged_case(batch: int, max_kv_len: int, seed: int = RAGGED_SEED) -> Case:
    rng = random.Random(seed * 1_000_003 + batch)
    return Case(f"ragged{batch}x1..{max_kv_len}", tuple(rng.randint(1, max_kv_len) for _ in range(batch)))


def build_cases(args) -> list[Case]:
    cases = [uniform_case(b, kv) for b, kv in (HARNESS_SHAPES if args.shapes is None else args.shapes)]
    if args.ragged:
        cases += [ragged_case(b, kv) for b, kv in RAGGED_BATCHES]
    if args.long:
        cases += [uniform_case(b, kv) for b, kv in LONG_SHAPES]
    return cases


def parse_shapes(text: str) -> list[tuple[int, int]]:
    if text.strip().lower() in ("", "none"):
        return []
    shapes = []
    for item in text.split(","):
        try:
            batch, kv_len = (int(x) for x in item.lower().split("x"))
        except ValueError:
            raise argparse.ArgumentTypeError(f"bad shape {item!r}: expected BATCHxKV_LEN, e.g. 4x1024") from None
        if batch < 1 or kv_len < 1:
            raise argparse.ArgumentTypeError(f"bad shape {item!r}: batch and kv_len must be >= 1")
        shapes.append((batch, kv_len))
    return shapes


def parse_modes(text: str) -> list[str]:
    modes = [m.strip() for m in text.split(",") if m.strip()]
    unknown = [m for m in modes if m not in MODES]
    if unknown or not modes:
        raise argparse.ArgumentTypeError(f"unknown mode(s) {unknown}: choose from {','.join(MODES)}")
    return modes


def parse_grid(text: str) -> list[tuple[int, int]]:
    """``HEADSxQ_LEN`` items, comma-separated (e.g. ``128x4,64x1,16x8``): the (heads, query tokens) points of a run."""
    points = []
    for item in text.split(","):
        item = item.strip().lower()
        if not item:
            continue
        try:
            heads, q_len = (int(x) for x in item.split("x"))
        except ValueError:
            raise argparse.ArgumentTypeError(f"bad grid point {item!r}: expected HEADSxQ_LEN, e.g. 128x4") from None
        if heads not in SUPPORTED_HEADS:
            raise argparse.ArgumentTypeError(f"bad grid point {item!r}: heads must be one of {SUPPORTED_HEADS}")
        if q_len < 1:
            raise argparse.ArgumentTypeError(f"bad grid point {item!r}: q_len must be >= 1")
        points.append((heads, q_len))
    if not points:
        raise argparse.ArgumentTypeError("empty --grid: expected HEADSxQ_LEN[,HEADSxQ_LEN...]")
    return list(dict.fromkeys(points))


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text}")
    return value


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        description="Time the TileLang MLA decode kernels (H200) against torch baselines, FlashInfer and FlashMLA.",
        epilog="\n\n".join(__doc__.split("\n\n")[1:5]),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--modes", type=parse_modes, default=list(MODES),
                        help=f"comma-separated subset of {','.join(MODES)} (default: all)")
    parser.add_argument("--shapes", type=parse_shapes, default=None,
                        help="comma-separated BATCHxKV_LEN, e.g. 4x1024,256x8192; 'none' for no uniform shape "
                             "(default: the 8 harness shapes, batch 4/32/64/256 x kv 1024/8192)")
    parser.add_argument("--ragged", action="store_true",
                        help="add ragged batches: 64 sequences of 1..8192 tokens, 128 of 1..2048 (fixed seed)")
    parser.add_argument("--long", action="store_true", help="add 32k contexts: batch 4 and 16 x 32768")
    parser.add_argument("--q-len", type=positive_int, default=1, help="query tokens per sequence (MTP; default 1)")
    parser.add_argument("--heads", type=int, choices=SUPPORTED_HEADS, default=16, help="query heads (default 16)")
    parser.add_argument("--grid", type=parse_grid, default=None,
                        help="comma-separated HEADSxQ_LEN points, e.g. 128x4,128x1,64x1,16x4,16x8: every case at each "
                             "point (replaces --heads / --q-len for the timed cases), then one table of all of them")
    parser.add_argument("--rows", action="store_true",
                        help="let the 64-row kernel class serve problems of 64+ query rows per sequence (opt-in while "
                             "mla.schedule.ROWS_BY_DEFAULT is False)")
    parser.add_argument("--page-size", type=positive_int, default=None,
                        help="read the KV through a page table: caches laid out in shuffled pages of this many tokens")
    parser.add_argument("--plan", action="store_true",
                        help="time DecodePlan.run (mla.decode.plan made once per shape, untimed, as FlashInfer's "
                             "plan is) instead of the one-shot mla_decode call")
    parser.add_argument("--splits", type=positive_int, default=None,
                        help="force num_splits (default: the op's own choice, schedule.choose_num_splits)")
    parser.add_argument("--host-shape", type=parse_shapes, default=parse_shapes(HOST_SHAPE),
                        help=f"BATCHxKV_LEN of the host-cost table (default {HOST_SHAPE}; 'none' skips it): wall us "
                             f"per call in a loop of --host-calls eager calls, and that minus the call's GPU time, for "
                             f"every mode (mla_decode and DecodePlan.run) and peer")
    parser.add_argument("--host-calls", type=positive_int, default=HOST_CALLS,
                        help=f"calls per host-cost loop (default {HOST_CALLS})")
    parser.add_argument("--no-baselines", action="store_true", help="skip the naive torch baselines")
    parser.add_argument("--no-peers", action="store_true", help="skip the peers (FlashInfer, FlashMLA, AMD aiter)")
    parser.add_argument("--config", type=json.loads, default=None, metavar="JSON",
                        help='kernel config overrides for our op (tuning; e.g. \'{"ws": false}\' for the 16/32/64-row '
                             'kernel instead of the warp-specialised one)')
    parser.add_argument("--json", metavar="PATH", help="write every measurement to PATH as JSON")
    parser.add_argument("--plot", metavar="PATH", help="write a PNG bar chart of achieved GB/s (needs matplotlib)")
    parser.add_argument("--reps", type=positive_int, default=DEFAULT_REPS,
                        help=f"timed reps per measurement (default {DEFAULT_REPS}, after {WARMUP_CALLS} warm-up calls)")
    parser.add_argument("--check", action="store_true",
                        help="before timing, compare each implementation once per shape with the fp32 reference")
    args = parser.parse_args(argv)
    if len(args.host_shape) > 1:
        parser.error("--host-shape takes one BATCHxKV_LEN")
    return args


# ---------------------------------------------------------------------------------------- bytes, kernels, splits


def bytes_moved(batch: int, kv_len: float, q_len: int, heads: int, mode: str) -> float:
    """The bytes one decode call cannot avoid moving (the numerator of "achieved GB/s").

    Counts: the KV cache in the mode's own format, batch * kv_len tokens of KV_BYTES_PER_TOKEN[mode] (bf16 1152,
    fp8 / a8w8 576, mxfp4 306 = 288 packed e2m1 + 18 e8m0 scales); Q read once as the caller passes it, bf16
    (batch * q_len * heads * 576 * 2, in every mode: a8w8's in-call quantization traffic is not counted); the bf16
    output written (batch * q_len * heads * 512 * 2).
    Not counted: split-KV partial outputs (an implementation choice), indptrs, the fp8 per-tensor scale.
    kv_len may be the mean length of a ragged batch: every term is linear in batch * kv_len.
    """
    kv_bytes = batch * kv_len * KV_BYTES_PER_TOKEN[mode]
    q_bytes = batch * q_len * heads * QK_DIM * BF16_BYTES
    out_bytes = batch * q_len * heads * KV_LORA_RANK * BF16_BYTES
    return kv_bytes + q_bytes + out_bytes


def flops_of(batch: int, kv_len: float, q_len: int, heads: int) -> float:
    """The flops of one decode call: per (query row, visible KV token) S = q . k over 576 dims and O += p v over 512,
    2 flop per multiply-add. Non-causal (every query sees its whole sequence), as the bench's calls are."""
    return 2.0 * batch * q_len * heads * kv_len * (QK_DIM + KV_LORA_RANK)


def grid_points(args) -> list[tuple[int, int]]:
    """The (heads, q_len) points of this run: ``--grid``, else the one of ``--heads`` / ``--q-len``."""
    return list(args.grid) if getattr(args, "grid", None) else [(args.heads, args.q_len)]


def at_point(args, heads: int, q_len: int) -> argparse.Namespace:
    """A copy of ``args`` at one grid point."""
    return argparse.Namespace(**dict(vars(args), heads=heads, q_len=q_len))


def mode_overrides(args) -> dict | None:
    """The op's config_overrides for this run: ``--config`` JSON, plus ``--rows`` (opt into the 64-row class)."""
    overrides = dict(getattr(args, "config", None) or {})
    if getattr(args, "rows", False):
        overrides["rows"] = True
    return overrides or None


def selected_kernels(spec, mode: str, case: Case, args, total_kv: int | None = None) -> tuple:
    """(decode config, combine config or None, num_splits) that mla_decode launches for this case: the op's own
    selection (``schedule.select_kernels``) from the same sizes. ``total_kv``: the rows of the cache the op is
    given (a paged cache's pages hold more rows than tokens); default the case's token count."""
    kv_format, q_format = MODE_FORMATS[mode]
    return schedule.select_kernels(
        spec, kv_format=kv_format, q_format=q_format, num_heads=args.heads, causal=False,
        page_size=args.page_size or 0, batch=case.batch, total_q=case.batch * args.q_len,
        total_kv=case.total_kv if total_kv is None else total_kv, num_splits=args.splits,
        **(mode_overrides(args) or {}),
    )


def splits_for(spec, mode: str, case: Case, args, total_kv: int | None = None) -> int:
    return selected_kernels(spec, mode, case, args, total_kv)[2]


# ----------------------------------------------------------------------------------------------- the callables


def make_inputs(case: Case, q_len: int, heads: int, device: str):
    """The harness tuple (q, kv_data, qo_indptr, kv_indptr, config), seeded; uniform cases exactly as the harness."""
    if case.uniform:
        return make_harness_inputs(case.batch, case.kv_lens[0], q_len=q_len, num_heads=heads, seed=INPUT_SEED,
                                   device=device)
    return make_ragged_inputs(list(case.kv_lens), q_len, num_heads=heads, seed=INPUT_SEED, device=device)


def eager_call(mode: str, data, num_splits: int | None = None, page_table: torch.Tensor | None = None,
               overrides: dict | None = None):
    """One eager ``mla_decode`` in ``mode`` on the harness tuple ``data``, as a callable: its cache keywords are taken
    from the tuple once (as ``planned_call`` does), so the call itself is the op's alone (paged caches come with
    ``page_table``; ``overrides``: config overrides, --config / --rows)."""
    q, kv_data, qo_indptr, kv_indptr, _ = data
    kv, cache_kwargs = harness_cache(kv_data, mode)
    if overrides:
        cache_kwargs["config_overrides"] = overrides
    return lambda: mla_decode(q, kv, qo_indptr, kv_indptr, num_splits=num_splits, page_table=page_table,
                              **cache_kwargs)


def planned_call(mode: str, data, num_splits: int | None = None, page_table: torch.Tensor | None = None,
                 causal: bool = False, overrides: dict | None = None):
    """``mla.decode.plan`` for this batch (untimed, as a serving engine plans once per step for all layers; the
    split count is the op's own choice unless forced) and the ``DecodePlan.run`` call to time."""
    q, kv_data, qo_indptr, kv_indptr, _ = data
    kv, cache_kwargs = harness_cache(kv_data, mode)
    kv_format, q_format = cache_kwargs.pop("kv_format"), cache_kwargs.pop("q_format")
    paging = {} if page_table is None else dict(page_size=page_size_of(kv), page_table=page_table)
    the_plan = plan(qo_indptr, kv_indptr, num_heads=q.shape[1], kv_format=kv_format, q_format=q_format,
                    num_splits=num_splits, causal=causal, device=q.device, config_overrides=overrides, **paging)
    return lambda: the_plan.run(q, kv, **cache_kwargs)


def torch_bf16_loop(data, sm_scale: float = DEFAULT_SM_SCALE) -> torch.Tensor:
    """The harness template's bf16 baseline: one sequence at a time, fp32 matmuls, host reads of the indptrs."""
    q, kv_data, qo_indptr, kv_indptr, _ = data
    kv_rows = kv_data["bf16"][:, 0]
    outs = []
    for b in range(qo_indptr.shape[0] - 1):
        q_lo, q_hi = int(qo_indptr[b].item()), int(qo_indptr[b + 1].item())
        kv_lo, kv_hi = int(kv_indptr[b].item()), int(kv_indptr[b + 1].item())
        keys, values = kv_rows[kv_lo:kv_hi].float(), kv_rows[kv_lo:kv_hi, :KV_LORA_RANK].float()
        scores = torch.softmax((q[q_lo:q_hi].float().permute(1, 0, 2) * sm_scale) @ keys.T, dim=-1)
        outs.append((scores @ values).permute(1, 0, 2).to(torch.bfloat16))
    return torch.cat(outs)


def torch_fp8_scaled_mm(data, sm_scale: float = DEFAULT_SM_SCALE) -> torch.Tensor:
    """The harness template's fp8 baseline: Q quantized per tensor, Q K^T by torch._scaled_mm, P V in fp32 from bf16."""
    q, kv_data, qo_indptr, kv_indptr, _ = data
    kv_fp8, kv_scale = kv_data["fp8"]
    kv_fp8_rows, kv_rows = kv_fp8.view(-1, QK_DIM), kv_data["bf16"][:, 0]
    q_fp8, q_scale = formats.quantize_fp8(q, kv_fp8.dtype)
    heads = q.shape[1]
    outs = []
    for b in range(qo_indptr.shape[0] - 1):
        q_lo, q_hi = int(qo_indptr[b].item()), int(qo_indptr[b + 1].item())
        kv_lo, kv_hi = int(kv_indptr[b].item()), int(kv_indptr[b + 1].item())
        n_q = q_hi - q_lo
        raw_scores = torch._scaled_mm(
            q_fp8[q_lo:q_hi].reshape(n_q * heads, QK_DIM), kv_fp8_rows[kv_lo:kv_hi].t(),
            scale_a=q_scale, scale_b=kv_scale, out_dtype=torch.float32,
        )
        scores = torch.softmax(raw_scores.view(n_q, heads, -1).permute(1, 0, 2) * sm_scale, dim=-1)
        outs.append((scores @ kv_rows[kv_lo:kv_hi, :KV_LORA_RANK].float()).permute(1, 0, 2).to(torch.bfloat16))
    return torch.cat(outs)


BASELINE_FUNCTIONS = {"loop": torch_bf16_loop, "scaled_mm": torch_fp8_scaled_mm}


def reference_output(impl: str, data) -> torch.Tensor:
    """fp32 reference on exactly the values ``impl`` reads (dequantized KV; fp8-rounded Q for a8w8)."""
    return harness_reference(data, impl if impl in MODES else "bf16")[0]


def check_output(out: torch.Tensor, ref: torch.Tensor) -> dict:
    """rel L2 error, and the fraction of elements outside the harness's |out - ref| <= 0.1 + 0.1 |ref|."""
    err = out.float() - ref
    rel_l2 = (err.norm() / ref.norm().clamp_min(1e-30)).item()
    miss_fraction = (err.abs() > 0.1 + 0.1 * ref.abs()).float().mean().item()
    return {"rel_l2": rel_l2, "harness_miss_fraction": miss_fraction}


# ------------------------------------------------------------------------------------------------------ timing


def time_call_us(fn, *, reps: int, warmup: int, flush: torch.Tensor | None) -> list[float]:
    """Per-rep times (us) of ``fn()``: CUDA events around one call, the L2 flushed (``flush.zero_()``) before each
    rep and the host synchronized after each, as the competition harness does."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times_us = []
    for _ in range(reps):
        if flush is not None:
            flush.zero_()
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times_us.append(start.elapsed_time(end) * 1e3)
    return times_us


def gbps_of(bytes_read: float, time_us: float) -> float:
    return bytes_read / time_us / 1e3


def measure_read_ceiling(device: str) -> dict:
    """Read bandwidth that torch.sum over a 4 GiB bf16 tensor (2 GiB if memory is short) achieves; median."""
    free_bytes, _ = torch.cuda.mem_get_info()
    nbytes = CEILING_BYTES if free_bytes > 2 * CEILING_BYTES else CEILING_BYTES // 2
    data = torch.ones(nbytes // BF16_BYTES, dtype=torch.bfloat16, device=device)
    times_us = time_call_us(functools.partial(torch.sum, data), reps=CEILING_REPS, warmup=2, flush=None)
    del data
    torch.cuda.empty_cache()
    time_us = statistics.median(times_us)
    return {"bytes": nbytes, "time_us": time_us, "gbps": gbps_of(nbytes, time_us), "times_us": times_us}


# ------------------------------------------------------------------------------------------------ measurements


@dataclasses.dataclass
class Bench:
    """What every measurement of one run shares."""

    args: argparse.Namespace
    spec: target.TargetSpec
    device: str
    flush: torch.Tensor
    ceiling_gbps: float
    peers: list[Peer]
    notes_printed: set = dataclasses.field(default_factory=set)

    def note_once(self, key: str, text: str) -> None:
        if key not in self.notes_printed:
            self.notes_printed.add(key)
            print(text)


def base_row(case: Case, impl: str, kind: str, args) -> dict:
    return {"case": case.label, "batch": case.batch, "total_kv": case.total_kv, "mean_kv_len": case.mean_kv_len,
            "q_len": args.q_len, "heads": args.heads, "harness_shape": case.harness, "impl": impl, "kind": kind}


def error_text(exc: Exception) -> str:
    return f"{type(exc).__name__}: {exc}".splitlines()[0][:300]


def measure(bench: Bench, row: dict, fn, *, reps: int, bytes_read: float | None, ref_fn=None) -> dict:
    """Fill ``row`` with the timing of ``fn`` (and its check against ``ref_fn()``); any exception goes in ``error``."""
    try:
        out = fn()  # first call: compiles the kernels (mla) or loads the module (peers)
    except Exception as exc:  # noqa: BLE001 - report and go on: a GPU run is too precious to lose to one failure
        row["error"] = error_text(exc)
        return row
    if ref_fn is not None:
        try:
            row.update(check_output(out, ref_fn()))
            row["check_ok"] = row["rel_l2"] <= REL_L2_LIMIT[row["impl"]]
        except Exception as exc:  # noqa: BLE001 - e.g. the reference ran out of memory: still time the call
            row["check_error"] = error_text(exc)
    del out
    try:
        times_us = time_call_us(fn, reps=reps, warmup=WARMUP_CALLS, flush=bench.flush)
    except Exception as exc:  # noqa: BLE001
        row["error"] = error_text(exc)
        return row
    row.update(time_us=statistics.median(times_us), min_us=min(times_us), reps=reps, times_us=times_us)
    if bytes_read is not None:
        row.update(bytes_read=bytes_read, gbps=gbps_of(bytes_read, row["time_us"]))
        row["pct_ceiling"] = 100.0 * row["gbps"] / bench.ceiling_gbps
    if all(k in row for k in ("batch", "mean_kv_len", "q_len", "heads")):
        row["tflops"] = flops_of(row["batch"], row["mean_kv_len"], row["q_len"], row["heads"]) / row["time_us"] / 1e6
    return row


def bench_baselines(bench: Bench, case: Case, data, ref_fn) -> list[dict]:
    args, rows = bench.args, []
    for name in BASELINES:
        row = base_row(case, name, "baseline", args)
        if case.total_kv > BASELINE_MAX_TOKENS:
            bench.note_once("baseline_skip", f"  (torch baselines are skipped above {BASELINE_MAX_TOKENS} cached "
                                             "tokens: their per-sequence Python loop would take most of the run)")
            row["skipped"] = "slow"
        else:
            fn = lambda name=name: BASELINE_FUNCTIONS[name](data)  # noqa: E731
            measure(bench, row, fn, reps=min(args.reps, BASELINE_MAX_REPS), bytes_read=None,
                    ref_fn=ref_fn if args.check else None)
        print(format_row(row), flush=True)
        rows.append(row)
    return rows


def bench_peers(bench: Bench, case: Case, data, ref_fns: dict, paging=None) -> list[dict]:
    args, rows, shared = bench.args, [], {}
    for peer in bench.peers:
        if peer.reason is not None:
            continue  # said once in the header
        row = base_row(case, peer.name, "peer", args)
        try:
            fn, peer_ref_fn, bytes_mode = peer_lib.peer_callable(peer, data, args.heads, ref_fns, paging, shared)
        except Exception as exc:  # noqa: BLE001 - the row says "unavailable: ..." and the run goes on
            row["error"] = ("setup failed: " if peer.name == AITER else "plan failed: ") + error_text(exc)
        else:
            measure(bench, row, fn, reps=args.reps,
                    bytes_read=bytes_moved(case.batch, case.mean_kv_len, args.q_len, args.heads, bytes_mode),
                    ref_fn=peer_ref_fn if args.check else None)
        print(format_row(row), flush=True)
        rows.append(row)
    return rows


def bench_modes(bench: Bench, case: Case, data, ref_fns: dict, comparisons: list[dict], paging=None) -> list[dict]:
    args, rows = bench.args, []
    page_table = None
    if paging is not None:  # same values, read through a shuffled page table (the reference keeps the flat cache)
        paged_kv, page_table = paging
        data = (data[0], paged_kv, *data[2:])
    for mode in args.modes:
        row = base_row(case, mode, "mode", args)
        # What the call divides by the batch for its split count: a plan, the exact token count; the one-shot op,
        # the rows of the cache it is given.
        kv = harness_cache(data[1], mode)[0]
        cache_rows = None if args.plan else kv.shape[0] * (page_size_of(kv) if page_table is not None else 1)
        row["num_splits"] = splits_for(bench.spec, mode, case, args, cache_rows)
        overrides = mode_overrides(args)
        if args.plan:
            fn = planned_call(mode, data, args.splits, page_table, overrides=overrides)
        else:
            fn = eager_call(mode, data, args.splits, page_table, overrides)
        measure(bench, row, fn, reps=args.reps,
                bytes_read=bytes_moved(case.batch, case.mean_kv_len, args.q_len, args.heads, mode),
                ref_fn=ref_fns[mode] if args.check else None)
        if "time_us" in row:
            row["speedup"] = {c["impl"]: c["time_us"] / row["time_us"] for c in comparisons
                              if "time_us" in c and mode in peer_lib.COMPARED_WITH.get(c["impl"], (mode,))}
        print(format_row(row), flush=True)
        rows.append(row)
    return rows


def reference_fns(data) -> dict:
    """impl -> a function computing its fp32 reference output (once, then cached)."""
    cache = {}

    def ref_for(mode):
        if mode not in cache:
            cache[mode] = reference_output(mode, data)
        return cache[mode]

    return {mode: (lambda mode=mode: ref_for(mode)) for mode in MODES}


def bench_case(bench: Bench, case: Case) -> list[dict]:
    args = bench.args
    print(f"\n== {case.label}: batch {case.batch}, {case.total_kv} cached tokens (mean {case.mean_kv_len:.0f}), "
          f"q_len {args.q_len}, {args.heads} heads", flush=True)
    data = make_inputs(case, args.q_len, args.heads, bench.device)
    ref_fns = reference_fns(data)
    rows = []
    if not args.no_baselines:
        rows += bench_baselines(bench, case, data, ref_fns["bf16"])
    paging = to_paged(data, args.page_size, seed=INPUT_SEED) if args.page_size else None
    if not args.no_peers:
        rows += bench_peers(bench, case, data, ref_fns, paging)
    rows += bench_modes(bench, case, data, ref_fns, comparisons=list(rows), paging=paging)
    del data, ref_fns
    torch.cuda.empty_cache()
    return rows


# ------------------------------------------------------------------------------------------------- host cost


def host_us_per_call(fn, calls: int) -> float:
    """Wall time per call of ``calls`` calls back to back (the host enqueues them; one synchronisation at the end):
    what a caller that launches nothing else sees. When the host is faster than the GPU this is the GPU time."""
    for _ in range(HOST_WARMUP_CALLS):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / calls * 1e6


def sleep_cycles_per_us() -> float:
    """GPU clock cycles per microsecond of ``torch.cuda._sleep`` (measured once with CUDA events)."""
    cycles = 20_000_000
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(cycles // 10)  # warm-up
    start.record()
    torch.cuda._sleep(cycles)
    end.record()
    torch.cuda.synchronize()
    return cycles / (start.elapsed_time(end) * 1e3)


def gpu_us_per_call(fn, calls: int, host_us: float, cycles_per_us: float) -> dict:
    """The GPU time of one call with the GPU never waiting for the host: a sleep kernel holds the stream while the
    host enqueues ``calls`` calls, and CUDA events around the calls time them back to back (launch gaps between a
    call's kernels included). ``queued``: the host finished enqueuing before the sleep ended (else the GPU may have
    waited, and the time is an upper bound)."""
    sleep_us = 2.0 * calls * host_us + 2000.0
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    torch.cuda._sleep(int(sleep_us * cycles_per_us))
    start.record()
    begin = time.perf_counter()
    for _ in range(calls):
        fn()
    enqueue_us = (time.perf_counter() - begin) * 1e6
    end.record()
    torch.cuda.synchronize()
    return {"gpu_us": start.elapsed_time(end) * 1e3 / calls, "queued": enqueue_us < sleep_us}


def measure_host(row: dict, fn, calls: int, cycles_per_us: float) -> dict:
    """Fill a host-cost row: ``host_us_per_call`` (median over HOST_ROUNDS loops of ``calls`` calls),
    ``gpu_us_per_call`` (median over HOST_ROUNDS) and ``host_overhead_us``, their difference."""
    try:
        fn()  # builds / loads the kernels
        host = [host_us_per_call(fn, calls) for _ in range(HOST_ROUNDS)]
        gpu = [gpu_us_per_call(fn, GPU_TIME_CALLS, statistics.median(host), cycles_per_us)
               for _ in range(HOST_ROUNDS)]
    except Exception as exc:  # noqa: BLE001 - report and go on
        row["error"] = error_text(exc)
        return row
    row.update(host_us_per_call=statistics.median(host), gpu_us_per_call=statistics.median(g["gpu_us"] for g in gpu),
               host_rounds_us=host, calls=calls, gpu_time_queued=all(g["queued"] for g in gpu))
    row["host_overhead_us"] = row["host_us_per_call"] - row["gpu_us_per_call"]
    return row


def bench_host(bench: Bench, case: Case) -> list[dict]:
    """The host-cost table at one shape: every mode through ``mla_decode`` and through ``DecodePlan.run`` (rows
    with ``"plan": true``), and every peer's timed call (FlashInfer's ``run``, FlashMLA's decode op, aiter's
    decode)."""
    args, rows = bench.args, []
    print(f"\n== host cost per call at {case.label} (q_len {args.q_len}, {args.heads} heads): wall time of "
          f"{args.host_calls} calls back to back, and that minus the call's GPU time (queued behind a sleep kernel); "
          f"median of {HOST_ROUNDS}", flush=True)
    data = make_inputs(case, args.q_len, args.heads, bench.device)
    paging = to_paged(data, args.page_size, seed=INPUT_SEED) if args.page_size else None
    run_data, page_table = (data, None) if paging is None else ((data[0], paging[0], *data[2:]), paging[1])
    cycles_per_us = sleep_cycles_per_us()
    calls, overrides = [], mode_overrides(args)
    for mode in args.modes:
        calls.append((mode, "eager", eager_call(mode, run_data, args.splits, page_table, overrides)))
        calls.append((mode, "plan.run", planned_call(mode, run_data, args.splits, page_table, overrides=overrides)))
    if not overrides:  # FlashMLA's interface (no config overrides), on 64-token pages as FlashMLA takes
        flash_paging = paging if args.page_size == FLASH_PAGE_SIZE else to_paged(data, FLASH_PAGE_SIZE, seed=INPUT_SEED)
        for mode in args.modes:
            calls.append((mode, "flash_mla", flash_mla_call(mode, data, flash_paging)))
    if "bf16" in args.modes and paging is None and not overrides and args.splits is None:
        # The competition harness's entry point: the harness tuple unpacked and checked on every call, then eager.
        calls.append(("bf16", "custom_kernel", lambda: custom_kernel(data)))
    # This host's own speed, for reading the rows across machines (their CPUs differ ~2x, docs/perf.md run 18): one
    # torch launch of a tiny kernel, host-bound, so its "host overhead" is torch's host time per launch here.
    cell = torch.zeros(1, device=bench.device)
    calls.append(("torch", "reference", lambda: cell.add_(1)))
    ref_fns, shared = reference_fns(data), {}
    for peer in bench.peers:
        if peer.reason is None:
            try:
                fn = peer_lib.peer_callable(peer, data, args.heads, ref_fns, paging, shared)[0]
            except Exception as exc:  # noqa: BLE001 - said in its row of the main table too
                rows.append(dict(base_row(case, peer.name, "host", args), peer=True, plan=False, call="peer",
                                 error="setup failed: " + error_text(exc)))
                continue
            calls.append((peer.name, "peer", fn))
    for impl, call, fn in calls:
        row = dict(base_row(case, impl, "host", args), plan=call == "plan.run", peer=call == "peer", call=call)
        measure_host(row, fn, args.host_calls, cycles_per_us)
        print(format_host_row(row), flush=True)
        rows.append(row)
    del data, run_data, paging, ref_fns, shared, calls
    torch.cuda.empty_cache()
    return rows


def flash_mla_extras(cache_kwargs: dict) -> dict:
    """``flash_mla_with_kvcache``'s keyword extras for the op's cache keywords (``harness_cache``'s): the fp8
    scale as ``descale_k``, the mxfp4 block scales, and a8w8's Q format."""
    extras = {}
    if "kv_scale" in cache_kwargs:
        extras["descale_k"] = cache_kwargs["kv_scale"]
    if "kv_block_scale" in cache_kwargs:
        extras["kv_block_scale"] = cache_kwargs["kv_block_scale"]
    if cache_kwargs["q_format"] == "fp8":
        extras["q_format"] = "fp8"
    return extras


def flash_mla_call(mode: str, data, paging):
    """``mla.flash_mla.flash_mla_with_kvcache`` on the paged cache ``paging`` (FlashMLA's layout: q (batch, s_q,
    h_q, 576), cache_seqlens, block table) with one metadata object reused, as a serving step reuses it across
    layers (filled by the first, untimed, call)."""
    q, _, qo_indptr, kv_indptr, _ = data
    caches, table = paging
    kv, cache_kwargs = harness_cache(caches, mode)
    batch = len(qo_indptr) - 1
    q4 = q.view(batch, q.shape[0] // batch, q.shape[1], q.shape[2])
    seqlens = kv_indptr.diff().to(torch.int32)
    extras = flash_mla_extras(cache_kwargs)
    metadata, _ = get_mla_metadata()
    fp8_cache = cache_kwargs["kv_format"] == "fp8"

    def call():
        return flash_mla_with_kvcache(q4, kv, table, seqlens, KV_LORA_RANK, metadata, is_fp8_kvcache=fp8_cache,
                                      **extras)

    call()
    return call


def format_host_row(row: dict) -> str:
    call = row.get("call") or ("plan.run" if row.get("plan") else ("peer" if row.get("peer") else "eager"))
    head = f"  {row['impl']:<14} {call:<9}"
    if "error" in row:
        return f"{head} {'unavailable' if row.get('peer') else 'FAILED'}: {row['error']}"
    text = (f"{head} {row['host_us_per_call']:8.1f} us/call wall, GPU {row['gpu_us_per_call']:7.1f} us, host overhead "
            f"{row['host_overhead_us']:7.1f} us")
    target = HOST_TARGETS_US.get(call)
    if target is not None:
        text += f"  (target <= {target:g}: {'met' if row['host_overhead_us'] <= target else 'MISSED'})"
    return text + ("" if row["gpu_time_queued"] else "  (GPU time: the queue ran dry, an upper bound)")


def print_host_summary(rows: list[dict]) -> None:
    """The host table again, with the fastest peer's wall time per call for comparison."""
    host = [r for r in rows if r["kind"] == "host" and "host_us_per_call" in r]
    if not host:
        return
    print(f"\n== host cost per call at {host[0]['case']}: wall us/call | GPU us/call | host overhead us")
    for row in host:
        print(format_host_row(row))
    peer_rows = [r for r in host if r["peer"]]
    if peer_rows:
        fastest = min(peer_rows, key=lambda r: r["host_us_per_call"])
        print(f"fastest peer per call: {fastest['impl']} {fastest['host_us_per_call']:.1f} us wall", flush=True)


# ------------------------------------------------------------------------------------------------------ output


def format_row(row: dict) -> str:
    head = f"  {row['case']:<20} {row['impl']:<10}"
    if row.get("skipped"):
        return f"{head} skipped ({row['skipped']})"
    if row.get("error"):
        return f"{head} {'FAILED' if row['kind'] == 'mode' else 'unavailable'}: {row['error']}"
    text = f"{head} {row['time_us']:9.1f} us (min {row['min_us']:9.1f})"
    if "gbps" in row:
        text += f" {row['gbps']:6.0f} GB/s {row['pct_ceiling']:5.1f}%"
    if "tflops" in row:
        text += f" {row['tflops']:6.1f} TFLOP/s"
    if "num_splits" in row:
        text += f"  splits {row['num_splits']:2d}"
    if row.get("speedup"):
        text += "  | " + " ".join(f"{ratio:6.2f}x {name}" for name, ratio in row["speedup"].items())
    if "rel_l2" in row:
        text += f"  | relL2 {row['rel_l2']:.1e} miss {100 * row['harness_miss_fraction']:.1f}%"
        text += "" if row["check_ok"] else " FAIL"
    if "check_error" in row:
        text += f"  | check not run: {row['check_error']}"
    return text


def geomean(values: list[float]) -> float:
    return math.exp(sum(math.log(v) for v in values) / len(values))


def timed_impls(rows: list[dict], kinds: tuple[str, ...]) -> list[str]:
    """Implementations of these kinds with at least one time: modes, then peers, then baselines."""
    timed = {r["impl"] for r in rows if r["kind"] in kinds and "time_us" in r}
    return [impl for impl in IMPL_ORDER if impl in timed]


def lookup(rows: list[dict], case_label: str, impl: str) -> dict | None:
    return next((r for r in rows if r["case"] == case_label and r["impl"] == impl and "time_us" in r), None)


def geomean_line(rows: list[dict], cases: list[Case], impls: list[str]) -> str | None:
    harness = [c.label for c in cases if c.harness]
    if not harness:
        return None
    parts = []
    for impl in impls:
        times_us = [r["time_us"] for r in (lookup(rows, label, impl) for label in harness) if r is not None]
        if times_us:
            partial = "" if len(times_us) == len(harness) else f" (over {len(times_us)})"
            parts.append(f"{impl} {geomean(times_us):.1f} us{partial}")
    return f"geomean time over {len(harness)} harness shape(s): " + " | ".join(parts)


def table(rows: list[dict], cases: list[Case], impls: list[str], cell, header_suffix: str) -> list[str]:
    """A compact table: one line per case, one column per implementation; ``cell(row) -> str``."""
    width = max([len(c.label) for c in cases] + [7])
    lines = [f"{'shape':<{width}} | " + " | ".join(f"{impl + header_suffix:>12}" for impl in impls)]
    for case in cases:
        cells = [lookup(rows, case.label, impl) for impl in impls]
        lines.append(f"{case.label:<{width}} | " + " | ".join(f"{cell(r) if r else '-':>12}" for r in cells))
    return lines


def print_summary(rows: list[dict], cases: list[Case], ceiling_gbps: float, args) -> None:
    modes_and_peers = timed_impls(rows, ("mode", "peer"))
    all_impls = timed_impls(rows, ("mode", "peer", "baseline"))
    print(f"\n== summary: median of {args.reps} reps, cold L2; q_len {args.q_len}, {args.heads} heads; "
          f"read ceiling {ceiling_gbps:.0f} GB/s")
    failed = [f"{r['case']}/{r['impl']}" for r in rows if r["kind"] == "mode" and "error" in r]
    if failed:
        print("FAILED: " + ", ".join(failed))
    if args.check:
        bad = [f"{r['case']}/{r['impl']}" for r in rows if r.get("check_ok") is False or "check_error" in r]
        print("check: " + ("all within tolerance" if not bad else "FAIL " + ", ".join(bad)))
    line = geomean_line(rows, cases, all_impls)
    if line:
        print(line)
    print("achieved GB/s (% of read ceiling):")
    print("\n".join(table(rows, cases, modes_and_peers,
                          lambda r: f"{r['gbps']:.0f} ({r['pct_ceiling']:.0f}%)", "")))
    print("time, us (median):")
    print("\n".join(table(rows, cases, all_impls, lambda r: f"{r['time_us']:.1f}", " us")), flush=True)


def grid_table(rows: list[dict], cases: list[Case], points: list[tuple[int, int]]) -> list[str]:
    """One line per (heads x q_len, shape), one column per mode / peer: median us and TFLOP/s."""
    impls = timed_impls(rows, ("mode", "peer"))
    width = max([len(c.label) for c in cases] + [5])
    lines = [f"{'heads x q':>9} {'shape':<{width}} | " + " | ".join(f"{impl + ' us (TFLOP/s)':>24}" for impl in impls)]
    for heads, q_len in points:
        at = [r for r in rows if r.get("heads") == heads and r.get("q_len") == q_len]
        for case in cases:
            cells = []
            for impl in impls:
                r = lookup(at, case.label, impl)
                cells.append("-" if r is None else f"{r['time_us']:.1f} ({r.get('tflops', 0.0):.0f})")
            lines.append(f"{f'{heads}x{q_len}':>9} {case.label:<{width}} | " + " | ".join(f"{c:>24}" for c in cells))
    return lines


def print_grid_summary(rows: list[dict], cases: list[Case], points: list[tuple[int, int]], args) -> None:
    print(f"\n== grid: median of {args.reps} reps, cold L2; us (achieved TFLOP/s) per (heads x q_len, shape)")
    print("\n".join(grid_table(rows, cases, points)), flush=True)


def git_commit() -> str | None:
    """The tree's commit: $MLA_GIT_COMMIT where set (a copied tree whose git metadata lags, e.g. the GPU host's),
    else ``git rev-parse``."""
    if os.environ.get("MLA_GIT_COMMIT"):
        return os.environ["MLA_GIT_COMMIT"]
    try:
        result = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO_DIR, capture_output=True,
                                text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    if result.returncode != 0:
        return None
    return result.stdout.strip() or None


def write_json(path: str, rows: list[dict], ceiling: dict, args, device_name: str) -> None:
    meta = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "git_commit": git_commit(),
        "device": device_name,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "hip": torch.version.hip,
        "read_ceiling": ceiling,
        "args": vars(args),
        "timing": {"warmup_calls": WARMUP_CALLS, "flush_bytes": FLUSH_BYTES, "baseline_max_reps": BASELINE_MAX_REPS},
    }
    with open(path, "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1, default=str)
    print(f"wrote {len(rows)} rows to {path}")


def write_plot(path: str, rows: list[dict], cases: list[Case], ceiling_gbps: float, title: str) -> None:
    """Bar chart: one group per case, one bar per mode / peer (achieved GB/s), dashed line at the read ceiling."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        print(f"plot skipped: {exc}")
        return
    impls = timed_impls(rows, ("mode", "peer"))
    if not impls:
        print("plot skipped: nothing was timed")
        return
    bar_width = 0.8 / len(impls)
    fig, ax = plt.subplots(figsize=(max(8.0, 1.1 * len(cases) + 2), 5))
    for i, impl in enumerate(impls):
        gbps = [(lookup(rows, c.label, impl) or {}).get("gbps", 0.0) for c in cases]
        offsets = [x + (i - (len(impls) - 1) / 2) * bar_width for x in range(len(cases))]
        ax.bar(offsets, gbps, bar_width, label=impl)
    ax.axhline(ceiling_gbps, color="black", linestyle="--", linewidth=1,
               label=f"read ceiling {ceiling_gbps:.0f} GB/s")
    ax.set_xticks(range(len(cases)))
    ax.set_xticklabels([c.label for c in cases], rotation=30, ha="right")
    ax.set_ylabel("achieved GB/s (own format's bytes)")
    ax.set_title(title)
    ax.legend(fontsize="small", ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)
    print(f"wrote plot to {path}")


# -------------------------------------------------------------------------------------------------------- runs


def print_split_table(spec, cases: list[Case], args) -> None:
    forced = f" (forced by --splits {args.splits})" if args.splits else ""
    print(f"KV splits per sequence for {spec.name} ({spec.num_sms} SMs){forced}:")
    width = max([len(c.label) for c in cases] + [5])
    print(f"  {'shape':<{width}} " + " ".join(f"{m:>6}" for m in args.modes))
    for case in cases:
        print(f"  {case.label:<{width}} " + " ".join(f"{splits_for(spec, m, case, args):>6}" for m in args.modes))


def compile_only(args, cases: list[Case]) -> int:
    """No GPU: build, for sm_90a, every kernel variant this command line would run; 0 when all compiled."""
    print("no CUDA device: timing skipped. Compiling the kernel variants this run would use, for sm_90a, on the CPU.")
    spec = target.spec_for_name("sm_90a")
    cases = list(dict.fromkeys(cases + [uniform_case(*shape) for shape in args.host_shape]))  # + the host table's
    print_split_table(spec, cases, args)
    configs = list(dict.fromkeys(
        cfg for heads, q_len in grid_points(args) for case in cases for mode in args.modes
        for cfg in selected_kernels(spec, mode, case, at_point(args, heads, q_len))[:2] if cfg is not None
    ))
    failures = 0
    for i, cfg in enumerate(configs, 1):  # jit logs one line per build ("... ready in N s")
        try:
            jit.get_kernel(cfg, spec)
        except Exception as exc:  # noqa: BLE001 - report every variant, then fail at the end
            failures += 1
            print(f"[{i}/{len(configs)}] {cfg.name}: FAILED: {type(exc).__name__}: {exc}", flush=True)
    print(f"{len(configs) - failures} of {len(configs)} kernel variants compiled for {spec.name}")
    return 1 if failures else 0


def print_header(args, spec, device_name: str) -> None:
    print(f"device: {device_name} ({spec.name}, {spec.num_sms} SMs); torch {torch.__version__}; "
          f"git {git_commit() or '?'}")
    print(f"timing: CUDA events around one call, L2 flushed ({FLUSH_BYTES >> 20} MiB write) before each rep, "
          f"median of {args.reps} reps after {WARMUP_CALLS} warm-up calls "
          f"(baselines: {min(args.reps, BASELINE_MAX_REPS)})", flush=True)


def print_ceiling(ceiling: dict) -> None:
    print(f"read ceiling: torch.sum over {ceiling['bytes'] / 2**30:g} GiB bf16: {ceiling['gbps']:.0f} GB/s "
          f"({ceiling['time_us']:.0f} us)", flush=True)


def print_peers(peers: list[Peer], args) -> None:
    if not args.no_peers:
        print("\n".join(peer_lib.status_lines(peers)))
    print("kernels compile on first use (one 'ready in' line each; TileLang's disk cache makes reruns fast)",
          flush=True)


def run_benchmark(args, cases: list[Case]) -> int:
    device_name = torch.cuda.get_device_name()
    spec = target.spec_for_device(torch.device(DEVICE))
    print_header(args, spec, device_name)
    ceiling = measure_read_ceiling(DEVICE)
    print_ceiling(ceiling)
    flush = torch.empty(FLUSH_BYTES, dtype=torch.uint8, device=DEVICE)
    peers = [] if args.no_peers else peer_lib.setup_peers(DEVICE)
    print_peers(peers, args)
    bench = Bench(args=args, spec=spec, device=DEVICE, flush=flush, ceiling_gbps=ceiling["gbps"], peers=peers)
    rows = []
    points = grid_points(args)
    for heads, q_len in points:
        bench.args = at_point(args, heads, q_len)
        for case in cases:
            rows += bench_case(bench, case)
    bench.args = args
    for shape in args.host_shape:
        rows += bench_host(bench, uniform_case(*shape))
    if args.json:
        write_json(args.json, rows, ceiling, args, device_name)
    if args.plot:
        title = f"MLA decode, {device_name}, q_len {args.q_len}, {args.heads} heads"
        write_plot(args.plot, rows, cases, ceiling["gbps"], title)
    for heads, q_len in points:
        at = [r for r in rows if r["kind"] == "host" or (r.get("heads"), r.get("q_len")) == (heads, q_len)]
        print_summary(at, cases, ceiling["gbps"], at_point(args, heads, q_len))
    if len(points) > 1:
        print_grid_summary(rows, cases, points, args)
    print_host_summary(rows)
    return 1 if any(r["kind"] in ("mode", "host") and "error" in r and not r.get("peer") for r in rows) else 0


def main(argv=None) -> int:
    args = parse_args(argv)
    logging.basicConfig(format="%(message)s")
    log.setLevel(logging.INFO)  # the "mla: <kernel> ready in X s" lines
    try:
        sys.stdout.reconfigure(line_buffering=True)
    except AttributeError:
        pass
    cases = build_cases(args)
    if not cases and not args.host_shape:
        print("nothing to run: no shapes (add --ragged or --long, or give --shapes or --host-shape)")
        return 2
    if not torch.cuda.is_available():
        return compile_only(args, cases)
    return run_benchmark(args, cases)


if __name__ == "__main__":
    sys.exit(main())
