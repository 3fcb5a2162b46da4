"""Command line: ``python -m mnemojax <command>`` / ``mnemojax <command>``.

Each command lives in its own module that exposes ``add_arguments(parser)`` and
``run(args)``; the module is imported only when its command runs, so ``mnemojax --help``
stays fast, no JAX backend is touched before the command configures it, and the JAX-free
commands (``simulate``, ``report``) never import JAX (tests/import_test.py checks).
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
    "launch": ("mnemojax._src.distributed.launcher.cli",
               "run N worker processes with agents and a recoverable coordination service"),
    "status": ("mnemojax._src.distributed.launcher.status",
               "a multi-node job's world, nodes, deaths and exits, read from etcd"),
    "bench": ("mnemojax._src.bench.cli", "mnemojax vs the classical restart baseline, same faults"),
    "report": ("mnemojax._src.bench.report_cli", "render a run's JSONL event log: table + PNG"),
    "simulate": ("mnemojax._src.simulator.cli", "project recovery costs to 1k-128k accelerators"),
}

# Top-level modules of the `tools` extra (pyproject.toml): figures and progress bars.
_TOOLS_EXTRA = frozenset({"matplotlib", "tqdm"})


class DefaultsHelpFormatter(argparse.HelpFormatter):
    """Adds "(default: X)" to an option's help where that says something: not for a
    required option, a flag, an option without a default, or help that names its default
    already."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if (action.required or action.default in (None, False, argparse.SUPPRESS)
                or "default" in text or not action.option_strings):
            return text
        return f"{text} (default: %(default)s)"


def main(argv: Sequence[str] | None = None) -> int:
    """Runs one command; returns its exit status.

    A command that needs a module of the ``tools`` extra which is not installed exits
    with status 1 and names the extra to install. Bad input (an option, a config file or
    the environment: `InvalidOptionError`, `WorldConfigError`) exits with status 2 and one
    line on stderr naming the bad value, as argparse does for its own arguments; a
    failure of the multi-process layer (`DistributedError`: etcd out of reach, a node
    that never registered) exits with status 1 and one line.
    """
    from mnemojax._src.errors import DistributedError, InvalidOptionError, WorldConfigError

    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="mnemojax",
                                     description="mnemojax command-line tools.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (_, help_text) in _COMMANDS.items():
        sub.add_parser(name, help=help_text, add_help=False)
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in _COMMANDS:
        parser.print_help()
        return 0 if not argv or argv[0] in ("-h", "--help") else 2
    try:
        module = importlib.import_module(_COMMANDS[argv[0]][0])
        command_parser = argparse.ArgumentParser(prog=f"mnemojax {argv[0]}",
                                                 formatter_class=DefaultsHelpFormatter)
        module.add_arguments(command_parser)
        args = command_parser.parse_args(argv[1:])
        return int(module.run(args) or 0)
    except (InvalidOptionError, WorldConfigError) as exc:
        cause = exc.__cause__  # raised from another error: say it too, it is not only input
        why = f" (from {type(cause).__name__}: {cause})" if cause is not None else ""
        print(f"mnemojax {argv[0]}: error: {exc}{why}", file=sys.stderr)
        return 2
    except DistributedError as exc:  # (etcd out of reach, a node that never came)
        print(f"mnemojax {argv[0]}: error: {exc}", file=sys.stderr)
        return 1
    except ModuleNotFoundError as exc:
        missing = (exc.name or "").partition(".")[0]
        if missing not in _TOOLS_EXTRA:
            raise
        print(f"mnemojax {argv[0]}: needs {missing}, which comes with the 'tools' extra: "
              "pip install 'mnemojax[tools]'", file=sys.stderr)
        return 1
