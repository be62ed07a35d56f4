"""The poller's sleep on an interrupt eventfd (verbs/interrupt_wait.py), on a plain eventfd: what fires it, what
ends it, what it leaves registered with the event loop."""
import asyncio
import os

import anyio
import anyio.lowlevel
import pytest

from aiofabric.verbs.interrupt_wait import InterruptWait

pytestmark = pytest.mark.anyio


@pytest.fixture
def eventfd():
    fd = os.eventfd(0, os.EFD_NONBLOCK)
    yield fd
    os.close(fd)


@pytest.fixture
async def waiter(eventfd):
    """A sleep on `eventfd`, closed after the test (made inside the test's event loop)."""
    waiting = InterruptWait(eventfd)
    yield waiting
    waiting.close()


def pending(fd: int) -> bool:
    try:
        os.eventfd_write(fd, 0)  # a no-op write; the read below says whether a count is waiting
        os.eventfd_read(fd)
    except BlockingIOError:
        return False
    return True


async def test_a_sleep_ends_when_the_interrupt_fires_and_acknowledges_it(eventfd, waiter):
    results = []

    async def sleeper():
        results.append(await waiter.sleep(30.0))
    with anyio.fail_after(10):
        async with anyio.create_task_group() as group:
            group.start_soon(sleeper)
            for _ in range(5):
                await anyio.lowlevel.checkpoint()
            os.eventfd_write(eventfd, 1)
    assert results == [True]
    assert not pending(eventfd)  # acknowledged: the next interrupt is a new one


async def test_a_sleep_ends_at_its_timeout_without_an_interrupt(waiter):
    with anyio.fail_after(10):
        assert await waiter.sleep(0.01) is False
        assert await waiter.sleep(0) is False  # zero: a look, no wait


async def test_an_interrupt_that_fired_while_nobody_slept_ends_the_next_sleep_at_once(eventfd, waiter):
    with anyio.fail_after(10):
        assert await waiter.sleep(0) is False  # registered (where a loop keeps it so)
        os.eventfd_write(eventfd, 1)
        for _ in range(10):  # the loop may hear it now, with nobody asleep
            await anyio.lowlevel.checkpoint()
        assert await waiter.sleep(None) is True  # no timeout: only the interrupt can end it
        assert await waiter.sleep(0) is False  # heard once


async def test_a_cancelled_sleep_leaves_the_next_one_working(eventfd, waiter):
    with anyio.move_on_after(0.01):
        await waiter.sleep(None)
    os.eventfd_write(eventfd, 1)
    with anyio.fail_after(10):
        assert await waiter.sleep(None) is True


async def test_on_asyncio_the_eventfd_stays_registered_between_sleeps_until_closed(eventfd, anyio_backend_name,
                                                                                    monkeypatch):
    if anyio_backend_name != "asyncio":
        pytest.skip("under trio a sleep is wait_for_interrupt's single registration")
    loop = asyncio.get_running_loop()
    added = []
    original = loop.add_reader
    monkeypatch.setattr(loop, "add_reader", lambda fd, *args: (added.append(fd), original(fd, *args)))
    waiter = InterruptWait(eventfd)
    with anyio.fail_after(10):
        for _ in range(20):
            os.eventfd_write(eventfd, 1)
            assert await waiter.sleep(5.0) is True
    assert added == [eventfd]  # once, not once per sleep
    waiter.close()
    os.eventfd_write(eventfd, 1)
    for _ in range(10):
        await anyio.lowlevel.checkpoint()
    assert pending(eventfd)  # nobody read it: close() unregistered the reader
