"""The remote-endpoint protocol: JSON lines, pure (no I/O, no anyio, no driver imports), tested like h11.

One protocol, several carriers: `aiofabric serve` speaks it on stdin/stdout (started over SSH by `connect_peer`),
and `aiofabric.peer.tcp` speaks it unchanged over a TCP connection (`serve_tcp` / `connect_tcp`, `bench --server`). Everything here turns bytes into messages and back;
the carriers only move lines.

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

Profiles
    `aiofabric serve` over SSH answers every operation below (the SSH login is the authentication). A TCP client
    of `bench --server` is unauthenticated, so it may send only the bench exchange (BENCH): no `post`, and
    `open_nic` takes only the test's wire faults as options; the server chooses its NIC, addresses, transport,
    capture files and namespaces. Anything else is answered with a `NotAllowed` error naming the op or field.

Handles
    Remote objects (NICs, CQs, QPs, MRs) are named by integer handles the endpoint hands out, unique per endpoint.
    Closing a NIC closes everything created on it.

Operations (`args` fields; "=" marks a default, the rest are required)
    ping         -                                            -> {"pid"}
    open_nic     spec="sim", ip=null, options={}              -> {"nic", "ip", "gid", "mac"}
                 (options: the emulated NIC's, e.g. {"netns": "B", "fw_latency_us": 30}; ip "ssh": the address
                 the SSH connection reached, from SSH_CONNECTION; ip "connection": the address the client's
                 connection reached, whatever the carrier: the accepted socket's local address over TCP, as "ssh"
                 over SSH)
    create_cq    nic, depth=256                               -> {"cq"}
    create_qp    nic, cq, sq_depth=128, rq_depth=128, max_inline_data=0 -> {"qp", "info": QP_INFO}
    register_mr  nic, size, atomic=false                      -> {"mr", "region": REGION}
                 (atomic: the region also allows remote atomics)
    fill         mr, seed=null, byte=0, offset=0, length=null -> {"sha256"}   (seed: pattern(seed, n), else byte)
    sha256       mr, offset=0, length=null                    -> {"sha256"}   (of that range; length null: to the end)
    connect_qp   qp, peer: QP_INFO, mtu=4096, timeout=14, retry_cnt=7, atomic=false -> {"state"}
                 (atomic: the QP also answers remote atomics)
    post         qp, verb, mr, size=null, local_offset=0, remote=null: REGION, remote_offset=0, imm=null,
                 deadline=null (seconds)                      -> {"byte_len", "imm"}   (awaits the completion)
                 verb: write, read, send, recv, write_with_imm; write/read need `remote`
    post_recvs   qp, mr, count, size, offset=0, stride=null    -> {"posted": count}
                 (posts `count` receives of `size` bytes at offset + i * stride (stride null: size) and answers
                 once they are posted, without awaiting them: the remote half of a SEND benchmark)
    close        handle                                       -> {"closed": handle}
    nic_status   nic, probe=1.0 (seconds, at most MAX_PROBE)  -> {"nic": its name, "stopped": why or null}
                 (whether that NIC stopped: its device gone, its session failed, or its firmware left a harmless
                 query unanswered for `probe` s; a client whose run failed asks, so its error names the NIC that
                 stopped rather than its own QP that saw it)
    lat_params   test, size, mtu, iters, warmup=0             -> {"test", "size", "mtu"}   (the server's)
                 (a latency client's parameters; a `lat --server` started with another test, size or MTU refuses
                 them with a ParameterMismatch naming both, and ends the session)
    pong         qp, mr, test, size, iters, wait, warmup=0, remote=null: REGION, rx_slots=0, inline=false -> {"pong"}
                 (starts the server half of a latency ping-pong, aiofabric/peer/pingpong.py, on a connected QP:
                 test "write" (remote: the client's region) or "send" (rx_slots receives posted ahead); answers
                 once it is ready for the first ping)
    pong_wait    pong                                         -> {"iterations"}   (awaits that half's end; its
                 error, e.g. a ping that never came within `wait` seconds, is this answer's)
    report       result: object                               -> {"reported": true}
                 (the client hands the endpoint a finished run's result, e.g. `run_bench`'s dict, so the server
                 side can print the same table; an endpoint with nobody to show it to just logs it)

    QP_INFO = {"qpn": int, "gid": hex str (16 bytes), "mac": "aa:bb:..", "psn": int}
    REGION  = {"addr": int, "rkey": int, "length": int|null}
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import random
import re
from typing import Any, Callable

from ..errors import NotAllowed as NotAllowed  # the protocol's errors,
from ..errors import NotProtocolError as NotProtocolError
from ..errors import ProtocolError as ProtocolError  # defined with the others
from ..errors import Refused as Refused
from ..util.escape import printable as printable  # re-exported: the servers show strangers' text through it
from ..util.json_depth import json_depth

PROTOCOL_VERSION = 1
MAX_LINE = 1 << 20
MAX_DEPTH = 32  # JSON nesting: a request is 4 deep, a bench report 6
POST_VERBS = ("write", "read", "send", "recv", "write_with_imm")  # what the post op takes
REQUIRED = object()  # marks a field without a default


# -- field kinds: each checks (and normalises) a value or raises ValueError naming what it wanted ------------------

def _int(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"an integer, not {value!r}")
    return value


def _natural(value: Any) -> int:
    if _int(value) < 0:
        raise ValueError(f"a non-negative integer, not {value!r}")
    return value


def _handle(value: Any) -> int:
    if _int(value) < 1:
        raise ValueError(f"a handle (a positive integer), not {value!r}")
    return value


def _str(value: Any) -> str:
    if not isinstance(value, str):
        raise ValueError(f"a string, not {value!r}")
    return value


def _optional(kind: Callable[[Any], Any]) -> Callable[[Any], Any]:
    def check(value: Any) -> Any:
        return None if value is None else kind(value)
    return check


def _options(value: Any) -> dict[str, Any]:
    if not isinstance(value, dict) or not all(isinstance(v, (str, int, float, bool, type(None)))
                                              for v in value.values()):
        raise ValueError(f"an object of scalar options, not {value!r}")
    return value


TEST_OPTIONS = ("loss", "reorder", "dup", "corrupt", "seed")  # the test's own wire faults: a bench client's to set


def _test_options(value: Any) -> dict[str, Any]:
    options = _options(value)
    others = sorted(set(options) - set(TEST_OPTIONS))
    if others:
        raise NotAllowed(f"option(s) {', '.join(map(repr, others))} are the server's to choose; a client may set "
                         f"only the test's wire faults ({', '.join(TEST_OPTIONS)})")
    return options


def _verb(value: Any) -> str:
    if value not in POST_VERBS:
        raise ValueError(f"one of {', '.join(POST_VERBS)}, not {value!r}")
    return value


MAC = re.compile(r"[0-9a-fA-F]{2}(:[0-9a-fA-F]{2}){5}")


def _qp_info(value: Any) -> dict[str, Any]:
    try:
        if not isinstance(value, dict) or set(value) != {"qpn", "gid", "mac", "psn"}:
            raise ValueError
        _natural(value["qpn"]), _natural(value["psn"])
        if len(bytes.fromhex(_str(value["gid"]))) != 16 or not MAC.fullmatch(_str(value["mac"])):
            raise ValueError
    except ValueError:
        raise ValueError(f'a QP info {{"qpn", "gid" (32 hex digits), "mac", "psn"}}, not {value!r}') from None
    return value


def _region(value: Any) -> dict[str, Any]:
    try:
        if not isinstance(value, dict) or not {"addr", "rkey"} <= set(value) <= {"addr", "rkey", "length"}:
            raise ValueError
        _natural(value["addr"]), _natural(value["rkey"]), _optional(_natural)(value.get("length"))
    except ValueError:
        raise ValueError(f'a remote region {{"addr", "rkey", "length"}}, not {value!r}') from None
    return {"length": None, **value}


def _json_object(value: Any) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise ValueError(f"a JSON object, not {value!r}"[:200])
    return value


MAX_PINGS = 10 ** 8  # warm-up + measured iterations of one pong: about three hours at the emulator's speed
MAX_WAIT = 3600.0  # seconds one ping may take
MAX_RX_SLOTS = 4096
MAX_PROBE = 10.0  # seconds a nic_status probe may wait for the firmware


def _bounded_int(low: int, high: int) -> Callable[[Any], int]:
    def check(value: Any) -> int:
        if not low <= _int(value) <= high:
            raise ValueError(f"an integer in [{low}, {high}], not {value!r}")
        return value
    return check


def _name(value: Any) -> str:
    if not isinstance(value, str) or not value.isidentifier() or len(value) > 32:
        raise ValueError(f"a name (letters, digits, _; at most 32), not {value!r}"[:200])
    return value


def _bool(value: Any) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"true or false, not {value!r}")
    return value


def _wait(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= MAX_WAIT:
        raise ValueError(f"a number of seconds in (0, {MAX_WAIT:g}], not {value!r}")
    return float(value)


def _probe(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= MAX_PROBE:
        raise ValueError(f"a number of seconds in (0, {MAX_PROBE:g}], not {value!r}")
    return float(value)


def _choice(*choices: str) -> Callable[[Any], str]:
    def check(value: Any) -> str:
        if value not in choices:
            raise ValueError(f"one of {', '.join(choices)}, not {value!r}")
        return value
    return check


def _deadline(value: Any) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(f"a positive number of seconds, not {value!r}")
    return float(value)


OPS: dict[str, dict[str, tuple[Callable[[Any], Any], Any]]] = {
    "ping": {},
    "open_nic": {"spec": (_str, "sim"), "ip": (_optional(_str), None), "options": (_options, {})},
    "create_cq": {"nic": (_handle, REQUIRED), "depth": (_int, 256)},
    "create_qp": {"nic": (_handle, REQUIRED), "cq": (_handle, REQUIRED), "sq_depth": (_int, 128),
                  "rq_depth": (_int, 128), "max_inline_data": (_natural, 0)},
    "register_mr": {"nic": (_handle, REQUIRED), "size": (_int, REQUIRED), "atomic": (_bool, False)},
    "fill": {"mr": (_handle, REQUIRED), "seed": (_optional(_int), None), "byte": (_int, 0),
             "offset": (_natural, 0), "length": (_optional(_natural), None)},
    "sha256": {"mr": (_handle, REQUIRED), "offset": (_natural, 0), "length": (_optional(_natural), None)},
    "connect_qp": {"qp": (_handle, REQUIRED), "peer": (_qp_info, REQUIRED), "mtu": (_int, 4096),
                   "timeout": (_int, 14), "retry_cnt": (_int, 7), "atomic": (_bool, False)},
    "post": {"qp": (_handle, REQUIRED), "verb": (_verb, REQUIRED), "mr": (_handle, REQUIRED),
             "size": (_optional(_natural), None), "local_offset": (_natural, 0),
             "remote": (_optional(_region), None), "remote_offset": (_natural, 0), "imm": (_optional(_int), None),
             "deadline": (_deadline, None)},
    "post_recvs": {"qp": (_handle, REQUIRED), "mr": (_handle, REQUIRED), "count": (_natural, REQUIRED),
                   "size": (_natural, REQUIRED), "offset": (_natural, 0), "stride": (_optional(_natural), None)},
    "close": {"handle": (_handle, REQUIRED)},
    "report": {"result": (_json_object, REQUIRED)},
    "lat_params": {"test": (_name, REQUIRED), "size": (_natural, REQUIRED), "mtu": (_natural, REQUIRED),
                   "iters": (_natural, REQUIRED), "warmup": (_natural, 0)},
    "pong": {"qp": (_handle, REQUIRED), "mr": (_handle, REQUIRED), "test": (_choice("write", "send"), REQUIRED),
             "size": (_bounded_int(1, 1 << 30), REQUIRED), "iters": (_bounded_int(1, MAX_PINGS), REQUIRED),
             "wait": (_wait, REQUIRED), "warmup": (_bounded_int(0, MAX_PINGS), 0), "remote": (_optional(_region), None),
             "rx_slots": (_bounded_int(0, MAX_RX_SLOTS), 0), "inline": (_bool, False)},
    "pong_wait": {"pong": (_handle, REQUIRED)},
    "nic_status": {"nic": (_handle, REQUIRED), "probe": (_probe, 1.0)},
}


@dataclasses.dataclass(frozen=True)
class Profile:
    """The requests one kind of client may send: `ops` (a subset of OPS, some with fewer fields); `why` ends the
    message of a refusal, saying who decides instead."""
    name: str
    ops: dict[str, dict[str, tuple[Callable[[Any], Any], Any]]]
    why: str = ""


ENDPOINT = Profile("endpoint", OPS)
BENCH_OPS_NAMES = ("ping", "open_nic", "create_cq", "create_qp", "register_mr", "fill", "sha256", "connect_qp",
                   "post_recvs", "close", "report", "nic_status")  # what `bench SERVER_HOST` sends, nothing else
BENCH = Profile("bench", {**{op: OPS[op] for op in BENCH_OPS_NAMES}, "open_nic": {"options": (_test_options, {})}},
                "a TCP client of `bench --server` runs only the bench exchange; the server chooses its NIC, "
                "addresses, transport, capture files and namespaces (its own flags)")
LAT_OPS_NAMES = ("ping", "open_nic", "create_cq", "create_qp", "register_mr", "fill", "sha256", "connect_qp",
                 "lat_params", "pong", "pong_wait", "close", "report", "nic_status")  # what `lat SERVER_HOST` sends
LAT = Profile("lat", {**{op: OPS[op] for op in LAT_OPS_NAMES}, "open_nic": {"options": (_test_options, {})}},
              "a TCP client of `lat --server` runs only the latency exchange; the server chooses its NIC, "
              "addresses, transport, capture files and namespaces (its own flags)")
PROFILES = {"bench": BENCH, "lat": LAT}  # a TCP server's profile, by the command serving


def check_args(op: str, args: Any, profile: Profile = ENDPOINT) -> dict[str, Any]:
    """`args` of `op` with defaults filled in; ValueError naming the op and the field that is wrong, NotAllowed
    for an op or field that exists but is outside `profile`."""
    fields = profile.ops.get(op)
    if fields is None:
        if op in OPS:
            raise NotAllowed(f"op {op!r} is not allowed: {profile.why}")
        raise ValueError(f"unknown op {op!r}; known: {', '.join(profile.ops)}")
    if not isinstance(args, dict):
        raise ValueError(f"{op}: args must be an object, not {args!r}")
    unknown = sorted(set(args) - set(fields))
    refused = [name for name in unknown if name in OPS[op]]
    if refused:
        raise NotAllowed(f"{op}: field(s) {', '.join(map(repr, refused))} not allowed: {profile.why}")
    if unknown:
        raise ValueError(f"{op}: unknown field(s) {', '.join(unknown)}; known: {', '.join(fields) or 'none'}")
    checked = {}
    for name, (kind, default) in fields.items():
        if name not in args:
            if default is REQUIRED:
                raise ValueError(f"{op}: missing field {name!r}")
            checked[name] = dict(default) if isinstance(default, dict) else default
            continue
        try:
            checked[name] = kind(args[name])
        except NotAllowed as exc:
            raise NotAllowed(f"{op}: field {name!r}: {exc}") from None
        except ValueError as exc:
            raise ValueError(f"{op}: field {name!r} must be {exc}") from None
    if op == "post" and checked["verb"] in ("write", "read", "write_with_imm") and checked["remote"] is None:
        raise ValueError(f"post: verb {checked['verb']!r} needs field 'remote'")
    if op == "post" and checked["verb"] == "write_with_imm" and checked["imm"] is None:
        raise ValueError("post: verb 'write_with_imm' needs field 'imm'")
    return checked


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
