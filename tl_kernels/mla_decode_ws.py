"""Warp-specialised split-KV MLA decode for Hopper (sm_90a), with the split combine fused in: one launch per call.

Each CTA owns one (KV split, sequence, head group). Its warp groups stream the split's KV tiles through a ring of
``num_stages`` shared-memory stages that always hold 16-bit MMA operands (bf16), whatever the cache format, so
the MMA warp group never decodes (mbarrier pair "ready" / "free" per stage; the trip count varies per CTA, so the
ring is a plain serial loop over barrier parities, not ``T.Pipelined``):

  producers (few registers), by cache format
    bf16: one warp group copies each tile's rows into the next free stage with cp.async, completing on the
          stage's "ready" barrier (``copy_tiles``).
    fp8 / mxfp4: two warp groups load each tile's codes from global memory into registers (whole vectors, two
          tiles ahead: a chunk's load for tile t + 2 is issued as soon as its registers are decoded for tile t),
          decode them by bit placement (``tl_kernels.dequant``: no conversion instruction) and store
          bf16 into the stage, then fence the async proxy and arrive on "ready" (``decode_tiles``).
    ``fp8_mma`` (fp8 cache): one warp group copies the fp8 codes with cp.async as bf16 is copied, the other writes
          each tile's V^T into a second ring (``transpose_tiles``): both GEMMs then run on fp8 wgmma. With an mxfp4
          cache (``mx_mma``) a decoder warp group writes e4m3 codes in the copier's place (``decode_mx_tiles``).
  consumer (one warp group, most registers; ``consume_tiles``)
    1. Q rows of the current query pass, once, into shared memory (a8w8: rounded to fp8 values here);
    2. per tile: S^T = K Q^T on wgmma with the 64 KV rows as M (16 query rows need no padding to 64);
    3. online softmax in base 2 (log2(e), fp8 per-tensor scales and the decode's 2^120 folded into one score
       scale);
    4. O^T += V^T P^T (V = the first 512 dims of the same tile), then the stage is released;
    5. one split: normalise and write bf16 out + natural-log LSE. Several splits: write the fp32 partial and its
       base-2 LSE, count the split in a per-(sequence, head group) semaphore, and the CTA that arrives last merges
       every split's partial by LSE into the output and resets the semaphore to 0 for the next call.

``mla_decode_stream_kernel`` builds the same producers with a consumer that does no MMA (it only releases each
stage, or copies it out to check the decode): the decode benchmark (tools/decode_bench.py) of exactly these roles.

Only what changes the generated code is static (``WSDecodeKernelConfig``); batch, lengths, token counts and the
number of splits are dynamic (the split count is a kernel argument), so a new shape never recompiles.
"""

import functools
import math
from dataclasses import dataclass
from types import SimpleNamespace

import tilelang.language as T

from tl_kernels import dequant, steps
from tl_kernels.steps import KV_FORMATS, KV_LORA_RANK, LN2, LOG2E, Q_FORMATS, QK_DIM, ROPE_DIM
WARP_GROUP = 128  # threads of one warp group (setmaxnreg and wgmma work per warp group)
CONSUMER_THREADS = WARP_GROUP
# Registers per lane that the roles' setmaxnreg budgets may sum to: the SM has 64 Ki (512 per lane of a warp-group
# slot), but setmaxnreg.inc waits until the pool holds what it asks for, and budgets summing to all 512 hung the
# consumer on the H200 (docs/perf.md, run 15); 504 leaves the headroom CUTLASS and FA3 kernels leave.
REGS_PER_LANE = 504
DECODER_GROUPS = 2  # fp8 / mxfp4 producer warp groups (decode spread over 8 warps that issue no MMA)
# A decoder thread's share of a 64-token tile: 9 chunks of 16 codes. Lane (r8, c4) = (lane % 8, lane // 8) of warp
# w takes latent chunk j < 8 at tile row 8j + r8, dims 64w + 16 c4 (a warp covers one 64-dim panel of 8 rows: its
# stores hit 32 distinct bank groups of the swizzled panel, its loads whole 32-byte sectors), and the rope chunk at
# row 8w + r8, dims 512 + 16 c4.
LATENT_CHUNKS = 8
CHUNKS_PER_THREAD = LATENT_CHUNKS + 1
# fp8_mma: P (at most 1) is stored as fp8 times 2^8: e4m3fn holds up to 448, and probabilities down to 2^-17 keep a
# nonzero code. The output scale divides it back out.
P_FP8_SCALE = 256.0
# fp8_mma with bf16 Q: row r of Q times 2^(7 - floor(log2 amax_r)) (amax_r into [128, 256), under e4m3fn's 448) is
# hi = e4m3(x) plus lo = e4m3((x - hi) * 16) / 16; the residual is at most half an e4m3 step (2^-4 of x), so lo fits
# and the pair holds x to about 2^-8.
Q_SPLIT_LO = 16.0
Q_SPLIT_TOP = 7  # amax_r is scaled into [2^7, 2^8)
# ``mx_mma``: the transposer's registers (its 8 blocks' words and addresses); the mxfp4 decoder takes the rest. With
# two decoder warp groups (``mx_decoders``) each decoder holds one tile instead of two, and the three share what the
# consumer leaves: 88 each at consumer_regs 240.
MX_TRANSPOSER_REGS = 128
MX_TRANSPOSER_REGS_2D = 72
# ``mx_mma``: a decoder thread's share of a tile: token p / 2, blocks 8 h .. 8 h + 7 of the latent dims and rope
# block 16 + h (h = p % 2): 9 blocks of 32 codes, 4 words each.
MX_BLOCKS = 9
MX_WORDS = 4 * MX_BLOCKS
# ``mx_mma``: per tile, the consumer's three column arrays of 64 floats (``dequant.mla_mx_store_columns``), in
# 2 * num_stages slots (slot s + num_stages * round parity): a tile's values are read after its stage is released,
# and the slot is rewritten only two rounds later.
MX_COLUMN_BYTES = 3 * 64 * 4


class StageView:
    """Stage ``s`` of a ring buffer whose stages lie side by side (``dynamic_stage``): ``view[i, c]`` is element
    (i, c) of the stage; ``rows`` / ``cols`` is the stage's step along each axis (the other is 0)."""

    def __init__(self, buf, s, rows=0, cols=0):
        self.buf, self.s, self.rows, self.cols = buf, s, rows, cols

    def __getitem__(self, idx):
        i, c = idx
        return self.buf[self.s * self.rows + i, self.s * self.cols + c]


