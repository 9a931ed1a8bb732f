"""CPU model of the warp-specialized fused-dQ dK/dV kernel's synchronisation (attn_bwd_wgmma_ws.cu).

The producer's four warps and the consumers' eight run as interleaved agents against the mbarrier
and bar.sync models of tests/_sync_model.py (the PTX ISA's arrive counts per phase,
``try_wait.parity``, named barriers completing at ``count`` threads). Warps are modelled one by
one, because the dS^T buffers' reuse rests on the barrier between a warpgroup's warps and the
work-item slots' on the producer's own barrier. The stage and K/V buffer counts, the mbarrier
counts, the parities, the slot index and the barriers' ids and thread counts are read *from the
source* (evaluated in Python).

A CTA takes work items one after the other (the model draws their tile counts; 0 is an item no
query row sees, which loads nothing) until the counter runs out, the end published like an item.
Random schedules and random tile visibility (per CTA, as the kernel skips tiles) check that
nothing deadlocks; that each warp reads the item
the producer published for it; that a warp reads a stage only after its tile landed there and a
K/V buffer only while it holds its item's K and V; that the producer never refills a stage or a
K/V buffer a warp still reads, nor rewrites a slot a producer warp has not read; that every dQ
product reads dS^T that every warp it needs has stored for that tile, and no warp overwrites dS^T
that a dQ product still reads.
"""
import os
import random
import re
import sys

import pytest
from portattn.backends.cupy import configs

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _sync_model import MBar, NamedBar, run_agents, wait  # noqa: E402

SRC = configs.source(("attn_bwd_wgmma_ws.cu",))
SRC = SRC[SRC.index("attn_bwd_dkdv_wgmma_ws(PA_COMMON_PARAMS"):]
PROD = SRC[SRC.index("if (wg == 0) {"):SRC.index("// ----- consumers -----")]
CONS = SRC[SRC.index("// ----- consumers -----"):]


def _expr(pattern: str, src: str = SRC) -> str:
    m = re.search(pattern, src)
    assert m, pattern
    return " ".join(m.group(1).split()).replace("/", "//").replace("&&", " and ")


STAGES, KV_BUFS = map(int, _expr(r"constexpr int BM = \d+, BN = \d+, STAGES = (\d+, KV_BUFS = \d+);")
                      .replace("KV_BUFS =", "").split(","))
COUNT_FULL, COUNT_EMPTY = map(int, _expr(r"mbar_ring_init<STAGES>\(bar_full, bar_empty, (\d+, \d+)\)").split(","))
COUNT_KV_FULL, COUNT_KV_EMPTY = map(int, _expr(r"mbar_ring_init<KV_BUFS>\(bar_kv_full, bar_kv_empty, (\d+, \d+)\)")
                                    .split(","))
EMPTY_PARITY = _expr(r"mbar_wait\(bar_empty \+ 8 \* st, (.*?)\);", PROD)
FULL_PARITY = _expr(r"mbar_wait\(bar_full \+ 8 \* stg, (.*?)\);", CONS)
KV_EMPTY_WAIT = _expr(r"if \((.*?)\) mbar_wait\(bar_kv_empty", PROD)
KV_EMPTY_PARITY = _expr(r"mbar_wait\(bar_kv_empty \+ 8 \* kb, (.*?)\);", PROD)
KV_FULL_PARITY = _expr(r"mbar_wait\(bar_kv_full \+ 8 \* kb, (.*?)\);", CONS)
KB = _expr(r"const int kb = (.*?);", PROD)
assert KB == _expr(r"const int kb = (.*?);", CONS)
SLOT_WRITE = _expr(r"if \(tid == 0\) item_slot\[(.*?)\] =", PROD)
SLOT_READ_P = _expr(r"const int item = item_slot\[(.*?)\];", PROD)
SLOT_READ_C = _expr(r"const int item = item_slot\[(.*?)\];", CONS)
PROD_BAR_ID, PROD_BAR_COUNT = map(int, _expr(r"named_bar_sync\((\d+, \d+)\);", PROD).split(","))
DQ_BAR_ID, DQ_BAR_COUNT = map(int, _expr(r"named_bar_sync\((\d+, \d+)\);", CONS).split(","))
DS_BUFFERS = int(_expr(r"const pa_u32 bar_full = sdS \+ (\d+) \* DS_BYTES;"))
assert "dsb ^= 1;" in SRC and DS_BUFFERS == 2   # the kernel alternates two dS^T buffers
# the consumers release the item's K/V buffer after its tile loop (every product retired)
assert CONS.index("mbar_arrive(bar_kv_empty + 8 * kb);") > CONS.index("dsb ^= 1;")
WARP = 32
ALL_WARPS = {("p", w) for w in range(4)} | {(c, w) for c in (0, 1) for w in range(4)}
END = -1   # the item a CTA reads when the counter has run out


def _ev(expr, **env):
    return eval(expr, {}, {"STAGES": STAGES, "KV_BUFS": KV_BUFS, **env})


