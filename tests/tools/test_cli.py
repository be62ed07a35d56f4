"""The command line contract (README: Command line): --json prints one JSON object last, with "ok"; failures exit non-zero."""
import json
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from aiofabric.tools.cli import describe
from tests.support import CHECKOUT
from tests.support.results import without_metadata

if sys.version_info < (3, 11):
    from exceptiongroup import BaseExceptionGroup, ExceptionGroup


CLI = [sys.executable, "-m", "aiofabric.tools.cli"]


def last_json(stdout):
    last = stdout.strip().splitlines()[-1] if stdout.strip() else ""
    return json.loads(last) if last.startswith("{") else None


def run(*args, timeout=120):
    process = subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=timeout)
    return process.returncode, last_json(process.stdout), process


def test_info_json():
    code, result, _ = run("info", "--json")
    assert code == 0 and result["ok"] is True
    assert result["fw_version"] and result["mac"].count(":") == 5 and result["gid"].startswith("0000:")
    assert isinstance(result["port"], int)
    assert (result["link"], result["link_speed_mbps"]) == ("up", 400000)  # info waits while the link trains


def test_info_human_output():
    code, _, process = run("info")
    assert code == 0 and "fw_version" in process.stdout and "gid" in process.stdout


def test_loopback_json():
    code, result, _ = run("loopback", "--size", "3000", "--json")
    assert code == 0 and result["ok"] and result["verified"] and result["bytes"] == 3000
    assert all(qpn > 0 for qpn in result["qpn"])


def test_loopback_human_output_names_live_qpns():
    code, _, process = run("loopback", "--size", "100")
    assert code == 0 and re.search(r"between QPs 0x[0-9a-f]+ -> 0x[0-9a-f]+: verified", process.stdout), process.stdout


@pytest.mark.parametrize("size,code,message", [("0", 2, "-s/--size: must be a size in [1, "), ("-5", 2, "is not a size")])
def test_loopback_refuses_a_size_below_one_byte(size, code, message):
    got, result, _ = run("loopback", f"--size={size}", "--json")
    assert got == code and result["ok"] is False and message in result["error"]


@pytest.mark.parametrize("test", ["write", "read", "send"])
def test_bench_json_fields(test):
    code, result, _ = run("bench", test, "--qps", "2", "--size", "2000", "--iters", "30", "--depth", "4",
                          "--mtu", "1024", "--json")
    assert code == 0 and result["ok"] and result["verified"]
    assert result["ops"] == 60 and result["bytes"] == 120000
    for key in ("seconds", "msg_rate", "bw_MiBps", "driver_cpu_us_per_op", "packets", "retransmits", "dropped"):
        assert result[key] >= 0
    assert result["packets"] >= 60 * 2 and result["lat_us"]["p50"] <= result["lat_us"]["p99"]


def test_bench_under_faults_reports_retransmits():
    code, result, _ = run("bench", "write", "--qps", "2", "--size", "4096", "--iters", "40", "--depth", "8",
                          "--mtu", "1024", "--loss", "0.05", "--corrupt", "0.02", "--seed", "3", "--timeout", "8",
                          "--json")
    assert code == 0 and result["verified"] and result["retransmits"] > 0 and result["dropped"] > 0


def test_bench_table_output():
    code, _, process = run("bench", "write", "--qps", "1", "--size", "64", "--iters", "20", "--depth", "2")
    assert code == 0
    assert "#bytes" in process.stdout and "BW average[MiB/sec]" in process.stdout and "verified: yes" in process.stdout


def test_bad_arguments_fail_with_a_reason():
    code, result, _ = run("bench", "write", "--nics", "3", "--json")
    assert code == 2 and result["ok"] is False and "--nics 3: must be an even number" in result["error"]
    code, result, _ = run("info", "--nic", "eth0", "--json")
    assert code == 1 and result["ok"] is False and "bad NIC spec" in result["error"]


