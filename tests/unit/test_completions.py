"""The Completion awaitable on every backend: several waiters, a waiter cancelled from outside, errors."""
import anyio
import pytest

from aiofabric.verbs.completions import Completion, finished

pytestmark = pytest.mark.anyio


async def test_every_waiter_wakes_and_a_cancelled_one_cancels_only_itself():
    completion, woken = Completion("write"), []

    async def waiter(name):
        await completion
        woken.append(name)

    async with anyio.create_task_group() as tasks:
        tasks.start_soon(waiter, "a")
        tasks.start_soon(waiter, "b")
        with anyio.move_on_after(0.05) as scope:  # a third waiter gives up, cancelled from outside
            await completion
        assert scope.cancelled_caught and not completion.done
        await anyio.sleep(0.01)
        completion.finish(None, 64, 7)
    assert sorted(woken) == ["a", "b"]
    assert (await completion).byte_len == 64 and completion.imm == 7  # awaiting again returns at once


async def test_a_failed_completion_raises_for_every_waiter_and_finish_is_once():
    completion, errors = Completion("read"), []

    async def waiter():
        try:
            await completion
        except RuntimeError as error:
            errors.append(error)

    async with anyio.create_task_group() as tasks:
        for _ in range(3):
            tasks.start_soon(waiter)
        await anyio.sleep(0.01)
        completion.finish(RuntimeError("remote access"))
        completion.finish(None)  # a second finish changes nothing
    assert len(errors) == 3 and all(str(e) == "remote access" for e in errors)
    with pytest.raises(RuntimeError):
        await finished("read", RuntimeError("x"))


async def test_a_waiter_cancelled_before_the_finish_leaves_nothing_behind():
    completion = Completion("send")
    with anyio.move_on_after(0.01):
        await completion
    completion.finish()  # wakes no one, and does not trip over the cancelled waiter
    assert completion.done and (await completion).error is None
