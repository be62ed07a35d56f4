"""How a rank reads its launcher, pure: each launcher's variables as it sets them (tests/support/launchers.py),
Slurm's host lists and steps, the NIC a local rank picks, MPI hostfiles' slots, and what a push ships."""
import importlib.metadata
import sysconfig

import pytest

from aiofabric.collectives.env_ranks import local_choice
from aiofabric.collectives.slurm import expand_hostlist, not_a_task
from aiofabric.collectives.world import World, from_environment
from aiofabric.errors import PeerError
from aiofabric.peer.hostfile import host_slots, local_ranks
from aiofabric.peer.push import endpoint_distributions, push_plan
from tests.support import launchers


# -- Slurm's host lists (src/common/hostlist.c) ----------------------------------------------------------------------

@pytest.mark.parametrize("text,hosts", [
    ("node[01-04,07],gpu5", ["node01", "node02", "node03", "node04", "node07", "gpu5"]),
    ("gpu5", ["gpu5"]),
    ("a[9-11] b[009-011]", ["a9", "a10", "a11", "b009", "b010", "b011"]),  # the width is the start's
    ("n[1-2]-ib,\tm[3]", ["n1-ib", "n2-ib", "m3"]),  # a suffix; tabs and blanks separate too
    ("rack[1-2]-n[1-2]", ["rack1-n1", "rack1-n2", "rack2-n1", "rack2-n2"]),  # the last bracket innermost
    ("n[0-0]", ["n0"]),
    ("n[3,1,2]", ["n3", "n1", "n2"]),  # in the order written
    ("", []), (" , ", []),
])
def test_a_slurm_host_list_expands_as_slurm_expands_it(text, hosts):
    assert expand_hostlist(text) == hosts


@pytest.mark.parametrize("text,message", [
    ("n[", "host list entry 'n[': a '[' without its ']'"),
    ("n]", "host list entry 'n]': a ']' without its '['"),
    ("n[1]]", "host list entry 'n[1]]': a ']' without its '['"),
    ("n[]", "host list entry 'n[]': '' is not a number or a range lo-hi"),
    ("n[3-1]", "host list entry 'n[3-1]': the range '3-1' goes down"),
    ("n[-1]", "host list entry 'n[-1]': '-1' is not a number or a range lo-hi"),
    ("n[1-x]", "host list entry 'n[1-x]': '1-x' is not a number or a range lo-hi"),
    ("n[0-65536]", "host list entry 'n[0-65536]': more than 65536 hosts"),
    ("a[0-999]b[0-999]", "host list entry 'a[0-999]b[0-999]': more than 65536 hosts"),  # before expanding them
    ("a[1]" * 17, f"host list entry {'a[1]' * 17!r}: more than 16 brackets"),
])
def test_a_malformed_host_list_is_named(text, message):
    with pytest.raises(ValueError) as caught:
        expand_hostlist(text)
    assert str(caught.value) == message


def test_the_largest_host_list_expands():
    assert len(expand_hostlist("n[0-65535]")) == 65536


@pytest.mark.parametrize("step,why", [
    (None, "no SLURM_STEP_ID: sbatch's batch script"),
    ("-5", "SLURM_STEP_ID=-5: sbatch's batch script"),  # printed signed by some versions
    ("4294967291", "SLURM_STEP_ID=4294967291: sbatch's batch script"),
    ("4294967290", "SLURM_STEP_ID=4294967290: salloc's interactive step"),
    ("4294967292", "SLURM_STEP_ID=4294967292: the extern step"),
    ("4294967281", "SLURM_STEP_ID=4294967281: a special step"),
    ("x", "SLURM_STEP_ID='x' is not a step's number"),
    ("0", None), ("4294967280", None),  # the first and the last of srun's own steps
])
def test_a_task_srun_started_is_told_from_a_batch_script(step, why):
    assert not_a_task({} if step is None else {"SLURM_STEP_ID": step}) == why


# -- each launcher's variables -----------------------------------------------------------------------------------

