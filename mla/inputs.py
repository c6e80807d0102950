"""Input generators: the competition harness's inputs, and ragged batches. Shared by tests and bench.py."""

from __future__ import annotations

import math

import torch

from mla import formats

from mla.constants import DEFAULT_SM_SCALE, QK_DIM

NUM_HEADS = 16
HARNESS_SHAPES = [(b, kv) for b in (4, 32, 64, 256) for kv in (1024, 8192)]  # (batch, kv_len), q_len 1


def harness_config(batch: int, kv_len: int, q_len: int = 1, num_heads: int = NUM_HEADS) -> dict:
    return {
        "batch_size": batch,
        "num_heads": num_heads,
        "num_kv_heads": 1,
        "kv_lora_rank": 512,
        "qk_rope_head_dim": 64,
        "qk_head_dim": QK_DIM,
        "v_head_dim": 512,
        "q_seq_len": q_len,
        "kv_seq_len": kv_len,
        "sm_scale": DEFAULT_SM_SCALE,
    }


def _kv_data(kv: torch.Tensor, fp8_dtype: torch.dtype) -> dict:
    return {
        "bf16": kv,
        "fp8": formats.quantize_kv(kv, "fp8", fp8_dtype=fp8_dtype),
        "mxfp4": formats.quantize_kv(kv, "mxfp4"),
    }


def make_harness_inputs(
    batch: int,
    kv_len: int,
    *,
    q_len: int = 1,
    num_heads: int = NUM_HEADS,
    seed: int = 0,
    device: str | torch.device = "cuda",
    fp8_dtype: torch.dtype = torch.float8_e4m3fn,
):
    """The harness tuple ``(q, kv_data, qo_indptr, kv_indptr, config)``: q and kv are randn bf16 (std 1) drawn on
    the device from a seeded generator; every sequence has q_len queries and kv_len cached tokens."""
    gen = torch.Generator(device=device).manual_seed(seed)
    q = torch.randn((batch * q_len, num_heads, QK_DIM), dtype=torch.bfloat16, device=device, generator=gen)
    kv = torch.randn((batch * kv_len, 1, QK_DIM), dtype=torch.bfloat16, device=device, generator=gen)
    qo_indptr = torch.arange(batch + 1, dtype=torch.int32, device=device) * q_len
    kv_indptr = torch.arange(batch + 1, dtype=torch.int32, device=device) * kv_len
    return q, _kv_data(kv, fp8_dtype), qo_indptr, kv_indptr, harness_config(batch, kv_len, q_len, num_heads)


def make_ragged_inputs(
    kv_lens: list[int],
    q_lens: list[int] | int = 1,
    *,
    num_heads: int = NUM_HEADS,
    seed: int = 0,
    device: str | torch.device = "cuda",
    fp8_dtype: torch.dtype = torch.float8_e4m3fn,
    tail_rows: int = 0,
):
    """Like ``make_harness_inputs`` with per-sequence lengths. ``tail_rows`` extra cache rows past the last
    sequence (never to be read) let tests poison memory the kernel must not touch."""
    q_lens = [q_lens] * len(kv_lens) if isinstance(q_lens, int) else list(q_lens)
    if len(q_lens) != len(kv_lens):
        raise ValueError("q_lens and kv_lens must have the same length")
    gen = torch.Generator(device=device).manual_seed(seed)
    total_q, total_kv = sum(q_lens), sum(kv_lens) + tail_rows
    q = torch.randn((total_q, num_heads, QK_DIM), dtype=torch.bfloat16, device=device, generator=gen)
    kv = torch.randn((total_kv, 1, QK_DIM), dtype=torch.bfloat16, device=device, generator=gen)
    qo_indptr = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32, device=device)
    kv_indptr = torch.tensor([0, *torch.tensor(kv_lens).cumsum(0).tolist()], dtype=torch.int32, device=device)
    config = harness_config(len(kv_lens), max(kv_lens, default=0), max(q_lens, default=0), num_heads)
    return q, _kv_data(kv, fp8_dtype), qo_indptr, kv_indptr, config


def to_paged(data, page_size: int, *, seed: int = 0):
    """The flat cache of a harness tuple laid out in shuffled pages of ``page_size`` tokens, every slot the kernel
    must not read (tails past a sequence's end, spare pages, unused page-table entries) holding NaN (fp8: the NaN
    code 0x7F; mxfp4: the NaN scale 0xFF). Returns ({"bf16": ..., "fp8": ..., "mxfp4": ...} with caches shaped
    (num_pages, page_size, 1, row), page_table (batch, max_pages) int32); kv_indptr keeps giving the lengths."""
    _, kv_data, _, kv_indptr, _ = data
    device = kv_indptr.device
    kv_lens = kv_indptr.diff().tolist()
    gen = torch.Generator().manual_seed(seed)
    pages_per_seq = [-(-n // page_size) for n in kv_lens]
    num_pages = sum(pages_per_seq) + 3  # spare pages, left NaN
    order = torch.randperm(num_pages, generator=gen).tolist()
    nan_page = order[-1]  # unused table entries point at a NaN page
    table = torch.full((len(kv_lens), max(pages_per_seq + [1]) + 1), nan_page, dtype=torch.int32)
    src_rows, dst_rows, next_page, start = [], [], 0, 0
    for b, n in enumerate(kv_lens):
        for p in range(pages_per_seq[b]):
            page = order[next_page]
            next_page += 1
            table[b, p] = page
            for slot in range(min(page_size, n - p * page_size)):
                src_rows.append(start + p * page_size + slot)
                dst_rows.append(page * page_size + slot)
        start += n
    src, dst = torch.tensor(src_rows, device=device), torch.tensor(dst_rows, device=device)
    rows = num_pages * page_size

    def scatter(values, fill, fill_dtype):
        """Rows of ``values`` moved to their paged places; every other row filled with ``fill`` (in fill_dtype)."""
        paged = torch.full((rows, *values.shape[1:]), fill, dtype=fill_dtype, device=device).view(values.dtype)
        paged[dst] = values[src]
        return paged

    fp8_codes, fp8_scale = kv_data["fp8"]
    packed, block_scale = kv_data["mxfp4"]
    paged = {
        "bf16": scatter(kv_data["bf16"], math.nan, torch.bfloat16).view(num_pages, page_size, 1, QK_DIM),
        "fp8": (scatter(fp8_codes, 0x7F, torch.uint8).view(num_pages, page_size, 1, QK_DIM), fp8_scale),
        "mxfp4": (
            scatter(packed, 0, torch.uint8).view(num_pages, page_size, 1, QK_DIM // 2),
            scatter(block_scale, 0xFF, torch.uint8),
        ),
    }
    return paged, table.to(device)
