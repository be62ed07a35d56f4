"""`aiofabric allreduce | reducescatter | allgather | broadcast | reduce | gather | scatter | sendrecv`: nccl-tests'
flags, counts, text and JSON, every element checked; the check itself shown able to fail. The text is checked
against nccl-tests' own format strings (src/util.cu, copied below), as its log parsers read it."""
import json
import os
import re
import signal
import subprocess

import anyio
import numpy as np
import pytest

from aiofabric import collectives
from aiofabric.collectives import layout, nccl_format
from aiofabric.collectives.perf import PerfConfig, run_perf
from aiofabric.tools import nccl_flags
from tests.support.processes import CLI

# nccl-tests' src/util.cu, verbatim (C's printf formats; Python's % reads them alike)
PREAMBLE = "# nThread %d nGpus %d minBytes %ld maxBytes %ld step: %ld(%s) warmup iters: %d iters: %d agg iters: %d " \
           "validation: %d graph: %d unalign: %d"
DEVICE = re.compile(r"#  Rank +(\d+) Group +(\d+) Pid +(\d+) on +(\S+) device +(\d+) \[([^]]+)\] (.*)")  # parseRankInfo
HEADER = ["#", "# %10s  %12s  %8s  %6s  %6s           out-of-place                       in-place          "
          % ("", "", "", "", ""),
          "# %10s  %12s  %8s  %6s  %6s  %7s  %6s  %6s  %6s  %7s  %6s  %6s  %6s %*s"
          % ("size", "count", "type", "redop", "root", "time", "algbw", "busbw", "#wrong", "time", "algbw", "busbw",
             "#wrong", 0, ""),
          "# %10s  %12s  %8s  %6s  %6s  %7s  %6s  %6s  %6s  %7s  %6s  %6s  %6s %*s"
          % ("(B)", "(elements)", "", "", "", "(us)", "(GB/s)", "(GB/s)", "", "(us)", "(GB/s)", "(GB/s)", "", 0, "")]
ROW_START, ROW_BODY = "%12li  %12li  %8s  %6s  %6s", "  %7s  %6s  %6s  %6g"


def run(*args, timeout=180, env=None):
    process = subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=timeout,
                             env=None if env is None else {**os.environ, **env})
    lines = process.stdout.strip().splitlines()
    return process.returncode, (json.loads(lines[-1]) if lines and lines[-1].startswith("{") else None), process


def parse(stdout):
    """A log parser's reading: rows re-rendered through nccl-tests' formats must give our lines back exactly."""
    rows = []
    for line in stdout.splitlines():
        if line.startswith("#") or not line:
            continue
        size, count, type_, redop, root, *cells = line.split()
        assert len(cells) == 8, line
        again = ROW_START % (int(size), int(count), type_, redop, "%6i" % int(root))
        for time_, algbw, busbw, wrong in (cells[:4], cells[4:]):
            again += ROW_BODY % (time_, algbw, busbw, float(wrong))
        assert again == line
        rows.append((int(size), int(count), type_, redop, int(root), *map(float, cells)))
    return rows


def test_allreduce_json_rows_are_checked_and_busbw_uses_nccl_tests_factor():
    code, result, process = run("allreduce", "--ranks", "3", "-b", "1K", "-e", "16K", "-f", "4", "-n", "3", "-w",
                                "1", "--json")
    assert code == 0 and result["ok"] is True, process.stderr
    rows = result["rows"]
    assert [(row["size"], row["placement"]) for row in rows] == [
        (size, placement) for size in (1024, 4096, 16384) for placement in ("out-of-place", "in-place")]
    for row in rows:
        assert row["wrong"] == 0 and row["count"] == row["size"] // 4 and row["type"] == "float"
        assert row["op"] == "sum" and row["root"] == -1 and row["time_us"] > 0
        assert row["busbw_GBps"] == pytest.approx(row["algbw_GBps"] * 4 / 3)
        assert row["algbw_GBps"] == pytest.approx(row["size"] / row["time_us"] / 1e3)
    assert result["ranks"] == 3 and result["collective"] == "allreduce" and result["wrong"] == 0
    assert result["out_of_bounds"] == 0 and [d["rank"] for d in result["devices"]] == [0, 1, 2]
    assert result["emulator_processes"] == 1  # the ranks' NICs share one by default


