"""The peers bench.py times beside the op, each with its detection (or the reason it is unavailable), an untimed
setup from the bench's harness tuple (its "plan"), and the one call to time:

  fa3, fa2        FlashInfer's BatchMLAPagedAttentionWrapper (backends fa3 / fa2), bf16 Q and KV: ``run`` is timed.
  flashmla-bf16   FlashMLA's SM90 dense decode (``dense_decode_fwd``), bf16, pages of 64 tokens: the op is timed,
                  its tile-scheduler metadata comes from one untimed first call.
  flashmla-fp8    FlashMLA's SM90 fp8 decode (``fwd_kvcache_mla_fp8``), a8w8: fp8 Q quantized per tensor and the fp8
                  cache, with their descales; metadata from ``get_mla_decoding_metadata_dense_fp8``, untimed.
  aiter           AMD aiter's a8w8 persistent MLA decode (ROCm only; untested in this project).

FlashMLA comes from the library ``$FLASHMLA_LEGACY_LIB`` names (SGLang's packaged fork, sgl-flash-mla 1.0.0, built
into .device/ by ../shared/device/make-flashmla.sh); without that variable it is not a peer. It reads pages of 64
tokens only: with another page size (or a flat cache) its caches are the same values laid out in shuffled pages
of 64 (``mla.inputs.to_paged``). Its Q is (batch, q_len, heads, 576), so every sequence needs the same q_len.
"""

from __future__ import annotations

import dataclasses
import importlib
import itertools
import os

import torch

from mla import formats
from mla.constants import DEFAULT_SM_SCALE, KV_LORA_RANK, QK_DIM, ROPE_DIM
from mla.inputs import to_paged
from mla.reference import mla_decode_reference

FLASHINFER = ("fa3", "fa2")  # FlashInfer MLA backends
FLASHINFER_WORKSPACE_BYTES = 128 * 2**20
FLASHMLA_BF16, FLASHMLA_FP8 = "flashmla-bf16", "flashmla-fp8"
FLASHMLA = (FLASHMLA_BF16, FLASHMLA_FP8)
FLASHMLA_LIB_ENV = "FLASHMLA_LEGACY_LIB"
FLASHMLA_NAMESPACE = "flash_mla_legacy"
FLASHMLA_OPS = ("dense_decode_fwd", "get_mla_decoding_metadata_dense_fp8", "fwd_kvcache_mla_fp8")
FLASHMLA_PAGE_SIZE = 64  # the only page size its kernels take
FLASHMLA_PAGE_SEED = 5
AITER = "aiter"  # AMD aiter's a8w8 persistent MLA decode (ROCm only)
AITER_PAGE_SIZE = 1  # as the competition reference (gpu-mode/reference-kernels problems/amd_202602/mixed-mla)
AITER_NUM_KV_SPLITS = 32
ALL = (*FLASHINFER, *FLASHMLA, AITER)
# The modes of ours a peer is compared with (its speedup column); a peer not listed is compared with every mode.
COMPARED_WITH = {FLASHMLA_BF16: ("bf16",), FLASHMLA_FP8: ("fp8", "a8w8")}
# The mode whose bytes a peer moves (for its GB/s).
BYTES_MODE = {"fa3": "bf16", "fa2": "bf16", FLASHMLA_BF16: "bf16", FLASHMLA_FP8: "a8w8", AITER: "a8w8"}


@dataclasses.dataclass
class Peer:
    """One peer (FlashInfer backend, FlashMLA kernel, AMD aiter), or why it is unavailable."""

    name: str
    module: object = None  # flashinfer / aiter module, or FlashMLA's op namespace
    workspace: torch.Tensor | None = None
    reason: str | None = None


def setup_peers(device: str) -> list[Peer]:
    """Every peer this machine could have: FlashInfer's two backends (or why not), FlashMLA's two kernels when
    ``$FLASHMLA_LEGACY_LIB`` is set, aiter on ROCm."""
    flashinfer, reason = load_flashinfer()
    if flashinfer is None:
        peers = [Peer(name, reason=reason) for name in FLASHINFER]
    else:
        peers = [Peer(name, module=flashinfer,
                      workspace=torch.empty(FLASHINFER_WORKSPACE_BYTES, dtype=torch.uint8, device=device))
                 for name in FLASHINFER]
    if os.environ.get(FLASHMLA_LIB_ENV):
        ops, reason = load_flashmla()
        peers += [Peer(name, module=ops, reason=reason) for name in FLASHMLA]
    aiter_peer = setup_aiter_peer()
    return peers + ([aiter_peer] if aiter_peer is not None else [])


