"""How the command line stops on a signal: SIGTERM, SIGINT and SIGHUP end a command with a JSON line and exit code
128 + signal, from the first instruction on (imports included); a second signal forces the exit.

Light on purpose (the standard library, and result_meta, which needs no more): the entry point installs these
handlers before it imports anything heavy, so a signal during start-up is reported like one during the run. Once the
command's own signal receiver runs (it cancels the command cleanly), `command_started()` turns these handlers into
the forced exit.
"""
from __future__ import annotations

import json
import os
import signal
import sys
from types import FrameType

from . import result_meta

MESSAGES = {signal.SIGTERM: "terminated by SIGTERM", signal.SIGINT: "interrupted by SIGINT",
            signal.SIGHUP: "hung up (SIGHUP)"}
_state = {"running": False}


class Signalled(BaseException):
    """A signal stopped the command. A BaseException, like KeyboardInterrupt: no `except Exception` eats it."""

    def __init__(self, signum: int) -> None:
        super().__init__(MESSAGES[signal.Signals(signum)])
        self.signum = signum


def _handle(signum: int, frame: FrameType | None) -> None:
    if not _state["running"]:
        raise Signalled(signum)  # start-up: unwinds to the entry point, which reports it
    signal.signal(signum, signal.SIG_DFL)  # a second signal while the command cleans up: exit now
    os.kill(os.getpid(), signum)


def install() -> None:
    """Report a signal that arrives before the command's own receiver (imports, argument parsing)."""
    for signum in MESSAGES:
        signal.signal(signum, _handle)


def command_started() -> None:
    """The command's receiver handles the first signal from now on; these handlers only force an exit."""
    _state["running"] = True


def report(stopped: Signalled, argv: list[str]) -> int:
    """Say that `stopped` ended the command as it would have been said at its end (a JSON line with --json); the
    exit code, 128 + signal."""
    if "--json" in argv:  # which word is the command is not known before the parser is built: none named
        print(json.dumps(result_meta.stamped(False, result_meta.metadata(argv, None, result_meta.now()),
                                             {"error": str(stopped)})), flush=True)
    else:
        print(f"aiofabric: {stopped}", file=sys.stderr, flush=True)
    return 128 + stopped.signum
