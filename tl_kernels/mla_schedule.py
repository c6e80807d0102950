"""The split schedule on the device: each sequence's KV split count from the lengths of this step, in FlashMLA's
``num_splits`` layout, so that a CUDA graph captured once runs every step at the split counts of that step's
lengths (the host never reads the lengths: ``mla.flash_mla.get_mla_metadata`` and the graph form of its calls).

One CTA, three stages:
  1. the total length (each thread sums a strided share; a tree reduction in shared memory);
  2. the batch's split count S by the cost model of ``mla.schedule.choose_num_splits`` (every thread runs it: at
     most MAX_CANDIDATES candidates, no memory traffic; costs in tenths of a tile, as integers, so that the device
     and ``mla.schedule.device_split_counts`` choose alike, ties included), and from it the tiles per split,
     chunk = ceil(mean tiles / S);
  3. each sequence's count, ceil(its tiles / chunk) clamped to [1, max_splits] (a long sequence of a ragged batch
     takes more splits, a short one fewer), and their running sum (a scan in shared memory per block of
     ``threads`` sequences).
"""

from __future__ import annotations

from dataclasses import dataclass

import tilelang.language as T

MAX_CANDIDATES = 64  # split counts the model tries (mla.schedule.MAX_SPLITS)


@dataclass(frozen=True)
class SplitScheduleConfig:
    """Everything that changes the generated code of the schedule kernel."""

    threads: int = 256
    max_candidates: int = MAX_CANDIDATES

    @property
    def name(self) -> str:
        return f"mla_split_schedule_t{self.threads}_c{self.max_candidates}"


def mla_split_schedule_kernel(cfg: SplitScheduleConfig):
    """Returns the prim_func of the schedule kernel.

    Arguments:
      Cache_seqlens     (batch,) int32 KV lengths (negative counts as 0)
      Num_splits        (batch + 1,) int32 out: 0, then the running sum of the split counts (FlashMLA's layout)
      block_n           int32  KV tokens per tile of the decode kernel
      head_groups       int32  CTAs per (sequence, split)
      slots             int32  CTAs resident at once (SMs x CTAs per SM)
      max_splits        int32  the decode grid's split dimension (every count is clamped to it)
      cta_overhead      int32  cost model, in tenths of a tile: the fixed cost of a CTA,
      combine_overhead  int32  of the merge when a sequence is split,
      combine_per_split int32  and per split merged
    """
    threads, candidates = cfg.threads, cfg.max_candidates
    i32, i64 = "int32", "int64"
    batch = T.dynamic("batch")

    @T.prim_func
    def mla_split_schedule(
        Cache_seqlens: T.Tensor([batch], i32),
        Num_splits: T.Tensor([batch + 1], i32),
        block_n: T.int32,
        head_groups: T.int32,
        slots: T.int32,
        max_splits: T.int32,
        cta_overhead: T.int32,
        combine_overhead: T.int32,
        combine_per_split: T.int32,
    ):
        with T.Kernel(1, threads=threads):
            tx = T.get_thread_binding()
            sums = T.alloc_shared([threads], i64)
            scan = T.alloc_shared([threads], i32)
            total = T.alloc_var(i64, init=0)
            best = T.alloc_var(i32, init=1)
            best_cost = T.alloc_var(i64, init=-1)  # -1: none yet
            carry = T.alloc_var(i32, init=0)
            value = T.alloc_var(i32, init=0)

            # Stage 1: the total length.
            for i in T.serial(T.ceildiv(batch, threads)):
                if i * threads + tx < batch:
                    total = total + T.cast(T.max(Cache_seqlens[i * threads + tx], 0), i64)
            sums[tx] = total
            T.sync_threads()
            for level in T.serial(threads.bit_length() - 1):
                if tx < T.shift_right(threads, level + 1):
                    sums[tx] = sums[tx] + sums[tx + T.shift_right(threads, level + 1)]
                T.sync_threads()

            # Stage 2: the batch's split count (the host model, ``choose_num_splits``) and the tiles per split.
            tiles = T.alloc_var(i32, init=T.cast(T.ceildiv(sums[0], T.cast(batch * block_n, i64)), i32))
            for k in T.serial(candidates):
                if k + 1 <= max_splits and k + 1 <= tiles:
                    waves = T.cast(T.ceildiv(batch * head_groups * (k + 1), slots), i64)
                    cost = waves * T.cast(10 * T.ceildiv(tiles, k + 1) + cta_overhead, i64) + T.cast(
                        T.if_then_else(k > 0, combine_overhead + combine_per_split * (k + 1), 0), i64)
                    if best_cost < 0 or cost < best_cost:
                        best = k + 1
                        best_cost = cost
            chunk = T.alloc_var(i32, init=T.max(T.ceildiv(tiles, best), 1))

            # Stage 3: each sequence's count and the running sum, a block of ``threads`` sequences at a time.
            if tx == 0:
                Num_splits[0] = 0
            for i in T.serial(T.ceildiv(batch, threads)):
                scan[tx] = 0
                if i * threads + tx < batch:
                    seq_tiles = T.ceildiv(T.max(Cache_seqlens[i * threads + tx], 0), block_n)
                    scan[tx] = T.max(T.min(T.ceildiv(seq_tiles, chunk), max_splits), 1)
                T.sync_threads()
                for level in T.serial(threads.bit_length() - 1):  # Hillis-Steele inclusive scan
                    value = scan[tx]
                    if tx >= T.shift_left(1, level):
                        value = value + scan[tx - T.shift_left(1, level)]
                    T.sync_threads()
                    scan[tx] = value
                    T.sync_threads()
                if i * threads + tx < batch:
                    Num_splits[i * threads + tx + 1] = carry + scan[tx]
                carry = carry + scan[threads - 1]
                T.sync_threads()

    return mla_split_schedule
