"""What the bench times, and the model numbers of each case.

A ``Case`` is one batch: the KV length of every sequence (the 8 harness shapes, ragged batches of a fixed seed, 32k
contexts). The command line's parsers of shapes (``BATCHxKV_LEN``), modes and grid points (``HEADSxQ_LEN``) live
here, as do ``bytes_moved`` / ``flops_of`` (the numerators of achieved GB/s and TFLOP/s) and ``selected_kernels``
(the kernels and split count the op itself picks for a case, through ``mla.schedule.select_kernels``).
"""

from __future__ import annotations

import argparse
import dataclasses
import random

from mla import schedule
from mla.constants import KV_LORA_RANK, QK_DIM
from mla.constants import MODES as MODE_FORMATS
from mla.decode import SUPPORTED_HEADS
from mla.inputs import HARNESS_SHAPES

MODES = tuple(MODE_FORMATS)  # bf16, fp8, a8w8, mxfp4
BF16_BYTES = 2
KV_BYTES_PER_TOKEN = {
    "bf16": QK_DIM * BF16_BYTES,  # 1152
    "fp8": QK_DIM,  # 576 (the one 4-byte per-tensor scale is not counted)
    "a8w8": QK_DIM,
    "mxfp4": QK_DIM // 2 + QK_DIM // 32,  # 288 packed e2m1 + 18 e8m0 scales = 306
}
RAGGED_SEED = 1234
RAGGED_BATCHES = ((64, 8192), (128, 2048))  # (sequences, max kv_len): lengths uniform in 1..max
LONG_SHAPES = ((4, 32768), (16, 32768))


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
    """The cases of a command line: ``--shapes`` (default the 8 harness shapes), then ``--ragged``, ``--long``."""
    cases = [uniform_case(b, kv) for b, kv in (HARNESS_SHAPES if args.shapes is None else args.shapes)]
    if args.ragged:
        cases += [ragged_case(b, kv) for b, kv in RAGGED_BATCHES]
    if args.long:
        cases += [uniform_case(b, kv) for b, kv in LONG_SHAPES]
    return cases


# ----------------------------------------------------------------------------------------------- parsers


def parse_shapes(text: str) -> list[tuple[int, int]]:
    """``BATCHxKV_LEN`` items, comma-separated; ``none`` (or nothing) for no shape."""
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


# ----------------------------------------------------------------------------------------------- grid points


def grid_points(args) -> list[tuple[int, int]]:
    """The (heads, q_len) points of this run: ``--grid``, else the one of ``--heads`` / ``--q-len``."""
    return list(args.grid) if getattr(args, "grid", None) else [(args.heads, args.q_len)]


def at_point(args, heads: int, q_len: int) -> argparse.Namespace:
    """A copy of ``args`` at one grid point."""
    return argparse.Namespace(**dict(vars(args), heads=heads, q_len=q_len))


# ----------------------------------------------------------------------------------------------- bytes and flops


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


# ----------------------------------------------------------------------------------------------- kernels, splits


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
