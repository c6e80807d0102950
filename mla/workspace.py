"""Device buffers the op keeps across calls: per-device constants (the unit scale of formats without one, the
stand-in block scales, 1-element dummies), for kernels that fuse the split combine, zeroed int32 semaphores per
(device, stream), for the fused a8w8 kernels a zeroed amax cell per (device, stream), and the eager call's fp32
scratch per (device, stream) (its split partials, the LSE nobody reads, a8w8's amax(|q|)): calls on one stream are
ordered, so one buffer per stream serves every eager call on it without a race, and the call allocates only its
output.

Why they are allocated the way they are: torch.compile(mode="reduce-overhead") runs a function's warm-up and
records it with every allocation of the current stream routed to the private pool of its CUDA-graph trees, and it
rejects a tensor of that pool that stays alive across calls without being one of its outputs (docs/perf.md, run 6;
commit 227df27 removed a workspace cache for that). A buffer made here is therefore allocated

  - on a side stream of our own, which no graph pool's stream filter matches (the trees route the *current*
    stream, a capture routes the *capturing* stream), and
  - inside a ``torch.cuda.MemPool`` of our own (where torch has it, >= 2.6), which also keeps it out of any pool a
    caller routes this thread's allocations to;

it is then initialised on the current stream (constants: on the side stream, waited for once), and never freed
(buffers outgrown are retired, not released: a captured graph may still hold their address).

Inside CUDA-graph capture nothing persistent is made: a missing constant is an error (warm up once outside
capture, as the kernels need anyway), and missing semaphores are a fresh ``torch.zeros`` that belongs to the
graph (its memset replays with it). The scratch is never used inside a capture (``scratch`` returns None: the
caller allocates from the graph's pool), so two graphs never share it, whatever streams replay them.
"""

from __future__ import annotations

import contextlib

import torch

from tl_kernels.mla_decode import MXFP4_SCALES_PER_TOKEN

SEMAPHORE_MIN = 1 << 16  # int32 entries first allocated per (device, stream): batch x head groups up to 65536

_SIDE_STREAMS: dict = {}  # device -> torch.cuda.Stream we allocate on
_POOLS: dict = {}  # device -> torch.cuda.MemPool (None where torch has none)
_CONSTANTS: dict = {}  # (device, name) -> tensor
_SEMAPHORES: dict = {}  # (device index, raw stream) -> zeroed int32 tensor
_RETIRED: list = []  # outgrown semaphore buffers, kept alive
_SCRATCH: dict = {}  # (device, raw stream) -> Scratch
_AMAX_CELLS: dict = {}  # (device, raw stream) -> zeroed (1,) float32
SCRATCH_GRANULE = 1 << 16  # float32 elements: the scratch grows in steps of 256 KiB
SCRATCH_VIEWS = 64  # launches whose views of one scratch are kept (all dropped when full)


def unit_scale(device: torch.device) -> torch.Tensor:
    """(1,) float32 one: the scale of formats that have none (q_scale of bf16 Q, kv_scale of bf16 / mxfp4 KV)."""
    return _constant(device, "unit_scale", (1,), torch.float32, 1)


def no_block_scales(device: torch.device) -> torch.Tensor:
    """(18,) uint8 zeros: the block-scale argument of kernels that read none."""
    return _constant(device, "no_block_scales", (MXFP4_SCALES_PER_TOKEN,), torch.uint8, 0)


def dummy_fp32(device: torch.device) -> torch.Tensor:
    """(1,) float32: the split-partial arguments of a fused kernel that runs one split (never read)."""
    return _constant(device, "dummy_fp32", (1,), torch.float32, 0)


def semaphores(device: torch.device, count: int) -> torch.Tensor:
    """An int32 buffer of at least ``count`` entries, zero, for the current stream of ``device``: the fused-combine
    kernels count finished splits in it and leave every entry they used at zero again, so one buffer per stream
    serves every call (calls on one stream are ordered). Grown (doubled) when too small."""
    if device.type != "cuda":  # lowering-only targets (tests): no streams
        return _cpu_semaphores(device, count)
    key = (device.index, torch._C._cuda_getCurrentRawStream(device.index))
    buf = _SEMAPHORES.get(key)
    if buf is not None and buf.numel() >= count:
        return buf
    if torch.cuda.is_current_stream_capturing():
        return torch.zeros(count, dtype=torch.int32, device=device)  # part of the graph: zeroed at every replay
    size = max(count, SEMAPHORE_MIN, 2 * buf.numel() if buf is not None else 0)
    if buf is not None:
        _RETIRED.append(buf)
    buf = _SEMAPHORES[key] = _allocate(device, (size,), torch.int32)
    buf.zero_()  # on the current stream: ordered before every use on it
    return buf


