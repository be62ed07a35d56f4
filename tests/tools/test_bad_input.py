"""Bad input gets a clear error naming what was wrong: on the command line a usage error (exit 2, the flag or
variable named) before anything runs, at every spelling (`--ranks 0`, `--ranks=0`, `-q0`) and exactly at each
boundary; in the API a ValueError naming the argument, raised before anything is sent."""
import json
import math
import re
import socket
import subprocess
import sys
import time

import pytest

import aiofabric
from aiofabric.tools import cli, nccl_flags, perftest_flags
from aiofabric.tools.commands.perftest_server import MAX_REPORT_ROWS
from tests.support.nics import connected_qps

ENVIRONMENT = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE",
               "SLURM_PROCID", "SLURM_NTASKS", "AIOFABRIC_RENDEZVOUS_PORT", "TORCHELASTIC_USE_AGENT_STORE")


@pytest.fixture(autouse=True)
def no_launcher(monkeypatch):
    """Each test names the launcher variables it sets: none leak in from the environment that runs the suite."""
    for name in ENVIRONMENT:
        monkeypatch.delenv(name, raising=False)


def usage_error(capsys, argv):
    """Run the command line in this process: it must stop at parsing with exit 2 and one JSON line."""
    code = cli.main([*argv, "--json"])
    out = capsys.readouterr().out
    result = json.loads(out.splitlines()[-1])
    assert code == 2 and result["ok"] is False and result["error"].startswith("usage: "), (code, out)
    assert out.count("\n") == 1 and "\n" not in result["error"]
    return result["error"].removeprefix("usage: ")


def parsed(*argv):
    """What the command line makes of argv, checked as `main` checks it, without running the command."""
    parser = cli.build_parser()
    args = parser.parse_args(list(argv))
    args.typed = perftest_flags.typed_flags(parser, list(argv))
    if getattr(args, "check", None) is not None:
        args.check(args)
    return args


RANKS = (": each rank of --ranks is an emulator process (or a PCI function) of this host, as bench's --nics; more "
         "ranks run one per process (torchrun, mpirun, srun) or per host (--hosts)")
