"""The warp-specialised Hopper kernel's structure, read from its generated CUDA (CPU only: lowering needs no GPU).

What the design promises and a silent TileLang change could take away: a bf16 cache is copied by cp.async that
completes on an mbarrier (no cp.async wait anywhere: a wait would serialise the ring again); an fp8 / mxfp4 cache
is decoded by the bit-placement device functions (no conversion instruction, no TileLang cast) in warp groups that
issue no MMA, with no barrier among them inside a tile; the roles get their own register budgets (setmaxnreg); the
GEMMs are wgmma; the cache is read in its compressed type; the split merge is fused (an atomic counter, no second
kernel); the shared memory the schedule counts bounds what TileLang allocates. Also the schedule's choices.
"""

import dataclasses
import re

import pytest

from mla import jit, schedule
from mla.constants import MODES
from mla.target import spec_for_name
from tl_kernels.mla_decode_ws import MX_BLOCKS, WSDecodeKernelConfig

H200 = spec_for_name("sm_90a")
LOWERED_LDS = {}  # config -> dyn_shared_memory_buf of its lowered kernel (filled by the ``source`` fixture)
CASES = [(mode, False, 0) for mode in MODES] + [("fp8", True, 0), ("mxfp4", False, 16), ("bf16", False, 64)]


@pytest.fixture(scope="module", params=CASES, ids=[f"{m}{'-causal' if c else ''}{f'-page{p}' if p else ''}" for m, c, p in CASES])
def source(request):
    mode, causal, page_size = request.param
    kv_format, q_format = MODES[mode]
    cfg = schedule.ws_config(H200, kv_format=kv_format, q_format=q_format, causal=causal, page_size=page_size)
    artifact = jit.lower(cfg, H200)
    LOWERED_LDS[cfg] = jit.lowered_lds_bytes(artifact)
    return cfg, artifact.kernel_source


def producer_code(src: str) -> str:
    """The producer warp groups' branch of the kernel (after the consumer's ``if (threadIdx.x < 128)``)."""
    return src[src.index("warpgroup_reg_dealloc"):]


def test_bf16_copies_are_async_and_never_waited_on(source):
    cfg, src = source
    if cfg.kv_format != "bf16":
        pytest.skip("fp8 / mxfp4 tiles are decoded, not copied")
    assert "cp_async_gs" in src, f"{cfg.name}: the producer's copies are not cp.async"
    assert "mbarrier_cp_async_arrive_noinc" in src, f"{cfg.name}: cp.async does not complete on the ring's mbarrier"
    assert "cp_async_wait" not in src, f"{cfg.name}: a cp.async wait serialises the ring"


def test_compressed_tiles_are_decoded_by_bit_placement_outside_the_mma_warps(source):
    cfg, src = source
    if cfg.kv_format == "bf16":
        pytest.skip("a bf16 cache needs no decode")
    decode = {"fp8": "mla_fp8x16_to_bf16", "mxfp4": "mla_e2m1x16_to_bf16"}[cfg.kv_format]
    decode += "_z((" if cfg.ordered_decode else "(("  # ordered_decode's decodes take the wait's 0
    consumer, producers = src[: src.index("warpgroup_reg_dealloc")], producer_code(src)
    assert decode in producers and decode not in consumer, "the decode belongs to the producers"
    assert "__tl_cvt" not in producers and "cvt." not in producers, f"{cfg.name}: a conversion instruction in the decode"
    assert "wgmma" not in producers, "the decoders must not issue MMAs"
    # one 16-byte (fp8) / 8-byte (mxfp4) vector load per 16 codes, nine per thread and tile: the prologue's two
    # tiles, and the rolling prefetch of the tile two ahead (once per ring stage)
    load = "mla_ld_global_16((" if cfg.kv_format == "fp8" else "mla_ld_global_8(("
    assert producers.count(load) == 4 * 9, f"{cfg.name}: expected 9 vector loads per tile"
    # No barrier that the consumer takes part in (it would stall the MMAs on the decode). TileLang puts named
    # barriers of the 256 decoders alone between chunks of some tiles (a known cost, docs/perf.md run 15).
    assert "__syncthreads" not in producers, f"{cfg.name}: a CTA-wide barrier in the decoders' loop"
    partial = re.findall(r"__sync_thread_partial\(\d+, (\d+)\)", producers)
    assert all(int(n) == cfg.producer_groups * 128 for n in partial), f"{cfg.name}: a barrier with the consumer"


def test_roles_have_their_own_register_budgets(source):
    cfg, src = source
    assert f"warpgroup_reg_alloc<{cfg.consumer_regs}>" in src and f"warpgroup_reg_dealloc<{cfg.producer_regs}>" in src
    assert cfg.consumer_regs + cfg.producer_groups * cfg.producer_regs <= 512, "64 Ki registers per SM"
    assert f"__launch_bounds__({cfg.threads}, 1)" in src, "setmaxnreg needs a register cap at entry"


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


def test_shared_bytes_bound_the_lowered_allocation(source):
    """The schedule sizes occupancy and checks the limit with ``shared_bytes``: it must not undercount."""
    cfg, _ = source
    lowered = LOWERED_LDS[cfg]
    assert lowered <= cfg.shared_bytes <= H200.smem_bytes, (cfg.name, lowered, cfg.shared_bytes)


@pytest.mark.parametrize("kv_format,q_format", [("fp8", "bf16"), ("fp8", "fp8"), ("mxfp4", "bf16")])
def test_default_ring_is_persistent_where_ws_defaults_say(kv_format, q_format):
    """The default's persistence (schedule.ws_persistent_defaults, docs/perf.md run 62b): fp8 caches with bf16 Q take
    the one-copy ring with one CTA per SM (the target's own count, so an SM count other than the H200's gets its own
    grid bound); a8w8 and mxfp4 keep one CTA per work item."""
    persistent = q_format in schedule.WS_DEFAULTS[kv_format].persistent_q_formats
    assert persistent == ((kv_format, q_format) == ("fp8", "bf16"))
    for spec in (H200, dataclasses.replace(H200, num_sms=114)):
        for causal, page_size in ((False, 0), (True, 64)):
            cfg = schedule.ws_default_config(spec, kv_format=kv_format, q_format=q_format, causal=causal,
                                             page_size=page_size)
            assert cfg.persistent_ctas == (spec.num_sms if persistent else 0), (spec.num_sms, causal, page_size)
            assert cfg.dynamic_stage or not persistent
            assert cfg.name.endswith(f"_pc{spec.num_sms}") == persistent, cfg.name


