"""The scheduler: compiled batches of kernel, copy and RDMA calls over many in-order queues (docs/scheduler.md).

    batch = sched.compile([sched.kernel(...), sched.write(qp, ...), ...], inputs={"x": x})
    await batch.run({"x": new_x})          # replay with new inputs, no planning
    print(batch.describe()); batch.trace("run.json")

Modules: `plan` (pure planner), `calls` (queues and calls), `kernels` (C and numpy kernels, the 0-d/1-d rule),
`timeline` (awaitable counters, each device's timeline), `pool` (receive pools), `run` (compiled batches: `Batch`,
`compile`), `binding` (a batch's inputs, rebinding them, each call's prepared work), `workers` (the task that runs
each queue of a batch), `trace` (Chrome trace JSON), `reduce` (reduction kernels).
"""
from . import reduce  # sched.reduce.reduce(...), sched.reduce.reduction(...)
from .calls import (Call, ComputeQueue, CopyQueue, Scalar, copy, kernel, qp_name, read, recv, send, wait_imm, write,
                    write_with_imm)
from .kernels import CKernel, CompilerNotFoundError, KernelBuildError, flatten
from .pool import ReceivePool, receive_pool
from .run import Batch, BindingError, CallError, compile
from ..errors import BatchTimeoutError, ImmediateMismatchError

__all__ = ["Batch", "BatchTimeoutError", "BindingError", "CKernel", "Call", "CallError", "CompilerNotFoundError",
           "ComputeQueue", "CopyQueue", "ImmediateMismatchError", "KernelBuildError", "ReceivePool", "Scalar",
           "compile", "copy", "flatten", "kernel", "qp_name", "read", "receive_pool", "recv", "reduce", "send",
           "wait_imm", "write", "write_with_imm"]
