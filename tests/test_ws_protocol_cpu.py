"""The warp-specialised kernel's ring protocol, model-checked on the CPU: every interleaving of its roles' barrier
operations, for short splits and several query passes, must finish (no role waits forever).

Each role is the sequence of ``T.barrier_wait`` / ``T.barrier_arrive`` calls its macro issues, round by round
(``tl_kernels/mla_decode_ws.py``: ``copy_tiles`` / ``decode_tiles``, ``transpose_tiles`` and ``consume_tiles`` with
``attend_tile``). A role's 128 threads act as one agent (they arrive together), so a barrier's count is the number
of roles that arrive on it. An mbarrier waited for with parity P returns once the phase of parity P has completed;
if a barrier completes two phases before its waiter looks, the waiter sees parity P current again and waits
forever: the hang of docs/perf.md run 47, which the model reproduces for that version of the protocol
(``test_the_model_finds_the_hang_of_run_47``). The models must be kept in step with the macros they transcribe.
"""

import itertools

import pytest

STAGES = 2


def parity(rounds, q_pass, rnd):
    return (q_pass * rounds + rnd) & 1  # ``ring_parity``


def schedule(num_tiles, passes):
    """(q_pass, round, stage, tile, parity, tile is real) in the order every role walks the ring."""
    rounds = -(-num_tiles // STAGES)
    for q_pass, rnd, s in itertools.product(range(passes), range(rounds), range(STAGES)):
        tile = rnd * STAGES + s
        yield s, parity(rounds, q_pass, rnd), tile < num_tiles


def decoder_ring(num_tiles, passes):
    """bf16 copier / fp8-mxfp4 decoders and the MMA warp group: one "ready" and one "free" per stage."""
    producer, consumer = [], []
    for s, p, real in schedule(num_tiles, passes):
        producer += [("wait", "free", s, p ^ 1), ("arrive", "ready", s)]
        consumer += [("wait", "ready", s, p), ("arrive", "free", s)]
    return {"ready": 1, "free": 1}, [producer, consumer]


def fp8_mma_ring(num_tiles, passes, stages=STAGES, vt_stages=None):
    """``fp8_mma`` as built: the copier; the transposer (waits for the codes and for its V^T stage every slot); the
    MMA warp group (releases the codes after the score wgmma, V^T after P V; a slot without a tile goes through the
    same handshake). Slot G = pass x slots per pass + t (rounds x stages slots per pass) takes codes stage t % stages
    with its round's parity and V^T stage G % vt_stages with parity (G // vt_stages) & 1 (``vt_stages`` with
    ``dynamic_stage``: ``vt_stage`` / ``vt_parity``); without vt_stages the V^T ring follows the codes'."""
    vt_stages = vt_stages or stages
    rounds = -(-num_tiles // stages)
    copier, transposer, consumer = [], [], []
    for q_pass in range(passes):
        for t in range(rounds * stages):
            g = q_pass * rounds * stages + t
            s, p = t % stages, parity(rounds, q_pass, t // stages)
            for program, ops in zip((copier, transposer, consumer),
                                    fp8_mma_slot(s, p, g % vt_stages, (g // vt_stages) & 1)):
                program += ops
    return FP8_MMA_COUNTS, [copier, transposer, consumer]


FP8_MMA_COUNTS = {"ready": 1, "free": 2, "vt_ready": 1, "vt_free": 1}  # arrivals per phase: "free" by two roles


def fp8_mma_slot(s, p, v, vp, seq=None):
    """One slot of ``fp8_mma``'s ring, each role's operations (copier, transposer, MMA warp group): codes stage
    ``s`` with parity ``p``, V^T stage ``v`` with parity ``vp``. ``seq``: also the copier's write of slot s and the
    MMA warp group's read of it, between its "ready" wait and its "free" arrival (``explore``'s slots)."""
    data = seq is not None
    return ([("wait", "free", s, p ^ 1)] + ([("write", s, seq)] if data else []) + [("arrive", "ready", s)],
            [("wait", "ready", s, p), ("wait", "vt_free", v, vp ^ 1), ("arrive", "vt_ready", v), ("arrive", "free", s)],
            [("wait", "ready", s, p)] + ([("read", s, seq), ("done", s, seq)] if data else [])
            + [("arrive", "free", s), ("wait", "vt_ready", v, vp), ("arrive", "vt_free", v)])


def fp8_mma_persistent_ring(items, stages=STAGES, carry_base=True):
    """``persistent_ctas``: one CTA's work items ``items`` [(num_tiles, passes), ...], each as ``fp8_mma_ring`` walks
    it, one after the other in every role (``each_item``), round r of pass q of an item with parity
    (ring_base + q x rounds + r) & 1, ring_base the rounds of the CTA's earlier items (``next_item``). The stages
    are also ``explore``'s slots: the copier writes slot s after its "free" wait, the MMA warp group reads it after
    its "ready" wait and is done before it releases it, so a stale read or an overwrite shows as well as a hang.
    ``carry_base`` False: every item's parity restarts at 0 (the mutant the check must catch)."""
    copier, transposer, consumer = [], [], []
    base, slot_seq = 0, 0
    for num_tiles, passes in items:
        rounds = -(-num_tiles // stages)
        for q_pass in range(passes):
            for t in range(rounds * stages):
                s, p = t % stages, (base + parity(rounds, q_pass, t // stages)) & 1
                for program, ops in zip((copier, transposer, consumer), fp8_mma_slot(s, p, s, p, slot_seq)):
                    program += ops
                slot_seq += 1
        if carry_base:
            base += passes * rounds
    return FP8_MMA_COUNTS, [copier, transposer, consumer]


def find_persistent_fault(items, stages=STAGES, carry_base=True):
    """``explore`` of ``fp8_mma_persistent_ring`` (its stages as slots): None, or the hang or stale read it finds."""
    return explore(*fp8_mma_persistent_ring(items, stages, carry_base), slots=stages)


def fp8_mma_ahead_ring(num_tiles, passes):
    """``fp8_mma`` with ``score_ahead``: the copier and transposer as in ``fp8_mma_ring``; the MMA warp group takes
    slot 0's codes before the loop, and at slot t waits for slot t + 1's codes (the scores one ahead), then for
    V^T(t), then releases the codes of t + 1 and V^T(t) (``attend_ahead``)."""
    counts, (copier, transposer, _) = fp8_mma_ring(num_tiles, passes)
    rounds = -(-num_tiles // STAGES)
    consumer = []
    for q_pass in range(passes):
        slots = [(u % STAGES, parity(rounds, q_pass, u // STAGES)) for u in range(rounds * STAGES)]
        if slots:
            consumer += [("wait", "ready", 0, slots[0][1]), ("arrive", "free", 0)]
        for u, (s, p) in enumerate(slots):
            ahead = slots[u + 1] if u + 1 < len(slots) else None
            consumer += ([("wait", "ready", *ahead)] if ahead else []) + [("wait", "vt_ready", s, p)]
            consumer += ([("arrive", "free", ahead[0])] if ahead else []) + [("arrive", "vt_free", s)]
    return counts, [copier, transposer, consumer]


def fp8_mma_ring_run47(num_tiles, passes):
    """The version that hung in run 47: rounds without a tile skipped the V^T waits."""
    copier, transposer, consumer = [], [], []
    for s, p, real in schedule(num_tiles, passes):
        copier += [("wait", "free", s, p ^ 1), ("arrive", "ready", s)]
        transposer += [("wait", "ready", s, p)] + ([("wait", "vt_free", s, p ^ 1)] if real else []) + [
            ("arrive", "vt_ready", s), ("arrive", "free", s)]
        consumer += [("wait", "ready", s, p), ("arrive", "free", s)] + (
            [("wait", "vt_ready", s, p)] if real else []) + [("arrive", "vt_free", s)]
    return FP8_MMA_COUNTS, [copier, transposer, consumer]


def explore(counts, programs, slots=0):
    """Depth-first search over every interleaving of ``programs`` (barrier waits and arrivals; with ``slots``, also
    the column slots' "write" / "read" / "done" events of ``mx_ring``). Returns None, or what went wrong: a state
    where some role can never move again (a hang), a write into a slot still being read, or a read that does not
    see its own tile's write."""
    # one barrier per (name, stage) the programs use: the rings may differ in depth (``fp8_mma_ring`` with vt_stages)
    keys = sorted({(op[1], op[2]) for program in programs for op in program if op[0] in ("wait", "arrive")})
    start = (tuple(0 for _ in programs), tuple((0, 0) for _ in keys),
             tuple((-1, False) for _ in range(slots)))  # per slot: (tile last written, being read)
    seen, stack = {start}, [start]
    while stack:
        pcs, bars, cols = stack.pop()
        moved = False
        for role, program in enumerate(programs):
            if pcs[role] == len(program):
                continue
            op, *args = program[pcs[role]]
            new_bars, new_cols = bars, cols
            if op in ("wait", "arrive"):
                name, s, *rest = args
                bar = keys.index((name, s))
                phase, pending = bars[bar]
                if op == "wait":
                    if phase & 1 == rest[0]:  # the phase of that parity has not completed (or aliased back)
                        continue
                else:
                    pending += 1
                    new_bars = list(bars)
                    new_bars[bar] = (phase + 1, 0) if pending == counts[name] else (phase, pending)
                    new_bars = tuple(new_bars)
            else:
                slot, tile = args
                written, reading = cols[slot]
                new_cols = list(cols)
                if op == "write":
                    if reading:
                        return f"tile {tile} written into slot {slot} while tile {written} is read"
                    new_cols[slot] = (tile, False)
                elif op == "read":
                    if written != tile:
                        return f"tile {tile} read slot {slot} holding tile {written}"
                    new_cols[slot] = (written, True)
                else:
                    new_cols[slot] = (written, False)
                new_cols = tuple(new_cols)
            state = (pcs[:role] + (pcs[role] + 1,) + pcs[role + 1:], new_bars, new_cols)
            moved = True
            if state not in seen:
                seen.add(state)
                stack.append(state)
        if not moved and any(pc < len(p) for pc, p in zip(pcs, programs)):
            return f"hang with the roles at {pcs}"
    return None


def find_hang(model, num_tiles, passes):
    """``explore`` of a barrier-only model: None, or the hang it finds."""
    return explore(*model(num_tiles, passes))


@pytest.mark.parametrize("passes", [1, 2, 3])
@pytest.mark.parametrize("num_tiles", [0, 1, 2, 3, 4, 5])
@pytest.mark.parametrize("model", [decoder_ring, fp8_mma_ring, fp8_mma_ahead_ring],
                         ids=["decoders", "fp8_mma", "fp8_mma_score_ahead"])
def test_every_interleaving_finishes(model, num_tiles, passes):
    assert find_hang(model, num_tiles, passes) is None


@pytest.mark.parametrize("passes", [1, 2, 3])
@pytest.mark.parametrize("num_tiles", [0, 1, 2, 3, 4, 5, 7])
@pytest.mark.parametrize("stages,vt_stages", [(3, 2), (4, 2), (4, 3), (2, 2), (3, 3)])
def test_every_interleaving_finishes_with_vt_stages(stages, vt_stages, num_tiles, passes):
    """The codes and V^T rings at different depths (``vt_stages``): no interleaving hangs, over tile counts that
    leave tile-less slots and passes whose slot counts are not multiples of the V^T depth."""
    assert explore(*fp8_mma_ring(num_tiles, passes, stages, vt_stages)) is None


def test_vt_ring_model_can_hang():
    """The check can fail: the V^T barriers waited for with the codes' round parity (as if both rings had one
    depth) while the V^T stage cycles by slot hangs."""
    counts, (copier, _, _) = fp8_mma_ring(3, 2, 3, 2)
    transposer, consumer = [], []
    for q_pass in range(2):
        for t in range(3):  # one round of 3 slots per pass
            s, p, v = t, parity(1, q_pass, 0), (q_pass * 3 + t) % 2
            transposer += [("wait", "ready", s, p), ("wait", "vt_free", v, p ^ 1), ("arrive", "vt_ready", v),
                           ("arrive", "free", s)]
            consumer += [("wait", "ready", s, p), ("arrive", "free", s), ("wait", "vt_ready", v, p),
                         ("arrive", "vt_free", v)]
    assert explore(counts, [copier, transposer, consumer]) is not None


# A persistent CTA's items: tile counts with odd and even round counts, empty splits (0 tiles), sequences without
# queries (0 passes), several passes; two and three items per CTA.
PERSISTENT_ITEMS = [(0, 1), (1, 1), (2, 1), (3, 1), (1, 2), (3, 2), (4, 0)]


@pytest.mark.parametrize("stages", [2, 3])
@pytest.mark.parametrize("items", [list(pair) for pair in itertools.product(PERSISTENT_ITEMS, repeat=2)]
                         + [[(1, 1), (0, 1), (3, 1)], [(3, 2), (1, 0), (1, 1)], [(1, 1)] * 3])
def test_every_interleaving_finishes_across_persistent_items(items, stages):
    """``persistent_ctas``: every role walks the CTA's items in one ring, so the next item's first tiles are filled
    while the MMA warp group still works on the last; no interleaving hangs."""
    assert find_persistent_fault(items, stages) is None


def test_persistent_ring_model_can_fail():
    """The check can fail: a parity that restarts per item (no ``ring_base``) reads a stale stage (or hangs) after
    an item of an odd round count."""
    assert find_persistent_fault([(1, 1), (1, 1)], carry_base=False) is not None
    assert find_persistent_fault([(4, 1), (4, 1)], carry_base=False) is None  # two rounds: no harm


def test_the_model_finds_the_hang_of_run_47():
    """The check can fail: run 47's protocol hangs once a split ends on an odd tile count."""
    assert find_hang(fp8_mma_ring_run47, 3, 1) is not None
    assert find_hang(fp8_mma_ring_run47, 2, 1) is None  # an even count has no tile-less round


# ---- ``mx_mma``: the mxfp4 decoder's per-token column values (``mx_cols``) ----------------------------------------
# The decoder takes the copier's place in ``fp8_mma_ring`` (same waits and arrivals) and, for a real tile, writes the
# tile's column values into slot s + STAGES * parity after its "free" wait; the MMA warp group reads them in
# ``mask_scores`` and the softmax, i.e. after it has released the stage ("free") and before its V^T wait. The check:
# no write lands in a slot while its previous tile is still being read, and every read sees its own tile's write.


def mx_ring(num_tiles, passes, slots=2 * STAGES, decoders=1):
    """``fp8_mma_ring`` with the column slots' writes and reads (``slots``: how many; the kernel has 2 x stages).
    ``decoders`` == STAGES: ``mx_decoders``, decoder group s walks stage s's rounds only (``mx_stage_loop``)."""
    counts, (copier, transposer, consumer) = fp8_mma_ring(num_tiles, passes)
    decoder_programs, reader = [[] for _ in range(decoders)], []
    for tile_seq, (s, p, real) in enumerate(schedule(num_tiles, passes)):
        slot = (s + STAGES * p) % slots
        decoder_programs[s % decoders] += [("wait", "free", s, p ^ 1)] + (
            [("write", slot, tile_seq)] if real else []) + [("arrive", "ready", s)]
        reader += [("wait", "ready", s, p), ("arrive", "free", s)] + (
            [("read", slot, tile_seq)] if real else []) + [("wait", "vt_ready", s, p)] + (
            [("done", slot, tile_seq)] if real else []) + [("arrive", "vt_free", s)]
    return counts, [*decoder_programs, transposer, reader]


def find_column_race(num_tiles, passes, slots=2 * STAGES, decoders=1):
    """``explore`` of ``mx_ring``: None, or the race (or hang) it finds."""
    return explore(*mx_ring(num_tiles, passes, slots, decoders), slots=slots)


@pytest.mark.parametrize("decoders", [1, STAGES], ids=["one-decoder", "decoder-per-stage"])
@pytest.mark.parametrize("passes", [1, 2])
@pytest.mark.parametrize("num_tiles", [0, 1, 2, 3, 4, 5, 6])
def test_mx_column_slots_are_never_overwritten_while_read(num_tiles, passes, decoders):
    assert find_column_race(num_tiles, passes, decoders=decoders) is None


def test_mx_column_slots_race_with_one_slot_per_stage():
    """The check can fail: with one slot per stage the decoder may write tile t + 2 while tile t is still read
    (the stage is released before the MMA warp group reads the values)."""
    assert find_column_race(4, 1, slots=STAGES) is not None
    assert find_column_race(4, 1, slots=STAGES, decoders=STAGES) is not None
