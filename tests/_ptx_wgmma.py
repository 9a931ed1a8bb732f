"""The wgmma register-hazard check of the sm_90a PTX (tests/test_cupy_wgmma.py, test_cupy_wgmma_bwd.py).

PTX ISA 9.7.15.7.1 (wgmma.fence, wgmma.wait_group): a register that a ``wgmma.mma_async`` reads
or writes (an accumulator or an A fragment) may be accessed by ordinary instructions only before
the ``wgmma.fence`` in front of its chain, and again once a ``wgmma.wait_group`` completed the
chain's commit group: ``wait_group N`` completes every group but the N committed last. The CUDA
compiler knows nothing of this; the kernels order their accesses with empty asm statements, and
this check reads the PTX NVRTC made to see that they did.

It follows the control flow, not the text: the entry is cut into basic blocks at labels and
branches, and every state a block can be entered in (the chains in flight, oldest first, and
the chain between its fence and its commit) is pushed through it until nothing new appears. So a
chain left in flight across a loop's back edge (a tile's last products running into the next
tile) is checked on the path that really follows it, and code in a block that path never reaches
is not blamed for it.
"""

from __future__ import annotations

import re

_LABEL = re.compile(r"^(\$?[\w$.]+):$")
_BRANCH = re.compile(r"^(@!?%\w+\s+)?bra(?:\.uni)?\s+(\$?[\w$.]+)\s*;")
_REG = re.compile(r"%\w+")
#: A chain left in flight for more than this many commits without a wait counts as never waited.
MAX_IN_FLIGHT = 8


def _chain_registers(lines: list[str], fence: int) -> set:
    """The registers named inside the braces of the ``wgmma.mma_async`` lines between the fence
    at ``fence`` and the next ``wgmma.commit_group`` (its accumulators and A fragments)."""
    regs, j = set(), fence + 1
    while j < len(lines) and not lines[j].startswith("wgmma.commit_group"):
        if lines[j].startswith("wgmma.mma_async"):
            regs |= {r for grp in re.findall(r"\{([^}]*)\}", lines[j]) for r in _REG.findall(grp)}
        j += 1
    assert regs, f"a wgmma.fence at PTX line {fence} without a chain before its commit_group"
    return regs


def _blocks(lines: list[str]) -> tuple[list[tuple[int, int]], list[list[int]]]:
    """(basic blocks as [start, end) line ranges, successors of each block)."""
    starts = {0}
    for i, ln in enumerate(lines):
        if _LABEL.match(ln):
            starts.add(i)
        elif _BRANCH.match(ln) or ln.startswith(("ret", "exit")):
            starts.add(i + 1)
    bounds = sorted(s for s in starts if s < len(lines))
    blocks = [(s, bounds[k + 1] if k + 1 < len(bounds) else len(lines)) for k, s in enumerate(bounds)]
    at_label = {_LABEL.match(lines[s]).group(1): k for k, (s, _) in enumerate(blocks) if _LABEL.match(lines[s])}
    succ = []
    for k, (s, e) in enumerate(blocks):
        last = next((lines[i] for i in range(e - 1, s - 1, -1) if lines[i] and lines[i] not in ("{", "}")), "")
        m = _BRANCH.match(last)
        nxt = [k + 1] if k + 1 < len(blocks) else []
        if m:
            succ.append([at_label[m.group(2)]] + (nxt if m.group(1) else []) if m.group(2) in at_label else nxt)
        elif last.startswith(("ret", "exit")):
            succ.append([])
        else:
            succ.append(nxt)
    return blocks, succ


def wgmma_register_hazards(ptx: str) -> list[str]:
    """Ordinary instructions of one PTX entry that touch a register of a wgmma chain in flight
    (from its fence until a wait completes it), on any path through the entry, as
    ``"line L (chain of line F): instruction"``. Raises AssertionError when a chain can reach the
    end of the entry, or pile up past :data:`MAX_IN_FLIGHT` commits, without a wait completing it."""
    lines = [ln.split("//")[0].strip() for ln in ptx.splitlines()]
    regs = {i: _chain_registers(lines, i) for i, ln in enumerate(lines) if ln.startswith("wgmma.fence")}
    blocks, succ = _blocks(lines)
    seen: list[set] = [set() for _ in blocks]
    work = [(0, ((), None))]
    bad: dict[int, str] = {}
    while work:
        k, state = work.pop()
        if state in seen[k]:
            continue
        seen[k].add(state)
        inflight, active = state
        s, e = blocks[k]
        for i in range(s, e):
            ln = lines[i]
            if ln.startswith("wgmma.fence"):
                active = i if active is None else active   # a second fence inside a chain keeps it
            elif ln.startswith("wgmma.commit_group"):
                if active is not None:
                    inflight = inflight + (active,)
                    assert len(inflight) <= MAX_IN_FLIGHT, f"the chain of PTX line {inflight[0]} is never waited for"
                active = None
            elif ln.startswith("wgmma.wait_group"):
                n = int(re.search(r"(\d+)\s*;", ln).group(1))
                inflight = inflight[len(inflight) - n:] if n else ()
            elif ln and not ln.startswith("wgmma.") and i not in bad:
                used = set(_REG.findall(ln))
                for f in inflight + ((active,) if active is not None else ()):
                    if regs[f] & used:
                        bad[i] = f"line {i} (chain of line {f}): {ln}"
                        break
        if not succ[k]:
            assert not inflight, f"the chain of PTX line {inflight[0]} is never waited for"
        for t in succ[k]:
            work.append((t, (inflight, active)))
    return [bad[i] for i in sorted(bad)]
