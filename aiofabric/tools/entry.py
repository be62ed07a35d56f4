"""The `aiofabric` command's entry point: signal handling first, then the command line (aiofabric/tools/cli.py), so a
signal that arrives while the driver's modules are still importing gets its JSON line and exit code too."""
from __future__ import annotations

import sys

from . import signals


def main() -> int:
    try:
        signals.install()  # inside: a signal may arrive between two of its handlers being installed
        from .cli import main as run
    except signals.Signalled as stopped:
        return signals.report(stopped, sys.argv[1:])
    return run()