@pytest.mark.parametrize("timeout", ["32", "99", "-1"])
def test_bench_refuses_an_ack_timeout_outside_its_5_bit_field(timeout):
    code, result, _ = run("bench", "write", "--iters", "5", "--timeout", timeout, "--json")
    assert code == 2 and result["ok"] is False
    assert "--timeout" in result["error"] and "[0, 31]" in result["error"]


@pytest.mark.parametrize("args,message", [
    (["bench", "write", "--mtu", "1000"], "argument -m/--mtu: invalid choice: 1000"),
    (["frobnicate"], "invalid choice: 'frobnicate'"),
    ([], "the following arguments are required: command"),
    (["bench", "write", "--dep", "4"], "unrecognized arguments: --dep 4"),  # not taken as --depth 4
    (["bench", "write", "--it", "5"], "unrecognized arguments: --it"),
    (["loopback", "--siz", "5"], "unrecognized arguments: --siz"),
])
def test_usage_errors_print_json_and_exit_2(args, message):
    code, result, process = run(*args, "--json", timeout=30)
    assert code == 2 and set(without_metadata(result)) == {"ok", "error"} and result["ok"] is False
    assert result["error"].startswith("usage: ") and message in result["error"] and "\n" not in result["error"]
    assert process.stdout.count("\n") == 1


def test_usage_errors_without_json_keep_argparse_output():
    code, _, process = run("bench", "write", "--mtu", "1000", timeout=30)
    assert code == 2 and process.stdout == ""
    assert process.stderr.startswith("usage: aiofabric bench")
    assert "aiofabric bench: error: argument -m/--mtu: invalid choice: 1000" in process.stderr


def test_describe_names_the_innermost_error_on_one_line():
    nested = ExceptionGroup("outer", [ExceptionGroup("inner", [OverflowError("too\nlarge")]), ValueError("second")])
    assert describe(nested) == "OverflowError: too large"
    assert describe(BaseExceptionGroup("one", [TimeoutError()])) == "TimeoutError"
    caused = RuntimeError("flushed because the QP failed earlier: retry exceeded")
    caused.__cause__ = KeyError("not followed")
    assert describe(caused) == "RuntimeError: flushed because the QP failed earlier: retry exceeded"


def test_a_failed_qp_is_one_line_naming_the_cause():
    code, result, _ = run("bench", "write", "--loss", "0.9", "--timeout", "1", "--iters", "50", "--json")
    assert code == 1 and result["ok"] is False
    error = result["error"]
    assert "ExceptionGroup" not in error and "\n" not in error
    assert error.startswith("CompletionError: ") and "RETRY" in error, error


def test_a_buffer_over_256_mib_works():
    """8 MiB x depth 33 = 264 MiB per QP, all of it written: the data pattern used to overflow random.randbytes
    (an OverflowError the user saw as "ExceptionGroup: unhandled errors in a TaskGroup")."""
    code, result, _ = run("bench", "write", "--size", "8388608", "--depth", "33", "--iters", "33", "--json")
    assert code == 0 and result["ok"] and result["verified"], result


def emulator_children(pid):
    """PIDs of the emulated NICs (aiofabric.sim.process) that process `pid` started, found through /proc."""
    children = []
    for entry in Path("/proc").iterdir():
        try:
            status = (entry / "status").read_text()
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        if re.search(rf"^PPid:\s+{pid}$", status, re.M) and b"aiofabric.sim.process" in cmdline:
            children.append(int(entry.name))
    return children


def start_moving_data(*args, pcap, **popen):
    """A 10-million-iteration `bench write` that captures NIC 0's packets to `pcap`, returned once packets flow (the
    capture grows past its 24-byte header)."""
    process = subprocess.Popen([*CLI, *args, "bench", "write", "--iters", "10000000", "--pcap", str(pcap), "--json"],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **popen)
    deadline = time.monotonic() + 30
    while not (pcap.exists() and pcap.stat().st_size > 24):
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            pytest.fail(f"no packets within 30 s: {process.communicate()}")
        time.sleep(0.01)
    return process


