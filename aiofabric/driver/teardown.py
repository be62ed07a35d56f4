"""What a device's close undoes, in reverse order of creation: the firmware objects bring-up created (each freed by a
command), then, only once the device is quiesced and can no longer write it, the host memory it was given."""
from __future__ import annotations

from typing import Any, Callable

from . import log
from ..errors import DeviceLostError


class Teardown:
    """The device's firmware objects (`on_close`) and host memory (`on_quiesced`), newest first when freed."""

    def __init__(self, address: str) -> None:
        self.address = address  # the device's, for the log
        self.commands: list[tuple[str, Callable[[], Any]]] = []  # (what, the command that frees it)
        self.memory: list[Callable[[], None]] = []

    def on_close(self, what: str, action: Callable[[], Any]) -> None:
        """A firmware object to free at close (a command)."""
        self.commands.append((what, action))

    def on_quiesced(self, free: Callable[[], None]) -> None:
        """Host memory the device may write (rings, context and statistics memory), freed at close only once the
        device is quiesced: told to let go, then stopped by bus mastering off and a function reset."""
        self.memory.append(free)

    async def run_commands(self) -> None:
        """Free the firmware objects; a failure is logged and the rest are freed all the same."""
        failures = []
        while self.commands:
            what, action = self.commands[-1]  # popped once done: a cancel in the middle leaves it for the resume
            try:
                result = action()  # with the device lost, its commands raise at once and memory is still freed
                if result is not None:
                    await result
            except DeviceLostError:
                pass  # the device is gone, and its objects with it
            except Exception as exc:  # keep freeing the rest; report at the end
                failures.append(f"{what}: {exc}")
            self.commands.pop()
        if failures:
            log.warning("%s: close: %s", self.address, "; ".join(failures))

    def free_memory(self) -> None:
        while self.memory:
            self.memory.pop()()
