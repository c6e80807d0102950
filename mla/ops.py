"""``mla.decode.mla_decode`` as PyTorch custom ops, for serving stacks: ``torch.compile(fullgraph=True)`` traces
through it (the ops are opaque nodes with fake implementations that give the output shapes without touching
data) and it can be captured in CUDA graphs (the op never syncs the host with the device).

Two ops in the ``mla`` namespace (a custom-op schema takes tensors, optional tensors, str, float, bool and int,
never dicts or arbitrary objects):

  torch.ops.mla.decode(q, kv_cache, qo_indptr, kv_indptr, kv_scale, kv_block_scale, q_scale, page_table,
                       kv_format, q_format, sm_scale, causal, num_splits) -> (out, lse)
      functional: returns fresh out (total_q, H, 512) bf16 and lse (total_q, H) float32.
  torch.ops.mla.decode_out(q, kv_cache, qo_indptr, kv_indptr, kv_scale, kv_block_scale, q_scale, page_table,
                           kv_format, q_format, sm_scale, causal, num_splits, out, lse) -> ()
      writes the caller's buffers in place (``mutates_args=("out", "lse")``; under torch.compile it is
      functionalized and re-inplaced).

  kv_scale, kv_block_scale, q_scale, page_table: ``Tensor?``; kv_format: ``str?`` (None: from the cache's
  dtype); q_format: "bf16" | "fp8"; sm_scale: ``float?`` (None: 1/sqrt(576)); num_splits: 0 = automatic.

Use the Python wrapper ``mla.ops.mla_decode``: the same keywords as ``mla.decode.mla_decode`` except
``config_overrides`` (a tuning-only dict) and ``check_inputs`` (a host-side check that syncs with the device,
which neither a traced graph nor a CUDA graph can hold: call ``mla.decode.validate_index_values`` eagerly
instead), returning ``out`` or ``(out, lse)``::

    import mla.ops
    decode = torch.compile(lambda q, kv, qo, kvp: mla.ops.mla_decode(q, kv, qo, kvp, causal=True), fullgraph=True)

Importing this module registers the ops without importing TileLang or touching CUDA (the kernels are built on
the first real call); importing it again (a reload, or a second copy on another import path) reuses the
registered ops.
"""

from typing import Optional

import torch

from mla.constants import DEFAULT_SM_SCALE, KV_LORA_RANK, QK_DIM

__all__ = ["mla_decode", "DEFAULT_SM_SCALE"]

NAMESPACE = "mla"

# Inductor hands the op its inputs with exactly the strides eager mode would have (the kernels need contiguous
# rows); this is torch's default for custom ops in recent releases, stated here so it holds on older ones too.
_TAGS = tuple(getattr(torch.Tag, t) for t in ("needs_exact_strides",) if hasattr(torch.Tag, t)) or tuple(
    getattr(torch.Tag, t) for t in ("needs_fixed_stride_order",) if hasattr(torch.Tag, t)
)


def _is_registered(name: str) -> bool:
    try:
        getattr(getattr(torch.ops, NAMESPACE), name)
    except (AttributeError, RuntimeError):
        return False
    return True


def _run(q, kv_cache, qo_indptr, kv_indptr, kv_scale, kv_block_scale, q_scale, page_table, kv_format, q_format,
         sm_scale, causal, num_splits, out=None, lse=None):
    """The real implementation: ``mla.launch.mla_decode`` (``mla.decode.mla_decode``) with ``num_splits`` 0 meaning
    automatic."""
    # Imported on the first real call, not at module level, only so that registering the ops loads no TileLang
    # (mla.launch imports the kernels); mla.launch never imports this module, so there is no cycle to break.
    from mla.launch import mla_decode as decode

    return decode(
        q,
        kv_cache,
        qo_indptr,
        kv_indptr,
        kv_scale=kv_scale,
        kv_block_scale=kv_block_scale,
        kv_format=kv_format,
        q_format=q_format,
        q_scale=q_scale,
        sm_scale=sm_scale,
        causal=causal,
        num_splits=None if num_splits == 0 else num_splits,
        out=out,
        lse=lse,
        page_table=page_table,
        return_lse=True,  # the op's schema always returns (out, lse)
    )


def _fake_check_q(q: torch.Tensor) -> None:
    torch._check(q.dim() == 3, lambda: f"q: expected (total_q, H, {QK_DIM}), got shape {tuple(q.shape)}")
    torch._check(q.shape[-1] == QK_DIM, lambda: f"q: expected last dim {QK_DIM}, got shape {tuple(q.shape)}")


def _fake_check_buffer(name: str, buf: torch.Tensor, shape: tuple, dtype: torch.dtype) -> None:
    torch._check(
        buf.dtype == dtype and buf.dim() == len(shape),
        lambda: f"{name}: expected a {dtype} tensor of shape {tuple(shape)}, got {buf.dtype} {tuple(buf.shape)}",
    )
    for got, want in zip(buf.shape, shape):
        torch._check(got == want, lambda: f"{name}: expected shape {tuple(shape)}, got {tuple(buf.shape)}")


