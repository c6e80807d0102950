"""MLA decode (DeepSeek absorbed form) as a torch-callable op: the public names in one place. The call reads as
validate (``mla.validate``) -> plan (``mla.plan``, for many calls over one batch layout) -> launch (``mla.launch``,
which holds the eager call ``mla_decode``); the harness entry point is in ``mla.harness``, FlashMLA's interface in
``mla.flash_mla``. Importing it also registers the torch.library ops (``mla.ops``).

Module graph (no cycle): ``mla.launch`` (the eager call) <- ``mla.plan`` <- ``mla.harness`` <- this module;
``mla.ops`` imports ``mla.launch`` only when an op runs (to register the ops without importing TileLang).

Example (H200)::

    import torch, mla.decode
    q = torch.randn(4, 16, 576, dtype=torch.bfloat16, device="cuda")             # 4 sequences, 1 query token each
    kv = torch.randn(4 * 1024, 1, 576, dtype=torch.bfloat16, device="cuda")      # 1024 cached tokens each
    qo_indptr = torch.arange(5, dtype=torch.int32, device="cuda")
    kv_indptr = torch.arange(5, dtype=torch.int32, device="cuda") * 1024
    out = mla.decode.mla_decode(q, kv, qo_indptr, kv_indptr)                    # (4, 16, 512) bf16
"""

from __future__ import annotations

from mla import jit, launch, ops  # noqa: F401 - ops: registers torch.ops.mla.decode / decode_out; jit: tests patch it
from mla.constants import DEFAULT_SM_SCALE
from mla.harness import CUSTOM_KERNEL_FORMAT, custom_kernel, harness_cache, page_size_of, run_harness
from mla.launch import clear_caches, mla_decode
from mla.plan import DecodePlan, plan
from mla.validate import SUPPORTED_HEADS, SUPPORTED_PAGE_SIZES, validate_index_values

__all__ = ["mla_decode", "plan", "DecodePlan", "custom_kernel", "run_harness", "harness_cache", "page_size_of",
           "validate_index_values", "clear_caches", "CUSTOM_KERNEL_FORMAT", "DEFAULT_SM_SCALE", "SUPPORTED_HEADS",
           "SUPPORTED_PAGE_SIZES"]
