"""The remote-endpoint protocol: JSON lines, pure (no I/O, no anyio, no driver imports), tested like h11.

One protocol, several carriers: `aiofabric serve` speaks it on stdin/stdout (started over SSH by `connect_peer`),
and `aiofabric.peer.tcp` speaks it unchanged over a TCP connection (`serve_tcp` / `connect_tcp`, `bench --server`).
Everything here turns bytes into messages and back; the carriers only move lines. What a request may ask, and who
may ask it, is `aiofabric.peer.operations`.

Framing
    Each message is one JSON object on one line: UTF-8, ending in "\\n", at most MAX_LINE bytes.

Messages
    endpoint -> client, once, first:  {"ready": true, "protocol": 1, "version": "0.1.0", "pid": 4242}
                                      (+ "idle_timeout": seconds, when the endpoint drops a client that sends no
                                      request for that long: the client then pings within it)
    client -> endpoint, a request:    {"id": 7, "op": "create_qp", "args": {"nic": 1, "cq": 2}}
    endpoint -> client, its answer:   {"id": 7, "ok": true, "result": {"qp": 3, "info": {...}}}
                     or an error:     {"id": 7, "ok": false, "error": {"type": "ValueError", "message": "..."}}

    `id` is a non-negative integer the client chooses, unique among its requests in flight. Several requests may be in
    flight; answers come in the order they finish, not the order asked. A request the endpoint cannot parse far
    enough to find its id is answered with "id": null. An unknown op, a missing, unknown or mistyped field, an
    unknown handle, and any exception the operation raises all become error answers: the endpoint never crashes on
    a request. End of input means: close every object and exit 0 (over TCP: close every object this client
    opened and wait for the next client).

    Over TCP an endpoint also drops a client that sends bytes which are not JSON-object lines at all (a stray
    connection, a port scanner, a client of another protocol): it answers the error ("id": null), closes that
    client's objects and the connection. A well-formed request with a bad op or field is answered as above.
    A line nested deeper than MAX_DEPTH (or the server's limit) is not protocol either: it is refused before any
    of it is turned into objects.

Handles
    Remote objects (NICs, CQs, QPs, MRs) are named by integer handles the endpoint hands out, unique per endpoint.
    Closing a NIC closes everything created on it.

The fill pattern
    `fill` with a seed writes `pattern(seed, n)`: both sides compute the same bytes without sending them.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import random
from typing import Any

from .operations import ENDPOINT, Profile, check_args
from ..errors import NotAllowed as NotAllowed  # the protocol's errors,
from ..errors import NotProtocolError as NotProtocolError
from ..errors import ProtocolError as ProtocolError  # defined with the others
from ..errors import Refused as Refused
from ..util.escape import printable as printable  # re-exported: the servers show strangers' text through it
from ..util.json_depth import json_depth

PROTOCOL_VERSION = 1
MAX_LINE = 1 << 20
MAX_DEPTH = 32  # JSON nesting: a request is 4 deep, a bench report 6


# -- messages ------------------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Ready:
    """The endpoint started and speaks `protocol`; it drops a client silent for `idle_timeout` s (None: never)."""
    protocol: int
    version: str
    pid: int
    idle_timeout: float | None = None


@dataclasses.dataclass(frozen=True)
class Request:
    id: int
    op: str
    args: dict[str, Any]


@dataclasses.dataclass(frozen=True)
class Answer:
    """The outcome of request `id`: `result` if ok, else the remote exception's type name and message."""
    id: int | None
    ok: bool
    result: dict[str, Any] | None = None
    error_type: str = ""
    error_message: str = ""


def encode(message: Ready | Request | Answer) -> bytes:
    """One message as one line."""
    if isinstance(message, Ready):
        data: dict[str, Any] = {"ready": True, "protocol": message.protocol, "version": message.version,
                                "pid": message.pid}
        if message.idle_timeout is not None:
            data["idle_timeout"] = message.idle_timeout
    elif isinstance(message, Request):
        data = {"id": message.id, "op": message.op, "args": message.args}
    elif message.ok:
        data = {"id": message.id, "ok": True, "result": message.result or {}}
    else:
        data = {"id": message.id, "ok": False, "error": {"type": message.error_type, "message": message.error_message}}
    line = json.dumps(data, separators=(",", ":")).encode() + b"\n"
    if len(line) > MAX_LINE:
        raise ProtocolError(f"message of {len(line)} bytes exceeds the {MAX_LINE}-byte line limit")
    return line