def status_lines(peers: list[Peer]) -> list[str]:
    """The header lines about the peers (one per library)."""
    lines = []
    for peer in peers:
        if peer.name in FLASHINFER:
            lines.append(f"peer {peer.name}: " + (f"unavailable: {peer.reason}" if peer.reason else
                                                  f"flashinfer {getattr(peer.module, '__version__', '?')}"))
        elif peer.name in FLASHMLA:
            lines.append(f"peer {peer.name}: " + (f"unavailable: {peer.reason}" if peer.reason else
                                                  f"FlashMLA SM90 from {os.environ.get(FLASHMLA_LIB_ENV)}"))
    if not any(p.name in FLASHMLA for p in peers):
        lines.append(f"peers {', '.join(FLASHMLA)}: ${FLASHMLA_LIB_ENV} not set")
    lines.append(aiter_status(next((p for p in peers if p.name == AITER), None)))
    return lines


def peer_callable(peer: Peer, data, heads: int, ref_fns: dict, paging=None, shared: dict | None = None):
    """(the call to time, its reference function, the mode whose bytes it moves) for one peer; setup untimed.
    ``ref_fns``: mode -> the fp32 reference of that mode (``mla_bench.calls.reference_fns``). ``paging``: (paged
    caches, page table) to read the KV through (FlashInfer; FlashMLA when its pages hold 64 tokens; aiter always reads
    page size 1). ``shared``: a dict the peers of one case share their setup in (FlashMLA's 64-token pages)."""
    if peer.name == AITER:
        fn, ref_fn = aiter_callable(peer, data, heads)
        return fn, ref_fn, BYTES_MODE[AITER]
    if peer.name in FLASHMLA:
        fp8 = peer.name == FLASHMLA_FP8
        fn = flashmla_callable(peer, data, heads, fp8=fp8, paging=flashmla_paging(data, paging, shared))
        return fn, ref_fns["a8w8" if fp8 else "bf16"], BYTES_MODE[peer.name]
    return flashinfer_callable(peer, data, heads, paging), ref_fns["bf16"], BYTES_MODE[peer.name]


# ------------------------------------------------------------------------------------------------------ FlashInfer


def load_flashinfer():
    """(flashinfer module, None) or (None, reason). JIT is disabled first: a missing prebuilt kernel fails loudly."""
    os.environ.setdefault("FLASHINFER_DISABLE_JIT", "1")
    try:
        import flashinfer
        import flashinfer.mla  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - any import failure just means "no peer"
        return None, f"import flashinfer failed: {type(exc).__name__}: {exc}"
    return flashinfer, None


