"""The PHY-loopback test of the synchronous driver this project grew from, async: one NIC, two QPs, port in local loopback, one verified RDMA WRITE.

    python examples/loopback.py [--nic sim|0000:41:00.0] [--ip 10.0.200.5]
"""
import argparse

import anyio

import aiofabric
from aiofabric.autogen import bnxt


async def main(spec: str, ip: str | None) -> None:
    async with aiofabric.open_nic(spec, ip=ip) as nic:
        print(f"[init] {nic.pci.address}: firmware {nic.fw_version}, MAC {nic.mac}, GID ::ffff:{nic.ip}")
        cq = await nic.create_cq(depth=64)
        tx, rx = await nic.create_qp(cq), await nic.create_qp(cq)
        await tx.connect(rx.info())
        await rx.connect(tx.info())
        print(f"[init] loopback-connected TX QP {tx.qpn:#x} <-> RX QP {rx.qpn:#x}")

        message = b"Hello from BNXT RoCE PHY loopback!"
        source, target = await nic.register_mr(4096), await nic.register_mr(4096)
        source.view[:len(message)] = message
        await nic.set_loopback(bnxt.PORT_PHY_CFG_REQ_LPBK_LOCAL)
        try:
            with anyio.fail_after(10):
                await tx.write(source, target, len(message))
        finally:
            await nic.set_loopback(bnxt.PORT_PHY_CFG_REQ_LPBK_NONE)
        got = bytes(target.view[:len(message)])
        print(f"[result] {got!r}")
        assert got == message, "loopback data differs"
        print("BNXT RoCE PHY loopback RDMA WRITE passed")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nic", default="sim")
    parser.add_argument("--ip")
    args = parser.parse_args()
    anyio.run(main, args.nic, args.ip)