@pytest.mark.parametrize("variables,world", [
    (launchers.torchrun(3, 4, 2), World(3, 4, "127.0.0.1", 29500, "torchrun", local_rank=1)),
    (launchers.open_mpi_4(2, 3, 2), World(2, 3, "127.0.0.1", 29500, "mpirun", local_rank=0)),
    (launchers.open_mpi_5(1, 3), World(1, 3, "127.0.0.1", 29500, "mpirun", local_rank=1)),  # PMIX_RANK too
    (launchers.hydra(5, 6, 4), World(5, 6, "127.0.0.1", 29500, "pmi", local_rank=1)),  # MPICH
    (launchers.intel_mpi(2, 4, 2), World(2, 4, "127.0.0.1", 29500, "pmi", local_rank=0)),
    (launchers.cray_pals(3, 4, 2), World(3, 4, "127.0.0.1", 29500, "pmi", local_rank=1)),
    (launchers.srun(3, 4, 2, "node[01-02]"), World(3, 4, "node01", 29500, "srun", local_rank=1)),
    (launchers.srun_pmi2(1, 2, 1, "gpu[7-8]"), World(1, 2, "gpu7", 29500, "pmi", local_rank=0)),  # srun's local
    (launchers.srun_pmix(1, 2, 2), World(1, 2, "vm", 29500, "srun", local_rank=1)),
    ({**launchers.prterun(1, 3), "WORLD_SIZE": "3"}, World(1, 3, "127.0.0.1", 29500, "pmix")),
])
def test_each_launcher_gives_the_rank_the_size_and_the_local_rank(variables, world):
    found = from_environment(variables)
    assert found == world and found.local_rank == world.local_rank


def test_ranks_an_mpi_launcher_starts_under_slurm_are_its_own():
    """Under Slurm an MPI launcher starts its ranks through daemons srun started (or from the batch script): the
    ranks inherit those SLURM_*, which describe the daemons. The MPI launcher's variables are the rank's; srun's node
    list gives rank 0's host only to ranks that are srun's tasks (the same rank and size)."""
    proxy = launchers.srun(0, 1, nodelist="node[01-02]")  # Hydra's proxy on node01: one task of its own step
    assert from_environment({**proxy, **launchers.hydra(1, 4)}) == World(1, 4, "127.0.0.1", 29500, "pmi",
                                                                         local_rank=1)
    batch = launchers.sbatch(8)  # mpirun in a batch script: its ranks inherit the script's
    assert from_environment({**batch, **launchers.open_mpi_4(3, 4)}).launcher == "mpirun"
    daemons = launchers.srun(0, 2, 1, "node[02-03]")  # prterun's daemons, which srun started: not the ranks
    with pytest.raises(ValueError, match="^PMIX_RANK=1 is set .* export WORLD_SIZE"):
        from_environment({**daemons, **launchers.prterun(1, 4)})
    with pytest.raises(ValueError, match="^PMIX_RANK=0 is set .* export WORLD_SIZE"):
        from_environment({**batch, **launchers.prterun(0, 4)})


def test_master_addr_wins_and_only_srun_tasks_read_its_node_list():
    step = launchers.srun(1, 4, 2, "node[03-04]")
    assert from_environment({**step, "SLURM_JOB_NODELIST": "node[01-04]"}).addr == "node03"  # the step's first
    del step["SLURM_STEP_NODELIST"]
    assert from_environment(step).addr == "node03"  # SLURM_JOB_NODELIST: as srun gives it to the step's tasks
    assert from_environment({**step, "MASTER_ADDR": "head"}).addr == "head"
    found = from_environment(step)
    assert found.addr_from == "the first host of SLURM_JOB_NODELIST"
    assert from_environment(launchers.srun(0, 1, nodelist="")).addr == "127.0.0.1"  # no list: the default
    with pytest.raises(ValueError, match=r"^SLURM_STEP_NODELIST: host list entry 'n\[1-': a '\[' without its '\]'$"):
        from_environment(launchers.srun(0, 2, nodelist="n[1-"))


