"""Every firmware profile the emulator plays runs the tools a user runs: `bench write`, `lat write`, `bench atomic`
and a collective, through the command line's `--profile`, with their bytes verified. The one profile the driver
refuses (backing store v1) is refused in one line."""
import json
import subprocess

import pytest

from aiofabric.sim.profiles import PROFILES
from tests.support.processes import CLI

BOOTING = [name for name, profile in PROFILES.items() if profile.backing_store_v2]
RUNS = {  # small and few: this checks that each profile works end to end, not how fast
    "bench write": ["bench", "write", "--qps", "2", "--size", "3000", "--iters", "20", "--depth", "4", "--mtu", "1024"],
    "lat write": ["lat", "write", "--iters", "20", "--size", "64"],
    "bench atomic": ["bench", "atomic", "--iters", "20", "--depth", "4"],
    "allreduce": ["allreduce", "-b", "1K", "-e", "16K", "-f", "4", "-n", "2", "-w", "1", "-c", "1"],
}


def run(args, profile):
    process = subprocess.run([*CLI, *args, "--profile", profile, "--json"], capture_output=True, text=True,
                             timeout=120)
    lines = process.stdout.strip().splitlines()
    return process.returncode, json.loads(lines[-1]) if lines else None, process


@pytest.mark.parametrize("command", RUNS)
@pytest.mark.parametrize("profile", BOOTING)
def test_each_profile_runs_the_tools(profile, command):
    code, result, process = run(RUNS[command], profile)
    assert code == 0 and result["ok"], process.stdout[-2000:] + process.stderr[-2000:]
    assert result.get("verified", True) and result.get("checked", True) and not result.get("wrong"), result


def test_the_profile_the_driver_refuses_is_refused_in_one_line():
    code, result, _ = run(RUNS["bench write"], "thor")
    assert code != 0 and "the firmware offers only backing store v1" in result["error"]
