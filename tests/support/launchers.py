"""The variables each launcher gives the processes it starts, as its own source sets them, for rank `rank` of a job
of `size` ranks laid out `per_node` to a host (block order, srun's and mpirun's default: rank r on node
r // per_node, local rank r % per_node). The tests start processes with them.

    srun             Slurm's src/common/env.c: setup_env (each task) and env_array_for_step (the step)
    srun --mpi=pmi2  Slurm's src/plugins/mpi/pmi2: PMI_FD, PMI_JOBID, PMI_RANK, PMI_SIZE
    srun --mpi=pmix  Slurm's src/plugins/mpi/pmix and PMIx's server: PMIX_NAMESPACE, PMIX_RANK, PMIX_SERVER_*
    Cray PALS        Slurm's src/plugins/mpi/cray_shasta (as PALS's mpiexec): PMI_RANK, PMI_SIZE, PMI_LOCAL_RANK,
                     PMI_LOCAL_SIZE, PMI_JOBID, PMI_UNIVERSE_SIZE
    Hydra            MPICH's src/pm/hydra/proxy/pmip_cb.c (Intel MPI's mpiexec.hydra is Hydra too): PMI_RANK,
                     PMI_SIZE, PMI_FD, MPI_LOCALRANKID, MPI_LOCALNRANKS
    Open MPI 4       its mpirun (docs: "Environment variables set for MPI applications"): OMPI_COMM_WORLD_*
    Open MPI 5       PMIx's pmdl/ompi: OMPI_COMM_WORLD_* and OMPI_UNIVERSE_SIZE, beside PMIx's PMIX_RANK
    prterun          PMIx's server (PMIx_server_setup_fork): PMIX_NAMESPACE, PMIX_RANK, nothing of the size
    torchrun         RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK, MASTER_ADDR, MASTER_PORT
    sbatch           its batch script: SLURM_PROCID=0 and the job's SLURM_NTASKS (env_array_for_batch_job), no step
"""
from __future__ import annotations

Variables = dict[str, str]


def _where(rank: int, per_node: int) -> tuple[int, int]:
    return rank // per_node, rank % per_node


