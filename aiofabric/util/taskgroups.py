"""A task group that is an implementation detail of a context manager: the block's errors leave as themselves."""
from __future__ import annotations

import contextlib
import sys
from typing import AsyncIterator, Awaitable, Callable

import anyio
import anyio.abc

if sys.version_info < (3, 11):
    from exceptiongroup import BaseExceptionGroup


def sole_error(group: BaseExceptionGroup, cancelled: type[BaseException]) -> BaseException | None:
    """The one exception `group` holds that is not a `cancelled` one (or its one cancellation); None if it holds
    several. Context managers that run a task group use it to re-raise the block's own error as itself: the task
    group is theirs, not the caller's. Only the group's own children are looked at, so an exception group the block
    raised itself comes out as that group, untouched."""
    children = [error for error in group.exceptions if not isinstance(error, cancelled)] or list(group.exceptions)
    return children[0] if len(children) == 1 else None



@contextlib.asynccontextmanager
async def own_task_group() -> AsyncIterator[anyio.abc.TaskGroup]:
    """`anyio.create_task_group()` for background tasks a context manager runs around its caller's block (open_nic,
    connect_peer, ...). anyio wraps whatever crosses a task group in an ExceptionGroup; the group is ours, not the
    caller's, so its one non-cancellation child is re-raised as itself (an exception group the block raised itself
    included, untouched). Several real errors at once stay grouped."""
    error: BaseException | None = None
    try:
        async with anyio.create_task_group() as tasks:
            yield tasks
    except BaseExceptionGroup as group:
        error = sole_error(group, anyio.get_cancelled_exc_class())
        if error is None:
            raise
    if error is not None:
        raise error


async def run_in(scope: anyio.CancelScope, function: Callable[[], Awaitable[None]]) -> None:
    """Run `function` inside `scope`: a task started so (with a shielded scope) outlives the cancellation of its
    caller's block, e.g. a peer's reader, which the block's shielded clean-up needs, until `scope` is cancelled."""
    with scope:
        await function()
