"""PHY loopback (`aiofabric loopback`): one NIC's port turned back on itself, an RDMA WRITE between two of its QPs."""
import anyio
import pytest

from aiofabric.tools import perftest

pytestmark = [pytest.mark.anyio, pytest.mark.loop_agnostic]


async def test_loopback_moves_megabytes_verified():
    result = await perftest.run_loopback("sim", 8 << 20)
    assert result["verified"] and result["bytes"] == 8 << 20 and result["packets"] >= (8 << 20) // 4096


async def test_loopback_time_limit_grows_with_the_size_and_says_what_timed_out(monkeypatch):
    # A limit of nothing: 1 s per 2^42 MiB alone. (At 1 s per MiB a 1-byte write had a microsecond, which uvloop's
    # millisecond timers round up to 1 ms: a write done in 0.8 ms escaped.)
    monkeypatch.setattr(perftest, "LOOPBACK_BASE_SECONDS", 0.0)
    monkeypatch.setattr(perftest, "LOOPBACK_SLOWEST_BPS", 1 << 62)
    with anyio.fail_after(30), pytest.raises(TimeoutError, match=r"PHY loopback: the 1-byte RDMA WRITE did not "
                                                               r"complete within 0 s \(allowed: 0 s \+ 1 s per "
                                                               r"4398046511104 MiB"):
        await perftest.run_loopback("sim", 1)
    monkeypatch.setattr(perftest, "LOOPBACK_SLOWEST_BPS", 1 << 20)  # back to 1 s per MiB, still no base
    # 16 s: far more than it takes (~1 s), even with the suite's other emulators busy on the same 2 cores (4 MiB
    # and 4 s timed out there once the collectives' tests ran beside it)
    result = await perftest.run_loopback("sim", 16 << 20)
    assert result["verified"] and result["seconds"] < 16
