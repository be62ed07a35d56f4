"""Soak: many mixed RDMA operations over a faulty wire, every byte and every completion checked.

    python bench/soak.py [--ops 100000] [--qps 16] [--nics 4] [--depth 16] [--mtu 4096] [--timeout 12]
                         [--loss 0.05] [--reorder 0.02] [--dup 0.01] [--corrupt 0.01] [--seed 1]
                         [--backend asyncio] [--json]

Each QP runs a seeded random sequence of WRITE, WRITE_WITH_IMM, READ and SEND of 0 B .. 64 KiB. Every operation
moves its own random payload through its own slot of the QP's buffers, and is checked when it completes:
- its bytes, at its own offset, on the side that received them (the target for WRITE/SEND, the source for READ);
- a receive it consumed (SEND, WRITE_WITH_IMM) completed with its length and immediate data;
- completions arrive exactly once and in order per QP: when operation k completes, every earlier one has;
- at the end, the emulator's per-QP placement counts (debug "placed") equal what was posted: nothing placed twice.
Receives race their SENDs: a separate task posts them after random delays, so some SENDs meet RNR NAKs and retry.
Prints the run's time and wire counters (retransmits, RNR NAKs, drops); exits 1 on the first wrong byte.
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import json
import random
import sys
import time
from typing import Any, AsyncIterator

import anyio

import aiofabric

if sys.version_info < (3, 11):
    from exceptiongroup import BaseExceptionGroup

MAX_SIZE = 64 << 10
VERBS = ("write", "write_with_imm", "read", "send")
SIZES = (0, 1, 7, 64, 1000, 4096, 4097, 12345, 32768, MAX_SIZE)  # edges of MTU segmentation and padding, and random


@dataclasses.dataclass
class Op:
    index: int
    verb: str
    size: int
    slot: int
    payload: bytes
    completion: Any = None
    receive: Any = None


class SoakError(AssertionError):
    """An operation's bytes, length, immediate or completion order was wrong."""


async def _receiver(qp: aiofabric.QueuePair, target: aiofabric.MemoryRegion, ops: Any, rng: random.Random) -> None:
    """Post each receive-consuming operation's receive, in posting order, after a random delay (racing its SEND)."""
    async with ops:
        async for op in ops:
            if rng.random() < 0.3:
                await anyio.sleep(rng.uniform(0, 0.002))
            op.receive = await qp.post_recv(target, MAX_SIZE, local_offset=op.slot)


async def _run_qp(number: int, client: aiofabric.QueuePair, server: aiofabric.QueuePair,
                  source: aiofabric.MemoryRegion, target: aiofabric.MemoryRegion, count: int, depth: int, seed: int,
                  totals: collections.Counter) -> None:
    rng = random.Random(seed * 1_000_003 + number)
    receives_in, receives_out = anyio.create_memory_object_stream(count)
    pending: collections.deque[Op] = collections.deque()
    async with anyio.create_task_group() as tasks:
        tasks.start_soon(_receiver, server, target, receives_out, random.Random(rng.random()))
        for index in range(count + depth):
            if len(pending) == depth or (index >= count and pending):
                await _complete(pending.popleft(), pending, source, target, totals)
            if index >= count:
                continue
            verb = rng.choice(VERBS)
            size = rng.choice(SIZES) if rng.random() < 0.5 else rng.randrange(MAX_SIZE + 1)
            op = Op(index, verb, size, (index % depth) * MAX_SIZE, rng.randbytes(size))
            if verb in ("send", "write_with_imm"):
                await receives_in.send(op)  # its receive, posted by _receiver when it gets to it
            if verb == "read":
                target.view[op.slot:op.slot + size] = op.payload
                op.completion = await client.post_read(source, target, size, local_offset=op.slot,
                                                       remote_offset=op.slot)
            else:
                source.view[op.slot:op.slot + size] = op.payload
                if verb == "write":
                    op.completion = await client.post_write(source, target, size, local_offset=op.slot,
                                                            remote_offset=op.slot)
                elif verb == "write_with_imm":
                    op.completion = await client.post_write_with_imm(source, target, index, size,
                                                                     local_offset=op.slot, remote_offset=op.slot)
                else:
                    op.completion = await client.post_send(source, size, local_offset=op.slot, imm=index)
            pending.append(op)
        receives_in.close()


async def _complete(op: Op, later: collections.deque[Op], source: aiofabric.MemoryRegion,
                    target: aiofabric.MemoryRegion, totals: collections.Counter) -> None:
    await op.completion
    done = [other.completion.done for other in later]
    if any(b and not a for a, b in zip(done, done[1:])):  # RC: what has completed is always a prefix
        raise SoakError(f"after op {op.index}, a work request completed before an earlier one")
    if op.verb in ("send", "write_with_imm"):
        with anyio.fail_after(30):
            while op.receive is None:  # the racing receiver has not posted it yet: the NIC had to, to complete op
                await anyio.sleep(0.001)
            received = await op.receive
        if received.byte_len != op.size or received.imm != op.index:
            raise SoakError(f"op {op.index} ({op.verb}): receive completed with {received.byte_len} bytes, imm "
                            f"{received.imm}; expected {op.size}, {op.index}")
    landed = (source if op.verb == "read" else target).view[op.slot:op.slot + op.size]
    if landed != op.payload:
        first = next(i for i in range(op.size) if landed[i] != op.payload[i])
        raise SoakError(f"op {op.index} ({op.verb}, {op.size} B): byte {first} differs at its own offset")
    placed = "read" if op.verb == "read" else "send" if op.verb == "send" else "write"
    totals[f"{placed}_messages"] += 1
    totals[f"{placed}_bytes"] += op.size


