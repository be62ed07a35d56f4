"""After a failure: a NIC whose firmware no longer answers would spend the whole close budget of every clean-up
command on silence, so it is found first (one query, PROBE_SECONDS) and closed at once with no budget at all."""
from __future__ import annotations

from typing import Iterable

import anyio

from .nic import NIC
from ..driver.close_budget import CLOSE_TIMEOUT
from ..driver.commands import OWN_FID
from ..errors import ClosedError, DeviceLostError, FabricError, FirmwareTimeoutError

PROBE_SECONDS = 1.0  # after a failure, how long a NIC's firmware gets to answer a query (microseconds when it runs)


async def silence(nic: NIC, seconds: float = PROBE_SECONDS) -> str | None:
    """Why `nic` stopped: its device is gone, or its firmware left a harmless query (FUNC_QCFG) unanswered for
    `seconds`; None while it answers (an error answer included) or once it is closed."""
    lost = nic.device.lost
    if lost is not None:
        return f"{type(lost).__name__}: {lost}"
    try:
        with anyio.move_on_after(seconds + 1):  # the command's own timeout ends it first; a backstop
            await nic.hwrm("func_qcfg", fid=OWN_FID, command_timeout=seconds)
            return None
    except ClosedError:
        return None
    except DeviceLostError as exc:
        return f"{type(exc).__name__}: {exc}"
    except FirmwareTimeoutError:
        pass
    except FabricError:  # it answered, if only to refuse
        return None
    return f"its firmware did not answer within {seconds:g} s"


async def settle(nics: Iterable[NIC], seconds: float = PROBE_SECONDS) -> dict[str, str]:
    """After a failure, before its clean-up: probe `nics` at once (`silence`, shielded: a cancelled run settles too)
    and close each that stopped now, with no budget (no command is sent to a firmware that does not answer; the
    function reset frees what they would have). {address: why} of those, in the order of `nics` (not the order the
    probes ended in: a report names them the same way every time)."""
    unique = list(dict.fromkeys(nics))
    stopped: dict[str, str] = {}

    async def probe(nic: NIC) -> None:
        why = await silence(nic, seconds)
        if why is not None:
            stopped[nic.pci.address] = why
            await nic.close(timeout=0)

    with anyio.CancelScope(shield=True), anyio.move_on_after(seconds + CLOSE_TIMEOUT):
        async with anyio.create_task_group() as tasks:
            for nic in unique:
                tasks.start_soon(probe, nic)
    return {nic.pci.address: stopped[nic.pci.address] for nic in unique if nic.pci.address in stopped}
