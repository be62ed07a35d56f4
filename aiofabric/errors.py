"""Exceptions the driver raises. Each names what failed and, where the device said why, the decoded reason."""
from __future__ import annotations

import sys

from .autogen import bnxt

if sys.version_info < (3, 11):
    from exceptiongroup import BaseExceptionGroup


def status_names(prefix: str) -> dict[int, str]:
    """Value -> name (without `prefix`) of the bindings' constants that start with `prefix`."""
    return {value: name[len(prefix):] for name, value in vars(bnxt).items()
            if name.startswith(prefix) and not name.endswith("_LAST")}


HWRM_ERRORS = status_names("HWRM_ERR_CODE_")
RCFW_STATUSES = status_names("CREQ_QP_EVENT_STATUS_")


class FabricError(Exception):
    """Base class of aiofabric's errors."""


class FirmwareError(FabricError):
    """The firmware answered a command with an error status."""

    def __init__(self, command: str, status: int, reason: str, detail: str = "") -> None:
        self.command, self.status, self.reason = command, status, reason
        super().__init__(f"{command} failed: {reason} ({status:#x}){': ' + detail if detail else ''}")

    @classmethod
    def hwrm(cls, name: str, status: int, cmd_err: int = 0) -> FirmwareError:
        return cls(f"HWRM {name}", status, HWRM_ERRORS.get(status, "UNKNOWN"),
                   f"cmd_err {cmd_err:#x}" if cmd_err else "")

    @classmethod
    def rcfw(cls, name: str, status: int) -> FirmwareError:
        return cls(f"RCFW {name}", status, RCFW_STATUSES.get(status, "UNKNOWN"))


class FirmwareTimeoutError(FabricError, TimeoutError):
    """The firmware did not answer a command in time."""


class ClosedError(FabricError):
    """The object (NIC, QP, CQ, MR) was closed or destroyed; it refuses every use (trio's ClosedResourceError)."""


class DeviceLostError(FabricError):
    """The device is gone (emulator process died, surprise removal); every pending operation fails with this."""


def sole_error(group: BaseExceptionGroup, cancelled: type[BaseException]) -> BaseException | None:
    """The one exception `group` holds that is not a `cancelled` one (or its one cancellation); None if it holds
    several. Context managers that run a task group use it to re-raise the block's own error as itself: the task
    group is theirs, not the caller's. Only the group's own children are looked at, so an exception group the block
    raised itself comes out as that group, untouched."""
    children = [error for error in group.exceptions if not isinstance(error, cancelled)] or list(group.exceptions)
    return children[0] if len(children) == 1 else None
