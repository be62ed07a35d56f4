"""aiofabric.tools.latency: perftest-style ping-pong latency (ib_write_lat / ib_send_lat / ib_read_lat) on emulated NICs."""
import dataclasses

import pytest

from aiofabric.tools.lat_config import LatConfig
from aiofabric.tools.lat_report import format_latency_table
from aiofabric.tools.perftest_format import RESULT_FMT_LAT as HEADER
from aiofabric.tools.latency import run_latency
from aiofabric.tools.samples import FIELDS as LATENCY_FIELDS
from aiofabric.tools.samples import histogram, summarize
from tests.support.backends import on
from tests.support.ssh_servers import assert_no_leftovers

ITERS = 40  # small: each run boots two emulator processes on a shared 2-core machine


def check_sane(result, config):
    t = {key: result[key] for key in LATENCY_FIELDS}
    assert t["t_min_us"] <= t["t_typical_us"] <= t["p99_us"] <= t["p99_9_us"] <= t["t_max_us"], t
    assert t["t_min_us"] <= t["t_avg_us"] <= t["t_max_us"], t
    assert t["t_min_us"] > 0 and t["t_stdev_us"] >= 0, t
    assert result["iterations"] == config.iters and "iters" not in result  # one key for one count
    assert result["size"] == config.size and result["test"] == config.test
    assert result["verified"] is True and "error" not in result, result


@pytest.mark.anyio
@pytest.mark.parametrize("test", ["write", "read", "send"])
@pytest.mark.loop_agnostic
async def test_each_verb_runs_and_reports_sane_numbers(test):
    config = LatConfig(test=test, iters=ITERS, size=4100 if test == "write" else 2, mtu=1024, histogram=True)
    result = await run_latency(config)
    check_sane(result, config)
    assert sum(count for _, count in result["histogram"]) == config.iters
    lows = [low for low, _ in result["histogram"]]
    assert lows == sorted(lows) and result["histogram"][0][1] and result["histogram"][-1][1]
    # t_max leaves out perftest's tail of the two largest samples; the histogram shows every sample
    assert lows[0] <= result["t_min_us"] and histogram([result["t_max_us"]])[0][0] <= lows[-1]
    assert result["latency"] == ("READ completion" if test == "read" else "one-way (RTT/2)")
    assert result["packets"] > 0 and result["retransmits"] == 0
    assert result["verification"].endswith("and the NICs' placement counts")  # emulated NICs count what they placed
    table = format_latency_table(result, config)
    assert HEADER in table.splitlines()
    row = table.splitlines()[table.splitlines().index(HEADER) + 1].split()
    assert row[:2] == [str(config.size), str(config.iters)]
    assert float(row[2]) == pytest.approx(result["t_min_us"], abs=0.01)
    assert "latency histogram" in table and " verified: yes" in table


@pytest.mark.anyio
@on("asyncio")
async def test_write_pingpong_survives_five_percent_loss(anyio_backend):
    config = LatConfig(test="write", iters=60, loss=0.05, seed=3)
    result = await run_latency(config)
    check_sane(result, config)
    assert result["retransmits"] > 0  # the loss was real, and go-back-N recovered every ping and pong


@pytest.mark.anyio
@on("trio")
async def test_a_lost_ping_is_a_timeout_naming_side_and_iteration(anyio_backend):
    # the server's NIC ACKs the first WRITE without placing it: the ping never lands, nobody may hang
    config = LatConfig(test="write", iters=5, inject_fault="skip_placement:1", wait=1.0)
    with pytest.raises(TimeoutError, match=r"^(server|client): warm-up iteration 1/8: the (ping|pong) .* within 1 s"):
        await run_latency(config)


@pytest.mark.anyio
@on("asyncio")
async def test_a_read_that_never_completes_is_a_timeout_naming_the_iteration(anyio_backend):
    # timeout 0: the QP never retransmits (IB's "wait forever"), so the first lost READ never completes
    config = LatConfig(test="read", iters=200, loss=0.3, seed=1, timeout=0, wait=0.5)
    with pytest.raises(TimeoutError, match=r"^client: (warm-up )?iteration \d+/(8|200): the RDMA READ did not "
                                           r"complete within 0.5 s$"):
        await run_latency(config)


@pytest.mark.parametrize("field, value", [
    ("size", 0), ("size", 1 << 29), ("iters", 0), ("test", "atomic"), ("mtu", 1000), ("timeout", 32),
    ("loss", 1.0), ("warmup", -1), ("wait", 0), ("inject_fault", "melt:1"), ("nic", "eth0")])
def test_bad_config_names_the_field(field, value):
    config = dataclasses.replace(LatConfig(), **{field: value})
    with pytest.raises(ValueError, match=field.replace("_", "-") if field == "inject_fault" else field):
        config.check()


@pytest.mark.anyio
@pytest.mark.loop_agnostic
async def test_run_latency_refuses_a_bad_config_before_booting():
    with pytest.raises(ValueError, match="--iters"):
        await run_latency(LatConfig(iters=0))


def test_histogram_buckets_are_contiguous_and_count_every_sample():
    rows = histogram([0.5, 1.0, 1.3, 33.0, 39.9, 40.0, 100.0])
    assert sum(count for _, count in rows) == 7
    counts = dict((low, count) for low, count in rows)
    assert counts[0.0] == 1 and counts[1.0] == 1 and counts[1.25] == 1 and counts[32.0] == 2 and counts[40.0] == 1
    assert counts[96.0] == 1 and counts[64.0] == 0  # empty buckets between are listed
    assert rows[-1] == [96.0, 1] and histogram([]) == []


def test_table_has_perftest_layout_and_an_ascii_histogram():
    config = LatConfig(test="send", iters=3, histogram=True)
    result = {"size": 2, "iterations": 3, "warmup": 8, "verified": True, "fw_version": "230.0.150.0", "packets": 44,
              "retransmits": 0, "dropped": 0, "seconds": 0.1, **summarize([10.0, 12.0, 30.0]),
              "histogram": histogram([10.0, 12.0, 30.0])}
    lines = format_latency_table(result, config).splitlines()
    header = lines.index(HEADER)
    row = lines[header + 1]
    assert row.split() == ["2", "3", "10.00", "30.00", "12.00", "17.33", "8.99", "30.00", "30.00"]
    assert "Send Latency Test" in lines[1] and "one-way = RTT/2" in "\n".join(lines)
    assert lines.index(" Max inline data : 0[B]") < header and lines[header + 2] == "-" * 87
    bars = [line for line in lines if line.startswith(" [")]
    assert sum(int(line.split(")")[1].split()[0]) for line in bars) == 3
    assert max(line.count("#") for line in bars) == 50
    assert "latency histogram" not in format_latency_table(result, dataclasses.replace(config, histogram=False))


@pytest.mark.anyio
async def test_two_runs_at_once_then_one_cancelled_from_outside_leaves_no_emulator():
    """Two latency runs in one event loop each get their own NICs; a third, cancelled mid-run from outside, closes
    its NICs on the way out (no emulator process of this driver is left)."""
    import os

    import anyio

    results = []

    async def one(test):
        results.append(await run_latency(LatConfig(test=test, iters=ITERS, size=64)))

    async with anyio.create_task_group() as tasks:
        tasks.start_soon(one, "write")
        tasks.start_soon(one, "send")
    assert len(results) == 2 and all(result["verified"] for result in results)
    with anyio.move_on_after(1.5) as scope:  # 200000 iterations take far longer
        await run_latency(LatConfig(test="write", iters=200_000))
    assert scope.cancelled_caught
    await assert_no_leftovers(drivers=[os.getpid()])
