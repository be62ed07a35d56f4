"""The RC contract under a faulty wire: mixed verbs, every byte at its own offset, completions once and in order.

The short soak runs in CI; the 100,000-operation one is `slow` (python -m pytest -m slow). RNR: SENDs that arrive
before their receive wait through RNR NAKs; with rnr_retry=0 they fail with the verbs status.
"""
import json
import random
import subprocess
import sys

import anyio
import pytest

from aiofabric import CompletionError, open_nic
from tests.support import CHECKOUT

SOAK = [sys.executable, str(CHECKOUT / "bench" / "soak.py")]


def soak(*args, timeout):
    process = subprocess.run([*SOAK, *args, "--json"], capture_output=True, text=True, timeout=timeout)
    lines = process.stdout.strip().splitlines()
    return process.returncode, json.loads(lines[-1]) if lines else None, process


def test_short_soak_under_every_fault():
    code, result, process = soak("--ops", "2400", "--qps", "8", timeout=300)
    assert code == 0 and result["ok"], process.stdout[-2000:] + process.stderr[-4000:]
    assert sum(result["messages"].values()) == 2400
    assert result["retransmits"] > 0 and result["wire_lost"] > 0 and result["wire_corrupted"] > 0
    assert result["wire_duplicated"] > 0 and result["wire_reordered"] > 0


@pytest.mark.parametrize("fault", ["skip_placement:3", "misplace:3:4096"])
def test_soak_catches_a_nic_that_misplaces_data(fault):
    code, result, process = soak("--ops", "400", "--qps", "2", "--nics", "2", "--loss", "0", "--reorder", "0",
                                 "--dup", "0", "--corrupt", "0", "--inject-fault", fault, timeout=120)
    assert code == 1 and result["ok"] is False, process.stdout + process.stderr
    assert "differs at its own offset" in result["error"] or "the NIC placed" in result["error"]


@pytest.mark.slow
def test_soak_100k_operations():
    code, result, process = soak(timeout=3600)
    assert code == 0 and result["ok"], process.stdout[-2000:] + process.stderr[-4000:]
    assert sum(result["messages"].values()) == 100_000


@pytest.mark.anyio
@pytest.mark.parametrize("rnr_retry", [7, 0])
@pytest.mark.loop_agnostic
async def test_a_send_before_its_receive(rnr_retry):
    """Its first packet is refused with an RNR NAK; the two behind it are dropped without a NAK of their own."""
    async with open_nic() as a, open_nic() as b:
        cq_a, cq_b = await a.create_cq(depth=64), await b.create_cq(depth=64)
        qa, qb = await a.create_qp(cq_a), await b.create_qp(cq_b)
        await qa.connect(qb.info(), rnr_retry=rnr_retry, mtu=1024)
        await qb.connect(qa.info(), min_rnr_timer=1, mtu=1024)
        source, target = await a.register_mr(4096), await b.register_mr(4096)
        source.view[:] = random.Random(8).randbytes(4096)
        sent = await qa.post_send(source, 3000)  # three packets
        with anyio.fail_after(5):  # the SEND arrives first: the responder answers RNR NAK
            while not b.pci.debug({"op": "stats"})["stats"]["rnr_naks"]:
                await anyio.sleep(0.01)
        if rnr_retry == 0:
            with anyio.fail_after(5), pytest.raises(CompletionError, match="RNR_NAK_RETRY_CNT_ERR"):
                await sent
        else:
            received = await qb.post_recv(target, 4096)
            with anyio.fail_after(10):
                await sent
                assert (await received).byte_len == 3000
            assert bytes(target.view[:3000]) == bytes(source.view[:3000])
        stats = b.pci.debug({"op": "stats"})["stats"]
        assert stats["naks"] == stats["rnr_naks"]