CASES = [
    (["allreduce", "--ranks", "0"], "argument --ranks: must be in [1, 16], not 0" + RANKS),
    (["allreduce", "--ranks=0"], "argument --ranks: must be in [1, 16], not 0" + RANKS),
    (["allreduce", "--ranks", "-1"], "argument --ranks: must be in [1, 16], not -1" + RANKS),
    (["allreduce", "--ranks=-1"], "argument --ranks: must be in [1, 16], not -1" + RANKS),
    (["allreduce", "--ranks", "17"], "argument --ranks: must be in [1, 16], not 17" + RANKS),
    (["allreduce", "--ranks", "100000"], "argument --ranks: must be in [1, 16], not 100000" + RANKS),
    (["allreduce", "--ranks", "two"], "argument --ranks: 'two' is not an integer"),
    (["allreduce", "--piece", "0"], "argument --piece: must be a size in [1, 1073741824], not 0"),
    (["allreduce", "--piece=0"], "argument --piece: must be a size in [1, 1073741824], not 0"),
    (["broadcast", "--ranks", "9", "-r", "9"], "-r/--root 9: must be a rank in [0, 8] (9 ranks), or all (-1)"),
    (["broadcast", "--ranks", "3", "-r3"], "-r/--root 3: must be a rank in [0, 2] (3 ranks), or all (-1)"),
    (["broadcast", "-r", "-2"], "-r/--root -2: must be a rank in [0, 1] (2 ranks), or all (-1)"),
    (["broadcast", "-r", "x"], "-r/--root 'x': a rank, or all (-1)"),
    (["allreduce", "--timeout", "nan"], "argument --timeout: must be a positive, finite number of seconds, not nan"),
    (["allreduce", "--timeout", "0"], "argument --timeout: must be a positive, finite number of seconds, not 0"),
    (["allreduce", "--rendezvous-timeout", "inf"],
     "argument --rendezvous-timeout: must be a positive, finite number of seconds, not inf"),
    (["allreduce", "-f", "0"], "argument -f/--stepfactor: must be at least 1, not 0"),
    (["allreduce", "-f0"], "argument -f/--stepfactor: must be at least 1, not 0"),
    (["allreduce", "-i", "0"], "argument -i/--stepbytes: must be a size of at least 1, not 0"),
    (["allreduce", "-n", "-1"], "argument -n/--iters: must be at least 0, not -1"),
    (["allreduce", "-w", "-1"], "argument -w/--warmup_iters: must be at least 0, not -1"),
    (["allreduce", "--loss", "2"], "argument --loss: must be a probability in [0, 1), not 2"),
    (["allreduce", "--loss", "1"], "argument --loss: must be a probability in [0, 1), not 1"),
    (["bench", "write", "--corrupt", "nan"], "argument --corrupt: must be a probability in [0, 1), not nan"),
    (["lat", "write", "--dup=-0.1"], "argument --dup: must be a probability in [0, 1), not -0.1"),
    (["allreduce", "-b", "4M", "-e", "1K"], "-b/--minbytes 4194304 is larger than -e/--maxbytes 1024: a sweep goes up"),
    (["allreduce", "-b", "0"], "argument -b/--minbytes: must be a size of at least 1, not 0"),
    (["allreduce", "--ranks", "2", "--hosts", "a,b"],
     "--ranks and --hosts both say where the ranks run: give one (--hosts: one rank per host)"),
    (["allreduce", "--ranks", "2", "--nics", "0000:41:00.0"], "--nics names 1 NICs for 2 ranks: one per rank"),
    (["allreduce", "--ip", "300.1.1.1"], "argument --ip: '300.1.1.1' is not an IPv4 address (a.b.c.d)"),
    (["info", "--ip", "300.1.1.1"], "argument --ip: '300.1.1.1' is not an IPv4 address (a.b.c.d)"),
    (["info", "--ip=224.0.0.1"], "argument --ip: 224.0.0.1: a NIC needs a unicast address"),
    (["bench", "write", "--ip", "0.0.0.0"], "argument --ip: 0.0.0.0: a NIC needs a unicast address"),
    (["connect", "h", "--local-ip", "1.2.3"], "argument --local-ip: '1.2.3' is not an IPv4 address (a.b.c.d)"),
    (["connect", "h", "--remote-ip", "sssh"], "argument --remote-ip: 'sssh' is not an IPv4 address (a.b.c.d)"),
    (["bench", "write", "--server", "--max-line", "0"], "argument --max-line: must be a size of at least 1, not 0"),
    (["bench", "write", "--server", "--max-memory=0"], "argument --max-memory: must be a size of at least 1, not 0"),
    (["loopback", "--size", "0"], "argument -s/--size: must be a size in [1, 1073741824], not 0"),
    (["loopback", "-s0"], "argument -s/--size: must be a size in [1, 1073741824], not 0"),
    (["loopback", "-s", "1025M"], "argument -s/--size: must be a size in [1, 1073741824], not 1074790400"),
    (["connect", "h", "--size", "0"], "argument --size: must be a size of at least 1, not 0"),
    (["connect", "127.0.0.1:99999"], "HOST: bad host '127.0.0.1:99999': use host, host:port or user@host:port"),
    (["connect", "127.0.0.1:65536"], "HOST: bad host '127.0.0.1:65536': use host, host:port or user@host:port"),
    (["connect", "--hosts", "h1,h2:0"], "--hosts h1,h2:0: bad host 'h2:0': use host, host:port or user@host:port"),
    (["connect", "--hosts", "h1"], "--hosts h1: a ring needs at least 2 hosts, not 1"),
    (["connect", "--hosts", "h1 slots=x,h2"], "--hosts h1 slots=x,h2: h1: 'slots=x': slots is a whole number, 0 or "
                                              "more"),
    (["allreduce", "--hosts", "h1 slots=0"], "--hosts h1 slots=0: names no host"),
    (["allreduce", "--hosts", "h1 slots=3,h2", "--remote-nic", "sim:a,sim:b"],
     "--remote-nic sim:a,sim:b names 2, one per rank of a host, and h1 runs 3 ranks (its slots): name one for each"),
    (["allreduce", "--hosts", "h1,h2 slots=2", "--remote-ip", "ssh"],
     "--remote-ip ssh: h2 runs 2 ranks (its slots), whose NICs cannot share one address: leave --remote-ip out "
     "(emulated NICs pick their own)"),
    (["connect", "127.0.0.1", "--identity", "/nonexistent"],
     "argument --identity: /nonexistent: cannot read it: No such file or directory"),
    (["connect", "--hosts", "h1,h2", "--identity", "/nonexistent"],
     "argument --identity: /nonexistent: cannot read it: No such file or directory"),
    (["allreduce", "--hosts", "h1,h2", "--identity", "/nonexistent"],
     "argument --identity: /nonexistent: cannot read it: No such file or directory"),
    (["connect", "h", "--connect-timeout", "nan"],
     "argument --connect-timeout: must be a positive, finite number of seconds, not nan"),
    (["bench", "write", "--peer", "h", "--command-timeout", "-1"],
     "argument --command-timeout: must be a positive, finite number of seconds, not -1"),
    (["bench", "write", "-q0"], "-q 0: must be at least 1"),
    (["bench", "write", "-D", "1", "-f", "nan"], "argument -f/--margin: must be a finite number of seconds of at least "
                                                 "0, not nan"),
    (["bench", "write", "-D", "1", "-finf"], "argument -f/--margin: must be a finite number of seconds of at least "
                                             "0, not inf"),
    (["bench", "write", "-I", "-1"], "argument -I/--inline_size/--inline-size: must be at least 0, not -1"),
]


