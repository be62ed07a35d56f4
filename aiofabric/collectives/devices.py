"""The lines nccl-tests prints under "# Using devices", one per rank of the job: each rank describes its own NIC
and an allgather brings every description to every rank (rank 0 prints them)."""
from __future__ import annotations

import functools
import json
import os
import re
import socket
from typing import Any

import numpy as np

from .communicator import Communicator
from .launch import run_ranks

LINE_BYTES = 256  # one rank's description, JSON padded with spaces
_PCI = re.compile(r"([0-9a-f]{4}):([0-9a-f]{2}):([0-9a-f]{2})\.[0-7]")


def describe(comm: Communicator, device: int) -> dict[str, Any]:
    """nccl-tests' rankInfo of `comm`'s rank: its PCI function's domain:bus:device, or 0000:00:00 for an emulated
    NIC, and what NIC it is."""
    nic = comm.nic
    address = nic.pci.address if nic is not None else "none"
    match = _PCI.fullmatch(address)
    emulated = address.startswith("sim")
    info = f"{'emulated' if emulated else 'BNXT'} NIC {address}" + (f" fw {nic.fw_version}" if nic is not None else "")
    return {"rank": comm.rank, "group": 0, "pid": os.getpid(), "hostname": socket.gethostname()[:40],
            "device": device, "device_hex": ":".join(match.groups()) if match else "0000:00:00",
            "device_info": info[:60]}


async def job_devices(comms: list[Communicator], devices: list[int]) -> list[dict[str, Any]]:
    """Every rank's description, in rank order; `devices[i]` is the device index comms[i] prints. The
    communicators' buffers must hold LINE_BYTES x ranks."""
    size = comms[0].size
    mine = [np.frombuffer(json.dumps(describe(comm, device)).encode().ljust(LINE_BYTES)[:LINE_BYTES], np.uint8).copy()
            for comm, device in zip(comms, devices)]
    outs = [np.zeros(LINE_BYTES * size, np.uint8) for _ in comms]
    await run_ranks([functools.partial(c.allgather, x, out) for c, x, out in zip(comms, mine, outs)])
    return [json.loads(outs[0][r * LINE_BYTES:(r + 1) * LINE_BYTES].tobytes().decode()) for r in range(size)]
