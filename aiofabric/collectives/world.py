"""Where a rank of a job learns its rank, the job's size and its rendezvous: from the variables launchers set. Pure.

    torchrun         RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT
    Open MPI mpirun  OMPI_COMM_WORLD_RANK, OMPI_COMM_WORLD_SIZE
    Slurm srun       SLURM_PROCID, SLURM_NTASKS

MASTER_ADDR and MASTER_PORT name rank 0's rendezvous for all three (mpirun and srun do not set them: export them,
e.g. `MASTER_ADDR=$(hostname) srun ...`); without them it is 127.0.0.1:29500, torchrun's default port. torchrun's
agent serves its own store on MASTER_PORT (TORCHELASTIC_USE_AGENT_STORE=True), so under it the rendezvous takes
MASTER_PORT + 1. AIOFABRIC_RENDEZVOUS_PORT overrides the port (the same for every rank); with
AIOFABRIC_RENDEZVOUS=external rank 0 does not serve it: a launcher does (`aiofabric <collective> --hosts`).
"""
from __future__ import annotations

import dataclasses
from typing import Mapping

LAUNCHERS = (("torchrun", "RANK", "WORLD_SIZE"), ("mpirun", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"),
             ("srun", "SLURM_PROCID", "SLURM_NTASKS"))
DEFAULT_ADDR, DEFAULT_PORT = "127.0.0.1", 29500


@dataclasses.dataclass(frozen=True)
class World:
    rank: int
    size: int
    addr: str = DEFAULT_ADDR
    port: int = DEFAULT_PORT
    launcher: str = ""
    serve: bool = True  # rank 0 serves the rendezvous (not when a launcher does)

    def __post_init__(self) -> None:
        if not 1 <= self.size or not 0 <= self.rank < self.size:
            raise ValueError(f"rank {self.rank} of a job of {self.size} ranks: the rank must be in [0, size - 1]")
        if not 1 <= self.port <= 65535:
            raise ValueError(f"rendezvous port {self.port} is not in [1, 65535]")


def from_environment(environ: Mapping[str, str]) -> World | None:
    """The World the first launcher whose variables are set describes, or None when none is. A variable that is
    set but not an integer, or out of its range, is a ValueError naming it."""
    for launcher, rank_name, size_name in LAUNCHERS:
        if rank_name in environ and size_name in environ:
            values = {}
            for name in (rank_name, size_name, "MASTER_PORT", "AIOFABRIC_RENDEZVOUS_PORT"):
                text = environ.get(name, str(DEFAULT_PORT))
                try:
                    values[name] = int(text)
                except ValueError:
                    raise ValueError(f"{name}={text!r} ({launcher}) is not an integer") from None
            size, rank = values[size_name], values[rank_name]
            if size < 1:
                raise ValueError(f"{size_name}={size} ({launcher}): a job has at least 1 rank")
            if not 0 <= rank < size:
                raise ValueError(f"{rank_name}={rank} ({launcher}): rank {rank} of a job of {size} ranks "
                                 f"({size_name}) must be in [0, {size - 1}]")
            port_name = "AIOFABRIC_RENDEZVOUS_PORT" if "AIOFABRIC_RENDEZVOUS_PORT" in environ else "MASTER_PORT"
            port = values[port_name]
            if not 1 <= port <= 65535:
                raise ValueError(f"{port_name}={port}: a port is in [1, 65535]")
            if port_name == "MASTER_PORT" and environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
                port += 1  # the agent's store has MASTER_PORT
                if port > 65535:
                    raise ValueError(f"MASTER_PORT={port - 1} (torchrun's agent store): the rendezvous takes the "
                                     "next port, and there is none; set AIOFABRIC_RENDEZVOUS_PORT")
            addr = environ.get("MASTER_ADDR", DEFAULT_ADDR)
            if not addr.strip():
                raise ValueError("MASTER_ADDR is empty: set it to rank 0's host")
            return World(rank, size, addr, port, launcher, environ.get("AIOFABRIC_RENDEZVOUS", "") != "external")
    return None
