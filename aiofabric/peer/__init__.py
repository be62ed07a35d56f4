"""Remote endpoints: drive NICs on other hosts from this event loop.

`protocol` (pure JSON-lines messages), `serve` (the endpoint, `aiofabric serve`), `client` (the carrier-agnostic
`Peer`), `ssh` (`connect_peer`, the only module that imports asyncssh) and `tcp` (`serve_tcp`/`connect_tcp`: the same
protocol over TCP, for `bench --server` and `bench SERVER_HOST`). Names here load lazily, so importing
this package costs nothing and never imports asyncssh.
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from ..errors import PeerError

_MODULE_OF = {"Peer": ".client", "RemoteNIC": ".client", "RemoteQP": ".client", "RemoteMR": ".client",
              "connect_peer": ".ssh", "SSHPeer": ".ssh", "connect_tcp": ".tcp", "serve_tcp": ".tcp",
              "TCPPeer": ".tcp"}
__all__ = ["PeerError", *_MODULE_OF]


def __getattr__(name: str) -> Any:
    module = _MODULE_OF.get(name)
    if module is None:
        raise AttributeError(f"module 'aiofabric.peer' has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value
    return value


if TYPE_CHECKING:
    from .client import Peer, RemoteMR, RemoteNIC, RemoteQP
    from .ssh import SSHPeer, connect_peer
