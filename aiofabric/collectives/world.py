"""Where a rank of a job learns its rank, the job's size and its rendezvous: from the variables launchers set. Pure.
The launchers and their variables (torchrun, Open MPI's mpirun, MPICH's and Intel MPI's mpiexec, srun, PMIx) are
in env_ranks.py; Slurm's node lists and steps in slurm.py.

MASTER_ADDR and MASTER_PORT name rank 0's rendezvous (torchrun sets them; mpirun and mpiexec do not: export them,
e.g. `mpirun -x MASTER_ADDR=$(hostname) ...`); without MASTER_ADDR, ranks that srun started meet on the first host
of srun's node list (where srun puts task 0), and others at 127.0.0.1; without MASTER_PORT, at 29500, torchrun's
default port. torchrun's agent serves its own store on MASTER_PORT (TORCHELASTIC_USE_AGENT_STORE=True), so under
it the rendezvous takes MASTER_PORT + 1. AIOFABRIC_RENDEZVOUS_PORT overrides the port (the same for every rank);
with AIOFABRIC_RENDEZVOUS=external rank 0 does not serve it: a launcher does (`aiofabric <collective> --hosts`).
"""
from __future__ import annotations

import dataclasses
from typing import Mapping

from .env_ranks import Launched, launched
from .slurm import first_host, srun_task

DEFAULT_ADDR, DEFAULT_PORT = "127.0.0.1", 29500


@dataclasses.dataclass(frozen=True)
class World:
    rank: int
    size: int
    addr: str = DEFAULT_ADDR
    port: int = DEFAULT_PORT
    launcher: str = ""
    serve: bool = True  # rank 0 serves the rendezvous (not when a launcher does)
    local_rank: int | None = None  # its rank among the job's processes on its host, if the launcher said
    addr_from: str = dataclasses.field(default="MASTER_ADDR", compare=False)  # where addr came from, for messages

    def __post_init__(self) -> None:
        if not 1 <= self.size or not 0 <= self.rank < self.size:
            raise ValueError(f"rank {self.rank} of a job of {self.size} ranks: the rank must be in [0, size - 1]")
        if not 1 <= self.port <= 65535:
            raise ValueError(f"rendezvous port {self.port} is not in [1, 65535]")


def from_environment(environ: Mapping[str, str]) -> World | None:
    """The World the first launcher whose variables are set describes (env_ranks.py), or None when none is. A
    variable that is set but not an integer, or out of its range, is a ValueError naming it."""
    found = launched(environ)
    if found is None:
        return None
    values = {}
    for name in ("MASTER_PORT", "AIOFABRIC_RENDEZVOUS_PORT"):
        text = environ.get(name, str(DEFAULT_PORT))
        try:
            values[name] = int(text)
        except ValueError:
            raise ValueError(f"{name}={text!r} ({found.launcher}) is not an integer") from None
    port_name = "AIOFABRIC_RENDEZVOUS_PORT" if "AIOFABRIC_RENDEZVOUS_PORT" in environ else "MASTER_PORT"
    port = values[port_name]
    if not 1 <= port <= 65535:
        raise ValueError(f"{port_name}={port}: a port is in [1, 65535]")
    if port_name == "MASTER_PORT" and environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        port += 1  # the agent's store has MASTER_PORT
        if port > 65535:
            raise ValueError(f"MASTER_PORT={port - 1} (torchrun's agent store): the rendezvous takes the "
                             "next port, and there is none; set AIOFABRIC_RENDEZVOUS_PORT")
    addr, addr_from = _address(environ, found)
    return World(found.rank, found.size, addr, port, found.launcher,
                 environ.get("AIOFABRIC_RENDEZVOUS", "") != "external", found.local_rank, addr_from)


def _address(environ: Mapping[str, str], found: Launched) -> tuple[str, str]:
    """Rank 0's host and where it came from: MASTER_ADDR; else, for ranks that are srun's tasks (its rank and size),
    the first host of srun's node list; else 127.0.0.1."""
    if "MASTER_ADDR" in environ:
        if not environ["MASTER_ADDR"].strip():
            raise ValueError("MASTER_ADDR is empty: set it to rank 0's host")
        return environ["MASTER_ADDR"], "MASTER_ADDR"
    if srun_task(environ) == (found.rank, found.size):
        host = first_host(environ)
        if host is not None:
            return host[0], f"the first host of {host[1]}"
    return DEFAULT_ADDR, "the default MASTER_ADDR"
