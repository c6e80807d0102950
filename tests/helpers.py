"""Shared helpers of the GPU tests: run a mode, its fp32 reference, poisoned buffers, an informative comparison,
and a parallel pre-build of the kernel variants a test module will launch.

Importing this module needs neither a GPU nor TileLang (the pre-build imports them in worker processes).

Tolerances (as in test_decode_gpu.py): the kernel rounds P to bf16 before P V and rounds the output to bf16;
relative L2 error <= 1e-2 (bf16) / 2e-2 (quantized modes, against the reference on the *dequantized* inputs),
max abs error <= 2% of max |ref|; LSE within 1e-3 (abs + rel) where finite, -inf exactly where the reference is.
"""

from __future__ import annotations

import itertools
import math
import os

import torch

from mla import schedule
from mla.constants import MODES as MODE_FORMATS
from mla.decode import run_harness
from mla.reference import harness_reference

MODES = list(MODE_FORMATS)  # KV format (+ Q precision for a8w8)
REL_L2 = {"bf16": 1e-2, "fp8": 2e-2, "a8w8": 2e-2, "mxfp4": 2e-2}
MAX_ABS_FRACTION = 2e-2  # of max |ref|
LSE_TOL = 1e-3  # abs + rel


def run_mode(decode, mode, data, **kwargs):
    """``decode`` (mla.decode.mla_decode or mla.ops.mla_decode) on the harness-style ``data`` in ``mode``."""
    return run_harness(data, mode, op=decode, **kwargs)


def reference_for(mode, data, *, causal=False, sm_scale=None):
    """fp32 reference on exactly the values the kernel sees (dequantized KV; quantized Q for a8w8)."""
    return harness_reference(data, mode, causal=causal, sm_scale=sm_scale)


def poisoned(shape, dtype, device="cuda"):
    return torch.full(shape, math.nan, dtype=dtype, device=device)


def q_tile_for(q_lens) -> int:
    """Query tokens per CTA the op picks for these query lengths (mirrors mla.decode: from the mean q_len)."""
    return schedule.query_tile(sum(q_lens), len(q_lens))


def lengths(indptr: torch.Tensor) -> list[int]:
    return torch.diff(indptr.cpu()).tolist()


def describe_lengths(values: list[int], limit: int = 12) -> str:
    if len(values) <= limit:
        return str(values)
    return f"[{', '.join(map(str, values[:limit]))}, ...] ({len(values)} seqs, min {min(values)}, max {max(values)}, sum {sum(values)})"


