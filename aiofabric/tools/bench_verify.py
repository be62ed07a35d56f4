"""Whether a bench run moved the right bytes (perftest.py's docstring says how): every slot compared (by sha256
where it lives on a peer), each atomic's original value and the counter, and the emulator's per-QP placement counts
where the placing NIC is ours and emulated."""
from __future__ import annotations

import hashlib
from typing import Any

from .bench_config import BenchConfig
from .bench_flows import Flow
from .introspect import NOT_COUNTED
from .options import ATOMIC_SIZE
from ..verbs import QueuePair


async def verify(config: BenchConfig, flows: list[Flow], placed: dict[Any, Any]) -> str | None:
    """Why the run's bytes are wrong, or None: every slot's bytes (by sha256 where they live on a peer), then the
    emulator's per-QP placement counts where the placing NIC is ours and emulated (`placed`, by seam: None where it
    is not; a peer offers no debug channel)."""
    used = config.used_bytes
    for flow in flows:
        if config.test == "atomic":
            wrong = await atomic_results(config, flow)
            if wrong:
                return wrong
        elif flow.remote is not None:
            here = hashlib.sha256(flow.source.view[:used]).hexdigest()
            there = flow.digest or await flow.remote.sha256(flow.target, 0, used)
            if here != there:
                return f"QP {flow.client.qpn:#x}: the bytes at {flow.remote.host} differ from the source (sha256)"
        elif flow.source.view[:used] != flow.target.view[:used]:
            offset = next(i for i in range(0, used, config.size)
                          if flow.source.view[i:i + config.size] != flow.target.view[i:i + config.size])
            return f"QP {flow.client.qpn:#x}: the bytes of message slot {offset // config.size} differ at the target"
        placer = flow.client if config.test == "read" else flow.server  # who places the data in memory
        if not isinstance(placer, QueuePair) or placed[placer.device.pci] is None:
            continue
        messages, size = placed[placer.device.pci][placer.qpn].of(config.test)
        if (messages, size) != (flow.done, flow.done * config.size):
            return (f"QP {placer.qpn:#x}: the NIC placed {messages} messages / {size} bytes, "
                    f"{flow.done} / {flow.done * config.size} were posted")
    return None


async def atomic_results(config: BenchConfig, flow: Flow) -> str | None:
    """What is wrong with an atomic run's results, or None: operation n found the counter at n (its original value,
    in its local slot: the last pass's where slots are reused), and the counter ends at the number done (compared by
    sha256 where it lives on a peer)."""
    slots, done = config.slots, flow.done
    for slot in range(min(slots, done)):
        n = slot + slots * ((done - 1 - slot) // slots)  # the last operation that used this slot
        got = int.from_bytes(flow.source.view[slot * ATOMIC_SIZE:(slot + 1) * ATOMIC_SIZE], "little")
        if got != n:
            return f"QP {flow.client.qpn:#x}: atomic {n} found the counter at {got}, not {n}"
    counter = done.to_bytes(ATOMIC_SIZE, "little")
    if flow.remote is not None:
        if await flow.remote.sha256(flow.target, 0, ATOMIC_SIZE) != hashlib.sha256(counter).hexdigest():
            return f"QP {flow.client.qpn:#x}: the counter at {flow.remote.host} is not {done} (sha256)"
    elif bytes(flow.target.view[:ATOMIC_SIZE]) != counter:
        return (f"QP {flow.client.qpn:#x}: the counter is {int.from_bytes(flow.target.view[:ATOMIC_SIZE], 'little')}"
                f" after {done} atomics")
    return None


def verification(config: BenchConfig, emulated: bool) -> str:
    """How `verified` was decided (docs/command-line.md: What `verified` means); `emulated`: every local NIC has a debug
    channel."""
    every = "every operation's bytes" if config.slots == config.iters else "the last pass's bytes"
    if config.test == "atomic":
        every = "the counter and every atomic's original value" if config.slots == config.iters else \
            "the counter and the last pass's original values"
    counted = config.remote is None or config.test == "read"  # a local NIC places the data
    if counted and not emulated:
        return f"{every} ({NOT_COUNTED})"
    counts_add = config.slots != config.iters or config.test == "atomic"  # what the bytes alone do not show
    return every + (" and the NIC's placement counts" if counted and counts_add else "")
