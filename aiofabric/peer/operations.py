"""The endpoint protocol's operations: what a client may ask, each op's fields, and who may ask what. Pure (no I/O).

The messages that carry them, and their framing, are `aiofabric.peer.protocol`'s; the endpoint that runs them is
`aiofabric.peer.endpoint`. Adding an op is a row of OPS here and an `op_<name>` method there.

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
    bench_params params: object                               -> the server's parameters
                 (a bandwidth client's symmetric parameters, {name: value}; a `bench --server` started with other
                 values refuses them with a ParameterMismatch naming both, and ends the session)
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

Profiles
    `aiofabric serve` over SSH answers every operation above (the SSH login is the authentication). A TCP client
    of `bench --server` is unauthenticated, so it may send only the bench exchange (BENCH): no `post`, and
    `open_nic` takes only the test's wire faults as options; the server chooses its NIC, addresses, transport,
    capture files and namespaces. Anything else is answered with a `NotAllowed` error naming the op or field.
"""
from __future__ import annotations

import dataclasses
import re
from typing import Any, Callable

from ..errors import NotAllowed

POST_VERBS = ("write", "read", "send", "recv", "write_with_imm")  # what the post op takes
REQUIRED = object()  # marks a field without a default
TEST_OPTIONS = ("loss", "reorder", "dup", "corrupt", "seed")  # the test's own wire faults: a bench client's to set
MAC = re.compile(r"[0-9a-fA-F]{2}(:[0-9a-fA-F]{2}){5}")
MAX_PINGS = 10 ** 8  # warm-up + measured iterations of one pong: about three hours at the emulator's speed
MAX_WAIT = 3600.0  # seconds one ping may take
MAX_RX_SLOTS = 4096
MAX_PROBE = 10.0  # seconds a nic_status probe may wait for the firmware

Fields = dict[str, tuple[Callable[[Any], Any], Any]]  # an op's fields: name -> (kind, default or REQUIRED)


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


def _test_options(value: Any) -> dict[str, Any]:
    options = _options(value)
    others = sorted(set(options) - set(TEST_OPTIONS))
    if others:
        raise NotAllowed(f"option(s) {', '.join(map(repr, others))} are the server's to choose; a client may set "
                         f"only the test's wire faults ({', '.join(TEST_OPTIONS)})")
    return options


def _choice(*choices: str) -> Callable[[Any], str]:
    def check(value: Any) -> str:
        if value not in choices:
            raise ValueError(f"one of {', '.join(choices)}, not {value!r}")
        return value
    return check


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


def _seconds(most: float) -> Callable[[Any], float]:
    def check(value: Any) -> float:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= most:
            raise ValueError(f"a number of seconds in (0, {most:g}], not {value!r}")
        return float(value)
    return check


def _deadline(value: Any) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(f"a positive number of seconds, not {value!r}")
    return float(value)


OPS: dict[str, Fields] = {
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
    "post": {"qp": (_handle, REQUIRED), "verb": (_choice(*POST_VERBS), REQUIRED), "mr": (_handle, REQUIRED),
             "size": (_optional(_natural), None), "local_offset": (_natural, 0),
             "remote": (_optional(_region), None), "remote_offset": (_natural, 0), "imm": (_optional(_int), None),
             "deadline": (_deadline, None)},
    "post_recvs": {"qp": (_handle, REQUIRED), "mr": (_handle, REQUIRED), "count": (_natural, REQUIRED),
                   "size": (_natural, REQUIRED), "offset": (_natural, 0), "stride": (_optional(_natural), None)},
    "close": {"handle": (_handle, REQUIRED)},
    "report": {"result": (_json_object, REQUIRED)},
    "lat_params": {"test": (_name, REQUIRED), "size": (_natural, REQUIRED), "mtu": (_natural, REQUIRED),
                   "iters": (_natural, REQUIRED), "warmup": (_natural, 0)},
    "bench_params": {"params": (_json_object, REQUIRED)},
    "pong": {"qp": (_handle, REQUIRED), "mr": (_handle, REQUIRED), "test": (_choice("write", "send"), REQUIRED),
             "size": (_bounded_int(1, 1 << 30), REQUIRED), "iters": (_bounded_int(1, MAX_PINGS), REQUIRED),
             "wait": (_seconds(MAX_WAIT), REQUIRED), "warmup": (_bounded_int(0, MAX_PINGS), 0),
             "remote": (_optional(_region), None), "rx_slots": (_bounded_int(0, MAX_RX_SLOTS), 0),
             "inline": (_bool, False)},
    "pong_wait": {"pong": (_handle, REQUIRED)},
    "nic_status": {"nic": (_handle, REQUIRED), "probe": (_seconds(MAX_PROBE), 1.0)},
}


@dataclasses.dataclass(frozen=True)
class Profile:
    """The requests one kind of client may send: `ops` (a subset of OPS, some with fewer fields); `why` ends the
    message of a refusal, saying who decides instead."""
    name: str
    ops: dict[str, Fields]
    why: str = ""


def _tcp_profile(tool: str, names: tuple[str, ...], exchange: str) -> Profile:
    """What an unauthenticated TCP client of `TOOL --server` may send: `names`, with open_nic taking only the
    test's wire faults."""
    return Profile(tool, {**{op: OPS[op] for op in names}, "open_nic": {"options": (_test_options, {})}},
                   f"a TCP client of `{tool} --server` runs only the {exchange}; the server chooses its NIC, "
                   "addresses, transport, capture files and namespaces (its own flags)")


ENDPOINT = Profile("endpoint", OPS)
BENCH_OPS_NAMES = ("ping", "open_nic", "create_cq", "create_qp", "register_mr", "fill", "sha256", "connect_qp",
                   "bench_params", "post_recvs", "close", "report", "nic_status")  # what `bench SERVER_HOST` sends
BENCH = _tcp_profile("bench", BENCH_OPS_NAMES, "bench exchange")
LAT_OPS_NAMES = ("ping", "open_nic", "create_cq", "create_qp", "register_mr", "fill", "sha256", "connect_qp",
                 "lat_params", "pong", "pong_wait", "close", "report", "nic_status")  # what `lat SERVER_HOST` sends
LAT = _tcp_profile("lat", LAT_OPS_NAMES, "latency exchange")
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
