"""Every kernel variant the op dispatches lowers and compiles for Hopper (sm_90a) with the local nvcc.

Only running a kernel needs a GPU, so this runs in CI on the CPU box and catches TileLang/codegen breakage early.
"""

import os
import shutil

import pytest

from mla import jit, schedule
from mla.target import spec_for_name
from tl_kernels.mla_decode import DecodeKernelConfig

H200 = spec_for_name("sm_90a")
VARIANTS = schedule.kernel_variants(H200) + [
    # MTP / causal class: 2 query tokens per CTA pass.
    schedule.decode_config(H200, kv_format="bf16", q_tile=2, causal=True),
    # Paged cache (16 tokens per page), compressed format.
    schedule.decode_config(H200, kv_format="mxfp4", page_size=16),
    # The fused split merge (one launch per call; kernel_variants has the flat 16-head ones), paged with MTP.
    schedule.decode_config(H200, kv_format="bf16", q_tile=2, causal=True, page_size=64, fused_combine=True),
    # ... and in FlashMLA's argument shapes (mla.flash_mla's one-launch calls), a8w8 (amax reduced inside).
    schedule.flash_io_variant(schedule.decode_config(H200, kv_format="fp8", q_format="fp8", page_size=64,
                                                     fused_combine=True)),
]


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not on PATH: cannot compile CUDA here")
@pytest.mark.parametrize("cfg", VARIANTS, ids=[cfg.name for cfg in VARIANTS])
def test_variant_compiles_for_sm90a(cfg):
    kernel = jit.get_kernel(cfg, H200)
    source = kernel.get_kernel_source()
    assert "__global__" in source
    if hasattr(cfg, "kv_format"):
        # The GEMMs run on tensor cores (16 rows: mma.sync; wgmma needs 64).
        assert "mma" in source, f"{cfg.name}: no tensor-core MMA in the generated CUDA"
        if cfg.kv_format != "bf16":
            # Compressed KV is read as is: the kernel's KV argument has the compressed element type.
            kv_type = "fp8_e4_t" if cfg.kv_format == "fp8" else "uchar"
            assert f"{kv_type}* __restrict__ KV" in source, f"{cfg.name}: KV is not read in its compressed form"
            if getattr(cfg, "fast_decode", False):
                # whole 16-code chunks decoded by bit placement (tl_kernels/dequant.py), not element by element
                decoder = "mla_fp8x16_to_bf16(" if cfg.kv_format == "fp8" else "mla_e2m1x16_to_bf16("
                assert decoder in source and "mla_ld_global_" in source, f"{cfg.name}: no chunk decode"


FUSED_VARIANTS = [cfg for cfg in VARIANTS if isinstance(cfg, DecodeKernelConfig) and cfg.fused_combine]


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not on PATH: cannot compile CUDA here")
@pytest.mark.parametrize("cfg", FUSED_VARIANTS, ids=[cfg.name for cfg in FUSED_VARIANTS])
def test_fused_merge_reads_whole_chunks_unguarded(cfg):
    """The fused merge reads the other CTAs' partials as 16-byte chunks (``mla_merge_load4``), and no bounds branch
    of TileLang's sits around them (a branch per load serialised the loads: docs/perf.md, runs 17-18)."""
    source = jit.get_kernel(cfg, H200).get_kernel_source()
    lines = [line.strip() for line in source.splitlines()]
    calls = [i for i, line in enumerate(lines) if line.startswith("mla_merge_load4(")]
    assert calls, f"{cfg.name}: the merge does not read 16-byte chunks"
    for i in calls:
        assert not lines[i - 1].startswith("if ("), f"{cfg.name}: a guard around a merge load: {lines[i - 1]}"
    assert "mla_merge_store4(" in source, f"{cfg.name}: the merge does not write whole chunks"


@pytest.mark.parametrize("cfg", FUSED_VARIANTS[:1], ids=[cfg.name for cfg in FUSED_VARIANTS[:1]])
def test_fused_merge_waits_at_a_grid_barrier_under_a_cooperative_launch(cfg):
    """The CTAs of a (sequence, head group) merge each other's partials after a grid-wide barrier: the barrier is
    in the kernel, and the kernel carries the attribute that makes its launch cooperative (every CTA resident, or
    the launch fails; a plain launch of a grid larger than the GPU would hang at the barrier)."""
    artifact = jit.lower(cfg, H200)
    assert "this_grid().sync()" in artifact.kernel_source
    attrs = [func.attrs for func in artifact.device_mod.functions.values() if func.attrs is not None]
    assert any(int(a.get("use_cooperative_groups", 0)) == 1 for a in attrs), "the launch would not be cooperative"


# The warp-specialised kernel's wgmma must stay asynchronous: ptxas silently serialises every wgmma of a kernel
# (a wait after each one) when a non-wgmma instruction reads or defines an accumulator while a group is in flight,
# e.g. where two paths merge with a group in flight (docs/perf.md runs 25-26: 200 serialised wgmma made the
# pipelined consumer 1.6x slower). It says so only in its verbose notes (C7514 / C7515).
WGMMA_VARIANTS = [
    schedule.ws_config(H200, kv_format="fp8"),  # the default (with its L2 prefetch)
    schedule.ws_config(H200, kv_format="fp8", overlap=True),  # the pipelined MMA warp group
    # fp8_mma one score ahead (S(t + 1) in flight during the softmax of t; a first build had a group in flight
    # across the loop's back edge: C7514)
    schedule.ws_config(H200, kv_format="fp8", q_format="fp8", fp8_mma=True, p_split=True, score_ahead=True),
    schedule.ws_config(H200, kv_format="fp8", fp8_mma=True, score_ahead=True),
]


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not on PATH: cannot compile CUDA here")
@pytest.mark.parametrize("cfg", WGMMA_VARIANTS, ids=[cfg.name for cfg in WGMMA_VARIANTS])
def test_ptxas_keeps_the_wgmma_asynchronous(cfg, tmp_path):
    import subprocess

    import tilelang

    tl_dir = os.path.dirname(tilelang.__file__)
    cu = tmp_path / "kernel.cu"
    cu.write_text(jit.lower(cfg, H200).kernel_source)
    # TileLang's own nvcc flags for sm_90a (tilelang's CUDA backend), plus ptxas' notes.
    result = subprocess.run(
        ["nvcc", "--cubin", "-O3", "-arch=sm_90a", "-std=c++20", f"-I{tl_dir}/src",
         f"-I{tl_dir}/3rdparty/cutlass/include", "--ptxas-options=--verbose", "-o", str(tmp_path / "kernel.cubin"),
         str(cu)], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    notes = [line for line in (result.stdout + result.stderr).splitlines() if "C7514" in line or "C7515" in line]
    assert not notes, f"{cfg.name}: ptxas serialises the wgmma: {notes}"
