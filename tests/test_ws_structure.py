"""The warp-specialised Hopper kernel's structure, read from its generated CUDA (CPU only: lowering needs no GPU).

What the design promises and a silent TileLang change could take away: the producer's copies are cp.async that
complete on an mbarrier (no cp.async wait anywhere: a wait would serialise the ring again), the roles get their
own register budgets (setmaxnreg), the GEMMs are wgmma, the cache is read in its compressed type, and the split
merge is fused (an atomic counter, no second kernel). Also the schedule's choices for the family.
"""

import pytest

from mla import jit, schedule
from mla.constants import MODES
from mla.target import spec_for_name
from tl_kernels.mla_decode_ws import WSDecodeKernelConfig

H200 = spec_for_name("sm_90a")
CASES = [(mode, False, 0) for mode in MODES] + [("fp8", True, 0), ("mxfp4", False, 16), ("bf16", False, 64)]


@pytest.fixture(scope="module", params=CASES, ids=[f"{m}{'-causal' if c else ''}{f'-page{p}' if p else ''}" for m, c, p in CASES])
def source(request):
    mode, causal, page_size = request.param
    kv_format, q_format = MODES[mode]
    cfg = schedule.ws_config(H200, kv_format=kv_format, q_format=q_format, causal=causal, page_size=page_size)
    return cfg, jit.lower(cfg, H200).kernel_source


def test_producer_copies_are_async_and_never_waited_on(source):
    cfg, src = source
    assert "cp_async_gs" in src, f"{cfg.name}: the producer's copies are not cp.async"
    assert "mbarrier_cp_async_arrive_noinc" in src, f"{cfg.name}: cp.async does not complete on the ring's mbarrier"
    assert "cp_async_wait" not in src, f"{cfg.name}: a cp.async wait serialises the ring"


def test_roles_have_their_own_register_budgets(source):
    cfg, src = source
    assert f"warpgroup_reg_alloc<{cfg.consumer_regs}>" in src and f"warpgroup_reg_dealloc<{cfg.producer_regs}>" in src
    assert "__launch_bounds__(256, 1)" in src, "setmaxnreg needs a register cap at entry"


def test_gemms_are_wgmma_with_the_kv_tile_as_m(source):
    cfg, src = source
    assert "wgmma_ss" in src and ", 64, 16, 16," in src, f"{cfg.name}: expected 64x16x16 wgmma (KV rows as M)"


def test_cache_is_read_in_its_own_type(source):
    cfg, src = source
    kv_type = {"bf16": "bfloat16_t", "fp8": "fp8_e4_t", "mxfp4": "uchar"}[cfg.kv_format]
    assert f"const {kv_type}* __restrict__ KV" in src


def test_split_merge_is_fused(source):
    cfg, src = source
    assert "AtomicAddRet" in src and "__threadfence" in src, f"{cfg.name}: no fused merge of the splits"


def test_schedule_picks_the_family_for_the_16_row_class_on_hopper_only():
    """Opt-in (``ws=True``) while it is slower than the 16-row kernel; then only where it can run."""
    common = dict(q_format="bf16", causal=False, page_size=0, total_kv=1 << 16, ws=True)
    cfg, combine, _ = schedule.select_kernels(H200, kv_format="fp8", num_heads=16, batch=8, total_q=8, **common)
    assert isinstance(cfg, WSDecodeKernelConfig) and combine is None
    for heads, total_q in ((32, 8), (16, 16)):  # more heads, or two queries per sequence: the 32/64-row kernel
        cfg, _, _ = schedule.select_kernels(H200, kv_format="fp8", num_heads=heads, batch=8, total_q=total_q, **common)
        assert not isinstance(cfg, WSDecodeKernelConfig)
    cfg, _, _ = schedule.select_kernels(spec_for_name("gfx942"), kv_format="fp8", num_heads=16, batch=8, total_q=8,
                                        **common)
    assert not isinstance(cfg, WSDecodeKernelConfig), "gfx942 has no wgmma / setmaxnreg"


@pytest.mark.parametrize("kv_format", ["bf16", "fp8", "mxfp4"])
def test_ring_fits_one_cta_per_sm(kv_format):
    cfg = schedule.ws_config(H200, kv_format=kv_format)
    assert cfg.shared_bytes <= H200.smem_bytes and schedule.ctas_per_sm(H200, cfg) == 1
    assert cfg.num_stages >= 2


@pytest.mark.parametrize("batch,kv_len", [(4, 1024), (4, 8192), (64, 8192), (256, 8192), (1, 100), (300, 64)])
def test_split_count_fills_the_machine_without_empty_tiles(batch, kv_len):
    cfg = schedule.ws_config(H200, kv_format="fp8")
    splits = schedule.ws_num_splits(H200, cfg, batch=batch, total_kv=batch * kv_len)
    tiles = -(-kv_len // cfg.block_n)
    assert 1 <= splits <= min(tiles, schedule.MAX_SPLITS)
    if batch * tiles >= 4 * H200.num_sms:  # plenty of tiles: at least 90% of the SMs get a CTA
        assert batch * splits >= 0.9 * H200.num_sms or splits == tiles
