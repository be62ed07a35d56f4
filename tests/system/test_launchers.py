"""The launcher lines of README.md and docs/collectives.md run as written, each process with the variables its
launcher gives it (tests/support/launchers.py, from each launcher's source), several processes on this host; every
MPI launcher's variables make a job whose ranks pick their NICs by local rank; a host's slots over SSH."""
import contextlib
import json
import os
import re
import shlex
import socket
import subprocess
import sys
from pathlib import Path

import anyio
import pytest

from tests.support import CHECKOUT, launchers
from tests.support.backends import on
from tests.support.processes import CLI, free_port

LINE_STARTS = ("torchrun ", "mpirun ", "srun ")


def doc_commands(path: Path, starts: tuple[str, ...] = LINE_STARTS) -> list[str]:
    """The launcher lines of a document's code blocks, continuation lines joined as the shell joins them."""
    commands, pending = [], ""
    for line in path.read_text().splitlines():
        text = line.strip()
        if pending:
            pending += " " + text
        elif line.startswith("    ") and text.startswith(starts):
            pending = text
        else:
            continue
        if pending.endswith("\\"):
            pending = pending[:-1].rstrip()
            continue
        commands.append(pending)
        pending = ""
    return commands


README_LINES = doc_commands(CHECKOUT / "README.md")


def test_the_docs_give_the_readmes_launcher_lines():
    """So the runs below test both (their comments aside)."""
    words = {tuple(shlex.split(line, comments=True)) for line in doc_commands(CHECKOUT / "docs" / "collectives.md")}
    assert len(README_LINES) == 4 and {tuple(shlex.split(line, comments=True)) for line in README_LINES} <= words


def _path_with_aiofabric(directory: Path) -> str:
    """PATH with an `aiofabric` that runs this checkout with this interpreter, as the installed script would."""
    script = directory / "aiofabric"
    script.write_text(f'#!/bin/sh\nexec {sys.executable} -m aiofabric "$@"\n')
    script.chmod(0o755)
    return f"{directory}:{os.environ['PATH']}"


