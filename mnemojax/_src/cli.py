"""Command line: ``python -m mnemojax <command>`` / ``mnemojax <command>``.

Each command lives in its own module that exposes ``add_parser(subparsers)``;
the module is imported only when its command runs, so ``mnemojax --help``
stays fast and no JAX backend is touched before the command configures it.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

# command name -> (module, one-line help). Modules are imported lazily.
_COMMANDS: dict[str, tuple[str, str]] = {
    "demo": ("mnemojax._src.demo", "train the tiny GPT on 8 CPU devices, lose a device, recover"),
    "chaos": ("mnemojax._src.chaos", "random fault schedule; the state must end exact"),
    "launch": ("mnemojax._src.distributed.launch_cli",
               "run N worker processes with agents and a recoverable coordination service"),
    "bench": ("mnemojax._src.bench.cli", "mnemojax vs the classical restart baseline, same faults"),
    "report": ("mnemojax._src.bench.report_cli", "render a run's JSONL event log: table + PNG"),
    "simulate": ("mnemojax._src.simulator.cli", "project recovery costs to 1k-128k accelerators"),
}


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="mnemojax", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (_, help_text) in _COMMANDS.items():
        sub.add_parser(name, help=help_text, add_help=False)
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in _COMMANDS:
        parser.print_help()
        return 0 if not argv or argv[0] in ("-h", "--help") else 2
    module = importlib.import_module(_COMMANDS[argv[0]][0])
    command_parser = argparse.ArgumentParser(prog=f"mnemojax {argv[0]}")
    module.add_arguments(command_parser)
    args = command_parser.parse_args(argv[1:])
    return int(module.run(args) or 0)