def test_no_shared_emulator_gives_each_ranks_nic_its_own_process():
    code, result, process = run("allreduce", "--ranks", "3", "--size", "1K", "-n", "1", "--no-shared-emulator",
                                "--json")
    assert code == 0 and result["ok"] is True and result["wrong"] == 0, process.stderr
    assert result["emulator_processes"] == 3


@pytest.mark.parametrize("command,flags,count,algbw_factor,busbw_factor", [
    ("reducescatter", ["-d", "half", "-o", "max"], lambda elements: elements // 3 & ~7, 3, 2 / 3),
    ("allgather", ["-d", "int64"], lambda elements: elements // 3 & ~1, 3, 2 / 3),
    ("broadcast", ["-d", "double", "-r", "2"], lambda elements: elements, 1, 1.0),
    ("reduce", ["-d", "uint8", "-o", "avg", "-r", "1"], lambda elements: elements, 1, 1.0),
    ("gather", ["-d", "int8", "-r", "2"], lambda elements: elements // 3 & ~15, 3, 2 / 3),
    ("scatter", ["-d", "uint32"], lambda elements: elements // 3 & ~3, 3, 2 / 3),
    ("sendrecv", ["-d", "uint64"], lambda elements: elements, 1, 1.0),
    ("alltoall", ["-d", "float"], lambda elements: elements // 3 & ~3, 3, 2 / 3),
])
def test_each_collective_prints_nccl_tests_lines_counts_and_factors(command, flags, count, algbw_factor,
                                                                   busbw_factor):
    """Sizes, counts and bandwidths as each nccl-tests collective's GetCollByteCount and GetBw have them: the
    per-rank collectives count one rank's part, in whole 16-byte units (1000 bytes of int8 on 3 ranks: 320 a rank,
    not 333), and their algbw counts every rank's."""
    code, _, process = run(command, "--ranks", "3", "-b", "1000", "-e", "4000", "-f", "2", "-n", "2", "-w", "1",
                           *flags)
    assert code == 0, process.stderr
    lines = process.stdout.splitlines()
    program = nccl_format.PROGRAMS[{"reducescatter": "reduce_scatter"}.get(command, command)]
    assert lines[0] == "# nccl-tests version aiofabric-0.1.0 nccl-headers=0 nccl-library=0"
    assert lines[1] == f"# Collective test starting: {program}"
    assert lines[2] == PREAMBLE % (1, 1, 1000, 4000, 2, "factor", 1, 2, 1, 1, 0, 0)
    assert lines[3:5] == ["#", "# Using devices"]
    devices = [DEVICE.fullmatch(line).groups() for line in lines[5:8]]
    assert [(int(rank), int(group), int(device)) for rank, group, _, _, device, _, _ in devices] == [
        (0, 0, 0), (1, 0, 1), (2, 0, 2)]
    assert all(hexa == "0000:00:00" and "emulated NIC sim:" in info for *_, hexa, info in devices)
    assert lines[8:12] == HEADER
    itemsize = np.dtype(layout.DTYPE_NAMES[flags[1]]).itemsize
    rows = parse(process.stdout)
    assert [row[1] for row in rows] == [count(size // itemsize) for size in (1000, 2000, 4000)]
    assert [row[0] for row in rows] == [row[1] * algbw_factor * itemsize for row in rows]  # the larger buffer
    for size, elements, _, redop, root, *cells in rows:
        assert redop == {"reduce": "avg", "reducescatter": "max", "sendrecv": "sum"}.get(command, "none")
        assert root == (int(flags[-1]) if "-r" in flags else 0 if command in ("scatter",) else -1)
        for time_us, algbw, busbw, wrong in (cells[:4], cells[4:]):
            assert time_us > 0 and wrong == 0
            assert algbw == pytest.approx(elements * itemsize * algbw_factor / time_us / 1e3, abs=0.006)
            assert busbw == pytest.approx(algbw * busbw_factor, abs=0.011)
    assert lines[-6] == "# %-20s : %d %s" % ("Out of bounds values", 0, "OK")
    assert lines[-5] == "# %-20s : %g %s" % ("Avg bus bandwidth", float(lines[-5].split()[-1]), "")
    assert lines[-4:] == ["#", f"# Collective test concluded: {program}", "#", ""]


def test_json_file_is_nccl_tests_document_and_never_overwritten(tmp_path):
    """-J: nccl-tests' JSON document (its keys and quirks); an existing file is kept and FILE.0 written instead."""
    target = tmp_path / "run.json"
    target.write_text("keep me")
    code, _, process = run("allgather", "--ranks", "2", "-b", "1K", "-e", "2K", "-f", "2", "-n", "1", "-J",
                           str(target), "-d", "all", env={"NCCL_TESTS_MIN_BW": "0"})
    assert code == 0, process.stderr
    assert process.stdout.splitlines()[0] == f"# Writing JSON output to {target}.0"
    assert target.read_text() == "keep me"
    document = json.loads((tmp_path / "run.json.0").read_text())
    assert document["version"] == 3 and document["config"]["step_factor"] == 2
    assert document["config"]["blocking_collectives"] == "false" and len(document["config"]["devices"]) == 2
    types = [result["type"] for result in document["results"]]
    assert types == [t for t in ("int8", "uint8", "int32", "uint32", "int64", "uint64", "half", "float", "double",
                                 *(("bfloat16",) if nccl_flags.HAVE_BFLOAT16 else ())) for _ in range(2)]
    first = document["results"][0]
    assert first["root"] == "    -1" and first["redop"] == "none" and first["out_of_place"]["nwrong"] == 0.0
    assert set(first["in_place"]) == {"time", "alg_bw", "bus_bw", "nwrong"}
    assert document["out_of_bounds"] == {"count": 0, "okay": "true"}
    assert document["average_bus_bandwidth"]["okay"] == "true"
    assert "NCCL_TESTS_MIN_BW=0" in document["env"]


def test_nccl_tests_min_bw_fails_a_slow_run_as_nccl_tests_does(tmp_path):
    code, result, process = run("sendrecv", "--ranks", "2", "--size", "4K", "-n", "1", "-J", str(tmp_path / "r.json"),
                                env={"NCCL_TESTS_MIN_BW": "1000"})
    assert code == 1 and "# Avg bus bandwidth    : " in process.stdout and process.stdout.splitlines()[-5].endswith(
        " FAILED")
    assert "below 90% of NCCL_TESTS_MIN_BW=1000" in process.stderr
    assert json.loads((tmp_path / "r.json").read_text())["average_bus_bandwidth"]["okay"] == "false"


def test_usage_errors_name_the_flag_and_why_with_exit_2():
    cases = [
        (["allreduce", "-d", "complex"], "invalid choice: 'complex'"),
        (["broadcast", "--ranks", "3", "-r", "3"], "-r/--root 3: must be a rank in [0, 2] (3 ranks), or all (-1)"),
        (["allreduce", "--ranks", "2", "-b", "64K", "-e", "1K"], "-b/--minbytes 65536 is larger than -e/--maxbytes"),
        (["allreduce", "-g", "2"], "-g 2: only 1 is taken (nccl-tests' GPUs per thread: here a rank is one NIC"),
        (["allreduce", "-t", "4"], "-t 4: only 1 is taken (nccl-tests' threads per process"),
        (["allreduce", "-G", "1"], "-G/--cudagraph 1: not taken here: CUDA graphs capture GPU kernels"),
        (["allreduce", "-C", "1"], "-C/--report_cputime 1: not taken here: the time reported here is the host's"),
        (["allreduce", "-D", "2"], "-D/--device_implementation 2: not taken here: NCCL's device API"),
        (["allreduce", "-x", "1"], "-x/--cta_policy 1: not taken here"),
        (["allreduce", "-o", "mulsum"], "-o mulsum: NCCL's ncclRedOpCreatePreMulSum"),
        (["allreduce", "-J", "out.txt"], "-J out.txt: nccl-tests writes JSON only, to a file named *.json"),
        (["allreduce", "-b", "1", "-e", "1G", "-i", "1"], "is 1073741824 sizes; at most 4096"),
        (["allreduce", "-z", "4"], "argument -z/--blocking: must be in [0, 3], not 4"),
        (["allreduce", "-a", "4"], "argument -a/--average: must be in [0, 3], not 4"),
        (["allreduce", "-m", "0"], "argument -m/--agg_iters: must be at least 1, not 0"),
        (["hypercube", "-b", "8", "-e", "128M", "-f", "2", "-g", "1"],
         "hypercube_perf is not here: its exchanges are between rank and rank ^ 2^k"),
    ]
    for args, message in cases:
        code, result, _ = run(*args, "--json")
        assert code == 2 and result["ok"] is False and message in result["error"], (args, result)
    code, result, _ = run("allreduce", "--json", env={"NCCL_TESTS_MIN_BW": "fast"})
    assert code == 2 and "NCCL_TESTS_MIN_BW='fast': not a number" in result["error"]
    for accepted in (["-g", "1", "-t", "1", "-G", "0", "-C", "0", "-V", "16"],):  # what every script passes
        code, result, _ = run("allreduce", "--ranks", "2", "--size", "1K", "-n", "1", *accepted, "--json")
        assert code == 0, result


def test_sweeps_agg_cycles_blocking_and_all_roots_as_nccl_tests():
    """-i steps by bytes (nccl-tests' default when -f is 1), -N repeats the sweep, -m and -z run, -r all walks every
    root, and every row of every type, op and root is checked."""
    code, result, process = run("reduce", "--ranks", "3", "-b", "1K", "-e", "3K", "-i", "1K", "-N", "2", "-m", "2",
                                "-z", "1", "-r", "all", "-o", "all", "-n", "1", "-a", "0", "--json")
    assert code == 0, process.stderr
    rows = result["rows"][::2]
    assert [(row["op"], row["root"], row["size"]) for row in rows] == [
        (op, root, size) for op in ("sum", "prod", "max", "min", "avg") for root in range(3) for _ in range(2)
        for size in (1024, 2048, 3072)]
    assert all(row["wrong"] == 0 for row in result["rows"])
    code, result, process = run("allgather", "--ranks", "2", "--size", "1K", "-n", "1", "-r", "all", "-o", "all",
                                "--json")  # neither an op nor a root: one row, as nccl-tests' all_gather_perf
    assert code == 0 and [(row["op"], row["root"]) for row in result["rows"]] == [("none", -1)] * 2, process.stderr


def test_two_runs_at_once_both_pass():
    processes = [subprocess.Popen([*CLI, "allreduce", "--ranks", "2", "-b", "4K", "-e", "64K", "-f", "4", "-n", "3",
                                   "--json"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                 for _ in range(2)]
    for process in processes:
        stdout, stderr = process.communicate(timeout=180)
        assert process.returncode == 0, stderr
        assert json.loads(stdout.strip().splitlines()[-1])["wrong"] == 0


@pytest.mark.anyio
@pytest.mark.loop_agnostic
@pytest.mark.parametrize("kind,messages", [("allreduce", 8), ("reduce", 4), ("gather", 2), ("scatter", 2),
                                           ("sendrecv", 4), ("alltoall", 6)])
async def test_the_check_counts_elements_a_faulty_nic_did_not_place(kind, messages):
    """Tamper: rank 2's NIC acknowledges the data messages of the out-of-place runs (the untimed one and the
    checked one: `messages` each, 256-element pieces of 1008 floats, or of a rank's 336; an alltoall's rank 2 gets
    3 parts of 336) and of the allreduce of the
    time between them (2) without placing them; rank 2 receives data in each of these collectives with root 0. That run's result then differs from numpy's, and the
    check says how many elements, so a broken transfer is never reported as a pass; the in-place runs, placed, pass."""
    async with collectives.local(3, buffer_bytes=1 << 16, landing_bytes=1 << 17, piece_bytes=1024) as comms:
        config = PerfConfig(kind, [4032], iters=0, warmup=0)
        clean = await run_perf(comms, config)
        assert clean["wrong"] == 0 and clean["out_of_bounds"] == 0 and "error" not in clean
        await comms[2].nic.pci.debug_client().fault("skip_placement", count=2 * messages + 2)
        broken = await run_perf(comms, config)
        assert [row["wrong"] > 0 for row in broken["rows"]] == [True, False] and "elements differ" in broken["error"]
        assert broken["out_of_bounds"] == 1
        assert nccl_format.footer(broken["out_of_bounds"], 1.0, None, "x")[0] == "# Out of bounds values : 1 FAILED"


@pytest.mark.anyio
@pytest.mark.loop_agnostic
async def test_each_rank_times_its_own_iterations_without_waiting_for_the_others_between_them(monkeypatch):
    """As nccl-tests' threads: a rank that finished an iteration starts the next while a slower one is still busy
    with its previous (the collectives' ready messages, not the harness, keep the ranks in step), and each rank's
    time is its own, which -a then averages (0: rank 0's, 2: the least, 3: the most)."""
    from aiofabric.collectives.communicator import Communicator
    events = []
    original = Communicator.allreduce

    async def allreduce(self, *args, **kwargs):
        events.append((self.rank, "start"))
        result = await original(self, *args, **kwargs)
        if self.rank == 1:
            await anyio.sleep(0.05)  # a slow rank: busy after each collective
        events.append((self.rank, "end"))
        return result
    from aiofabric.collectives import perf
    ranks_times = []
    job_seconds = perf._job_seconds

    async def recorded(comms, seconds, average):  # each run's own ranks' times, beside the job's figure
        ranks_times.append(list(seconds))
        return await job_seconds(comms, seconds, average)
    monkeypatch.setattr(perf, "_job_seconds", recorded)
    async with collectives.local(2, buffer_bytes=4096) as comms:
        monkeypatch.setattr(Communicator, "allreduce", allreduce)
        for average, pick in ((0, lambda times: times[0]), (2, min), (3, max)):
            config = PerfConfig("allreduce", [1024], iters=3, warmup=0, check=0, average=average)
            events.clear()
            ranks_times.clear()
            time_us = (await run_perf(comms, config))["rows"][0]["time_us"]
            timed = events[4:4 + 12]  # after the untimed run's start and end at each rank
            assert timed.index((0, "start"), 2) < timed.index((1, "end")), timed  # rank 0 went on before rank 1 ended
            times = ranks_times[0]  # the row's (out of place) run, compared within itself: runs differ by noise
            assert times[0] < times[1], times  # rank 0's time is without rank 1's last 50 ms
            assert time_us == pytest.approx(pick(times) * 1e6), (average, times, time_us)


def test_nccl_tests_reference_is_the_ring_order_and_agrees_with_exact_sums():
    """The reference the check uses: for integers, any order gives numpy's sum."""
    from aiofabric.collectives.reference import chain_reference, ring_reference
    rng = np.random.default_rng(1)
    for n in (2, 3, 5):
        xs = [rng.integers(-2**40, 2**40, 1001) for _ in range(n)]
        assert np.array_equal(ring_reference(xs, "sum"), np.sum(xs, axis=0))
        assert np.array_equal(ring_reference(xs, "max"), np.max(xs, axis=0))
        assert np.array_equal(chain_reference(xs, "sum", n - 1), np.sum(xs, axis=0))
        assert np.array_equal(ring_reference(xs, "avg"), np.trunc(np.sum(xs, axis=0) / n).astype(np.int64))


def test_hosts_set_the_number_of_ranks_and_an_unreachable_host_is_named(tmp_path):
    """Found by review: --root was checked against the default 2 ranks, not the 3 hosts. A run that fails leaves no
    -J document behind (an empty one would read as a run)."""
    code, result, _ = run("broadcast", "--hosts", "127.0.0.1:1,127.0.0.1:2,127.0.0.1:3", "-r", "2",
                          "--connect-timeout", "3", "-J", str(tmp_path / "r.json"), "--json")
    assert code == 1 and "--root" not in result["error"] and "127.0.0.1" in result["error"], result
    assert list(tmp_path.iterdir()) == []
    code, result, _ = run("allreduce", "--hosts", "a,b", "--ranks", "2", "--json")
    assert code == 2 and "--ranks and --hosts both say where the ranks run" in result["error"]


def test_run_cycles_0_repeats_until_interrupted_printing_each_row():
    """-N 0: nccl-tests' endless cycles; each row is printed as it is measured, and Ctrl-C ends the run (130)."""
    process = subprocess.Popen([*CLI, "sendrecv", "--ranks", "2", "--size", "1K", "-n", "1", "-N", "0"],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        rows = []
        while len(rows) < 3:
            line = process.stdout.readline()
            assert line, process.stderr.read()
            if not line.startswith("#"):
                rows.append(line)
        process.send_signal(signal.SIGINT)
        assert process.wait(timeout=60) == 130
        assert all(row.split()[:2] == ["1024", "256"] for row in rows)
    finally:
        process.kill()
        process.communicate()
