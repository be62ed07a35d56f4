"""Orderings checked while they can go wrong, not after the fact: a close must not free memory the device could
still write, and the test makes the device write at the very moment the order matters (just before the quiesce),
instead of only after close() has returned, when any order looks right."""
import anyio
import pytest

from aiofabric.driver.device import Device
from tests.support.nics import closing_with_a_sender, stats

pytestmark = pytest.mark.anyio


@pytest.mark.loop_agnostic
async def test_a_close_frees_nothing_the_device_writes_up_to_its_quiesce(monkeypatch):
    """The firmware stops answering, so the QP, CQ and MR stay alive in the device; a peer then sends into that QP
    right up to the quiesce, and every message is placed before it. Memory freed before the quiesce would be
    written: the emulator counts that (writes_after_free)."""
    real_quiesce, placed = Device._quiesce, []

    async def quiesce_while_the_peer_sends(self):
        if self is closing.device and not placed:
            before = stats(closing).get("packets_received", 0)
            for _ in range(50):
                await peer_qp.post_send(source, 64)
            with anyio.fail_after(10):
                while True:  # the device is still running: it places them (or writes into freed memory)
                    now = stats(closing)
                    placed.append(now.get("packets_received", 0) - before)
                    if placed[-1] >= 50 or now.get("writes_after_free", 0):
                        break
                    await anyio.sleep(0.01)
        await real_quiesce(self)

    monkeypatch.setattr(Device, "_quiesce", quiesce_while_the_peer_sends)
    async with closing_with_a_sender() as (closing, peer_qp, source):
        closing.pci.debug({"op": "hang", "channel": "rcfw", "count": 1000})  # no destroy is ever carried out
        await closing.close(timeout=0.5)
        after = stats(closing)
    assert placed and after["writes_after_free"] == 0, (placed[-1:], after)
    assert placed[-1] >= 50  # the device did write, at the moment the order mattered
