"""The one reference implementation (float32 or float64 torch), shared by tests and bench.py."""

from __future__ import annotations

import math

import torch

from mla import formats
from mla.constants import DEFAULT_SM_SCALE, KV_LORA_RANK, QK_DIM


def mla_decode_reference(
    q: torch.Tensor,
    kv: torch.Tensor,
    qo_indptr: torch.Tensor,
    kv_indptr: torch.Tensor,
    *,
    sm_scale: float | None = None,
    causal: bool = False,
    dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact MLA decode attention, one sequence at a time.

    q:   (total_q, H, 576), any float dtype (pass the *dequantized* Q for a8w8).
    kv:  (total_kv, 1, 576) or (total_kv, 576), any float dtype (pass the *dequantized* cache).
    qo_indptr, kv_indptr: (batch + 1,) int.
    causal: query i of a sequence with n queries and L KV tokens sees positions [0, L - n + i].
    Returns (out (total_q, H, 512), lse (total_q, H)) in ``dtype``; lse is the natural-log log-sum-exp of the
    scaled scores, -inf (and out 0) where a query sees no token.
    """
    sm_scale = DEFAULT_SM_SCALE if sm_scale is None else sm_scale
    kv2 = kv.reshape(kv.shape[0], QK_DIM).to(dtype)
    total_q, heads, _ = q.shape
    out = torch.zeros(total_q, heads, KV_LORA_RANK, dtype=dtype, device=q.device)
    lse = torch.full((total_q, heads), -math.inf, dtype=dtype, device=q.device)
    qo, kvp = qo_indptr.tolist(), kv_indptr.tolist()
    for b in range(len(qo) - 1):
        q_lo, q_hi, kv_lo, kv_hi = qo[b], qo[b + 1], kvp[b], kvp[b + 1]
        n_q, n_kv = q_hi - q_lo, kv_hi - kv_lo
        if n_q == 0 or n_kv == 0:
            continue
        keys = kv2[kv_lo:kv_hi]  # (L, 576)
        scores = torch.einsum("qhd,kd->qhk", q[q_lo:q_hi].to(dtype), keys) * sm_scale  # (n_q, H, L)
        if causal:
            horizon = torch.arange(n_q, device=q.device) + (n_kv - n_q)  # last visible position per query
            hidden = torch.arange(n_kv, device=q.device)[None, :] > horizon[:, None]
            scores = scores.masked_fill(hidden[:, None, :], -math.inf)
        seq_lse = torch.logsumexp(scores, dim=-1)  # (n_q, H)
        visible = torch.isfinite(seq_lse)
        probs = torch.where(visible[..., None], torch.exp(scores - seq_lse[..., None]), 0.0)
        out[q_lo:q_hi] = torch.einsum("qhk,kd->qhd", probs, keys[:, :KV_LORA_RANK])
        lse[q_lo:q_hi] = seq_lse
    return out, lse


def harness_reference(data, mode: str = "bf16", *, causal: bool = False, sm_scale: float | None = None):
    """The reference on exactly the values ``mla.decode.run_harness(data, mode)`` reads: the dequantized cache of
    the mode's format, and for "a8w8" Q rounded through fp8 as the kernel does (same per-tensor quantizer).
    Returns (out, lse) like ``mla_decode_reference``."""
    q, kv_data, qo_indptr, kv_indptr, _ = data
    fmt = "fp8" if mode == "a8w8" else mode
    kv = formats.dequantize_kv(kv_data[fmt], fmt)
    if mode == "a8w8":
        q = formats.dequantize_fp8(*formats.quantize_fp8(q, kv_data["fp8"][0].dtype))
    return mla_decode_reference(q, kv, qo_indptr, kv_indptr, causal=causal, sm_scale=sm_scale)
