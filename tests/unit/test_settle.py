"""settle: after a failure, the NICs whose firmware stopped are named in the order they were given, whichever probe
ends first (a report reads the same on every run), and each is closed without a budget."""
import types

import anyio
import pytest

from aiofabric.errors import FirmwareTimeoutError
from aiofabric.verbs.settle import settle

pytestmark = pytest.mark.anyio


class SilentNIC:
    """A NIC whose firmware leaves a query unanswered after `delay` s (or answers, if `answers`)."""

    def __init__(self, address: str, delay: float, answers: bool = False) -> None:
        self.pci = types.SimpleNamespace(address=address)
        self.device = types.SimpleNamespace(lost=None)
        self.delay, self.answers, self.closed_with = delay, answers, None

    async def hwrm(self, command: str, **fields: object) -> None:
        await anyio.sleep(self.delay)
        if not self.answers:
            raise FirmwareTimeoutError(f"{command}: no answer")

    async def close(self, timeout: float | None = None) -> None:
        self.closed_with = timeout


async def test_stopped_nics_are_named_in_the_order_given_not_the_order_their_probes_ended():
    first, second, alive = SilentNIC("0000:01:00.0", 0.2), SilentNIC("0000:02:00.0", 0.0), SilentNIC("x", 0, True)
    stopped = await settle([first, alive, second, first], seconds=1)
    assert list(stopped) == ["0000:01:00.0", "0000:02:00.0"]  # the second's probe ended first
    assert stopped["0000:01:00.0"] == "its firmware did not answer within 1 s"
    assert first.closed_with == 0 and second.closed_with == 0 and alive.closed_with is None
