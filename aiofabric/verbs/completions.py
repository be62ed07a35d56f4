"""Work completions: the awaitable a posted work request returns (a failed one raises `CompletionError`)."""
from __future__ import annotations

import asyncio
from typing import Any, Generator

import anyio

from ..autogen import bnxt

SEND_FLUSHED = bnxt.CQ_REQ_STATUS_WORK_REQUEST_FLUSHED_ERR
RECV_FLUSHED = bnxt.CQ_RES_RC_STATUS_WORK_REQUEST_FLUSHED_ERR


class Completion:
    """Completes when the NIC finishes the work request. `await` it for the result; it raises `CompletionError`.

    Cheap by design (hundreds are in flight per QP): something to wake is made only for a task that waits before
    the completion arrives. On asyncio that is a bare future per waiting task (an anyio.Event costs twice the CPU
    of a whole wait, ~4 us, and a completion is awaited once per batch); elsewhere an anyio.Event.
    """

    __slots__ = ("verb", "done", "error", "byte_len", "imm", "_waiters")

    def __init__(self, verb: str) -> None:
        self.verb, self.done = verb, False
        self.error: BaseException | None = None
        self.byte_len = 0
        self.imm: int | None = None
        self._waiters: list[Any] | None = None  # asyncio futures, or one anyio.Event

    def finish(self, error: BaseException | None = None, byte_len: int = 0, imm: int | None = None) -> None:
        if self.done:
            return
        self.done, self.error, self.byte_len, self.imm = True, error, byte_len, imm
        if self._waiters is not None:
            self.wake()

    @staticmethod
    def finish_many(completions: list[Completion]) -> None:
        """finish() each without an error: what a requester CQE does to the work requests before the one it names.
        The loop is finish() inlined, as it runs once per operation."""
        for completion in completions:
            if not completion.done:
                completion.done = True
                if completion._waiters is not None:
                    completion.wake()

    def wake(self) -> None:
        """Wake whoever waits (after `done` is set)."""
        for waiter in self._waiters or ():
            if isinstance(waiter, asyncio.Future):
                if not waiter.done():  # a cancelled waiter's future is done already
                    waiter.set_result(None)
            else:
                waiter.set()
        self._waiters = None

    async def wait(self) -> Completion:
        if not self.done:
            loop = asyncio._get_running_loop()  # the C accessor: None under trio
            if loop is not None:
                future = loop.create_future()
                if self._waiters is None:
                    self._waiters = []
                self._waiters.append(future)  # each its own: one waiter cancelled cancels only its future
                await future
            else:
                if self._waiters is None:
                    self._waiters = [anyio.Event()]
                await self._waiters[0].wait()
        if self.error is not None:
            raise self.error
        return self

    def __await__(self) -> Generator[Any, None, Completion]:
        return self.wait().__await__()


def finished(verb: str, error: BaseException | None = None) -> Completion:
    completion = Completion(verb)
    completion.finish(error)
    return completion
