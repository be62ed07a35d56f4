"""Every --json line (docs/json-results.md): the metadata (schema version, command, command line, host, start time
in UTC, aiofabric's version), and the keys of its command as the schema shipped in the package says, no more
(a key the schema does not know, as a duplicate would be, fails it), no fewer."""
import calendar
import json
import os
import shlex
import signal
import socket
import subprocess
import time

import pytest

from aiofabric.tools import signals
from aiofabric.tools.result_meta import SCHEMA, SCHEMA_VERSION, command_of, metadata, stamped
from aiofabric.version import __version__
from tests.support import CHECKOUT
from tests.support.processes import CLI, free_port
from tests.support.results import DOCUMENT, assert_valid, schema_problems


def run(*args, env=None, timeout=120):
    process = subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=timeout, env=env)
    lines = process.stdout.strip().splitlines()
    return process.returncode, json.loads(lines[-1]) if lines and lines[-1].startswith("{") else None, process


def test_the_schema_is_valid_json_schema_and_ships_in_the_package():
    from jsonschema import Draft202012Validator
    Draft202012Validator.check_schema(DOCUMENT)
    assert SCHEMA.is_relative_to(CHECKOUT / "aiofabric")
    assert DOCUMENT["$defs"]["envelope"]["properties"]["schema_version"]["const"] == SCHEMA_VERSION
    pyproject = (CHECKOUT / "pyproject.toml").read_text()
    assert '"tools/schemas/*.json"' in pyproject  # package data: a wheel without it has no schema


@pytest.mark.parametrize("backend", ["asyncio", "trio", "uvloop"])
def test_a_run_says_what_ran_where_and_when(backend):
    before = int(time.time())
    argv = ["--backend", backend, "bench", "write", "-n", "20", "-s", "4096", "-q", "2", "--json"]
    code, result, process = run(*argv)
    after = time.time()
    assert code == 0 and result["ok"], process.stderr
    assert_valid(result)
    assert (result["schema_version"], result["aiofabric_version"], result["command"]) == (1, __version__, "bench")
    assert result["command_line"] == shlex.join(["aiofabric", *argv])
    assert shlex.split(result["command_line"])[1:] == argv
    assert result["host"] == socket.gethostname()
    started = calendar.timegm(time.strptime(result["time"], "%Y-%m-%dT%H:%M:%SZ"))  # UTC, to the second
    assert before <= started <= after
    assert list(result)[:7] == ["ok", "schema_version", "aiofabric_version", "command", "command_line", "host", "time"]


def test_one_key_for_one_fact():
    """perftest's #iterations is `iterations` (lat had it twice, as iters too; bench's iters was -n, iterations / qps);
    nccl-tests' type name is `type` (numpy's dtype was beside it)."""
    code, bench, _ = run("bench", "write", "-n", "10", "-s", "64", "-q", "2", "--json")
    assert code == 0 and bench["iterations"] == 20 and "iters" not in bench
    code, lat, _ = run("lat", "write", "-n", "10", "--json")
    assert code == 0 and lat["iterations"] == 10 and "iters" not in lat
    code, coll, _ = run("allgather", "--ranks", "2", "--size", "1K", "-n", "1", "-d", "half", "--json")
    assert code == 0 and {row["type"] for row in coll["rows"]} == {"half"} and "dtype" not in coll["rows"][0]
    for result in (bench, lat, coll):
        assert_valid(result)
    assert "unexpected" in "".join(schema_problems({**lat, "iters": 10}))  # the schema holds them gone


