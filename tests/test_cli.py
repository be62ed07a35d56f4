"""The command line contract (design.md §5): --json prints one JSON object last, with "ok"; failures exit non-zero."""
import json
import subprocess
import sys

import pytest


def run(*args, timeout=120):
    process = subprocess.run([sys.executable, "-m", "aiofabric.cli", *args], capture_output=True, text=True,
                             timeout=timeout)
    last = process.stdout.strip().splitlines()[-1] if process.stdout.strip() else ""
    return process.returncode, (json.loads(last) if last.startswith("{") else None), process


def test_info_json():
    code, result, _ = run("info", "--json")
    assert code == 0 and result["ok"] is True
    assert result["fw_version"] and result["mac"].count(":") == 5 and result["gid"].startswith("0000:")
    assert isinstance(result["port"], int)


def test_info_human_output():
    code, _, process = run("info")
    assert code == 0 and "fw_version" in process.stdout and "gid" in process.stdout


def test_loopback_json():
    code, result, _ = run("loopback", "--size", "3000", "--json")
    assert code == 0 and result["ok"] and result["verified"] and result["bytes"] == 3000


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
    assert "#bytes" in process.stdout and "BW average[MB/sec]" in process.stdout and "verified: yes" in process.stdout


def test_bad_arguments_fail_with_a_reason():
    code, result, _ = run("bench", "write", "--nics", "3", "--json")
    assert code == 1 and result["ok"] is False and "--nics" in result["error"]
    code, result, _ = run("info", "--nic", "eth0", "--json")
    assert code == 1 and result["ok"] is False and "bad NIC spec" in result["error"]


@pytest.mark.parametrize("example,args", [("loopback.py", []), ("multi_qp.py", ["--qps", "8", "--writes", "40"])])
def test_examples_run_as_is(example, args):
    path = __import__("pathlib").Path(__file__).resolve().parents[1] / "examples" / example
    process = subprocess.run([sys.executable, str(path), *args], capture_output=True, text=True, timeout=120)
    assert process.returncode == 0, process.stderr
    assert "passed" in process.stdout or "verified" in process.stdout
