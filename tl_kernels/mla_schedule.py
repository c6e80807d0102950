"""The split schedule on the device: each sequence's KV split count from the lengths of this step, in FlashMLA's
``num_splits`` layout, so that a CUDA graph captured once runs every step at the split counts of that step's
lengths (the host never reads the lengths: ``mla.flash_mla.get_mla_metadata`` and the graph form of its calls).

One CTA, three stages:
  1. the total length (each thread sums a strided share; a tree reduction in shared memory);
  2. the batch's split count S by the cost model of ``mla.schedule.choose_num_splits`` (a thread per candidate, at
     most MAX_CANDIDATES, then a min-reduction; costs in tenths of a tile, as integers, so that the device and
     ``mla.schedule.device_split_counts`` choose alike, ties included), and from it the tiles per split,
     chunk = ceil(mean tiles / S);
  3. each sequence's count, ceil(its tiles / chunk) clamped to [1, max_splits] (a long sequence of a ragged batch
     takes more splits, a short one fewer), and their running sum (a scan in shared memory per block of
     ``threads`` sequences).
"""

from __future__ import annotations

from dataclasses import dataclass

import tilelang.language as T

MAX_CANDIDATES = 64  # split counts the model tries (mla.schedule.MAX_SPLITS)
KEY_COUNTS = 1024  # a candidate's key is cost * KEY_COUNTS + count (count < KEY_COUNTS), so min() takes the
# cheapest and, on a tie, the smallest count
KEY_NONE = 1 << 62  # no candidate


@dataclass(frozen=True)
class SplitScheduleConfig:
    """Everything that changes the generated code of the schedule kernel."""

    threads: int = 256
    max_candidates: int = MAX_CANDIDATES

    def __post_init__(self):
        if self.threads & (self.threads - 1) or not 0 < self.max_candidates < KEY_COUNTS:
            raise ValueError(f"threads must be a power of two and max_candidates in [1, {KEY_COUNTS}): {self}")

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

    @T.macro
    def tree_reduce(buf, tx, combine):
        """buf[0] = combine of buf[0 .. threads): halving steps, a barrier after each (stages 1 and 2)."""
        for level in T.serial(threads.bit_length() - 1):
            if tx < T.shift_right(threads, level + 1):
                buf[tx] = combine(buf[tx], buf[tx + T.shift_right(threads, level + 1)])
            T.sync_threads()

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
            keys = T.alloc_shared([threads], i64)
            best = T.alloc_var(i32, init=1)
            best_key = T.alloc_var(i64, init=KEY_NONE)  # cost * KEY_COUNTS + count of this thread's cheapest
            carry = T.alloc_var(i32, init=0)
            value = T.alloc_var(i32, init=0)

            # Stage 1: the total length.
            for i in T.serial(T.ceildiv(batch, threads)):
                if i * threads + tx < batch:
                    total = total + T.cast(T.max(Cache_seqlens[i * threads + tx], 0), i64)
            sums[tx] = total
            T.sync_threads()
            tree_reduce(sums, tx, lambda a, b: a + b)

            # Stage 2: the batch's split count (the host model, ``choose_num_splits``) and the tiles per split. Each
            # thread costs its own candidates (one, for 64 candidates on 256 threads) and a min-reduction of
            # (cost, count) keys picks the cheapest, the smallest count on a tie, as the host's strict < over
            # increasing counts does; no valid candidate (no tile) leaves 1.
            tiles = T.alloc_var(i32, init=T.cast(T.ceildiv(sums[0], T.cast(batch * block_n, i64)), i32))
            for j in T.serial(T.ceildiv(candidates, threads)):
                count = j * threads + tx + 1
                if count <= candidates and count <= max_splits and count <= tiles:
                    waves = T.cast(T.ceildiv(batch * head_groups * count, slots), i64)
                    cost = waves * T.cast(10 * T.ceildiv(tiles, count) + cta_overhead, i64) + T.cast(
                        T.if_then_else(count > 1, combine_overhead + combine_per_split * count, 0), i64)
                    best_key = T.min(best_key, cost * KEY_COUNTS + count)
            keys[tx] = best_key
            T.sync_threads()
            tree_reduce(keys, tx, T.min)
            best = T.if_then_else(keys[0] == KEY_NONE, 1, T.cast(keys[0] % KEY_COUNTS, i32))
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
