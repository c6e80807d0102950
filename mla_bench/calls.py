"""The callables the bench times, each set up once (untimed) from the harness tuple ``(q, kv_data, qo_indptr,
kv_indptr, config)``: our op eagerly (``eager_call``), through a plan (``planned_call``) and through the
FlashMLA-shaped interface (``flash_mla_call``); the seeded inputs they read (``make_inputs``); and the fp32
references with the check of an output against them (``reference_fns``, ``check_output``).
"""

from __future__ import annotations

import torch

from mla.constants import KV_LORA_RANK
from mla.decode import harness_cache, mla_decode, page_size_of, plan
from mla.flash_mla import flash_mla_with_kvcache, get_mla_metadata
from mla.inputs import make_harness_inputs, make_ragged_inputs
from mla.reference import harness_reference
from mla_bench.cases import MODES, Case

INPUT_SEED = 0


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


# ------------------------------------------------------------------------------------------------ references


def reference_output(impl: str, data) -> torch.Tensor:
    """fp32 reference on exactly the values ``impl`` reads (dequantized KV; fp8-rounded Q for a8w8)."""
    return harness_reference(data, impl if impl in MODES else "bf16")[0]


def reference_fns(data) -> dict:
    """mode -> a function computing its fp32 reference output (once, then cached)."""
    cache = {}

    def ref_for(mode):
        if mode not in cache:
            cache[mode] = reference_output(mode, data)
        return cache[mode]

    return {mode: (lambda mode=mode: ref_for(mode)) for mode in MODES}


def check_output(out: torch.Tensor, ref: torch.Tensor) -> dict:
    """rel L2 error, and the fraction of elements outside the harness's |out - ref| <= 0.1 + 0.1 |ref|."""
    err = out.float() - ref
    rel_l2 = (err.norm() / ref.norm().clamp_min(1e-30)).item()
    miss_fraction = (err.abs() > 0.1 + 0.1 * ref.abs()).float().mean().item()
    return {"rel_l2": rel_l2, "harness_miss_fraction": miss_fraction}
