"""How deeply a parsed JSON value nests, for the servers that take JSON from strangers (peer/protocol.py, the
collectives' rendezvous): json.loads parses deeper than json.dumps can write back. Pure."""
from __future__ import annotations

from typing import Any


def json_depth(value: Any) -> int:
    """How deeply `value` nests lists and objects (a scalar: 0), without recursion."""
    deepest, level = 0, [(value, 1)]
    while level:
        item, depth = level.pop()
        children = item.values() if isinstance(item, dict) else item if isinstance(item, list) else None
        if children is not None:
            deepest = max(deepest, depth)
            level.extend((child, depth + 1) for child in children)
    return deepest
