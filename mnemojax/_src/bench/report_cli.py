"""``mnemojax report RUN.jsonl``: goodput table and PNG of any run's event log (no JAX)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from mnemojax._src.errors import InvalidOptionError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = (__doc__ or "").partition("\n")[0]
    parser.add_argument("log", help="JSONL event log (one or several runs)")
    parser.add_argument("--out", default=None,
                        help="directory for report.png and report.json (default: the log's)")
    parser.add_argument("--run", action="append", default=None,
                        help="only this run id (repeatable)")


def run(args: argparse.Namespace) -> int:
    from mnemojax._src.bench import plots, report

    path = Path(args.log)
    if not path.is_file():
        raise InvalidOptionError(f"log={str(path)!r} is invalid: no such file")
    accounts = report.account_log(path)
    if args.run:
        unknown = sorted(set(args.run) - {a.run for a in accounts})
        if unknown:
            raise InvalidOptionError(f"--run={unknown!r} is invalid: the log has runs "
                                     f"{[a.run for a in accounts]}")
        accounts = [a for a in accounts if a.run in args.run]
    if not accounts:
        raise InvalidOptionError(f"log={str(path)!r} is invalid: it holds no events")
    out = Path(args.out) if args.out else path.parent
    out.mkdir(parents=True, exist_ok=True)
    print(report.format_table(accounts))
    png = out / "report.png"
    plots.save_report(png, accounts, f"{path.name}: steps against wall time (x = fault)")
    (out / "report.json").write_text(json.dumps([a.as_dict() for a in accounts], indent=1))
    print(f"written: {png}, {out / 'report.json'}")
    return 0