class State:
    def __init__(self, items, visible, ds_buffers=DS_BUFFERS, slots=2):
        self.bars = {name: [MBar(cnt) for _ in range(n)] for name, cnt, n in (
            ("full", COUNT_FULL, STAGES), ("empty", COUNT_EMPTY, STAGES),
            ("kv_full", COUNT_KV_FULL, KV_BUFS), ("kv_empty", COUNT_KV_EMPTY, KV_BUFS))}
        self.named = {}
        self.items = items + [END]                  # tile counts of the CTA's items, then the end
        self.slots, self.slot_read = [None] * slots, [set() for _ in range(slots)]
        self.stage_tile, self.stage_readers = [None] * STAGES, [set() for _ in range(STAGES)]
        self.kv_item, self.kv_readers = [None] * KV_BUFS, [set() for _ in range(KV_BUFS)]
        # dS^T: (buffer, consumer half, warp) -> the tile whose rows it holds; (buffer, half) ->
        # the warps whose dQ product reads it
        self.ds = {}
        self.ds_buffers = ds_buffers
        self.ds_readers = {(b, h): set() for b in range(ds_buffers) for h in (0, 1)}
        self.visible = visible


def _producer_warp(S, w):
    me = ("p", w)
    rt = 0
    for n, tiles in enumerate(S.items):
        kb = _ev(KB, n=n)
        if _ev(KV_EMPTY_WAIT, n=n):
            p = _ev(KV_EMPTY_PARITY, n=n)
            yield from wait(lambda kb=kb, p=p: S.bars["kv_empty"][kb].ready(p))
        slot = _ev(SLOT_WRITE, n=n) % len(S.slots)
        if w == 0:   # thread 0 takes the item: every warp must have read the slot's last item
            unread = ALL_WARPS - S.slot_read[slot]
            assert S.slots[slot] is None or not unread, f"item {n} overwrites slot {slot} before {sorted(map(str, unread))} read it"
            S.slots[slot], S.slot_read[slot] = n, set()
            yield "ran"
        bar = S.named.setdefault(PROD_BAR_ID, NamedBar())
        gen = bar.arrive(PROD_BAR_COUNT, WARP)
        yield from wait(lambda b=bar, g=gen: b.gen > g)
        rslot = _ev(SLOT_READ_P, n=n) % len(S.slots)
        assert S.slots[rslot] == n, f"producer warp {w} reads item {S.slots[rslot]} for its item {n}"
        S.slot_read[rslot].add(me)
        yield "ran"
        if tiles == END:
            S.bars["kv_full"][kb].arrive(WARP)
            return
        if tiles > 0:   # K and V into the buffer: nobody may still read it
            assert not S.kv_readers[kb], f"item {n} overwrites K/V buffer {kb} while {S.kv_readers[kb]} read it"
            S.kv_item[kb] = n
            yield "ran"
        for it in range(tiles):
            st = rt % STAGES
            if rt >= STAGES:
                p = _ev(EMPTY_PARITY, rt=rt)
                yield from wait(lambda st=st, p=p: S.bars["empty"][st].ready(p))
            assert not S.stage_readers[st], f"tile {rt} overwrites stage {st} while {S.stage_readers[st]} still read it"
            if w == 0:
                S.stage_tile[st] = rt
            yield "ran"
            if it == 0:
                S.bars["kv_full"][kb].arrive(WARP)   # each warp after its copies landed
            S.bars["full"][st].arrive(WARP)
            rt += 1
            yield "ran"
        if tiles == 0:
            S.bars["kv_full"][kb].arrive(WARP)


