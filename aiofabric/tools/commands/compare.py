"""`compare BASE.json RUN.json [--tolerance 5%]`: two saved results of one command side by side; exit 1 when a
figure of RUN is worse than BASE's beyond the tolerance (or RUN failed), 2 when the files cannot be compared
(compare.py)."""
from __future__ import annotations

import argparse
from typing import Any, Callable

from ..arguments import Subcommands
from ..compare import CompareError, compare, format_report, load, parse_tolerance

DEFAULT_TOLERANCE = "5%"


def _tolerance(text: str) -> float:
    try:
        return parse_tolerance(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


_tolerance.__name__ = "tolerance"  # argparse's "invalid tolerance value" names it so


def add_compare(sub: Subcommands) -> None:
    parser = sub.add_parser("compare", help="two saved results of one command (bench, lat, a collective) side by "
                                            "side; exit 1 on a figure worse than the tolerance allows")
    parser.add_argument("base_file", metavar="BASE.json",
                        help="the reference result (a --json output, or bench's and lat's --out_json file)")
    parser.add_argument("run_file", metavar="RUN.json", help="the result judged against it")
    parser.add_argument("--tolerance", type=_tolerance, default=_tolerance(DEFAULT_TOLERANCE),
                        help="how much worse than the base a figure may be: a percentage (5%%) or a fraction below "
                             f"1 (0.05); default {DEFAULT_TOLERANCE.replace('%', '%%')}")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.set_defaults(run=cmd_compare, check=_check_compare(parser))


def _check_compare(parser: argparse.ArgumentParser) -> Callable[[argparse.Namespace], None]:
    """Both files read, and comparable, before anything runs: else a usage error naming the file."""
    def check(args: argparse.Namespace) -> None:
        try:
            files = [args.base_file, args.run_file]
            args.report = compare(files, [load(path) for path in files], args.tolerance)
        except CompareError as exc:
            parser.error(str(exc))
    return check


async def cmd_compare(args: argparse.Namespace) -> dict[str, Any]:
    if not args.json:
        print(format_report(args.report))
    return dict(args.report)
