"""The 64-row warp-specialised Hopper kernel (tl_kernels/mla_decode_rows.py, issue 17) on the CPU: its config, the
schedule's choice of it, and its structure read from the generated CUDA (lowering needs no GPU).

What the design promises and a silent TileLang change could take away: three warp-group roles with their own
register budgets, the producer's copies are cp.async completing on mbarriers (never waited on), both GEMMs are
wgmma with the 64 query rows as M (S: 64 x 64 tiles; O: 64 x 256 per consumer), and the split merge is fused.
"""

import pytest

from mla import jit, schedule
from mla.target import spec_for_name
from tl_kernels.mla_decode_rows import RowsDecodeKernelConfig

H200 = spec_for_name("sm_90a")
COMMON = dict(kv_format="bf16", q_format="bf16", causal=False, page_size=0, total_kv=1 << 20)


def select(num_heads, batch, total_q, spec=H200, **overrides):
    return schedule.select_kernels(spec, num_heads=num_heads, batch=batch, total_q=total_q, **{**COMMON, **overrides})


# ------------------------------------------------------------------------------------------------ config


def test_config_shapes():
    cfg = RowsDecodeKernelConfig(num_heads=128, block_h=64, q_slots=4)
    assert (cfg.q_group, cfg.q_tile, cfg.head_groups, cfg.row_tiles, cfg.threads) == (1, 4, 2, 8, 384)
    assert cfg.semaphores_per_seq == 8 and cfg.fused_combine
    cfg = RowsDecodeKernelConfig(num_heads=16, block_h=16)
    assert (cfg.q_group, cfg.row_tiles, cfg.block_m) == (4, 1, 64)
    assert cfg.shared_bytes <= H200.smem_bytes


@pytest.mark.parametrize("bad", [dict(kv_format="fp8"), dict(q_format="fp8"), dict(block_h=48), dict(num_heads=16),
                                 dict(block_n=32), dict(q_slots=0), dict(softmax_regs=256, pv_regs=240)])
def test_config_rejects(bad):
    with pytest.raises(ValueError):
        RowsDecodeKernelConfig(**bad)


def test_names_differ_by_what_changes_the_code():
    base = RowsDecodeKernelConfig()
    names = {base.name, RowsDecodeKernelConfig(q_slots=2).name, RowsDecodeKernelConfig(causal=True).name,
             RowsDecodeKernelConfig(page_size=16).name, RowsDecodeKernelConfig(num_heads=64).name}
    assert len(names) == 5


# ---------------------------------------------------------------------------------------------- schedule


def test_opt_in_only():
    """ROWS_BY_DEFAULT is False until an H200 run validates the kernel: without the override, the old families."""
    assert schedule.ROWS_BY_DEFAULT is False
    cfg, _, _ = select(128, 8, 32)
    assert not isinstance(cfg, RowsDecodeKernelConfig)


@pytest.mark.parametrize("heads,q_len,block_h,q_slots", [
    (128, 4, 64, 4), (128, 1, 64, 1), (64, 1, 64, 1), (16, 4, 16, 1), (16, 8, 16, 2), (32, 2, 32, 1),
    (128, 8, 64, 8), (128, 16, 64, 8),  # q_slots stops at ROWS_MAX_Q_SLOTS: longer query runs take passes
])
def test_picked_by_row_count(heads, q_len, block_h, q_slots):
    cfg, combine, splits = select(heads, 8, 8 * q_len, rows=True)
    assert isinstance(cfg, RowsDecodeKernelConfig) and combine is None and splits >= 1
    assert (cfg.block_h, cfg.q_slots) == (block_h, q_slots)
    assert cfg.semaphores_per_seq <= heads, "mla.plan allocates batch x num_heads semaphores"


@pytest.mark.parametrize("heads,q_len,extra", [
    (16, 1, {}), (32, 1, {}),  # fewer than 64 rows per sequence: the 16/32-row kernels
    (128, 4, dict(kv_format="fp8")), (128, 4, dict(kv_format="mxfp4")),  # formats not served yet
    (128, 4, dict(q_format="fp8")),  # a8w8: not yet
])
def test_not_picked(heads, q_len, extra):
    cfg, _, _ = select(heads, 8, 8 * q_len, rows=True, **extra)
    assert not isinstance(cfg, RowsDecodeKernelConfig)


