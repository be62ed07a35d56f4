"""How long a NIC's close may spend on the firmware: every command wait is cut to what is left of the budget, and
once it is spent no command is sent (the device's reset frees what it would have).

After a failure, aiofabric/verbs/settle.py finds the NICs whose firmware no longer answers first and closes them with
no budget at all."""
from __future__ import annotations

import anyio

from ..errors import FirmwareTimeoutError

CLOSE_TIMEOUT = 10.0  # seconds a close may spend on the firmware, by default


class CloseBudget:
    """No deadline until `start`; then `bounded` cuts timeouts to it, `check` refuses to send once it is spent."""

    def __init__(self) -> None:
        self.deadline: float | None = None

    def start(self, timeout: float) -> None:
        """Each close() call gets its own budget: a close that was cancelled is resumed by the next with a fresh one."""
        self.deadline = anyio.current_time() + timeout

    def bounded(self, timeout: float) -> float:
        """A command's timeout, cut to what is left of the budget while closing."""
        if self.deadline is None:
            return timeout
        return max(0.0, min(timeout, self.deadline - anyio.current_time()))

    def spent(self) -> bool:
        return self.deadline is not None and anyio.current_time() >= self.deadline

    def check(self, what: str) -> None:
        """Refuse to send `what` once the budget is spent."""
        if self.spent():
            raise FirmwareTimeoutError(f"{what}: not sent: close() spent its budget on the firmware already (the "
                                       "device's reset frees what it would have)")

    def note(self) -> str:
        """What a timeout message adds while closing."""
        return " (close() spends at most its budget on the firmware)" if self.deadline is not None else ""
