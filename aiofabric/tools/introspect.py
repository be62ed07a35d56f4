"""What a run asks an emulated NIC's debug channel (`debug_client()` of its seam), before and after its loop, never
in it: the wire's counters, the messages each QP placed, the emulator processes, and the fault to inject. A NIC
that is not emulated has no such channel: the answers are None, and the tables say "n/a"."""
from __future__ import annotations

import collections
from typing import Any, Iterable

from ..verbs import NIC

WIRE_COUNTERS = (("packets", "packets_sent"), ("retransmits", "retransmits"), ("dropped", "dropped"),
                 ("rx_overflow", "rx_overflow"))  # the JSON's name, the emulator's counter
NOT_COUNTED = "the NIC's placement counts were not available: it is not an emulated NIC"


def emulator(nic: NIC, purpose: str) -> Any:
    """The debug client of `nic`'s emulator (DebugClient), for `purpose`; ValueError naming the NIC if it has none."""
    client = nic.pci.debug_client()
    if client is None:
        raise ValueError(f"{purpose} needs the emulator's debug channel, which {nic.pci.address} does not have (it "
                         "is not an emulated NIC)")
    return client


async def wire_counters(nics: Iterable[NIC]) -> list[collections.Counter[str]] | None:
    """The emulator's counters of each NIC, or None when one of them is not emulated (nothing counts its packets)."""
    clients = [nic.pci.debug_client() for nic in nics]
    if None in clients:
        return None
    return [await client.stats() for client in clients]


async def emulator_processes(nics: Iterable[NIC]) -> int | None:
    """How many emulator processes run `nics` (--shared-emulator: one), or None when one of them is not emulated."""
    clients = [nic.pci.debug_client() for nic in nics]
    if None in clients:
        return None
    return len({(await client.ping()).pid for client in clients})


def wire_delta(before: list[collections.Counter[str]] | None, after: list[collections.Counter[str]] | None,
               counters: Iterable[tuple[str, str]] = WIRE_COUNTERS) -> dict[str, int | None]:
    """How much each of `counters` (JSON name, emulator counter) grew, summed over the NICs; None if not counted."""
    if before is None or after is None:
        return {key: None for key, _ in counters}
    return {key: sum(new[name] - old[name] for new, old in zip(after, before)) for key, name in counters}


async def placement_counts(nic: NIC) -> collections.defaultdict[int, Any] | None:
    """What each QP of `nic` placed (DebugClient.placed), or None when it is not an emulated NIC."""
    client = nic.pci.debug_client()
    return None if client is None else await client.placed()


def count_text(value: int | None) -> str:
    """A counter for the tables: "n/a" where it was not counted."""
    return "n/a" if value is None else str(value)