@pytest.mark.parametrize("argv,message", CASES, ids=[" ".join(argv) for argv, _ in CASES])
def test_a_bad_value_is_a_usage_error_naming_its_flag(capsys, argv, message):
    assert usage_error(capsys, argv) == message


LAUNCHED = [
    ({"RANK": "x", "WORLD_SIZE": "2"}, "RANK='x' (torchrun) is not an integer"),
    ({"RANK": "0", "WORLD_SIZE": "0"}, "WORLD_SIZE=0 (torchrun): a job has at least 1 rank"),
    ({"RANK": "0", "WORLD_SIZE": "-3"}, "WORLD_SIZE=-3 (torchrun): a job has at least 1 rank"),
    ({"RANK": "2", "WORLD_SIZE": "2"}, "RANK=2 (torchrun): rank 2 of a job of 2 ranks (WORLD_SIZE) must be in [0, 1]"),
    ({"OMPI_COMM_WORLD_RANK": "-1", "OMPI_COMM_WORLD_SIZE": "2"},
     "OMPI_COMM_WORLD_RANK=-1 (mpirun): rank -1 of a job of 2 ranks (OMPI_COMM_WORLD_SIZE) must be in [0, 1]"),
    ({"RANK": "0", "WORLD_SIZE": "1", "MASTER_PORT": "99999"}, "MASTER_PORT=99999: a port is in [1, 65535]"),
    ({"RANK": "0", "WORLD_SIZE": "1", "MASTER_PORT": "65536"}, "MASTER_PORT=65536: a port is in [1, 65535]"),
    ({"RANK": "0", "WORLD_SIZE": "1", "MASTER_PORT": "0"}, "MASTER_PORT=0: a port is in [1, 65535]"),
    ({"RANK": "0", "WORLD_SIZE": "1", "AIOFABRIC_RENDEZVOUS_PORT": "70000"},
     "AIOFABRIC_RENDEZVOUS_PORT=70000: a port is in [1, 65535]"),
    ({"RANK": "0", "WORLD_SIZE": "2", "MASTER_PORT": "65535", "TORCHELASTIC_USE_AGENT_STORE": "True"},
     "MASTER_PORT=65535 (torchrun's agent store): the rendezvous takes the next port, and there is none; set "
     "AIOFABRIC_RENDEZVOUS_PORT"),
    ({"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_STEP_ID": "0", "MASTER_ADDR": ""},
     "MASTER_ADDR is empty: set it to rank 0's host"),
    # a plain run in a batch script (sbatch -n 4): its Slurm variables are not a task's of srun
    ({"SLURM_JOB_ID": "7", "SLURM_PROCID": "0", "SLURM_NTASKS": "4", "SLURM_JOB_NODELIST": "node[01-02]"},
     "SLURM_PROCID=0 and SLURM_NTASKS=4 do not come from srun (no SLURM_STEP_ID: sbatch's batch script): this "
     "process is alone and ranks 1-3 would never come; start every rank with srun (srun aiofabric ...), or run the "
     "ranks in this process with --ranks N"),
    ({"SLURM_PROCID": "1", "SLURM_NTASKS": "2", "SLURM_STEP_ID": "0", "SLURM_STEP_NODELIST": "node[01-"},
     "SLURM_STEP_NODELIST: host list entry 'node[01-': a '[' without its ']'"),
    ({"PMIX_RANK": "0", "PMIX_NAMESPACE": "prterun-vm-1@1"},
     "PMIX_RANK=0 is set (a PMIx launcher: prterun, mpirun) but not the job's size, which PMIx keeps in its library: "
     "export WORLD_SIZE (the number of ranks) to every rank, or launch with Open MPI's mpirun or srun, which set it"),
]


