"""The harness template's two naive torch versions, re-implemented: a per-sequence bf16 loop ("loop") and fp8 Q/K
through ``torch._scaled_mm`` ("scaled_mm"). They set the scale of the tables only: slow (a Python loop over the
sequences, host reads of the indptrs), so the bench skips them above ``BASELINE_MAX_TOKENS`` cached tokens and times
them with fewer reps. Each takes the harness tuple and returns the bf16 output (total_q, heads, 512).
"""

from __future__ import annotations

import torch

from mla import formats
from mla.constants import DEFAULT_SM_SCALE, KV_LORA_RANK, QK_DIM

BASELINES = ("loop", "scaled_mm")
BASELINE_MAX_TOKENS = 64 * 8192  # cached tokens (batch * kv_len) above which the baselines are skipped
BASELINE_MAX_REPS = 20  # the baselines are slow and only set the scale; fewer reps


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
