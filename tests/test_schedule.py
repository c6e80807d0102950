"""Scheduling is a pure function of host-known sizes: test its contract on the CPU."""

import dataclasses

import pytest

from mla import schedule
from mla.target import spec_for_name

H200 = spec_for_name("sm_90a", num_sms=132)


def splits(batch, kv_len, **kw):
    cfg = schedule.decode_config(H200, kv_format=kw.pop("kv_format", "bf16"))
    return schedule.choose_num_splits(
        batch=batch, total_kv=batch * kv_len, num_sms=132, ctas_per_sm=schedule.ctas_per_sm(H200, cfg), block_n=cfg.block_n, **kw
    )


@pytest.mark.parametrize("batch,kv_len", [(b, kv) for b in (1, 4, 32, 64, 256, 1024) for kv in (1, 64, 1024, 8192, 32768)])
def test_split_count_is_bounded_and_useful(batch, kv_len):
    n = splits(batch, kv_len)
    assert 1 <= n <= schedule.MAX_SPLITS
    assert n <= max(1, -(-kv_len // 64)), "never more splits than KV tiles"


def test_small_batches_split_to_fill_the_gpu_and_large_ones_do_not():
    assert splits(4, 8192) >= 16, "4 sequences must spread over many SMs"
    assert splits(256, 8192) == 1, "256 sequences already fill 132 SMs: no combine kernel"
    assert splits(4, 8192) > splits(64, 8192) >= splits(256, 8192)


def test_degenerate_sizes():
    assert schedule.choose_num_splits(batch=0, total_kv=0, num_sms=132, ctas_per_sm=2, block_n=64) == 1
    assert schedule.choose_num_splits(batch=5, total_kv=0, num_sms=132, ctas_per_sm=2, block_n=64) == 1


def test_configs_fit_the_target_memory():
    for spec in (H200, spec_for_name("gfx942")):
        for cfg in schedule.kernel_variants(spec):
            if hasattr(cfg, "shared_bytes"):
                assert cfg.shared_bytes <= spec.smem_bytes, f"{cfg.name} needs {cfg.shared_bytes} B on {spec.name}"


def test_variant_names_are_unique():
    names = [cfg.name for cfg in schedule.kernel_variants(H200)]
    assert len(names) == len(set(names))


def test_op_layer_dims_match_the_kernels():
    """mla.constants (TileLang-free, for mla.ops) and the kernel layer (tl_kernels.steps) must agree on every
    shape."""
    from mla import constants
    from tl_kernels import steps

    assert (constants.KV_LORA_RANK, constants.ROPE_DIM, constants.QK_DIM) == (
        steps.KV_LORA_RANK,
        steps.ROPE_DIM,
        steps.QK_DIM,
    )
    assert {q for _, q in constants.MODES.values()} <= set(steps.Q_FORMATS)
    assert {kv for kv, _ in constants.MODES.values()} == set(steps.KV_FORMATS)


# --- the fused split merge (one cooperative launch; Hopper) ---------------------------------------------------------


def select(spec, batch, kv_len, *, kv_format="bf16", num_heads=16, q_len=1, **kw):
    return schedule.select_kernels(spec, kv_format=kv_format, q_format="bf16", num_heads=num_heads, causal=False,
                                   page_size=0, batch=batch, total_q=batch * q_len, total_kv=batch * kv_len, **kw)


def grid(cfg, batch, num_splits):
    return batch * (cfg.num_heads // cfg.block_h) * num_splits


@pytest.mark.parametrize("kv_format", ["bf16", "fp8", "mxfp4"])
@pytest.mark.parametrize("batch,kv_len,num_heads,q_len", [(1, 1024, 16, 1), (4, 1024, 16, 1), (4, 8192, 16, 1),
                                                          (8, 1024, 128, 1), (2, 4096, 16, 4)])
def test_small_split_grids_merge_inside_the_decode_kernel(kv_format, batch, kv_len, num_heads, q_len):
    """Where the split grid fits the GPU at once (at most one CTA per SM), Hopper runs one launch: the decode
    kernel merges its splits after a grid barrier, no combine kernel."""
    cfg, combine, num_splits = select(H200, batch, kv_len, kv_format=kv_format, num_heads=num_heads, q_len=q_len)
    assert num_splits > 1 and cfg.fused_combine and combine is None
    assert grid(cfg, batch, num_splits) <= H200.num_sms


@pytest.mark.parametrize("batch,kv_len", [(32, 1024), (64, 8192), (16, 1024)])
def test_large_split_grids_keep_the_combine_kernel(batch, kv_len):
    cfg, combine, num_splits = select(H200, batch, kv_len)
    assert num_splits > 1 and grid(cfg, batch, num_splits) > H200.num_sms
    assert not cfg.fused_combine and combine is not None


def test_one_split_runs_the_direct_kernel():
    cfg, combine, num_splits = select(H200, 256, 8192)
    assert num_splits == 1 and not cfg.split and combine is None


def test_gfx942_never_fuses_the_merge():
    gfx942 = spec_for_name("gfx942")
    cfg, combine, num_splits = select(gfx942, 4, 1024)
    assert num_splits > 1 and not cfg.fused_combine and combine is not None
    assert not any(getattr(c, "fused_combine", False) for c in schedule.kernel_variants(gfx942))
    assert any(getattr(c, "fused_combine", False) for c in schedule.kernel_variants(H200))


def test_a_forced_fused_merge_splits_within_the_gpu_and_refuses_what_cannot_fit():
    cfg, _, num_splits = select(H200, 8, 8192, fused_combine=True)
    assert cfg.fused_combine and 1 < num_splits and grid(cfg, 8, num_splits) <= H200.num_sms
    with pytest.raises(ValueError, match="fused_combine.*132 CTAs"):
        select(H200, 10, 1024, num_splits=14, fused_combine=True)
    with pytest.raises(ValueError, match="fused_combine"):
        select(H200, 200, 1024, fused_combine=True)  # more sequences than SMs: not even one split fits
    cfg, combine, _ = select(H200, 4, 1024, fused_combine=False)  # the two-kernel form, forced
    assert not cfg.fused_combine and combine is not None


def test_only_the_one_launch_paged_kernel_has_a_flashmla_shaped_form():
    """``flash_io_variant``: the block-level paged kernel with the merge fused gets FlashMLA's argument shapes (the
    call where host time shows); flat caches, the two-kernel form, gfx942's wave program and the other families
    keep the package's shapes; flash_io without a paged fused kernel is refused."""
    paged_fused = schedule.decode_config(H200, kv_format="bf16", page_size=64, fused_combine=True)
    flash = schedule.flash_io_variant(paged_fused)
    assert flash.flash_io and flash.name != paged_fused.name and flash == dataclasses.replace(paged_fused, flash_io=True)
    assert schedule.flash_io_variant(schedule.decode_config(H200, kv_format="bf16", fused_combine=True)) is None
    assert schedule.flash_io_variant(schedule.decode_config(H200, kv_format="bf16", page_size=64)) is None
    gfx942 = spec_for_name("gfx942")
    assert all(schedule.flash_io_variant(c) is None for c in schedule.kernel_variants(gfx942))
    ws = schedule.ws_config(H200, kv_format="bf16", q_format="bf16", num_heads=16, causal=False, page_size=64)
    assert schedule.flash_io_variant(ws) is None
    with pytest.raises(ValueError, match="flash_io"):
        dataclasses.replace(schedule.decode_config(H200, kv_format="bf16", page_size=64), flash_io=True)


# ---- fast_decode: the block-level kernel's compressed tiles by bit placement ------------------------------------------


@pytest.mark.parametrize("kv_format", ["fp8", "mxfp4"])
@pytest.mark.parametrize("q_tile", [1, 2, 4])
def test_flat_compressed_caches_decode_whole_chunks_on_cuda(kv_format, q_tile):
    cfg = schedule.decode_config(H200, kv_format=kv_format, q_tile=q_tile)
    assert cfg.fast_decode, f"{cfg.name}: a flat {kv_format} cache should take the bit-placement decode"


def test_fast_decode_only_where_it_has_a_form():
    assert not schedule.decode_config(H200, kv_format="bf16").fast_decode, "bf16 has nothing to decode"
    paged = schedule.decode_config(H200, kv_format="fp8", page_size=64)
    assert paged.stage_compressed and not paged.fast_decode, "a paged cache stages its rows (one element at a time)"
    assert not schedule.decode_config(spec_for_name("gfx942"), kv_format="mxfp4").fast_decode, "gfx942: dim_split"
    # a tuning override that stages the tile turns it off rather than failing
    assert not schedule.decode_config(H200, kv_format="mxfp4", stage_compressed=True).fast_decode
    assert not schedule.decode_config(H200, kv_format="mxfp4", fast_decode=False).fast_decode


@pytest.mark.parametrize("fields, message", [
    (dict(kv_format="bf16"), "fp8 / mxfp4"),
    (dict(kv_format="fp8", stage_compressed=True), "fp8 / mxfp4"),
    (dict(kv_format="fp8", block_n=32, threads=256), "divide"),
])
def test_fast_decode_refuses_configs_without_a_form(fields, message):
    from tl_kernels.mla_decode import DecodeKernelConfig

    with pytest.raises(ValueError, match=message):
        DecodeKernelConfig(fast_decode=True, **fields)


@pytest.mark.parametrize("block_n, threads", [(64, 128), (32, 128), (64, 256)])
def test_fast_decode_chunks_cover_every_element_of_the_tile_once(block_n, threads):
    """Each thread's chunks (``_fast_chunk_place``) tile the block_n x 576 tile exactly, 16 dims each, and a warp's
    latent chunks are one row's contiguous 512 dims (one coalesced 512-byte fp8 read)."""
    from types import SimpleNamespace

    from tl_kernels.mla_decode import LATENT_CHUNKS, ROPE_CHUNKS, _fast_chunk_place

    c = SimpleNamespace(block_n=block_n, threads=threads, fast_latent_chunks=block_n * LATENT_CHUNKS // threads)
    per_thread = block_n * (LATENT_CHUNKS + ROPE_CHUNKS) // threads
    seen = {}
    for tx in range(threads):
        for j in range(per_thread):
            row, dim = _fast_chunk_place(c, tx, j)
            assert 0 <= row < block_n and dim % 16 == 0 and 0 <= dim < 576
            assert (row, dim) not in seen, f"chunk {(row, dim)} of two threads: {seen[(row, dim)]} and {(tx, j)}"
            seen[(row, dim)] = (tx, j)
    assert len(seen) == block_n * 36
    for j in range(block_n * LATENT_CHUNKS // threads):
        rows = {_fast_chunk_place(c, tx, j)[0] for tx in range(32)}
        dims = sorted(_fast_chunk_place(c, tx, j)[1] for tx in range(32))
        assert len(rows) == 1 and dims == list(range(0, 512, 16))