@pytest.mark.parametrize("variables,message", LAUNCHED, ids=[" ".join(f"{k}={v}" for k, v in e.items())
                                                             for e, _ in LAUNCHED])
def test_a_launchers_bad_variable_is_a_usage_error_naming_it(capsys, monkeypatch, variables, message):
    for name, value in variables.items():
        monkeypatch.setenv(name, value)
    assert usage_error(capsys, ["allreduce"]) == message


def test_an_unresolvable_master_addr_is_a_usage_error_at_once(capsys, monkeypatch):
    for name, value in {"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "no-such-host.invalid"}.items():
        monkeypatch.setenv(name, value)
    started = time.monotonic()
    assert re.fullmatch(r"MASTER_ADDR=no-such-host\.invalid: cannot be resolved \(.+\)",
                        usage_error(capsys, ["allreduce"]))
    assert time.monotonic() - started < 20  # the resolver's answer, not the rendezvous timeout (60 s)


def test_srun_nodes_that_do_not_resolve_are_a_usage_error_saying_to_set_master_addr(capsys, monkeypatch):
    for name, value in {"SLURM_PROCID": "1", "SLURM_NTASKS": "2", "SLURM_STEP_ID": "0",
                        "SLURM_STEP_NODELIST": "no-such-node[1-2].invalid"}.items():
        monkeypatch.setenv(name, value)
    assert re.fullmatch(r"no-such-node1\.invalid \(the first host of SLURM_STEP_NODELIST\): cannot be resolved "
                        r"\(.+\); set MASTER_ADDR to rank 0's host", usage_error(capsys, ["allreduce"]))


@pytest.mark.parametrize("variables,nic,message", [
    ({"RANK": "0", "WORLD_SIZE": "2"}, "sim:a,sim:b",
     "--nic sim:a,sim:b names one per local rank, but torchrun sets no local rank (none of LOCAL_RANK, "
     "OMPI_COMM_WORLD_LOCAL_RANK, MPI_LOCALRANKID, PMI_LOCAL_RANK, SLURM_LOCALID is set): name one"),
    ({"SLURM_PROCID": "2", "SLURM_NTASKS": "3", "SLURM_LOCALID": "2", "SLURM_STEP_ID": "0"}, "sim:a,sim:b",
     "--nic sim:a,sim:b names 2, one per local rank, and this process is local rank 2: name one for each rank of a "
     "host"),
    ({"PMI_RANK": "1", "PMI_SIZE": "2", "MPI_LOCALRANKID": "1"}, "sim:a,,sim:b",
     "--nic sim:a,,sim:b: an empty name in the list"),
])
def test_a_nic_list_is_one_per_local_rank(capsys, monkeypatch, variables, nic, message):
    for name, value in variables.items():
        monkeypatch.setenv(name, value)
    assert usage_error(capsys, ["allreduce", "--nic", nic]) == message


def test_a_nic_list_gives_each_local_rank_its_own(monkeypatch):
    for name, value in {"OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_SIZE": "4",
                        "OMPI_COMM_WORLD_LOCAL_RANK": "1"}.items():
        monkeypatch.setenv(name, value)
    assert parsed("allreduce", "--nic", "0000:41:00.0,0000:41:00.1").nic == "0000:41:00.1"
    monkeypatch.setenv("OMPI_COMM_WORLD_LOCAL_RANK", "0")
    assert parsed("allreduce", "--nic", "0000:41:00.0,0000:41:00.1").nic == "0000:41:00.0"
    assert parsed("allreduce", "--nic", "0000:41:00.0").nic == "0000:41:00.0"  # one NIC: every local rank's


def test_a_root_is_a_rank_of_the_launchers_job(capsys, monkeypatch):
    for name, value in {"RANK": "0", "WORLD_SIZE": "2"}.items():
        monkeypatch.setenv(name, value)
    assert usage_error(capsys, ["broadcast", "-r", "2"]) == ("-r/--root 2: must be a rank in [0, 1] (2 ranks), or "
                                                             "all (-1)")
    assert parsed("broadcast", "-r", "1").roots == [1]  # the last rank is one
    assert parsed("broadcast", "-r", "all").roots == parsed("broadcast", "-r", "-1").roots == [0, 1]


def test_bfloat16_without_ml_dtypes_is_refused_saying_what_to_install(capsys, monkeypatch):
    monkeypatch.setattr(nccl_flags, "HAVE_BFLOAT16", False)
    assert usage_error(capsys, ["allreduce", "-d", "bfloat16"]) == (
        "-d bfloat16: numpy has no bfloat16 type; it takes the ml_dtypes package (pip install 'aiofabric[bf16]')")


def test_the_values_at_each_boundary_are_accepted():
    """The other side of each boundary above: the largest --ranks, the last root, the smallest piece, factor and
    size, a probability just below 1, and the hosts of --hosts without a port (found by a probe: a TypeError)."""
    args = parsed("broadcast", "--ranks", "16", "-r", "15", "--piece", "1", "-f", "2", "-b", "1", "-e", "1",
                  "--loss", "0.999", "-n", "0", "-w", "0")
    assert (args.rank_count, args.roots, args.piece, args.sizes, args.loss) == (16, [15], 1, [1], 0.999)
    assert parsed("allreduce", "-b", "1", "-e", "3", "-i", "1", "-f", "1").sizes == [1, 2, 3]  # -f 1: step by -i
    assert parsed("allreduce", "--ranks=1").rank_count == 1
    assert parsed("loopback", "-s", "1G").size == 1 << 30
    assert parsed("connect", "--hosts", "h1,h2").host_list == [(None, "h1", 22), (None, "h2", 22)]
    assert parsed("connect", "--hosts", "h1,u@h2:2222", "--port", "23").host_list == [(None, "h1", 23),
                                                                                      ("u", "h2", 2222)]
    assert parsed("connect", "127.0.0.1:65535").target == (None, "127.0.0.1", 65535)
    assert parsed("connect", "h", "--remote-ip", "ssh").remote_ip == "ssh"
    assert parsed("allreduce", "--hosts", "a,b,c", "-r", "2").rank_count == 3
    assert parsed("allreduce", "--hosts", "a slots=2,b", "-r", "2", "--remote-nic", "sim:x,sim:y").rank_count == 3
    assert parsed("connect", "--hosts", "a slots=2").host_list == [(None, "a", 22)] * 2  # a ring of two there


# -- the API ------------------------------------------------------------------------------------------------------
@pytest.mark.anyio
@pytest.mark.loop_agnostic
@pytest.mark.parametrize("latency", [math.inf, math.nan, -1, 1e7 + 1, True, "5"])
async def test_an_emulated_nics_firmware_latency_is_a_finite_number(latency):
    with pytest.raises(ValueError, match=rf"^fw_latency_us={re.escape(repr(latency))}: must be a number >= 0, at "
                                         r"most 1e7 \(10 s a command\)$"):
        async with aiofabric.open_nic("sim", fw_latency_us=latency):
            pass


@pytest.mark.anyio
@pytest.mark.loop_agnostic
async def test_sizes_and_offsets_are_integers_not_floats_strings_or_bools():
    async with aiofabric.open_nic("sim") as a, aiofabric.open_nic("sim") as b:
        limit = a.caps.get("max_mr_size") or 1 << 40
        for size in (math.nan, 1.5, "4096", True, 0):
            with pytest.raises(ValueError, match=rf"^size must be an integer in \[1, {limit}\], not "
                                                 rf"{re.escape(repr(size))}$"):
                await a.register_mr(size)
        assert (await a.register_mr(1)).length >= 1  # the boundary (a page, allocated)
        qa, qb = await connected_qps(a, b, 16)
        source, target = await a.register_mr(4096), await b.register_mr(4096)
        posted = qa.send_queue.posted
        for keywords, name, value in ((dict(local_offset=1.5), "local_offset", 1.5),
                                      (dict(local_offset=True), "local_offset", True),
                                      (dict(remote_offset=1.5), "remote_offset", 1.5),
                                      (dict(remote_offset=False), "remote_offset", False),
                                      (dict(size=1.5), "size", 1.5), (dict(size=True), "size", True)):
            size = keywords.pop("size", 64)
            for verb in (qa.write, qa.read):
                with pytest.raises(ValueError, match=rf"^{name} must be an integer in \[0, \d+\], not {value!r}$"):
                    await verb(source, target.remote(), size, **keywords)
        with pytest.raises(ValueError, match=r"^local_offset must be an integer"):
            await qa.post_send(source, 8, local_offset=0.5)
        assert qa.send_queue.posted == posted  # nothing was posted
        await qa.write(source, target.remote(), 64, local_offset=8, remote_offset=16)  # integers still work


# -- the servers' reports -------------------------------------------------------------------------------------------
def test_a_bench_server_prints_one_bounded_report_per_client(tmp_path):
    """A client of `bench --server` may hand over its report once, and a report of at most MAX_REPORT_ROWS rows:
    the server's output is bounded by its clients' number, not by what each one sends."""
    result = subprocess.run([sys.executable, "-m", "aiofabric", "bench", "write", "--iters", "4", "--size", "64",
                             "--json"], capture_output=True, text=True, timeout=120)
    honest = json.loads(result.stdout.splitlines()[-1])
    server = subprocess.Popen([sys.executable, "-m", "aiofabric", "bench", "write", "--server", "--bind",
                               "127.0.0.1", "--port", "0"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        port = int(re.search(r"TCP port (\d+)", server.stderr.readline())[1])
        with socket.create_connection(("127.0.0.1", port), timeout=20) as sock, sock.makefile("rb") as answers:
            assert json.loads(answers.readline()).get("ready")

            def request(number, result):
                sock.sendall(json.dumps({"id": number, "op": "report", "args": {"result": result}}).encode() + b"\n")
                return json.loads(answers.readline())
            rows = {**honest, "rows": [honest] * (MAX_REPORT_ROWS + 1)}
            too_many = request(1, rows)
            assert not too_many["ok"] and f"report: {MAX_REPORT_ROWS + 1} rows; a sweep has at most " \
                f"{MAX_REPORT_ROWS}" in too_many["error"]["message"], too_many
            assert request(2, honest)["ok"]
            again = request(3, honest)
            assert not again["ok"] and "report: a client reports its run once" in again["error"]["message"], again
        out, _ = server.communicate(timeout=60)
    finally:
        if server.poll() is None:
            server.kill()
            server.communicate()
    assert out.count("the report of client") == 1, out