def _consumer_warp(S, c, wq):
    me = (c, wq)
    rt, dsb = 0, 0
    for n, tiles in enumerate(S.items):
        kb = _ev(KB, n=n)
        p = _ev(KV_FULL_PARITY, n=n)
        yield from wait(lambda kb=kb, p=p: S.bars["kv_full"][kb].ready(p))
        slot = _ev(SLOT_READ_C, n=n) % len(S.slots)
        assert S.slots[slot] == n, f"warp {me} reads item {S.slots[slot]} for its item {n}"
        S.slot_read[slot].add(me)
        if tiles == END:
            return
        if tiles > 0:
            assert S.kv_item[kb] == n, f"warp {me} reads K/V buffer {kb} for item {n}, it holds {S.kv_item[kb]}"
        S.kv_readers[kb].add(me)
        yield "ran"
        for it in range(tiles):
            st = rt % STAGES
            p = _ev(FULL_PARITY, rt=rt)
            yield from wait(lambda st=st, p=p: S.bars["full"][st].ready(p))
            assert S.stage_tile[st] == rt, f"warp {me} reads stage {st} for tile {rt}, it holds {S.stage_tile[st]}"
            rt += 1
            if not S.visible(n, it, c):
                S.bars["empty"][st].arrive(WARP)
                yield "ran"
                continue
            S.stage_readers[st].add(me)
            yield "ran"   # S^T, dP^T, dV, dK issued
            # store this warp's rows of dS^T for the tile into buffer dsb: no dQ product may still read it
            readers = S.ds_readers[(dsb, c)]
            assert not readers, f"warp {me} overwrites dS^T buffer {dsb} half {c} while {readers} read it"
            S.ds[(dsb, c, wq)] = (n, it)
            yield "ran"
            bar = S.named.setdefault(DQ_BAR_ID, NamedBar())
            gen = bar.arrive(DQ_BAR_COUNT, WARP)
            yield from wait(lambda b=bar, g=gen: b.gen > g)
            # dQ: reads both consumers' dS^T (the item's 128 keys) and K
            halves = (0, 1)
            for h in halves:
                for w in range(4):
                    assert S.ds.get((dsb, h, w)) == (n, it), (f"warp {me}'s dQ of tile {(n, it)} reads buffer {dsb} "
                                                              f"half {h} warp {w}: tile {S.ds.get((dsb, h, w))}")
            assert S.kv_item[kb] == n, f"warp {me}'s dQ of item {n} reads K from buffer {kb}: item {S.kv_item[kb]}"
            for h in halves:
                S.ds_readers[(dsb, h)].add(me)
            yield "ran"   # dQ issued; wait_group 0: dK retired, the stage released
            assert S.stage_tile[st] == rt - 1, f"stage {st} refilled while warp {me} read tile {rt - 1}"
            S.stage_readers[st].discard(me)
            S.bars["empty"][st].arrive(WARP)
            yield "ran"   # the reduction; the dQ product (and its reads of dS^T and K) long retired
            for h in halves:
                S.ds_readers[(dsb, h)].discard(me)
            dsb = (dsb + 1) % S.ds_buffers   # the kernel's dsb ^= 1
            yield "ran"
        S.kv_readers[kb].discard(me)
        S.bars["kv_empty"][kb].arrive(WARP)
        yield "ran"   # the epilogue: registers to global memory


def _run(items, seed, ds_buffers=DS_BUFFERS, slots=2):
    rng = random.Random(seed)
    vis = {(n, it): rng.random() < 0.8 for n, t in enumerate(items) for it in range(t)}   # the CTA skips a tile
    S = State(items, lambda n, it, c: vis[(n, it)], ds_buffers, slots)
    agents = {**{f"p{w}": _producer_warp(S, w) for w in range(4)},
              **{f"c{c}w{w}": _consumer_warp(S, c, w) for c in (0, 1) for w in range(4)}}
    run_agents(agents, rng, f"items {items}")
    return S


def test_protocol_counts_match_the_warpgroups():
    assert COUNT_FULL == COUNT_KV_FULL == 128 and COUNT_EMPTY == COUNT_KV_EMPTY == 256   # producer; consumers
    assert DQ_BAR_COUNT == 256 and PROD_BAR_COUNT == 128 and DQ_BAR_ID == 1
    assert PROD_BAR_ID not in {0, DQ_BAR_ID}   # its own id: not __syncthreads' nor the consumers'
    assert STAGES == 2 and KV_BUFS == 2


ITEMS = [[], [0], [1], [3], [2, 0, 3], [1, 1, 1, 1], [0, 0, 2], [5, 2], [1, 0, 4, 2, 0, 1]]


@pytest.mark.parametrize("items", ITEMS, ids=lambda x: "-".join(map(str, x)) or "none")
def test_ws_backward_protocol_has_no_deadlock_or_race(items):
    for seed in range(60):
        S = _run(items, seed)
        for bar in S.named.values():
            assert bar.arrived == 0, "a named barrier left with arrivals nobody syncs on"


def test_model_sees_a_single_ds_buffer():
    """With one dS^T buffer instead of two, a warp overwrites rows that a dQ product still reads
    (or reads rows of the next tile): the model can fail."""
    with pytest.raises(AssertionError):
        for seed in range(60):
            _run([4], seed, ds_buffers=1)


def test_model_sees_a_wrong_parity(monkeypatch):
    monkeypatch.setitem(globals(), "FULL_PARITY", "((rt // STAGES) + 1) & 1")
    with pytest.raises(AssertionError):
        for seed in range(20):
            _run([3], seed)


def test_model_sees_one_kv_buffer_without_its_wait(monkeypatch):
    """K/V buffers released per item: a producer that does not wait for the buffer's previous item
    overwrites K and V that a consumer still reads."""
    monkeypatch.setitem(globals(), "KV_EMPTY_WAIT", "False")
    with pytest.raises(AssertionError):
        for seed in range(60):
            _run([1, 1, 1, 1, 1], seed)


def test_model_sees_a_single_item_slot():
    """With one slot, thread 0 can publish the next item before every producer warp read the
    last one."""
    with pytest.raises(AssertionError):
        for seed in range(200):
            _run([0, 0, 0, 0, 1], seed, slots=1)
