"""Remote endpoints: drive NICs on other hosts from this event loop.

The protocol, pure: `protocol` (JSON-lines messages, their framing, the client's state machine) and `operations`
(each op's fields, and which a TCP client may send). The endpoint: `endpoint` (the handler of each op), `serve` (the
session around it, `aiofabric serve`) and `policy` (what an unauthenticated client may make it do). The client side:
`client` (the carrier-agnostic `Peer`), `ssh` (`connect_peer`, the only module that imports asyncssh), `launch` (what
runs on the remote host), `push` (what a push copies there), `hostfile` (`--hosts`' hosts and their MPI slots),
`remote_run` (`run_remote`, one command to its end) and
`tcp` (`serve_tcp`/`connect_tcp`: the same protocol over TCP, for `bench --server` and `bench SERVER_HOST`). Also:
`connect` (the flows of `aiofabric connect`: two hosts, a ring) and `pingpong` (the two halves of the latency
ping-pong). Names here load lazily, so importing this package costs nothing and never imports asyncssh.
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