def _register() -> None:
    if not _is_registered("decode"):

        @torch.library.custom_op(f"{NAMESPACE}::decode", mutates_args=(), tags=_TAGS)
        def decode(
            q: torch.Tensor,
            kv_cache: torch.Tensor,
            qo_indptr: torch.Tensor,
            kv_indptr: torch.Tensor,
            kv_scale: Optional[torch.Tensor],
            kv_block_scale: Optional[torch.Tensor],
            q_scale: Optional[torch.Tensor],
            page_table: Optional[torch.Tensor],
            kv_format: Optional[str],
            q_format: str,
            sm_scale: Optional[float],
            causal: bool,
            num_splits: int,
        ) -> tuple[torch.Tensor, torch.Tensor]:
            out, lse = _run(q, kv_cache, qo_indptr, kv_indptr, kv_scale, kv_block_scale, q_scale, page_table,
                            kv_format, q_format, sm_scale, causal, num_splits)
            return out, lse

        @decode.register_fake
        def _(q, kv_cache, qo_indptr, kv_indptr, kv_scale, kv_block_scale, q_scale, page_table, kv_format, q_format,
              sm_scale, causal, num_splits):
            _fake_check_q(q)
            total_q, heads = q.shape[0], q.shape[1]
            return (
                q.new_empty((total_q, heads, KV_LORA_RANK), dtype=torch.bfloat16),
                q.new_empty((total_q, heads), dtype=torch.float32),
            )

    if not _is_registered("decode_out"):

        @torch.library.custom_op(f"{NAMESPACE}::decode_out", mutates_args=("out", "lse"), tags=_TAGS)
        def decode_out(
            q: torch.Tensor,
            kv_cache: torch.Tensor,
            qo_indptr: torch.Tensor,
            kv_indptr: torch.Tensor,
            kv_scale: Optional[torch.Tensor],
            kv_block_scale: Optional[torch.Tensor],
            q_scale: Optional[torch.Tensor],
            page_table: Optional[torch.Tensor],
            kv_format: Optional[str],
            q_format: str,
            sm_scale: Optional[float],
            causal: bool,
            num_splits: int,
            out: torch.Tensor,
            lse: torch.Tensor,
        ) -> None:
            _run(q, kv_cache, qo_indptr, kv_indptr, kv_scale, kv_block_scale, q_scale, page_table, kv_format, q_format,
                 sm_scale, causal, num_splits, out=out, lse=lse)

        @decode_out.register_fake
        def _(q, kv_cache, qo_indptr, kv_indptr, kv_scale, kv_block_scale, q_scale, page_table, kv_format, q_format,
              sm_scale, causal, num_splits, out, lse):
            _fake_check_q(q)
            total_q, heads = q.shape[0], q.shape[1]
            _fake_check_buffer("out", out, (total_q, heads, KV_LORA_RANK), torch.bfloat16)
            _fake_check_buffer("lse", lse, (total_q, heads), torch.float32)


_register()


def mla_decode(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    qo_indptr: torch.Tensor,
    kv_indptr: torch.Tensor,
    *,
    kv_scale: Optional[torch.Tensor] = None,
    kv_block_scale: Optional[torch.Tensor] = None,
    kv_format: Optional[str] = None,
    q_format: str = "bf16",
    q_scale: Optional[torch.Tensor] = None,
    sm_scale: Optional[float] = None,
    causal: bool = False,
    page_table: Optional[torch.Tensor] = None,
    num_splits: Optional[int] = None,
    out: Optional[torch.Tensor] = None,
    lse: Optional[torch.Tensor] = None,
    return_lse: bool = False,
):
    """``mla.decode.mla_decode`` through ``torch.ops.mla.decode`` / ``torch.ops.mla.decode_out`` (see there for
    the arguments). Returns ``out`` (total_q, H, 512) bf16, or ``(out, lse)`` when ``return_lse``; caller
    buffers ``out`` / ``lse`` are written in place and returned (a missing one of the two is allocated)."""
    splits = 0 if num_splits is None else num_splits
    scale = None if sm_scale is None else float(sm_scale)
    args = (q, kv_cache, qo_indptr, kv_indptr, kv_scale, kv_block_scale, q_scale, page_table, kv_format, q_format,
            scale, bool(causal), splits)
    if out is None and lse is None:
        out, lse = torch.ops.mla.decode(*args)
    else:
        if out is None:
            out = q.new_empty((q.shape[0], q.shape[1], KV_LORA_RANK), dtype=torch.bfloat16)
        if lse is None:
            lse = q.new_empty((q.shape[0], q.shape[1]), dtype=torch.float32)
        torch.ops.mla.decode_out(*args, out, lse)
    return (out, lse) if return_lse else out