def _launch_line(command: str) -> tuple[list[str], list[dict[str, str]]]:
    """A launcher line as the launcher runs it: the command each process runs, and each process's variables."""
    words = shlex.split(command, comments=True)
    launcher, options = words[0], {}
    index = 1
    while words[index].startswith("-"):
        if words[index] == "--no-python":  # torchrun runs the command itself, not python with it
            index += 1
            continue
        options[words[index]] = words[index + 1]
        index += 2
    if launcher == "torchrun":
        size = int(options["--nproc-per-node"])
        variables = [{**launchers.torchrun(rank, size), "TORCHELASTIC_USE_AGENT_STORE": "True"}
                     for rank in range(size)]
        return words[index:], variables
    if launcher == "mpirun":
        size = int(options["-np"])
        return words[index:], [launchers.open_mpi_4(rank, size) for rank in range(size)]
    nodes = int(options["-N"])
    per_node = int(options.get("--ntasks-per-node", 0)) or -(-int(options["-n"]) // nodes)
    size = int(options.get("-n", 0)) or nodes * per_node
    nodelist = "vm" if nodes == 1 else f"127.0.0.[3-{nodes + 2}]"  # this host's 127.0.0.1, or 127.0.0.3
    return words[index:], [launchers.srun(rank, size, per_node, nodelist) for rank in range(size)]


@pytest.mark.parametrize("command", README_LINES, ids=[line.split()[0] + str(i) for i, line in enumerate(README_LINES)])
def test_each_readme_launcher_line_runs_as_written(command, tmp_path):
    """Each process runs the line's command with its launcher's variables; only a PCI NIC (none here) is swapped for
    an emulated one, and the address its subnet gives it for one of this host's loopback addresses. Rank 0 prints
    nccl-tests' table, every value checked; each rank drives the NIC of its local rank. srun's nodes across hosts
    are 127.0.0.3 and .4, and another program holds the rendezvous port on 127.0.0.1: only ranks that meet on srun's
    first node get together."""
    argv, variables = _launch_line(command)
    argv = [word.replace("0000:41:00.0,0000:41:00.1", "sim:port0,sim:port1").replace("--ip 10.0.", "--ip 127.84.")
            for word in argv]
    port = free_port()
    path = _path_with_aiofabric(tmp_path)
    across = variables[0].get("SLURM_STEP_NODELIST", "").startswith("127.0.0.")
    with socket.create_server(("127.0.0.1", port)) if across else contextlib.nullcontext():  # the decoy
        processes = [subprocess.Popen(argv, env={**os.environ, **extra, "PATH": path, "MASTER_PORT": str(port),
                                                 "AIOFABRIC_RENDEZVOUS_PORT": str(port)},
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                     for extra in variables]
        outputs = [process.communicate(timeout=300) for process in processes]
    for rank, (process, (stdout, stderr)) in enumerate(zip(processes, outputs)):
        assert process.returncode == 0, (rank, stdout[-2000:], stderr[-3000:])
    table = outputs[0][0]
    assert "# Out of bounds values : 0 OK" in table and "# Avg bus bandwidth" in table, table
    assert len(re.findall(r"^ +1048576 +262144 +float +sum", table, re.M)) == 1  # the last size, checked
    devices = re.findall(r"#  Rank +(\d+) .* emulated NIC (\S+)", table)
    assert [int(rank) for rank, _ in devices] == list(range(len(variables)))
    if "sim:port0" in " ".join(argv):  # two NICs a host: local rank 0 on the first, 1 on the second
        assert [nic for _, nic in devices] == ["sim:port0", "sim:port1"] * (len(variables) // 2)


def _job(size, variables, *args, master=True):
    """`size` processes of `aiofabric ARGS --json`, each with variables(rank); their exit codes and JSON."""
    port = str(free_port())
    processes = []
    for rank in range(size):
        env = {**os.environ, **variables(rank), "MASTER_PORT": port, "AIOFABRIC_RENDEZVOUS_PORT": port}
        if master:
            env["MASTER_ADDR"] = "127.0.0.1"
        processes.append(subprocess.Popen([*CLI, *args, "--json"], env=env, stdout=subprocess.PIPE,
                                          stderr=subprocess.PIPE, text=True))
    results = []
    for process in processes:
        stdout, stderr = process.communicate(timeout=180)
        lines = stdout.strip().splitlines()
        results.append((process.returncode, json.loads(lines[-1]) if lines else None, stderr))
    return results


@pytest.mark.parametrize("name,variables,launcher", [
    ("MPICH mpiexec", lambda rank: launchers.hydra(rank, 3), "pmi"),
    ("Intel MPI mpiexec.hydra", lambda rank: launchers.intel_mpi(rank, 3), "pmi"),
    ("Cray PALS mpiexec", lambda rank: launchers.cray_pals(rank, 3), "pmi"),
    ("Open MPI 5 mpirun", lambda rank: launchers.open_mpi_5(rank, 3), "mpirun"),
    ("srun --mpi=pmi2", lambda rank: launchers.srun_pmi2(rank, 3), "pmi"),
    ("srun --mpi=pmix", lambda rank: launchers.srun_pmix(rank, 3), "srun"),
    ("prterun -x WORLD_SIZE=3", lambda rank: {**launchers.prterun(rank, 3), "WORLD_SIZE": "3"}, "pmix"),
])
def test_each_launchers_variables_make_a_job_whose_ranks_take_their_local_nic(name, variables, launcher):
    """Three processes on this host, as each launcher starts them; srun's tasks meet on its first node (this host)
    without MASTER_ADDR. Each rank drives the NIC of its local rank (a PMIx launcher says none: one NIC for all)."""
    nics = "sim:nic0" if launcher == "pmix" else "sim:nic0,sim:nic1,sim:nic2"
    results = _job(3, variables, "allgather", "--size", "6K", "-n", "2", "-w", "0", "--nic", nics,
                   master=not name.startswith("srun"))
    for rank, (code, result, stderr) in enumerate(results):
        assert code == 0 and result["launcher"] == launcher and result["wrong"] == 0, (name, rank, result, stderr)
    devices = [device["device_info"].split()[2] for device in results[0][1]["devices"]]
    assert devices == (["sim:nic0"] * 3 if launcher == "pmix" else ["sim:nic0", "sim:nic1", "sim:nic2"])


@pytest.mark.anyio
@on("asyncio")  # the SSH server of the test runs in its loop
async def test_the_docs_hostfile_line_runs_a_rank_per_slot_each_on_its_nic(server):
    """`--hosts 'node01 slots=3' --remote-nic sim:a,sim:b,sim:c` as docs/collectives.md writes it, node01 being this
    host's SSH server: three ranks there, local ranks 0 to 2, each on its NIC of the list."""
    line = next(line for line in doc_commands(CHECKOUT / "docs" / "collectives.md", ("aiofabric ",))
                if "slots=3" in line)
    words = [word.replace("node01", f"127.0.0.1:{server.port}") for word in shlex.split(line, comments=True)]
    with anyio.fail_after(240):
        process = await anyio.run_process([*CLI, *words[1:], *server.cli_flags(), "-b", "4K", "-e", "4K", "-n", "2"],
                                          check=False)
    table = process.stdout.decode()
    assert process.returncode == 0, (table[-2000:], process.stderr.decode()[-3000:])
    assert "# Out of bounds values : 0 OK" in table
    assert re.findall(r"#  Rank +(\d+) .* emulated NIC (\S+)", table) == [("0", "sim:a"), ("1", "sim:b"),
                                                                           ("2", "sim:c")]


@pytest.mark.anyio
async def test_rank_0_given_another_hosts_address_says_to_set_master_addr():
    """srun's first node is not always task 0's (srun -m arbitrary, a hostfile): rank 0 cannot listen there, and says
    so at once instead of leaving the others to wait."""
    from aiofabric.collectives import RendezvousError, World, join
    world = World(0, 2, "192.0.2.1", free_port(), "srun", addr_from="the first host of SLURM_STEP_NODELIST")
    with anyio.fail_after(10), pytest.raises(RendezvousError) as caught:
        async with join(world):
            pass
    assert str(caught.value).startswith(f"rank 0 cannot serve the rendezvous at 192.0.2.1:{world.port}: ")
    assert str(caught.value).endswith("; 192.0.2.1 (the first host of SLURM_STEP_NODELIST) is not this host, where "
                                      "rank 0 runs: set MASTER_ADDR to rank 0's host")
