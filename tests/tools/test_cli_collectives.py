"""`aiofabric allreduce | reducescatter | allgather | broadcast`: nccl-tests' flags, table and JSON, every element
checked; the check itself shown able to fail."""
import json
import subprocess

import numpy as np
import pytest

from aiofabric import collectives
from aiofabric.collectives.perf import PerfConfig, format_table, run_perf
from tests.support.processes import CLI


def run(*args, timeout=180):
    process = subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=timeout)
    lines = process.stdout.strip().splitlines()
    return process.returncode, (json.loads(lines[-1]) if lines and lines[-1].startswith("{") else None), process


def test_allreduce_json_rows_are_checked_and_busbw_uses_nccl_tests_factor():
    code, result, process = run("allreduce", "--ranks", "3", "-b", "1K", "-e", "16K", "-f", "4", "-n", "3", "-w",
                                "1", "--json")
    assert code == 0 and result["ok"] is True, process.stderr
    rows = result["rows"]
    assert [(row["size"], row["placement"]) for row in rows] == [
        (size, placement) for size in (1024, 4096, 16384) for placement in ("out-of-place", "in-place")]
    for row in rows:
        assert row["wrong"] == 0 and row["count"] == row["size"] // 4 and row["dtype"] == "float32"
        assert row["op"] == "sum" and row["root"] == -1 and row["time_us"] > 0
        assert row["busbw_GBps"] == pytest.approx(row["algbw_GBps"] * 4 / 3, rel=1e-3, abs=2e-6)
    assert result["ranks"] == 3 and result["collective"] == "allreduce" and result["wrong"] == 0


@pytest.mark.parametrize("command,flags,factor", [
    ("reducescatter", ["-d", "half", "-o", "max"], 2 / 3),
    ("allgather", ["-d", "int64"], 2 / 3),
    ("broadcast", ["-d", "double", "-r", "2"], 1.0),
])
def test_each_collective_prints_nccl_tests_table(command, flags, factor):
    code, _, process = run(command, "--ranks", "3", "-b", "3K", "-e", "12K", "-n", "2", "-w", "1", *flags)
    assert code == 0, process.stderr
    lines = process.stdout.splitlines()
    assert "out-of-place" in lines[1] and "in-place" in lines[1]
    assert lines[2].split()[1:6] == ["size", "count", "type", "redop", "root"]
    body = [line.split() for line in lines if line and not line.startswith("#")]
    assert [int(row[0]) for row in body] == [3072, 6144, 12288]
    for row in body:
        time_us, algbw, busbw, wrong = float(row[5]), float(row[6]), float(row[7]), row[8]
        assert time_us > 0 and wrong == "0" and row[12] == "0"
        assert busbw == pytest.approx(algbw * factor, abs=0.011)
    assert lines[-2] == "# Out of bounds values : 0 OK" and lines[-1].startswith("# Avg bus bandwidth    : ")


def test_usage_and_value_errors_are_reported_with_their_exit_codes():
    code, result, _ = run("allreduce", "-d", "complex", "--json")
    assert code == 2 and result["ok"] is False and "invalid choice: 'complex'" in result["error"]
    code, result, _ = run("broadcast", "--ranks", "3", "-r", "3", "--json")
    assert code == 2 and "-r/--root 3: must be a rank in [0, 2] (3 ranks)" in result["error"]
    code, result, _ = run("allreduce", "--ranks", "2", "-b", "64K", "-e", "1K", "--json")
    assert code == 2 and "-b/--minbytes 65536 is larger than -e/--maxbytes 1024" in result["error"]


def test_two_runs_at_once_both_pass():
    processes = [subprocess.Popen([*CLI, "allreduce", "--ranks", "2", "-b", "4K", "-e", "64K", "-n", "3", "--json"],
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    for process in processes:
        stdout, stderr = process.communicate(timeout=180)
        assert process.returncode == 0, stderr
        assert json.loads(stdout.strip().splitlines()[-1])["wrong"] == 0


@pytest.mark.anyio
@pytest.mark.loop_agnostic
async def test_the_check_counts_elements_a_faulty_nic_did_not_place():
    """Tamper: rank 1's NIC acknowledges the next incoming write without placing it. The run's result then differs
    from numpy's, and the check says how many elements, so a broken transfer is never reported as a pass."""
    async with collectives.local(3, buffer_bytes=1 << 16, piece_bytes=1024) as comms:
        config = PerfConfig("allreduce", [4096], iters=0, warmup=0, dtype="float32")
        clean = await run_perf(comms, config)
        assert clean["wrong"] == 0 and "error" not in clean
        await comms[1].nic.pci.debug_client().fault("skip_placement", count=1)
        broken = await run_perf(comms, config)
        assert broken["rows"][0]["wrong"] > 0 and "elements differ" in broken["error"]
        assert "FAILED" in format_table(broken)


def test_nccl_tests_reference_is_the_ring_order_and_agrees_with_exact_sums():
    """The reference the check uses: for integers, any order gives numpy's sum."""
    from aiofabric.collectives.perf import ring_reference
    rng = np.random.default_rng(1)
    for n in (2, 3, 5):
        xs = [rng.integers(-2**40, 2**40, 1001) for _ in range(n)]
        assert np.array_equal(ring_reference(xs, "sum"), np.sum(xs, axis=0))
        assert np.array_equal(ring_reference(xs, "max"), np.max(xs, axis=0))


def test_hosts_set_the_number_of_ranks_and_an_unreachable_host_is_named():
    """Found by review: --root was checked against the default 2 ranks, not the 3 hosts."""
    code, result, _ = run("broadcast", "--hosts", "127.0.0.1:1,127.0.0.1:2,127.0.0.1:3", "-r", "2",
                          "--connect-timeout", "3", "--json")
    assert code == 1 and "--root" not in result["error"] and "127.0.0.1" in result["error"], result
    code, result, _ = run("allreduce", "--hosts", "a,b", "--ranks", "2", "--json")
    assert code == 2 and "--ranks and --hosts both say where the ranks run" in result["error"]
