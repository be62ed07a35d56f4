"""A NIC that stops mid-run (its emulator process SIGSTOPped: firmware and datapath frozen, the process alive): bench
and lat fail within a bound, exit 1, and their error names the NIC that stopped, not a neighbour or a clean-up step;
SIGTERM of a stalled run exits within the close budget (README: "A close gives the firmware at most 10 seconds");
with a server host, the client's error names the server's NIC.

The emulators are found by their command line (`python -m aiofabric.sim.process CONFIG`, CONFIG naming the driver's
pid and the NIC); a run is known to be under way by its output (bench's interval lines) or by its capture file
growing (packets move only once the QPs run). Every stopped emulator is continued in a finally.
"""
import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest

from aiofabric.driver.close_budget import CLOSE_TIMEOUT
from tests.support.processes import CLI
from tests.support.results import without_metadata

BOUND = 20.0  # seconds from the stop to the exit: the no-progress limit (about 7 s) + a probe + the clean-up, with
# room for a loaded machine; before, a stopped sender ran forever and a stopped receiver took 33-48 s


def emulators(driver: int) -> dict[str, int]:
    """The emulator processes of driver process `driver`, by label (the NIC's name, or the shared process's)."""
    found = {}
    for entry in os.listdir("/proc"):
        try:
            argv = Path(f"/proc/{entry}/cmdline").read_bytes().rstrip(b"\0").split(b"\0")
        except OSError:
            continue
        if b"aiofabric.sim.process" in argv:
            config = json.loads(argv[-1])
            if config.get("driver_pid") == driver:
                found[config["label"]] = int(entry)
    return found


