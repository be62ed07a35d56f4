"""`nic.events()` (docs/api.md: firmware events): every asynchronous event, once, to each subscriber from its
subscription on, in order; a bounded buffer that drops the oldest and says how many; the end of every stream when the
NIC closes or is lost; cancelled and dropped readers. Every test runs on every backend: readers sleep on the loop."""
import gc
import json
import os
import pickle
import signal

import anyio
import pytest

from aiofabric import open_nic
from aiofabric.driver.firmware_events import DeviceEvent
from aiofabric.errors import ClosedError, DeviceLostError
from aiofabric.hw.async_event import EventId
from tests.support.nics import tag

pytestmark = pytest.mark.anyio


async def wait_for(condition, seconds=10.0):
    with anyio.fail_after(seconds):
        while not condition():
            await anyio.sleep(0.01)


async def next_event(stream, seconds=10.0):
    with anyio.fail_after(seconds):
        return await stream.__anext__()


async def opened(nic):
    """The NIC once its link is up and the link's event is logged: nothing of the open is still to come."""
    await nic.wait_for_link()
    await wait_for(lambda: nic.event_log)


def function_event(nic, code):
    """A function-wide event on the CREQ (heard by the CREQ's reader, in the order sent)."""
    nic.pci.debug({"op": "event", "event": {"kind": "function", "event": code}})


async def test_each_subscriber_gets_every_event_from_its_subscription_on_once_in_order():
    async with open_nic(f"sim:ev-{tag()}") as nic:
        await opened(nic)
        cq = await nic.create_cq(64)
        qp = await nic.create_qp(cq)
        first, second = nic.events(), nic.events()
        nic.pci.debug({"op": "event", "event": {"kind": "link_down"}})
        heard_first = await next_event(first)
        with pytest.raises(TypeError, match=r"shared by every subscriber: change a copy \(dict\(event\.detail\)\)"):
            heard_first.detail["up"] = 1  # one subscriber cannot change what the others are told
        assert pickle.loads(pickle.dumps(heard_first)) == heard_first and json.loads(json.dumps(heard_first.detail))
        for event in (heard_first, await next_event(second)):
            assert (event.kind, event.xid, event.detail["up"]) == ("link", EventId.LINK_STATUS_CHANGE, 0)
        late = nic.events()  # subscribed after the link went down: hears only what follows
        nic.pci.debug({"op": "event", "event": {"kind": "link_up"}})
        for stream in (first, second, late):
            assert (await next_event(stream)).detail["up"] == 1
        nic.pci.debug({"op": "event", "event": {"kind": "mtu", "mtu": 1500}})
        for stream in (first, second, late):
            assert (await next_event(stream)).detail["port_mtu"] == 1500
        nic.pci.debug({"op": "event", "event": {"kind": "qp_error", "xid": qp.qpn}})  # the QP's handler takes it too
        nic.pci.debug({"op": "event", "event": {"kind": "cq_error", "xid": cq.id}})
        for code in range(1, 6):
            function_event(nic, code)
        for stream in (first, second, late):
            heard = [await next_event(stream) for _ in range(7)]
            assert [(event.kind, event.xid) for event in heard] == [
                ("qp_error", qp.qpn), ("cq_error", cq.id), *(("function", code) for code in range(1, 6))]
            assert stream.missed == 0
        assert qp.errors and cq.errors  # the objects' own handlers still got theirs


async def test_a_reader_cancelled_while_waiting_loses_nothing_and_others_go_on():
    async with open_nic(f"sim:ev-{tag()}") as nic:
        await opened(nic)
        stream, other = nic.events(), nic.events()
        with anyio.move_on_after(0.05) as scope:  # cancelled from outside while it waits
            await stream.__anext__()
        assert scope.cancelled_caught
        async with anyio.create_task_group() as tasks:  # and a reader cancelled by its task group
            tasks.start_soon(stream.__anext__)
            await anyio.wait_all_tasks_blocked()
            tasks.cancel_scope.cancel()
        function_event(nic, 7)
        assert (await next_event(other)).xid == 7
        assert (await next_event(stream)).xid == 7 and stream.missed == 0