def srun(rank: int, size: int, per_node: int | None = None, nodelist: str = "vm", step: int = 0) -> Variables:
    per_node = per_node or size
    node, local = _where(rank, per_node)
    nodes = -(-size // per_node)
    tasks = f"{per_node}(x{nodes})" if size % per_node == 0 else f"{per_node}(x{nodes - 1}),{size % per_node}"
    return {"SLURM_JOB_ID": "4242", "SLURM_JOBID": "4242", "SLURM_STEP_ID": str(step), "SLURM_STEPID": str(step),
            "SLURM_PROCID": str(rank), "SLURM_LOCALID": str(local), "SLURM_NODEID": str(node),
            "SLURM_GTIDS": ",".join(str(node * per_node + i) for i in range(min(per_node, size - node * per_node))),
            "SLURM_NTASKS": str(size), "SLURM_NPROCS": str(size), "SLURM_NNODES": str(nodes),
            "SLURM_JOB_NUM_NODES": str(nodes), "SLURM_STEP_NUM_TASKS": str(size), "SLURM_STEP_NUM_NODES": str(nodes),
            "SLURM_STEP_NODELIST": nodelist, "SLURM_JOB_NODELIST": nodelist, "SLURM_NODELIST": nodelist,
            "SLURM_TASKS_PER_NODE": tasks, "SLURM_STEP_TASKS_PER_NODE": tasks, "SLURMD_NODENAME": f"node{node}",
            "SLURM_CPUS_ON_NODE": "2", "SLURM_TASK_PID": "1000", "SLURM_LAUNCH_NODE_IPADDR": "127.0.0.1",
            "SLURM_SRUN_COMM_PORT": "40000", "SLURM_STEP_LAUNCHER_PORT": "40000"}


def srun_pmi2(rank: int, size: int, per_node: int | None = None, nodelist: str = "vm") -> Variables:
    return {**srun(rank, size, per_node, nodelist), "PMI_FD": "9", "PMI_JOBID": "4242.0", "PMI_RANK": str(rank),
            "PMI_SIZE": str(size)}


def srun_pmix(rank: int, size: int, per_node: int | None = None, nodelist: str = "vm") -> Variables:
    return {**srun(rank, size, per_node, nodelist), "PMIX_NAMESPACE": "slurm.pmix.4242.0", "PMIX_RANK": str(rank),
            "PMIX_SERVER_URI41": "pmix-server.1000;tcp4://127.0.0.1:40001", "PMIX_SECURITY_MODE": "munge,native",
            "PMIX_GDS_MODULE": "hash", "PMIX_VERSION": "5.0.3"}


def cray_pals(rank: int, size: int, per_node: int | None = None) -> Variables:
    per_node = per_node or size
    node, local = _where(rank, per_node)
    return {"PMI_RANK": str(rank), "PMI_SIZE": str(size), "PMI_LOCAL_RANK": str(local),
            "PMI_LOCAL_SIZE": str(min(per_node, size - node * per_node)), "PMI_JOBID": "4242.0",
            "PMI_UNIVERSE_SIZE": str(size), "PMI_CONTROL_PORT": "40002", "PMI_SHARED_SECRET": "1234"}


def hydra(rank: int, size: int, per_node: int | None = None) -> Variables:
    per_node = per_node or size
    node, local = _where(rank, per_node)
    return {"PMI_RANK": str(rank), "PMI_SIZE": str(size), "PMI_FD": "6", "MPI_LOCALRANKID": str(local),
            "MPI_LOCALNRANKS": str(min(per_node, size - node * per_node))}


def intel_mpi(rank: int, size: int, per_node: int | None = None) -> Variables:
    """Intel MPI's mpiexec.hydra: Hydra's variables, and its own I_MPI_* settings."""
    return {**hydra(rank, size, per_node), "I_MPI_ROOT": "/opt/intel/oneapi/mpi/2021.11",
            "I_MPI_HYDRA_TOPOLIB": "hwloc"}


def open_mpi_4(rank: int, size: int, per_node: int | None = None) -> Variables:
    per_node = per_node or size
    node, local = _where(rank, per_node)
    here = min(per_node, size - node * per_node)
    return {"OMPI_COMM_WORLD_RANK": str(rank), "OMPI_COMM_WORLD_SIZE": str(size),
            "OMPI_COMM_WORLD_LOCAL_RANK": str(local), "OMPI_COMM_WORLD_LOCAL_SIZE": str(here),
            "OMPI_COMM_WORLD_NODE_RANK": str(local), "OMPI_UNIVERSE_SIZE": str(size)}


def open_mpi_5(rank: int, size: int, per_node: int | None = None) -> Variables:
    return {**open_mpi_4(rank, size, per_node), "OMPI_WORLD_SIZE": str(size), "OMPI_MCA_num_procs": str(size),
            "PMIX_NAMESPACE": "prterun-vm-1000@1", "PMIX_RANK": str(rank), "PMIX_SERVER_RANK": str(rank),
            "PMIX_VERSION": "5.0.3"}


def prterun(rank: int, size: int) -> Variables:
    """PMIx's own variables only: the job's size is in its library."""
    return {"PMIX_NAMESPACE": "prterun-vm-1000@1", "PMIX_RANK": str(rank), "PMIX_SERVER_RANK": str(rank),
            "PMIX_SERVER_NSPACE": "prterun-vm-1000@1", "PMIX_VERSION": "5.0.3", "PRTE_LAUNCHED": "1"}


def torchrun(rank: int, size: int, per_node: int | None = None) -> Variables:
    per_node = per_node or size
    node, local = _where(rank, per_node)
    return {"RANK": str(rank), "WORLD_SIZE": str(size), "LOCAL_RANK": str(local), "LOCAL_WORLD_SIZE": str(per_node),
            "GROUP_RANK": str(node), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}


def sbatch(size: int, nodelist: str = "vm") -> Variables:
    """A batch script's environment: task 0 of the batch step, with the job's task count."""
    return {"SLURM_JOB_ID": "4242", "SLURM_JOBID": "4242", "SLURM_PROCID": "0", "SLURM_LOCALID": "0",
            "SLURM_NODEID": "0", "SLURM_GTIDS": "0", "SLURM_NTASKS": str(size), "SLURM_NPROCS": str(size),
            "SLURM_JOB_NODELIST": nodelist, "SLURM_NODELIST": nodelist, "SLURM_SUBMIT_HOST": "login1",
            "SLURMD_NODENAME": "node0", "SLURM_CPUS_ON_NODE": "2"}
