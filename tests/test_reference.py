"""The fp32 reference against a float64 textbook loop (one query, one head at a time), on the CPU."""

import math

import pytest
import torch

from mla.reference import mla_decode_reference


def naive_attention(q, kv, qo, kvp, sm_scale, causal):
    """float64, explicit softmax, one (query, head) at a time."""
    kv = kv.reshape(kv.shape[0], 576).double()
    out = torch.zeros(q.shape[0], q.shape[1], 512, dtype=torch.float64)
    lse = torch.full((q.shape[0], q.shape[1]), -math.inf, dtype=torch.float64)
    for b in range(len(qo) - 1):
        n_q, n_kv = qo[b + 1] - qo[b], kvp[b + 1] - kvp[b]
        for i in range(n_q):
            visible = n_kv - n_q + i + 1 if causal else n_kv
            if visible <= 0:
                continue
            keys = kv[kvp[b] : kvp[b] + visible]
            for h in range(q.shape[1]):
                s = keys @ q[qo[b] + i, h].double() * sm_scale
                m = s.max()
                p = torch.exp(s - m)
                out[qo[b] + i, h] = (p / p.sum()) @ keys[:, :512]
                lse[qo[b] + i, h] = m + torch.log(p.sum())
    return out, lse


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize(
    "kv_lens,q_lens",
    [
        ([7], [1]),  # one short sequence
        ([5, 0, 33, 1], [1, 1, 1, 1]),  # ragged, with an empty sequence and a single token
        ([9, 4, 16], [3, 2, 1]),  # MTP: several queries per sequence
        ([2, 6], [4, 2]),  # causal: more queries than tokens leaves early queries blind
    ],
)
def test_reference_matches_float64_loop(kv_lens, q_lens, causal):
    gen = torch.Generator().manual_seed(sum(kv_lens) * 31 + sum(q_lens))
    q = torch.randn(sum(q_lens), 4, 576, generator=gen)
    kv = torch.randn(sum(kv_lens), 1, 576, generator=gen)
    qo = [0, *torch.tensor(q_lens).cumsum(0).tolist()]
    kvp = [0, *torch.tensor(kv_lens).cumsum(0).tolist()]
    sm_scale = 1 / math.sqrt(576)
    out, lse = mla_decode_reference(
        q, kv, torch.tensor(qo, dtype=torch.int32), torch.tensor(kvp, dtype=torch.int32), causal=causal
    )
    want_out, want_lse = naive_attention(q, kv, qo, kvp, sm_scale, causal)
    # fp32 arithmetic over <= 576-term dot products: far below 1e-5 relative.
    torch.testing.assert_close(out.double(), want_out, rtol=1e-5, atol=1e-5)
    assert torch.equal(torch.isinf(lse), torch.isinf(want_lse))
    finite = torch.isfinite(want_lse)
    torch.testing.assert_close(lse.double()[finite], want_lse[finite], rtol=1e-5, atol=1e-5)
    assert (out[~finite] == 0).all(), "a query that sees no token must output zeros"


def test_reference_float64_mode_and_default_scale():
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(2, 16, 576, generator=gen)
    kv = torch.randn(10, 1, 576, generator=gen)
    indptr_q = torch.tensor([0, 1, 2], dtype=torch.int32)
    indptr_kv = torch.tensor([0, 4, 10], dtype=torch.int32)
    out64, _ = mla_decode_reference(q, kv, indptr_q, indptr_kv, dtype=torch.float64)
    out_scaled, _ = mla_decode_reference(q, kv, indptr_q, indptr_kv, sm_scale=1 / 24, dtype=torch.float64)
    assert out64.dtype == torch.float64
    torch.testing.assert_close(out64, out_scaled, rtol=0, atol=0)  # 1/sqrt(576) == 1/24
    other, _ = mla_decode_reference(q, kv, indptr_q, indptr_kv, sm_scale=0.5, dtype=torch.float64)
    assert not torch.allclose(out64, other), "sm_scale must change the result"