def test_schedule_picks_the_family_for_the_16_row_class_on_hopper_only():
    """The default for 16 heads x 1 query on sm_90a where it measured faster (schedule.WS_DEFAULTS: flat fp8 and
    mxfp4 caches from 256 Ki tokens, docs/perf.md runs 52 and 58; paged mxfp4 from 64 Ki, run 15); the 16/32/64-row
    kernel elsewhere (bf16 caches, smaller caches, paged fp8, mxfp4 with fp8 Q), and always on gfx942."""
    common = dict(q_format="bf16", causal=False, page_size=0)
    big = max(d.min_tokens for d in schedule.WS_DEFAULTS.values())
    for kv_format, default in schedule.WS_DEFAULTS.items():
        min_tokens = default.min_tokens
        cfg, combine, _ = schedule.select_kernels(H200, kv_format=kv_format, num_heads=16, batch=8, total_q=8,
                                                  total_kv=min_tokens, **common)
        assert isinstance(cfg, WSDecodeKernelConfig) and combine is None, kv_format
        # the default's ring: fp8 on fp8 wgmma with P in two terms (no decoders, so no decoder tunings); mxfp4 on
        # its decoders with theirs
        assert (cfg.fp8_mma, cfg.p_split, cfg.q_stack, cfg.p_stack) == (
            default.fp8_mma, default.p_split, default.q_stack, default.p_stack), kv_format
        assert cfg == schedule.ws_default_config(H200, kv_format=kv_format), kv_format
        if not default.fp8_mma:
            assert (cfg.l2_prefetch, cfg.direct_stores) == (default.l2_prefetch, default.direct_stores), kv_format
        cfg, _, _ = schedule.select_kernels(H200, kv_format=kv_format, num_heads=16, batch=8, total_q=8,
                                            total_kv=min_tokens - 1, **common)
        assert not isinstance(cfg, WSDecodeKernelConfig), (kv_format, min_tokens - 1)
    cfg, _, _ = schedule.select_kernels(H200, kv_format="bf16", num_heads=16, batch=8, total_q=8, total_kv=big,
                                        **common)
    assert not isinstance(cfg, WSDecodeKernelConfig), "bf16 caches keep the 16-row kernel"
    a8w8_min = schedule.WS_DEFAULTS["fp8"].fp8_q_min_tokens  # fp8 Q (a8w8): its own threshold
    for total_kv, ws in ((a8w8_min, True), (a8w8_min - 1, False)):
        cfg, _, _ = schedule.select_kernels(H200, kv_format="fp8", num_heads=16, batch=8, total_q=8, total_kv=total_kv,
                                            **dict(common, q_format="fp8"))
        assert isinstance(cfg, WSDecodeKernelConfig) == ws and (not ws or cfg.q_format == "fp8"), total_kv
        assert not ws or (cfg.fp8_mma and cfg.p_split and cfg.p_stack and not cfg.q_stack), (
            "a8w8's default: both GEMMs on fp8 wgmma, P's two terms in one P V group")
        assert not ws or not cfg.persistent_ctas, "a8w8's default ring: one CTA per work item (run 62b)"
    # any tuning override beyond ``ws``: the family's base config plus those overrides (the decoder ring for fp8)
    cfg, _, _ = schedule.select_kernels(H200, kv_format="fp8", num_heads=16, batch=8, total_q=8, total_kv=8,
                                        ws=True, num_stages=2, **common)
    assert isinstance(cfg, WSDecodeKernelConfig) and not cfg.fp8_mma and cfg.l2_prefetch == 3
    cfg, _, _ = schedule.select_kernels(H200, kv_format="fp8", num_heads=16, batch=8, total_q=8, total_kv=8,
                                        ws=True, **common)
    assert cfg == schedule.ws_default_config(H200, kv_format="fp8"), "ws=True alone: the default's ring"
    assert schedule.ws_min_tokens("mxfp4", "fp8") is None and schedule.ws_min_tokens("bf16", "bf16") is None
    for kv_format in schedule.WS_FORMATS:  # paged caches: only the formats measured paged, from their own threshold
        paged_min = schedule.WS_DEFAULTS[kv_format].paged_min_tokens
        for total_kv in (big, paged_min or big, (paged_min or big) - 1):
            cfg, _, _ = schedule.select_kernels(H200, kv_format=kv_format, num_heads=16, batch=8, total_q=8,
                                                total_kv=total_kv, **dict(common, page_size=64))
            ws = paged_min is not None and total_kv >= paged_min
            assert isinstance(cfg, WSDecodeKernelConfig) == ws, (kv_format, total_kv)
    for heads, total_q in ((32, 8), (16, 16)):  # more heads, or two queries per sequence: the 32/64-row kernel
        cfg, _, _ = schedule.select_kernels(H200, kv_format="mxfp4", num_heads=heads, batch=8, total_q=total_q,
                                            total_kv=big, **common)
        assert not isinstance(cfg, WSDecodeKernelConfig)
    cfg, _, _ = schedule.select_kernels(spec_for_name("gfx942"), kv_format="mxfp4", num_heads=16, batch=8, total_q=8,
                                        total_kv=big, ws=True, **common)
    assert not isinstance(cfg, WSDecodeKernelConfig), "gfx942 has no wgmma / setmaxnreg"
    cfg, _, _ = schedule.select_kernels(H200, kv_format="fp8", num_heads=16, batch=8, total_q=8, total_kv=big,
                                        ws=True, **common)
    assert isinstance(cfg, WSDecodeKernelConfig), "ws=True forces the family (tuning, tests)"


@pytest.mark.parametrize("kv_format", ["bf16", "fp8", "mxfp4"])
def test_ring_fits_one_cta_per_sm(kv_format):
    cfg = schedule.ws_config(H200, kv_format=kv_format)
    assert cfg.shared_bytes <= H200.smem_bytes and schedule.ctas_per_sm(H200, cfg) == 1
    assert cfg.num_stages >= 2


def test_decoders_take_two_stages_only():
    with pytest.raises(ValueError, match="num_stages == 2"):
        WSDecodeKernelConfig(kv_format="fp8", num_stages=3)


