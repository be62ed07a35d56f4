"""Remote endpoints: drive NICs on other hosts from this event loop.

`protocol` (pure JSON-lines messages), `serve` (the endpoint, `aiofabric serve`), `client` (the carrier-agnostic
`Peer`), `ssh` (`connect_peer`, the only module that imports asyncssh) and `tcp` (`serve_tcp`/`connect_tcp`: the same
protocol over TCP, for `bench --server` and `bench SERVER_HOST`). Names here load lazily, so importing
this package costs nothing and never imports asyncssh.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from ..errors import PeerError
from ..util.lazy import lazy_attributes

_HOMES = {".client": ("Peer", "RemoteNIC", "RemoteQP", "RemoteMR"), ".ssh": ("connect_peer", "SSHPeer"),
          ".tcp": ("connect_tcp", "serve_tcp", "TCPPeer")}
__all__ = ["PeerError", *(name for names in _HOMES.values() for name in names)]
__getattr__ = lazy_attributes(globals(), _HOMES)


if TYPE_CHECKING:
    from .client import Peer, RemoteMR, RemoteNIC, RemoteQP
    from .ssh import SSHPeer, connect_peer
