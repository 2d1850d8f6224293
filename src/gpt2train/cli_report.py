"""`gpt2train report RUN_DIR [RUN_DIR ...] [--out DIR]`: argparse wiring only; the work is in report.py."""

from __future__ import annotations

import argparse
from pathlib import Path

from gpt2train.report import build_report


def register(subparsers) -> None:
    """Add the `report` subcommand to the main CLI's subparsers."""
    p = subparsers.add_parser(
        "report",
        help="figures, an HTML page and a JSON summary of one or more runs",
        description="Read RUN_DIR/metrics.jsonl and write PNG figures, a self-contained report.html and "
        "metrics.json. Several runs are overlaid on the same axes for comparison. "
        "Works on a run in progress.",
    )
    p.add_argument("run_dirs", nargs="+", type=Path, metavar="RUN_DIR", help="run directories to report on")
    p.add_argument("--out", type=Path, default=None, metavar="DIR",
                   help="output folder (default: RUN_DIR/report for one run, ./report for several)")
    p.add_argument("--log-y", action="store_true", help="loss on a log scale")
    p.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    """Build the report and print the page's path; bad input raises ReportError (a ValueError)."""
    print(build_report(args.run_dirs, args.out, log_y=args.log_y))
    return 0