class Stopped:
    """SIGSTOP `pid` now; SIGCONT it at the end (it may be gone: its driver kills what it cannot close)."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        os.kill(pid, signal.SIGSTOP)
        self.at = time.monotonic()

    def __enter__(self) -> "Stopped":
        return self

    def __exit__(self, *exc) -> None:
        try:
            os.kill(self.pid, signal.SIGCONT)
        except ProcessLookupError:
            pass


def _wait_for(predicate, what: str, process: subprocess.Popen, seconds: float = 60):
    deadline = time.monotonic() + seconds
    while not (value := predicate()):
        assert process.poll() is None, f"exited before {what}: {process.communicate()}"
        assert time.monotonic() < deadline, f"no {what} within {seconds} s"
        time.sleep(0.02)
    return value


def _finish(process: subprocess.Popen, stopped: Stopped) -> tuple[int, dict, str, float]:
    try:
        out, err = process.communicate(timeout=60)
    finally:
        if process.poll() is None:
            process.kill()
    return process.returncode, json.loads(out.splitlines()[-1]), err, time.monotonic() - stopped.at


def _bench_running() -> subprocess.Popen:
    """`bench write --run-infinitely`: an interval line a second on stderr (with --json) once it runs."""
    bench = subprocess.Popen([*CLI, "bench", "write", "--run-infinitely", "-D", "0.5", "--json"],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert bench.stderr.readline(), bench.communicate()
    return bench


@pytest.mark.parametrize("side", [0, 1], ids=["sender", "receiver"])
def test_bench_with_a_stopped_nic_fails_within_a_bound_naming_it(side):
    bench = _bench_running()
    name = f"bench{bench.pid}-{side}"
    with Stopped(emulators(bench.pid)[name]) as stopped:
        code, result, err, took = _finish(bench, stopped)
    assert code == 1 and took < BOUND, (code, took, result, err[-2000:])
    # the sender's QP completes nothing (a stopped receiver ACKs nothing: its retries run out first)
    saw = (r"NoProgressError: QP 0x[0-9a-f]+ \(sim:bench\d+-0 to sim:bench\d+-1\) completed nothing for [\d.]+ s "
           r"with \d+ work request\(s\) outstanding \(the limit: [\d.]+ s\)") if side == 0 else \
        r"CompletionError: .*TRANSPORT_RETRY_CNT_ERR.*"
    assert re.fullmatch(rf"NICStoppedError: sim:{name} stopped: its firmware did not answer within 1 s; what the run "
                        rf"saw: {saw}", result["error"]), result["error"]
    assert "destroy_qp" not in result["error"]  # the clean-up's errors are not the headline


def test_sigterm_of_a_stalled_bench_exits_within_the_close_budget():
    bench = _bench_running()
    with Stopped(emulators(bench.pid)[f"bench{bench.pid}-0"]) as stopped:
        time.sleep(0.5)  # the run is waiting on the stopped NIC (its no-progress limit is far off)
        assert bench.poll() is None
        bench.send_signal(signal.SIGTERM)
        stopped.at = time.monotonic()
        code, result, err, took = _finish(bench, stopped)
    assert code == 143 and without_metadata(result) == {"ok": False, "error": "terminated by SIGTERM"}, \
        (code, result, err[-2000:])
    assert took < CLOSE_TIMEOUT, (took, err[-2000:])


def _lat_running(tmp_path: Path, *args: str) -> subprocess.Popen:
    """`lat write` with a capture file: once it grows past its header, packets move: the ping-pong runs."""
    pcap = tmp_path / "lat.pcap"
    lat = subprocess.Popen([*CLI, "lat", "write", "-n", "10000000", "--pcap", str(pcap), *args, "--json"],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    _wait_for(lambda: pcap.exists() and pcap.stat().st_size > 24, "packets", lat)
    return lat


def test_lat_with_its_emulator_stopped_fails_within_a_bound_naming_both_nics(tmp_path):
    lat = _lat_running(tmp_path)
    (label, pid), = emulators(lat.pid).items()  # lat's two NICs share one emulator process
    with Stopped(pid) as stopped:
        code, result, err, took = _finish(lat, stopped)
    assert code == 1 and took < BOUND, (code, took, result, err[-2000:])
    assert re.fullmatch(r"NICStoppedError: sim:bench\d+-0 stopped: its firmware did not answer within 1 s; "
                        r"sim:bench\d+-1 stopped: its firmware did not answer within 1 s; what the run saw: "
                        r"TimeoutError: (client|server): iteration \d+/10000000: the (pong|ping) \(an RDMA WRITE into "
                        r"the (client|server)'s buffer\) did not arrive within [\d.]+ s .*", result["error"]), \
        result["error"]


def test_sigterm_of_a_stalled_lat_exits_within_the_close_budget(tmp_path):
    lat = _lat_running(tmp_path)
    (label, pid), = emulators(lat.pid).items()
    with Stopped(pid) as stopped:
        time.sleep(0.5)
        lat.send_signal(signal.SIGTERM)
        stopped.at = time.monotonic()
        code, result, err, took = _finish(lat, stopped)
    assert code == 143 and without_metadata(result) == {"ok": False, "error": "terminated by SIGTERM"}, \
        (code, result, err[-2000:])
    assert took < CLOSE_TIMEOUT, (took, err[-2000:])


def test_a_lat_client_whose_servers_nic_stopped_names_the_servers_nic(tmp_path):
    log = tmp_path / "server.log"
    with open(log, "w") as server_log:
        server = subprocess.Popen([*CLI, "lat", "write", "--server", "--bind", "127.0.0.1", "--port", "0"],
                                  stdout=subprocess.DEVNULL, stderr=server_log)
    try:
        port = _wait_for(lambda: re.search(r"TCP port (\d+)", log.read_text()), "a port", server)[1]
        lat = _lat_running(tmp_path, "127.0.0.1", "--port", port)
        (label, pid), = _wait_for(lambda: emulators(server.pid), "the server's NIC", server).items()
        with Stopped(pid) as stopped:
            code, result, err, took = _finish(lat, stopped)
        assert code == 1 and took < BOUND, (code, took, result, err[-2000:])
        assert re.fullmatch(rf"NICStoppedError: the server's NIC sim:\S+ at 127.0.0.1:{port} stopped: its firmware did "
                            r"not answer within 1 s; what the run saw: .*", result["error"]), result["error"]
    finally:
        server.send_signal(signal.SIGINT)
        try:
            server.wait(30)
        finally:
            if server.poll() is None:
                server.kill()
