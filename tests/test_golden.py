"""The golden check of the generated code (tools/golden.py) in CI: the default problem class's kernels, sm_90a CUDA
and gfx942 HIP, must generate the source whose hash tests/golden/sources.json records.

A kernel change that changes no behaviour (a refactor) leaves every hash unchanged; one that is meant to change the
generated code records the new hashes in the same commit (``python tools/golden.py --update``, about 15 minutes on
two cores), and its message says which variants changed and why. The whole grid (191 variants: every family, mode,
split form, page size and head class) is checked by ``python tools/golden.py``; CI checks the default class, whose
kernels the other CPU tests build anyway (tests/test_compile.py compiles the sm_90a ones, tests/test_gfx942.py lowers
the gfx942 ones; ``mla.jit`` caches both per process, so this module adds no build when it runs after them).
"""

import json
import pathlib
import sys

import pytest

from mla import jit
from mla.target import spec_for_name

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
import golden  # noqa: E402

RECORDED = json.loads(golden.GOLDEN_FILE.read_text())["sources"]
DEFAULT = [(target, cfg) for target in golden.TARGETS for cfg in golden.golden_variants(target, only="default")]


def test_the_record_covers_the_grid():
    """Every variant of the golden grid has a recorded hash, and nothing recorded is outside the grid (a variant
    added to or dropped from the grid updates the record)."""
    grid = {f"{t}/{golden.variant_name(v)}" for t in golden.TARGETS for v in golden.golden_variants(t)}
    assert sorted(grid - set(RECORDED)) == [], "variants with no recorded hash: run tools/golden.py --update"
    assert sorted(set(RECORDED) - grid) == [], "recorded variants the grid no longer has"


@pytest.mark.parametrize("target,cfg", DEFAULT, ids=[f"{t}-{c.name}" for t, c in DEFAULT])
def test_default_class_generates_the_recorded_source(target, cfg):
    spec = spec_for_name(target)
    # sm_90a: the compiled kernel's source (tests/test_compile.py builds the same kernels in this process); gfx942:
    # the lowered source (no ROCm here). Both are the source TileLang generates; golden.source_hash forgives only
    # the shared-memory planner's run-to-run permutation of equal-sized buffers.
    source = jit.get_kernel(cfg, spec).get_kernel_source() if target == "sm_90a" else jit.lower(cfg, spec).kernel_source
    key = f"{target}/{cfg.name}"
    assert golden.source_hash(source) == RECORDED[key], (
        f"{key}: the generated source changed. If that is intended, record it (python tools/golden.py --update) "
        "and say why in the commit; if not, the change altered a kernel it should not have")


def test_normalization_forgives_only_a_permutation_of_shared_buffers():
    """Two shared-memory buffers swapped (what TileLang's planner does between runs) hash the same; a changed
    offset, a changed instruction or a renamed use does not."""
    base = ("  void* v_1 = ((void*)((char*)buf_dyn_shmem + 0));\n  void* v_2 = ((void*)((char*)buf_dyn_shmem + 2048));\n"
            "  f((bfloat16_t*)v_1); g((bfloat16_t*)v_2);\n")
    swapped = base.replace("f((bfloat16_t*)v_1); g((bfloat16_t*)v_2)", "f((bfloat16_t*)v_2); g((bfloat16_t*)v_1)")
    assert golden.source_hash(swapped) == golden.source_hash(base)
    assert golden.source_hash(base.replace("+ 2048", "+ 4096")) != golden.source_hash(base)
    assert golden.source_hash(base.replace("g((", "h((")) != golden.source_hash(base)
    assert golden.source_hash(base.replace("g((bfloat16_t*)v_2)", "g((bfloat16_t*)v_1)")) != golden.source_hash(base)


def test_normalization_ignores_the_imported_device_functions():
    """The device functions imported before the kernel name their own parameters (``dst``, ``v``) like the shared
    pointers; those names must not decide the canonical order, or a swap of two buffers changes the hash (it did for
    the fp8_mma kernels)."""
    head = "__device__ void helper(void* dst, void* v_2) { use(dst); use(v_2); }\n"
    base = (head + "  void* dst = ((void*)((char*)buf_dyn_shmem + 0));\n"
            "  void* v_2 = ((void*)((char*)buf_dyn_shmem + 2048));\n  f((bfloat16_t*)v_2); g((bfloat16_t*)dst);\n")
    swapped = base.replace("f((bfloat16_t*)v_2); g((bfloat16_t*)dst)", "f((bfloat16_t*)dst); g((bfloat16_t*)v_2)")
    assert golden.source_hash(swapped) == golden.source_hash(base)
    assert "void* dst, void* v_2" in golden.normalized(base), "the imported functions are kept as written"
