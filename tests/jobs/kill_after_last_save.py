"""A worker killed once it has published the last step, with mnemojax's own checkpoints
after every step: how long the survivors take to exit after the kill, and with what
status (their last commits wait for the dead worker in `checkpoint_barrier`).

PYTHONPATH=. python -m tests.jobs.kill_after_last_save [--runs N] [--steps S] [--victim W]

The kill lands anywhere in the last step's save and commit: some runs leave the survivors
a barrier to give up, some do not (`tests/e2e/resilient_multiprocess_test.py::
test_a_peer_dead_in_the_last_commit_leaves_no_barrier_to_wait_for_at_exit` places the
death exactly).
"""

import argparse
import statistics
import sys
import tempfile

from mnemojax.testing import ProcessFault, run_scenario


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--victim", type=int, default=1)
    args = parser.parse_args()
    waits = []
    for run in range(args.runs):
        with tempfile.TemporaryDirectory(prefix="mnemojax-last-save-") as out:
            cmd = [sys.executable, "-m", "tests.jobs.mp_resilient_job", "--out", out,
                   "--steps", str(args.steps), "--ckpt", f"{out}/ckpt", "--ckpt-every", "1"]
            report = run_scenario(cmd, nproc=3, devices_per_proc=2, job_timeout_s=200,
                                  faults=[ProcessFault("kill", args.victim, args.steps)])
        exits = {e["worker_id"]: (e["code"], e["t"]) for e in report["events"]
                 if e["op"] == "worker_exit" and e["worker_id"] != args.victim}
        wait = max(t for _, t in exits.values()) - report["t0"]
        waits.append(wait)
        print(f"run {run}: job status {report['rc']}, survivors' exit statuses "
              f"{sorted((w, c) for w, (c, _) in exits.items())}, last exit {wait:.2f} s "
              "after the kill", flush=True)
    print(f"median {statistics.median(waits):.2f} s from the kill to the last survivor's exit")


if __name__ == "__main__":
    main()
