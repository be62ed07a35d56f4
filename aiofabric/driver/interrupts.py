"""Waiting on the device's interrupts: MSI-X vectors arrive as eventfds (the seam's `interrupt_fd`), on every
platform that has them; plain sysfs has none, and waits become short polls of memory instead."""
from __future__ import annotations

import os
import select

import anyio

# RING_ALLOC's logical_id, which picks the MSI-X vector: 0..num_msix-1 of what FUNC_CFG reserved (bnxt_re's CREQ is
# entry 0, its NQs follow; HWRM answers are polled and have none)
CREQ_VECTOR, NQ_VECTOR = 0, 1
POLL_INTERVAL = 0.001  # how often to look at memory on a platform without interrupts
COMMAND_POLL = 0.05  # the longest a waiting HWRM command goes between looks; the CREQ reader's poll is 4 of these


def readable(fd: int) -> bool:
    """Whether `fd` is readable now (a removal fd: the device is gone)."""
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    return bool(poller.poll(0))


def wake(fd: int | None) -> None:
    """Signal an interrupt fd from the host, waking whoever sleeps on it (no-op without interrupts)."""
    if fd is not None:
        os.eventfd_write(fd, 1)


async def wait_for_interrupt(fd: int | None, timeout: float | None) -> bool:
    """Sleep until the MSI-X vector behind `fd` fires, or `timeout` passes (insurance against a lost interrupt;
    None: no timeout), and acknowledge it; whether it fired. Without interrupts (`fd` None: plain sysfs) this is a
    short poll interval, and never fires."""
    if fd is None:
        await anyio.sleep(POLL_INTERVAL if timeout is None else min(timeout, POLL_INTERVAL))
        return False
    with anyio.move_on_after(timeout) as scope:
        await anyio.wait_readable(fd)
    try:
        os.eventfd_read(fd)
    except BlockingIOError:
        pass
    return not scope.cancelled_caught
