"""Exceptions the driver raises. Each names what failed and, where the device said why, the decoded reason."""
from __future__ import annotations

from .hw.firmware import HWRM_ERROR_NAMES, RCFW_STATUS_NAMES


class FabricError(Exception):
    """Base class of aiofabric's errors. Every error aiofabric raises on purpose is one, except bad arguments, which
    are plain ValueErrors naming the argument and its range; those below that are also about a bad value keep
    ValueError as a second base."""


class BadOption(ValueError):
    """A setting out of its range, named by its option (`dest`: the long flag without "--", "_" for "-") and the
    value given; the command line reports it as a usage error under the spelling the user typed (-q or --qps)."""

    def __init__(self, dest: str, value: object, reason: str) -> None:
        self.dest, self.value, self.reason = dest, value, reason
        super().__init__(f"--{dest.replace('_', '-')} {value}: {reason}")


class FirmwareError(FabricError):
    """The firmware answered a command with an error status."""

    def __init__(self, command: str, status: int, reason: str, detail: str = "") -> None:
        self.command, self.status, self.reason = command, status, reason
        super().__init__(f"{command} failed: {reason} ({status:#x}){': ' + detail if detail else ''}")

    @classmethod
    def hwrm(cls, name: str, status: int, cmd_err: int = 0) -> FirmwareError:
        return cls(f"HWRM {name}", status, HWRM_ERROR_NAMES.get(status, "UNKNOWN"),
                   f"cmd_err {cmd_err:#x}" if cmd_err else "")

    @classmethod
    def rcfw(cls, name: str, status: int) -> FirmwareError:
        return cls(f"RCFW {name}", status, RCFW_STATUS_NAMES.get(status, "UNKNOWN"))


class FirmwareTimeoutError(FabricError, TimeoutError):
    """The firmware did not answer a command in time."""


class ClosedError(FabricError):
    """The object (NIC, QP, CQ, MR) was closed or destroyed; it refuses every use (trio's ClosedResourceError)."""


class DeviceLostError(FabricError):
    """The device is gone (emulator process died, surprise removal); every pending operation fails with this."""


class PCIError(FabricError, RuntimeError):
    """The device could not be opened or used through the seam (missing device, driver bound, privileges...)."""


class CompletionError(FabricError):
    """A work request completed with an error status (decoded from the CQE).

    A flushed work request (its QP had already failed) names the error that moved the QP to ERR: `root` holds it
    (also chained as `__cause__`), so the first failure is what the user reads, even when it hit an unsignaled
    work request nobody awaited."""

    def __init__(self, verb: str, qpn: int, status: int, reason: str, root: BaseException | None = None) -> None:
        self.verb, self.qpn, self.status, self.reason, self.root = verb, qpn, status, reason, root
        message = f"{verb} on QP {qpn:#x} failed: {reason} ({status})"
        if root is not None:
            message = f"{verb} on QP {qpn:#x} was flushed ({reason}) because the QP failed earlier: {root}"
        super().__init__(message)
        self.__cause__ = root

    @property
    def flushed(self) -> bool:
        return self.reason == "WORK_REQUEST_FLUSHED_ERR"


class QPStateError(FabricError, RuntimeError):
    """A verb that the QP's state does not allow (a post before connect, a receive in RESET)."""


class OperationTimeoutError(FabricError, TimeoutError):
    """An operation (not a firmware command) did not finish in time: a benchmark's message, a peer's request."""


class LinkDownError(FabricError, TimeoutError):
    """The port's link did not come up in time (no cable, a dark switch port, a link partner that does not train)."""


class PeerError(FabricError):
    """A remote endpoint failed: a request's error answer, a crash, a disconnect, a timeout, an SSH failure.

    The message names the host, the request (op and id) and the remote exception's text; `host`, `op`,
    `remote_type` and `remote_message` hold them for code."""

    def __init__(self, message: str, *, host: str = "", op: str = "", remote_type: str = "",
                 remote_message: str = "") -> None:
        super().__init__(message)
        self.host, self.op, self.remote_type, self.remote_message = host, op, remote_type, remote_message


class ProtocolError(FabricError, ValueError):
    """A line that is not a valid message of the peer protocol. `request_id` is the id it carried, if one could be
    read."""

    def __init__(self, message: str, request_id: int | None = None) -> None:
        super().__init__(message)
        self.request_id = request_id


class NotProtocolError(ProtocolError):
    """Bytes that are not a JSON-object line at all (not JSON, not an object, an overlong line): the other side does
    not speak this protocol. A TCP endpoint drops such a client; the stdin endpoint answers and reads on.
    `lines`: from `LineBuffer.feed`, the complete lines that came before the bad one (still to be handled)."""

    def __init__(self, message: str, request_id: int | None = None, lines: list[bytes] | None = None) -> None:
        super().__init__(message, request_id)
        self.lines = lines or []


class Refused(ProtocolError):
    """The endpoint answered before its ready message, with an error and no id: it turned this client away."""


class NotAllowed(ProtocolError):
    """A request this client may not send (an op or a field outside its profile): refused, never run."""


class ParameterMismatch(FabricError, ValueError):
    """The two sides of a test were started with different parameters (test, size, MTU): both refuse to run it."""


class LimitError(FabricError, RuntimeError):
    """A request that would take a client past one of the bench server's limits: refused, nothing done."""


class CallError(FabricError):
    """A call of a batch failed; the batch was aborted. `call` is its index, `queue` its queue's name, `cause` the
    original error (also `__cause__`)."""

    def __init__(self, index: int, name: str, queue: str, cause: BaseException, note: str = "") -> None:
        self.call, self.queue, self.cause = index, queue, cause
        super().__init__(f"call {index} ({name}) on queue {queue} failed: {type(cause).__name__}: {cause}; "
                         f"the batch was aborted{note}")


class ImmediateMismatchError(FabricError):
    """A WRITE_WITH_IMM arrived with another immediate than the receiver expected: the peers disagree about what
    runs (another collective, another size, a step missed), and the data it placed cannot be trusted."""

    def __init__(self, expected: int, got: int | None) -> None:
        self.expected, self.got = expected, got
        got_text = f"{got:#x}" if got is not None else "none (a SEND without immediate)"
        super().__init__(f"expected immediate {expected:#x}, got {got_text}")


class BatchTimeoutError(FabricError, TimeoutError):
    """A batch's run did not finish within its `timeout`; the batch was aborted. The message names the calls still
    pending; `pending_queues` lists their queues' names, in call order."""

    pending_queues: list[str] = []


class BindingError(FabricError, ValueError):
    """A batch's `run(bindings)` or `bind` got an input that does not fit its slot (name, size, dtype, memory)."""


class CompilerNotFoundError(FabricError):
    """No C compiler: C kernels cannot be built (numpy kernels still work)."""


class KernelBuildError(FabricError):
    """The C compiler refused a kernel's source; the message carries its diagnostics."""


class UnsupportedError(FabricError):
    """The NIC does not offer what was asked: atomics, when the PCIe path to the root port does not complete
    AtomicOps (the message names the port)."""
