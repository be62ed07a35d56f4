"""PHY loopback (`aiofabric loopback`): one NIC's port turned back on itself, an RDMA WRITE between two of its QPs."""
import anyio
import pytest

from aiofabric import perftest

pytestmark = pytest.mark.anyio


async def test_loopback_moves_megabytes_verified():
    result = await perftest.run_loopback("sim", 8 << 20)
    assert result["verified"] and result["bytes"] == 8 << 20 and result["packets"] >= (8 << 20) // 4096


async def test_loopback_time_limit_grows_with_the_size_and_says_what_timed_out(monkeypatch):
    monkeypatch.setattr(perftest, "LOOPBACK_BASE_SECONDS", 0.0)
    monkeypatch.setattr(perftest, "LOOPBACK_SLOWEST_BPS", 1 << 40)  # a limit far below what any transfer needs
    with anyio.fail_after(30), pytest.raises(TimeoutError, match=r"PHY loopback: the 4194304-byte RDMA WRITE did "
                                                               r"not complete within 0 s"):
        await perftest.run_loopback("sim", 4 << 20)
