"""PHY loopback (`aiofabric loopback`): one NIC's port turned back on itself, an RDMA WRITE between two of its QPs."""
import anyio
import pytest

from aiofabric import perftest

pytestmark = [pytest.mark.anyio, pytest.mark.loop_agnostic]


async def test_loopback_moves_megabytes_verified():
    result = await perftest.run_loopback("sim", 8 << 20)
    assert result["verified"] and result["bytes"] == 8 << 20 and result["packets"] >= (8 << 20) // 4096


async def test_loopback_time_limit_grows_with_the_size_and_says_what_timed_out(monkeypatch):
    monkeypatch.setattr(perftest, "LOOPBACK_BASE_SECONDS", 0.0)  # the limit is 1 s per MiB alone
    with anyio.fail_after(30), pytest.raises(TimeoutError, match=r"PHY loopback: the 1-byte RDMA WRITE did not "
                                                               r"complete within 0 s \(allowed: 0 s \+ 1 s per 1 MiB"):
        await perftest.run_loopback("sim", 1)  # a microsecond: no write completes that fast
    # 16 s: far more than it takes (~1 s), even with the suite's other emulators busy on the same 2 cores (4 MiB
    # and 4 s timed out there once the collectives' tests ran beside it)
    result = await perftest.run_loopback("sim", 16 << 20)
    assert result["verified"] and result["seconds"] < 16
