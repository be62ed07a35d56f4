"""Many QPs on two NICs, all driven from one event loop: each QP streams RDMA WRITEs, then bytes are verified.

    python examples/multi_qp.py [--qps 32] [--writes 200] [--size 4096] [--backend asyncio|trio]
"""
import argparse
import random
import time

import anyio

import aiofabric


async def main(qps: int, writes: int, size: int) -> None:
    async with aiofabric.open_nic("sim:left") as left, aiofabric.open_nic("sim:right") as right:
        cq_left, cq_right = await left.create_cq(4096), await right.create_cq(4096)
        source = await left.register_mr(qps * size)
        target = await right.register_mr(qps * size)
        source.view[:] = random.randbytes(qps * size)
        pairs = []
        for _ in range(qps):
            a = await left.create_qp(cq_left, sq_depth=32)
            b = await right.create_qp(cq_right, sq_depth=32)
            await a.connect(b.info())
            await b.connect(a.info())
            pairs.append(a)

        async def stream(qp, offset):
            # keep up to 16 writes in flight; only every 8th is signaled, the rest retire with it
            in_flight = []
            for i in range(writes):
                in_flight.append(await qp.post_write(source, target, size, local_offset=offset,
                                                     remote_offset=offset, signaled=i % 8 == 7 or i == writes - 1))
                if len(in_flight) >= 16:
                    await in_flight.pop(0)
            for completion in in_flight:
                await completion

        started = time.perf_counter()
        async with anyio.create_task_group() as tasks:
            for i, qp in enumerate(pairs):
                tasks.start_soon(stream, qp, i * size)
        elapsed = time.perf_counter() - started
        assert bytes(target.view) == bytes(source.view), "destination differs"
        total = qps * writes
        print(f"{qps} QPs x {writes} writes of {size} B from one event loop: {elapsed:.2f} s, "
              f"{total / elapsed:,.0f} writes/s, {total * size / elapsed / 2**20:.1f} MiB/s, verified")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--qps", type=int, default=32)
    parser.add_argument("--writes", type=int, default=200)
    parser.add_argument("--size", type=int, default=4096)
    parser.add_argument("--backend", default="asyncio", choices=("asyncio", "trio"))
    args = parser.parse_args()
    anyio.run(main, args.qps, args.writes, args.size, backend=args.backend)
