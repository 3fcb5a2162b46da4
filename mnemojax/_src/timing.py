"""Steady-state step time of several configurations, measured fairly on a noisy machine.

Used by `mnemojax demo` (plain Flax vs mnemojax with and without snapshots) and `mnemojax
bench` (runs (a) and (b)): every configuration runs a block of steps per round, the order
rotating from round to round so that no configuration always follows the same one, and
each block is timed as a whole (a snapshot every N steps is a cost spread over N steps: a
per-step median would hide it). Callers take the median over rounds of the block means.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence


def interleaved_block_means(names: Sequence[str], rounds: int,
                            run_block: Callable[[str, int], int], *,
                            after_round: Callable[[int], None] | None = None,
                            ) -> dict[str, list[float]]:
    """Times ``run_block(name, round)`` for every name, ``rounds`` times.

    Args:
        names: the configurations.
        rounds: rounds; in round ``r`` the order is ``names`` rotated by ``r``.
        run_block: runs one block of steps of a configuration (including any wait that
            belongs to the block, such as a snapshot copy in flight) and returns how many
            steps it ran.
        after_round: called with the round index after each round (progress).

    Returns:
        Per name, the mean seconds per step of each of its blocks, in round order.
    """
    names = list(names)
    means: dict[str, list[float]] = {name: [] for name in names}
    for r in range(rounds):
        k = r % len(names)
        for name in names[k:] + names[:k]:
            t0 = time.perf_counter()
            steps = run_block(name, r)
            means[name].append((time.perf_counter() - t0) / steps)
        if after_round is not None:
            after_round(r)
    return means