def is_running(pid):
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.parametrize("backend", ["asyncio", "uvloop", "trio"])
@pytest.mark.parametrize("signum,code,message", [(signal.SIGTERM, 143, "terminated by SIGTERM"),
                                                 (signal.SIGINT, 130, "interrupted by SIGINT"),
                                                 (signal.SIGHUP, 129, "hung up (SIGHUP)")])
def test_a_signal_closes_cleanly_and_prints_json(backend, signum, code, message, tmp_path):
    process = start_moving_data("--backend", backend, "-v", pcap=tmp_path / "wire.pcap")
    try:
        emulators = emulator_children(process.pid)
        assert len(emulators) == 2, "the two emulated NICs did not start"
        process.send_signal(signum)
        stdout, stderr = process.communicate(timeout=15)
    finally:
        process.kill()
        process.wait()
    assert process.returncode == code, stderr
    assert without_metadata(last_json(stdout)) == {"ok": False, "error": message}, stdout + stderr
    assert "close:" not in stderr, stderr  # every firmware object was freed
    assert not [pid for pid in emulators if is_running(pid)]


def _catches(pid: int, signum: int) -> bool:
    status = Path(f"/proc/{pid}/status").read_text()
    return bool(int(re.search(r"SigCgt:\s+([0-9a-f]+)", status)[1], 16) >> (signum - 1) & 1)


@pytest.mark.parametrize("signum,code,message", [(signal.SIGTERM, 143, "terminated by SIGTERM"),
                                                 (signal.SIGINT, 130, "interrupted by SIGINT"),
                                                 (signal.SIGHUP, 129, "hung up (SIGHUP)")])
