"""What every `--json` line carries besides its command's own keys (docs/json-results.md): "ok", the version of the
keys' schema (schemas/result.schema.json), the command and the command line that made it, the host, the time it
started (ISO 8601, UTC) and aiofabric's version. The standard library only, like signals.py, which stamps a signal's
line with it before the command line is imported."""
from __future__ import annotations

import shlex
import socket
import time
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

from ..version import __version__

# Raised when a key is removed or renamed or its meaning changes; a new key keeps it (a reader ignores keys it does
# not know). compare reads the versions it knows (compare.KNOWN_SCHEMAS).
SCHEMA_VERSION = 1
SCHEMA = Path(__file__).with_name("schemas") / "result.schema.json"  # shipped with the package
KEYS = ("ok", "schema_version", "aiofabric_version", "command", "command_line", "host", "time")


def now() -> str:
    """The current time as the results write it: ISO 8601 in UTC, to the second (2026-12-05T14:03:59Z)."""
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def command_of(argv: Sequence[str], commands: Iterable[str]) -> str | None:
    """The command `argv` names (its first word that is one), or None: a usage error may come before any."""
    names = set(commands)
    return next((word for word in argv if word in names), None)


def metadata(argv: Sequence[str], command: str | None, started: str) -> dict[str, Any]:
    """The keys every result of this command line carries (`started`: `now()` when the command started)."""
    return {"schema_version": SCHEMA_VERSION, "aiofabric_version": __version__, "command": command,
            "command_line": shlex.join(["aiofabric", *argv]), "host": socket.gethostname(), "time": started}


def stamped(ok: bool, meta: Mapping[str, Any], result: Mapping[str, Any]) -> dict[str, Any]:
    """One `--json` line: "ok", the metadata, then the command's keys. A result's own copy of a metadata key (a
    remote rank's line, taken into --hosts' result) gives way to this command's."""
    return {"ok": ok, **meta, **{key: value for key, value in result.items() if key not in KEYS}}
