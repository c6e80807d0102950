"""a8w8's amax(|q|) kernel (``tl_kernels.mla_amax``): the same value as torch's amax, bit for bit, on every size
(fewer vectors than CTAs, a share per CTA that is not a multiple of its threads, many steps), wherever the maximum
sits, with a NaN or an inf in Q; and its ticket back at zero after every call (a second call must not see the
first's count). The decode kernels that read it are checked by the a8w8 cases of the other GPU modules."""

import pytest
import torch

from mla import jit, schedule
from mla.target import spec_for_device
from tl_kernels.mla_amax import AMAX_CTAS

from conftest import requires_gpu
from helpers import launches

pytestmark = requires_gpu


def run_amax(q: torch.Tensor):
    """amax(|q|) by the kernel, and the ticket after the call."""
    spec = spec_for_device(q.device)
    launcher = jit.get_launcher(schedule.amax_config(spec, num_heads=q.shape[1]), spec)
    amax = torch.full((1,), float("nan"), dtype=torch.float32, device=q.device)  # poisoned: must be written
    partials = torch.full((AMAX_CTAS,), -1, dtype=torch.int32, device=q.device)  # garbage: written before read
    ticket = torch.zeros(1, dtype=torch.float32, device=q.device)
    launcher(q, amax, partials, ticket)
    return amax, ticket


def torch_amax(q: torch.Tensor) -> torch.Tensor:
    return torch.linalg.vector_norm(q, ord=float("inf"), dtype=torch.float32).reshape(1)


@launches(lambda heads, **_: [("a8w8", heads, 1, False)])
@pytest.mark.parametrize("heads", [16, 128])
@pytest.mark.parametrize("total_q", [1, 3, 37, 1000, 4096])
def test_amax_equals_torch_bit_for_bit(total_q, heads):
    gen = torch.Generator(device="cuda").manual_seed(total_q * 1000 + heads)
    q = torch.randn(total_q, heads, 576, generator=gen, device="cuda").to(torch.bfloat16)
    for where in (0, q.numel() // 2, q.numel() - 1):  # the maximum first, inside, last
        q.view(-1)[where] = -7.5 * (1 + where % 3)  # negative: |x| is what counts
        for rep in range(2):  # twice: the ticket must be back at zero
            amax, ticket = run_amax(q)
            assert torch.equal(amax.view(torch.int32), torch_amax(q).view(torch.int32)), (where, rep, amax, torch_amax(q))
            assert ticket.item() == 0, f"ticket {ticket.item()} after the call: the last CTA must put it back at zero"
        q.view(-1)[where] = 0


@launches(lambda **_: [("a8w8", 16, 1, False)])
@pytest.mark.parametrize("special", ["nan", "inf", "-inf", "zeros"])
def test_amax_special_values(special):
    gen = torch.Generator(device="cuda").manual_seed(7)
    q = torch.randn(64, 16, 576, generator=gen, device="cuda").to(torch.bfloat16)
    if special == "zeros":
        q.zero_()
    else:
        q.view(-1)[12345] = float(special)
    amax, ticket = run_amax(q)
    expected = torch_amax(q)
    if special == "nan":
        assert torch.isnan(amax).all() and torch.isnan(expected).all()
    else:
        assert torch.equal(amax, expected), (amax, expected)
    assert ticket.item() == 0
