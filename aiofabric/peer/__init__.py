"""Remote endpoints: drive NICs on other hosts from this event loop.

`protocol` (pure JSON-lines messages), `serve` (the endpoint, `aiofabric serve`), `client` (the carrier-agnostic
`Peer`), `ssh` (`connect_peer`, the only module that imports asyncssh) and `tcp` (`serve_tcp`/`connect_tcp`: the same
protocol over TCP, for `bench --server` and `bench SERVER_HOST`). Names here load lazily, so importing
this package costs nothing and never imports asyncssh.
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from ..errors import FabricError


class PeerError(FabricError):
    """A remote endpoint failed: a request's error answer, a crash, a disconnect, a timeout, an SSH failure.

    The message names the host, the request (op and id) and the remote exception's text; `host`, `op`,
    `remote_type` and `remote_message` hold them for code."""

    def __init__(self, message: str, *, host: str = "", op: str = "", remote_type: str = "",
                 remote_message: str = "") -> None:
        super().__init__(message)
        self.host, self.op, self.remote_type, self.remote_message = host, op, remote_type, remote_message


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