@dataclass(frozen=True)
class WSDecodeKernelConfig:
    """Everything that changes the generated code of the warp-specialised decode kernel."""

    kv_format: str  # "bf16" | "fp8" | "mxfp4"
    q_format: str = "bf16"  # see tl_kernels.mla_decode.Q_FORMATS
    num_heads: int = 16
    block_h: int = 16  # heads per CTA: the wgmma N dimension (16 query rows)
    block_n: int = 64  # KV tokens per tile: the wgmma M dimension
    num_stages: int = 2  # depth of the 16-bit ring
    causal: bool = False
    page_size: int = 0  # 0: flat cache; else tokens per page (Page_table argument)
    fp8_dtype: str = "float8_e4m3fn"
    consumer_regs: int = 240  # setmaxnreg of the MMA warp group; the producers get the rest (``producer_regs``)
    # Tiles ahead of the one being filled whose bytes the producers ask L2 to fetch (one bulk prefetch per contiguous
    # run of rows, issued before the wait for a free stage): HBM reads in flight no longer wait on the ring or on
    # the decoders' registers, which then load from L2. 0: no prefetch.
    l2_prefetch: int = 0
    # The MMA warp group as a two-tile pipeline: tile t's score wgmma and tile t - 1's P V wgmma are issued together
    # and the softmax of tile t runs while P V is in flight (it rescales the output only after P V's wait).
    overlap: bool = False
    # Benchmark only: producers that touch no memory (they only pass stages along), so the kernel times the MMA
    # warp group alone. Its output is meaningless.
    idle_producers: bool = False
    # The MMA warp group's softmax with one barrier per tile: the tile's row maxima exchanged once across the 4 warps
    # (``steps.TILE_MAX_CUDA_SOURCE``) instead of TileLang's per-value reductions (two barriers per value, 4 values
    # per thread), and the denominators summed per score position, reduced once per pass (no per-tile reduction).
    fast_softmax: bool = False
    # S^T's latent and rope wgmma issued as one group and waited for once (T.gemm waits after each of the two).
    score_group: bool = False
    # The decoders store each chunk by shared address (``dequant.store_swizzled_32``): TileLang's barrier planner
    # then sees no ring access in their loop and inserts none (it put a barrier among all 256 decoders before most
    # chunks' stores: the 8 warps in lock-step, each waiting on the slowest's loads). The ring's stages are ordered
    # by their mbarriers; no decoder reads the ring.
    direct_stores: bool = False
    # The decoders wait for a free stage through ``dequant.mbar_wait_zero`` and feed its 0 into every decode, so
    # ptxas cannot hoist the decode above that wait: the wait for the tile's loads then comes after the wait for the
    # stage instead of before it (the SASS without it waits for every outstanding load first). Untimed: opt-in.
    ordered_decode: bool = False
    # a8w8 on fp8 wgmma (issue 28, step 5): the ring holds the cache's fp8 codes as stored (cp.async by one producer
    # warp group, no decode), the score wgmma reads them against fp8 Q codes; a second producer warp group writes
    # each tile's V^T into a ring of its own (8-bit wgmma operands are K-major only: ``dequant.transpose_v_fp8``);
    # P goes to fp8 times ``P_FP8_SCALE`` for P V. Scores and outputs carry no decode factor. A ring stage is
    # released once the score wgmma and the transposer have read it ("free", two roles), a V^T stage after P V
    # ("vt_free"); tests/test_ws_protocol_cpu.py model-checks the four barriers' protocol.
    # With bf16 Q (the "fp8" mode) Q is carried as two e4m3 terms per element, hi + lo / 16 under a per-row power of
    # two (``Q_SPLIT_LO``): about 2^-8 relative, near bf16's own 2^-9; the score wgmma runs once per term.
    fp8_mma: bool = False
    # ``fp8_mma``: P as two e4m3 terms, hi = e4m3(256 P) and lo = e4m3(256 P - hi), both multiplied into the same
    # accumulator (a second P V wgmma group): P to ~2^-8 instead of e4m3's 2^-4, at the cost of reading V^T twice.
    # Runs 48-49: with P as one term short sequences land just over the tests' per-sequence gate (2.1e-2 > 2e-2).
    p_split: bool = False
    # ``fp8_mma``: the MMA warp group one score ahead (FA3's intra-warp-group pipelining): at tile t it issues the
    # score wgmma of tile t + 1 (into that stage's own S^T fragment) before it waits for tile t's scores, so the
    # tensor cores compute S(t + 1) during the softmax of t; one wait per tile covers S(t + 1) and P V(t), so no
    # group is in flight across the loop's back edge or where paths merge (ptxas would serialise every wgmma):
    # the loop has no branch on the tile count, a slot without a tile is a fully masked tile (P = 0) over a V^T
    # ring the transposer zeroed once.
    score_ahead: bool = False
    # ``fp8_mma`` with bf16 Q: Q's two e4m3 terms stacked as the score wgmma's 32 B-operand rows (hi rows 0-15, lo
    # rows 16-31; S^T of m64n32), so each tile's scores take one group of 18 wgmma instead of two (the MMA warp
    # group's serial chain: run 50, 36 of fp8's 68 wgmma per tile); the two halves are summed in registers (the
    # accumulator's columns c and c + 16 sit in the same thread).
    q_stack: bool = False
    # ``p_split``: P's two e4m3 terms stacked as the P V wgmma's 32 B-operand rows (hi rows 0-15, lo rows 16-31; O^T
    # of 512 x 32), so P V takes one group of 16 m64n32 wgmma instead of two of m64n16 (the MMA warp group's chain);
    # the accumulator's two halves are rescaled alike per tile and summed once per pass (``fold_output``), at the cost
    # of 64 more accumulator registers per thread.
    p_stack: bool = False
    # ``mx_mma``: decoder warp groups. 1: one decodes every tile, two tiles of codes in its registers (run 50: its
    # ~790 instructions per thread and tile, one warp per scheduler, bound the ring at 754 us for 256 x 8192 on an
    # H100, where fp8's copier ring took 447). 2 (= num_stages): decoder g owns stage g (tiles g, g + 2, ...) and
    # holds only its next tile, so each has two tiles' time per tile and the SM has two decoding warps per
    # scheduler; the ready / free protocol per stage is unchanged (one role fills a stage, as before).
    mx_decoders: int = 1
    # ``fp8_mma``'s serial consumer: each ring operand is one shared buffer whose stages lie side by side (latent
    # codes [64, stages x 512], stage s at + 32 KiB; rope [stages x 64, 64], + 4 KiB; V^T as before), and every role
    # walks its tiles in one copy of its step with the stage t % stages in a register (the wgmma descriptors take
    # the stage's offset at run time), instead of one unrolled copy per stage: fp8's ring cubin 129.0 -> 109.5 KB
    # (ptxas, CPU box). Runs 58 / 61 (H100): equal for fp8 and a8w8, 4% faster for mxfp4's two-decoder ring
    # (``schedule.MX_RING_2D``), which then beats the decoder ring at 256 x 8192 (552 vs 573 us). Opt-in.
    dynamic_stage: bool = False
    # ``dynamic_stage`` with an fp8 cache: the V^T ring's depth apart from the codes' (0: num_stages). Slot G of the
    # CTA's walk (G = pass x slots per pass + t) takes codes stage G % num_stages and V^T stage G % vt_stages, each
    # ring with its own parity: a third 36 KiB codes stage fits beside two 32 KiB V^T stages where three of each do
    # not (fp8 with bf16 Q: 200,704 B). tests/test_ws_protocol_cpu.py model-checks the rings' protocol. Run 61
    # (H100): no gain (fp8 1.2% faster at 256 x 8192 only, a8w8 with four codes stages 2-13% slower); opt-in.
    vt_stages: int = 0
    # ``dynamic_stage`` with an fp8 cache: persistent CTAs. The grid is min(work items, persistent_ctas) CTAs (one
    # per SM: 132 on the H100 / H200), and CTA c walks the work items c, c + grid, ... (an item is one (KV split,
    # sequence, head group), split fastest). Every role carries the ring across items: a stage's parity counts the
    # CTA's rounds so far (``ring_base``), so the copier and the transposer fill the next item's first stages while
    # the MMA warp group writes, merges and loads Q for the last one, and the prologue (barriers, register budgets,
    # descriptors) is paid once per SM instead of once per item. 0: one CTA per item (the grid of splits x
    # sequences x head groups). tests/test_ws_protocol_cpu.py model-checks the ring across items. The op's default
    # for bf16 Q at the target's SM count (mla.schedule.ws_persistent_defaults; docs/perf.md run 62b, H100: 256 x 8192
    # 437.8 -> 414.4 us); a8w8 was 0.5-3% slower with it.
    persistent_ctas: int = 0
    # ``fp8_mma``: the MMA warp group writes Q's shared rows (codes, or bf16 Q's two terms) ``q_loop_rows`` rows at a
    # time in a loop, instead of all 16 in one unrolled block: the straight-line code each pass runs once (fp8
    # with bf16 Q: ~1570 instructions, 25 KB of SASS before the first wgmma) becomes a loop (the cubin 109.5 ->
    # 91.1 KB at 2 rows), for a CTA that starts with a cold instruction cache (the harness flushes L2 between
    # calls). 0: one block. Opt-in: 1-4% slower (docs/perf.md run 62b, H100), the cold-cache hypothesis rejected.
    q_loop_rows: int = 0

    fused_combine = True  # the launch passes num_splits + split workspace + semaphores; no combine kernel
    q_tile = 1  # one query token per pass (more queries take more passes)

    def __post_init__(self):
        if self.kv_format not in KV_FORMATS:
            raise ValueError(f"kv_format must be one of {KV_FORMATS}, got {self.kv_format!r}")
        if self.q_format not in Q_FORMATS:
            raise ValueError(f"q_format must be one of {Q_FORMATS}, got {self.q_format!r}")
        if self.num_heads % self.block_h:
            raise ValueError(f"block_h={self.block_h} must divide num_heads={self.num_heads}")
        if self.block_h != 16 or self.block_n != 64:
            raise ValueError("the warp-specialised kernel is built for 16 query rows x 64-token tiles")
        if self.fp8_mma:
            if (self.kv_format, self.q_format) not in (("fp8", "fp8"), ("fp8", "bf16"), ("mxfp4", "bf16")):
                raise ValueError(f"fp8_mma reads an fp8 cache with fp8 or bf16 Q, or an mxfp4 cache with bf16 Q "
                                 f"(kv_format 'fp8' / 'mxfp4'), got kv_format={self.kv_format!r}, "
                                 f"q_format={self.q_format!r}")
            if self.mx_mma and not self.fast_softmax:
                raise ValueError("fp8_mma with an mxfp4 cache weights the softmax denominators per token: it needs "
                                 "fast_softmax (the per-position sums)")
            if self.score_ahead and self.mx_mma:
                raise ValueError("score_ahead is built for an fp8 cache (mx_mma's column slots are per round)")
            if self.overlap or self.direct_stores or self.ordered_decode or self.idle_producers:
                raise ValueError("fp8_mma has no decoders and a serial consumer: overlap, direct_stores, "
                                 "ordered_decode and idle_producers must be off")
            if self.p_stack and (not self.p_split or self.score_ahead):
                raise ValueError("p_stack stacks p_split's two P terms (p_split), without score_ahead")
            if self.q_stack and (self.q_format != "bf16" or self.score_ahead or not self.score_group):
                raise ValueError("q_stack stacks bf16 Q's two e4m3 terms (q_format 'bf16'), in score_group's one "
                                 "wgmma group, without score_ahead")
            if self.mx_decoders not in (1, self.num_stages) or (self.mx_decoders > 1 and not self.mx_mma):
                raise ValueError(f"mx_decoders is mx_mma's (an mxfp4 cache on fp8_mma): 1, or one decoder warp group "
                                 f"per stage ({self.num_stages}); got {self.mx_decoders}")
            if self.dynamic_stage and (self.score_ahead or (self.mx_mma and self.mx_decoders != self.num_stages)):
                raise ValueError("dynamic_stage is built for fp8_mma's serial consumer (not score_ahead), with an "
                                 "mxfp4 cache one decoder warp group per stage (mx_decoders == num_stages)")
            if self.vt_stages and not (self.dynamic_stage and not self.mx_mma
                                       and 2 <= self.vt_stages <= self.num_stages):
                raise ValueError(f"vt_stages is dynamic_stage's with an fp8 cache: 2 .. num_stages "
                                 f"({self.num_stages}) V^T stages, got {self.vt_stages}")
            if self.persistent_ctas and not (self.dynamic_stage and not self.mx_mma and not self.vt_stages):
                raise ValueError("persistent_ctas is dynamic_stage's with an fp8 cache (fp8_mma, no mxfp4 decoders, "
                                 "no vt_stages)")
        elif self.persistent_ctas:
            raise ValueError("persistent_ctas is dynamic_stage's with an fp8 cache (fp8_mma)")
        elif self.vt_stages:
            raise ValueError("vt_stages is dynamic_stage's with an fp8 cache (fp8_mma)")
        elif self.dynamic_stage:
            raise ValueError("dynamic_stage is fp8_mma's (the copier's, the transposer's and the MMA warp group's "
                             "ring of fp8 codes)")
        elif self.mx_decoders != 1:
            raise ValueError("mx_decoders is mx_mma's (fp8_mma with an mxfp4 cache)")
        elif self.p_split or self.score_ahead or self.q_stack or self.p_stack:
            raise ValueError("p_split, score_ahead, q_stack and p_stack are fp8_mma's (P as two e4m3 terms; the "
                             "score wgmma a tile ahead; Q's or P's two terms in one wgmma)")
        elif self.kv_format != "bf16" and self.num_stages != 2:
            raise ValueError("the decoders keep two tiles in registers: fp8 / mxfp4 need num_stages == 2")
        if self.ordered_decode and (self.kv_format == "bf16" or self.overlap):
            raise ValueError("ordered_decode is the decoders' (fp8 / mxfp4) with the serial consumer (which then "
                             "issues the L2 prefetches)")
        if self.direct_stores and self.kv_format == "bf16":
            raise ValueError("direct_stores is the decoders' (fp8 / mxfp4): a bf16 cache is copied, not stored")
        if self.q_loop_rows and (not self.fp8_mma or self.block_m % self.q_loop_rows):
            raise ValueError(f"q_loop_rows is fp8_mma's, a divisor of the {self.block_m} query rows; got "
                             f"{self.q_loop_rows}")
        if self.persistent_ctas < 0:
            raise ValueError(f"persistent_ctas must be >= 0 (CTAs of the grid; 0: one per work item), got "
                             f"{self.persistent_ctas}")
        if self.l2_prefetch < 0:
            raise ValueError(f"l2_prefetch must be >= 0 (tiles ahead; 0: off), got {self.l2_prefetch}")
        producers = {f"producer_regs (group {g})": self.group_regs(g) for g in range(self.producer_groups)}
        steps.check_register_budgets("WSDecodeKernelConfig", {"consumer_regs": self.consumer_regs, **producers},
                                     self.threads)

    @property
    def block_m(self) -> int:
        return self.block_h

    @property
    def vt_depth(self) -> int:
        """``fp8_mma``: stages of the V^T ring (``vt_stages``, else num_stages)."""
        return self.vt_stages or self.num_stages

    @property
    def q_split(self) -> bool:
        """``fp8_mma`` with bf16 Q: Q as two e4m3 terms (hi, lo), two score wgmma per tile."""
        return self.fp8_mma and self.q_format == "bf16"

    @property
    def mx_mma(self) -> bool:
        """``fp8_mma`` with an mxfp4 cache: a decoder warp group writes e4m3 codes under per-token exponents
        (``dequant.MX_E4M3_CUDA_SOURCE``) into the ring the transposer and the fp8 wgmma read."""
        return self.fp8_mma and self.kv_format == "mxfp4"

    @property
    def semaphores_per_seq(self) -> int:
        """Fused-merge counters per sequence (one per head group): the launch allocates batch x this many."""
        return self.num_heads // self.block_h

    @property
    def producer_groups(self) -> int:
        """bf16: one copier; fp8 / mxfp4: two decoder warp groups; ``fp8_mma``: a copier (``mx_mma``: the e4m3
        decoder, or ``mx_decoders`` of them) and a V^T transposer. Group g is threads 128 (g + 1) ..: the transposer
        is group 1, a second mxfp4 decoder group 2."""
        if self.mx_mma:
            return 1 + self.mx_decoders
        return 1 if self.kv_format == "bf16" else DECODER_GROUPS

    @property
    def threads(self) -> int:
        return CONSUMER_THREADS + WARP_GROUP * self.producer_groups

    @property
    def producer_regs(self) -> int:
        """setmaxnreg of the first producer warp group (of each, but with ``mx_mma``): a copier needs few, decoders
        the registers the consumer leaves (``mx_mma``: what the consumer and the transposer leave)."""
        if self.kv_format == "bf16":
            return 96
        if self.mx_mma:
            return (REGS_PER_LANE - self.consumer_regs - self.transposer_regs) // self.mx_decoders // 8 * 8
        return (REGS_PER_LANE - self.consumer_regs) // self.producer_groups // 8 * 8

    @property
    def transposer_regs(self) -> int:
        """``mx_mma``: setmaxnreg of the transposer (less with two decoder groups beside it)."""
        return MX_TRANSPOSER_REGS if self.mx_decoders == 1 else MX_TRANSPOSER_REGS_2D

    def group_regs(self, group: int) -> int:
        """setmaxnreg of producer warp group ``group`` (0: copier / decoders, 1: the second decoder group or the
        transposer, 2: ``mx_mma``'s second decoder group)."""
        return self.transposer_regs if self.mx_mma and group == 1 else self.producer_regs

    @property
    def raw_cols(self) -> int:
        """Elements per stored KV row: 576 (bf16 / fp8) or 288 packed bytes (mxfp4)."""
        return QK_DIM // 2 if self.kv_format == "mxfp4" else QK_DIM

    @property
    def shared_bytes(self) -> int:
        """Shared memory the kernel needs, in bytes: an upper bound of TileLang's allocation (the ring, Q, P, the
        barriers and the reductions' scratch, each rounded up to 1 KiB); tests/test_ws_structure.py checks it against
        the lowered kernel's ``dyn_shared_memory_buf``."""
        kib = lambda n: -(-n // 1024) * 1024  # noqa: E731
        if self.fp8_mma:  # 1-byte operands; per stage the codes and their V^T
            ring = self.num_stages * kib(self.block_n * QK_DIM) + self.vt_depth * kib(self.block_n * KV_LORA_RANK)
            q_terms = 2 if self.q_split else 1
            mx = kib(2 * self.num_stages * MX_COLUMN_BYTES) + kib(4 * 2 * dequant.MX_TABLES) if self.mx_mma else 0
            p_terms = 2 if self.p_split else 1
            return (ring + q_terms * kib(QK_DIM * self.block_m) + p_terms * kib(self.block_m * self.block_n) + 4 * 1024
                    + mx)
        ring = self.num_stages * kib(2 * self.block_n * QK_DIM)
        return ring + kib(2 * QK_DIM * self.block_m) + kib(2 * self.block_m * self.block_n) + 4 * 1024

    @property
    def name(self) -> str:
        fp8 = "fnuz" if self.fp8_dtype.endswith("fnuz") else "fn"
        return (
            f"mla_decode_ws_kv{self.kv_format}_q{self.q_format}_h{self.num_heads}_bh{self.block_h}"
            f"_bn{self.block_n}_st{self.num_stages}_r{self.consumer_regs}-{self.producer_regs}x{self.producer_groups}"
            f"{'_causal' if self.causal else ''}{f'_page{self.page_size}' if self.page_size else ''}_{fp8}"
            f"{f'_pf{self.l2_prefetch}' if self.l2_prefetch else ''}{'_ov' if self.overlap else ''}"
            f"{'_idle' if self.idle_producers else ''}{'_fs' if self.fast_softmax else ''}{'_sg' if self.score_group else ''}{'_dst' if self.direct_stores else ''}{'_od' if self.ordered_decode else ''}"
            f"{'_f8mma' if self.fp8_mma else ''}{'_ps' if self.p_split else ''}{'_sa' if self.score_ahead else ''}"
            f"{'_qs' if self.q_stack else ''}{'_pst' if self.p_stack else ''}"
            f"{f'_mxd{self.mx_decoders}' if self.mx_decoders != 1 else ''}{'_dyn' if self.dynamic_stage else ''}"
            f"{f'_vt{self.vt_stages}' if self.vt_stages and self.vt_stages != self.num_stages else ''}"
            f"{f'_pc{self.persistent_ctas}' if self.persistent_ctas else ''}"
            f"{f'_ql{self.q_loop_rows}' if self.q_loop_rows else ''}"
        )


def mla_decode_ws_kernel(cfg: WSDecodeKernelConfig, stream: str | None = None):
    """Returns the prim_func of the warp-specialised decode kernel for ``cfg``.

    Arguments (shapes in elements; dynamic dims symbolic):
      Q             (total_q, num_heads, 576) bf16 (fp8 codes when q_format == "fp8_codes")
      KV            (cache_rows, 576) bf16 | (cache_rows, 576) fp8 | (cache_rows, 288) uint8 (mxfp4 pairs)
      KV_scales     (scale_len,) uint8    mxfp4 e8m0 scales, flat; row t starts at t * scale_stride
      scale_stride  int32
      Q_scale       (1,) fp32             "fp8_codes": the Q scale; "fp8": amax(|Q|); "bf16": 1
      KV_scale      (1,) fp32             per-tensor KV scale (1 unless fp8)
      qo_indptr     (batch + 1,) int32
      kv_indptr     (batch + 1,) int32
      Page_table    (batch, max_pages) int32   only when page_size > 0
      sm_scale      fp32
      num_splits    int32                 KV splits per sequence (the grid's x dimension)
      O_partial     (o_len,) fp32         num_splits * total_q * num_heads * 512 when num_splits > 1 (else unused;
                                          the kernel's own order, see ``partial_index``)
      LSE_partial   (l_len,) fp32         num_splits * total_q * num_heads when num_splits > 1 (else unused)
      Semaphores    (sem_len,) int32      >= batch * num_heads / block_h entries, zero before the call; left zero
      Out           (total_q, num_heads, 512) bf16
      LSE           (total_q, num_heads) fp32, natural log; -inf (and Out 0) where no KV token is visible

    ``stream`` ("bench" or "check") returns ``mla_decode_stream_kernel``'s program instead.
    """
    heads, block_h, block_n, block_m = cfg.num_heads, cfg.block_h, cfg.block_n, cfg.block_m
    head_groups = heads // block_h
    stages = cfg.num_stages
    kv_cols = cfg.raw_cols
    kv_dtype = {"bf16": "bfloat16", "fp8": cfg.fp8_dtype, "mxfp4": "uint8"}[cfg.kv_format]
    q_dtype = cfg.fp8_dtype if cfg.q_format == "fp8_codes" else "bfloat16"
    bf16, f32 = "bfloat16", "float32"
    fp8_mma = cfg.fp8_mma
    if fp8_mma and stream:
        raise ValueError("fp8_mma has no decoders: the decode benchmark is the decoding kernels'")
    ring_dtype = cfg.fp8_dtype if fp8_mma else bf16  # the ring's MMA operands (and Q's, P's)
    decodes = cfg.kv_format != "bf16" and not fp8_mma
    mxfp4 = cfg.kv_format == "mxfp4"
    producer_threads = WARP_GROUP * cfg.producer_groups
    # "ready" completes when every filling thread arrived: cp.async arrivals (bf16, fp8_mma's copier), plain
    # arrivals (decoders).
    ready_count = WARP_GROUP if fp8_mma else producer_threads
    # fp8 tiles hold code * 2^-120 (tl_kernels.dequant): the factor returns in the score and output scales.
    decode_factor = dequant.FP8_BF16_FACTOR if decodes and cfg.kv_format == "fp8" else 1.0
    chunk_words = dequant.chunk_words(cfg.kv_format)

    total_q = T.dynamic("total_q")
    cache_rows = T.dynamic("cache_rows")
    indptr_len = T.dynamic("indptr_len")
    scale_len = T.dynamic("scale_len")
    o_len = T.dynamic("o_len")
    l_len = T.dynamic("l_len")
    sem_len = T.dynamic("sem_len")
    batch, max_pages = T.dynamic("batch, max_pages")

    def cache_row(k, pos):
        """Cache row of token ``pos`` of the CTA's sequence, clamped into the cache: offsets and page numbers are
        only checked on request (a host copy), so a bad one reads a wrong row, never outside the cache (and the
        clamp lets the compiler drop per-element bounds checks, which would block cp.async)."""
        if cfg.page_size:
            row = k.Page_table[k.seq_id, pos // cfg.page_size] * cfg.page_size + pos % cfg.page_size
        else:
            row = k.kv_begin + pos
        return T.min(T.max(row, 0), cache_rows - 1)

    def tile_pos(k, tile_lo, i):
        """Sequence position of row i of the tile starting at ``tile_lo``: rows past the split end repeat its last
        token (finite data, whose scores are masked)."""
        return T.min(tile_lo + i, k.split_hi - 1)

    def partial_index(split, qi, hg, d, r):
        """Element (dim d, row r) of a split's fp32 partial output: [split, query, head group, dim, row], the order
        of the accumulator's fragments, so each thread writes and reads back contiguous pairs of rows."""
        return (((split * total_q + qi) * head_groups + hg) * KV_LORA_RANK + d) * block_m + r

    def q_value(k, q_inv, qi, h, d, codes=False):
        """Q[query qi, head h, dim d] as bf16 (``steps.q_value``: 0 past the sequence's queries; a8w8 rounds it to
        fp8 values exactly as torch's per-tensor quantizer does; ``codes``: a8w8's fp8 code, for fp8_mma)."""
        return steps.q_value(k.Q, k.q_begin, k.q_len, qi, h, d, q_inv, q_format=cfg.q_format,
                             fp8_dtype=cfg.fp8_dtype, codes=codes)

    softmax_ctx = SimpleNamespace(block_m=block_m, block_n=block_n, token_axis=0, kv_major_loops=True,
                                  out_dims=KV_LORA_RANK, deferred_sum=cfg.fast_softmax,
                                  tr=functools.partial(steps.accumulator_index, True))

    persistent = cfg.persistent_ctas > 0

    def ring_parity(k, q_pass, rnd):
        """Parity of a stage's barriers in round ``rnd`` of pass ``q_pass``: every pass walks ``rounds`` rounds of
        all stages, so a tile's stage is static (``persistent_ctas``: after the ``ring_base`` rounds of the CTA's
        earlier items)."""
        if persistent:
            return (k.ring_base + q_pass * k.rounds + rnd) & 1
        return (q_pass * k.rounds + rnd) & 1

    def split_values(k, kv_indptr):
        """The work item's KV scalars as (name, value) in order, each value (a function) reading the ones before
        through ``k``: once per CTA (``cta_state``) or per work item (``item_state``)."""
        return [("kv_begin", lambda: kv_indptr[k.seq_id]),
                ("kv_len", lambda: kv_indptr[k.seq_id + 1] - kv_indptr[k.seq_id]),
                # Split s covers tokens [s * chunk, (s + 1) * chunk), chunk a multiple of block_n.
                ("chunk", lambda: steps.split_chunk(k.kv_len, k.num_splits, block_n)),
                ("split_lo", lambda: k.split_id * k.chunk),
                ("split_hi", lambda: T.min(k.split_lo + k.chunk, k.kv_len)),
                ("num_tiles", lambda: steps.tile_count(k.split_lo, k.split_hi, block_n)),
                ("rounds", lambda: T.ceildiv(k.num_tiles, stages))]

    def query_values(k, qo_indptr):
        """The work item's query scalars, as ``split_values`` (``consumer_state`` / ``item_state``)."""
        return [("q_begin", lambda: qo_indptr[k.seq_id]),
                ("q_len", lambda: qo_indptr[k.seq_id + 1] - qo_indptr[k.seq_id]),
                ("num_passes", lambda: T.max(k.q_len, 0))]

    # ---- ``persistent_ctas``: the CTA's work items (without it, one: the grid's, and these add no code)

    @T.macro
    def item_state(k, i):
        """The scalars of the CTA's i-th work item w = cta + i x grid (split fastest, then head group, then
        sequence), into its registers (``item_registers``): what ``cta_state`` / ``consumer_state`` compute once
        per CTA without persistent CTAs."""
        if persistent:
            k.item.split_id[0] = (k.cta + i * k.grid) % k.num_splits
            k.item.hg[0] = (k.cta + i * k.grid) // k.num_splits % head_groups
            k.item.seq_id[0] = (k.cta + i * k.grid) // (k.num_splits * head_groups)
            for name, value in split_values(k, k.kv_indptr) + query_values(k, k.qo_indptr):
                T.buffer_store(getattr(k.item, name), value(), [0])

    @T.macro
    def next_item(k):
        """Past a work item: every role walked its passes x rounds rounds of the ring."""
        if persistent:
            k.item.ring_base[0] = k.ring_base + k.num_passes * k.rounds

    @T.macro
    def each_item(k, step):
        """A role's ``step(k)`` for each of the CTA's work items (without persistent CTAs: once, for the grid's
        item)."""
        if persistent:
            for item in T.serial(k.cta_items):
                item_state(k, item)
                step(k)
                next_item(k)
        else:
            step(k)

    # ``dynamic_stage``: the fp8 ring's stages side by side in one buffer per operand, at these byte steps (1-byte
    # codes; TileLang's 128-byte swizzle lays the latent codes out in 8 KiB panels of 128 columns, so the stage of
    # columns s * 512 .. starts s * 4 panels in).
    dyn = cfg.dynamic_stage
    lat_stage_bytes, rope_stage_bytes, vt_stage_bytes = block_n * KV_LORA_RANK, block_n * ROPE_DIM, KV_LORA_RANK * block_n

    vt_split = cfg.vt_depth != stages  # V^T stage and parity from the slot G, apart from the codes'

    # (Plain functions, not assignments inside the macros: an assignment there binds a named variable, which would
    # change the generated code of the rings without ``vt_stages``.)
    def vt_stage(k, q_pass, t, s):
        """The V^T stage of slot t of pass ``q_pass``: with ``vt_stages``, slot G = q_pass x slots per pass + t takes
        stage G % vt_stages; else the codes' stage ``s``."""
        return (q_pass * k.rounds * stages + t) % cfg.vt_depth if vt_split else s

    def vt_parity(k, q_pass, t, parity):
        """The parity of that V^T stage's barriers: (G // vt_stages) & 1; else the codes' ``parity``."""
        return ((q_pass * k.rounds * stages + t) // cfg.vt_depth) & 1 if vt_split else parity

    def vt_region(k, v):
        """V^T stage ``v`` (a wgmma operand: 512 rows of the V^T ring)."""
        return k.Vt[v * KV_LORA_RANK:(v + 1) * KV_LORA_RANK, :]

    def either(override, value):
        """``override`` where given (``attend_tile``'s V^T stage and parity), else ``value``."""
        return value if override is None else override

    def lat_stage(k, s):
        """Stage ``s``'s latent codes (a wgmma operand): its named buffer, or its columns of the one ring buffer."""
        if dyn:
            return k.Ring_lat_all[:, s * KV_LORA_RANK:(s + 1) * KV_LORA_RANK]
        return k.Ring_lat[s]

    def rope_stage(k, s):
        """Stage ``s``'s rope codes (a wgmma operand): its named buffer, or its rows of the one ring buffer."""
        if dyn:
            return k.Ring_rope_all[s * block_n:(s + 1) * block_n, :]
        return k.Ring_rope[s]

    # ------------------------------------------------------------------------------------------- producers

    # A contiguous run of cache rows: a whole tile in a flat cache, else the largest run inside one page.
    prefetch_run = math.gcd(cfg.page_size, block_n) if cfg.page_size else block_n
    row_bytes = kv_cols * (2 if kv_dtype == "bfloat16" else 1)  # a stored row: bf16, fp8 codes or mxfp4 pairs
    vec = 16 if fp8_mma else 8  # elements of one 16-byte cp.async (copy_tiles)

    @T.macro
    def prefetch_tile(k, tile):
        """L2 prefetch of tile ``tile``'s rows (and mxfp4 scale rows): producer thread p takes run p of the tile
        (with ``ordered_decode``, consumer thread p: a decoder's divergent branch makes ptxas wait for all of its
        outstanding loads first)."""
        p = k.tx if cfg.ordered_decode else k.tx - CONSUMER_THREADS
        i = p * prefetch_run
        if tile < k.num_tiles and p < block_n // prefetch_run:
            tile_lo = k.split_lo + tile * block_n
            if tile_lo + i < k.split_hi:
                rows = T.min(prefetch_run, k.split_hi - tile_lo - i)
                row = cache_row(k, tile_lo + i)
                T.evaluate(dequant.prefetch_l2(k.KV[row, 0], rows * row_bytes))
                if mxfp4:
                    T.evaluate(dequant.prefetch_l2(k.KV_scales[row * k.scale_stride], rows * k.scale_stride))

    @T.macro
    def prefetch_ahead(k, tile):
        """Before tile ``tile`` waits for its stage: the prefetch of the tile ``l2_prefetch`` ahead (decoders)."""
        if cfg.l2_prefetch and not cfg.ordered_decode:
            prefetch_tile(k, tile + cfg.l2_prefetch)

    @T.macro
    def prefetch_prologue(k, first):
        """A pass's first prefetches: tiles ``first`` .. l2_prefetch - 1 (the loop then keeps l2_prefetch ahead).
        With ``ordered_decode`` the consumer issues them, one tile further ahead (it runs a tile behind the decoders):
        tiles ``first`` .. l2_prefetch at a pass's start, tile t + l2_prefetch + 1 before it waits for tile t."""
        for t in list(range(first, cfg.l2_prefetch + (1 if cfg.ordered_decode else 0))):
            prefetch_tile(k, t)

    @T.macro
    def pass_tiles(k):
        """Benchmark only (``idle_producers``): stages passed along untouched, so only the MMA warp group works."""
        T.set_max_nreg(cfg.producer_regs, 0)
        for q_pass in T.serial(k.num_passes):
            for rnd in T.serial(k.rounds):
                for s in list(range(stages)):
                    T.barrier_wait(k.free[s], ring_parity(k, q_pass, rnd) ^ 1)
                    T.barrier_arrive(k.ready[s])

    @T.macro
    def copy_tiles(k):
        """bf16 (and ``fp8_mma``'s fp8 codes): each tile's rows, 16-byte cp.async chunks (consecutive threads on
        consecutive chunks of a row), into the next free stage."""
        T.set_max_nreg(cfg.producer_regs, 0)
        p = k.tx - CONSUMER_THREADS
        for q_pass in T.serial(k.num_passes):
            prefetch_prologue(k, 0)
            for rnd in T.serial(k.rounds):
                for s in list(range(stages)):  # static: the stage picks named buffers
                    tile = rnd * stages + s
                    tile_lo = k.split_lo + tile * block_n
                    prefetch_ahead(k, tile)
                    T.barrier_wait(k.free[s], ring_parity(k, q_pass, rnd) ^ 1)
                    if tile < k.num_tiles:
                        for dst, col0, cols in ((k.Ring_lat[s], 0, KV_LORA_RANK), (k.Ring_rope[s], KV_LORA_RANK, ROPE_DIM)):
                            per_row = cols // vec
                            for c in T.unroll(block_n * per_row // WARP_GROUP):
                                i = (p + c * WARP_GROUP) // per_row
                                col = (p + c * WARP_GROUP) % per_row * vec
                                row = cache_row(k, tile_pos(k, tile_lo, i))
                                T.ptx_cp_async(
                                    T.access_ptr(dst[i, col], "w", vec), T.access_ptr(k.KV[row, col0 + col], "r", vec),
                                    vec,
                                )
                    T.cp_async_barrier_noinc(k.ready[s])

    @T.macro
    def copy_item_one_copy(k):
        """One work item's passes of ``copy_tiles_one_copy``."""
        p = k.tx - CONSUMER_THREADS
        for q_pass in T.serial(k.num_passes):
            prefetch_prologue(k, 0)
            for t in T.serial(k.rounds * stages):
                s = t % stages
                tile_lo = k.split_lo + t * block_n
                prefetch_ahead(k, t)
                T.barrier_wait(k.free[s], ring_parity(k, q_pass, t // stages) ^ 1)
                if t < k.num_tiles:
                    for dst, col0, cols in ((StageView(k.Ring_lat_all, s, cols=KV_LORA_RANK), 0, KV_LORA_RANK),
                                            (StageView(k.Ring_rope_all, s, rows=block_n), KV_LORA_RANK, ROPE_DIM)):
                        per_row = cols // vec
                        for c in T.unroll(block_n * per_row // WARP_GROUP):
                            i = (p + c * WARP_GROUP) // per_row
                            col = (p + c * WARP_GROUP) % per_row * vec
                            row = cache_row(k, tile_pos(k, tile_lo, i))
                            T.ptx_cp_async(
                                T.access_ptr(dst[i, col], "w", vec), T.access_ptr(k.KV[row, col0 + col], "r", vec),
                                vec,
                            )
                T.cp_async_barrier_noinc(k.ready[s])

    @T.macro
    def copy_tiles_one_copy(k):
        """``dynamic_stage``: ``copy_tiles`` in one copy of the tile step, tile t into stage t % stages (a register)
        through ``StageView``s of the one ring buffer per operand; per work item (``persistent_ctas``)."""
        T.set_max_nreg(cfg.producer_regs, 0)
        each_item(k, copy_item_one_copy)

    @T.macro
    def transpose_item_one_copy(k):
        """One work item's passes of ``transpose_tiles_one_copy``."""
        p = k.tx - CONSUMER_THREADS - WARP_GROUP
        for q_pass in T.serial(k.num_passes):
            for t in T.serial(k.rounds * stages):
                s = t % stages
                parity = ring_parity(k, q_pass, t // stages)
                T.barrier_wait(k.ready[s], parity)
                # every slot, tile or not (see transpose_tiles)
                T.barrier_wait(k.vt_free[vt_stage(k, q_pass, t, s)], vt_parity(k, q_pass, t, parity) ^ 1)
                if t < k.num_tiles:
                    T.evaluate(dequant.transpose_v_fp8(k.vt_addr[0] + s * lat_stage_bytes,
                                                       k.vt_addr[1] + vt_stage(k, q_pass, t, s) * vt_stage_bytes, p))
                    T.fence_proxy_async()  # generic-proxy stores, read next by wgmma
                T.barrier_arrive(k.vt_ready[vt_stage(k, q_pass, t, s)])
                T.barrier_arrive(k.free[s])

    @T.macro
    def transpose_tiles_one_copy(k):
        """``dynamic_stage``: ``transpose_tiles`` in one copy of the tile step (stage t % stages, a register; its
        codes and V^T at the stage's byte offsets)."""
        T.set_max_nreg(cfg.group_regs(1), 0)
        k.vt_addr[0] = dequant.smem_addr(k.Ring_lat_all[0, 0])
        k.vt_addr[1] = dequant.smem_addr(k.Vt[0, 0])
        each_item(k, transpose_item_one_copy)

    @T.macro
    def transpose_tiles(k):
        """``fp8_mma``: per tile, once its codes have landed (the copier's or the mxfp4 decoder's "ready") and the
        V^T stage of the same index is free (the MMA warp group's "vt_free", after the P V two tiles back), its V^T
        into that stage; then "vt_ready", and its share of the ring stage's release ("free": the codes are read)."""
        T.set_max_nreg(cfg.group_regs(1), 0)
        p = k.tx - CONSUMER_THREADS - WARP_GROUP
        for s in list(range(stages)):
            k.vt_addr[2 * s] = dequant.smem_addr(k.Ring_lat[s][0, 0])
            k.vt_addr[2 * s + 1] = dequant.smem_addr(k.Vt[s * KV_LORA_RANK, 0])
        if cfg.score_ahead:  # every V^T byte defined before any P V reads it (a slot without a tile included)
            T.evaluate(dequant.zero_shared(k.vt_addr[1], stages * KV_LORA_RANK * block_n, p, WARP_GROUP))
            T.fence_proxy_async()
            T.sync_threads(6, WARP_GROUP)  # no transposer thread writes V^T(0) before every zero has landed
        for q_pass in T.serial(k.num_passes):
            for rnd in T.serial(k.rounds):
                for s in list(range(stages)):
                    tile = rnd * stages + s
                    T.barrier_wait(k.ready[s], ring_parity(k, q_pass, rnd))
                    # Every round, tile or not: each side of the V^T ring waits before it arrives, so no barrier
                    # ever completes two phases ahead of its waiter (a parity wait would then hang).
                    T.barrier_wait(k.vt_free[s], ring_parity(k, q_pass, rnd) ^ 1)
                    if tile < k.num_tiles:
                        T.evaluate(dequant.transpose_v_fp8(k.vt_addr[2 * s], k.vt_addr[2 * s + 1], p))
                        T.fence_proxy_async()  # generic-proxy stores, read next by wgmma
                    T.barrier_arrive(k.vt_ready[s])
                    T.barrier_arrive(k.free[s])

    # ---- ``mx_mma``: the mxfp4 decoder (producer group 0; the transposer above is group 1)

    def column_slot(s, parity):
        """``mx_mma``: the slot of ``mx_cols`` holding the column values of the tile in stage ``s`` of a round of
        parity ``parity`` (written by the decoder, read by the MMA warp group after it has released the stage)."""
        return s + stages * parity

    def mx_place(k, b):
        """(code column, scale column) of the decoder thread's block b: latent blocks 8 h + b (b < 8), rope block
        16 + h (b == 8)."""
        if b < MX_BLOCKS - 1:
            return 128 * k.mx_h + 16 * b, 8 * k.mx_h + b
        return KV_LORA_RANK // 2 + 16 * k.mx_h, 16 + k.mx_h

    def mx_chunk_addr(k, s, b, half):
        """Shared address of chunk ``half`` (codes 16 half .. + 15) of block b in stage s, in TileLang's swizzles of
        the ring (those the transposer assumes; tests/test_ws_structure.py checks them): latent chunk c = 2 b + half
        of row i in panel 2 h + c / 8 at 16-byte slot (c % 8) ^ (i % 8); rope chunk 2 h + half of row i (64-byte
        rows) at slot (2 h + half) ^ (i / 2 % 4)."""
        i = k.mx_token
        if b < MX_BLOCKS - 1:
            c = 2 * b + half
            return (k.mx_addr[2 * s] + (2 * k.mx_h + c // 8) * 8192 + i * 128
                    + T.shift_left(T.bitwise_xor(c % 8, i % 8), 4))
        return k.mx_addr[2 * s + 1] + i * 64 + T.shift_left(T.bitwise_xor(2 * k.mx_h + half, i // 2 % 4), 4)

    @T.macro
    def mx_fetch_block(k, buf, b):
        """Issue the loads of block b (16 bytes of codes, its scale byte) of row ``k.mx_row[buf]`` into register
        buffer ``buf``."""
        col, scol = mx_place(k, b)
        T.evaluate(dequant.load_vector(k.mx_raw[(buf * MX_BLOCKS + b) * 4], k.KV[k.mx_row[buf], col], 16))
        k.mx_scale[buf * MX_BLOCKS + b] = dequant.load_byte(k.KV_scales[k.mx_row[buf] * k.scale_stride + scol])

    @T.macro
    def mx_store_tile(k, s, buf, parity, next_lo, addr_s=None):
        """Register buffer ``buf`` (the token's half of the tile) into stage ``s``: the token exponent (one
        shuffle with the partner thread), the consumer's column values (the even thread), then per block its e4m3
        codes, and as each block's registers free up the load of the same block of the stage's next tile, two ahead
        (starting at ``next_lo``; None: no such tile). ``addr_s``: the static index of the stage's addresses in
        ``mx_addr`` when ``s`` is not static (``mx_decoders``)."""
        addr_s = s if addr_s is None else addr_s
        k.mx_exp[0] = dequant.mx_token_exp(k.mx_raw[buf * MX_WORDS], k.mx_scale[buf * MX_BLOCKS])
        if k.mx_h == 0:
            T.evaluate(dequant.mx_store_columns(
                k.mx_addr[2 * stages + 1] + column_slot(s, parity) * MX_COLUMN_BYTES + k.mx_token * 4, k.mx_exp[0]))
        if next_lo is not None:
            k.mx_row[buf] = cache_row(k, tile_pos(k, next_lo, k.mx_token))
        for b in list(range(MX_BLOCKS)):
            T.evaluate(dequant.mx_block_to_e4m3(mx_chunk_addr(k, addr_s, b, 0), mx_chunk_addr(k, addr_s, b, 1),
                                                k.mx_raw[(buf * MX_BLOCKS + b) * 4], k.mx_scale[buf * MX_BLOCKS + b],
                                                k.mx_exp[0], k.mx_addr[2 * stages]))
            if next_lo is not None:
                mx_fetch_block(k, buf, b)

    @T.macro
    def mx_fill_stage(k, q_pass, rnd, s, buf, addr_s=None):
        """``mx_mma``: stage ``s``'s tile of round ``rnd`` from register buffer ``buf``: wait for the stage to be
        free, write its e4m3 codes and column values (loading the stage's next tile), fence, "ready" (the transposer
        then writes its V^T). A round without a tile still waits and arrives (the barriers' phases stay in step).
        ``addr_s`` (a register stage, ``mx_stage_loop``): the static index of its addresses; the next tile's loads
        are then issued whether or not the split has one (one copy of the store code, rows clamped)."""
        tile = rnd * stages + s
        parity = ring_parity(k, q_pass, rnd)
        T.barrier_wait(k.free[s], parity ^ 1)
        if tile < k.num_tiles:
            if addr_s is not None:
                mx_store_tile(k, s, buf, parity, k.split_lo + (tile + stages) * block_n, addr_s=addr_s)
            elif tile + stages < k.num_tiles:
                mx_store_tile(k, s, buf, parity, k.split_lo + (tile + stages) * block_n)
            else:
                mx_store_tile(k, s, buf, parity, None)
            T.fence_proxy_async()  # generic-proxy stores, read next by wgmma
        T.barrier_arrive(k.ready[s])

    @T.macro
    def mx_first_load(k, tile, buf):
        """``mx_mma``: a pass's first load of tile ``tile`` (if the split has it) into register buffer ``buf``."""
        if tile < k.num_tiles:
            k.mx_row[buf] = cache_row(k, tile_pos(k, k.split_lo + tile * block_n, k.mx_token))
            for b in list(range(MX_BLOCKS)):
                mx_fetch_block(k, buf, b)

    @T.macro
    def mx_stage_loop(k):
        """``mx_decoders`` == stages: decoder group s fills stage s only (tiles s, s + stages, ...), from one
        register buffer, in one copy of the code for every group: the stage is a register (``mx_stage``), its ring
        addresses are ``mx_addr[0]`` / ``[1]``, and the next tile's loads are issued whether or not the split has one
        (rows clamped into the split: a few redundant loads at a pass's end instead of a second copy of the store
        code). The unrolled decode is ~25 KB of SASS per copy: one copy fewer per group keeps the roles' per-tile code
        within the SM's instruction caches (run 54: two copies, 708 us at 256 x 8192 on an H100)."""
        s = k.mx_stage
        for q_pass in T.serial(k.num_passes):
            mx_first_load(k, s, 0)
            for rnd in T.serial(k.rounds):
                mx_fill_stage(k, q_pass, rnd, s, 0, addr_s=0)

    @T.macro
    def decode_mx_tiles(k):
        """``mx_mma``: the decoder's tiles are loaded two ahead; per tile ``mx_fill_stage``. One decoder group fills
        every stage (register buffer s for stage s); with ``mx_decoders`` == stages each group its own stage."""
        T.set_max_nreg(cfg.producer_regs, 0)
        if cfg.mx_decoders == 1:
            for s in list(range(stages)):
                k.mx_addr[2 * s] = dequant.smem_addr(k.Ring_lat[s][0, 0])
                k.mx_addr[2 * s + 1] = dequant.smem_addr(k.Ring_rope[s][0, 0])
        elif dyn:  # the group's own stage at index 0: its byte offset in the one ring buffer per operand
            k.mx_addr[0] = dequant.smem_addr(k.Ring_lat_all[0, 0]) + T.cast(k.mx_stage, "uint32") * lat_stage_bytes
            k.mx_addr[1] = dequant.smem_addr(k.Ring_rope_all[0, 0]) + T.cast(k.mx_stage, "uint32") * rope_stage_bytes
        else:  # the group's own stage (two stages: 0 or 1) at index 0
            k.mx_addr[0] = T.if_then_else(k.mx_stage == 0, dequant.smem_addr(k.Ring_lat[0][0, 0]),
                                          dequant.smem_addr(k.Ring_lat[1][0, 0]))
            k.mx_addr[1] = T.if_then_else(k.mx_stage == 0, dequant.smem_addr(k.Ring_rope[0][0, 0]),
                                          dequant.smem_addr(k.Ring_rope[1][0, 0]))
        k.mx_addr[2 * stages] = dequant.smem_addr(k.mx_table[0])
        k.mx_addr[2 * stages + 1] = dequant.smem_addr(k.mx_cols[0])
        # The decode tables: every decoder thread writes all of them and reads only what it wrote itself (the same
        # words; a second decoder group writes the same values), so no barrier orders the threads' writes.
        for w, word in enumerate(dequant.mx_table_words()):
            k.mx_table[w] = T.uint32(word)
        if cfg.mx_decoders == 1:
            for q_pass in T.serial(k.num_passes):
                for first in list(range(stages)):
                    mx_first_load(k, first, first)
                for rnd in T.serial(k.rounds):
                    for s in list(range(stages)):  # static: stage s and register buffer s hold tiles t = s (mod 2)
                        mx_fill_stage(k, q_pass, rnd, s, s)
        else:
            mx_stage_loop(k)

    def chunk_place(k, j):
        """(tile row, first dim) of the decoder thread's chunk j (see CHUNKS_PER_THREAD)."""
        if j < LATENT_CHUNKS:
            return LATENT_CHUNKS * j + k.r8, 64 * k.warp + 16 * k.c4
        return 8 * k.warp + k.r8, KV_LORA_RANK + 16 * k.c4

    @T.macro
    def fetch_chunk(k, buf, tile_lo, j):
        """Issue the load of chunk j of the tile starting at ``tile_lo`` (codes, and the mxfp4 scale byte) into
        register buffer ``buf``."""
        i, dim = chunk_place(k, j)
        row = cache_row(k, tile_pos(k, tile_lo, i))
        word = (buf * CHUNKS_PER_THREAD + j) * chunk_words
        dequant.load_chunk(cfg.kv_format, k.raw[word], k.scale, buf * CHUNKS_PER_THREAD + j, k.KV, k.KV_scales,
                           k.scale_stride, row, dim)

    @T.macro
    def fetch_tile(k, buf, tile_lo):
        for j in list(range(CHUNKS_PER_THREAD)):
            fetch_chunk(k, buf, tile_lo, j)

    @T.macro
    def store_tile(k, s, next_lo):
        """Decode register buffer ``s`` into stage ``s`` (16 bf16 per chunk, two 16-byte stores); as each chunk's
        registers free up, issue the load of the same chunk of the tile two ahead (starting at ``next_lo``; None:
        no such tile), so every tile's loads are in flight for two tiles' time with only two tiles of registers."""
        for j in list(range(CHUNKS_PER_THREAD)):
            i, dim = chunk_place(k, j)
            word = (s * CHUNKS_PER_THREAD + j) * chunk_words
            z = k.zero[0] if cfg.ordered_decode else None  # keeps the decode below the free-stage wait
            T.evaluate(dequant.decode_chunk(cfg.kv_format, k.vals[0], k.raw[word],
                                            k.scale[s * CHUNKS_PER_THREAD + j] if mxfp4 else None, z))
            if next_lo is not None:
                fetch_chunk(k, s, next_lo, j)
            if cfg.direct_stores:
                # chunk j's rows are 8 j + r8: 8 rows (1 KiB of the swizzled panel) past chunk 0's
                addr = k.ring_addr[2 * s] + j * 1024 if j < LATENT_CHUNKS else k.ring_addr[2 * s + 1]
                T.evaluate(dequant.store_swizzled_32(addr, k.vals[0]))
            else:
                dst, col = (k.Ring_lat[s], dim) if j < LATENT_CHUNKS else (k.Ring_rope[s], dim - KV_LORA_RANK)
                for v in T.vectorized(dequant.CHUNK):
                    dst[i, col + v] = k.vals[v]

    @T.macro
    def decode_tiles(k):
        """fp8 / mxfp4: tiles t and t + 1 are loaded ahead; per tile, wait for a free stage, decode into it."""
        T.set_max_nreg(cfg.producer_regs, 0)
        if cfg.ordered_decode:
            # The shared 0 that mbar_wait_zero reads after each wait, written by every decoder thread itself (all
            # write 0, so each one's later reads see 0 with no barrier between the roles).
            k.zero_word[0] = 0
        if cfg.direct_stores:
            # Per stage, the shared addresses of this thread's chunk 0 (latent) and rope chunk, once.
            for s in list(range(stages)):
                i0, d0 = chunk_place(k, 0)
                ir, dr = chunk_place(k, LATENT_CHUNKS)
                k.ring_addr[2 * s] = dequant.smem_addr(k.Ring_lat[s][i0, d0])
                k.ring_addr[2 * s + 1] = dequant.smem_addr(k.Ring_rope[s][ir, dr - KV_LORA_RANK])
        for q_pass in T.serial(k.num_passes):
            for first in list(range(stages)):
                if first < k.num_tiles:
                    fetch_tile(k, first, k.split_lo + first * block_n)
            if not cfg.ordered_decode:
                prefetch_prologue(k, stages)  # tiles 0 .. stages - 1 are already on their way into registers
            for rnd in T.serial(k.rounds):
                for s in list(range(stages)):  # static: stage s and register buffer s hold tiles t = s (mod 2)
                    tile = rnd * stages + s
                    tile_lo = k.split_lo + tile * block_n
                    prefetch_ahead(k, tile)
                    if cfg.ordered_decode:
                        k.zero[0] = dequant.mbar_wait_zero(k.free[s], ring_parity(k, q_pass, rnd) ^ 1,
                                                           k.zero_word[0])
                    else:
                        T.barrier_wait(k.free[s], ring_parity(k, q_pass, rnd) ^ 1)
                    if tile < k.num_tiles:
                        if tile + stages < k.num_tiles:
                            store_tile(k, s, tile_lo + stages * block_n)
                        else:
                            store_tile(k, s, None)
                        T.fence_proxy_async()  # generic-proxy stores, read next by wgmma
                    T.barrier_arrive(k.ready[s])

    @T.macro
    def produce(k):
        if cfg.idle_producers:
            pass_tiles(k)
        elif fp8_mma:
            # group 0 (threads 128 ..): copier or mxfp4 decoder; group 1: transposer; group 2: second mxfp4 decoder
            if cfg.producer_groups == 3:
                if k.tx < CONSUMER_THREADS + WARP_GROUP or k.tx >= CONSUMER_THREADS + 2 * WARP_GROUP:
                    decode_mx_tiles(k)
                elif dyn:
                    transpose_tiles_one_copy(k)
                else:
                    transpose_tiles(k)
            elif k.tx < CONSUMER_THREADS + WARP_GROUP:
                if cfg.mx_mma:
                    decode_mx_tiles(k)
                elif dyn:
                    copy_tiles_one_copy(k)
                else:
                    copy_tiles(k)
            elif dyn:
                transpose_tiles_one_copy(k)
            else:
                transpose_tiles(k)
        elif decodes:
            decode_tiles(k)
        else:
            copy_tiles(k)

    # -------------------------------------------------------------------------------------------- consumer

    q_rows = cfg.q_loop_rows or block_m  # rows per step of the Q loops (``q_loop_rows``; else one step of all)

    @T.macro
    def q_codes_rows(k, q_pass, q_inv, r0):
        """Rows r0 .. r0 + q_rows - 1 of Q's shared tiles as codes (fp8_mma) or bf16 values."""
        for r, d in T.Parallel(q_rows, KV_LORA_RANK):
            k.Q_lat[r0 + r, d] = q_value(k, q_inv, q_pass, k.hg * block_h + (r0 + r), d, codes=fp8_mma)
        for r, d in T.Parallel(q_rows, ROPE_DIM):
            k.Q_rope[r0 + r, d] = q_value(k, q_inv, q_pass, k.hg * block_h + (r0 + r), KV_LORA_RANK + d,
                                          codes=fp8_mma)

    @T.macro
    def load_q_codes(k, q_pass, q_inv):
        if cfg.q_loop_rows:
            for rb in T.serial(block_m // q_rows):
                q_codes_rows(k, q_pass, q_inv, rb * q_rows)
        else:
            q_codes_rows(k, q_pass, q_inv, 0)

    def q_terms(k, q_pass, r, d):
        """``q_split``: Q[query q_pass, row r, dim d] times its row's scale (exact: a power of two) as its two e4m3
        terms (hi, lo): hi = e4m3(x), lo = e4m3((x - hi) * Q_SPLIT_LO)."""
        x = T.cast(q_value(k, None, q_pass, k.hg * block_h + r, d), f32) * k.q_row_scale[r]
        hi = T.cast(x, ring_dtype)
        return hi, T.cast((x - T.cast(hi, f32)) * Q_SPLIT_LO, ring_dtype)

    q_lo_row = block_m if cfg.q_stack else 0  # ``q_split``: the first row of the lo term in its buffer

    def q_lo(k, rope):
        """``q_split``: the buffer of the lo term (Q_lat / Q_rope below the hi rows with ``q_stack``, else its own);
        a function, not a macro assignment, which would rename the buffer in the generated code."""
        if cfg.q_stack:
            return k.Q_rope if rope else k.Q_lat
        return k.Q_rope_lo if rope else k.Q_lat_lo

    @T.macro
    def q_split_rows(k, q_pass, r0):
        """``q_split``: rows r0 .. r0 + q_rows - 1 of bf16 Q as their two e4m3 terms: hi into Q_lat / Q_rope, lo into
        their rows block_m .. (``q_stack``) or into Q_lat_lo / Q_rope_lo."""
        for r, d in T.Parallel(q_rows, KV_LORA_RANK):
            k.Q_lat[r0 + r, d], q_lo(k, False)[q_lo_row + (r0 + r), d] = q_terms(k, q_pass, r0 + r, d)
        for r, d in T.Parallel(q_rows, ROPE_DIM):
            k.Q_rope[r0 + r, d], q_lo(k, True)[q_lo_row + (r0 + r), d] = q_terms(k, q_pass, r0 + r, KV_LORA_RANK + d)

    @T.macro
    def load_q_split(k, q_pass):
        """``q_split``: each Q row's amax, its power-of-two scale (the inverse kept in shared memory for the scores,
        ``q_row_factor``), and the row as hi / lo e4m3 terms (``Q_SPLIT_LO``)."""
        # amax per row: thread t takes 72 dims of row t / 8, the 8 partial maxima meet in shared memory
        row, seg = k.tx // 8, k.tx % 8
        k.q_max[0] = 0
        for i in T.serial(QK_DIM // 8):
            k.q_max[0] = T.max(k.q_max[0], T.abs(T.cast(q_value(k, None, q_pass, k.hg * block_h + row,
                                                                 seg * (QK_DIM // 8) + i), f32)))
        k.q_partial[k.tx] = k.q_max[0]
        T.sync_threads(1, CONSUMER_THREADS)
        if seg == 0:  # amax_r into [2^7, 2^8): exact powers of two (an all-zero row: any)
            for i in T.serial(7):
                k.q_max[0] = T.max(k.q_max[0], k.q_partial[k.tx + 1 + i])
            k.q_max[0] = T.floor(T.log2(T.max(k.q_max[0], 1e-30)))  # the row's exponent
            k.q_row_factor[row] = T.exp2(k.q_max[0] - Q_SPLIT_TOP)
            k.q_row_scale[row] = T.exp2(Q_SPLIT_TOP - k.q_max[0])
        T.sync_threads(1, CONSUMER_THREADS)
        if cfg.q_loop_rows:
            for rb in T.serial(block_m // q_rows):
                q_split_rows(k, q_pass, rb * q_rows)
        else:
            q_split_rows(k, q_pass, 0)

    @T.macro
    def load_q(k, q_pass, q_inv):
        """This pass's Q rows (row r = head hg * block_h + r of query q_pass) into shared memory (``fp8_mma``: their
        fp8 codes)."""
        if cfg.q_split:
            load_q_split(k, q_pass)
        else:
            load_q_codes(k, q_pass, q_inv)

    def tile_max_scratch(k, s):
        """``fast_softmax``: the address of stage ``s``'s slot of the tile-max scratch; else None (TileLang's
        reduction)."""
        return k.tile_max.access_ptr("rw", offset=s * 64) if cfg.fast_softmax else None

    def mx_column(k, slot, array, j):
        """``mx_mma``: token j's value in column array ``array`` of column slot ``slot`` (0: the score factor
        2^(E - 133), 1: the softmax offset E - 133, 2: the denominator weight 2^(133 - E))."""
        return k.mx_cols[slot * (MX_COLUMN_BYTES // 4) + array * block_n + j]

    def scaled_score(k, j, r, score_scale, slot):
        """Score (token j, row r) of the finished S^T times the score scale. ``q_split``: the two terms' scores summed
        and the row's Q scale undone first. ``mx_mma`` (column slot ``slot``): then times the token's factor
        2^(E - 133), plus E - 133 (its values' factor, carried into P: P' = P 2^(E - 133); the denominator is
        weighted back by 2^(133 - E), ``softmax_probabilities``' ``weight``)."""
        if not cfg.q_split:
            return k.acc_s[j, r] * score_scale
        if cfg.q_stack:  # (the lo half moved into acc_s_lo first: ``mask_scores``)
            both = k.acc_s2[j, r] + k.acc_s_lo[j, r] * (1.0 / Q_SPLIT_LO)
        else:
            both = k.acc_s[j, r] + k.acc_s_lo[j, r] * (1.0 / Q_SPLIT_LO)
        score = both * (score_scale * k.q_row_factor[r])
        if cfg.mx_mma:
            score = score * mx_column(k, slot, 0, j) + mx_column(k, slot, 1, j)
        return score

    @T.macro
    def mask_scores(k, tile_lo, horizon, score_scale, slot=None):
        """The finished scores, scaled (``scaled_score``); -inf past the horizon (split end, causal)."""
        if cfg.q_stack:
            # the lo term's half of S^T into a fragment of its own (one loop may index a buffer one way only; the
            # same thread holds both halves, so this is a register move)
            for j, r in T.Parallel(block_n, block_m):
                k.acc_s_lo[j, r] = k.acc_s2[j, block_m + r]
        for j, r in T.Parallel(block_n, block_m):
            k.acc_s[j, r] = T.if_then_else(tile_lo + j < horizon, scaled_score(k, j, r, score_scale, slot),
                                           -T.infinity(f32))

    def p_terms(p):
        """``p_split``: P (at most 1) times P_FP8_SCALE as two e4m3 terms, hi = e4m3(x), lo = e4m3(x - hi)."""
        x = p * P_FP8_SCALE
        hi = T.cast(x, ring_dtype)
        return hi, T.cast(x - T.cast(hi, f32), ring_dtype)

    @T.macro
    def store_p(k):
        """The probabilities as bf16 into shared memory, P V's B operand (``fp8_mma``: fp8 times P_FP8_SCALE)."""
        for r, j in T.Parallel(block_m, block_n):
            if cfg.p_stack:
                k.P_shared[r, j], k.P_shared[block_m + r, j] = p_terms(k.acc_s[j, r])
            elif cfg.p_split:
                k.P_shared[r, j], k.P_shared_lo[r, j] = p_terms(k.acc_s[j, r])
            elif fp8_mma:
                k.P_shared[r, j] = T.cast(k.acc_s[j, r] * P_FP8_SCALE, ring_dtype)
            else:
                k.P_shared[r, j] = T.cast(k.acc_s[j, r], bf16)

    # The score and P V wgmma issued without a wait (``T.wgmma_gemm``): the pipelined consumer (``overlap``) and
    # ``score_group`` wait for them where they need their results.

    @T.macro
    def issue_scores(k, s):
        """S^T = K Q^T of the tile in stage ``s``: two wgmma groups (latent, rope), not waited for."""
        if cfg.q_stack:  # both Q terms' scores in one accumulator of 2 x block_m columns
            T.wgmma_gemm(lat_stage(k, s), k.Q_lat, k.acc_s2, transpose_B=True, clear_accum=True)
            T.wgmma_gemm(rope_stage(k, s), k.Q_rope, k.acc_s2, transpose_B=True)
        else:
            T.wgmma_gemm(lat_stage(k, s), k.Q_lat, k.acc_s, transpose_B=True, clear_accum=True)
            T.wgmma_gemm(rope_stage(k, s), k.Q_rope, k.acc_s, transpose_B=True)
            if cfg.q_split:  # the lo term's scores
                T.wgmma_gemm(lat_stage(k, s), k.Q_lat_lo, k.acc_s_lo, transpose_B=True, clear_accum=True)
                T.wgmma_gemm(rope_stage(k, s), k.Q_rope_lo, k.acc_s_lo, transpose_B=True)

    @T.macro
    def issue_pv(k, s):
        """O^T += V^T P^T of the tile in stage ``s`` (P of that tile in ``P_shared``): one wgmma group, not waited."""
        T.wgmma_gemm(k.Ring_lat[s], k.P_shared, k.acc_o, transpose_A=True, transpose_B=True)

    @T.macro
    def probabilities(k, s, tile_lo, horizon, score_scale, slot=None):
        """Mask and scale the finished scores of the tile in stage ``s``, then the online-softmax step (base 2; S^T:
        the KV tile is the wgmma M dimension) up to the probabilities, not ``acc_o``. ``mx_mma``: the tile's column
        slot ``slot`` weights the denominators."""
        mask_scores(k, tile_lo, horizon, score_scale, slot)
        steps.softmax_probabilities(softmax_ctx, k, tile_max_scratch(k, s),
                                    (lambda j: mx_column(k, slot, 2, j)) if cfg.mx_mma else None)

    @T.macro
    def issue_pv_vt(k, s):
        """``fp8_mma``: O^T += V^T P^T on stage ``s`` of the V^T ring (``p_split``: and P's lo term), not waited."""
        T.wgmma_gemm(k.Vt[s * KV_LORA_RANK:(s + 1) * KV_LORA_RANK, :], k.P_shared, k.acc_o, transpose_B=True)
        if cfg.p_split:
            T.wgmma_gemm(k.Vt[s * KV_LORA_RANK:(s + 1) * KV_LORA_RANK, :], k.P_shared_lo, k.acc_o, transpose_B=True)

    @T.macro
    def attend_ahead(k, q_pass, horizon, score_scale):
        """``score_ahead``: one pass's slots (rounds x stages, tile or not); S(0) before the loop. At slot t: wait for
        stage t + 1's codes and issue its scores, then mask, softmax and rescale t, P(t) into shared memory, P V(t)
        issued on V^T(t), and one wait for both groups (none is in flight across the loop's back edge: ptxas would
        serialise every wgmma, C7514); then the codes of t + 1 and V^T(t) are released. A slot without a tile is
        masked whole (P = 0); the score wgmma of the slot past the last reads a stage it did not wait for, and its
        result is never used."""
        views = k.stage_views
        slots = k.rounds * stages
        if k.rounds > 0:
            T.barrier_wait(k.ready[0], ring_parity(k, q_pass, 0))
            issue_scores(views[0], 0)
            T.wait_wgmma(0)
            T.barrier_arrive(k.free[0])
        for rnd in T.serial(k.rounds):
            for s in list(range(stages)):  # static: the stage picks named buffers and S^T fragments
                ns = (s + 1) % stages
                tile = rnd * stages + s
                if tile + 1 < slots:
                    T.barrier_wait(k.ready[ns], ring_parity(k, q_pass, rnd + (s + 1) // stages))
                issue_scores(views[ns], ns)  # S(t + 1) runs during the softmax of t
                probabilities(views[s], s, k.split_lo + tile * block_n, horizon, score_scale)
                steps.rescale_output(softmax_ctx, k)
                # P's buffer is free (every warp waited for P V(t - 1)): an explicit barrier, as in attend_tile
                T.sync_threads(3, CONSUMER_THREADS)
                store_p(views[s])
                T.fence_proxy_async()  # generic-proxy stores, read next by wgmma
                T.sync_threads(2, CONSUMER_THREADS)
                T.barrier_wait(k.vt_ready[s], ring_parity(k, q_pass, rnd))
                issue_pv_vt(k, s)
                T.wait_wgmma(0)
                if tile + 1 < slots:
                    T.barrier_arrive(k.free[ns])  # the codes of t + 1 are read
                T.barrier_arrive(k.vt_free[s])

    @T.macro
    def rescale_pv(k):
        """The output accumulator times this tile's rescale (``p_stack``: both halves of acc_o2, one loop each: a
        loop may index a buffer one way only)."""
        if cfg.p_stack:
            for half in list(range(2)):  # static
                for d, r in T.Parallel(KV_LORA_RANK, block_m):
                    k.acc_o2[d, half * block_m + r] *= k.rescale[r]
        else:
            steps.rescale_output(softmax_ctx, k)

    @T.macro
    def fold_output(k):
        """``p_stack``: the pass's O^T, the sum of acc_o2's two halves (P's hi and lo terms), into acc_o (the same
        thread holds d, r and d, r + 16: register moves and adds)."""
        for d, r in T.Parallel(KV_LORA_RANK, block_m):
            k.acc_o[d, r] = k.acc_o2[d, block_m + r]
        for d, r in T.Parallel(KV_LORA_RANK, block_m):
            k.acc_o[d, r] += k.acc_o2[d, r]

    @T.macro
    def attend_tile(k, s, tile_lo, horizon, score_scale, parity=None, vt_s=None, vt_p=None):
        """Scores, online-softmax step and P V for the tile in stage ``s`` (``parity``: its round's, for
        ``fp8_mma``'s V^T wait; ``vt_s`` / ``vt_p``: the V^T stage and parity where ``vt_stages`` sets them
        apart)."""
        # S^T = K Q^T over 512 latent + 64 rope dims.
        if cfg.score_group:
            issue_scores(k, s)
            T.wait_wgmma(0)
        else:
            T.gemm(lat_stage(k, s), k.Q_lat, k.acc_s, transpose_B=True, clear_accum=True)
            T.gemm(rope_stage(k, s), k.Q_rope, k.acc_s, transpose_B=True)
            if cfg.q_split:
                T.gemm(lat_stage(k, s), k.Q_lat_lo, k.acc_s_lo, transpose_B=True, clear_accum=True)
                T.gemm(rope_stage(k, s), k.Q_rope_lo, k.acc_s_lo, transpose_B=True)
        if fp8_mma:
            T.barrier_arrive(k.free[s])  # the codes are read (P V reads V^T): the copier may refill the stage
        probabilities(k, s, tile_lo, horizon, score_scale, column_slot(s, parity) if cfg.mx_mma else None)
        rescale_pv(k)
        if cfg.mx_mma:
            # P's buffer is free (every warp waited for the last P V before the tile's max exchange): an explicit
            # barrier, so that TileLang's planner, which placed one here in some runs and not in others, has nothing
            # left to order (the generated code must not vary: tools/golden.py).
            T.sync_threads(3, CONSUMER_THREADS)
        store_p(k)
        # O^T += V^T P^T.
        if fp8_mma:
            T.barrier_wait(k.vt_ready[either(vt_s, s)], either(vt_p, parity))
            if cfg.p_stack:  # both P terms, side by side
                T.gemm(vt_region(k, either(vt_s, s)), k.P_shared, k.acc_o2, transpose_B=True)
            else:
                T.gemm(vt_region(k, either(vt_s, s)), k.P_shared, k.acc_o, transpose_B=True)
            if cfg.p_split and not cfg.p_stack:  # P's lo term into the same accumulator
                T.gemm(vt_region(k, either(vt_s, s)), k.P_shared_lo, k.acc_o, transpose_B=True)
            T.barrier_arrive(k.vt_free[either(vt_s, s)])
        else:
            T.gemm(k.Ring_lat[s], k.P_shared, k.acc_o, transpose_A=True, transpose_B=True)

    # ---- the pipelined MMA warp group (``overlap``): the same steps, issued a tile apart

    @T.macro
    def publish_p(k):
        """acc_o times this tile's rescale (its P V is done), then P into shared memory for the next P V wgmma."""
        steps.rescale_output(softmax_ctx, k)
        store_p(k)
        T.fence_proxy_async()  # generic-proxy stores, read next by wgmma
        T.sync_threads(2, CONSUMER_THREADS)

    @T.macro
    def attend_overlapped(k, q_pass, horizon, score_scale):
        """One pass's tiles: at tile t, issue S(t) then P V(t - 1), wait for S(t) only, run the softmax of t while
        P V(t - 1) runs, then wait for it, release its stage, rescale and publish P(t). Slots past the split's
        tiles release their stage at once; the last tile issues and waits for its own P V."""
        for rnd in T.serial(k.rounds):
            for s in list(range(stages)):  # static: the stage picks named buffers
                prev = (s + stages - 1) % stages
                tile = rnd * stages + s
                T.barrier_wait(k.ready[s], ring_parity(k, q_pass, rnd))
                if tile < k.num_tiles:
                    issue_scores(k, s)
                    if tile > 0:
                        issue_pv(k, prev)
                        T.wait_wgmma(1)
                    else:
                        T.wait_wgmma(0)
                    probabilities(k, s, k.split_lo + tile * block_n, horizon, score_scale)
                    # Unconditional (a no-op at tile 0): ptxas must see every path wait before acc_o is read, or
                    # it serialises every wgmma of the kernel.
                    T.wait_wgmma(0)
                    if tile > 0:
                        T.barrier_arrive(k.free[prev])
                    publish_p(k)
                    if tile + 1 == k.num_tiles:
                        # The last tile's P V, issued and waited for in one block: a wgmma group still in flight
                        # where two paths merge makes ptxas serialise every wgmma (C7515: the merge copies
                        # accumulator registers).
                        issue_pv(k, s)
                        T.wait_wgmma(0)
                        T.barrier_arrive(k.free[s])
                else:
                    T.barrier_arrive(k.free[s])

    @T.macro
    def attend_one_copy(k, q_pass, horizon, score_scale):
        """``dynamic_stage``: one pass's slots t = 0 .. rounds x stages - 1 in one copy of the tile step, stage
        t % stages (a register). A slot without a tile releases its codes and takes the V^T ring's handshake."""
        for t in T.serial(k.rounds * stages):
            s = t % stages
            parity = ring_parity(k, q_pass, t // stages)
            T.barrier_wait(k.ready[s], parity)
            if t < k.num_tiles:
                if vt_split:
                    attend_tile(k, s, k.split_lo + t * block_n, horizon, score_scale, parity,
                                vt_stage(k, q_pass, t, s), vt_parity(k, q_pass, t, parity))
                else:
                    attend_tile(k, s, k.split_lo + t * block_n, horizon, score_scale, parity)
            else:
                T.barrier_arrive(k.free[s])
                T.barrier_wait(k.vt_ready[vt_stage(k, q_pass, t, s)], vt_parity(k, q_pass, t, parity))
                T.barrier_arrive(k.vt_free[vt_stage(k, q_pass, t, s)])

    @T.macro
    def write_pass(k, q_pass, out_scale):
        """This pass's rows. denom == 0: nothing visible, output 0 and LSE -inf."""
        qi = k.q_begin + q_pass
        for r in T.Parallel(block_m):  # the rows' output factors, in the pass's free rescale fragment
            k.rescale[r] = steps.output_factor(k.denom[r], out_scale)
        if k.num_splits == 1:
            for d, r in T.Parallel(KV_LORA_RANK, block_m):
                k.Out[qi, k.hg * block_h + r, d] = T.cast(steps.normalised(k.acc_o[d, r], k.denom[r], k.rescale[r]),
                                                          bf16)
            for r in T.Parallel(block_m):
                k.LSE[qi, k.hg * block_h + r] = T.if_then_else(
                    k.denom[r] > 0, (T.log2(k.denom[r]) + k.row_max[r]) * LN2, -T.infinity(f32)
                )
        else:
            for d, r in T.Parallel(KV_LORA_RANK, block_m):
                k.O_partial[partial_index(k.split_id, qi, k.hg, d, r)] = steps.normalised(k.acc_o[d, r], k.denom[r],
                                                                                          k.rescale[r])
            for r in T.Parallel(block_m):
                k.LSE_partial[(k.split_id * total_q + qi) * heads + k.hg * block_h + r] = T.if_then_else(
                    k.denom[r] > 0, T.log2(k.denom[r]) + k.row_max[r], -T.infinity(f32)
                )

    @T.macro
    def merge_splits(k):
        """Fused combine: publish this split, count it; the last split to arrive merges all."""
        T.call_extern("handle", "__threadfence")
        T.sync_threads(1, CONSUMER_THREADS)
        if k.tx == 0:
            k.last_flag[0] = T.atomic_add(
                k.Semaphores[k.seq_id * head_groups + k.hg], 1, memory_order="acq_rel", return_prev=True
            )
        T.sync_threads(1, CONSUMER_THREADS)
        if k.last_flag[0] == k.num_splits - 1:
            T.call_extern("handle", "__threadfence")
            for q_pass in T.serial(k.num_passes):
                qi = k.q_begin + q_pass
                lse_at = lambda sp, r: (sp * total_q + qi) * heads + k.hg * block_h + r  # noqa: E731
                for r in T.Parallel(block_m):
                    k.row_max[r] = -T.infinity(f32)
                    k.denom[r] = 0
                    for sp in T.serial(k.num_splits):
                        k.row_max[r] = T.max(k.row_max[r], k.LSE_partial[lse_at(sp, r)])
                T.fill(k.acc_o, 0)
                for sp in T.serial(k.num_splits):
                    for r in T.Parallel(block_m):
                        k.rescale[r] = T.if_then_else(
                            k.row_max[r] == -T.infinity(f32), 0, T.exp2(k.LSE_partial[lse_at(sp, r)] - k.row_max[r])
                        )
                        k.denom[r] += k.rescale[r]
                    for d, r in T.Parallel(KV_LORA_RANK, block_m):
                        k.acc_o[d, r] += k.rescale[r] * k.O_partial[partial_index(sp, qi, k.hg, d, r)]
                for r in T.Parallel(block_m):
                    k.rescale[r] = steps.output_factor(k.denom[r], 1.0)
                for d, r in T.Parallel(KV_LORA_RANK, block_m):
                    k.Out[qi, k.hg * block_h + r, d] = T.cast(
                        steps.normalised(k.acc_o[d, r], k.denom[r], k.rescale[r]), bf16
                    )
                for r in T.Parallel(block_m):
                    k.LSE[qi, k.hg * block_h + r] = T.if_then_else(
                        k.denom[r] > 0, (T.log2(k.denom[r]) + k.row_max[r]) * LN2, -T.infinity(f32)
                    )
            if k.tx == 0:
                k.Semaphores[k.seq_id * head_groups + k.hg] = 0

    @T.macro
    def consume_item(k):
        """One work item: its query passes over the split's tiles, then its share of the fused merge."""
        q_scale = T.alloc_var(f32, init=steps.q_scale_of(cfg.q_format, cfg.fp8_dtype, k.Q_scale[0]))
        q_inv = T.alloc_var(f32, init=steps.q_inverse(q_scale)) if cfg.q_format == "fp8" else None
        # One multiply per score: sm_scale, log2(e), the fp8 per-tensor scales of Q and K, the decode's factor.
        score_scale = T.alloc_var(f32, init=k.sm_scale * LOG2E * q_scale * k.KV_scale[0] * decode_factor)
        out_scale = T.alloc_var(f32, init=k.KV_scale[0] * decode_factor / (P_FP8_SCALE if fp8_mma else 1.0))
        for q_pass in T.serial(k.num_passes):
            load_q(k, q_pass, q_inv)
            if fp8_mma:
                # Q's shared rows are complete before any score wgmma: an explicit barrier, so that TileLang's
                # planner, which otherwise placed its own before or inside the tile loop from run to run (the
                # generated code must not vary: tools/golden.py), has nothing left to order.
                T.sync_threads(1, CONSUMER_THREADS)
            if cfg.p_stack:
                T.fill(k.acc_o2, 0)
            else:
                T.fill(k.acc_o, 0)
            T.fill(k.denom, 0)
            if cfg.fast_softmax:
                T.fill(k.psum, 0)
            T.fill(k.row_max, -T.infinity(f32))
            horizon = k.split_hi
            if cfg.causal:
                # query q_pass of q_len sees positions [0, kv_len - q_len + q_pass]
                horizon = T.min(k.split_hi, k.kv_len - k.q_len + q_pass + 1)
            if cfg.overlap:
                attend_overlapped(k, q_pass, horizon, score_scale)
            elif cfg.score_ahead:
                attend_ahead(k, q_pass, horizon, score_scale)
            elif dyn:
                attend_one_copy(k, q_pass, horizon, score_scale)
            else:
                if cfg.ordered_decode and cfg.l2_prefetch:
                    prefetch_prologue(k, stages)
                for rnd in T.serial(k.rounds):
                    for s in list(range(stages)):  # static: the stage picks named buffers
                        tile = rnd * stages + s
                        if cfg.ordered_decode and cfg.l2_prefetch:
                            prefetch_tile(k, tile + cfg.l2_prefetch + 1)
                        T.barrier_wait(k.ready[s], ring_parity(k, q_pass, rnd))
                        # (static branches: the decoding kernels' loop keeps its generated form)
                        if fp8_mma:  # the ring stage is released after the score wgmma, V^T after P V
                            if tile < k.num_tiles:
                                attend_tile(k, s, k.split_lo + tile * block_n, horizon, score_scale,
                                            ring_parity(k, q_pass, rnd))
                            else:  # no tile: the releases, and the V^T ring's handshake as for a tile
                                T.barrier_arrive(k.free[s])
                                T.barrier_wait(k.vt_ready[s], ring_parity(k, q_pass, rnd))
                                T.barrier_arrive(k.vt_free[s])
                        else:
                            if tile < k.num_tiles:
                                attend_tile(k, s, k.split_lo + tile * block_n, horizon, score_scale)
                            T.barrier_arrive(k.free[s])
            if cfg.fast_softmax:
                steps.deferred_denominator(softmax_ctx, k)
            if cfg.p_stack:
                fold_output(k)
            write_pass(k, q_pass, out_scale)
        if k.num_splits > 1:
            merge_splits(k)

    @T.macro
    def consume_tiles(k):
        T.set_max_nreg(cfg.consumer_regs, 1)
        each_item(k, consume_item)

    # ------------------------------------------------------------------------------------------- the CTA

    def scalar(dtype, init):
        """A per-CTA scalar computed once into a register (a helper's value, not a re-derived expression)."""
        return T.alloc_var(dtype, init=init)[0]

    def cta_state(k, split_id, seq_id, kv_indptr, num_splits, cta=None, num_items=None):
        """The CTA's ring, barriers and per-CTA scalars (registers), shared by both programs (``persistent_ctas``:
        the CTA's index ``cta`` of a grid over ``num_items`` work items, and registers for the item's scalars)."""
        if dyn:  # the stages side by side: latent codes along the columns, rope along the rows
            k.Ring_lat_all = T.alloc_shared([block_n, stages * KV_LORA_RANK], ring_dtype)
            k.Ring_rope_all = T.alloc_shared([stages * block_n, ROPE_DIM], ring_dtype)
        else:
            k.Ring_lat = [T.alloc_shared([block_n, KV_LORA_RANK], ring_dtype) for _ in range(stages)]
            k.Ring_rope = [T.alloc_shared([block_n, ROPE_DIM], ring_dtype) for _ in range(stages)]
        if fp8_mma:
            # V^T of every stage in one buffer (stage s: rows s * 512 ..): TileLang's planner places equal-sized
            # buffers in an order that varies from run to run, and with four of them (two ring stages, two V^T
            # stages) its barrier placement varied with it. The transposer's addresses assume the swizzles wgmma
            # infers for these operands (128-byte for the codes, 64-byte for V^T; test_ws_structure checks them).
            k.Vt = T.alloc_shared([cfg.vt_depth * KV_LORA_RANK, block_n], ring_dtype)
            if cfg.mx_mma:
                k.mx_table = T.alloc_shared([2 * dequant.MX_TABLES], "uint32")
                k.mx_cols = T.alloc_shared([2 * stages * MX_COLUMN_BYTES // 4], f32)
            k.vt_ready = T.alloc_barrier([WARP_GROUP] * cfg.vt_depth)
            k.vt_free = T.alloc_barrier([CONSUMER_THREADS] * cfg.vt_depth)
        k.ready = T.alloc_barrier([ready_count] * stages)
        # "free": the MMA warp group's release of a stage (fp8_mma: and the transposer's, once both read the codes)
        k.free = T.alloc_barrier([CONSUMER_THREADS + (WARP_GROUP if fp8_mma else 0)] * stages)
        k.num_splits = num_splits
        if persistent:  # the work item's scalars: registers that ``item_state`` sets per item
            k.kv_indptr, k.cta = kv_indptr, cta
            k.grid = T.min(num_items, cfg.persistent_ctas)
            k.cta_items = scalar("int32", T.ceildiv(num_items - cta, k.grid))
            item_registers(k)
        else:
            k.split_id, k.seq_id = split_id, seq_id
            for name, value in split_values(k, kv_indptr):
                setattr(k, name, scalar("int32", value()))
        k.tx = T.get_thread_binding()
        if decodes:
            p = k.tx - CONSUMER_THREADS
            k.warp, k.r8, k.c4 = p // 32, p % 8, p % 32 // 8
        if cfg.mx_mma:  # the mxfp4 decoder thread's token of the tile and half of it (mx_place)
            # its lane in its decoder group (a second group, mx_decoders, starts at thread 384)
            p = k.tx % WARP_GROUP if cfg.mx_decoders > 1 else k.tx - CONSUMER_THREADS
            k.mx_token, k.mx_h = p // 2, p % 2
            if cfg.mx_decoders > 1:  # the decoder group's stage: group 0 (threads 128 ..) stage 0, group 2 stage 1
                k.mx_stage = scalar("int32", T.if_then_else(k.tx < CONSUMER_THREADS + WARP_GROUP, 0, 1))

    def item_registers(k):
        """``persistent_ctas``: one int32 register per work-item scalar (``k.item.<name>``, written by
        ``item_state``), read as ``k.<name>``; ``ring_base`` (the CTA's rounds so far) starts at 0."""
        names = ("split_id", "hg", "seq_id", *(name for name, _ in split_values(k, None) + query_values(k, None)))
        k.item = SimpleNamespace(**{name: T.alloc_var("int32") for name in names})
        k.item.ring_base = T.alloc_var("int32", init=0)
        for name in (*names, "ring_base"):
            setattr(k, name, getattr(k.item, name)[0])

    def producer_registers(k):
        """A decoder thread's register buffers: two tiles of codes (and scale bytes), one chunk of bf16."""
        if decodes:
            k.raw = T.alloc_local([2 * CHUNKS_PER_THREAD * chunk_words], "uint32")
            k.scale = T.alloc_local([2 * CHUNKS_PER_THREAD], "uint32") if mxfp4 else None
            k.vals = T.alloc_local([16], bf16)
            k.ring_addr = T.alloc_local([2 * stages], "uint32") if cfg.direct_stores else None
            k.zero = T.alloc_local([1], "uint32") if cfg.ordered_decode else None  # mbar_wait_zero's 0
            k.zero_word = T.alloc_shared([1], "uint32") if cfg.ordered_decode else None  # the shared 0 it reads
        if fp8_mma:  # the transposer's stage addresses: (codes, V^T) per stage
            k.vt_addr = T.alloc_local([2 * stages], "uint32")
        if cfg.mx_mma:  # the mxfp4 decoder's: its tiles of codes and scale bytes (two; one per group with
            # mx_decoders == stages), their rows, its shared addresses
            bufs = 2 if cfg.mx_decoders == 1 else 1
            k.mx_raw = T.alloc_local([bufs * MX_WORDS], "uint32")
            k.mx_scale = T.alloc_local([bufs * MX_BLOCKS], "uint32")
            k.mx_row = T.alloc_local([bufs], "int32")
            k.mx_exp = T.alloc_local([1], "uint32")
            k.mx_addr = T.alloc_local([2 * stages + 2], "uint32")  # (codes, rope) per stage, the tables, the columns

    def consumer_state(k, qo_indptr, seq_id):
        """The consumer's Q and P tiles, accumulators and query range."""
        q_rows = 2 * block_m if cfg.q_stack else block_m  # (q_stack: hi rows, then lo rows)
        k.Q_lat = T.alloc_shared([q_rows, KV_LORA_RANK], ring_dtype)
        k.Q_rope = T.alloc_shared([q_rows, ROPE_DIM], ring_dtype)
        k.P_shared = T.alloc_shared([2 * block_m if cfg.p_stack else block_m, block_n], ring_dtype)
        k.P_shared_lo = T.alloc_shared([block_m, block_n], ring_dtype) if cfg.p_split and not cfg.p_stack else None
        if cfg.q_split:
            if not cfg.q_stack:
                k.Q_lat_lo = T.alloc_shared([block_m, KV_LORA_RANK], ring_dtype)
                k.Q_rope_lo = T.alloc_shared([block_m, ROPE_DIM], ring_dtype)
            k.q_row_factor = T.alloc_shared([block_m], f32)  # 1 / each row's Q scale (a power of two)
            k.q_row_scale = T.alloc_shared([block_m], f32)  # each row's Q scale
            k.q_partial = T.alloc_shared([CONSUMER_THREADS], f32)  # partial row maxima of |Q|
            k.q_max = T.alloc_local([1], f32)
            k.acc_s_lo = T.alloc_fragment([block_n, block_m], f32)  # S^T of the lo term
            if cfg.q_stack:
                k.acc_s2 = T.alloc_fragment([block_n, 2 * block_m], f32)  # S^T of both terms, side by side
        k.last_flag = T.alloc_shared([1], "int32")
        # S^T [token, row] and O^T [dim, row]: the KV tile is the wgmma M dimension.
        k.acc_s = T.alloc_fragment([block_n, block_m], f32)
        k.acc_o = T.alloc_fragment([KV_LORA_RANK, block_m], f32)
        if cfg.p_stack:
            k.acc_o2 = T.alloc_fragment([KV_LORA_RANK, 2 * block_m], f32)  # O^T of P's two terms, side by side
        for name in ("row_max", "row_max_prev", "row_max_safe", "rescale", "row_sum", "denom"):
            setattr(k, name, T.alloc_fragment([block_m], f32))
        if cfg.fast_softmax:
            k.psum = T.alloc_fragment([block_n, block_m], f32)  # running sums per score position
            k.tile_max = T.alloc_shared([stages * 64], f32)  # mla_ws_tile_max's slots, one per stage
        if persistent:  # per work item: ``item_state``
            k.qo_indptr = qo_indptr
        else:
            for name, value in query_values(k, qo_indptr):
                setattr(k, name, scalar("int32", value()))
        if cfg.score_ahead:
            # One S^T fragment (and lo term's) per stage: stage s's view of the state is the state with its own.
            k.stage_views = [k]
            for _ in range(1, stages):
                view = SimpleNamespace(**vars(k))
                view.acc_s = T.alloc_fragment([block_n, block_m], f32)
                if cfg.q_split:
                    view.acc_s_lo = T.alloc_fragment([block_n, block_m], f32)
                k.stage_views.append(view)

    def work_items(num_splits):
        """The launch's work items: (KV split, sequence, head group) triples."""
        return num_splits * (indptr_len - 1) * head_groups

    @T.macro
    def cta_program(Q, KV, KV_scales, scale_stride, Q_scale, KV_scale, qo_indptr, kv_indptr, Page_table, sm_scale,
                    num_splits, O_partial, LSE_partial, Semaphores, Out, LSE, split_id, seq_id, hg, cta):
        """One CTA: its state, then the consumer and the producers (``cta``: the persistent CTA's index, else
        None and the grid's (split_id, seq_id, hg))."""
        dequant.import_cuda_source(prefetch=cfg.l2_prefetch > 0, ordered=cfg.ordered_decode,
                                   extra=(steps.TILE_MAX_CUDA_SOURCE if cfg.fast_softmax else "")
                                   + (dequant.TRANSPOSE_CUDA_SOURCE if fp8_mma else "")
                                   + (dequant.ZERO_SHARED_CUDA_SOURCE if cfg.score_ahead else "")
                                   + (dequant.MX_E4M3_CUDA_SOURCE if cfg.mx_mma else ""))
        k = SimpleNamespace(Q=Q, KV=KV, KV_scales=KV_scales, scale_stride=scale_stride, Q_scale=Q_scale,
                            KV_scale=KV_scale, Page_table=Page_table, sm_scale=sm_scale, O_partial=O_partial,
                            LSE_partial=LSE_partial, Semaphores=Semaphores, Out=Out, LSE=LSE, hg=hg)
        cta_state(k, split_id, seq_id, kv_indptr, num_splits, cta=cta, num_items=work_items(num_splits))
        consumer_state(k, qo_indptr, seq_id)
        if cfg.q_stack:
            # S^T's fragments that no wgmma writes take a wgmma accumulator's layout (m64n16), so that the lo
            # half of the m64n32 one moves into acc_s_lo within each thread
            T.annotate_layout({k.acc_s: accumulator_fragment(block_n, block_m),
                               k.acc_s_lo: accumulator_fragment(block_n, block_m)})
        if cfg.p_stack:  # likewise O^T, which only fold_output writes
            T.annotate_layout({k.acc_o: accumulator_fragment(KV_LORA_RANK, block_m)})
        if k.tx < CONSUMER_THREADS:
            consume_tiles(k)
        else:
            producer_registers(k)
            produce(k)

    @T.macro
    def body(Q, KV, KV_scales, scale_stride, Q_scale, KV_scale, qo_indptr, kv_indptr, Page_table, sm_scale,
             num_splits, O_partial, LSE_partial, Semaphores, Out, LSE):
        if persistent:  # at most persistent_ctas CTAs, each walking its work items
            with T.Kernel(T.min(work_items(num_splits), cfg.persistent_ctas), threads=cfg.threads) as cta:
                cta_program(Q, KV, KV_scales, scale_stride, Q_scale, KV_scale, qo_indptr, kv_indptr, Page_table,
                            sm_scale, num_splits, O_partial, LSE_partial, Semaphores, Out, LSE, None, None, None, cta)
        else:
            with T.Kernel(num_splits, indptr_len - 1, head_groups, threads=cfg.threads) as (split_id, seq_id, hg):
                cta_program(Q, KV, KV_scales, scale_stride, Q_scale, KV_scale, qo_indptr, kv_indptr, Page_table,
                            sm_scale, num_splits, O_partial, LSE_partial, Semaphores, Out, LSE, split_id, seq_id, hg,
                            None)

    if stream:
        dims = dict(cache_rows=cache_rows, scale_len=scale_len, indptr_len=indptr_len)
        return _stream_prim_func(cfg, stream, cta_state, producer_registers, produce, kv_dtype, kv_cols, dims)

    if cfg.page_size:

        @T.prim_func
        def mla_decode_ws_paged(
            Q: T.Tensor([total_q, heads, QK_DIM], q_dtype),
            KV: T.Tensor([cache_rows, kv_cols], kv_dtype),
            KV_scales: T.Tensor([scale_len], "uint8"),
            scale_stride: T.int32,
            Q_scale: T.Tensor([1], f32),
            KV_scale: T.Tensor([1], f32),
            qo_indptr: T.Tensor([indptr_len], "int32"),
            kv_indptr: T.Tensor([indptr_len], "int32"),
            Page_table: T.Tensor([batch, max_pages], "int32"),
            sm_scale: T.float32,
            num_splits: T.int32,
            O_partial: T.Tensor([o_len], f32),
            LSE_partial: T.Tensor([l_len], f32),
            Semaphores: T.Tensor([sem_len], "int32"),
            Out: T.Tensor([total_q, heads, KV_LORA_RANK], bf16),
            LSE: T.Tensor([total_q, heads], f32),
        ):
            body(Q, KV, KV_scales, scale_stride, Q_scale, KV_scale, qo_indptr, kv_indptr, Page_table, sm_scale,
                 num_splits, O_partial, LSE_partial, Semaphores, Out, LSE)

        return mla_decode_ws_paged

    @T.prim_func
    def mla_decode_ws(
        Q: T.Tensor([total_q, heads, QK_DIM], q_dtype),
        KV: T.Tensor([cache_rows, kv_cols], kv_dtype),
        KV_scales: T.Tensor([scale_len], "uint8"),
        scale_stride: T.int32,
        Q_scale: T.Tensor([1], f32),
        KV_scale: T.Tensor([1], f32),
        qo_indptr: T.Tensor([indptr_len], "int32"),
        kv_indptr: T.Tensor([indptr_len], "int32"),
        sm_scale: T.float32,
        num_splits: T.int32,
        O_partial: T.Tensor([o_len], f32),
        LSE_partial: T.Tensor([l_len], f32),
        Semaphores: T.Tensor([sem_len], "int32"),
        Out: T.Tensor([total_q, heads, KV_LORA_RANK], bf16),
        LSE: T.Tensor([total_q, heads], f32),
    ):
        body(Q, KV, KV_scales, scale_stride, Q_scale, KV_scale, qo_indptr, kv_indptr, None, sm_scale,
             num_splits, O_partial, LSE_partial, Semaphores, Out, LSE)

    return mla_decode_ws


def accumulator_fragment(rows: int, cols: int):
    """The wgmma accumulator layout of a rows x cols fp32 tile over one warp group (m64nN, rows / 64 blocks along
    M): row i in warp (i % 64) // 16, lane row i % 8; column c in lane column (c % 8) // 2; per thread cols / 2
    values per 64-row block, in the order (i // 64, c // 8, (i % 16) // 8, c % 2)."""
    from tilelang.layout import Fragment

    return Fragment([rows, cols], forward_fn=lambda i, c: (
        (i % 64) // 16 * 32 + (i % 8) * 4 + (c % 8) // 2,
        (i // 64) * (cols // 2) + (c // 8) * 4 + ((i % 16) // 8) * 2 + c % 2))


def mla_decode_stream_kernel(cfg: WSDecodeKernelConfig, mode: str = "bench"):
    """The decode kernel's producers with a consumer that does no MMA: the decode benchmark and its check.

    One CTA per entry of ``kv_indptr`` streams rows kv_indptr[b]:kv_indptr[b + 1] of the cache through the ring,
    exactly as the decode kernel's producers do for one split. The consumer releases each stage ("bench"), or
    first copies it, times the format's factor (fp8: 2^120), to ``Out`` ("check": the decoded cache, for comparing
    with ``mla.formats``).
    Arguments: KV, KV_scales, scale_stride as the decode kernel; kv_indptr (ctas + 1,) int32;
    Out (out_rows, 576) bf16 ("check"; any size for "bench", unused).
    """
    if mode not in ("bench", "check"):
        raise ValueError(f"mode must be 'bench' or 'check', got {mode!r}")
    return mla_decode_ws_kernel(cfg, stream=mode)


def _stream_prim_func(cfg, mode, cta_state, producer_registers, produce, kv_dtype, kv_cols, dims):
    """``mla_decode_stream_kernel``'s program, from the decode kernel's own CTA state and producer macros (and its
    dynamic dims ``dims``, which they close over)."""
    from tilelang.layout import make_full_bank_swizzled_layout

    bf16 = "bfloat16"
    factor = dequant.FP8_BF16_FACTOR if cfg.kv_format == "fp8" else 1.0
    cache_rows, scale_len, indptr_len = dims["cache_rows"], dims["scale_len"], dims["indptr_len"]
    out_rows = T.dynamic("out_rows")

    def stream_state(k):
        k.num_passes = 1  # one pass over each CTA's rows

    @T.prim_func
    def mla_decode_stream(
        KV: T.Tensor([cache_rows, kv_cols], kv_dtype),
        KV_scales: T.Tensor([scale_len], "uint8"),
        scale_stride: T.int32,
        kv_indptr: T.Tensor([indptr_len], "int32"),
        Out: T.Tensor([out_rows, QK_DIM], bf16),
    ):
        with T.Kernel(indptr_len - 1, threads=cfg.threads) as seq_id:
            dequant.import_cuda_source(prefetch=cfg.l2_prefetch > 0)
            k = SimpleNamespace(KV=KV, KV_scales=KV_scales, scale_stride=scale_stride, Page_table=None)
            cta_state(k, 0, seq_id, kv_indptr, 1)
            # The decode kernel's wgmma gives the ring its 128-byte swizzle; here nothing infers it: state it.
            T.annotate_layout({buf: make_full_bank_swizzled_layout(buf) for buf in k.Ring_lat + k.Ring_rope})
            stream_state(k)
            if k.tx < CONSUMER_THREADS:
                for rnd in T.serial(k.rounds):
                    for s in list(range(cfg.num_stages)):
                        tile = rnd * cfg.num_stages + s
                        T.barrier_wait(k.ready[s], rnd & 1)
                        if mode == "check":
                            if tile < k.num_tiles:
                                tile_lo = k.split_lo + tile * cfg.block_n
                                for i, d in T.Parallel(cfg.block_n, KV_LORA_RANK):
                                    if tile_lo + i < k.split_hi:
                                        Out[k.kv_begin + tile_lo + i, d] = T.cast(
                                            T.cast(k.Ring_lat[s][i, d], "float32") * factor, bf16)
                                for i, d in T.Parallel(cfg.block_n, ROPE_DIM):
                                    if tile_lo + i < k.split_hi:
                                        Out[k.kv_begin + tile_lo + i, KV_LORA_RANK + d] = T.cast(
                                            T.cast(k.Ring_rope[s][i, d], "float32") * factor, bf16)
                        T.barrier_arrive(k.free[s])
            else:
                producer_registers(k)
                produce(k)

    return mla_decode_stream
