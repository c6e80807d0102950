"""Plan once per step, run every layer: ``plan(...)`` takes a decode batch's layout on the host once (offsets, split
count from the exact KV lengths, block table, compiled kernels, split workspace); ``DecodePlan.run`` is the op's
cheapest call: a signature lookup and the launches.

Example (Hopper; every name defined, as in the README's plan example)::

    import torch
    from mla import formats
    from mla.plan import plan

    num_layers = 2
    qo_indptr, kv_indptr = [0, 1, 2, 4], [0, 100, 100, 3100]  # 1, 1, 2 queries over 100, 0, 3000 cached tokens
    q = torch.randn(num_layers, 4, 16, 576, dtype=torch.bfloat16, device="cuda")
    kv, kv_scale = zip(*(formats.quantize_kv(torch.randn(3100, 1, 576, dtype=torch.bfloat16, device="cuda"), "fp8")
                         for _ in range(num_layers)))  # per layer: fp8 cache (3100, 1, 576), scale (1,)
    step = plan(qo_indptr, kv_indptr, num_heads=16, kv_format="fp8", causal=True)
    for layer in range(num_layers):
        out = step.run(q[layer], kv[layer], kv_scale=kv_scale[layer])  # (4, 16, 512) bf16
"""

from __future__ import annotations

import torch

from mla import validate, workspace
from mla.constants import DEFAULT_SM_SCALE, KV_LORA_RANK
from mla.launch import Launch, Workspace, kernels
from mla.target import spec_for_device
from mla.validate import SUPPORTED_HEADS, SUPPORTED_PAGE_SIZES, KVFormat, QFormat, host_offsets
from tl_kernels.mla_amax import AMAX_CTAS

MAX_SIGNATURES = 64  # per plan: run signatures kept (a plan normally sees one per cache format)