@pytest.mark.parametrize("variables,message", [
    (launchers.sbatch(4), "SLURM_PROCID=0 and SLURM_NTASKS=4 do not come from srun (no SLURM_STEP_ID: sbatch's "
                          "batch script): this process is alone and ranks 1-3 would never come; start every rank "
                          "with srun (srun aiofabric ...), or run the ranks in this process with --ranks N"),
    ({**launchers.sbatch(2), "SLURM_STEP_ID": "-5"}, "SLURM_PROCID=0 and SLURM_NTASKS=2 do not come from srun "
     "(SLURM_STEP_ID=-5: sbatch's batch script): this process is alone and rank 1 would never come; start every "
     "rank with srun (srun aiofabric ...), or run the ranks in this process with --ranks N"),
    (launchers.prterun(0, 2), "PMIX_RANK=0 is set (a PMIx launcher: prterun, mpirun) but not the job's size, which "
                              "PMIx keeps in its library: export WORLD_SIZE (the number of ranks) to every rank, or "
                              "launch with Open MPI's mpirun or srun, which set it"),
    ({**launchers.hydra(0, 2), "MPI_LOCALRANKID": "2"}, "MPI_LOCALRANKID=2 (pmi): a local rank is in [0, 1] (a job "
                                                        "of 2 ranks)"),
    ({**launchers.hydra(0, 2), "MPI_LOCALRANKID": "-1"}, "MPI_LOCALRANKID=-1 (pmi): a local rank is in [0, 1] (a "
                                                         "job of 2 ranks)"),
    ({**launchers.cray_pals(0, 2), "PMI_SIZE": "x"}, "PMI_SIZE='x' (pmi) is not an integer"),
    ({**launchers.srun(0, 2), "SLURM_STEP_NUM_TASKS": "0"}, "SLURM_STEP_NUM_TASKS=0 (srun): a job has at least 1 "
                                                            "rank"),
])
def test_what_cannot_run_is_refused_saying_what_to_do(variables, message):
    with pytest.raises(ValueError) as caught:
        from_environment(variables)
    assert str(caught.value) == message


def test_a_batch_script_of_one_task_and_an_empty_environment():
    """One task: nobody is waited for, and srun's node list is not rank 0's (it is not srun's task)."""
    assert from_environment(launchers.sbatch(1)) == World(0, 1, "127.0.0.1", 29500, "srun", local_rank=0)
    assert from_environment({}) is None


# -- a NIC per local rank ---------------------------------------------------------------------------------------------

def test_a_list_names_one_per_local_rank():
    assert local_choice("0000:41:00.0", "--nic", "srun", None) == "0000:41:00.0"  # one for every rank
    assert local_choice("sim:a,sim:b", "--nic", "srun", 0) == "sim:a"
    assert local_choice("sim:a, sim:b", "--nic", "srun", 1) == "sim:b"
    with pytest.raises(ValueError) as caught:
        local_choice("sim:a,sim:b", "--nic", "srun", 2)
    assert str(caught.value) == ("--nic sim:a,sim:b names 2, one per local rank, and this process is local rank 2: "
                                 "name one for each rank of a host")
    with pytest.raises(ValueError) as caught:
        local_choice("sim:a,sim:b", "--nic", "pmix", None)
    assert str(caught.value) == ("--nic sim:a,sim:b names one per local rank, but pmix sets no local rank (none of "
                                 "LOCAL_RANK, OMPI_COMM_WORLD_LOCAL_RANK, MPI_LOCALRANKID, PMI_LOCAL_RANK, "
                                 "SLURM_LOCALID is set): name one")
    with pytest.raises(ValueError, match=r"^--nic sim:a,: an empty name in the list$"):
        local_choice("sim:a,", "--nic", "srun", 0)


# -- MPI hostfiles (PRRTE's hostfile syntax) ---------------------------------------------------------------------------

def test_a_hostfile_with_slots_gives_each_host_its_ranks_in_mpiruns_order():
    lines = ["# the job's hosts", "", "node01 slots=2", "u@node02:2222  slots = 3 max_slots=4  # a comment",
             "node03 max-slots=2", "node04 slots=0", "node05", "node01 count=1", "   "]
    hosts = host_slots(lines, 22, numbered=True)
    assert hosts == [(None, "node01", 22)] * 3 + [("u", "node02", 2222)] * 3 + [(None, "node03", 22)] * 2 + \
        [(None, "node05", 22)]  # node04 (0 slots) takes none; node01's two lines join
    assert local_ranks(hosts) == [0, 1, 2, 0, 1, 2, 0, 1, 0]
    assert host_slots(["h1 slots=2", "h2"], 23, numbered=False) == [(None, "h1", 23)] * 2 + [(None, "h2", 23)]


@pytest.mark.parametrize("lines,message", [
    (["h1", "h2 slots=x"], "line 2: h2: 'slots=x': slots is a whole number, 0 or more"),
    (["h1 slots=-1"], "line 1: h1: 'slots=-1': slots is a whole number, 0 or more"),
    (["h1 slots=2 cpu=3"], "line 1: h1: the slots are given twice"),
    (["h1 slots=4 max_slots=2"], "line 1: h1: max_slots=2 is below slots=4"),
    (["h1 boards=2"], "line 1: h1: 'boards=2' is not a setting of a host here (slots=N, max_slots=M)"),
    (["h1 h2"], "line 1: h1: 'h2' is not a setting of a host here (slots=N, max_slots=M)"),
    (["h1:0 slots=1"], "line 1: bad host 'h1:0': use host, host:port or user@host:port"),
    (["h1 slots=4096", "h2"], "more than 4096 slots in all"),
])
def test_a_bad_hostfile_line_is_named(lines, message):
    with pytest.raises(ValueError) as caught:
        host_slots(lines, 22, numbered=True)
    assert str(caught.value) == message