def test_not_picked_off_hopper():
    cfg, _, _ = select(128, 8, 32, spec=spec_for_name("gfx942"), rows=True)
    assert not isinstance(cfg, RowsDecodeKernelConfig), "gfx942 has no wgmma / setmaxnreg"
    assert not schedule.uses_rows(spec_for_name("sm_80"), kv_format="bf16", q_format="bf16", num_heads=128, batch=8,
                                  total_q=32)


def test_overrides_reach_the_config_and_forced_splits_are_kept():
    cfg, _, splits = select(128, 8, 32, rows=True, q_slots=2, num_splits=5)
    assert cfg.q_slots == 2 and splits == 5


@pytest.mark.parametrize("batch,kv_len", [(32, 8192), (256, 8192), (4, 1024), (1, 100)])
def test_split_count(batch, kv_len):
    cfg = schedule.rows_config(H200, kv_format="bf16", num_heads=128, batch=batch, total_q=4 * batch)
    splits = schedule.rows_num_splits(H200, cfg, batch=batch, total_kv=batch * kv_len)
    assert 1 <= splits <= min(-(-kv_len // 64), schedule.MAX_SPLITS)
    if batch * cfg.row_tiles >= H200.num_sms:  # 128 heads x 4 queries: 8 CTAs per sequence fill the machine
        assert splits == 1


def test_launch_counts_one_semaphore_per_row_tile(monkeypatch):
    """mla.launch allocates batch x semaphores_per_seq counters for the 64-row family (not batch x head groups)."""
    import torch

    from mla import launch

    cfg = RowsDecodeKernelConfig(num_heads=128, q_slots=4)
    monkeypatch.setattr(launch, "kernels", lambda *a, **k: launch.Kernels(cfg, object(), None, 3, True))
    call = type("Call", (), dict(device=torch.device("cpu"), cache_rows=10, total_q=12, page_size=0, num_heads=128,
                                 batch=3, spec=H200, kv_format="bf16", kernel_q_format="bf16", row=576,
                                 kv_as_uint8=False, block_scale_len=0, block_scale_as_uint8=False, scale_stride=0,
                                 reshape_q_scale=False, reshape_kv_scale=False))()
    monkeypatch.setattr(launch.workspace, "dummy_fp32", lambda device: None)
    monkeypatch.setattr(launch.workspace, "no_block_scales", lambda device: None)
    monkeypatch.setattr(launch.workspace, "unit_scale", lambda device: None)
    prepared = launch.Launch(call, causal=False, num_splits=3, total_kv=10, overrides=(("rows", True),))
    assert prepared.fused and prepared.semaphore_count == 3 * 8


# ------------------------------------------------------------------------------------- generated CUDA


LDS = {}  # config -> dynamic shared memory TileLang allocates
CASES = [dict(num_heads=128, q_slots=4), dict(num_heads=16, block_h=16, causal=True, page_size=16)]


@pytest.fixture(scope="module", params=CASES, ids=["h128-qs4", "h16-causal-page16"])
def source(request):
    cfg = RowsDecodeKernelConfig(**request.param)
    artifact = jit.lower(cfg, H200)
    LDS[cfg] = jit.lowered_lds_bytes(artifact)
    return cfg, artifact.kernel_source


def test_fits_shared_memory(source):
    """What TileLang allocates (not the config's estimate: run 14's WS kernel failed to launch on an undercount),
    plus 1 KiB for the static barriers before the 1024-aligned dynamic buffer, fits one CTA per SM."""
    cfg, _ = source
    assert LDS[cfg] + 1024 <= H200.smem_bytes
    assert abs(LDS[cfg] - cfg.shared_bytes) < 4096, "the estimate drives the scheduler's occupancy"


def test_three_roles_with_their_own_register_budgets(source):
    cfg, src = source
    assert "__launch_bounds__(384, 1)" in src, "setmaxnreg needs a register cap at entry"
    # Each role moves from the launch count (65536 / 384 threads, rounded down to 8: 168) to its budget: up with
    # .inc, down with .dec. An .inc to a lower count is an illegal instruction on the H200 (seen with pv_regs 160).
    launch_regs = 65536 // 384 // 8 * 8
    for regs in (cfg.softmax_regs, cfg.pv_regs, cfg.producer_regs):
        wanted, wrong = ("alloc", "dealloc") if regs >= launch_regs else ("dealloc", "alloc")
        assert f"warpgroup_reg_{wanted}<{regs}>" in src, f"{cfg.name}: budget {regs} needs setmaxnreg.{wanted}"
        assert f"warpgroup_reg_{wrong}<{regs}>" not in src, f"{cfg.name}: budget {regs} must not be a {wrong}"


def test_producer_copies_are_async_and_never_waited_on(source):
    cfg, src = source
    assert "cp_async_gs" in src and "mbarrier_cp_async_arrive_noinc" in src
    assert "cp_async_wait" not in src, f"{cfg.name}: a cp.async wait serialises the ring"


def test_gemms_are_wgmma_with_64_query_rows_as_m(source):
    cfg, src = source
    assert ", 64, 64, 16," in src, "S = Q K^T: 64 rows x 64 tokens"
    assert ", 64, 256, 16," in src, "O += P V: 64 rows x 256 columns per consumer warp group"
    assert "mma_sync" not in src and "mma.sync" not in src


def test_no_block_wide_barrier_inside_the_roles(source):
    """A __syncthreads() after the role split would deadlock (the roles never meet): only the one after barrier
    init may exist; TileLang's own syncs inside a role are partial (named barriers over 128 threads)."""
    cfg, src = source
    assert src.count("__syncthreads()") <= 1
    assert "__sync_thread_partial(" in src


def test_split_merge_is_fused(source):
    cfg, src = source
    assert "AtomicAddRet" in src and "__threadfence" in src


def test_rows_check_reports_a_hung_item_and_goes_on():
    """tools/rows_check.py must never hang the lead's GPU call: an item past its time is killed and reported, and
    the remaining items run in a fresh child process."""
    import time

    from tools import rows_check

    start = time.time()
    results = rows_check.run_watched(["sleep:0.1", "sleep:60", "sleep:0.1"], reps=1, item_timeout=3.0,
                                     deadline=time.time() + 120)
    assert [r["status"] for r in results] == ["ok", "HUNG", "ok"]
    assert [r["item"] for r in results] == ["sleep:0.1", "sleep:60", "sleep:0.1"]
    assert time.time() - start < 90


# setmaxnreg budgets (issue 30): the roles' budgets must fit the registers the warp groups are launched with, or the
# .inc waits forever. (family, config fields, accepted?)
BUDGETS = [
    ("rows", dict(), True),  # 240 + 160 + 96 = 496 <= 504
    ("rows", dict(softmax_regs=248), True),  # 504: the most a 384-thread launch (168 per thread) allows
    ("rows", dict(softmax_regs=256), False),  # 512: the r256 variant that hung every timed item
    ("rows", dict(pv_regs=172), False),  # not a multiple of 8
    ("ws", dict(kv_format="fp8"), True),  # 240 + 2 x 128 = 496
    ("ws", dict(kv_format="bf16"), True),  # 240 + 96 of a 256-thread launch (256 per thread)
    ("ws", dict(kv_format="mxfp4", consumer_regs=264), False),  # over setmaxnreg's 256
]


@pytest.mark.parametrize("family,fields,accepted", BUDGETS,
                         ids=[f"{f}-{'-'.join(f'{k}{v}' for k, v in d.items()) or 'default'}" for f, d, _ in BUDGETS])
def test_register_budgets_the_launch_cannot_grant_are_refused(family, fields, accepted):
    from tl_kernels.mla_decode_ws import WSDecodeKernelConfig

    make = (lambda: RowsDecodeKernelConfig(**fields)) if family == "rows" else (lambda: WSDecodeKernelConfig(**fields))
    if accepted:
        make()
    else:
        with pytest.raises(ValueError, match="regs"):
            make()


def test_rows_check_times_only_budgets_the_launch_can_grant():
    """Every timed variant of tools/rows_check.py is a config the kernel family accepts (the r256 one was not)."""
    from mla.target import spec_for_name
    from tools import rows_check

    for heads, q_len, batch, kv_len in rows_check.TIMED:
        assert rows_check.timed_configs(spec_for_name("sm_90a"), heads, q_len, batch, kv_len)
