"""CPU model of the warp-specialized fused-dQ dK/dV kernel's synchronisation (attn_bwd_wgmma_ws.cu).

The producer warpgroup and the consumers' eight warps run as interleaved agents against the
mbarrier and bar.sync models of tests/_sync_model.py (the PTX ISA's arrive counts per phase,
``try_wait.parity``, named barriers completing at ``count`` threads). A consumer is modelled
warp by warp, because the dS^T buffers' reuse rests on the barrier between a warpgroup's warps.
The stage count, the mbarrier counts, the parities and the dQ barrier's ids and thread counts are
read *from the source* (evaluated in Python). Random schedules and random tile visibility
(per CTA for ``LOCAL_DQ = false``, per consumer for ``true``, as the kernel skips tiles) check for
each tile count that nothing deadlocks, a warp reads a stage only after its tile landed there, the
producer never refills a stage a warp still reads, every dQ product reads dS^T that every warp it
needs has stored for that tile, and no warp overwrites dS^T that a dQ product still reads.
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


def _expr(pattern: str) -> str:
    m = re.search(pattern, SRC)
    assert m, pattern
    return " ".join(m.group(1).split()).replace("/", "//").replace("&&", " and ")


STAGES = int(_expr(r"constexpr int BM = \d+, BN = \d+, STAGES = (\d+);"))
COUNT_FULL, COUNT_EMPTY = map(int, _expr(r"mbar_ring_init<STAGES>\(bar_full, bar_empty, (\d+, \d+)\)").split(","))
EMPTY_PARITY = _expr(r"mbar_wait\(bar_empty \+ 8 \* st, (.*?)\);")
FULL_PARITY = _expr(r"mbar_wait\(bar_full \+ 8 \* stg, (.*?)\);")
LOCAL_ID, LOCAL_COUNT = _expr(r"if \(LOCAL_DQ\)\s*named_bar_sync\((.*?)\);").rsplit(",", 1)
SHARED_ID, SHARED_COUNT = _expr(r"else\s*named_bar_sync\((.*?)\);").rsplit(",", 1)
DS_BUFFERS = int(_expr(r"const pa_u32 bar_full = sdS \+ (\d+) \* DS_BYTES;"))
assert "dsb ^= 1;" in SRC and DS_BUFFERS == 2   # the kernel alternates two dS^T buffers
WARP = 32


class State:
    def __init__(self, n_tiles, local, visible, ds_buffers=DS_BUFFERS):
        self.bars = {"full": [MBar(COUNT_FULL) for _ in range(STAGES)], "empty": [MBar(COUNT_EMPTY) for _ in range(STAGES)]}
        self.named = {}
        self.stage_tile, self.stage_readers = [None] * STAGES, [set() for _ in range(STAGES)]
        # dS^T: (buffer, consumer half, warp) -> the tile whose rows it holds; (buffer, half) ->
        # the warps whose dQ product reads it
        self.ds = {}
        self.ds_buffers = ds_buffers
        self.ds_readers = {(b, h): set() for b in range(ds_buffers) for h in (0, 1)}
        self.n_tiles, self.local, self.visible = n_tiles, local, visible


def _producer(S):
    for it in range(S.n_tiles):
        st = it % STAGES
        if it >= STAGES:
            parity = eval(EMPTY_PARITY, {}, {"it": it, "STAGES": STAGES})
            yield from wait(lambda st=st, p=parity: S.bars["empty"][st].ready(p))
        assert not S.stage_readers[st], f"tile {it} overwrites stage {st} while {S.stage_readers[st]} still read it"
        S.stage_tile[st] = it
        yield "ran"
        S.bars["full"][st].arrive(128)   # the producer warpgroup's 128 threads, each after its copies
        yield "ran"


def _consumer_warp(S, c, wq):
    me = (c, wq)
    dsb = 0
    for it in range(S.n_tiles):
        st = it % STAGES
        parity = eval(FULL_PARITY, {}, {"it": it, "STAGES": STAGES})
        yield from wait(lambda st=st, p=parity: S.bars["full"][st].ready(p))
        assert S.stage_tile[st] == it, f"warp {me} reads stage {st} for tile {it}, it holds {S.stage_tile[st]}"
        if not S.visible(it, c):
            S.bars["empty"][st].arrive(WARP)
            yield "ran"
            continue
        S.stage_readers[st].add(me)
        yield "ran"   # S^T, dP^T, dV, dK issued
        # store this warp's rows of dS^T for tile it into buffer dsb: no dQ product may still read it
        readers = S.ds_readers[(dsb, c)]
        assert not readers, f"warp {me} overwrites dS^T buffer {dsb} half {c} while {readers} read it"
        S.ds[(dsb, c, wq)] = it
        yield "ran"
        env = {"c": c}
        if S.local:
            bid, cnt = eval(LOCAL_ID, {}, env), int(LOCAL_COUNT)
        else:
            bid, cnt = eval(SHARED_ID, {}, env), int(SHARED_COUNT)
        bar = S.named.setdefault(bid, NamedBar())
        gen = bar.arrive(cnt, WARP)
        yield from wait(lambda b=bar, g=gen: b.gen > g)
        # dQ: reads the consumer's own 64 keys (LOCAL_DQ) or both consumers' 128
        halves = (c,) if S.local else (0, 1)
        for h in halves:
            for w in range(4):
                assert S.ds.get((dsb, h, w)) == it, (f"warp {me}'s dQ of tile {it} reads buffer {dsb} half {h} "
                                                     f"warp {w}: tile {S.ds.get((dsb, h, w))}")
        for h in halves:
            S.ds_readers[(dsb, h)].add(me)
        yield "ran"   # dQ issued; wait_group 0: dK retired, the stage released
        assert S.stage_tile[st] == it, f"stage {st} refilled while warp {me} read tile {it}"
        S.stage_readers[st].discard(me)
        S.bars["empty"][st].arrive(WARP)
        yield "ran"   # the reduction; the dQ product (and its reads of dS^T) long retired
        for h in halves:
            S.ds_readers[(dsb, h)].discard(me)
        dsb = (dsb + 1) % S.ds_buffers   # the kernel's dsb ^= 1
        yield "ran"


def _run(n_tiles, local, seed, ds_buffers=DS_BUFFERS):
    rng = random.Random(seed)
    if local:   # each consumer skips its own tiles
        vis = {(it, c): rng.random() < 0.8 for it in range(n_tiles) for c in (0, 1)}
    else:       # the whole CTA skips a tile
        cta = {it: rng.random() < 0.8 for it in range(n_tiles)}
        vis = {(it, c): cta[it] for it in range(n_tiles) for c in (0, 1)}
    S = State(n_tiles, local, lambda it, c: vis[(it, c)], ds_buffers)
    agents = {"producer": _producer(S), **{f"c{c}w{w}": _consumer_warp(S, c, w) for c in (0, 1) for w in range(4)}}
    run_agents(agents, rng, f"n_tiles {n_tiles} local {local}")
    return S


def test_protocol_counts_match_the_warpgroups():
    assert COUNT_FULL == 128 and COUNT_EMPTY == 256   # the producer arrives; both consumers release
    assert int(LOCAL_COUNT) == 128 and int(SHARED_COUNT) == 256
    assert {eval(LOCAL_ID, {}, {"c": c}) for c in (0, 1)} == {2, 3} and eval(SHARED_ID, {}, {"c": 0}) == 1


@pytest.mark.parametrize("local", [False, True])
@pytest.mark.parametrize("n_tiles", [0, 1, 2, 3, 5, 8])
def test_ws_backward_protocol_has_no_deadlock_or_race(n_tiles, local):
    for seed in range(40):
        S = _run(n_tiles, local, seed)
        for bar in S.named.values():
            assert bar.arrived == 0, "a named barrier left with arrivals nobody syncs on"


@pytest.mark.parametrize("local", [False, True])
def test_model_sees_a_single_ds_buffer(local):
    """With one dS^T buffer instead of two, a warp overwrites rows that a dQ product still reads
    (or reads rows of the next tile): the model can fail."""
    with pytest.raises(AssertionError):
        for seed in range(60):
            _run(4, local, seed, ds_buffers=1)


def test_model_sees_a_wrong_parity(monkeypatch):
    monkeypatch.setitem(globals(), "FULL_PARITY", "((it // STAGES) + 1) & 1")
    with pytest.raises(AssertionError):
        for seed in range(20):
            _run(3, True, seed)