def amax_cell(device: torch.device) -> torch.Tensor:
    """(1,) float32, zero, for the current stream of ``device``: the cell in which the fused a8w8 kernels
    (``amax_in_kernel``) accumulate amax(|Q|), leaving it zero again, so one per stream serves every call (calls on
    one stream are ordered). Inside CUDA-graph capture a fresh ``torch.zeros`` that belongs to the graph."""
    if device.type != "cuda":  # lowering-only targets (tests): no streams
        key = (device, None)
    else:
        if torch._C._cuda_isCurrentStreamCapturing():
            return torch.zeros(1, dtype=torch.float32, device=device)  # part of the graph: zeroed at every replay
        key = (device, torch._C._cuda_getCurrentRawStream(device.index))
    cell = _AMAX_CELLS.get(key)
    if cell is None:
        cell = _AMAX_CELLS[key] = zeroed_float32(device, 1)
    return cell


class Scratch:
    """One stream's eager scratch: ``buffer`` (float32) and the views launches made of it (``views``: launch ->
    its views, at most SCRATCH_VIEWS), which go with the buffer when it is outgrown."""

    __slots__ = ("buffer", "views")

    def __init__(self, buffer: torch.Tensor):
        self.buffer, self.views = buffer, {}


def scratch(device: torch.device, numel: int) -> Scratch | None:
    """The eager call's float32 scratch of the current stream of ``device``, at least ``numel`` elements
    (uninitialised; its contents are the last call's), or None inside CUDA-graph capture (the caller allocates one
    that belongs to the graph). Calls on one stream are ordered, so each stream's buffer serves every call on it.
    Grown when too small: the outgrown buffer is released once the current stream's queued work is done
    (``record_stream``), as nothing but this stream used it."""
    if device.type != "cuda":  # lowering-only targets (tests): no streams
        key = (device, None)
    else:
        if torch._C._cuda_isCurrentStreamCapturing():
            return None
        key = (device, torch._C._cuda_getCurrentRawStream(device.index))
    found = _SCRATCH.get(key)
    if found is not None and found.buffer.numel() >= numel:
        return found
    size = -(-numel // SCRATCH_GRANULE) * SCRATCH_GRANULE
    if device.type != "cuda":
        buf = torch.empty(size, dtype=torch.float32, device=device)
    else:
        if found is not None:
            found.buffer.record_stream(torch.cuda.current_stream(device))
        buf = _allocate(device, (size,), torch.float32)
    found = _SCRATCH[key] = Scratch(buf)
    return found


def zeroed_int32(device: torch.device, count: int) -> torch.Tensor:
    """A zeroed int32 buffer owned by the caller (a plan's semaphores), allocated like the shared ones."""
    if device.type != "cuda":
        return torch.zeros(count, dtype=torch.int32, device=device)
    buf = _allocate(device, (count,), torch.int32)
    buf.zero_()
    return buf


def zeroed_float32(device: torch.device, count: int) -> torch.Tensor:
    """A zeroed float32 buffer owned by the caller (a plan's amax cell), allocated like the shared ones; zeroed on
    the current stream, so ordered before every use on it."""
    if device.type != "cuda":
        return torch.zeros(count, dtype=torch.float32, device=device)
    buf = _allocate(device, (count,), torch.float32)
    buf.zero_()
    return buf


def _constant(device: torch.device, name: str, shape: tuple, dtype: torch.dtype, value) -> torch.Tensor:
    buf = _CONSTANTS.get((device, name))
    if buf is not None:
        return buf
    if device.type != "cuda":
        buf = torch.full(shape, value, dtype=dtype, device=device)
    else:
        if torch.cuda.is_current_stream_capturing():
            raise RuntimeError(f"mla: the op's constants for {device} are made on its first call, which must not be "
                               "inside CUDA-graph capture: call it once before capturing (a warm-up, as the kernels "
                               "need anyway)")
        buf = _allocate(device, shape, dtype)
        side = _side_stream(device)
        with torch.cuda.stream(side):
            buf.fill_(value)
        side.synchronize()  # once per device and constant: every stream may read it from now on
    _CONSTANTS[(device, name)] = buf
    return buf


def _allocate(device: torch.device, shape: tuple, dtype: torch.dtype) -> torch.Tensor:
    """Uninitialised memory outside every graph pool (see the module docstring)."""
    pool = _pool(device)
    routed = torch.cuda.use_mem_pool(pool, device) if pool is not None else contextlib.nullcontext()
    with torch.cuda.stream(_side_stream(device)), routed:
        return torch.empty(shape, dtype=dtype, device=device)


def _side_stream(device: torch.device):
    stream = _SIDE_STREAMS.get(device)
    if stream is None:
        stream = _SIDE_STREAMS[device] = torch.cuda.Stream(device=device)
    return stream


def _pool(device: torch.device):
    if device not in _POOLS:
        has_pools = hasattr(torch.cuda, "MemPool") and hasattr(torch.cuda, "use_mem_pool")
        with torch.cuda.device(device):
            _POOLS[device] = torch.cuda.MemPool() if has_pools else None
    return _POOLS[device]


def _cpu_semaphores(device: torch.device, count: int) -> torch.Tensor:
    key = (device, None)
    buf = _SEMAPHORES.get(key)
    if buf is None or buf.numel() < count:
        buf = _SEMAPHORES[key] = torch.zeros(max(count, SEMAPHORE_MIN), dtype=torch.int32, device=device)
    return buf
