"""CPU model of the warp-specialized wgmma forward's synchronisation (attn_fwd_wgmma_ws.cu).

The producer warpgroup and the two consumer warpgroups run as interleaved agents against the
models of the PTX ISA's mbarrier and bar.sync / bar.arrive in tests/_sync_model.py. The arrival
counts, parities, named-barrier ids and the pingpong's skipped arrive are read *from the source*
(evaluated in Python), and many random schedules check for each tile count that nothing
deadlocks, every consumer reads a stage only after the tile it wants landed there, and the
producer never refills a stage that a consumer is still reading.
"""
import os
import random
import re
import sys

import pytest
from portattn.backends.cupy import configs

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _sync_model import MBar, NamedBar, run_agents, wait  # noqa: E402

SRC = configs.source(("attn_fwd_wgmma_ws.cu",))


def _expr(pattern: str) -> str:
    m = re.search(pattern, SRC)
    assert m, pattern
    return " ".join(m.group(1).split()).replace("/", "//").replace("&&", " and ").replace("!(", " not (")


STAGES = int(_expr(r"constexpr int STAGES = (\d+);"))
COUNT_Q = int(_expr(r"mbar_init\(bar_q, (\d+)\)"))
COUNT_FULL, COUNT_EMPTY = map(int, _expr(r"mbar_ring_init<STAGES>\(bar_full, bar_empty, (\d+, \d+)\)").split(","))
EMPTY_PARITY = _expr(r"mbar_wait\(bar_empty \+ 8 \* st, (.*?)\);")
FULL_PARITY = _expr(r"mbar_wait\(bar_full \+ 8 \* st, (.*?)\);")
SYNC_ID, SYNC_COUNT = _expr(r"named_bar_sync\((.*?)\);").rsplit(",", 1)
ARRIVE_IF = _expr(r"if \(PINGPONG && (.*?)\) named_bar_arrive\(2 - c")
ARRIVE_ID = _expr(r"named_bar_arrive\((2 - c), 256\)")
FIRST_IF = _expr(r"if \(PINGPONG && (.*?)\) named_bar_arrive\(1, 256\)")
WG = 128   # threads per warpgroup: each agent's arrive stands for its 128 threads


def _producer(st_of, bars, n_tiles, stage_tile, readers):
    stage_tile[0] = 0 if n_tiles > 0 else None
    yield "ran"
    bars["q"].arrive(WG)
    if n_tiles > 0:
        bars["full"][0].arrive(WG)
    for it in range(1, n_tiles):
        st = it % STAGES
        if it >= STAGES:
            parity = eval(EMPTY_PARITY, {}, {"it": it, "STAGES": STAGES})
            yield from wait(lambda st=st, p=parity: bars["empty"][st].ready(p))
        assert not readers[st], f"tile {it} overwrites stage {st} while {readers[st]} still read it"
        stage_tile[st] = it
        yield "ran"
        bars["full"][st].arrive(WG)
        yield "ran"


def _consumer(c, bars, named, n_tiles, pingpong, stage_tile, readers):
    env = {"c": c, "n_tiles": n_tiles}
    if pingpong and eval(FIRST_IF, {}, env):
        named[1].arrive(256, WG)
    yield from wait(lambda: bars["q"].ready(0))
    for it in range(n_tiles):
        st = it % STAGES
        env["it"] = it
        parity = eval(FULL_PARITY, {}, {"it": it, "STAGES": STAGES})
        yield from wait(lambda st=st, p=parity: bars["full"][st].ready(p))
        assert stage_tile[st] == it, f"consumer {c} reads stage {st} for tile {it}, it holds {stage_tile[st]}"
        readers[st].add(c)
        if pingpong:
            bid, cnt = eval(SYNC_ID, {}, env), eval(SYNC_COUNT, {}, env)
            gen = named[bid].arrive(cnt, WG)
            yield from wait(lambda b=bid, g=gen: named[b].gen > g)
        yield "ran"   # S = Q K^T issued
        if pingpong and eval(ARRIVE_IF, {}, env):
            named[eval(ARRIVE_ID, {}, env)].arrive(256, WG)
        yield "ran"   # softmax, O += P V, waited
        assert stage_tile[st] == it, f"stage {st} refilled while consumer {c} read tile {it}"
        readers[st].discard(c)
        bars["empty"][st].arrive(WG)
        yield "ran"


def _run(n_tiles, pingpong, seed):
    rng = random.Random(seed)
    bars = {"q": MBar(COUNT_Q), "full": [MBar(COUNT_FULL) for _ in range(STAGES)],
            "empty": [MBar(COUNT_EMPTY) for _ in range(STAGES)]}
    named = {1: NamedBar(), 2: NamedBar()}
    stage_tile, readers = [None] * STAGES, [set() for _ in range(STAGES)]
    agents = {"producer": _producer(None, bars, n_tiles, stage_tile, readers),
              **{f"consumer{c}": _consumer(c, bars, named, n_tiles, pingpong, stage_tile, readers) for c in (0, 1)}}
    run_agents(agents, rng, f"n_tiles {n_tiles} pingpong {pingpong}", max_steps=100000)
    return named


def test_protocol_counts_match_the_warpgroups():
    assert COUNT_Q == COUNT_FULL == WG           # the producer warpgroup arrives
    assert COUNT_EMPTY == 2 * WG                 # both consumer warpgroups release a stage
    assert SYNC_COUNT.strip() == "256"           # two consumer warpgroups meet at a named barrier


@pytest.mark.parametrize("pingpong", [False, True])
@pytest.mark.parametrize("n_tiles", [0, 1, 2, 3, 4, 7])
def test_ws_protocol_has_no_deadlock_or_race(n_tiles, pingpong):
    for seed in range(60):
        named = _run(n_tiles, pingpong, seed)
        for bar in named.values():
            assert bar.arrived == 0, "a named barrier left with arrivals nobody syncs on"


def test_model_sees_a_wrong_parity():
    """The model fails when the consumers wait on the wrong phase (it can fail)."""
    global FULL_PARITY
    saved = FULL_PARITY
    try:
        FULL_PARITY = "((it // STAGES) + 1) & 1"
        with pytest.raises(AssertionError):
            for seed in range(20):
                _run(3, True, seed)
    finally:
        FULL_PARITY = saved
