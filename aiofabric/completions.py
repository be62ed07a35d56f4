"""Work completions: the awaitable a posted work request returns (a failed one raises `CompletionError`)."""
from __future__ import annotations

from typing import Any, Generator

import anyio

from .autogen import bnxt
from .errors import CompletionError as CompletionError  # where it used to live

SEND_FLUSHED = bnxt.CQ_REQ_STATUS_WORK_REQUEST_FLUSHED_ERR
RECV_FLUSHED = bnxt.CQ_RES_RC_STATUS_WORK_REQUEST_FLUSHED_ERR


class Completion:
    """Completes when the NIC finishes the work request. `await` it for the result; it raises `CompletionError`.

    Cheap by design (hundreds are in flight per QP): the wake-up event is created only if someone waits before
    the completion arrives.
    """

    __slots__ = ("verb", "done", "error", "byte_len", "imm", "_event")

    def __init__(self, verb: str) -> None:
        self.verb, self.done = verb, False
        self.error: BaseException | None = None
        self.byte_len = 0
        self.imm: int | None = None
        self._event: anyio.Event | None = None

    def finish(self, error: BaseException | None = None, byte_len: int = 0, imm: int | None = None) -> None:
        if self.done:
            return
        self.done, self.error, self.byte_len, self.imm = True, error, byte_len, imm
        if self._event is not None:
            self._event.set()

    async def wait(self) -> Completion:
        if not self.done:
            if self._event is None:
                self._event = anyio.Event()
            await self._event.wait()
        if self.error is not None:
            raise self.error
        return self

    def __await__(self) -> Generator[Any, None, Completion]:
        return self.wait().__await__()


def finished(verb: str, error: BaseException | None = None) -> Completion:
    completion = Completion(verb)
    completion.finish(error)
    return completion
