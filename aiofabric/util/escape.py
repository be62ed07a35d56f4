"""Text from strangers made safe to show: what every server (peer/, the collectives' rendezvous) does to a string a
client sent before it prints or logs it. Pure."""
from __future__ import annotations


def printable(text: str, limit: int = 200) -> str:
    """`text` safe for a terminal or a log line: control, format and separator characters (escape sequences,
    newlines, bidirectional overrides) written as escapes, cut at `limit` characters."""
    cut = text[:limit]
    safe = "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in cut)
    return safe + ("..." if len(text) > limit else "")
