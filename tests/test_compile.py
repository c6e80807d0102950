"""Every kernel variant the op dispatches lowers and compiles for Hopper (sm_90a) with the local nvcc.

Only running a kernel needs a GPU, so this runs in CI on the CPU box and catches TileLang/codegen breakage early.
"""

import shutil

import pytest

from mla import jit, schedule
from mla.target import spec_for_name

H200 = spec_for_name("sm_90a")
VARIANTS = schedule.kernel_variants(H200) + [
    # MTP / causal class: 2 query tokens per CTA pass.
    schedule.decode_config(H200, kv_format="bf16", q_tile=2, causal=True),
    # Paged cache (16 tokens per page), compressed format.
    schedule.decode_config(H200, kv_format="mxfp4", page_size=16),
    # The opt-in fused split merge (one launch per call), flat and paged.
    schedule.decode_config(H200, kv_format="fp8", fused_combine=True),
    schedule.decode_config(H200, kv_format="bf16", q_tile=2, causal=True, page_size=64, fused_combine=True),
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