# -- what a push ships ------------------------------------------------------------------------------------------------

HERE = [sysconfig.get_config_var("SOABI"), sysconfig.get_platform()]


def _remote(versions, abi=HERE):
    return {"dir": "/tmp/aiofabric-push.x", "python": "3.11.7", "abi": abi, "versions": versions}


def _versions(needed, **changes):
    versions = {distribution.metadata["Name"]: distribution.version for distribution, _ in needed.values()}
    return {**versions, **changes}


def test_a_push_ships_every_distribution_whose_version_differs_or_is_missing():
    """The remote had an older typing_extensions than the anyio pushed to it needs: it is shipped too."""
    needed = endpoint_distributions()
    assert {"anyio", "typing-extensions", "numpy"} <= needed.keys()  # aiofabric's requirements and theirs
    same = push_plan(_remote(_versions(needed)), needed, ["python3"], "h:22")
    assert (same.shipped, same.kept) == ([], [])  # the package alone
    assert {file.parts[0] for _, file in same.files} == {"aiofabric"}
    package = {file.as_posix() for _, file in same.files}  # its data as pip installs it: the emulator's C core too
    assert {"aiofabric/sim/wirecodec.c", "aiofabric/sim/wirecore.h", "aiofabric/tools/schemas/result.schema.json",
            "aiofabric/py.typed"} <= package and not any("__pycache__" in name for name in package)
    name = needed["typing-extensions"][0].metadata["Name"]
    plan = push_plan(_remote(_versions(needed, anyio=None, **{name: "4.1.0"})), needed, ["python3"], "h:22")
    version = importlib.metadata.version
    assert plan.shipped == [f"anyio {version('anyio')} (remote: none)", f"{name} {version(name)} (remote: 4.1.0)"]
    shipped = {file.as_posix() for _, file in plan.files}
    assert "typing_extensions.py" in shipped and "anyio/__init__.py" in shipped


def test_compiled_packages_go_only_to_the_same_abi_and_else_the_remotes_own_version_runs():
    needed = endpoint_distributions()
    elsewhere = ["cpython-310-aarch64-linux-gnu", "linux-aarch64"]
    plan = push_plan(_remote(_versions(needed, numpy="1.26.4"), elsewhere), needed, ["python3"], "h:22")
    assert plan.shipped == [] and plan.kept == [f"numpy {importlib.metadata.version('numpy')} (remote: 1.26.4)"]
    with pytest.raises(PeerError) as caught:
        push_plan(_remote(_versions(needed, numpy=None), elsewhere), needed, ["python3"], "h:22")
    assert str(caught.value) == ("h:22: push: the remote python (python3: 3.11.7, cpython-310-aarch64-linux-gnu "
                                 "linux-aarch64) lacks compiled packages built here for " + " ".join(HERE) +
                                 ": install them there: python3 -m pip install 'numpy>=1.24'")
    same_abi = push_plan(_remote(_versions(needed, numpy="1.26.4")), needed, ["python3"], "h:22")
    assert same_abi.shipped == [f"numpy {importlib.metadata.version('numpy')} (remote: 1.26.4)"]


def test_a_remote_module_of_another_version_is_named_with_the_version_to_install():
    """What the remote said when the push kept its old typing_extensions: one line naming the version here."""
    from aiofabric.peer.launch import start_error
    tail = ["  File \"/tmp/aiofabric-push.x/anyio/abc/_tasks.py\", line 13, in <module>",
            "ImportError: cannot import name 'TypeVar' from 'typing_extensions' (/usr/lib/python3/site.py)"]
    error = start_error(PeerError("h:22: exited"), tail, "h:22", "python3", push=False)
    here = importlib.metadata.version("typing_extensions")
    assert str(error) == ("h:22: the remote endpoint exited before it was ready: the remote python (python3) has a "
                          "typing_extensions without TypeVar, another version than this side's: install this side's "
                          f"there (python3 -m pip install typing_extensions=={here}) or use push=True (connect "
                          "--push), which copies the versions here")
    assert start_error(PeerError("h:22: exited"), ["Traceback", "ValueError: x"], "h:22", "python3", True).args == \
        ("h:22: exited",)
