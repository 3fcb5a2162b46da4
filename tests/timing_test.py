"""The interleaved block timing shared by the demo and the bench."""

import time

from mnemojax._src.timing import interleaved_block_means


def test_order_rotates_and_blocks_are_timed_per_step():
    order, rounds_done = [], []

    def run_block(name, r):
        order.append((r, name))
        time.sleep(0.02 if name == "slow" else 0.0)
        return 2  # steps in the block

    means = interleaved_block_means(["fast", "slow", "mid"], 3, run_block,
                                    after_round=rounds_done.append)
    assert [n for r, n in order if r == 0] == ["fast", "slow", "mid"]
    assert [n for r, n in order if r == 1] == ["slow", "mid", "fast"]
    assert [n for r, n in order if r == 2] == ["mid", "fast", "slow"]
    assert rounds_done == [0, 1, 2]
    assert all(len(v) == 3 for v in means.values())
    assert all(m >= 0.01 for m in means["slow"])  # >= 20 ms per block of 2 steps
    assert max(means["fast"]) < min(means["slow"])
