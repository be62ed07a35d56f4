"""Collectives over a ring of RDMA NICs, on the scheduler (README: Collectives).

    async with collectives.local(4) as comms:             # 4 ranks in this process, an emulated NIC each
        await collectives.run_ranks([lambda c=c, x=x: c.allreduce(x) for c, x in zip(comms, xs)])

Modules: `layout` (pure ring arithmetic and nccl-tests' bus factors), `communicator` (a rank: its links, buffers and
compiled collectives), `launch` (N ranks in one process, and running them together).
"""
from .communicator import CollectiveError, Communicator
from .layout import BUS_FACTORS, KINDS, bus_bandwidth
from .launch import connect_ring, local, run_ranks

__all__ = ["BUS_FACTORS", "KINDS", "CollectiveError", "Communicator", "bus_bandwidth", "connect_ring", "local",
           "run_ranks"]
