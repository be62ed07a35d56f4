"""settle on emulated NICs: after a failure, the NICs whose firmware stopped are named in the order they were given,
whichever probe ends first (a report reads the same on every run), and each is closed; a NIC that answers is left."""
import os
import signal

import anyio
import pytest

from aiofabric import ClosedError, open_nic
from aiofabric.verbs.settle import settle

pytestmark = pytest.mark.anyio


async def test_stopped_nics_are_named_in_the_order_given_not_the_order_their_probes_ended():
    async with open_nic("sim:settle-stalled") as stalled, open_nic("sim:settle-alive") as alive, \
            open_nic("sim:settle-killed") as killed:
        stalled.pci.debug({"op": "stall", "channel": "hwrm"})  # its probe ends at its 1 s timeout
        os.kill(killed.pci.pid, signal.SIGKILL)  # its probe ends as soon as the loss is seen
        with anyio.fail_after(5):
            while killed.device.lost is None:
                await anyio.sleep(0.01)
        stopped = await settle([stalled, alive, killed, stalled], seconds=1)
        assert list(stopped) == [stalled.pci.address, killed.pci.address]
        assert stopped[stalled.pci.address] == "its firmware did not answer within 1 s"
        assert stopped[killed.pci.address].startswith("DeviceLostError: ")
        with pytest.raises(ClosedError):  # settled: closed at once, with no budget
            await stalled.create_cq(16)
        await alive.create_cq(16)  # it answered: left alone