@pytest.mark.parametrize("batch,kv_len", [(4, 1024), (4, 8192), (64, 8192), (256, 8192), (1, 100), (300, 64)])
def test_split_count_fills_the_machine_without_empty_tiles(batch, kv_len):
    cfg = schedule.ws_config(H200, kv_format="fp8")
    splits = schedule.ws_num_splits(H200, cfg, batch=batch, total_kv=batch * kv_len)
    tiles = -(-kv_len // cfg.block_n)
    assert 1 <= splits <= min(tiles, schedule.MAX_SPLITS)
    if batch * tiles >= 4 * H200.num_sms:  # plenty of tiles: at least 90% of the SMs get a CTA
        assert batch * splits >= 0.9 * H200.num_sms or splits == tiles


def test_measurement_fields_name_their_variants_and_are_checked():
    """The L2 prefetch, the pipelined consumer and the idle producers each change the generated code, so each has
    its own kernel name (the cache key); a negative prefetch distance is refused."""
    base = WSDecodeKernelConfig(kv_format="fp8")
    names = {base.name}
    for fields in (dict(l2_prefetch=3), dict(overlap=True), dict(idle_producers=True),
                   dict(overlap=True, idle_producers=True)):
        names.add(WSDecodeKernelConfig(kv_format="fp8", **fields).name)
    assert len(names) == 5
    with pytest.raises(ValueError, match="l2_prefetch"):
        WSDecodeKernelConfig(kv_format="fp8", l2_prefetch=-1)


def test_l2_prefetch_is_one_bulk_prefetch_per_run_of_rows():
    """fp8 with the prefetch: the producers issue TMA bulk L2 prefetches (no register, no scoreboard) of whole tiles
    (a flat cache) or page runs; a kernel without it has none."""
    with_pf = jit.lower(schedule.ws_config(H200, kv_format="fp8"), H200).kernel_source
    assert schedule.ws_config(H200, kv_format="fp8").l2_prefetch == schedule.WS_DEFAULTS["fp8"].l2_prefetch > 0
    assert "cp.async.bulk.prefetch.L2.global" in with_pf
    calls = [line for line in producer_code(with_pf).splitlines() if "mla_prefetch_l2(" in line]
    assert calls, "no prefetch issued by the producers"
    without = jit.lower(schedule.ws_config(H200, kv_format="mxfp4"), H200).kernel_source
    assert "mla_prefetch_l2" not in without


@pytest.mark.parametrize("overlap", [False, True], ids=["serial", "overlap"])
def test_fast_softmax_exchanges_each_tile_max_once(overlap):
    """``fast_softmax`` (the schedule's default): each tile's row maxima come from ``mla_ws_tile_max`` (one exchange
    through shared memory behind its own named barrier, id 5, which no other barrier of the kernel uses) and no
    TileLang reduction is left in the KV loop: the one left is the per-pass sum of the deferred denominators."""
    fast = schedule.ws_config(H200, kv_format="fp8", overlap=overlap)
    base = schedule.ws_config(H200, kv_format="fp8", overlap=overlap, fast_softmax=False)
    assert fast.fast_softmax and fast.score_group and fast.name == base.name.replace("_sg", "_fs_sg")
    src = jit.lower(fast, H200).kernel_source
    base_src = jit.lower(base, H200).kernel_source
    calls = [line for line in src.splitlines() if "mla_ws_tile_max(" in line and "__device__" not in line]
    assert len(calls) == base.num_stages  # one per static stage of the ring loop
    assert src.count("AllReduce<tl::SumOp") == 2 and src.count("AllReduce<tl::MaxOp") == 0  # the per-pass sum
    assert base_src.count("AllReduce<tl::MaxOp") == 2 * base.num_stages  # what it replaces: two per stage
    other_ids = {int(i) for i in re.findall(r"__sync_thread_partial\((\d+)", src)}
    assert 5 not in other_ids and src.count("bar.sync 5, 128") == 1


@pytest.mark.parametrize("kv_format", ["fp8", "mxfp4"])
def test_direct_stores_leave_the_decoders_without_barriers(kv_format):
    """``direct_stores``: the decoders store each chunk by its shared address (taken once per stage through the
    ring's layout), so TileLang's barrier planner puts no barrier among them (without it: one before most chunks'
    stores, the 8 decoder warps in lock-step); the schedule turns it on for fp8 and mxfp4. (Counted in the ring
    loop: ``ordered_decode``'s shared 0 puts one before it.)"""
    on = schedule.ws_config(H200, kv_format=kv_format, direct_stores=True)
    off = schedule.ws_config(H200, kv_format=kv_format, direct_stores=False)

    def decoder_barriers(src):
        ring_loop = producer_code(src)[producer_code(src).index("for (int rnd"):]
        return len(re.findall(r"__sync_thread_partial\(\d+, 256\)", ring_loop))

    on_src = jit.lower(on, H200).kernel_source
    assert decoder_barriers(on_src) == 0 and "mla_st_shared_swz32(" in producer_code(on_src)
    assert decoder_barriers(jit.lower(off, H200).kernel_source) > 0
    assert schedule.ws_config(H200, kv_format=kv_format).direct_stores == schedule.WS_DEFAULTS[kv_format].direct_stores
    with pytest.raises(ValueError, match="direct_stores"):
        WSDecodeKernelConfig(kv_format="bf16", direct_stores=True)


def test_ordered_decode_keeps_the_decode_below_the_stage_wait():
    """``ordered_decode`` (mxfp4's default, docs/perf.md run 34): the decoders wait for a free stage through
    ``mla_mbar_wait_zero`` and every decode takes its 0 (so ptxas cannot hoist the decode, and with it the wait for
    all outstanding loads, above the stage wait); the 0 is a shared word each decoder writes itself and the wait
    reads after its acquire (a 0 derived from the wait's predicate was miscompiled: run 33); the L2 prefetches move
    to the consumer (a decoder's divergent branch also drains its loads)."""
    cfg = schedule.ws_config(H200, kv_format="fp8", ordered_decode=True)
    src = jit.lower(cfg, H200).kernel_source
    producers, consumer = producer_code(src), src[:src.index("warpgroup_reg_dealloc")]
    assert cfg.name.endswith("_od") and cfg.l2_prefetch > 0
    waits = re.findall(r"mla_mbar_wait_zero\((.*)\);", producers)
    assert len(waits) == cfg.num_stages and all(w.count(",") == 2 for w in waits)  # barrier, parity, the shared 0
    zero_word = re.search(r"\(&\(\(\(uint\*\)(\w+)\)\[0\]\)\)\)?$", waits[0]).group(1)
    assert re.search(rf"\(\(uint\*\){zero_word}\)\[0\] = \(uint\)0;", producers), "each decoder writes the 0"
    assert "mla_fp8x16_to_bf16_z((" in producers and "mla_fp8x16_to_bf16((" not in producers  # every decode
    assert "mla_prefetch_l2(" not in producers and "mla_prefetch_l2(" in consumer
    default = jit.lower(schedule.ws_config(H200, kv_format="fp8"), H200).kernel_source
    assert "mla_mbar_wait_zero" not in default  # the default kernel's source is untouched
    for bad in (dict(kv_format="bf16"), dict(kv_format="fp8", overlap=True)):
        with pytest.raises(ValueError, match="ordered_decode"):
            WSDecodeKernelConfig(ordered_decode=True, **bad)
    # the defaults: mxfp4 with it (and with the stores by address), fp8 without; a pipelined-consumer override drops it
    assert schedule.ws_config(H200, kv_format="mxfp4").ordered_decode == schedule.WS_DEFAULTS["mxfp4"].ordered_decode
    assert schedule.WS_DEFAULTS["mxfp4"].ordered_decode and not schedule.WS_DEFAULTS["fp8"].ordered_decode
    assert not schedule.ws_config(H200, kv_format="mxfp4", overlap=True).ordered_decode


# ---- a8w8 on fp8 wgmma (``fp8_mma``, issue 28 step 5) ----------------------------------------------------------

F8MMA = dict(fp8_mma=True)


@pytest.fixture(scope="module", params=[("fp8", False, 0), ("fp8", True, 64), ("fp8", False, 0, 3), ("bf16", False, 0),
                                        ("bf16", True, 16)],
                ids=["a8w8", "a8w8-causal-page64", "a8w8-st3", "bf16q", "bf16q-causal-page16"])
def f8mma_source(request):
    q_format, causal, page_size, *stages = request.param
    extra = dict(num_stages=stages[0]) if stages else {}
    cfg = schedule.ws_config(H200, kv_format="fp8", q_format=q_format, causal=causal, page_size=page_size, **F8MMA,
                             **extra)
    artifact = jit.lower(cfg, H200)
    return cfg, artifact.kernel_source, jit.lowered_lds_bytes(artifact)


def test_fp8_mma_reads_the_codes_as_stored_on_fp8_wgmma(f8mma_source):
    """No decode anywhere: the codes are copied by cp.async (completing on the ring's mbarrier, never waited on),
    both GEMMs are fp8 wgmma with the KV tile as M (k = 32), and the transposer alone writes V^T."""
    cfg, src, _ = f8mma_source
    body = src[src.index("__global__"):]  # the kernel, not the imported device functions
    consumer, producers = body[: body.index("warpgroup_reg_dealloc")], producer_code(body)
    assert "mla_fp8x16_to_bf16" not in body and "mla_ld_global" not in body, f"{cfg.name}: a decode or register load"
    assert "cp_async_gs" in producers and "mbarrier_cp_async_arrive_noinc" in producers
    assert "cp_async_wait" not in src, f"{cfg.name}: a cp.async wait serialises the ring"
    fp8_wgmma = "wgmma_ss<tl::DataType::kFloat8_e4m3, tl::DataType::kFloat8_e4m3, tl::DataType::kFloat32, 64, 16, 32,"
    assert fp8_wgmma in consumer and "kBFloat16" not in consumer, f"{cfg.name}: a GEMM not on fp8 wgmma"
    assert "wgmma" not in producers, "the copier and the transposer issue no MMA"
    # the layouts the transposer's addresses assume: the codes' latent tile in the 128-byte swizzle (descriptor mode
    # 1), V^T in the 64-byte swizzle (mode 2), as wgmma infers them for these shapes
    assert "initialize_wgmma_descriptor<1, 1, 64>(desc_a" in consumer, f"{cfg.name}: codes not 128-byte swizzled"
    assert consumer.count("initialize_wgmma_descriptor<2, 1, 32>(desc_a") >= 2 * cfg.num_stages, (
        f"{cfg.name}: V^T (and the rope codes) not 64-byte swizzled")
    # one transposer call per ring stage, in the producers' branch (plus its definition)
    assert producers.count("mla_transpose_v_fp8(") == cfg.num_stages
    assert "__syncthreads" not in producers, f"{cfg.name}: a CTA-wide barrier in the producers' loop"
    # bf16 Q: two score wgmma groups per tile (Q's hi and lo terms), 18 each; a8w8 one
    qk_per_stage = 36 if cfg.q_split else 18
    assert consumer.count(fp8_wgmma) == cfg.num_stages * (4 if cfg.q_split else 2) + cfg.num_stages, (
        f"{cfg.name}: expected {qk_per_stage} score and 16 P V wgmma per stage")


def test_fp8_mma_shared_bytes_bound_the_lowered_allocation(f8mma_source):
    cfg, _, lowered = f8mma_source
    assert lowered <= cfg.shared_bytes <= H200.smem_bytes, (cfg.name, lowered, cfg.shared_bytes)


@pytest.mark.parametrize("kv_format,q_format", [("mxfp4", "fp8"), ("bf16", "bf16"), ("mxfp4", "fp8_codes")])
def test_fp8_mma_reads_an_fp8_cache_or_mxfp4_with_bf16_q(kv_format, q_format):
    with pytest.raises(ValueError, match="fp8_mma reads an fp8 cache"):
        WSDecodeKernelConfig(kv_format=kv_format, q_format=q_format, fp8_mma=True)


# ---- mxfp4 on fp8 wgmma (``fp8_mma`` with an mxfp4 cache, issue 28 step 4) -------------------------------------


@pytest.fixture(scope="module", params=[(False, 0, False, F8MMA), (True, 64, False, F8MMA), (False, 0, True, F8MMA),
                                        (False, 0, True, schedule.MX_RING_2D)],
                ids=["flat", "causal-page64", "p-split", "two-decoders"])
def mx_mma_source(request):
    causal, page_size, p_split, ring = request.param
    cfg = schedule.ws_config(H200, kv_format="mxfp4", causal=causal, page_size=page_size,
                             **{"p_split": p_split, **ring})
    artifact = jit.lower(cfg, H200)
    return cfg, artifact.kernel_source, jit.lowered_lds_bytes(artifact)


def test_mx_mma_decodes_mxfp4_to_e4m3_for_fp8_wgmma(mx_mma_source):
    """The decoder warp group loads the codes into registers and writes e4m3 codes by address (9 blocks per tile,
    per stage, with and without the next tile's loads), the transposer writes V^T, both GEMMs are fp8 wgmma with Q
    as two terms, and the consumer reads the tile's column values (score factor, offset, weight)."""
    cfg, src, _ = mx_mma_source
    assert cfg.mx_mma and cfg.q_split and cfg.fast_softmax
    body = src[src.index("__global__"):]
    consumer, producers = body[: body.index("warpgroup_reg_dealloc")], producer_code(body)
    assert "cp_async" not in producers and "mla_ld_global_16" in producers and "mla_ld_global_u8" in producers
    # one decoder: per stage, the store with and without the next tile's loads; a decoder per stage (mx_decoders):
    # one copy of the store for every group (its stage a register, the next tile's loads always issued)
    copies = 2 * cfg.num_stages if cfg.mx_decoders == 1 else 1
    assert producers.count("mla_mx_block_to_e4m3(") == copies * MX_BLOCKS
    assert producers.count("mla_mx_token_exp(") == producers.count("mla_mx_store_columns(") == copies
    assert producers.count("mla_transpose_v_fp8(") == cfg.num_stages
    fp8_wgmma = "wgmma_ss<tl::DataType::kFloat8_e4m3, tl::DataType::kFloat8_e4m3, tl::DataType::kFloat32, 64, 16, 32,"
    assert fp8_wgmma.split(", 64,")[0] in consumer and "kBFloat16" not in consumer and "wgmma" not in producers
    if cfg.p_stack:  # Q's and P's two terms stacked: m64n32, one score group (two loops) and one P V group
        stacked = fp8_wgmma.replace(", 64, 16, 32,", ", 64, 32, 32,")
        assert consumer.count(stacked) == cfg.num_stages * 3, "one score group of two wgmma loops, one P V, per stage"
    else:
        assert consumer.count(fp8_wgmma) == cfg.num_stages * (6 if cfg.p_split else 5), (
            "two score groups of two wgmma loops, one P V (two with p_split), per stage")
    assert "initialize_wgmma_descriptor<1, 1, 64>(desc_a" in consumer, "latent codes not 128-byte swizzled"
    assert consumer.count("initialize_wgmma_descriptor<2, 1, 32>(desc_a") >= 2 * cfg.num_stages
    assert "__syncthreads" not in producers, "a CTA-wide barrier in the producers' loop"
    # the registers: consumer + decoder(s) + transposer within the pool, each group's setmaxnreg in the source
    groups = [cfg.group_regs(g) for g in range(cfg.producer_groups)]
    assert cfg.consumer_regs + sum(groups) <= 504 and groups[1] == cfg.transposer_regs
    assert cfg.producer_groups == 1 + cfg.mx_decoders and f"__launch_bounds__({cfg.threads}, 1)" in src
    for regs in {cfg.producer_regs, cfg.transposer_regs}:
        assert f"warpgroup_reg_dealloc<{regs}>" in body, f"{cfg.name}: no setmaxnreg {regs}"
    if cfg.mx_decoders > 1:  # each decoder group owns one stage: one ready arrival per stage per group's loop
        assert cfg.threads == 512 and "(384 <= ((int)threadIdx.x))" in body, (
            f"{cfg.name}: no branch for the second decoder group (threads 384 ..)")


def test_mx_mma_shared_bytes_bound_the_lowered_allocation(mx_mma_source):
    cfg, _, lowered = mx_mma_source
    assert lowered <= cfg.shared_bytes <= H200.smem_bytes, (cfg.name, lowered, cfg.shared_bytes)


def mx_decoder_stores():
    """A model of ``mx_chunk_addr`` (tl_kernels/mla_decode_ws.py): per warp and (block, half), the 32 lanes'
    (token, first dim) and shared byte offset (latent: 8 KiB panels of 128 dims, 128-byte swizzle; rope: 64-byte
    rows, 64-byte swizzle, at offset ROPE)."""
    rope = 1 << 20
    accesses = []
    for warp in range(4):
        for b in range(MX_BLOCKS):
            for half in range(2):
                lanes = []
                for lane in range(32):
                    p = 32 * warp + lane
                    i, h = p // 2, p % 2
                    if b < MX_BLOCKS - 1:
                        c = 2 * b + half
                        lanes.append(((i, 256 * h + 16 * c), (2 * h + c // 8) * 8192 + i * 128 + (((c % 8) ^ (i % 8)) << 4)))
                    else:
                        q = 2 * h + half
                        lanes.append(((i, 512 + 16 * q), rope + i * 64 + ((q ^ (i // 2 % 4)) << 4)))
                accesses.append(lanes)
    return accesses


def test_mx_decoder_writes_every_chunk_once_at_full_store_width():
    """Every 16-byte chunk of a stage (64 tokens x 576 codes) is written once, where TileLang's swizzles put it
    (the transposer's source formula for the latent panels), and each warp-wide 16-byte store needs the minimum of 4
    shared-memory wavefronts (each 128-byte bank window holds every 16-byte slot 4 times)."""
    accesses = mx_decoder_stores()
    chunks = [where for lanes in accesses for where, _ in lanes]
    assert sorted(chunks) == sorted((i, d) for i in range(64) for d in range(0, 576, 16))
    offsets = [offset for lanes in accesses for _, offset in lanes]
    assert len(set(offsets)) == len(offsets)
    for lanes in accesses:
        slots = [offset % 128 // 16 for _, offset in lanes]
        assert max(slots.count(x) for x in range(8)) == 4, slots


@pytest.mark.parametrize("fields,suffix,q_format", [(("p_split",), "_ps", "fp8"), (("score_ahead",), "_sa", "fp8"),
                                                    (("q_stack",), "_qs", "bf16"),
                                                    (("p_split", "p_stack"), "_pst", "fp8")])
def test_p_split_score_ahead_and_the_stacks_are_fp8_mmas(fields, suffix, q_format):
    with pytest.raises(ValueError, match="p_split, score_ahead, q_stack and p_stack are fp8_mma's"):
        WSDecodeKernelConfig(kv_format="fp8", q_format=q_format, **{f: True for f in fields})
    cfg = WSDecodeKernelConfig(kv_format="fp8", q_format=q_format, fp8_mma=True, score_group=True,
                               **{f: True for f in fields})
    assert cfg.name.endswith(suffix)


@pytest.mark.parametrize("stages", [2, 3])
def test_the_stacks_keep_fp8_mmas_ring_depths(stages):
    """The stacks' checks sit inside fp8_mma's (a misplaced one once cut the elif chain that frees fp8_mma from the
    decoders' two-stage rule)."""
    for extra in (dict(q_format="fp8"), dict(q_format="bf16", q_stack=True, score_group=True)):
        cfg = WSDecodeKernelConfig(kv_format="fp8", fp8_mma=True, p_split=True, p_stack=True, num_stages=stages, **extra)
        assert cfg.num_stages == stages
    with pytest.raises(ValueError, match="need num_stages == 2"):
        WSDecodeKernelConfig(kv_format="fp8", num_stages=stages + 1)


@pytest.mark.parametrize("bad", [dict(p_split=False), dict(score_ahead=True)], ids=["no-p-split", "score-ahead"])
def test_p_stack_stacks_p_splits_two_terms_only(bad):
    with pytest.raises(ValueError, match="p_stack stacks p_split's two P terms"):
        WSDecodeKernelConfig(**{"kv_format": "fp8", "q_format": "fp8", "fp8_mma": True, "p_split": True,
                                "p_stack": True, **bad})


@pytest.mark.parametrize("q_format", ["fp8", "bf16"])
def test_p_stack_multiplies_both_p_terms_in_one_wgmma_group(q_format):
    """``p_stack``: per stage one P V group of m64n32 wgmma (16: 8 row blocks of V^T x 2) instead of two of m64n16;
    O^T's two halves (registers 16 b + 0-7 and 16 b + 8-15 of each 64-row block b) rescaled per tile, then summed
    into the 64-register acc_o once per pass, within each thread."""
    extra = dict(q_stack=True) if q_format == "bf16" else {}
    cfg = schedule.ws_config(H200, kv_format="fp8", q_format=q_format, fp8_mma=True, p_split=True, p_stack=True,
                             **extra)
    src = jit.lower(cfg, H200).kernel_source
    consumer = src[src.index("warpgroup_reg_alloc"):src.index("warpgroup_reg_dealloc")]
    wgmma = "wgmma_ss<tl::DataType::kFloat8_e4m3, tl::DataType::kFloat8_e4m3, tl::DataType::kFloat32, 64, {}, 32,"
    # call sites per stage: the score's latent and rope loops (m64n32 with q_stack, else m64n16), P V's one loop
    n32, n16 = (3, 0) if q_format == "bf16" else (1, 2)
    assert (consumer.count(wgmma.format(32)), consumer.count(wgmma.format(16))) == (
        n32 * cfg.num_stages, n16 * cfg.num_stages), cfg.name
    assert re.search(r"float v_\d+\[128\];", src), "O^T of 512 x 32: 128 floats per thread"
    fold = re.findall(r"\*\(float4\*\)\(v_\d+ \+ \((i_\d+) \* 4\)\) = \*\(float4\*\)\(v_\d+ \+ \(\(\(\((i_\d+) >> 1\) \* 16\) "
                      r"\+ \(\((i_\d+) & 1\) \* 4\)\) \+ 8\)\);", src)
    assert fold, "the hi half of O^T moved into acc_o within the thread"


@pytest.mark.parametrize("bad", [dict(q_format="fp8"), dict(score_ahead=True), dict(score_group=False)],
                         ids=["fp8-q", "score-ahead", "no-score-group"])
def test_q_stack_stacks_bf16_qs_two_terms_only(bad):
    with pytest.raises(ValueError, match="q_stack stacks bf16 Q's two e4m3 terms"):
        WSDecodeKernelConfig(**{"kv_format": "fp8", "q_format": "bf16", "fp8_mma": True, "q_stack": True,
                                "score_group": True, **bad})


def test_q_stack_scores_both_q_terms_in_one_wgmma_group():
    """``q_stack``: per stage one score group of m64n32 wgmma (18: 16 latent + 2 rope) instead of two of m64n16,
    P V unchanged (two m64n16 groups with ``p_split``); the lo half of S^T moves within each thread (registers 8-15
    of the m64n32 accumulator, one 16-byte copy per 4 values) before the scores are scaled."""
    cfg = schedule.ws_config(H200, kv_format="fp8", fp8_mma=True, p_split=True, q_stack=True)
    src = jit.lower(cfg, H200).kernel_source
    consumer = src[src.index("warpgroup_reg_alloc"):src.index("warpgroup_reg_dealloc")]
    wgmma = "wgmma_ss<tl::DataType::kFloat8_e4m3, tl::DataType::kFloat8_e4m3, tl::DataType::kFloat32, 64, {}, 32,"
    assert consumer.count(wgmma.format(32)) == 2 * cfg.num_stages, "one latent and one rope loop per stage"
    assert consumer.count(wgmma.format(16)) == 2 * cfg.num_stages, "P V: P's hi and lo terms"
    moves = re.findall(r"\*\(float4\*\)\(v_\d+ \+ \((i_\d+) \* 4\)\) = \*\(float4\*\)\(v_\d+ \+ \(\((i_\d+) \* 4\) \+ 8\)\);",
                       consumer)
    assert moves and all(a == b for a, b in moves), "the lo half of S^T: registers 8-15 moved within the thread"


def test_score_ahead_is_built_for_an_fp8_cache():
    with pytest.raises(ValueError, match="score_ahead is built for an fp8 cache"):
        WSDecodeKernelConfig(kv_format="mxfp4", fp8_mma=True, fast_softmax=True, score_ahead=True)


@pytest.mark.parametrize("q_format", ["fp8", "bf16"])
def test_score_ahead_issues_the_next_scores_before_the_softmax(q_format):
    """``attend_ahead``: per static stage copy, S(t + 1) is issued (the other stage's codes into its own S^T
    fragment) before this tile's scores are read, and each copy ends with one wait for every group (none in flight
    across the back edge); the transposer zeroes the V^T ring once."""
    cfg = schedule.ws_config(H200, kv_format="fp8", q_format=q_format, fp8_mma=True, score_ahead=True)
    src = jit.lower(cfg, H200).kernel_source
    consumer = src[src.index("warpgroup_reg_alloc"):src.index("warpgroup_reg_dealloc")]
    loop = consumer[consumer.index("for (int rnd = 0;"):]
    loop = loop[:loop.index("wait_wgmma<0>();", loop.index("wait_wgmma<0>();") + 1) + 16]
    assert loop.count("wait_wgmma<0>();") == cfg.num_stages and "wait_wgmma<" not in loop.replace(
        "wait_wgmma<0>();", ""), "one full wait per stage copy, nothing else"
    first_mask = loop.index("-CUDART_INF_F")
    assert loop[:first_mask].count("warpgroup_commit_batch") == (4 if q_format == "bf16" else 2), (
        "the next tile's score groups are issued before this tile's scores are masked")
    assert src.count("mla_zero_shared(") == 2  # the device function and its one call


@pytest.mark.parametrize("field", ["overlap", "direct_stores", "ordered_decode", "idle_producers"])
def test_fp8_mma_refuses_the_decoders_options(field):
    with pytest.raises(ValueError, match="fp8_mma has no decoders"):
        WSDecodeKernelConfig(kv_format="fp8", q_format="fp8", fp8_mma=True, **{field: True})


def transposer_accesses():
    """A model of ``dequant.TRANSPOSE_CUDA_SOURCE``'s index arithmetic, instruction by instruction: for each warp,
    iteration and load / store slot, the 32 lanes' (token, dim) and shared byte offsets, as the device function
    computes them (a per-lane base plus an immediate for the loads, a per-lane base XOR / plus a part of the block
    group for the stores), each checked against the swizzle formula it stands for (source: the ring stage's
    128-byte swizzle; destination: the V^T stage's 64-byte swizzle)."""
    loads, stores = [], []
    for warp in range(4):
        for it in range(16):
            b = it * 4 + warp
            for i in range(4):
                lane_loads = []
                for lane in range(32):
                    g = ((lane >> 4) & 1) << 1
                    dq, jq = 8 * (b & 15) + (lane & 7), 4 * (b >> 4) + (lane >> 3)
                    j = 4 * jq + (i ^ g)
                    formula = (dq >> 5) * 8192 + j * 128 + ((((dq >> 2) & 7) ^ (j & 7)) << 4) + (dq & 3) * 4
                    cq = (2 * warp + ((lane & 7) >> 2)) & 7
                    jj = 4 * (lane >> 3) + (i ^ g)
                    device = jj * 128 + ((cq ^ (jj & 7)) << 4) + (lane & 3) * 4 + (it & 3) * 8192 + (it >> 2) * 2048
                    assert device == formula, (warp, it, i, lane)
                    lane_loads.append(((j, 4 * dq), device))
                loads.append(lane_loads)
            for k in range(4):
                lane_stores = []
                for lane in range(32):
                    f = (lane >> 1) & 3
                    dq, jq = 8 * (b & 15) + (lane & 7), 4 * (b >> 4) + (lane >> 3)
                    d = 4 * dq + (k ^ f)
                    formula = d * 64 + ((((jq >> 2) & 3) ^ ((d >> 1) & 3)) << 4) + (jq & 3) * 4
                    dl = 32 * warp + 4 * (lane & 7) + (k ^ f)
                    base = dl * 64 + (((dl >> 1) & 3) << 4) + ((lane >> 3) & 3) * 4
                    device = (base ^ (((it >> 2) & 3) << 4)) + (it & 3) * 8192
                    assert device == formula, (warp, it, k, lane)
                    lane_stores.append(((4 * jq, d), device))
                stores.append(lane_stores)
    return loads, stores


def test_transposer_moves_every_code_once_without_bank_conflicts():
    """Every 4-byte word of the tile's V is loaded once and every word of V^T stored once, and each warp-wide
    load or store touches 32 distinct banks (so the 32 KiB per tile move at the shared-memory port's full width)."""
    loads, stores = transposer_accesses()
    load_words = [where for access in loads for where, _ in access]
    store_words = [where for access in stores for where, _ in access]
    assert sorted(load_words) == sorted((j, d) for j in range(64) for d in range(0, 512, 4))
    assert sorted(store_words) == sorted((j, d) for j in range(0, 64, 4) for d in range(512))
    for access in loads + stores:
        banks = {offset // 4 % 32 for _, offset in access}
        assert len(banks) == 32, f"bank conflict: {sorted(offset for _, offset in access)}"
    # the swizzles are bijections onto the stages: 32 KiB of V, 32 KiB of V^T
    assert len({offset for access in loads for _, offset in access}) == 64 * 512 // 4
    assert max(offset for access in stores for _, offset in access) < 512 * 64


@pytest.mark.parametrize("q_format", ["fp8", "bf16"])
def test_fp8_mma_takes_none_of_the_decoders_tunings(q_format):
    """``fp8_mma=True`` alone is the override: the schedule leaves out the fp8 decoders' defaults (direct stores,
    the L2 prefetch), which the copier has no use for."""
    cfg = schedule.ws_config(H200, kv_format="fp8", q_format=q_format, fp8_mma=True)
    assert (cfg.direct_stores, cfg.ordered_decode, cfg.l2_prefetch) == (False, False, 0)
    assert schedule.ws_config(H200, kv_format="fp8", q_format=q_format).direct_stores, "the decoders keep theirs"


# ---- every role's tile step in one copy (``dynamic_stage``) ------------------------------------------------------

DYN_RINGS = {"fp8": schedule.ws_ring_defaults("fp8", "bf16"), "a8w8": schedule.ws_ring_defaults("fp8", "fp8"),
             "mxfp4-2dec": schedule.MX_RING_2D}


def lowered_pair(mode, **kwargs):
    """The ring's generated source with and without ``dynamic_stage`` (same config otherwise)."""
    kv_format, q_format = MODES[mode.split("-")[0]]
    pair = []
    for dyn in (False, True):
        cfg = schedule.ws_config(H200, kv_format=kv_format, q_format=q_format, dynamic_stage=dyn,
                                 **DYN_RINGS[mode], **kwargs)
        artifact = jit.lower(cfg, H200)
        pair.append((cfg, artifact.kernel_source, jit.lowered_lds_bytes(artifact)))
    return pair


@pytest.fixture(scope="module", params=[("fp8", {}), ("a8w8", dict(causal=True, page_size=64)), ("mxfp4-2dec", {})],
                ids=["fp8", "a8w8-causal-page64", "mxfp4-2dec"])
def dyn_pair(request):
    mode, kwargs = request.param
    return lowered_pair(mode, **kwargs)


def copier_destinations(src):
    """The copier's cp.async destinations (shared element offsets from the ring buffer's base), in source order:
    one Python function of (threadIdx.x, stage s, the unrolled chunk c) per cp.async, and each loop's trip count."""
    producers = producer_code(src[src.index("__global__"):])
    out = []
    for m in re.finditer(r"tl::cp_async_gs_conditional<16>\(\(&\(\(\(fp8_e4_t\*\)\w+\)\[(.*?)\]\)\), \(&\(KV", producers):
        loop = list(re.finditer(r"for \(int (c(?:_\d+)?) = 0; \1 < (\d+); \+\+\1\)", producers[: m.start()]))[-1]
        var, trips = loop.group(1), int(loop.group(2))
        expr = m.group(1).replace("((int)threadIdx.x)", "tx")
        expr = re.sub(rf"\b{var}\b", "c", re.sub(r"\((tile|t)(_\d+)? & 1\)", "s", expr))
        out.append((trips, eval(f"lambda tx, s, c: {expr}")))  # noqa: S307 (the generated code, parenthesised)
    return out


def test_dynamic_stage_runs_each_roles_tile_step_once(dyn_pair):
    """With ``dynamic_stage`` the MMA warp group's score and P V wgmma, the transposer and the copier (or the
    two-decoder ring's decode) appear once instead of once per stage, the wgmma descriptors take the stage's byte
    offset at run time (latent codes 32 KiB, rope 4 KiB, V^T 32 KiB), and the shared memory is the same."""
    (cfg, src, lds), (dcfg, dsrc, dlds) = dyn_pair
    assert dcfg.name == cfg.name + "_dyn" and dcfg.shared_bytes == cfg.shared_bytes and dlds == lds
    body, dbody = src[src.index("__global__"):], dsrc[dsrc.index("__global__"):]
    consumer = body[: body.index("warpgroup_reg_dealloc")]
    dconsumer = dbody[: dbody.index("warpgroup_reg_dealloc")]
    wgmma = "tl::wgmma_ss<"
    assert consumer.count(wgmma) == cfg.num_stages * dconsumer.count(wgmma) and dconsumer.count(wgmma) > 0
    for stage_bytes in (32768, 4096):  # (the V^T stage is 32 KiB too)
        assert re.search(rf"increase_descriptor_offset<int>\(desc_a(_\d+)?, \(\(t & 1\) \* {stage_bytes}\)\)",
                         dconsumer), f"no descriptor offset of {stage_bytes} B per stage"
    assert "increase_descriptor_offset" not in consumer, "the named-buffer ring has no run-time stage"
    assert producer_code(body).count("mla_transpose_v_fp8(") == cfg.num_stages
    assert producer_code(dbody).count("mla_transpose_v_fp8(") == 1
    assert re.search(r"mla_transpose_v_fp8\(\(v_\d+\[0\] \+ \(\(uint\)\(\(t_\d+ & 1\) \* 32768\)\)\), "
                     r"\(v_\d+\[1\] \+ \(\(uint\)\(\(t_\d+ & 1\) \* 32768\)\)\)", dbody), "transposer's stage offsets"
    if cfg.mx_mma:  # the decoder groups' store code is one copy either way; their stage's base moves by 32 / 4 KiB
        assert dbody.count("mla_mx_block_to_e4m3(") == body.count("mla_mx_block_to_e4m3(") == MX_BLOCKS
        assert "* (uint)32768)" in dbody and "* (uint)4096)" in dbody
    else:  # the copier: two cp.async loops (latent, rope) per stage, or two in all
        assert len(copier_destinations(src)) == 2 * cfg.num_stages and len(copier_destinations(dsrc)) == 2


def test_dynamic_stage_copier_writes_where_the_named_stages_lie():
    """Every copier thread's cp.async destination in stage s of the one ring buffer is its destination in the named
    stage-0 buffer plus s stages (latent 32 KiB, rope 4 KiB of fp8 codes): TileLang's swizzle of the side-by-side
    buffer puts each stage exactly where the transposer and the wgmma descriptors' offsets expect it."""
    (cfg, src, _), (_, dsrc, _) = lowered_pair("a8w8")
    static, dyn = copier_destinations(src), copier_destinations(dsrc)
    for (trips, named), (dtrips, one), stage_bytes in zip(static[:2], dyn, (32768, 4096)):
        assert trips == dtrips
        for tx in range(128, 256):
            for c in range(trips):
                for s in range(cfg.num_stages):
                    assert one(tx, s, c) == named(tx, 0, c) + s * stage_bytes, (tx, c, s)
    # and the named buffers' stage 1 is laid out as stage 0 (each stage its own buffer)
    for (trips, stage0), (_, stage1) in zip(static[:2], static[2:4]):
        assert all(stage0(tx, 0, c) == stage1(tx, 0, c) for tx in range(128, 256) for c in range(trips))


@pytest.mark.parametrize("bad,why", [(dict(fp8_mma=False), "dynamic_stage is fp8_mma's"),
                                     (dict(fp8_mma=True, score_ahead=True), "not score_ahead")],
                         ids=["decoder-ring", "score-ahead"])
def test_dynamic_stage_is_the_serial_fp8_mma_rings(bad, why):
    with pytest.raises(ValueError, match=why):
        WSDecodeKernelConfig(kv_format="fp8", q_format="fp8", dynamic_stage=True, **bad)
    with pytest.raises(ValueError, match="mx_decoders == num_stages"):
        WSDecodeKernelConfig(kv_format="mxfp4", fp8_mma=True, fast_softmax=True, dynamic_stage=True)


# ---- the V^T ring's depth apart from the codes' (``vt_stages``) ---------------------------------------------------

@pytest.mark.parametrize("mode,stages", [("fp8", 3), ("a8w8", 4)])
def test_vt_stages_walk_the_v_ring_by_slot(mode, stages):
    """A deeper codes ring beside two V^T stages fits one CTA per SM (fp8 with bf16 Q: three codes stages; a8w8:
    four), and the generated code takes the codes' stage from the slot's round (t % stages) and the V^T stage
    apart from it: the transposer writes and P V reads V^T at that stage's 32 KiB offset, each V^T barrier indexed
    by it."""
    kv_format, q_format = MODES[mode]
    cfg = schedule.ws_config(H200, kv_format=kv_format, q_format=q_format, num_stages=stages, vt_stages=2,
                             dynamic_stage=True, **DYN_RINGS[mode])
    assert f"_st{stages}_" in cfg.name and cfg.name.endswith("_dyn_vt2") and cfg.vt_depth == 2
    artifact = jit.lower(cfg, H200)
    lds = jit.lowered_lds_bytes(artifact)
    assert lds <= cfg.shared_bytes <= H200.smem_bytes, (cfg.name, lds, cfg.shared_bytes)
    three_vt = dataclasses.replace(cfg, vt_stages=0)
    assert three_vt.shared_bytes - cfg.shared_bytes == (stages - 2) * 32768
    body = artifact.kernel_source[artifact.kernel_source.index("__global__"):]
    consumer, producers = body[: body.index("warpgroup_reg_dealloc")], producer_code(body)
    codes = rf"\(t(?:_\d+)? (?:% {stages}|& {stages - 1})\)"  # t % stages (a power of two: t & (stages - 1))
    assert re.search(rf"increase_descriptor_offset<int>\(desc_a, \({codes} \* 32768\)\)", consumer)
    pv = re.search(r"increase_descriptor_offset<int>\(desc_a_\d+, \((vt_s|v_\d+|\(t & 1\)) \* 32768\)\)", consumer)
    assert pv, "P V's V^T descriptor not at the V^T stage's offset (slot G % 2)"
    transpose = re.search(rf"mla_transpose_v_fp8\(\(v_\d+\[0\] \+ \(\(uint\)\({codes} \* 32768\)\)\), "
                          r"\(v_\d+\[1\] \+ \(\(uint\)\((.+?) \* 32768\)\)\), \(\(\(int\)threadIdx", producers)
    assert transpose, "the transposer's codes stage (t % stages) and V^T stage (slot G % 2)"
    vt_index = transpose.group(1)  # the slot's V^T stage: G % 2 (G = pass x slots per pass + t)
    assert not re.fullmatch(codes, vt_index) and ("& 1" in vt_index or "% 2" in vt_index), vt_index
    assert f"[((int64_t){vt_index})].wait(" in producers or f"[{vt_index}].wait(" in producers, (
        "the V^T barriers indexed by the V^T stage")


@pytest.mark.parametrize("bad,why", [(dict(dynamic_stage=False), "vt_stages is dynamic_stage's"),
                                     (dict(vt_stages=1), "2 .. num_stages"), (dict(vt_stages=4), "2 .. num_stages")],
                         ids=["no-dynamic-stage", "one", "deeper-than-the-codes"])
def test_vt_stages_refusals(bad, why):
    fields = dict(kv_format="fp8", q_format="fp8", fp8_mma=True, dynamic_stage=True, num_stages=3, vt_stages=2)
    with pytest.raises(ValueError, match=why):
        WSDecodeKernelConfig(**{**fields, **bad})
    with pytest.raises(ValueError, match="vt_stages is dynamic_stage's with an fp8 cache"):
        WSDecodeKernelConfig(kv_format="mxfp4", fp8_mma=True, fast_softmax=True, mx_decoders=2, dynamic_stage=True,
                             vt_stages=2)


def test_watchdog_prebuild_builds_what_the_op_selects():
    """tests/test_ws_gpu.py compiles each watchdog ring's kernels before its watchdog starts (``prebuild_rings``):
    those configs must be the ones the op then selects for the same overrides, or the child would compile inside
    the watchdog after all."""
    import test_ws_gpu

    rings = list(test_ws_gpu.F8MMA)
    built = iter(test_ws_gpu.watchdog_configs(H200, rings))
    for ring in rings:
        kv_format, q_format = MODES[ring.split("-")[0]]
        for causal, page_size in test_ws_gpu.WATCHDOG_LAYOUTS:
            selected, _, _ = schedule.select_kernels(H200, kv_format=kv_format, q_format=q_format, num_heads=16,
                                                     causal=causal, page_size=page_size, batch=4, total_q=4,
                                                     total_kv=4000, **test_ws_gpu.F8MMA[ring])
            expected = next(built)
            assert selected == expected, (ring, causal, page_size, selected.name, expected.name)


# ---- persistent CTAs (``persistent_ctas``) -----------------------------------------------------------------------

@pytest.mark.parametrize("mode,kwargs", [("fp8", {}), ("a8w8", dict(causal=True, page_size=64))],
                         ids=["fp8", "a8w8-causal-page64"])
def test_persistent_ctas_walk_their_items_with_one_ring(mode, kwargs):
    """With ``persistent_ctas`` the launch's grid is min(splits x sequences x head groups, persistent_ctas) CTAs of
    one dimension; each of the three roles (MMA warp group, copier, transposer) walks the CTA's items in one loop,
    derives the item's sequence and split from blockIdx.x + i x grid inside it, and carries one ring parity base
    across items: every barrier wait's parity adds that base, and each role adds its item's passes x rounds to it
    after the item. The shared memory is the one-item ring's."""
    kv_format, q_format = MODES[mode]
    ring = dict(dynamic_stage=True, **DYN_RINGS[mode], **kwargs)
    cfg = schedule.ws_config(H200, kv_format=kv_format, q_format=q_format, persistent_ctas=132, **ring)
    plain = schedule.ws_config(H200, kv_format=kv_format, q_format=q_format, **ring)
    assert cfg.name == plain.name + "_pc132" and cfg.shared_bytes == plain.shared_bytes
    artifact = jit.lower(cfg, H200)
    launch = re.search(r'T.call_packed\("mla_decode_ws(_paged)?_kernel", .*\)', artifact.host_mod.script()).group(0)
    assert launch.endswith("T.min(num_splits * (indptr_len - 1), 132), 384, 1, 1, %d)" % jit.lowered_lds_bytes(
        artifact)), launch
    src = artifact.kernel_source
    body = src[src.index("__global__"):]
    assert "blockIdx.y" not in body and "blockIdx.z" not in body
    bases = re.findall(r"\b(v_\d+) = \(\1 \+ \(v_\d+ \* v_\d+\)\);", body)
    assert len(bases) == 3 and len(set(bases)) == 1, f"one ring base, advanced once per item by each role: {bases}"
    base = bases[0]
    assert re.search(rf"int {base} = 0;", body), "the ring base starts at 0 once per CTA"
    roles = {"consumer": body[: body.index("warpgroup_reg_dealloc")], "producers": producer_code(body)}
    for role, code in roles.items():
        items = re.findall(r"for \(int (i(?:_\d+)?) = 0; \1 < v_\d+; \+\+\1\) \{\n\s+int rmod_\d+ = \(\(\(\(int\)"
                           r"blockIdx\.x\) \+ \(\1 \* min\(", code)
        assert len(items) == (1 if role == "consumer" else 2), f"{role}: one item loop per role ({items})"
        # a wait's parity, or the slot's parity variable that the waits take
        parities = re.findall(r"\.wait\(([^;]*)\);|int parity(?:_\d+)? = ([^;]*);", code)
        with_base = [p for p in parities if base in "".join(p)]
        assert len(with_base) == (1 if role == "consumer" else 2), f"{role}: parities with the ring base {parities}"
    plain_src = jit.lower(plain, H200).kernel_source
    assert "blockIdx.y" in plain_src and not re.search(r"\b(v_\d+) = \(\1 \+ \(v_\d+ \* v_\d+\)\);", plain_src)


@pytest.mark.parametrize("fields,why", [
    (dict(kv_format="fp8", fp8_mma=True, persistent_ctas=132), "persistent_ctas is dynamic_stage's"),
    (dict(kv_format="fp8", persistent_ctas=132), "persistent_ctas is dynamic_stage's with an fp8 cache \\(fp8_mma\\)"),
    (dict(kv_format="fp8", fp8_mma=True, dynamic_stage=True, num_stages=3, vt_stages=2, persistent_ctas=132),
     "no vt_stages"),
    (dict(kv_format="mxfp4", fp8_mma=True, fast_softmax=True, mx_decoders=2, dynamic_stage=True, persistent_ctas=132),
     "no mxfp4 decoders"),
    (dict(kv_format="fp8", fp8_mma=True, dynamic_stage=True, persistent_ctas=-1), "persistent_ctas must be >= 0"),
], ids=["no-dynamic-stage", "decoder-ring", "vt-stages", "mxfp4", "negative"])
def test_persistent_ctas_refusals(fields, why):
    with pytest.raises(ValueError, match=why):
        WSDecodeKernelConfig(**{"q_format": "bf16" if fields["kv_format"] == "mxfp4" else "fp8", **fields})


# ---- Q's shared rows in a loop (``q_loop_rows``) -------------------------------------------------------------------

@pytest.mark.parametrize("mode", ["fp8", "a8w8"])
def test_q_loop_rows_writes_q_in_a_loop_of_row_steps(mode):
    """With ``q_loop_rows`` = 2 the MMA warp group writes Q's shared rows (bf16 Q's two e4m3 terms, or a8w8's codes)
    in a loop of 16 / 2 steps (a loop nvcc keeps: its once-per-pass code before the first wgmma shrinks), the shared
    memory is the same."""
    kv_format, q_format = MODES[mode]
    ring = dict(dynamic_stage=True, **DYN_RINGS[mode])
    block = schedule.ws_config(H200, kv_format=kv_format, q_format=q_format, **ring)
    looped = dataclasses.replace(block, q_loop_rows=2)
    assert looped.name == block.name + "_ql2" and looped.shared_bytes == block.shared_bytes
    srcs = [jit.lower(cfg, H200).kernel_source for cfg in (block, looped)]
    prologues = []
    for src in srcs:
        body = src[src.index("__global__"):]
        consumer = body[: body.index("warpgroup_reg_dealloc")]
        prologues.append(consumer[: consumer.index("tl::wgmma_ss<")])
    assert re.search(r"for \(int rb = 0; rb < 8; \+\+rb\) \{", prologues[1]), "no loop of 8 row steps"
    assert "rb" not in prologues[0]
    # (the cubin of fp8's one-copy ring: 109.5 KB in one block, 91.1 KB in steps of two rows; ptxas, CPU box)


@pytest.mark.parametrize("rows", [3, 32])
def test_q_loop_rows_must_divide_the_rows(rows):
    with pytest.raises(ValueError, match="q_loop_rows is fp8_mma's, a divisor"):
        WSDecodeKernelConfig(kv_format="fp8", q_format="fp8", fp8_mma=True, q_loop_rows=rows)
    with pytest.raises(ValueError, match="q_loop_rows is fp8_mma's"):
        WSDecodeKernelConfig(kv_format="fp8", q_format="fp8", q_loop_rows=2)
