"""A compiled batch across two emulated NICs: a C kernel scales x on NIC A's host, RDMA WRITE carries the result to
NIC B, a numpy kernel sums it there. Planned once, replayed with new inputs; every result is verified.

    python examples/batch.py [--size 65536] [--runs 3] [--backend asyncio|trio] [--trace run.json]
"""
import argparse

import anyio
import numpy as np

import aiofabric
from aiofabric import sched

SCALE = r"""
#include <stdint.h>
void scale(double *out, const double *in, int64_t n, double k) { for (int64_t i = 0; i < n; i++) out[i] = in[i] * k; }
"""


async def main(size: int, runs: int, trace: str | None) -> None:
    async with aiofabric.open_nic("sim") as a, aiofabric.open_nic("sim") as b:
        cq_a, cq_b = await a.create_cq(256), await b.create_cq(256)
        qa, qb = await a.create_qp(cq_a), await b.create_qp(cq_b)
        await qa.connect(qb.info())
        await qb.connect(qa.info())
        staging, landing = await a.register_mr(size * 8), await b.register_mr(size * 8)
        scaled = np.frombuffer(staging.view, np.float64)  # kernels write the MR's memory: no copy before the write
        arrived = np.frombuffer(landing.view, np.float64)
        x, total = np.zeros(size), np.zeros(1)
        on_a, on_b = sched.ComputeQueue("A compute"), sched.ComputeQueue("B compute")
        batch = sched.compile([
            sched.kernel(sched.CKernel(SCALE, "scale"), [scaled], [x], [size, 3.0], queue=on_a),
            sched.write(qa, staging, landing, name="write A->B"),  # landing is B's MR: the planner sees both ends
            sched.kernel(lambda out, v: out.fill(v.sum()), [total], [arrived], queue=on_b, name="sum on B"),
        ], inputs={"x": x})
        print(batch.describe())
        rng = np.random.default_rng(0)
        for run in range(runs):
            new_x = rng.random(size)
            with anyio.fail_after(30):
                await batch.run({"x": new_x})  # rebinds x; no planning
            assert np.allclose(total[0], 3.0 * new_x.sum()), f"run {run}: sum {total[0]} != {3.0 * new_x.sum()}"
            print(f"run {run}: sum of 3*x on NIC B = {total[0]:.3f}, verified")
        if trace:
            batch.trace(trace)
            print(f"Chrome trace of the last run in {trace}")
        print(f"{runs} runs of one compiled batch passed")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", type=int, default=1 << 16, help="elements of x (float64)")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--backend", default="asyncio", choices=("asyncio", "trio"))
    parser.add_argument("--trace", help="write the last run's Chrome trace JSON here")
    args = parser.parse_args()
    anyio.run(main, args.size, args.runs, args.trace, backend=args.backend)