@pytest.mark.parametrize("argv,code", [
    (["info"], 0), (["loopback", "-s", "100"], 0), (["doctor"], None),
    (["bench", "send", "-b", "-n", "20", "-s", "1024"], 0),
    (["bench", "read", "--min-size", "2", "--max-size", "8", "-n", "10"], 0),
    (["bench", "write", "-D", "0.3", "-f", "0.1", "-s", "64"], 0),
    (["bench", "write", "-n", "10", "-s", "4096", "--inject-fault", "skip_placement:1"], 1),  # figures and an error
    (["lat", "write", "-n", "20", "-C", "-H", "--histogram"], 0),
    (["lat", "send", "-a", "-n", "5", "--warmup", "1"], 0),
    (["allreduce", "--ranks", "2", "-b", "1K", "-e", "2K", "-f", "2", "-n", "1", "-N", "2"], 0),
    (["broadcast", "--ranks", "3", "--size", "1K", "-n", "1", "-r", "all", "-d", "int8"], 0),
    (["bench", "bogus"], 2), (["--frobnicate"], 2), (["--version"], 0), (["bench", "-V"], 0),
], ids=["info", "loopback", "doctor", "bench-b", "bench-sweep", "bench-D", "bench-failed", "lat", "lat-sweep",
        "allreduce", "broadcast", "usage", "usage-no-command", "version", "bench-V"])
def test_every_outcome_is_a_valid_line(argv, code):
    got, result, process = run(*argv, "--json")
    if code is not None:  # doctor: 1 without a supported PCI function (here), 0 with one
        assert got == code, process.stderr[-2000:]
    assert result is not None and result["ok"] is (got == 0), process.stdout[-2000:]
    assert_valid(result)
    assert result["command"] == (None if argv[0].startswith("-") or "-V" in argv else argv[0])


def test_a_collective_that_misses_nccl_tests_min_bw_keeps_its_figures():
    code, result, _ = run("allreduce", "--ranks", "2", "--size", "1K", "-n", "1", "--json",
                          env=dict(os.environ, NCCL_TESTS_MIN_BW="1000000"))
    assert code == 1 and "NCCL_TESTS_MIN_BW" in result["error"] and result["min_bw_GBps"] == 1000000
    assert_valid(result)


def test_ranks_under_a_launcher_each_print_a_valid_line():
    port = str(free_port())
    processes = [subprocess.Popen([*CLI, "allreduce", "--size", "1K", "-n", "1", "--json"], stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True,
                                  env=dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=port, RANK=str(rank),
                                           WORLD_SIZE="2")) for rank in range(2)]
    for process in processes:
        out, err = process.communicate(timeout=120)
        result = json.loads(out.strip().splitlines()[-1])
        assert process.returncode == 0 and result["launcher"] == "torchrun", err[-2000:]
        assert_valid(result)


def test_the_out_json_file_is_the_line_with_perftests_keys(tmp_path):
    path = tmp_path / "run.json"
    code, line, _ = run("lat", "read", "-n", "10", "--out_json_file", str(path), "--json")
    saved = json.loads(path.read_text())
    assert code == 0 and saved == {**line, "test_info": saved["test_info"], "results": saved["results"]}
    assert_valid(saved)


