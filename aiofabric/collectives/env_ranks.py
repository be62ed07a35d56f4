"""Which launcher started this process, read from the variables each sets: this process's rank, the job's size, and
its rank among the job's processes on this host (the local rank, which picks its NIC from a list). Pure.

    torchrun  RANK / WORLD_SIZE; LOCAL_RANK (torchrun)
    mpirun    OMPI_COMM_WORLD_RANK / OMPI_COMM_WORLD_SIZE; OMPI_COMM_WORLD_LOCAL_RANK (Open MPI's mpirun)
    pmi       PMI_RANK / PMI_SIZE; MPI_LOCALRANKID or PMI_LOCAL_RANK (MPICH's and Intel MPI's mpiexec, which are
              Hydra's, with MPI_LOCALRANKID; Cray's mpiexec, PALS, with PMI_LOCAL_RANK; srun --mpi=pmi2 or cray_shasta)
    srun      SLURM_PROCID / SLURM_STEP_NUM_TASKS or SLURM_NTASKS; SLURM_LOCALID (Slurm's srun)
    pmix      PMIX_RANK / WORLD_SIZE; none (a PMIx launcher)

The first launcher whose variables are set is the one, in this order: an MPI launcher under Slurm starts its ranks
through daemons srun started, and those ranks inherit the daemons' SLURM_* (or a batch script's). A launcher that
sets no local rank of its own gets srun's SLURM_LOCALID when its ranks are srun's tasks (the same rank and size:
srun --mpi=pmi2). A PMIx launcher (prterun; srun --mpi=pmix, which also sets srun's variables) gives each process
only PMIX_RANK: the job's size is in PMIx's library, which this does not load, so it must come from WORLD_SIZE.
Open MPI 5's mpirun sets PMIX_RANK and Open MPI's variables.
"""
from __future__ import annotations

import dataclasses
from typing import Mapping, Sequence

from .slurm import not_a_task, srun_task


@dataclasses.dataclass(frozen=True)
class Launcher:
    name: str  # as the command line's JSON says it ("launcher")
    rank: str
    sizes: tuple[str, ...]  # the first one set
    locals: tuple[str, ...]  # the first one set


LAUNCHERS = (Launcher("torchrun", "RANK", ("WORLD_SIZE",), ("LOCAL_RANK",)),
             Launcher("mpirun", "OMPI_COMM_WORLD_RANK", ("OMPI_COMM_WORLD_SIZE",), ("OMPI_COMM_WORLD_LOCAL_RANK",)),
             Launcher("pmi", "PMI_RANK", ("PMI_SIZE",), ("MPI_LOCALRANKID", "PMI_LOCAL_RANK")),
             Launcher("srun", "SLURM_PROCID", ("SLURM_STEP_NUM_TASKS", "SLURM_NTASKS"), ("SLURM_LOCALID",)),
             Launcher("pmix", "PMIX_RANK", ("WORLD_SIZE",), ()))
LOCAL_NAMES = ", ".join(dict.fromkeys(name for launcher in LAUNCHERS for name in launcher.locals))


@dataclasses.dataclass(frozen=True)
class Launched:
    launcher: str
    rank: int
    size: int
    local_rank: int | None  # None: the launcher sets none


def launched(environ: Mapping[str, str]) -> Launched | None:
    """This process's rank as the first launcher whose variables are set says, or None when none are. A variable
    that is not an integer or out of its range, a PMIx rank without a size, and a batch script that looks like
    srun's rank 0 of many are ValueErrors saying what is wrong and what to do."""
    for launcher in LAUNCHERS:
        size_name = next((name for name in launcher.sizes if name in environ), None)
        if launcher.rank not in environ or (launcher.name == "srun" and _not_this_pmix_ranks(environ)):
            continue
        if size_name is None:
            if launcher.name == "pmix":
                raise ValueError(f"PMIX_RANK={environ['PMIX_RANK']} is set (a PMIx launcher: prterun, mpirun) but "
                                 "not the job's size, which PMIx keeps in its library: export WORLD_SIZE (the number "
                                 "of ranks) to every rank, or launch with Open MPI's mpirun or srun, which set it")
            continue
        rank, size = _integer(environ, launcher.rank, launcher), _integer(environ, size_name, launcher)
        if size < 1:
            raise ValueError(f"{size_name}={size} ({launcher.name}): a job has at least 1 rank")
        if not 0 <= rank < size:
            raise ValueError(f"{launcher.rank}={rank} ({launcher.name}): rank {rank} of a job of {size} ranks "
                             f"({size_name}) must be in [0, {size - 1}]")
        if launcher.name == "srun" and size > 1 and (why := not_a_task(environ)) is not None:
            others = "rank 1" if size == 2 else f"ranks 1-{size - 1}"
            raise ValueError(f"SLURM_PROCID={rank} and {size_name}={size} do not come from srun ({why}): this "
                             f"process is alone and {others} would never come; start every rank with srun (srun "
                             "aiofabric ...), or run the ranks in this process with --ranks N")
        return Launched(launcher.name, rank, size, _local_rank(environ, launcher, rank, size))
    return None


def _not_this_pmix_ranks(environ: Mapping[str, str]) -> bool:
    """SLURM_* that are not this PMIx rank's own: a batch script's, or those of daemons srun started for a PMIx
    launcher (srun --mpi=pmix gives its tasks the same rank in both)."""
    if "PMIX_RANK" not in environ:
        return False
    task = srun_task(environ)
    return task is None or str(task[0]) != environ["PMIX_RANK"].strip()


def _integer(environ: Mapping[str, str], name: str, launcher: Launcher) -> int:
    try:
        return int(environ[name])
    except ValueError:
        raise ValueError(f"{name}={environ[name]!r} ({launcher.name}) is not an integer") from None


def _local_rank(environ: Mapping[str, str], launcher: Launcher, rank: int, size: int) -> int | None:
    """The launcher's own local rank, or srun's when its ranks are srun's tasks; None when neither is set."""
    names: Sequence[str] = launcher.locals
    if not any(name in environ for name in names) and srun_task(environ) == (rank, size):
        names = ("SLURM_LOCALID",)
    name = next((name for name in names if name in environ), None)
    if name is None:
        return None
    local = _integer(environ, name, launcher)
    if not 0 <= local < size:
        raise ValueError(f"{name}={local} ({launcher.name}): a local rank is in [0, {size - 1}] (a job of {size} "
                         "ranks)")
    return local


def local_choice(text: str, flag: str, launcher: str, local_rank: int | None) -> str:
    """The item of `text` (a comma-separated list, one per local rank) for local rank `local_rank`; a single item
    is every rank's. ValueError says what is missing."""
    items = [item.strip() for item in text.split(",")]
    if "" in items:
        raise ValueError(f"{flag} {text}: an empty name in the list")
    if len(items) == 1:
        return items[0]
    if local_rank is None:
        raise ValueError(f"{flag} {text} names one per local rank, but {launcher} sets no local rank (none of "
                         f"{LOCAL_NAMES} is set): name one")
    if local_rank >= len(items):
        raise ValueError(f"{flag} {text} names {len(items)}, one per local rank, and this process is local rank "
                         f"{local_rank}: name one for each rank of a host")
    return items[local_rank]
