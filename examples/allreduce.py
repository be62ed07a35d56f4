"""A data-parallel step on a ring of RDMA NICs: each rank computes gradients with a kernel, an allreduce sums them
across the ranks, and a kernel applies the mean, all three in one compiled batch per rank, replayed step after step
with new data. Every step's result is checked against numpy.

    python examples/allreduce.py [--ranks 4] [--size 100000] [--steps 5]     # the ranks in this process
    torchrun --nproc-per-node 3 examples/allreduce.py                        # one rank per process
"""
import argparse
import functools
import os

import anyio
import numpy as np

from aiofabric import collectives, sched


def step_batch(comm, params, data, grads):
    """grads = 2 * data (this rank's gradient), summed over the ranks in place, then params -= lr * mean."""
    compute = sched.ComputeQueue(f"rank {comm.rank} compute")
    return sched.compile([
        sched.kernel(lambda g, d: np.multiply(d, 2.0, out=g), [grads], [data], queue=compute, name="gradients"),
        *comm.calls("allreduce", grads),
        sched.kernel(lambda p, g: np.subtract(p, 0.1 * g / comm.size, out=p), [params], [grads], queue=compute,
                     name="update"),
    ], inputs={"data": data})


async def run_rank(comm, size, steps, check_data):
    params, grads = np.zeros(size), np.zeros(size)
    batch = step_batch(comm, params, np.zeros(size), grads)
    expected = np.zeros(size)
    for step in range(steps):
        data = check_data(step, comm.rank)
        await batch.run({"data": data}, timeout=60)
        expected -= 0.1 * sum(2.0 * check_data(step, r) for r in range(comm.size)) / comm.size
    assert np.allclose(params, expected), f"rank {comm.rank}: parameters differ from numpy's"
    return float(np.abs(params).mean())


def data_of(step, rank, size):
    return np.random.default_rng(1000 * step + rank).standard_normal(size)


async def main(ranks, size, steps):
    check_data = functools.partial(data_of, size=size)
    world = collectives.from_environment(os.environ)
    if world is not None:  # started by torchrun, mpirun or srun: this process is one rank
        async with collectives.join(world, buffer_bytes=size * 8) as comm:
            mean = await run_rank(comm, size, steps, check_data)
            print(f"rank {comm.rank} of {comm.size}: {steps} steps verified (mean |param| {mean:.4f})")
        return
    async with collectives.local(ranks, buffer_bytes=size * 8) as comms:
        means = await collectives.run_ranks([functools.partial(run_rank, comm, size, steps, check_data)
                                             for comm in comms])
        print(f"{ranks} ranks, {steps} steps of {size} float64: verified (mean |param| {means[0]:.4f})")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--size", type=int, default=100_000)
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()
    anyio.run(main, args.ranks, args.size, args.steps)