async def test_a_full_stream_drops_its_oldest_events_and_says_how_many_where_they_were():
    async with open_nic(f"sim:ev-{tag()}") as nic:
        await opened(nic)
        with pytest.raises(ValueError, match=r"^buffer must be an integer in \[1, 1048576\], not 0$"):
            nic.events(buffer=0)
        small, exact, roomy = nic.events(buffer=2), nic.events(buffer=5), nic.events()
        logged = len(nic.event_log)
        for code in range(1, 6):  # nobody reads meanwhile: the firmware's side never waits for a reader
            function_event(nic, code)
        await wait_for(lambda: len(nic.event_log) == logged + 5)  # the streams had each before the log
        assert [await next_event(small) for _ in range(3)] == [
            DeviceEvent("missed", 0, {"count": 3}), DeviceEvent("function", 4, {}), DeviceEvent("function", 5, {})]
        assert small.missed == 3
        assert [(await next_event(exact)).xid for _ in range(5)] == [1, 2, 3, 4, 5] and exact.missed == 0
        assert [(await next_event(roomy)).xid for _ in range(5)] == [1, 2, 3, 4, 5]
        function_event(nic, 6)  # after the gap was reported, events come as before
        assert (await next_event(small)).xid == 6 and small.missed == 3


async def test_the_close_ends_every_stream_after_what_it_holds_and_a_closed_nic_refuses_new_ones():
    ended = []

    async def read_all(stream):
        ended.append([event.xid async for event in stream])

    with anyio.fail_after(30):
        async with anyio.create_task_group() as tasks:
            async with open_nic(f"sim:ev-{tag()}") as nic:
                await opened(nic)
                tasks.start_soon(read_all, nic.events())  # waiting when the close comes
                unread = nic.events()
                logged = len(nic.event_log)
                function_event(nic, 3)
                await wait_for(lambda: len(nic.event_log) == logged + 1)
                await anyio.wait_all_tasks_blocked()
        assert ended == [[3]]
        assert [event.xid async for event in unread] == [3]  # held before the close: still delivered, then the end
        with pytest.raises(ClosedError, match="is closed"):
            nic.events()
        assert [event async for event in unread] == []  # an ended stream stays ended


async def test_a_reset_notice_ends_every_stream_with_the_notice_then_a_lost_event():
    async with open_nic(f"sim:ev-{tag()}") as nic:
        await opened(nic)
        stream = nic.events()
        nic.pci.debug({"op": "event", "event": {"kind": "fatal"}})
        with anyio.fail_after(10):
            heard = [event.kind async for event in stream]
        assert heard == ["fatal", "lost"]
        with pytest.raises(DeviceLostError, match="RESET_NOTIFY"):
            nic.events()


async def test_an_emulator_that_dies_ends_every_stream_with_a_lost_event():
    async with open_nic(f"sim:ev-{tag()}") as nic:
        await opened(nic)
        stream = nic.events()
        os.kill(nic.pci.pid, signal.SIGKILL)
        with anyio.fail_after(10):
            assert [event.kind async for event in stream] == ["lost"]


async def test_a_stream_closed_or_dropped_is_unsubscribed():
    async with open_nic(f"sim:ev-{tag()}") as nic:
        await opened(nic)
        hub = nic._events
        with nic.events() as stream:
            assert set(hub.streams) == {stream}
        assert not hub.streams and [event async for event in stream] == []
        closing = nic.events()
        function_event(nic, 1)
        assert (await next_event(closing)).xid == 1
        await closing.aclose()  # what it held is dropped with it
        assert not hub.streams and [event async for event in closing] == []
        looped = nic.events()
        function_event(nic, 2)
        async for event in looped:
            assert event.xid == 2
            break
        del looped  # a loop left with break, its stream no longer referred to
        gc.collect()
        assert not hub.streams