def flashinfer_callable(peer: Peer, data, heads: int, paging=None):
    """Plan FlashInfer's MLA wrapper for this batch (untimed); returns the call to time (``run`` only). Flat
    caches are read as pages of one token; with ``paging`` (paged caches, page table) through the same pages as
    our kernels, as CSR page lists."""
    q, kv_data, qo_indptr, kv_indptr, _ = data
    wrapper = peer.module.mla.BatchMLAPagedAttentionWrapper(peer.workspace, backend=peer.name)
    kv_lens = (kv_indptr[1:] - kv_indptr[:-1]).to(torch.int32)
    if paging is None:
        kv = kv_data["bf16"]  # (total_kv, 1, 576): page size 1, one token per page
        page_size, page_indptr = 1, kv_indptr
        kv_indices = torch.arange(kv.shape[0], dtype=torch.int32, device=kv.device)
    else:
        paged_kv, page_table = paging
        num_pages, page_size = paged_kv["bf16"].shape[:2]
        kv = paged_kv["bf16"].view(num_pages, page_size, QK_DIM)
        pages = [-(-n // page_size) for n in kv_lens.tolist()]
        page_indptr = torch.tensor([0, *itertools.accumulate(pages)], dtype=torch.int32, device=kv.device)
        kv_indices = torch.cat([page_table[b, :n] for b, n in enumerate(pages)]).contiguous()
    wrapper.plan(
        qo_indptr=qo_indptr, kv_indptr=page_indptr, kv_indices=kv_indices, kv_len_arr=kv_lens, num_heads=heads,
        head_dim_ckv=KV_LORA_RANK, head_dim_kpe=ROPE_DIM, page_size=page_size, causal=False,
        sm_scale=DEFAULT_SM_SCALE, q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16,
    )
    q_nope, q_pe = q[..., :KV_LORA_RANK], q[..., KV_LORA_RANK:]  # strided views, as SGLang passes them
    ckv_cache, kpe_cache = kv[..., :KV_LORA_RANK], kv[..., KV_LORA_RANK:]  # (pages, page_size, 512) / (.., 64)
    return lambda: wrapper.run(q_nope, q_pe, ckv_cache, kpe_cache)


# -------------------------------------------------------------------------------------------------------- FlashMLA


def load_flashmla():
    """(FlashMLA's op namespace, None) or (None, reason): loads ``$FLASHMLA_LEGACY_LIB`` and checks its three ops."""
    path = os.environ.get(FLASHMLA_LIB_ENV)
    if not path:
        return None, f"${FLASHMLA_LIB_ENV} not set"
    try:
        torch.ops.load_library(path)
        ops = getattr(torch.ops, FLASHMLA_NAMESPACE)
        missing = [name for name in FLASHMLA_OPS if not hasattr(ops, name)]
    except Exception as exc:  # noqa: BLE001 - a library that does not load (ABI, CUDA version) means "no peer"
        return None, f"loading {path} failed: {type(exc).__name__}: {exc}"
    if missing:
        return None, f"{path} has no torch.ops.{FLASHMLA_NAMESPACE}." + ", ".join(missing)
    return ops, None


def flashmla_paging(data, paging=None, shared: dict | None = None):
    """(paged caches, page table) with FlashMLA's 64-token pages: the bench's own when they have 64 tokens, else
    the same values laid out anew (once per ``shared`` dict)."""
    if paging is not None and paging[0]["bf16"].shape[1] == FLASHMLA_PAGE_SIZE:
        return paging
    if shared is not None and "flashmla_paging" in shared:
        return shared["flashmla_paging"]
    result = to_paged(data, FLASHMLA_PAGE_SIZE, seed=FLASHMLA_PAGE_SEED)
    if shared is not None:
        shared["flashmla_paging"] = result
    return result


def flashmla_callable(peer: Peer, data, heads: int, *, fp8: bool, paging):
    """Sets FlashMLA up for this batch (untimed: quantized Q, scheduler metadata); returns the call to time, which
    gives (total_q, heads, 512) bf16. ``paging``: (paged caches, block table) with 64-token pages."""
    ops = peer.module
    q, kv_data, qo_indptr, kv_indptr, _ = data
    (paged, block_table) = paging
    total_q, batch = q.shape[0], qo_indptr.shape[0] - 1
    q_lens = torch.diff(qo_indptr).tolist()
    if batch == 0 or len(set(q_lens)) != 1:
        raise ValueError(f"FlashMLA needs one q_len for every sequence (q is (batch, q_len, heads, 576)), got "
                         f"{q_lens[:8]}")
    q_len = q_lens[0]
    seqlens = torch.diff(kv_indptr).to(torch.int32)
    block_table = block_table.to(torch.int32).contiguous()
    if not fp8:
        q4 = q.view(batch, q_len, heads, QK_DIM)
        kcache = paged["bf16"]  # (num_pages, 64, 1, 576)
        # The first call computes the tile-scheduler metadata (FlashMLA's plan); later calls pass it back.
        _, _, metadata, splits = ops.dense_decode_fwd(q4, kcache, KV_LORA_RANK, seqlens, block_table,
                                                      DEFAULT_SM_SCALE, False, None, None)
        decode = ops.dense_decode_fwd

        def run():
            out = decode(q4, kcache, KV_LORA_RANK, seqlens, block_table, DEFAULT_SM_SCALE, False, metadata, splits)[0]
            return out.reshape(total_q, heads, KV_LORA_RANK)

        return run
    fp8_dtype = torch.float8_e4m3fn
    q_fp8, q_descale = formats.quantize_fp8(q, fp8_dtype)
    q4 = q_fp8.view(batch, q_len, heads, QK_DIM)
    kcache, kv_descale = paged["fp8"]
    if kcache.dtype != fp8_dtype:
        raise TypeError(f"FlashMLA's fp8 kernel reads {fp8_dtype}, the bench's fp8 cache is {kcache.dtype}")
    kv_descale = kv_descale.to(torch.float32).reshape(1)
    metadata, splits = ops.get_mla_decoding_metadata_dense_fp8(seqlens, q_len * heads, 1)
    decode = ops.fwd_kvcache_mla_fp8

    def run():
        out = decode(q4, kcache, KV_LORA_RANK, seqlens, block_table, DEFAULT_SM_SCALE, False, metadata, splits,
                     q_descale, kv_descale)[0]
        return out.reshape(total_q, heads, KV_LORA_RANK)

    return run


# AMD aiter. Untested in this project (no ROCm machine): written from aiter's sources (aiter/mla.py, aiter/ops/
# attention.py, op_tests/test_mla_persistent.py of ROCm/aiter) and the competition reference (gpu-mode/
# reference-kernels problems/amd_202602/mixed-mla/reference.py); tests/test_bench_cpu.py checks the calls against a
# fake aiter on the CPU. PyPI's "aiter" is an unrelated package: AMD's is "amd-aiter", recognised by aiter.mla.


def load_aiter():
    """(aiter module, None) or (None, reason). Off ROCm: (None, "not on ROCm") without trying to import anything."""
    if not torch.version.hip:
        return None, "not on ROCm"
    try:
        aiter = importlib.import_module("aiter")
    except Exception as exc:  # noqa: BLE001 - amd-aiter may fail to import (JIT, missing ROCm libs): no peer
        return None, f"unavailable: import aiter failed: {type(exc).__name__}: {exc}"
    try:
        aiter_mla = importlib.import_module("aiter.mla")
    except ModuleNotFoundError as exc:
        if exc.name in ("aiter.mla", "aiter"):  # an "aiter" without an mla submodule: not AMD's
            return None, (f"wrong package: 'import aiter' found {getattr(aiter, '__file__', '?')}, which has no "
                          "aiter.mla (PyPI's 'aiter' is unrelated; AMD's package is amd-aiter)")
        return None, f"unavailable: import aiter.mla failed: {type(exc).__name__}: {exc}"
    except Exception as exc:  # noqa: BLE001
        return None, f"unavailable: import aiter.mla failed: {type(exc).__name__}: {exc}"
    if not callable(getattr(aiter_mla, "mla_decode_fwd", None)):
        return None, "wrong package: aiter.mla has no mla_decode_fwd (AMD's package is amd-aiter)"
    missing = [name for name in ("get_mla_metadata_info_v1", "get_mla_metadata_v1")
               if not callable(getattr(aiter, name, None))]
    if not isinstance(getattr(getattr(aiter, "dtypes", None), "fp8", None), torch.dtype):
        missing.append("dtypes.fp8")
    if missing:  # an amd-aiter from before the persistent (v1 metadata) MLA decode
        return None, "unavailable: amd-aiter too old or incomplete: no " + ", ".join(f"aiter.{m}" for m in missing)
    return aiter, None


def aiter_version(aiter) -> str:
    version = getattr(aiter, "__version__", None)
    if version:
        return str(version)
    try:
        from importlib import metadata

        return metadata.version("amd-aiter")
    except Exception:  # noqa: BLE001 - a source checkout may have no distribution metadata
        return "?"


def setup_aiter_peer() -> Peer | None:
    """None off ROCm (nothing is imported); else the aiter peer, or why it is unavailable."""
    aiter, reason = load_aiter()
    if aiter is None and reason == "not on ROCm":
        return None
    return Peer(AITER, module=aiter, reason=reason)


def aiter_status(peer: Peer | None) -> str:
    """The header line about AMD aiter."""
    if peer is None:
        return "aiter: not on ROCm"
    if peer.reason is not None:
        return f"aiter: {peer.reason}"
    return (f"aiter: amd-aiter {aiter_version(peer.module)}: a8w8 persistent MLA decode (fp8 Q and KV, page size "
            f"{AITER_PAGE_SIZE}, {AITER_NUM_KV_SPLITS} KV splits); untested in this project")


def aiter_callable(peer: Peer, data, heads: int):
    """Set up aiter's a8w8 persistent MLA decode for this batch (untimed); returns (the call to time, a function
    computing the fp32 reference on exactly the fp8 values that call reads).

    Untested in this project (no ROCm machine). The call sequence is the competition reference's:
      1. Q and the KV cache quantized per tensor to ``aiter.dtypes.fp8`` (e4m3fnuz on gfx942, e4m3fn on gfx950);
      2. ``aiter.get_mla_metadata_info_v1`` gives the (size, dtype) of the six work buffers;
      3. ``aiter.get_mla_metadata_v1`` fills them (note its argument order: work_info_set before work_indptr);
      4. timed: ``aiter.mla.mla_decode_fwd`` with the buffers, the scales and num_kv_splits=32.
    One deviation: kv_last_page_lens is all ones (page size 1: one token in every page), as aiter's own
    op_tests/test_mla_persistent.py passes it; the competition reference passes the sequence lengths there.
    Like the reference, the metadata is causal (is_causal=True; mla_decode_fwd's default): the same as non-causal
    for one query token, and the check's reference is causal too.
    """
    aiter = peer.module
    aiter_mla = getattr(aiter, "mla", None)
    if aiter_mla is None:
        aiter_mla = importlib.import_module("aiter.mla")
    fp8 = aiter.dtypes.fp8
    q, kv_data, qo_indptr, kv_indptr, _ = data
    device = q.device
    total_q = q.shape[0]
    batch = qo_indptr.shape[0] - 1
    num_kv_heads = 1
    if q.shape[1] != heads or q.shape[2] != QK_DIM:
        raise ValueError(f"q is {tuple(q.shape)}, expected (total_q, {heads}, {QK_DIM})")
    if heads % 8:
        raise ValueError(f"aiter's MLA metadata needs a multiple of 8 heads, got {heads}")

    # Untimed setup: fp8 operands. The harness's fp8 cache is reused when it already is aiter's fp8 dtype.
    q_fp8, q_scale = formats.quantize_fp8(q, fp8)
    kv_fp8, kv_scale = kv_data["fp8"]
    if kv_fp8.dtype != fp8:
        kv_fp8, kv_scale = formats.quantize_fp8(kv_data["bf16"], fp8)
    total_kv = kv_fp8.shape[0]
    kv_4d = kv_fp8.reshape(total_kv, AITER_PAGE_SIZE, num_kv_heads, QK_DIM)  # (pages, page_size, kv heads, 576)
    q_scale = q_scale.to(device=device, dtype=torch.float32).reshape(1)
    kv_scale = kv_scale.to(device=device, dtype=torch.float32).reshape(1)
    qo_indptr = qo_indptr.to(device=device, dtype=torch.int32).contiguous()
    kv_indptr = kv_indptr.to(device=device, dtype=torch.int32).contiguous()
    kv_indices = torch.arange(total_kv, dtype=torch.int32, device=device)  # page i holds token i
    kv_last_page_lens = torch.ones(batch, dtype=torch.int32, device=device)
    max_q_len = int((qo_indptr[1:] - qo_indptr[:-1]).max().item())

    info = aiter.get_mla_metadata_info_v1(
        batch, max_q_len, heads, fp8, fp8,
        is_sparse=False, fast_mode=False, num_kv_splits=AITER_NUM_KV_SPLITS, intra_batch_mode=True,
    )
    info = list(info)
    if len(info) != 6:
        raise RuntimeError(f"aiter.get_mla_metadata_info_v1 returned {len(info)} entries, expected 6")
    (work_meta_data, work_indptr, work_info_set, reduce_indptr, reduce_final_map, reduce_partial_map) = (
        torch.empty(size, dtype=dtype, device=device) for size, dtype in info)
    aiter.get_mla_metadata_v1(
        qo_indptr, kv_indptr, kv_last_page_lens,
        heads // num_kv_heads, num_kv_heads, True,  # num_heads_per_head_k, num_heads_k, is_causal
        work_meta_data, work_info_set, work_indptr, reduce_indptr, reduce_final_map, reduce_partial_map,
        page_size=AITER_PAGE_SIZE, kv_granularity=max(AITER_PAGE_SIZE, 16), max_seqlen_qo=max_q_len,
        uni_seqlen_qo=max_q_len, fast_mode=False, max_split_per_batch=AITER_NUM_KV_SPLITS, intra_batch_mode=True,
        dtype_q=fp8, dtype_kv=fp8,
    )
    out = torch.empty((total_q, heads, KV_LORA_RANK), dtype=torch.bfloat16, device=device)
    work = {"work_meta_data": work_meta_data, "work_indptr": work_indptr, "work_info_set": work_info_set,
            "reduce_indptr": reduce_indptr, "reduce_final_map": reduce_final_map,
            "reduce_partial_map": reduce_partial_map}
    decode = aiter_mla.mla_decode_fwd

    def run():
        decode(q_fp8, kv_4d, out, qo_indptr, kv_indptr, kv_indices, kv_last_page_lens, max_q_len,
               page_size=AITER_PAGE_SIZE, nhead_kv=num_kv_heads, sm_scale=DEFAULT_SM_SCALE, logit_cap=0.0,
               num_kv_splits=AITER_NUM_KV_SPLITS, q_scale=q_scale, kv_scale=kv_scale, intra_batch_mode=True,
               **work)
        return out

    def reference():
        ref, _ = mla_decode_reference(formats.dequantize_fp8(q_fp8, q_scale), formats.dequantize_fp8(kv_fp8, kv_scale),
                                      qo_indptr, kv_indptr, causal=True)
        return ref

    return run, reference


