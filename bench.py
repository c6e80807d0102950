"""Benchmark of the TileLang MLA decode op (``mla.decode.mla_decode``), timed the way the competition harness times:
CUDA events around ONE call, the L2 flushed (a 256 MiB write) before each rep, median of many reps (the min too).

Usage, from the repo root (``python bench.py`` finds the ``mla`` package next to this file):

    python bench.py                                  # 8 harness shapes x modes bf16 fp8 a8w8 mxfp4, + peers, baselines
    python bench.py --modes fp8,mxfp4 --shapes 4x1024,256x8192
    python bench.py --ragged --long --check          # + ragged batches and 32k contexts; verify vs the fp32 reference
    python bench.py --q-len 2 --no-baselines         # MTP: 2 query tokens per sequence
    python bench.py --page-size 16 --heads 128       # paged KV (FlashInfer reads the same pages), 128 heads
    python bench.py --plan                           # time DecodePlan.run (planned once, untimed, like FlashInfer)
    python bench.py --splits 1 --no-peers --reps 100 # force one KV split (no combine kernel)
    python bench.py --json results.json --plot gbps.png
    python bench.py --shapes none --ragged           # only the ragged batches

Modes (what the op reads):
    bf16   bf16 Q, bf16 KV cache                      (1152 B per cached token)
    fp8    bf16 Q, fp8 e4m3 KV + per-tensor scale     (576 B per token)
    a8w8   Q quantized to fp8 inside the call, fp8 KV (576 B per token): the competition's reference configuration
    mxfp4  bf16 Q, mxfp4 KV (e2m1 + e8m0 per 32)      (288 + 18 = 306 B per token)
Peers (when importable): FlashInfer's BatchMLAPagedAttentionWrapper, backends fa3 and fa2, bf16 Q and KV, page size 1
(with --page-size: the same shuffled pages as ours, as CSR page lists); only its ``run`` is timed (``plan`` is not; our
--plan option times ``DecodePlan.run`` the same way). On ROCm only, AMD aiter (package amd-aiter): its a8w8 persistent MLA decode
called as the competition reference calls it (fp8 Q and KV, per-tensor scales, page size 1, 32 KV splits); only
``aiter.mla.mla_decode_fwd`` is timed (metadata and the fp8 quantization of Q and KV are not). The aiter peer is
untested in this project (no ROCm machine): only its call sequence is checked, on the CPU, against a fake aiter.
Baselines: the harness template's two naive torch versions, re-implemented here: a per-sequence bf16 loop ("loop") and
fp8 Q/K through ``torch._scaled_mm`` ("scaled_mm"); skipped above BASELINE_MAX_TOKENS cached tokens (too slow).

Achieved GB/s = ``bytes_moved(...)`` / median time; the read ceiling (``torch.sum`` over a 4 GiB bf16 tensor) is
measured in the same run. Without a CUDA device the script compiles, for sm_90a on the CPU, every kernel variant the
same command line would use, prints the modelled split counts, and exits.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import importlib
import itertools
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
from mla.decode import DEFAULT_SM_SCALE, SUPPORTED_HEADS, harness_cache, page_size_of, plan, run_harness  # noqa: E402
from mla.inputs import HARNESS_SHAPES, make_harness_inputs, make_ragged_inputs, to_paged  # noqa: E402
from mla.constants import KV_LORA_RANK, QK_DIM, ROPE_DIM  # noqa: E402
from mla.constants import MODES as MODE_FORMATS  # noqa: E402
from mla.reference import harness_reference, mla_decode_reference  # noqa: E402

DEVICE = "cuda"
BF16_BYTES = 2

MODES = tuple(MODE_FORMATS)
KV_BYTES_PER_TOKEN = {
    "bf16": QK_DIM * BF16_BYTES,  # 1152
    "fp8": QK_DIM,  # 576 (the one 4-byte per-tensor scale is not counted)
    "a8w8": QK_DIM,
    "mxfp4": QK_DIM // 2 + QK_DIM // 32,  # 288 packed e2m1 + 18 e8m0 scales = 306
}
PEERS = ("fa3", "fa2")  # FlashInfer MLA backends
AITER = "aiter"  # AMD aiter's a8w8 persistent MLA decode (ROCm only)
AITER_PAGE_SIZE = 1  # as the competition reference (gpu-mode/reference-kernels problems/amd_202602/mixed-mla)
AITER_NUM_KV_SPLITS = 32
BASELINES = ("loop", "scaled_mm")  # the harness template's naive torch versions
BASELINE_MAX_TOKENS = 64 * 8192  # cached tokens (batch * kv_len) above which the baselines are skipped
REL_L2_LIMIT = {"bf16": 1e-2, "fp8": 2e-2, "a8w8": 2e-2, "mxfp4": 2e-2, "fa3": 1e-2, "fa2": 1e-2, AITER: 2e-2,
                "loop": 1e-2, "scaled_mm": 5e-2}  # --check flags FAIL above these (vs the fp32 reference)

WARMUP_CALLS = 5
DEFAULT_REPS = 50
BASELINE_MAX_REPS = 20  # the baselines are slow and only set the scale; fewer reps
FLUSH_BYTES = 256 * 2**20  # >= 256 MB written before each rep: the H200's L2 is 50 MiB
CEILING_BYTES = 4 * 2**30  # torch.sum over this many bytes of bf16 (half of it when memory is short)
CEILING_REPS = 10
FLASHINFER_WORKSPACE_BYTES = 128 * 2**20
INPUT_SEED = 0
RAGGED_SEED = 1234
RAGGED_BATCHES = ((64, 8192), (128, 2048))  # (sequences, max kv_len): lengths uniform in 1..max
LONG_SHAPES = ((4, 32768), (16, 32768))

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


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text}")
    return value


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        description="Time the TileLang MLA decode kernels (H200) against torch baselines and FlashInfer.",
        epilog="\n\n".join(__doc__.split("\n\n")[1:4]),
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
    parser.add_argument("--page-size", type=positive_int, default=None,
                        help="read the KV through a page table: caches laid out in shuffled pages of this many tokens")
    parser.add_argument("--plan", action="store_true",
                        help="time DecodePlan.run (mla.decode.plan made once per shape, untimed, as FlashInfer's "
                             "plan is) instead of the one-shot mla_decode call")
    parser.add_argument("--splits", type=positive_int, default=None,
                        help="force num_splits (default: the op's own choice, schedule.choose_num_splits)")
    parser.add_argument("--no-baselines", action="store_true", help="skip the naive torch baselines")
    parser.add_argument("--no-peers", action="store_true", help="skip FlashInfer (and AMD aiter, on ROCm)")
    parser.add_argument("--json", metavar="PATH", help="write every measurement to PATH as JSON")
    parser.add_argument("--plot", metavar="PATH", help="write a PNG bar chart of achieved GB/s (needs matplotlib)")
    parser.add_argument("--reps", type=positive_int, default=DEFAULT_REPS,
                        help=f"timed reps per measurement (default {DEFAULT_REPS}, after {WARMUP_CALLS} warm-up calls)")
    parser.add_argument("--check", action="store_true",
                        help="before timing, compare each implementation once per shape with the fp32 reference")
    return parser.parse_args(argv)


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


def selected_kernels(spec, mode: str, case: Case, args, total_kv: int | None = None) -> tuple:
    """(decode config, combine config or None, num_splits) that mla_decode launches for this case: the op's own
    selection (``schedule.select_kernels``) from the same sizes. ``total_kv``: the rows of the cache the op is
    given (a paged cache's pages hold more rows than tokens); default the case's token count."""
    kv_format, q_format = MODE_FORMATS[mode]
    return schedule.select_kernels(
        spec, kv_format=kv_format, q_format=q_format, num_heads=args.heads, causal=False,
        page_size=args.page_size or 0, batch=case.batch, total_q=case.batch * args.q_len,
        total_kv=case.total_kv if total_kv is None else total_kv, num_splits=args.splits,
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


def run_mode(mode: str, data, num_splits: int | None = None, page_table: torch.Tensor | None = None) -> torch.Tensor:
    """One mla_decode call in ``mode`` on the harness tuple ``data`` (paged caches come with ``page_table``)."""
    return run_harness(data, mode, num_splits=num_splits, page_table=page_table)


def planned_call(mode: str, data, num_splits: int | None = None, page_table: torch.Tensor | None = None,
                 causal: bool = False):
    """``mla.decode.plan`` for this batch (untimed, as a serving engine plans once per step for all layers; the
    split count is the op's own choice unless forced) and the ``DecodePlan.run`` call to time."""
    q, kv_data, qo_indptr, kv_indptr, _ = data
    kv, cache_kwargs = harness_cache(kv_data, mode)
    kv_format, q_format = cache_kwargs.pop("kv_format"), cache_kwargs.pop("q_format")
    paging = {} if page_table is None else dict(page_size=page_size_of(kv), page_table=page_table)
    the_plan = plan(qo_indptr, kv_indptr, num_heads=q.shape[1], kv_format=kv_format, q_format=q_format,
                    num_splits=num_splits, causal=causal, **paging)
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


# ------------------------------------------------------------------------------------------------------- peers


@dataclasses.dataclass
class Peer:
    """A FlashInfer MLA backend or AMD aiter, or why it is unavailable."""

    name: str
    module: object = None
    workspace: torch.Tensor | None = None
    reason: str | None = None


def load_flashinfer():
    """(flashinfer module, None) or (None, reason). JIT is disabled first: a missing prebuilt kernel fails loudly."""
    os.environ.setdefault("FLASHINFER_DISABLE_JIT", "1")
    try:
        import flashinfer
        import flashinfer.mla  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - any import failure just means "no peer"
        return None, f"import flashinfer failed: {type(exc).__name__}: {exc}"
    return flashinfer, None


def setup_peers(device: str) -> list[Peer]:
    flashinfer, reason = load_flashinfer()
    if flashinfer is None:
        peers = [Peer(name, reason=reason) for name in PEERS]
    else:
        peers = [Peer(name, module=flashinfer,
                      workspace=torch.empty(FLASHINFER_WORKSPACE_BYTES, dtype=torch.uint8, device=device))
                 for name in PEERS]
    aiter_peer = setup_aiter_peer()
    return peers + ([aiter_peer] if aiter_peer is not None else [])


def flashinfer_callable(peer: Peer, data, heads: int, paging=None):
    """Plan FlashInfer's MLA wrapper for this batch (untimed); returns the call to time (``run`` only). Flat
    caches are read as pages of one token; with ``paging`` (paged caches, page table) through the same pages as
    our kernels, as CSR page lists."""
    q, kv_data, qo_indptr, kv_indptr, _ = data
    wrapper = peer.module.mla.BatchMLAPagedAttentionWrapper(peer.workspace, backend=peer.name)
    kv_lens = (kv_indptr[1:] - kv_indptr[:-1]).to(torch.int32)
    if paging is None:
        kv = kv_data["bf16"]  # (total_kv, 1, 576): page size 1, one token per page
        page_size, page_indptr = 1, kv_indptr
        kv_indices = torch.arange(kv.shape[0], dtype=torch.int32, device=kv.device)
    else:
        paged_kv, page_table = paging
        num_pages, page_size = paged_kv["bf16"].shape[:2]
        kv = paged_kv["bf16"].view(num_pages, page_size, QK_DIM)
        pages = [-(-n // page_size) for n in kv_lens.tolist()]
        page_indptr = torch.tensor([0, *itertools.accumulate(pages)], dtype=torch.int32, device=kv.device)
        kv_indices = torch.cat([page_table[b, :n] for b, n in enumerate(pages)]).contiguous()
    wrapper.plan(
        qo_indptr=qo_indptr, kv_indptr=page_indptr, kv_indices=kv_indices, kv_len_arr=kv_lens, num_heads=heads,
        head_dim_ckv=KV_LORA_RANK, head_dim_kpe=ROPE_DIM, page_size=page_size, causal=False,
        sm_scale=DEFAULT_SM_SCALE, q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16,
    )
    q_nope, q_pe = q[..., :KV_LORA_RANK], q[..., KV_LORA_RANK:]  # strided views, as SGLang passes them
    ckv_cache, kpe_cache = kv[..., :KV_LORA_RANK], kv[..., KV_LORA_RANK:]  # (pages, page_size, 512) / (.., 64)
    return lambda: wrapper.run(q_nope, q_pe, ckv_cache, kpe_cache)


# AMD aiter. Untested in this project (no ROCm machine): written from aiter's sources (aiter/mla.py, aiter/ops/
# attention.py, op_tests/test_mla_persistent.py of ROCm/aiter) and the competition reference (gpu-mode/
# reference-kernels problems/amd_202602/mixed-mla/reference.py); tests/test_bench_cpu.py checks the calls against a
# fake aiter on the CPU. PyPI's "aiter" is an unrelated package: AMD's is "amd-aiter", recognised by aiter.mla.


def load_aiter():
    """(aiter module, None) or (None, reason). Off ROCm: (None, "not on ROCm") without trying to import anything."""
    if not torch.version.hip:
        return None, "not on ROCm"
    try:
        aiter = importlib.import_module("aiter")
    except Exception as exc:  # noqa: BLE001 - amd-aiter may fail to import (JIT, missing ROCm libs): no peer
        return None, f"unavailable: import aiter failed: {type(exc).__name__}: {exc}"
    try:
        aiter_mla = importlib.import_module("aiter.mla")
    except ModuleNotFoundError as exc:
        if exc.name in ("aiter.mla", "aiter"):  # an "aiter" without an mla submodule: not AMD's
            return None, (f"wrong package: 'import aiter' found {getattr(aiter, '__file__', '?')}, which has no "
                          "aiter.mla (PyPI's 'aiter' is unrelated; AMD's package is amd-aiter)")
        return None, f"unavailable: import aiter.mla failed: {type(exc).__name__}: {exc}"
    except Exception as exc:  # noqa: BLE001
        return None, f"unavailable: import aiter.mla failed: {type(exc).__name__}: {exc}"
    if not callable(getattr(aiter_mla, "mla_decode_fwd", None)):
        return None, "wrong package: aiter.mla has no mla_decode_fwd (AMD's package is amd-aiter)"
    missing = [name for name in ("get_mla_metadata_info_v1", "get_mla_metadata_v1")
               if not callable(getattr(aiter, name, None))]
    if not isinstance(getattr(getattr(aiter, "dtypes", None), "fp8", None), torch.dtype):
        missing.append("dtypes.fp8")
    if missing:  # an amd-aiter from before the persistent (v1 metadata) MLA decode
        return None, "unavailable: amd-aiter too old or incomplete: no " + ", ".join(f"aiter.{m}" for m in missing)
    return aiter, None


def aiter_version(aiter) -> str:
    version = getattr(aiter, "__version__", None)
    if version:
        return str(version)
    try:
        from importlib import metadata

        return metadata.version("amd-aiter")
    except Exception:  # noqa: BLE001 - a source checkout may have no distribution metadata
        return "?"


def setup_aiter_peer() -> Peer | None:
    """None off ROCm (nothing is imported); else the aiter peer, or why it is unavailable."""
    aiter, reason = load_aiter()
    if aiter is None and reason == "not on ROCm":
        return None
    return Peer(AITER, module=aiter, reason=reason)


def aiter_status(peer: Peer | None) -> str:
    """The header line about AMD aiter."""
    if peer is None:
        return "aiter: not on ROCm"
    if peer.reason is not None:
        return f"aiter: {peer.reason}"
    return (f"aiter: amd-aiter {aiter_version(peer.module)}: a8w8 persistent MLA decode (fp8 Q and KV, page size "
            f"{AITER_PAGE_SIZE}, {AITER_NUM_KV_SPLITS} KV splits); untested in this project")


def aiter_callable(peer: Peer, data, heads: int):
    """Set up aiter's a8w8 persistent MLA decode for this batch (untimed); returns (the call to time, a function
    computing the fp32 reference on exactly the fp8 values that call reads).

    Untested in this project (no ROCm machine). The call sequence is the competition reference's:
      1. Q and the KV cache quantized per tensor to ``aiter.dtypes.fp8`` (e4m3fnuz on gfx942, e4m3fn on gfx950);
      2. ``aiter.get_mla_metadata_info_v1`` gives the (size, dtype) of the six work buffers;
      3. ``aiter.get_mla_metadata_v1`` fills them (note its argument order: work_info_set before work_indptr);
      4. timed: ``aiter.mla.mla_decode_fwd`` with the buffers, the scales and num_kv_splits=32.
    One deviation: kv_last_page_lens is all ones (page size 1: one token in every page), as aiter's own
    op_tests/test_mla_persistent.py passes it; the competition reference passes the sequence lengths there.
    Like the reference, the metadata is causal (is_causal=True; mla_decode_fwd's default): the same as non-causal
    for one query token, and the check's reference is causal too.
    """
    aiter = peer.module
    aiter_mla = getattr(aiter, "mla", None)
    if aiter_mla is None:
        aiter_mla = importlib.import_module("aiter.mla")
    fp8 = aiter.dtypes.fp8
    q, kv_data, qo_indptr, kv_indptr, _ = data
    device = q.device
    total_q = q.shape[0]
    batch = qo_indptr.shape[0] - 1
    num_kv_heads = 1
    if q.shape[1] != heads or q.shape[2] != QK_DIM:
        raise ValueError(f"q is {tuple(q.shape)}, expected (total_q, {heads}, {QK_DIM})")
    if heads % 8:
        raise ValueError(f"aiter's MLA metadata needs a multiple of 8 heads, got {heads}")

    # Untimed setup: fp8 operands. The harness's fp8 cache is reused when it already is aiter's fp8 dtype.
    q_fp8, q_scale = formats.quantize_fp8(q, fp8)
    kv_fp8, kv_scale = kv_data["fp8"]
    if kv_fp8.dtype != fp8:
        kv_fp8, kv_scale = formats.quantize_fp8(kv_data["bf16"], fp8)
    total_kv = kv_fp8.shape[0]
    kv_4d = kv_fp8.reshape(total_kv, AITER_PAGE_SIZE, num_kv_heads, QK_DIM)  # (pages, page_size, kv heads, 576)
    q_scale = q_scale.to(device=device, dtype=torch.float32).reshape(1)
    kv_scale = kv_scale.to(device=device, dtype=torch.float32).reshape(1)
    qo_indptr = qo_indptr.to(device=device, dtype=torch.int32).contiguous()
    kv_indptr = kv_indptr.to(device=device, dtype=torch.int32).contiguous()
    kv_indices = torch.arange(total_kv, dtype=torch.int32, device=device)  # page i holds token i
    kv_last_page_lens = torch.ones(batch, dtype=torch.int32, device=device)
    max_q_len = int((qo_indptr[1:] - qo_indptr[:-1]).max().item())

    info = aiter.get_mla_metadata_info_v1(
        batch, max_q_len, heads, fp8, fp8,
        is_sparse=False, fast_mode=False, num_kv_splits=AITER_NUM_KV_SPLITS, intra_batch_mode=True,
    )
    info = list(info)
    if len(info) != 6:
        raise RuntimeError(f"aiter.get_mla_metadata_info_v1 returned {len(info)} entries, expected 6")
    (work_meta_data, work_indptr, work_info_set, reduce_indptr, reduce_final_map, reduce_partial_map) = (
        torch.empty(size, dtype=dtype, device=device) for size, dtype in info)
    aiter.get_mla_metadata_v1(
        qo_indptr, kv_indptr, kv_last_page_lens,
        heads // num_kv_heads, num_kv_heads, True,  # num_heads_per_head_k, num_heads_k, is_causal
        work_meta_data, work_info_set, work_indptr, reduce_indptr, reduce_final_map, reduce_partial_map,
        page_size=AITER_PAGE_SIZE, kv_granularity=max(AITER_PAGE_SIZE, 16), max_seqlen_qo=max_q_len,
        uni_seqlen_qo=max_q_len, fast_mode=False, max_split_per_batch=AITER_NUM_KV_SPLITS, intra_batch_mode=True,
        dtype_q=fp8, dtype_kv=fp8,
    )
    out = torch.empty((total_q, heads, KV_LORA_RANK), dtype=torch.bfloat16, device=device)
    work = {"work_meta_data": work_meta_data, "work_indptr": work_indptr, "work_info_set": work_info_set,
            "reduce_indptr": reduce_indptr, "reduce_final_map": reduce_final_map,
            "reduce_partial_map": reduce_partial_map}
    decode = aiter_mla.mla_decode_fwd

    def run():
        decode(q_fp8, kv_4d, out, qo_indptr, kv_indptr, kv_indices, kv_last_page_lens, max_q_len,
               page_size=AITER_PAGE_SIZE, nhead_kv=num_kv_heads, sm_scale=DEFAULT_SM_SCALE, logit_cap=0.0,
               num_kv_splits=AITER_NUM_KV_SPLITS, q_scale=q_scale, kv_scale=kv_scale, intra_batch_mode=True,
               **work)
        return out

    def reference():
        ref, _ = mla_decode_reference(formats.dequantize_fp8(q_fp8, q_scale), formats.dequantize_fp8(kv_fp8, kv_scale),
                                      qo_indptr, kv_indptr, causal=True)
        return ref

    return run, reference


def peer_callable(peer: Peer, data, heads: int, ref_bf16, paging=None):
    """(the call to time, its reference function, the mode whose bytes it moves) for one peer; setup untimed.
    ``paging``: (paged caches, page table) to read the KV through (FlashInfer; aiter always reads page size 1)."""
    if peer.name == AITER:
        fn, ref_fn = aiter_callable(peer, data, heads)
        return fn, ref_fn, "a8w8"
    return flashinfer_callable(peer, data, heads, paging), ref_bf16, "bf16"


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


def bench_peers(bench: Bench, case: Case, data, ref_fn, paging=None) -> list[dict]:
    args, rows = bench.args, []
    for peer in bench.peers:
        if peer.reason is not None:
            continue  # said once in the header
        row = base_row(case, peer.name, "peer", args)
        try:
            fn, peer_ref_fn, bytes_mode = peer_callable(peer, data, args.heads, ref_fn, paging)
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
        if args.plan:
            fn = planned_call(mode, data, args.splits, page_table)
        else:
            fn = lambda mode=mode: run_mode(mode, data, args.splits, page_table)  # noqa: E731
        measure(bench, row, fn, reps=args.reps,
                bytes_read=bytes_moved(case.batch, case.mean_kv_len, args.q_len, args.heads, mode),
                ref_fn=ref_fns[mode] if args.check else None)
        if "time_us" in row:
            row["speedup"] = {c["impl"]: c["time_us"] / row["time_us"] for c in comparisons if "time_us" in c}
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
        rows += bench_peers(bench, case, data, ref_fns["bf16"], paging)
    rows += bench_modes(bench, case, data, ref_fns, comparisons=list(rows), paging=paging)
    del data, ref_fns
    torch.cuda.empty_cache()
    return rows


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
    return [impl for impl in (*MODES, *PEERS, AITER, *BASELINES) if impl in timed]


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


def git_commit() -> str | None:
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
    print_split_table(spec, cases, args)
    configs = list(dict.fromkeys(
        cfg for case in cases for mode in args.modes
        for cfg in selected_kernels(spec, mode, case, args)[:2] if cfg is not None
    ))
    failures = 0
    for i, cfg in enumerate(configs, 1):
        print(f"[{i}/{len(configs)}] compiling {cfg.name} ...", flush=True)
        start = time.perf_counter()
        try:
            jit.get_kernel(cfg, spec)
        except Exception as exc:  # noqa: BLE001 - report every variant, then fail at the end
            failures += 1
            print(f"[{i}/{len(configs)}] {cfg.name}: FAILED: {type(exc).__name__}: {exc}", flush=True)
            continue
        print(f"[{i}/{len(configs)}] {cfg.name}: compiled in {time.perf_counter() - start:.1f} s", flush=True)
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
    for peer in peers:
        if peer.name in PEERS:
            print(f"peer {peer.name}: " + (f"unavailable: {peer.reason}" if peer.reason else
                                           f"flashinfer {getattr(peer.module, '__version__', '?')}"))
    if not args.no_peers:
        print(aiter_status(next((p for p in peers if p.name == AITER), None)))
    print("kernels compile on first use (one 'ready in' line each; TileLang's disk cache makes reruns fast)",
          flush=True)


def run_benchmark(args, cases: list[Case]) -> int:
    device_name = torch.cuda.get_device_name()
    spec = target.spec_for_device(torch.device(DEVICE))
    print_header(args, spec, device_name)
    ceiling = measure_read_ceiling(DEVICE)
    print_ceiling(ceiling)
    flush = torch.empty(FLUSH_BYTES, dtype=torch.uint8, device=DEVICE)
    peers = [] if args.no_peers else setup_peers(DEVICE)
    print_peers(peers, args)
    bench = Bench(args=args, spec=spec, device=DEVICE, flush=flush, ceiling_gbps=ceiling["gbps"], peers=peers)
    rows = []
    for case in cases:
        rows += bench_case(bench, case)
    if args.json:
        write_json(args.json, rows, ceiling, args, device_name)
    if args.plot:
        title = f"MLA decode, {device_name}, q_len {args.q_len}, {args.heads} heads"
        write_plot(args.plot, rows, cases, ceiling["gbps"], title)
    print_summary(rows, cases, ceiling["gbps"], args)
    return 1 if any(r["kind"] == "mode" and "error" in r for r in rows) else 0


def main(argv=None) -> int:
    args = parse_args(argv)
    logging.basicConfig(format="%(message)s")
    log.setLevel(logging.INFO)  # the "mla: <kernel> ready in X s" lines
    try:
        sys.stdout.reconfigure(line_buffering=True)
    except AttributeError:
        pass
    cases = build_cases(args)
    if not cases:
        print("nothing to run: no shapes (add --ragged or --long, or give --shapes)")
        return 2
    if not torch.cuda.is_available():
        return compile_only(args, cases)
    return run_benchmark(args, cases)


if __name__ == "__main__":
    sys.exit(main())
