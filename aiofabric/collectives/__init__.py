"""Collectives over a ring of RDMA NICs, on the scheduler (docs/collectives.md).

    async with collectives.local(4) as comms:             # 4 ranks in this process, an emulated NIC each
        await collectives.run_ranks([functools.partial(c.allreduce, x) for c, x in zip(comms, xs)])

Modules: `layout` (pure ring arithmetic, nccl-tests' names, counts and bandwidth factors), `communicator` (a rank:
its links, buffers and compiled collectives; the ring's), `steps` (what every collective's run is made of), `reduce`,
`gather`, `scatter`, `sendrecv` (those collectives along the ring), `reference` (what each computes, in numpy),
`launch` (N ranks in one process, one rank of a job, and running ranks together), `world` (a rank's job and its
rendezvous), `env_ranks` (the launchers' variables), `slurm` (srun's steps and node lists), `rendezvous` (rank 0's
TCP rendezvous), `perf` (the nccl-tests sweep behind `aiofabric allreduce ...`),
`nccl_format` (nccl-tests' lines and JSON document), `devices` (its "# Using devices" lines). The names below load
on first use (PEP 562), so the command line reads `layout` without the scheduler.
"""
from __future__ import annotations

from ..util.lazy import lazy_attributes

_HOMES = {".communicator": ("CollectiveError", "Communicator"), ".layout": ("BUS_FACTORS", "KINDS", "bus_bandwidth"),
          ".launch": ("connect_ring", "join", "local", "run_ranks"), ".world": ("World", "from_environment"),
          ".rendezvous": ("RendezvousError",)}
__all__ = sorted(name for names in _HOMES.values() for name in names)
__getattr__ = lazy_attributes(globals(), _HOMES)