def plan_and_run(q, kv_cache, qo_indptr, kv_indptr, *, kv_format, page_table=None, causal=False, sm_scale=None,
                 num_splits=None, q_format="bf16", kv_scale=None, kv_block_scale=None, out=None, lse=None,
                 return_lse=False, csr_spare_pages=True):
    """``mla_decode``'s signature through ``mla.decode.plan(...).run(...)``: a third entry point for the tests. A
    page table is handed to the plan as FlashInfer-style CSR ``kv_indices`` (the table's rows back to back), with
    one spare page after every other sequence's pages (a page list may be longer than the sequence needs)."""
    from mla.decode import page_size_of, plan

    page_size = 0
    extra = {}
    if page_table is not None:
        page_size = page_size_of(kv_cache)
        needed = [-(-n // page_size) for n in lengths(kv_indptr)]
        counts = [n + (1 if csr_spare_pages and b % 2 and n < page_table.shape[1] else 0) for b, n in enumerate(needed)]
        rows = [page_table[b, :c] for b, c in enumerate(counts)]
        kv_indices = torch.cat(rows) if rows else page_table.new_empty(0)
        extra = dict(kv_indices=kv_indices.contiguous(), kv_page_indptr=[0, *itertools.accumulate(counts)])
    the_plan = plan(qo_indptr, kv_indptr, num_heads=q.shape[1], kv_format=kv_format, q_format=q_format, causal=causal,
                    sm_scale=sm_scale, page_size=page_size, num_splits=num_splits, **extra)
    return the_plan.run(q, kv_cache, kv_scale=kv_scale, kv_block_scale=kv_block_scale, out=out, lse=lse,
                        return_lse=return_lse)


# --- comparison ---------------------------------------------------------------------------------------------


def per_sequence_rel_l2(out, ref, seq_of_row, batch: int) -> torch.Tensor:
    """Relative L2 error of each sequence's rows, (batch,) float64; 0 where a sequence has no rows or a zero
    reference. out, ref: (rows, H, D) float; seq_of_row: (rows,) the sequence of each row."""
    err2 = torch.zeros(batch, device=out.device, dtype=torch.float64).index_add_(
        0, seq_of_row, (out - ref).double().square().sum((1, 2)))
    ref2 = torch.zeros(batch, device=out.device, dtype=torch.float64).index_add_(
        0, seq_of_row, ref.double().square().sum((1, 2)))
    return torch.where(ref2 > 0, (err2 / ref2.clamp_min(1e-300)).sqrt(), torch.zeros_like(ref2))


def check_against_reference(out, ref_out, mode, qo_indptr, kv_indptr, *, lse=None, ref_lse=None, seqs=None,
                            context=""):
    """Compares the kernel's output (and LSE) with the reference; fails with every violated criterion, naming
    the worst sequences with their q_len / kv_len.

    out: (total_q, H, 512) bf16; ref_out: fp32. lse / ref_lse: (total_q, H) or None. seqs: the sequences to
    check (default: all); rows of other sequences are ignored (e.g. deliberately poisoned ones).
    """
    problems = []
    if out.dtype != torch.bfloat16 or out.shape != ref_out.shape:
        raise AssertionError(f"{context}: out is {out.dtype} {tuple(out.shape)}, expected bf16 {tuple(ref_out.shape)}")
    q_lens, kv_lens = lengths(qo_indptr), lengths(kv_indptr)
    batch, heads = len(q_lens), out.shape[1]
    device = out.device
    seq_of_row = torch.repeat_interleave(torch.arange(batch, device=device), torch.tensor(q_lens, device=device))
    keep = torch.ones(batch, dtype=torch.bool, device=device)
    if seqs is not None:
        keep[:] = False
        keep[torch.tensor(list(seqs), dtype=torch.long, device=device)] = True
    rows = keep[seq_of_row]
    if not bool(rows.any()):
        return
    o, r, sid = out[rows].float(), ref_out[rows].float(), seq_of_row[rows]
    row_ids = rows.nonzero().flatten().tolist()  # kept row -> row of out
    q_starts = [0, *itertools.accumulate(q_lens)]

    def where(row_head):  # (row, head) index within the kept rows -> readable location
        row, head = (int(x) for x in row_head)
        b = int(sid[row])
        query = row_ids[row] - q_starts[b]
        return f"seq {b} (q_len {q_lens[b]}, kv_len {kv_lens[b]}) query {query} head {head} (out row {row_ids[row]})"

    nonfinite = ~torch.isfinite(o).all(dim=-1)  # (rows, H)
    if nonfinite.any():
        bad = nonfinite.nonzero().tolist()
        problems.append(
            f"NaN/inf in {len(bad)} (query, head) output rows (unwritten or poisoned data read), first at {where(bad[0])}"
        )
        o = torch.nan_to_num(o, nan=0.0, posinf=0.0, neginf=0.0)

    err = o - r
    ref_norm = r.norm().item()
    rel_l2 = err.norm().item() / max(ref_norm, 1e-30)
    if rel_l2 > REL_L2[mode]:
        problems.append(f"relative L2 error {rel_l2:.2e} > {REL_L2[mode]:.0e}")
    abs_err = err.abs().amax(dim=-1)  # (rows, H)
    bound = MAX_ABS_FRACTION * r.abs().max().item() + 1e-6
    if abs_err.numel() and abs_err.max().item() > bound:
        worst = divmod(int(abs_err.argmax()), heads)
        problems.append(f"max abs error {abs_err.max().item():.3e} > {bound:.3e} at {where(worst)}")

    # Per sequence: relative L2 over its rows (a wrong small sequence must not hide in a large batch).
    seq_rel = per_sequence_rel_l2(o, r, sid, batch)
    bad_seqs = (seq_rel > REL_L2[mode]).nonzero().flatten().tolist()
    if bad_seqs:
        worst = sorted(bad_seqs, key=lambda b: -seq_rel[b].item())[:5]
        detail = ", ".join(f"seq {b} (q_len {q_lens[b]}, kv_len {kv_lens[b]}): {seq_rel[b].item():.2e}" for b in worst)
        problems.append(f"{len(bad_seqs)} sequences over relative L2 {REL_L2[mode]:.0e}; worst: {detail}")

    if ref_lse is not None:
        rl = ref_lse[rows].float()
        hidden = torch.isneginf(rl)  # (rows, H): the query sees no KV token
        if hidden.any():
            nonzero = hidden & (out[rows].float() != 0).any(dim=-1)
            if nonzero.any():
                problems.append(
                    f"{int(nonzero.sum())} (query, head) rows that see no KV token are not exactly 0, first at "
                    f"{where(nonzero.nonzero()[0].tolist())}"
                )
        if lse is not None:
            lv = lse[rows].float()
            if torch.isnan(lv).any():
                problems.append(f"LSE has {int(torch.isnan(lv).sum())} NaNs, first at {where(torch.isnan(lv).nonzero()[0].tolist())}")
            mismatch = hidden != torch.isneginf(lv)
            if mismatch.any():
                first = mismatch.nonzero()[0].tolist()
                problems.append(
                    f"LSE -inf pattern differs from the reference at {int(mismatch.sum())} (query, head), first at "
                    f"{where(first)}: got {lv[tuple(first)].item()}, reference {rl[tuple(first)].item()}"
                )
            visible = ~hidden  # the reference is finite there: so must the kernel's LSE be, within tolerance
            lse_err = torch.where(visible, (lv - rl).abs() - LSE_TOL * rl.abs(), torch.zeros_like(lv))
            if (lse_err > LSE_TOL).any():
                first = divmod(int(lse_err.argmax()), heads)
                problems.append(
                    f"LSE off by more than {LSE_TOL:.0e} abs + rel at {int((lse_err > LSE_TOL).sum())} (query, head); "
                    f"worst at {where(first)}: got {lv[first].item():.6f}, reference {rl[first].item():.6f}"
                )
    if problems:
        raise AssertionError(f"{mode}: {context}\n  " + "\n  ".join(problems))


# --- pre-building the kernel variants in parallel --------------------------------------------------------------


KERNEL_CLASSES = {}  # (test module, test name) -> function(**params) -> [kernel class]


def launches(classes_of):
    """Declares which kernel classes ``(mode, num_heads, q_tile, causal[, page_size[, flash]])`` a GPU test launches
    (``flash``: also through ``mla.flash_mla``, whose one-launch kernels take FlashMLA's shapes), as a
    function of its parameters; conftest builds them all in parallel before the module's first test (and
    ``pytest --prebuild-only`` builds them into TILELANG_CACHE_DIR on a CPU box)."""

    def register(test):
        KERNEL_CLASSES[(test.__module__, test.__name__)] = classes_of
        return test

    return register


def classes_of_items(items):
    """The kernel classes the given collected test items launch (those declared with ``launches``)."""
    classes = set()
    for item in items:
        fn = getattr(item, "function", None)
        classes_of = KERNEL_CLASSES.get((getattr(fn, "__module__", None), getattr(item, "originalname", None)))
        if classes_of is not None:
            params = item.callspec.params if hasattr(item, "callspec") else {}
            classes.update(tuple(c) + (0,) * (6 - len(c)) for c in classes_of(**params))
    return classes


def kernel_configs(spec, classes):
    """The kernels the op may launch for problem classes ``(mode, num_heads, q_tile, causal, page_size, flash)``
    (``mla.prebuild.class_variants``: ``schedule.decode_variants``; on Hopper's 16-row class also the
    warp-specialised kernel, for every format, since tests force it; with ``flash`` also the FlashMLA-shaped form of
    each, ``schedule.flash_io_variant``)."""
    from mla import prebuild as mla_prebuild

    configs = []
    for mode, heads, q_tile, causal, page_size, flash in sorted(set(classes)):
        configs += mla_prebuild.class_variants(spec, mode=mode, num_heads=heads, q_tile=q_tile, causal=causal,
                                               page_size=page_size, flash_mla=bool(flash), force_ws=True)
    return mla_prebuild.unique(configs)


def prebuild(classes, spec=None, workers=None, log=print):
    """Compile every kernel variant of ``classes`` in parallel worker processes (``mla.prebuild.build``; the tests'
    own processes then load them from TileLang's disk cache in ~0.1 s each). Best effort: a variant that fails to
    build is reported here and fails again, with its full error, in the test that launches it. Set
    MLA_TEST_PREBUILD=0 to skip (variants then build on first use, one at a time)."""
    if os.environ.get("MLA_TEST_PREBUILD", "1") == "0" or not classes:
        return
    from mla import prebuild as mla_prebuild
    from mla.target import spec_for_device

    spec = spec or spec_for_device(torch.device("cuda"))
    mla_prebuild.build(kernel_configs(spec, classes), spec, jobs=workers, log=log, label="mla tests")
