"""The competition harness's entry point and the mapping from a harness tuple ``(q, kv_data, qo_indptr, kv_indptr,
config)`` to the op's arguments, shared by tests, tools and bench.py."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from mla.constants import DEFAULT_SM_SCALE, MODES
from mla.launch import mla_decode

CUSTOM_KERNEL_FORMAT = "bf16"  # fastest format that passes the competition check (docs/perf.md, run 10): every
# format passes it with no miss, and today bf16 KV is the fastest (geomean 69.2 us vs fp8 93.2, mxfp4 147.4).


def run_harness(data, mode: str = "bf16", *, op=None, **kwargs):
    """``op`` (default ``mla.decode.mla_decode``; ``mla.ops.mla_decode`` works too) on a harness tuple
    ``(q, kv_data, qo_indptr, kv_indptr, config)`` in ``mode``: "bf16" (bf16 KV), "fp8" (bf16 Q, fp8 KV),
    "a8w8" (fp8 Q, fp8 KV) or "mxfp4" (bf16 Q, mxfp4 KV). ``kwargs`` go to the op."""
    q, kv_data, qo_indptr, kv_indptr, _ = _unpack(data)
    op = mla_decode if op is None else op
    kv, cache_kwargs = harness_cache(kv_data, mode)
    return op(q, kv, qo_indptr, kv_indptr, **cache_kwargs, **kwargs)


def harness_cache(kv_data, mode: str) -> tuple[torch.Tensor, dict]:
    """(the cache tensor, the op's keywords for it: kv_format, q_format and the cache's scales) of a harness
    ``kv_data`` dict in ``mode``."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {tuple(MODES)}, got {mode!r}")
    kv_format, q_format = MODES[mode]
    if type(kv_data) is not dict and not isinstance(kv_data, Mapping):  # exact type first: an ABC check costs more
        raise TypeError(f"kv_data: expected a dict {{'bf16': cache, 'fp8': (cache, scale), 'mxfp4': (cache, scale)}}, "
                        f"got {type(kv_data).__name__}")
    if kv_format not in kv_data:
        raise ValueError(f"kv_data: no {kv_format!r} entry (mode {mode!r} reads it); keys: {sorted(kv_data)}")
    kwargs = dict(kv_format=kv_format, q_format=q_format)
    if kv_format == "bf16":
        return kv_data["bf16"], kwargs
    entry = kv_data[kv_format]
    if type(entry) is not tuple and not isinstance(entry, Sequence) or len(entry) != 2:
        raise TypeError(f"kv_data[{kv_format!r}]: expected a (cache, scale) pair, got {type(entry).__name__}")
    kv, scale = entry
    return kv, dict(kwargs, **{"kv_scale" if kv_format == "fp8" else "kv_block_scale": scale})


def page_size_of(kv_cache: torch.Tensor) -> int:
    """Tokens per page of a cache read through a page table: dim 1 of a (num_pages, page_size, 1, row) cache, 1 for
    a flat (total_kv, 1, row) one."""
    return kv_cache.shape[1] if kv_cache.dim() == 4 else 1


def custom_kernel(data):
    """Entry point of the competition harness: ``data = (q, kv_data, qo_indptr, kv_indptr, config)`` with
    ``kv_data = {"bf16": T, "fp8": (T, scale), "mxfp4": (T, scale)}``; returns (total_q, 16, 512) bf16.
    Reads ``kv_data[CUSTOM_KERNEL_FORMAT]``."""
    config = _unpack(data)[4]
    sm_scale = config.get("sm_scale", DEFAULT_SM_SCALE) if isinstance(config, dict) else DEFAULT_SM_SCALE
    return run_harness(data, CUSTOM_KERNEL_FORMAT, sm_scale=sm_scale)


def _unpack(data) -> tuple:
    """``data`` checked as the harness's 5-tuple ``(q, kv_data, qo_indptr, kv_indptr, config)``."""
    if type(data) is tuple and len(data) == 5 and type(data[1]) is dict:  # the harness's own types: nothing to check
        return data
    if not isinstance(data, Sequence) or isinstance(data, (str, bytes)) or len(data) != 5:
        got = f"{type(data).__name__} of length {len(data)}" if isinstance(data, Sequence) else type(data).__name__
        raise TypeError(f"data: expected the harness tuple (q, kv_data, qo_indptr, kv_indptr, config), got {got}")
    if not isinstance(data[1], Mapping):
        raise TypeError(f"data[1] (kv_data): expected a dict {{'bf16': cache, 'fp8': (cache, scale), 'mxfp4': "
                        f"(cache, scale)}}, got {type(data[1]).__name__}")
    return tuple(data)
