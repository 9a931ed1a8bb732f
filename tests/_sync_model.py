"""CPU models of Hopper's CTA synchronisation for the warp-specialized kernels' protocol tests
(test_cupy_wgmma_protocol.py, test_cupy_wgmma_bwd_protocol.py).

``MBar``: the PTX ISA's mbarrier (9.7.13.15): an arrive-count per phase; ``try_wait.parity P``
succeeds once the phase of parity P has completed, i.e. while the number of completed phases has
the other parity (a fresh barrier passes a wait on parity 1). ``NamedBar``: bar.sync / bar.arrive
(9.7.13.1): a barrier completes when ``count`` threads arrived; bar.sync also waits for that.
``run_agents`` interleaves generator agents (each step yields "ran" or "blocked") in a random
order and fails on a deadlock.
"""


class MBar:
    def __init__(self, count):
        self.count, self.pending, self.done = count, count, 0

    def arrive(self, n):
        """``n`` threads arrive on the current phase."""
        self.pending -= n
        assert self.pending >= 0, "more arrivals than the phase's count"
        if self.pending == 0:
            self.done, self.pending = self.done + 1, self.count

    def ready(self, parity):
        return self.done % 2 != parity


class NamedBar:
    def __init__(self):
        self.gen, self.arrived, self.count = 0, 0, None

    def arrive(self, count, n):
        """``n`` threads arrive at a barrier of ``count`` threads; returns the generation they wait
        for (bar.sync: until ``gen`` exceeds it)."""
        assert self.count in (None, count), "one named barrier used with two thread counts"
        self.count = count
        self.arrived += n
        gen = self.gen
        if self.arrived == count:
            self.gen, self.arrived = self.gen + 1, 0
        return gen


def wait(cond):
    """An agent's wait: "blocked" steps until ``cond()`` holds."""
    while not cond():
        yield "blocked"


def run_agents(agents: dict, rng, what: str, max_steps: int = 200000) -> None:
    """Step the generator ``agents`` (name -> generator) in a random order (``rng``) until all
    finish; AssertionError on a deadlock (every live agent blocked, twice over) or no progress
    within ``max_steps``; ``what`` names the run in the message."""
    blocked = {}
    for _ in range(max_steps):
        if not agents:
            return
        name = rng.choice(sorted(agents))
        try:
            blocked[name] = next(agents[name]) == "blocked"
        except StopIteration:
            del agents[name]
            blocked.pop(name, None)
            continue
        if len(blocked) == len(agents) and all(blocked.values()):
            # every live agent reported blocked at its last step: step each once more to be sure
            for n in sorted(agents):
                try:
                    blocked[n] = next(agents[n]) == "blocked"
                except StopIteration:
                    del agents[n]
                    blocked.pop(n)
            if agents and all(blocked.values()):
                raise AssertionError(f"deadlock: {what}: {sorted(agents)} blocked")
    raise AssertionError(f"no progress: {what}")