async def soak(ops: int = 100_000, qps: int = 16, nics: int = 4, depth: int = 16, loss: float = 0.05,
               reorder: float = 0.02, dup: float = 0.01, corrupt: float = 0.01, seed: int = 1,
               timeout: int = 12, mtu: int = 4096, inject_fault: str | None = None) -> dict[str, Any]:
    """Run the soak; return its summary, or raise SoakError naming the first wrong operation.

    `inject_fault` ("skip_placement:N" or "misplace:N:OFFSET") makes the responders misbehave: the soak must fail."""
    faults = {"loss": loss, "reorder": reorder, "dup": dup, "corrupt": corrupt}
    async with _open_nics(nics, faults, seed) as cards:
        if inject_fault:
            kind, count, *offset = inject_fault.split(":")
            for card in cards[1::2]:
                card.pci.debug({"op": "fault", "kind": kind, "count": int(count), "offset": int(*offset or [64])})
        flows = []
        for number in range(qps):
            a, b = cards[2 * (number % (nics // 2))], cards[2 * (number % (nics // 2)) + 1]
            cq_a, cq_b = await a.create_cq(depth=4 * depth), await b.create_cq(depth=4 * depth)
            client = await a.create_qp(cq_a, sq_depth=depth, rq_depth=depth)
            server = await b.create_qp(cq_b, sq_depth=depth, rq_depth=depth)
            await client.connect(server.info(), mtu=mtu, timeout=timeout)
            await server.connect(client.info(), mtu=mtu, timeout=timeout)
            flows.append((client, server, await a.register_mr(depth * MAX_SIZE), await b.register_mr(depth * MAX_SIZE)))
        totals = [collections.Counter() for _ in flows]
        started = time.perf_counter()
        async with anyio.create_task_group() as tasks:
            for number, (client, server, source, target) in enumerate(flows):
                share = ops // qps + (number < ops % qps)
                tasks.start_soon(_run_qp, number, client, server, source, target, share, depth, seed,
                                 totals[number])
        seconds = time.perf_counter() - started
        for (client, server, _, _), expected in zip(flows, totals):
            _check_placed(client, server, expected)
        stats = [card.pci.debug({"op": "stats"})["stats"] for card in cards]
    wire = {key: sum(s.get(key, 0) for s in stats) for key in
            ("packets_sent", "retransmits", "rnr_naks", "naks", "timeouts", "duplicates", "dropped", "dropped_icrc",
             "wire_lost", "wire_duplicated", "wire_reordered", "wire_corrupted")}
    verbs = collections.Counter()
    for expected in totals:
        verbs.update({k: v for k, v in expected.items() if k.endswith("_messages")})
    return {"ok": True, "ops": ops, "qps": qps, "nics": nics, "depth": depth, "mtu": mtu, **faults, "seed": seed,
            "seconds": seconds, "ops_per_second": ops / seconds, "messages": dict(verbs), **wire}


def _check_placed(client: aiofabric.QueuePair, server: aiofabric.QueuePair, expected: collections.Counter) -> None:
    """The emulator placed each message exactly once: its per-QP counts equal what completed here."""
    for qp, kinds in ((server, ("write", "send")), (client, ("read",))):
        counts = qp.device.pci.debug({"op": "placed"})["qps"].get(str(qp.qpn), {})
        for kind in kinds:
            for unit in ("messages", "bytes"):
                key = f"{kind}_{unit}"
                if counts.get(key, 0) != expected[key]:
                    raise SoakError(f"QP {qp.qpn:#x}: the NIC placed {counts.get(key, 0)} {key.replace('_', ' ')}, "
                                    f"{expected[key]} completed")


@contextlib.asynccontextmanager
async def _open_nics(count: int, faults: dict[str, float], seed: int) -> AsyncIterator[list[aiofabric.NIC]]:
    async with contextlib.AsyncExitStack() as stack:
        yield [await stack.enter_async_context(aiofabric.open_nic(**faults, seed=seed + i)) for i in range(count)]


def _first_leaf(error: BaseException) -> BaseException:
    """The first exception inside nested exception groups (each QP runs in its own task)."""
    while isinstance(error, BaseExceptionGroup):
        error = error.exceptions[0]
    return error


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    for name, kind, default in (("ops", int, 100_000), ("qps", int, 16), ("nics", int, 4), ("depth", int, 16),
                                ("loss", float, 0.05), ("reorder", float, 0.02), ("dup", float, 0.01),
                                ("corrupt", float, 0.01), ("seed", int, 1), ("timeout", int, 12),
                                ("mtu", int, 4096)):
        parser.add_argument(f"--{name}", type=kind, default=default)
    parser.add_argument("--inject-fault", metavar="KIND:N[:OFFSET]", help="make the responders misbehave (a check)")
    parser.add_argument("--backend", choices=("asyncio", "uvloop", "trio"), default="asyncio")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args()
    options = {k: v for k, v in vars(args).items() if k not in ("backend", "json")}
    backend, backend_options = ("asyncio", {"use_uvloop": True}) if args.backend == "uvloop" else (args.backend, {})
    try:
        result = anyio.run(lambda: soak(**options), backend=backend, backend_options=backend_options)
    except BaseException as exc:  # a wrong byte, or a work request that failed outright (several QPs may at once)
        first = _first_leaf(exc)
        if not isinstance(first, (SoakError, aiofabric.FabricError)):
            raise
        result = {"ok": False, "error": f"{type(first).__name__}: {first}"}
    print(json.dumps(result) if args.json else "\n".join(f"{k:>16}: {v}" for k, v in result.items()))
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
