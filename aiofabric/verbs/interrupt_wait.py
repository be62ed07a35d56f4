"""The completion poller's sleep on its NQ's MSI-X eventfd, cheap enough to take once per completion.

A collective of small messages sleeps and wakes a poller per hop: thousands of times a second. `wait_for_interrupt`
registers the eventfd with the event loop for each sleep and removes it after (two epoll_ctl calls) inside a cancel
scope for the safety poll; on asyncio (and uvloop) that was a quarter of the driver's CPU in a 4-rank 1 KiB allreduce
(bench/RESULTS.md, "Collectives without dead time"). Here the eventfd stays registered while the poller runs: its
reader callback acknowledges the interrupt and wakes the sleeper's future, and the safety poll is a timer. Under trio
a sleep is `wait_for_interrupt`, whose wait is already a single registration.
"""
from __future__ import annotations

import asyncio
import os

from ..driver.interrupts import wait_for_interrupt


class InterruptWait:
    """Sleeps on interrupt eventfd `fd` (None: a platform without interrupts). `close()` when the sleeper stops."""

    def __init__(self, fd: int | None) -> None:
        self.fd = fd
        self.loop: asyncio.AbstractEventLoop | None = None  # where fd is registered
        self.future: asyncio.Future[None] | None = None  # the sleep under way
        self.fired = False  # the reader acknowledged an interrupt the next sleep has not returned yet

    async def sleep(self, timeout: float | None) -> bool:
        """Sleep until the interrupt fires (acknowledging it) or `timeout` seconds pass (None: no timeout); whether it
        fired. An interrupt that fired while nobody slept ends the next sleep at once, as the eventfd would."""
        loop = asyncio._get_running_loop()  # the C accessor: None under trio
        if loop is None or self.fd is None:
            return await wait_for_interrupt(self.fd, timeout)
        if self.loop is not loop:
            self.close()
            loop.add_reader(self.fd, self._on_readable)
            self.loop = loop
        if not self.fired:
            future = self.future = loop.create_future()
            timer = loop.call_later(timeout, _expire, future) if timeout is not None else None
            try:
                await future
            finally:
                self.future = None
                if timer is not None:
                    timer.cancel()
        fired, self.fired = self.fired, False
        return fired

    def close(self) -> None:
        """Unregister the eventfd (before it is closed: the device's close stops its poller first)."""
        if self.loop is not None and self.fd is not None:
            if not self.loop.is_closed():
                self.loop.remove_reader(self.fd)
        self.loop = None

    def _on_readable(self) -> None:
        try:
            os.eventfd_read(self.fd)  # type: ignore[arg-type]  # registered only with an fd
        except BlockingIOError:
            return
        self.fired = True
        if self.future is not None and not self.future.done():
            self.future.set_result(None)


def _expire(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)