class DecodePlan:
    """The schedule of one decode batch, made once by ``plan(...)`` and run many times (e.g. by every layer of a
    model step): FlashInfer's plan/run split, FlashMLA's metadata. Holds the batch layout on the device
    (``qo_indptr``, ``kv_indptr``, ``page_table``), the split count chosen from the exact KV lengths, the compiled
    kernels and the split workspace, so ``run`` only looks its tensors' signature up and launches.

    ``run`` does no host-device synchronisation and allocates nothing but its output (none with ``out=``; an LSE
    only with ``return_lse`` and no ``lse=``): it can be captured in a CUDA graph, and a graph replays it with
    whatever the plan's index tensors hold then. One plan's workspace (split partials, unread LSE, semaphores,
    a8w8's amax(|q|)) serves one stream at a time: runs of the same plan on concurrent streams race; give each
    stream its own plan. (The eager ``mla_decode`` keeps one scratch per stream and has no such rule.)
    """

    def __init__(self, *, spec, device, kv_format, q_format, num_heads, causal, sm_scale, page_size, kv_lens,
                 total_q, num_splits, qo_indptr, kv_indptr, page_table, overrides, with_semaphores=False):
        self.spec = spec
        self.device = device
        self.kv_format = kv_format
        self.q_format = q_format
        self.num_heads = num_heads
        self.causal = causal
        self.sm_scale = sm_scale
        self.page_size = page_size  # 0: flat cache; else tokens per page (1 for a flat cache read through a table)
        self.kv_lens = kv_lens  # host copy of the planned KV lengths
        self.kv_tokens = sum(kv_lens)
        self.batch = len(kv_lens)
        self.total_q = total_q
        self.num_splits = num_splits
        self.qo_indptr = qo_indptr  # (batch + 1,) int32 on the device
        self.kv_indptr = kv_indptr  # (batch + 1,) int32 on the device
        self.page_table = page_table  # (batch, max_pages) int32 on the device, or None
        self._overrides = overrides  # sorted (field, value) pairs, as launch.kernels takes them
        self._launches: dict = {}  # run signature -> Launch
        o_flat = lse_flat = o_partial = lse_partial = None
        if num_splits > 1 and total_q > 0:
            # Flat, as the fused kernels take them; shaped views of the same memory for the two-kernel form.
            shape = (num_splits, total_q, num_heads)
            lse_flat = torch.empty(num_splits * total_q * num_heads, dtype=torch.float32, device=device)
            o_flat = torch.empty(lse_flat.numel() * KV_LORA_RANK, dtype=torch.float32, device=device)
            o_partial, lse_partial = o_flat.view(*shape, KV_LORA_RANK), lse_flat.view(shape)
        unread_lse = torch.empty((total_q, num_heads), dtype=torch.float32, device=device)
        semaphores = self._semaphores() if with_semaphores else None
        q_amax = q_amax_arg = amax_cell = amax_partials = None
        if q_format == "fp8":  # a8w8 from bf16 Q: amax(|q|), written by each run's reduction, read by its kernel;
            # or, where the kernel reduces it itself, accumulated in a zeroed cell that it leaves zero (the amax
            # kernel's ticket otherwise, which it leaves zero too; its per-CTA partials are written before read)
            q_amax_arg = torch.empty(1, dtype=torch.float32, device=device)
            q_amax = q_amax_arg.view(())
            amax_cell = workspace.zeroed_float32(device, 1)
            amax_partials = torch.empty(AMAX_CTAS, dtype=torch.int32, device=device)
        self._ws = Workspace(o_partial, lse_partial, o_flat, lse_flat, unread_lse, semaphores, q_amax, q_amax_arg,
                             amax_cell, amax_partials)

    @property
    def _o_partial(self):
        return self._ws.o_partial

    @property
    def _lse_partial(self):
        return self._ws.lse_partial

    def _semaphores(self) -> torch.Tensor:
        return workspace.zeroed_int32(self.device, max(self.batch * self.num_heads, 1))  # >= batch x head groups

    def __repr__(self) -> str:
        paging = f", page_size={self.page_size}" if self.page_size else ""
        return (f"DecodePlan({self.kv_format}, q {self.q_format}, heads={self.num_heads}, batch={self.batch}, "
                f"total_q={self.total_q}, kv_tokens={self.kv_tokens}, num_splits={self.num_splits}, "
                f"causal={self.causal}{paging}, {self.spec.name})")

    def kernels(self, kernel_q_format: str):
        """(decode launcher, combine launcher or None) for the planned problem with Q read as
        ``kernel_q_format``: the one-shot op's selection (``launch.kernels``) with the planned split count."""
        k = kernels(self.spec, self.kv_format, kernel_q_format, self.num_heads, self.causal, self.page_size,
                    self.batch, self.total_q, self.kv_tokens, self.num_splits, self._overrides)
        return k.decode, k.combine

    def run(
        self,
        q: torch.Tensor,
        kv_cache: torch.Tensor,
        *,
        kv_scale: torch.Tensor | None = None,
        kv_block_scale: torch.Tensor | None = None,
        q_scale: torch.Tensor | None = None,
        out: torch.Tensor | None = None,
        lse: torch.Tensor | None = None,
        return_lse: bool = False,
        check_inputs: bool = False,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Decode with this plan: ``q`` (total_q, H, 576) and the cache as in ``mla_decode`` (paged caches as
        (num_pages, page_size, 1, row)); returns ``out`` or ``(out, lse)``. ``check_inputs``: also check the page
        table's values against the cache (a device-to-host copy).

        Every check of ``mla_decode`` applies; they run when a signature (dtypes, shapes, strides, devices of the
        tensors) is first seen, and a later run with the same signature only looks it up."""
        try:
            key = (q.dtype, q.shape, q.device, q.is_contiguous(),
                   kv_cache.dtype, kv_cache.shape, kv_cache.stride(), kv_cache.device,
                   None if kv_scale is None else (kv_scale.dtype, kv_scale.shape, kv_scale.device),
                   None if kv_block_scale is None else (kv_block_scale.dtype, kv_block_scale.shape,
                                                        kv_block_scale.stride(), kv_block_scale.device),
                   None if q_scale is None else (q_scale.dtype, q_scale.shape, q_scale.device),
                   None if out is None else (out.dtype, out.shape, out.device, out.is_contiguous()),
                   None if lse is None else (lse.dtype, lse.shape, lse.device, lse.is_contiguous()))
            launch = self._launches.get(key)
        except AttributeError:  # not a tensor: the checks say which argument
            key = launch = None
        if launch is None or launch.forced_target is not None and launch.target_changed():
            launch = self._prepare(key, q, kv_cache, kv_scale, kv_block_scale, q_scale, out, lse)
        if check_inputs and self.page_table is not None:
            validate.validate_index_values(self.qo_indptr, self.kv_indptr, launch.cache_rows, launch.total_q,
                                           self.page_table, self.page_size)
        return launch.run(q, kv_cache, self.qo_indptr, self.kv_indptr, self.page_table, kv_scale, kv_block_scale,
                          q_scale, self.sm_scale, out, lse, return_lse, self._ws)

    def _prepare(self, key, q, kv_cache, kv_scale, kv_block_scale, q_scale, out, lse) -> Launch:
        """Checks a run signature (the op's checks, and that it fits the plan), prepares its launch and keeps it."""
        launch = self.prepare(q, kv_cache, kv_scale=kv_scale, kv_block_scale=kv_block_scale, q_scale=q_scale, out=out,
                              lse=lse)
        if key is not None:
            if len(self._launches) >= MAX_SIGNATURES:
                self._launches.clear()
            self._launches[key] = launch
        return launch

    @property
    def workspace(self) -> Workspace:
        """The plan's split workspace, for ``Launch.run(..., ws=)`` (``mla.flash_mla`` runs a plan's launches with
        the caller's block table)."""
        return self._ws

    def prepare(self, q, kv_cache, *, kv_scale=None, kv_block_scale=None, q_scale=None, out=None, lse=None) -> Launch:
        """The ``Launch`` of one run signature: every check of ``mla_decode`` on these tensors, and that they fit
        the plan (raising ValueError / TypeError naming the argument). Not kept: ``run`` keeps its own."""
        call = validate.check_call(q, kv_cache, self.qo_indptr, self.kv_indptr, kv_scale, kv_block_scale, None,
                                   self.q_format, q_scale, paged=self.page_size > 0, out=out, lse=lse)
        if call.kv_format != self.kv_format:
            raise ValueError(f"kv_cache: this plan is for a {self.kv_format} cache, got a {call.kv_format} one")
        if call.num_heads != self.num_heads:
            raise ValueError(f"q: this plan is for {self.num_heads} heads, got shape {tuple(q.shape)}")
        if call.total_q != self.total_q:
            raise ValueError(f"q: the plan's qo_indptr holds {self.total_q} query rows, q has {call.total_q}")
        if call.page_size != self.page_size:
            raise ValueError(f"kv_cache: this plan is for page_size {self.page_size}, the cache has {call.page_size}")
        if not self.page_size and self.kv_tokens > call.cache_rows:
            raise ValueError(f"kv_cache: the plan's kv_indptr reaches row {self.kv_tokens}, the cache has {call.cache_rows}")
        launch = Launch(call, causal=self.causal, num_splits=self.num_splits, total_kv=self.kv_tokens,
                        overrides=self._overrides)
        if launch.semaphore_count and self._ws.semaphores is None:  # Q read in another form than planned
            self._ws = self._ws._replace(semaphores=self._semaphores())
        return launch


def plan(
    qo_indptr,
    kv_indptr,
    *,
    num_heads: int,
    kv_format: KVFormat,
    q_format: QFormat = "bf16",
    causal: bool = False,
    sm_scale: float | None = None,
    page_size: int = 0,
    page_table: torch.Tensor | None = None,
    kv_indices: torch.Tensor | None = None,
    kv_page_indptr=None,
    num_splits: int | None = None,
    device: torch.device | str | None = None,
    config_overrides: dict | None = None,
) -> DecodePlan:
    """Plans a decode batch once, for many ``DecodePlan.run`` calls (every layer of a step).

    Args:
      qo_indptr, kv_indptr: (batch + 1,) offsets as host data (a list, or a CPU int tensor: no synchronisation)
        or as int32 device tensors (read to the host once: a synchronisation, so plan outside CUDA-graph capture).
        ``kv_indptr`` gives each sequence's KV length; for a flat cache also its rows.
      num_heads: 16, 32, 64 or 128. kv_format: "bf16", "fp8" or "mxfp4". q_format: "bf16", or "fp8" (a8w8: bf16
        Q quantized inside the kernel, or Q passed to ``run`` as fp8 codes with ``q_scale``).
      causal, sm_scale: as in ``mla_decode``.
      page_size: 0 for a flat cache, else tokens per page of a paged cache (1, 16, 32, 64, 128) given with either
        page_table: (batch, max_pages) int32 on the device (FlashMLA's block table): token p of sequence b is slot
          p % page_size of page page_table[b, p // page_size]; or
        kv_indices: (num_used_pages,) int32 on the device, the pages of all sequences back to back (FlashInfer's
          CSR): sequence b's pages are kv_indices[kv_page_indptr[b]:kv_page_indptr[b+1]]. kv_page_indptr: host
          or device (batch + 1,) offsets; default: each sequence holds exactly ceil(length / page_size) pages.
          The plan turns them into a block table once, on the device.
      num_splits: KV splits per sequence; default ``schedule.choose_num_splits`` from the exact mean KV length.
      device: where the kernels run (default: the device of a tensor argument, else the current CUDA device).
      config_overrides: tuning only, as in ``mla_decode``.

    Index values are checked here, on the host (monotonic offsets from 0, page counts); page numbers are checked
    against the cache by ``run(check_inputs=True)``.
    """
    device = _plan_device(device, qo_indptr, kv_indptr, page_table, kv_indices)
    spec = spec_for_device(device)
    qo = host_offsets("qo_indptr", qo_indptr)
    kvp = host_offsets("kv_indptr", kv_indptr)
    if len(qo) != len(kvp):
        raise ValueError(f"qo_indptr and kv_indptr must both be (batch + 1,), got {len(qo)} and {len(kvp)} entries")
    if num_heads not in SUPPORTED_HEADS:
        raise ValueError(f"num_heads: expected one of {SUPPORTED_HEADS}, got {num_heads!r}")
    if kv_format not in ("bf16", "fp8", "mxfp4"):
        raise ValueError(f"kv_format must be 'bf16', 'fp8' or 'mxfp4', got {kv_format!r}")
    if q_format not in ("bf16", "fp8"):
        raise ValueError(f"q_format must be 'bf16' or 'fp8', got {q_format!r}")
    validate.check_num_splits(num_splits)
    sm_scale = DEFAULT_SM_SCALE if sm_scale is None else validate.check_sm_scale(sm_scale)
    kv_lens = [hi - lo for lo, hi in zip(kvp, kvp[1:])]
    batch, total_q = len(kv_lens), qo[-1]
    table = _plan_page_table(page_size, page_table, kv_indices, kv_page_indptr, kv_lens, device)
    overrides = tuple(sorted(config_overrides.items())) if config_overrides else ()
    causal = bool(causal)
    with_semaphores = False
    if total_q and batch:
        # The one-shot op's selection, with the exact token count; builds (or loads) the kernels now, not in the
        # first run.
        selected = kernels(spec, kv_format, q_format, num_heads, causal, page_size, batch, total_q, sum(kv_lens),
                           num_splits, overrides)
        num_splits = selected.num_splits
        # Families whose last CTA merges count splits on semaphores (the grid-barrier merge needs none).
        with_semaphores = selected.fused and selected.decode_cfg.semaphores_per_seq > 0
    return DecodePlan(
        spec=spec, device=device, kv_format=kv_format, q_format=q_format, num_heads=num_heads, causal=causal,
        sm_scale=sm_scale, page_size=page_size, kv_lens=kv_lens, total_q=total_q, num_splits=num_splits or 1,
        qo_indptr=_device_offsets(qo_indptr, qo, device), kv_indptr=_device_offsets(kv_indptr, kvp, device),
        page_table=table, overrides=overrides, with_semaphores=with_semaphores,
    )


def _plan_device(device, *tensors) -> torch.device:
    if device is not None:
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:  # "cuda" means the current device: name it, so it
            device = torch.device("cuda", torch.cuda.current_device())  # compares equal to tensors' "cuda:N"
        return device
    for t in tensors:
        if isinstance(t, torch.Tensor) and t.device.type != "cpu":
            return t.device
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    raise ValueError("device: no device tensor among the arguments and no CUDA/ROCm device; pass device=")


def _device_offsets(given, values: list[int], device: torch.device) -> torch.Tensor:
    """The offsets as the kernels read them: the caller's tensor when it already is contiguous int32 on the device
    (so a CUDA graph sees in-place updates), else a fresh copy."""
    if isinstance(given, torch.Tensor) and given.device == device and given.dtype == torch.int32 and given.is_contiguous():
        return given
    return torch.tensor(values, dtype=torch.int32, device=device)


def _plan_page_table(page_size, page_table, kv_indices, kv_page_indptr, kv_lens, device):
    """The (batch, max_pages) int32 block table the paged kernels read, or None for a flat cache."""
    if not isinstance(page_size, int) or (page_size and page_size not in SUPPORTED_PAGE_SIZES):
        raise ValueError(f"page_size: expected 0 (flat cache) or one of {SUPPORTED_PAGE_SIZES}, got {page_size!r}")
    needed = [-(-n // page_size) for n in kv_lens] if page_size else []
    if not page_size:
        if page_table is not None or kv_indices is not None or kv_page_indptr is not None:
            raise ValueError("page_size: pass the cache's page size (> 0) with page_table / kv_indices")
        return None
    if (page_table is None) == (kv_indices is None):
        raise ValueError("page_table / kv_indices: a paged plan needs exactly one of them")
    if page_table is not None:
        if kv_page_indptr is not None:
            raise ValueError("kv_page_indptr: only with kv_indices, not with page_table")
        validate.check_page_table(page_table, len(kv_lens), device)
        short = [b for b, n in enumerate(needed) if n > page_table.shape[1]]
        if short:
            raise ValueError(f"page_table: sequence {short[0]} has {kv_lens[short[0]]} tokens, more than "
                             f"{page_table.shape[1]} pages of {page_size} hold")
        return page_table
    validate.check_tensor("kv_indices", kv_indices, (torch.int32,), 1)
    validate.check_same_device("kv_indices", kv_indices, device)
    if kv_page_indptr is None:
        page_offsets = [0]
        for n in needed:
            page_offsets.append(page_offsets[-1] + n)
    else:
        page_offsets = host_offsets("kv_page_indptr", kv_page_indptr)
        if len(page_offsets) != len(kv_lens) + 1:
            raise ValueError(f"kv_page_indptr: expected {len(kv_lens) + 1} entries (batch + 1), got {len(page_offsets)}")
    counts = [hi - lo for lo, hi in zip(page_offsets, page_offsets[1:])]
    short = [b for b, (n, c) in enumerate(zip(needed, counts)) if n > c]
    if short:
        b = short[0]
        raise ValueError(f"kv_page_indptr: sequence {b} has {kv_lens[b]} tokens ({needed[b]} pages of {page_size}) "
                         f"but {counts[b]} pages")
    if page_offsets[-1] > kv_indices.shape[0]:
        raise ValueError(f"kv_indices: expected at least {page_offsets[-1]} entries (kv_page_indptr[-1]), "
                         f"got {kv_indices.shape[0]}")
    # Gather each sequence's pages into its row of the block table; columns past its pages get page 0 (never read).
    max_pages = max(needed + [1])
    if kv_indices.shape[0] == 0:
        return torch.zeros((len(kv_lens), max_pages), dtype=torch.int32, device=device)
    starts = torch.tensor(page_offsets[:-1], dtype=torch.int64, device=device)
    columns = torch.arange(max_pages, dtype=torch.int64, device=device)
    used = columns[None, :] < torch.tensor(needed, dtype=torch.int64, device=device)[:, None]
    index = (starts[:, None] + columns[None, :]).clamp_(max=kv_indices.shape[0] - 1)
    return torch.where(used, kv_indices[index], 0).to(torch.int32).contiguous()