def test_a_signal_during_start_up_still_prints_json(signum, code, message):
    """The entry point's handlers are in place before the driver's modules import (numpy, anyio: a few hundred
    ms), so a signal sent the moment they are is one that arrives mid-import."""
    process = subprocess.Popen([sys.executable, "-m", "aiofabric", "info", "--json"], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 10
        while not _catches(process.pid, signal.SIGTERM):  # Python catches SIGINT from its start: wait for ours
            assert process.poll() is None and time.monotonic() < deadline
            time.sleep(0.0005)
        imported = set(Path(f"/proc/{process.pid}/maps").read_text().split())
        process.send_signal(signum)
        stdout, stderr = process.communicate(timeout=30)
    finally:
        process.kill()
        process.wait()
    assert not any(path.endswith(".so") and "numpy" in path for path in imported)  # still importing, as meant
    assert process.returncode == code, stderr
    assert without_metadata(last_json(stdout)) == {"ok": False, "error": message}, stdout + stderr


def test_concurrent_runs_each_get_their_own_nics():
    processes = [subprocess.Popen([*CLI, "bench", "write", "--iters", "100", "--json"], stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True) for _ in range(4)]
    results = [last_json(process.communicate(timeout=120)[0]) for process in processes]
    assert all(result and result["ok"] and result["verified"] for result in results), results


@pytest.mark.parametrize("example,args", [("loopback.py", []), ("multi_qp.py", ["--qps", "8", "--writes", "40"]),
                                          ("post_many.py", ["--writes", "1000", "--batch", "16"]),
                                          ("allreduce.py", ["--ranks", "3", "--size", "5000", "--steps", "3"])])
def test_examples_run_as_is(example, args):
    path = CHECKOUT / "examples" / example
    process = subprocess.run([sys.executable, str(path), *args], capture_output=True, text=True, timeout=120)
    assert process.returncode == 0, process.stderr
    assert "passed" in process.stdout or "verified" in process.stdout


def test_bench_pcap_names_one_file_per_nic(tmp_path):
    capture = tmp_path / "run.pcap"
    code, result, process = run("bench", "write", "--nics", "4", "--qps", "2", "--size", "64", "--iters", "5",
                                "--pcap", str(capture), "--json")
    assert code == 0 and result["ok"], process.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run.pcap", "run.pcap.1", "run.pcap.2", "run.pcap.3"]
    assert all(p.stat().st_size > 24 for p in tmp_path.iterdir())  # more than the pcap header: packets


# -- verification can fail: the emulator misbehaves on purpose and `bench` must notice ----------------------
FULL = ("--size", "4096", "--iters", "64", "--depth", "8", "--mtu", "1024")  # every operation has its own slot
REUSED = ("--size", "65536", "--iters", "1100", "--depth", "16")  # 68.75 MiB > 64 MiB: slots reused, stamped


@pytest.mark.parametrize("shape", [FULL, REUSED], ids=["own-slots", "reused-slots"])
@pytest.mark.parametrize("test", ["write", "read", "send"])
def test_bench_verifies_every_operation(test, shape):
    code, result, process = run("bench", test, *shape, "--json")
    assert code == 0 and result["ok"] and result["verified"], process.stdout + process.stderr


@pytest.mark.parametrize("shape", [FULL, REUSED], ids=["own-slots", "reused-slots"])
@pytest.mark.parametrize("test", ["write", "read", "send"])
def test_bench_post_lists_verify_every_operation(test, shape):
    """-l posts through QueuePair.post_many: the same bytes, verified the same way."""
    code, result, process = run("bench", test, *shape, "-l", "4", "--json")
    assert code == 0 and result["ok"] and result["verified"] and result["post_list"] == 4, process.stdout


def test_bench_post_list_longer_than_the_depth_is_refused():
    code, result, _ = run("bench", "write", "--depth", "8", "--post-list", "9", "--json")
    assert code == 2 and result["ok"] is False and "--post-list 9: must be in [1, --tx-depth 8]" in result["error"]


@pytest.mark.parametrize("shape,fault,why", [
    (FULL, "skip_placement:1", "differ"), (FULL, "misplace:1:64", "differ"),
    (REUSED, "skip_placement:1", "placed 1099 messages"), (REUSED, "misplace:1100:64", "differ"),
], ids=["own-slots-skip", "own-slots-misplace", "reused-slots-skip", "reused-slots-misplace"])
def test_bench_verification_fails_when_the_nic_misplaces_data(shape, fault, why):
    code, result, process = run("bench", "write", *shape, "--inject-fault", fault, "--json")
    assert code == 1 and result["ok"] is False and result["verified"] is False, process.stdout + process.stderr
    assert why in result["error"]


def test_bench_refuses_an_unknown_fault():
    code, result, _ = run("bench", "write", "--inject-fault", "gremlins", "--json")
    assert code == 2 and "--inject-fault gremlins: must be KIND" in result["error"]


# -- bench as perftest users expect it -------------------------------------------------------------------------------
def test_sizes_take_suffixes_and_a_sweep_gives_one_row_per_size(tmp_path):
    saved = tmp_path / "sweep.json"
    code, result, process = run("bench", "write", "--min-size", "1K", "--max-size", "16K", "--factor", "4",
                                "--iters", "40", "--depth", "8", "--json", "--json-file", str(saved))
    assert code == 0 and result["ok"] and result["verified"], process.stderr
    assert [row["size"] for row in result["rows"]] == [1024, 4096, 16384] and result["sizes"] == [1024, 4096, 16384]
    assert all(row["verified"] and row["ops"] == 40 and row["bw_peak_MiBps"] >= row["bw_MiBps"] > 0
               for row in result["rows"])
    assert json.loads(saved.read_text())["rows"] == result["rows"]  # --json-file holds the same object
    code, result, process = run("bench", "read", "-s", "2K", "--iters", "30", "--json")
    assert code == 0 and result["size"] == 2048 and "rows" not in result  # a single size stays a flat object


def test_table_with_gbits_and_both_directions():
    code, _, process = run("bench", "write", "-s", "8K", "--iters", "60", "--depth", "8", "-b", "--report-gbits")
    assert code == 0, process.stderr
    assert "BW peak[Gb/sec]" in process.stdout and "BW average[Gb/sec]" in process.stdout
    assert "Bidirectional" in process.stdout and "NIC 0 sending" in process.stdout and "NIC 1 sending" in \
        process.stdout
    code, result, _ = run("bench", "write", "-s", "8K", "--iters", "60", "--depth", "8", "-b", "--json")
    assert code == 0 and result["verified"] and [d["ops"] for d in result["directions"]] == [60, 60]
    assert abs(sum(d["bw_MiBps"] for d in result["directions"]) - result["bw_MiBps"]) < 0.01 * result["bw_MiBps"]
    assert abs(result["bw_Gbps"] - result["bw_MiBps"] * 2**20 * 8 / 1e9) < 1e-6


def test_duration_runs_for_a_time_and_verifies_what_it_posted():
    code, result, process = run("bench", "write", "-s", "4K", "-D", "1.5", "--depth", "8", "--json")
    assert code == 0 and result["verified"], process.stderr
    assert result["duration"] == 1.5 and result["ops"] > 0 and 0.8 < result["seconds"] < 3
    assert "placement counts" in result["verification"]


def test_plot_of_a_sweep_and_of_saved_runs(tmp_path):
    png, saved = tmp_path / "bw.png", tmp_path / "run.json"
    code, result, process = run("bench", "write", "--min-size", "1K", "--max-size", "4K", "--iters", "20",
                                "--plot", str(png), "--json-file", str(saved), "--json")
    assert code == 0 and result["ok"], process.stderr
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    overlay = tmp_path / "overlay.png"
    code, result, _ = run("plot", str(saved), str(saved), "-o", str(overlay), "--json")
    assert code == 0 and result["runs"] == 2 and overlay.stat().st_size > 1000


@pytest.mark.parametrize("args,code,message", [
    (["bench", "write", "-s", "64Q"], 2, "is not a size"),
    (["bench", "write", "-s", "2G"], 2, "-s 2147483648: must be in [1, 1073741824]"),
    (["bench", "write", "-D", "0"], 2, "-D 0.0: must be in (0, 86400]"),
    (["bench", "write", "--min-size", "8K", "--max-size", "1K"], 2, "a sweep needs 1 <= --min-size <= --max-size"),
    (["bench", "write", "-a", "--factor", "1"], 2, "--factor must be at least 2"),
    (["bench", "write", "--plot", "x.png"], 2, "--plot draws a sweep"),
    (["bench", "write", "--nic", "4"], 2, "'4' is not 'sim', 'sim:NAME', a PCI address"),
    (["bench", "write", "--nic", "0000:41:00.0"], 2, "--nic 0000:41:00.0: a PCI NIC needs its partner on another"),
    (["plot", "/nonexistent.json", "-o", "x.png"], 1, "No such file"),
    (["bench", "write", "127.0.0.1", "--port", "1"], 1, "no aiofabric server (bench or lat --server) at 127.0.0.1:1"),
    (["bench", "write", "--forever"], 2, "--forever goes with --server"),
    (["bench", "write", "somehost", "--server"], 2, "choose one of SERVER_HOST, --server and --peer"),
    (["lat", "write", "--iters", "0"], 2, "--iters 0: must be an integer of at least 1"),
    (["lat", "read", "-s", "1Q"], 2, "is not a size"),
    (["lat", "send", "--nic", "0000:41:00.0"], 1, "0000:41:00.0: give the NIC's IPv4 address (ip=...)"),
    (["bench", "write", "--nics", "1000"], 2, "--nics 1000: must be an even number in [2, 16]"),
    (["bench", "write", "--server", "--port", "70000"], 2, "a port is in [0, 65535], not 70000"),
    (["bench", "write", "127.0.0.1", "--remote-ip", "10.0.0.9"], 2, "the server chooses its NIC and address"),
    (["bench", "write", "--server", "--nic", "0000:41:00.0"], 2, "give the NIC's address with --ip"),
    (["bench", "write", "--server", "--max-nics", "0"], 2, "must be at least 1, not 0"),
    (["bench", "write", "--server", "--allow-peer", "10.0.0.0/33"], 2, "invalid ip_network value"),
], ids=["suffix", "too-big", "duration-0", "sweep-order", "factor", "plot-no-sweep", "nic-spec", "pci-alone",
        "plot-missing", "no-server", "forever-alone", "two-modes", "lat-iters", "lat-suffix", "lat-pci-no-ip", "nics-cap",
        "port-range", "client-names-server-ip", "server-pci-no-ip", "max-nics-0", "allow-peer-bad"])
def test_bad_input_for_every_new_flag_is_one_line(args, code, message):
    got, result, process = run(*args, "--json")
    assert got == code and result["ok"] is False and message in result["error"], process.stdout + process.stderr
    assert "\n" not in result["error"]


@pytest.mark.parametrize("test", ["write", "read", "send"])
def test_lat_reports_perftest_latency_fields(test):
    code, result, process = run("lat", test, "--iters", "60", "-s", "64", "--histogram", "-H", "--json")
    assert code == 0 and result["ok"] and result["verified"], process.stderr
    assert result["t_min_us"] <= result["t_typical_us"] <= result["p99_us"] <= result["p99_9_us"] <= result["t_max_us"]
    assert result["iterations"] == 60 and sum(count for _, count in result["histogram"]) == 60
    assert len(result["samples"]) == 60  # -H: every sample (the table lists them sorted)
    code, _, process = run("lat", test, "--iters", "20")
    assert code == 0 and "t_typical[usec]" in process.stdout and "99.9% percentile[usec]" in process.stdout


def test_a_server_on_a_taken_port_says_so():
    import socket
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        code, result, _ = run("bench", "write", "--server", "--bind", "127.0.0.1", "--port", str(port), "--json")
    assert code == 1 and result["ok"] is False and f"port {port} is taken" in result["error"]


def test_bench_server_and_client_on_one_host():
    """perftest's two commands on loopback: a server that serves one client and prints the client's table."""
    import socket
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = str(probe.getsockname()[1])
    server = subprocess.Popen([*CLI, "bench", "read", "--server", "--bind", "127.0.0.1", "--port", port, "-s", "4K",
                               "-n", "100"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert "waiting for a client" in server.stderr.readline()
        code, result, process = run("bench", "read", "127.0.0.1", "--port", port, "-s", "4K", "--iters", "100",
                                    "--json")
        assert code == 0 and result["verified"] and result["remote_host"] == f"127.0.0.1:{port}", process.stderr
        out, _ = server.communicate(timeout=30)
        assert server.returncode == 0 and "RDMA_Read BW Test" in out and "verified: yes" in out
    finally:
        if server.poll() is None:
            server.kill()
            server.wait(10)


@pytest.mark.parametrize("server_args,client_args,what", [
    (["write", "-s", "4K", "-n", "20"], ["write", "-s", "8K", "-n", "20"],
     "the client runs size 8192, the server size 4096"),
    (["write", "-n", "20"], ["read", "-n", "20"], "the client runs test read, the server test write"),
    (["write", "-n", "20", "-q", "2", "-t", "8"], ["write", "-n", "20", "-t", "16"],
     "the client runs qps 1, depth 16, the server qps 2, depth 8"),
    (["write", "-n", "20", "-m", "1024"], ["write", "-n", "30", "-m", "2048"],
     "the client runs mtu 2048, iters 30, the server mtu 1024, iters 20"),
], ids=["size", "test", "qps-and-depth", "mtu-and-iters"])
def test_a_bench_server_refuses_a_client_whose_symmetric_flags_differ(server_args, client_args, what):
    """As `lat --server`: perftest's symmetric flags (and -t) must agree; both sides exit 1 naming the difference."""
    server = subprocess.Popen([*CLI, "bench", *server_args, "--server", "--bind", "127.0.0.1", "--port", "0",
                               "--json"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        port = re.search(r"TCP port (\d+)", server.stderr.readline())[1]
        code, mine, process = run("bench", *client_args, "127.0.0.1", "--port", port, "--json")
        out, _ = server.communicate(timeout=30)
    finally:
        if server.poll() is None:
            server.kill()
            server.wait(10)
    theirs = json.loads(out.strip().splitlines()[-1])
    assert code == 1 and not mine["ok"] and what in mine["error"] and "\n" not in mine["error"], process.stderr
    assert server.returncode == 1 and not theirs["ok"] and what in theirs["error"]
    assert theirs["error"].startswith("the two sides' parameters differ") and \
        theirs["error"].endswith("start both with the same test, -s, -a (sizes), -A, -b, -D, -f, -m, -n, -q, -t and "
                                 "--run_infinitely")


def test_run_infinitely_reports_until_ctrl_c_then_prints_the_result():
    process = subprocess.Popen([*CLI, "bench", "write", "-s", "4K", "-D", "0.5", "--run-infinitely", "--json"],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 30
        reports, head = [], []
        while len(reports) < 2 and time.monotonic() < deadline:  # perftest's table on stderr (stdout is the JSON)
            line = process.stderr.readline()
            if line.startswith(" 4096 "):
                reports.append(line.split())
            else:
                head.append(line.rstrip("\n"))
        assert len(reports) == 2 and all(len(row) == 5 and row[2] == "0.00" for row in reports)  # perftest's rows
        assert head[-1].startswith(" #bytes     #iterations    BW peak[MiB/sec]")  # its header first
        process.send_signal(signal.SIGINT)  # a terminal's Ctrl-C: ends the run, not the program
        out, err = process.communicate(timeout=30)
    finally:
        if process.poll() is None:
            process.kill()
    assert process.returncode == 0, err[-2000:]
    result = json.loads(out.strip().splitlines()[-1])
    assert result["ok"] and result["verified"] and result["ops"] > 0


def test_ctrl_c_to_the_whole_process_group_closes_cleanly(tmp_path):
    """A terminal's Ctrl-C signals every process of the foreground group, the emulated NICs included: they must
    leave the ending to the driver (which frees every firmware object first), with no traceback anywhere."""
    import os
    process = start_moving_data(pcap=tmp_path / "wire.pcap", start_new_session=True)
    try:
        os.killpg(process.pid, signal.SIGINT)
        out, err = process.communicate(timeout=30)
    finally:
        if process.poll() is None:
            process.kill()
    assert process.returncode == 130 and json.loads(out.strip().splitlines()[-1])["error"] == "interrupted by SIGINT"
    assert "Traceback" not in err and "close:" not in err and "is gone" not in err, err[-3000:]


def test_plot_without_matplotlib_names_the_extra_before_running():
    hide = "import sys; sys.modules['matplotlib'] = None; from aiofabric.tools.cli import main; sys.exit(main(sys.argv[1:]))"
    process = subprocess.run([sys.executable, "-c", hide, "bench", "write", "--min-size", "2", "--max-size", "4",
                              "--plot", "never.png", "--json"], capture_output=True, text=True, timeout=60)
    result = json.loads(process.stdout.strip().splitlines()[-1])
    assert process.returncode == 1 and "pip install 'aiofabric[plot]'" in result["error"]
    assert "fw_version" not in result  # refused before any NIC booted
