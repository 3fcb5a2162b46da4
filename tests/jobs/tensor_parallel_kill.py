"""A real kill in a tensor-parallel job whose one model replica spans every process.

    PYTHONPATH=. python -m tests.jobs.tensor_parallel_kill [--kill-after 8] [--steps 24]

The bench's tiny GPT (8 heads) on a (1, 8) mesh: data 1 x model 8, over 4 processes x 2
CPU devices under the launcher with its defaults, so every process holds a quarter of
each model-sharded weight and no process holds a whole replica. Runs it twice with the
same batches: failure-free, then with worker 1 SIGKILLed once it has published step
``--kill-after``. No whole replica survives the kill: the model axis shrinks to 4 over
two survivors, the third leaves the job. Prints the recovery (meshes, who failed, who
left, the executable's source) and the largest difference of the final state from the
failure-free run. Exit status 1 if either job failed. Every process ends with the
launcher (bounded by ``--timeout-s``).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import tomllib
from pathlib import Path

import numpy as np

from mnemojax._src.bench.multiproc import launch_resilient_workers
from mnemojax.testing import ProcessFault

_CONFIGS = Path(__file__).resolve().parents[2] / "configs"


def _preset(steps: int, out: Path) -> Path:
    """The tiny bench preset on a (1, 8) mesh with 8 heads. Its in-process faults are
    unused by the multi-process worker (the launcher's kill is the fault here); their
    steps are only kept within the run, as the preset's checks ask."""
    cfg = tomllib.loads((_CONFIGS / "bench_tiny.toml").read_text())
    cfg.update(mesh=[1, 8], steps=steps)
    cfg["model"]["n_heads"] = 8
    for i, fault in enumerate(cfg["faults"]):
        fault["step"] = 2 + i
    lines = [f"{k} = {json.dumps(v)}" for k, v in cfg.items() if not isinstance(v, dict | list)
             or k == "mesh"]
    lines += ["[model]", *(f"{k} = {json.dumps(v)}" for k, v in cfg["model"].items())]
    for fault in cfg["faults"]:
        lines += ["[[faults]]", *(f"{k} = {json.dumps(v)}" for k, v in fault.items())]
    path = out / "bench_tp8.toml"
    path.write_text("\n".join(lines) + "\n")
    return path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tests.jobs.tensor_parallel_kill")
    p.add_argument("--kill-after", type=int, default=8)
    p.add_argument("--steps", type=int, default=24)
    p.add_argument("--timeout-s", type=float, default=400.0)
    args = p.parse_args(argv)
    root = Path(tempfile.mkdtemp(prefix="mnemojax-tp-kill-"))
    preset = _preset(args.steps, root)
    outs = {}
    for name, faults in (("reference", []),
                         ("kill", [ProcessFault("kill", 1, args.kill_after)])):
        out = root / name
        out.mkdir()
        report = launch_resilient_workers(
            preset=str(preset), steps=args.steps, out=out, run=name, nproc=4,
            devices_per_proc=2, faults=faults, compile_cache=str(out / "xla-cache"),
            timeout_s=args.timeout_s)
        print(f"{name}: job exit {report['rc']}, output in {out}")
        if report["rc"] != 0:
            log = out / "workers.log"
            print(log.read_text()[-3000:] if log.exists() else "(no worker log)")
            return 1
        outs[name] = out
    [rec] = json.loads((outs["kill"] / "stats.json").read_text())["recoveries"]
    print({k: rec[k] for k in ("old_mesh_shape", "new_mesh_shape", "failed_processes",
                               "left_processes", "agreement_rounds", "executable",
                               "bytes_moved")})
    want, got = np.load(outs["reference"] / "final.npz"), np.load(outs["kill"] / "final.npz")
    diff = max(float(np.max(np.abs(want[k] - got[k]))) for k in want.files)
    print(f"final state: {len(want.files)} leaves, max |diff| from the failure-free run "
          f"{diff:.2e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