def _object(line: bytes, max_depth: int = MAX_DEPTH) -> dict[str, Any]:
    try:
        data = json.loads(line)
    except RecursionError:  # the parser's own guard: far deeper than any limit
        raise NotProtocolError(f"JSON nested deeper than {max_depth} levels") from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise NotProtocolError(f"not JSON ({exc}): {line[:80]!r}") from None
    if not isinstance(data, dict):
        raise NotProtocolError(f"not a JSON object: {line[:80]!r}")
    if json_depth(data) > max_depth:
        raise NotProtocolError(f"JSON nested deeper than {max_depth} levels")
    return data


def decode_request(line: bytes, profile: Profile = ENDPOINT, max_depth: int = MAX_DEPTH) -> Request:
    """A request line, its args checked against `profile`; ProtocolError (with the id, if readable) otherwise:
    NotAllowed for a request outside the profile, NotProtocolError for a line that is no JSON object at all."""
    data = _object(line, max_depth)
    request_id = data.get("id")
    if isinstance(request_id, bool) or not isinstance(request_id, int) or request_id < 0:
        raise ProtocolError(f"request without a valid id (a non-negative integer): {line[:80]!r}")
    if set(data) - {"id", "op", "args"}:
        raise ProtocolError(f"unknown request key(s) {sorted(set(data) - {'id', 'op', 'args'})}", request_id)
    if not isinstance(data.get("op"), str):
        raise ProtocolError("request without an op", request_id)
    try:
        return Request(request_id, data["op"], check_args(data["op"], data.get("args", {}), profile))
    except NotAllowed as exc:
        raise NotAllowed(str(exc), request_id) from None
    except ValueError as exc:
        raise ProtocolError(str(exc), request_id) from None


def decode_reply(line: bytes) -> Ready | Answer:
    """A line from the endpoint: Ready or Answer; ProtocolError otherwise."""
    data = _object(line)
    if data.get("ready") is True:
        if not isinstance(data.get("protocol"), int):
            raise ProtocolError(f"ready message without a protocol version: {line[:80]!r}")
        idle = data.get("idle_timeout")
        if idle is not None and (isinstance(idle, bool) or not isinstance(idle, (int, float)) or not idle > 0):
            raise ProtocolError(f"ready message with a bad idle_timeout: {line[:80]!r}")
        return Ready(data["protocol"], str(data.get("version", "")), int(data.get("pid", 0)),
                     None if idle is None else float(idle))
    request_id = data.get("id")
    if request_id is not None and (isinstance(request_id, bool) or not isinstance(request_id, int)):
        raise ProtocolError(f"answer with a bad id: {line[:80]!r}")
    if data.get("ok") is True and isinstance(data.get("result"), dict):
        return Answer(request_id, True, data["result"])
    error = data.get("error")
    if data.get("ok") is False and isinstance(error, dict):
        return Answer(request_id, False, None, str(error.get("type", "")), str(error.get("message", "")))
    raise ProtocolError(f"neither an answer nor a ready message: {line[:80]!r}")


def error_answer(request_id: int | None, error: BaseException) -> Answer:
    """The answer reporting `error`: its type name and its message on one line."""
    name = "ProtocolError" if isinstance(error, NotProtocolError) else type(error).__name__  # the wire's name
    return Answer(request_id, False, None, name, " ".join(str(error).split()))