def test_a_server_and_its_client_print_valid_lines():
    port = str(free_port())
    server = subprocess.Popen([*CLI, "lat", "write", "--server", "--bind", "127.0.0.1", "--port", port, "--json"],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert "waiting for a client" in server.stderr.readline()
        code, client, process = run("lat", "write", "127.0.0.1", "--port", port, "-n", "10", "--json")
        out, _ = server.communicate(timeout=60)
    finally:
        if server.poll() is None:
            server.kill()
            server.wait(10)
    assert code == 0 and client["remote_host"] == f"127.0.0.1:{port}", process.stderr[-2000:]
    summary = json.loads(out.strip().splitlines()[-1])
    assert server.returncode == 0 and summary["server"] is True and summary["reports"] == 1
    for result in (client, summary):
        assert_valid(result)


def test_plot_and_compare_lines(tmp_path):
    saved = tmp_path / "sweep.json"
    code, _, _ = run("bench", "write", "--min-size", "64", "--max-size", "128", "-n", "10", "--json-file",
                     str(saved))
    assert code == 0
    code, plotted, process = run("plot", str(saved), "-o", str(tmp_path / "sweep.png"), "--json")
    assert code == 0 and plotted["runs"] == 1, process.stderr[-2000:]
    code, compared, _ = run("compare", str(saved), str(saved), "--json")
    assert code == 0 and compared["regressions"] == 0
    halved = json.loads(saved.read_text())
    for row in halved["rows"]:
        row["bw_MiBps"] /= 2
    (tmp_path / "halved.json").write_text(json.dumps(halved))
    code, regressed, _ = run("compare", str(saved), str(tmp_path / "halved.json"), "--json")
    assert code == 1 and regressed["regressions"] == 2 and "worse than the base" in regressed["error"]
    for result in (plotted, compared, regressed):
        assert_valid(result)


def test_a_signal_before_the_command_ran_is_a_valid_line(capsys):
    assert signals.report(signals.Signalled(signal.SIGTERM), ["bench", "write", "--json"]) == 128 + signal.SIGTERM
    line = json.loads(capsys.readouterr().out)
    assert line["error"] == "terminated by SIGTERM" and line["command"] is None
    assert_valid(line)


def test_the_metadata_of_a_line_gives_way_to_nothing_and_names_the_command():
    meta = metadata(["--backend", "trio", "lat", "write", "-s", "a b"], "lat", "2026-01-02T03:04:05Z")
    assert meta["command_line"] == "aiofabric --backend trio lat write -s 'a b'"
    line = stamped(True, meta, {"schema_version": 0, "host": "elsewhere", "t_avg_us": 1.0})  # a remote rank's copy
    assert (line["schema_version"], line["host"], line["t_avg_us"]) == (1, socket.gethostname(), 1.0)
    assert command_of(["--backend", "trio", "lat", "write"], ["bench", "lat"]) == "lat"
    assert command_of(["--version"], ["bench", "lat"]) is None


@pytest.mark.parametrize("change,wrong", [
    (lambda r: r.pop("host"), "'host' is a required property"),
    (lambda r: r.update(time="2026-12-05 06:40:30"), "does not match"),
    (lambda r: r.update(time="2026-12-05T06:40:30+01:00"), "does not match"),
    (lambda r: r.update(schema_version=2), "1 was expected"),
    (lambda r: r.update(ok=False), "'error' is a required property"),
    (lambda r: r.update(error="x"), "should not be valid"),
    (lambda r: r["lat_us"].update(p90=1.0), "Additional properties are not allowed"),
], ids=["no-host", "time-not-iso", "time-not-utc", "schema-version", "failure-without-error", "success-with-error",
        "nested-key"])
def test_the_schema_refuses_what_the_contract_does_not_say(change, wrong):
    line = stamped(True, metadata(["bench", "write"], "bench", "2026-12-05T06:40:30Z"), BENCH_ROW)
    assert_valid(line)
    broken = json.loads(json.dumps(line))
    change(broken)
    assert wrong in "\n".join(schema_problems(broken))


BENCH_ROW = {
    "verified": True, "test": "write", "qps": 1, "size": 4096, "iterations": 20, "duration": None,
    "warmup_seconds": 0.0, "depth": 20, "post_list": 1, "cq_mod": 20, "inline_size": 0, "events": False, "mtu": 4096,
    "nics": 2, "emulator_processes": 2, "ops": 20, "measured_ops": 20, "bytes": 81920, "seconds": 0.0026,
    "msg_rate": 7620.4, "bw_MiBps": 29.8, "bw_peak_MiBps": 29.8, "bw_Gbps": 0.25,
    "lat_us": {"p50": 2624.5, "p99": 2624.5},
    "driver_cpu_us_per_op": 64.5, "packets": 21, "retransmits": 0, "dropped": 0, "rx_overflow": 0,
    "fw_version": "230.0.150.0", "verification": "every operation's bytes", "mtu_requested": 4096}
