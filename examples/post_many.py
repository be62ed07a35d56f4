"""Posting many work requests per call (perftest's post list), scatter/gather lists and inline data, on two emulated
NICs; every byte is verified.

    python examples/post_many.py [--writes 4096] [--size 64] [--batch 32]

`qp.post_many` packs a whole batch into the send queue in one pass and rings one doorbell; only the work requests
you ask for (and the batch's last) get a completion, so the driver's CPU per write falls to about half of a
`post_write` each (bench/RESULTS.md, "The data path's CPU").
"""
import argparse
import time

import anyio

import aiofabric


async def main(writes: int, size: int, batch: int) -> None:
    async with aiofabric.open_nic("sim") as a, aiofabric.open_nic("sim") as b:
        cq_a, cq_b = await a.create_cq(1024), await b.create_cq(1024)
        qa = await a.create_qp(cq_a, sq_depth=4 * batch, max_send_sge=2, max_inline_data=a.caps["max_inline_data"])
        qb = await b.create_qp(cq_b)
        await qa.connect(qb.info())
        await qb.connect(qa.info())
        source, target = await a.register_mr(writes * size), await b.register_mr(writes * size)
        total = writes * size
        source.view[:total] = bytes(i * 7 % 251 for i in range(total))

        # 1. post lists: `batch` writes per call, one completion per batch, a few batches in flight
        started, cpu = time.perf_counter(), time.process_time()
        in_flight = []
        for first in range(0, writes, batch):
            offsets = range(first * size, min(writes, first + batch) * size, size)
            in_flight.append((await qa.post_many("write", source, target, size, offsets))[-1])
            if len(in_flight) > 2:
                await in_flight.pop(0)
        for completion in in_flight:
            await completion
        seconds, cpu = time.perf_counter() - started, time.process_time() - cpu
        assert bytes(target.view[:total]) == bytes(source.view[:total])
        print(f"{writes} writes of {size} B in batches of {batch}: {writes / seconds:,.0f} writes/s, "
              f"{cpu / writes * 1e6:.2f} us of driver CPU each (emulated NICs share this machine's cores)")

        # 2. a scatter/gather list: two pieces of the source become one message
        await qa.write([source.sge(0, 8), source.sge(size, 8)], target, remote_offset=0)
        assert bytes(target.view[:16]) == bytes(source.view[:8]) + bytes(source.view[size:size + 8])

        # 3. inline data: the bytes travel in the WQE, so the buffer is free again as soon as the post returns
        source.view[:4] = b"ping"
        posted = await qa.post_write(source, target, 4, inline=True)
        source.view[:4] = b"XXXX"
        await posted
        assert bytes(target.view[:4]) == b"ping"
        print("verified: post lists, an SGE list and inline data")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--writes", type=int, default=4096)
    parser.add_argument("--size", type=int, default=64)
    parser.add_argument("--batch", type=int, default=32)
    args = parser.parse_args()
    anyio.run(main, args.writes, args.size, args.batch)