class LineBuffer:
    """Bytes in, complete lines out (without their newline). A line longer than `max_line` raises NotProtocolError
    (whole or not yet ended; the lines before it are in the error's `lines`), and the buffer skips to the next
    newline, so one bad line does not poison the stream: `feed(b"")` then returns the lines after it."""

    def __init__(self, max_line: int = MAX_LINE) -> None:
        self.max_line = max_line
        self._buffer = bytearray()
        self._skipping = False

    def feed(self, data: bytes) -> list[bytes]:
        self._buffer += data
        lines: list[bytes] = []
        while True:
            end = self._buffer.find(b"\n")
            if end < 0:
                break
            line = bytes(self._buffer[:end])
            del self._buffer[:end + 1]
            if self._skipping:
                self._skipping = False
            elif len(line) > self.max_line:
                raise NotProtocolError(f"line longer than {self.max_line} bytes", lines=lines)
            elif line.strip():
                lines.append(line)
        if len(self._buffer) > self.max_line:
            self._buffer.clear()
            if not self._skipping:
                self._skipping = True
                raise NotProtocolError(f"line longer than {self.max_line} bytes", lines=lines)
        return lines

    @property
    def pending(self) -> int:
        """Bytes of an unfinished line (at end of input: a truncated last line)."""
        return len(self._buffer)


class ClientState:
    """The client's side as a small state machine: it hands out request ids, encodes requests (checked before they
    leave, so a bad field fails here with the same message the endpoint would give) and matches answers to them."""

    def __init__(self) -> None:
        self.ready: Ready | None = None
        self.in_flight: dict[int, str] = {}  # id -> op
        self.forgotten: set[int] = set()
        self._next_id = 1

    def request(self, op: str, **args: Any) -> tuple[int, bytes]:
        checked = check_args(op, args)
        request_id, self._next_id = self._next_id, self._next_id + 1
        line = encode(Request(request_id, op, {k: v for k, v in args.items() if k in checked}))
        self.in_flight[request_id] = op
        return request_id, line

    def forget(self, request_id: int) -> None:
        """The caller gave up on `request_id` (timeout, cancellation): its late answer is dropped."""
        if self.in_flight.pop(request_id, None) is not None:
            self.forgotten.add(request_id)

    def receive(self, line: bytes) -> Ready | Answer | None:
        """The message on `line`; None for a late answer to a forgotten request."""
        message = decode_reply(line)
        if isinstance(message, Ready):
            if self.ready is not None:
                raise ProtocolError("a second ready message")
            if message.protocol != PROTOCOL_VERSION:
                raise ProtocolError(f"endpoint speaks protocol {message.protocol}, this client {PROTOCOL_VERSION}")
            self.ready = message
            return message
        if self.ready is None:
            if message.id is None and not message.ok:  # the endpoint turned this client away (a busy TCP server)
                raise Refused(f"{message.error_type}: {message.error_message}")
            raise ProtocolError("an answer before the ready message")
        if message.id is None:
            raise ProtocolError(f"the endpoint could not parse a request: {message.error_message}")
        if self.in_flight.pop(message.id, None) is None:
            if message.id in self.forgotten:
                self.forgotten.discard(message.id)
                return None
            raise ProtocolError(f"an answer to request {message.id}, which is not in flight")
        return message


PATTERN_CHUNK = 1 << 20


def fill_pattern(view: memoryview | bytearray, seed: int) -> None:
    """Fill `view` with the pseudo-random bytes of `seed`, a chunk at a time (no temporary the size of the whole,
    any length): both sides of a test compute the same bytes without sending them, and a shorter fill is a prefix
    of a longer one."""
    with memoryview(view) as whole, whole.cast("B") as flat:
        for index, start in enumerate(range(0, len(flat), PATTERN_CHUNK)):
            end = min(start + PATTERN_CHUNK, len(flat))
            # a str seed is hashed, not truncated; whole 32-bit words keep the prefix rule inside a chunk
            flat[start:end] = random.Random(f"{seed}:{index}").randbytes(-(-(end - start) // 4) * 4)[:end - start]


def pattern(seed: int, length: int) -> bytes:
    """The first `length` bytes `fill_pattern` writes for `seed`."""
    data = bytearray(length)
    fill_pattern(data, seed)
    return bytes(data)


def printable_tree(value: Any) -> Any:
    """A JSON value with every string in it (keys too) made `printable`, cut at 1000 characters."""
    if isinstance(value, str):
        return printable(value, 1000)
    if isinstance(value, dict):
        return {printable(str(key), 1000): printable_tree(item) for key, item in value.items()}
    if isinstance(value, list):
        return [printable_tree(item) for item in value]
    return value


def sha256_hex(data: bytes | memoryview) -> str:
    return hashlib.sha256(data).hexdigest()
