"""The endpoint's operations: the objects one client created, by handle, and the handler of each op.

Each `op_<name>` method runs one request of `aiofabric.peer.operations`' OPS (its arguments already checked) on the
public driver API and returns the answer's result; whatever it raises becomes the error answer. The session around
it (reading requests, answering, limits, the end of input) is `aiofabric.peer.serve`'s.
"""
from __future__ import annotations

import inspect
import logging
import os
from typing import Any, Callable

import anyio
import anyio.abc
import numpy

from . import pingpong, protocol
from .policy import ServerPolicy, unmapped
from ..errors import LimitError, NotAllowed
from ..verbs import (ALL_ACCESS, ATOMIC_ACCESS, NIC, CompletionQueue, DmaBudget, MemoryRegion, QPInfo, QueuePair,
                     RemoteRegion, open_nic, silence)

log = logging.getLogger("aiofabric.serve")
OnReport = Callable[[dict[str, Any], str], Any]  # on_report(result, client): a report's escaped result; may be async


class _NicSlot:
    """An open NIC lives in its own task (open_nic's block must be left by the task that entered it)."""

    def __init__(self, spec: str = "") -> None:
        self.spec = spec
        self.nic: NIC | None = None
        self.error: str | None = None  # why it failed after it opened (its block ended with an error)
        self.close_requested = anyio.Event()
        self.closed = anyio.Event()


class _Pong:
    """The server half of a latency ping-pong running in the endpoint (op pong), until pong_wait collects it."""

    def __init__(self) -> None:
        self.done = anyio.Event()
        self.scope = anyio.CancelScope()  # close cancels it
        self.error: Exception | None = None
        self.iterations = 0

    async def run(self, side: pingpong.Side) -> None:
        try:
            with self.scope:
                await pingpong.server(side)
                self.iterations = side.iters
            if self.scope.cancelled_caught:
                self.error = ValueError("pong: closed before it ended")
        except Exception as exc:  # pong_wait answers with it; it never ends the endpoint
            self.error = exc
        finally:
            self.done.set()


class Endpoint:
    """The objects one client created, by handle, and the operations on them. With a `policy` (an unauthenticated
    client at `client_ip`) NICs are the server's choice, their DMA memory is capped, and QPs connect only to the
    client."""

    def __init__(self, tasks: anyio.abc.TaskGroup, *, on_report: OnReport | None = None,
                 connection_ip: str | None = None, summary: dict[str, Any] | None = None,
                 policy: ServerPolicy | None = None, client_ip: str | None = None) -> None:
        self.tasks = tasks
        self.on_report, self.connection_ip = on_report, connection_ip
        self.summary = summary if summary is not None else {}
        self.policy, self.client_ip = policy, client_ip
        self.budget = (DmaBudget(policy.limits.memory, "server's limit per client (--max-memory)")
                       if policy is not None else None)
        self._opening = 0  # open_nic requests under way
        self._starting_pong = False  # a pong request under way (its receives being posted)
        self._reporting = 0  # report requests under way
        self.objects: dict[int, Any] = {}  # handle -> _NicSlot | CompletionQueue | QueuePair | MemoryRegion
        self.owner: dict[int, int] = {}  # handle -> handle of its NIC
        self._next_handle = 1

    def _add(self, obj: Any, nic: int | None = None) -> int:
        handle, self._next_handle = self._next_handle, self._next_handle + 1
        self.objects[handle] = obj
        if nic is not None:
            self.owner[handle] = nic
        return handle

    def _get(self, handle: int, kind: type, field: str) -> Any:
        obj = self.objects.get(handle)
        if isinstance(obj, _NicSlot) and kind is NIC:
            return obj.nic
        if not isinstance(obj, kind):
            raise ValueError(f"{field}: no {kind.__name__} with handle {handle}")
        return obj

    async def handle(self, request: protocol.Request) -> dict[str, Any]:
        return await getattr(self, f"op_{request.op}")(**request.args)

    async def op_ping(self) -> dict[str, Any]:
        return {"pid": os.getpid()}

    async def op_open_nic(self, spec: str = "sim", ip: str | None = None,
                          options: dict[str, Any] | None = None) -> dict[str, Any]:
        options = dict(options or {})
        if self.policy is not None:  # the server's NIC, address and capture file; the client's test faults
            open_nics = self._opening + sum(isinstance(obj, _NicSlot) for obj in self.objects.values())
            if open_nics >= self.policy.limits.nics:
                raise LimitError(f"open_nic: this client has {open_nics} NIC(s) open or opening, the server's "
                                 "limit (--max-nics): close one first")
            spec, ip = self.policy.nic, self.policy.ip or self._reached_address(self.policy.nic)
            options.update(self.policy.nic_options())
        elif ip == "ssh":  # the address the client's SSH connection reached: this host's address on that network
            try:
                ip = os.environ["SSH_CONNECTION"].split()[2]
            except (KeyError, IndexError):
                raise ValueError("open_nic: ip 'ssh' needs SSH_CONNECTION (set by sshd); this endpoint was not "
                                 "started over SSH (over TCP, use ip 'connection')") from None
        elif ip == "connection":  # the address the client's connection reached, whatever the carrier
            ssh = os.environ.get("SSH_CONNECTION", "").split()
            ip = self.connection_ip or (ssh[2] if len(ssh) > 2 else None)
            if ip is None:
                raise ValueError("open_nic: ip 'connection': this endpoint does not know the address its client "
                                 "reached (it runs neither over TCP nor over SSH)")
        slot = _NicSlot(spec)
        self._opening += 1  # counted from here: several opens at once cannot pass the limit together
        try:
            await self.tasks.start(self._run_nic, slot, spec, ip, options)
        finally:
            self._opening -= 1
        nic = slot.nic
        assert nic is not None
        info = nic.info()
        return {"nic": self._add(slot), "ip": info["ip"], "gid": info["gid"], "mac": info["mac"]}

    def _reached_address(self, spec: str) -> str | None:
        """The address the client's connection reached, for the server's NIC; None (a free 127.0.0.x) for an
        emulated NIC reached over loopback, where every server on the host would otherwise want 127.0.0.1."""
        reached = self.connection_ip
        if reached is not None and spec.startswith("sim") and unmapped(reached).is_loopback:
            return None
        return reached

    async def _run_nic(self, slot: _NicSlot, spec: str, ip: str | None, options: dict[str, Any],
                       *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        started = False
        try:
            async with open_nic(spec, ip=ip, dma_budget=self.budget, **options) as nic:
                slot.nic = nic
                task_status.started()
                started = True
                await slot.close_requested.wait()
        except Exception as exc:
            if not started:
                raise  # the open_nic request answers with it
            slot.error = f"{type(exc).__name__}: {' '.join(str(exc).split())}"
            log.warning("NIC %s failed: %s", spec, exc)
        finally:
            slot.closed.set()

    async def op_create_cq(self, nic: int, depth: int) -> dict[str, Any]:
        cq = await self._get(nic, NIC, "nic").create_cq(depth)
        return {"cq": self._add(cq, nic)}

    async def op_create_qp(self, nic: int, cq: int, sq_depth: int, rq_depth: int,
                           max_inline_data: int) -> dict[str, Any]:
        queue = self._get(cq, CompletionQueue, "cq")
        qp = await self._get(nic, NIC, "nic").create_qp(queue, sq_depth=sq_depth, rq_depth=rq_depth,
                                                        max_inline_data=max_inline_data)
        return {"qp": self._add(qp, nic), "info": qp.info().to_dict()}

    async def op_register_mr(self, nic: int, size: int, atomic: bool) -> dict[str, Any]:
        mr = await self._get(nic, NIC, "nic").register_mr(size, ATOMIC_ACCESS if atomic else ALL_ACCESS)
        return {"mr": self._add(mr, nic), "region": mr.remote().to_dict()}

    def _range(self, mr: int, offset: int, length: int | None) -> memoryview:
        region = self._get(mr, MemoryRegion, "mr")
        length = region.length - offset if length is None else length
        if offset + length > region.length or length < 0:
            raise ValueError(f"{length} bytes at offset {offset} exceed the {region.length}-byte memory region")
        return region.view[offset:offset + length]

    async def op_fill(self, mr: int, seed: int | None, byte: int, offset: int, length: int | None) -> dict[str, Any]:
        view = self._range(mr, offset, length)
        if seed is not None:
            protocol.fill_pattern(view, seed)
        elif not 0 <= byte <= 255:
            raise ValueError(f"fill: byte must be in [0, 255], not {byte}")
        else:
            numpy.frombuffer(view, numpy.uint8)[:] = byte  # in place: no copy the size of the range
        return {"sha256": protocol.sha256_hex(view)}

    async def op_sha256(self, mr: int, offset: int, length: int | None) -> dict[str, Any]:
        return {"sha256": protocol.sha256_hex(self._range(mr, offset, length))}

    async def op_connect_qp(self, qp: int, peer: dict[str, Any], mtu: int, timeout: int,
                            retry_cnt: int, atomic: bool) -> dict[str, Any]:
        queue_pair = self._get(qp, QueuePair, "qp")
        if self.policy is not None:
            self.policy.check_peer(peer["gid"], self.client_ip or "")
        if atomic:
            await queue_pair.to_init(ATOMIC_ACCESS)
        await queue_pair.connect(QPInfo.from_dict(peer), mtu=mtu, timeout=timeout, retry_cnt=retry_cnt)
        return {"state": queue_pair.state.name}

    async def op_post(self, qp: int, verb: str, mr: int, size: int | None, local_offset: int,
                      remote: dict[str, Any] | None, remote_offset: int, imm: int | None,
                      deadline: float | None) -> dict[str, Any]:
        queue_pair, local = self._get(qp, QueuePair, "qp"), self._get(mr, MemoryRegion, "mr")
        with anyio.fail_after(deadline):
            if verb in ("send", "recv"):
                options = {"imm": imm} if verb == "send" else {}
                completion = await getattr(queue_pair, verb)(local, size, local_offset=local_offset, **options)
            else:
                target = RemoteRegion.from_dict(remote or {})
                extra = (imm,) if verb == "write_with_imm" else ()
                completion = await getattr(queue_pair, verb)(local, target, *extra, size, local_offset=local_offset,
                                                             remote_offset=remote_offset)
        return {"byte_len": completion.byte_len, "imm": completion.imm}

    async def op_post_recvs(self, qp: int, mr: int, count: int, size: int, offset: int,
                            stride: int | None) -> dict[str, Any]:
        queue_pair, local = self._get(qp, QueuePair, "qp"), self._get(mr, MemoryRegion, "mr")
        step = size if stride is None else stride
        for i in range(count):  # each waits for receive-queue space, never overwrites; failures show at the sender
            await queue_pair.post_recv(local, size, local_offset=offset + i * step)
        return {"posted": count}

    async def op_close(self, handle: int) -> dict[str, Any]:
        obj = self.objects.get(handle)
        if obj is None:
            raise ValueError(f"close: no object with handle {handle}")
        if isinstance(obj, _NicSlot):
            obj.close_requested.set()
            with anyio.fail_after(30):
                await obj.closed.wait()
            for child in [h for h, owner in self.owner.items() if owner == handle]:
                self.objects.pop(child, None)
                self.owner.pop(child, None)
        elif isinstance(obj, (QueuePair, CompletionQueue)):
            await obj.destroy()
        elif isinstance(obj, _Pong):
            obj.scope.cancel()
            await obj.done.wait()
        else:
            await obj.deregister()
        self.objects.pop(handle, None)
        self.owner.pop(handle, None)
        return {"closed": handle}

    async def op_nic_status(self, nic: int, probe: float) -> dict[str, Any]:
        slot = self.objects.get(nic)
        if not isinstance(slot, _NicSlot):
            raise ValueError(f"nic: no NIC with handle {nic}")
        if slot.nic is None:
            return {"nic": slot.spec, "stopped": slot.error or "it is not open"}
        name = slot.nic.pci.address
        if slot.error is not None or slot.closed.is_set():
            return {"nic": name, "stopped": slot.error or "its session ended"}
        return {"nic": name, "stopped": await silence(slot.nic, probe)}

    async def op_lat_params(self, test: str, size: int, mtu: int, iters: int, warmup: int) -> dict[str, Any]:
        if self.policy is not None:
            self.policy.check_params({"test": test, "size": size, "mtu": mtu})
        return {"test": test, "size": size, "mtu": mtu, **(self.policy.expect if self.policy else {})}

    async def op_bench_params(self, params: dict[str, Any]) -> dict[str, Any]:
        if self.policy is not None:
            self.policy.check_params(params)
        return self.policy.expect if self.policy else params

    async def op_pong(self, qp: int, mr: int, test: str, size: int, iters: int, wait: float, warmup: int,
                      remote: dict[str, Any] | None, rx_slots: int, inline: bool) -> dict[str, Any]:
        # one server half per client at a time: each is a background task polling a QP until its wait runs out
        if self.policy is not None and (self._starting_pong or any(isinstance(obj, _Pong)
                                                                   for obj in self.objects.values())):
            raise NotAllowed("pong: a ping-pong is already running for this client: pong_wait for it first")
        queue_pair = self._get(qp, QueuePair, "qp")
        if rx_slots > queue_pair.recv_queue.depth:
            raise ValueError(f"pong: {rx_slots} receive slots exceed the QP's receive queue "
                             f"({queue_pair.recv_queue.depth})")
        side = pingpong.Side("server", test, queue_pair, self._get(mr, MemoryRegion, "mr"), size, warmup, iters, wait,
                             None if remote is None else RemoteRegion.from_dict(remote), rx_slots, inline)
        self._starting_pong = True  # from here: two pongs at once cannot both pass the check above
        try:
            with anyio.fail_after(wait):  # posting the receives waits for room only as long as a ping may take
                await side.prepare()
            pong = _Pong()
            self.tasks.start_soon(pong.run, side)
            return {"pong": self._add(pong, self.owner.get(qp))}
        finally:
            self._starting_pong = False

    async def op_pong_wait(self, pong: int) -> dict[str, Any]:
        running = self._get(pong, _Pong, "pong")
        await running.done.wait()
        self.objects.pop(pong, None)
        self.owner.pop(pong, None)
        if running.error is not None:
            raise running.error
        return {"iterations": running.iterations}

    async def op_report(self, result: dict[str, Any]) -> dict[str, Any]:
        # each is printed on the server; a report the server refused (on_report raised) is not counted
        if self.policy is not None and self.summary.get("reports", 0) + self._reporting >= 1:
            raise NotAllowed("report: a client reports its run once")
        self._reporting += 1
        try:
            result = protocol.printable_tree(result)  # whoever shows it shows text, never the client's escape codes
            if self.on_report is None:
                log.info("the client reported: %s", result)
            else:
                outcome = self.on_report(result, self.summary.get("client", ""))
                if inspect.isawaitable(outcome):
                    await outcome
        finally:
            self._reporting -= 1
        self.summary["reports"] = self.summary.get("reports", 0) + 1
        return {"reported": True}

    async def close_all(self) -> None:
        for pong in [obj for obj in self.objects.values() if isinstance(obj, _Pong)]:
            pong.scope.cancel()  # a server half would otherwise poll for pings until its wait ran out
        for slot in [obj for obj in self.objects.values() if isinstance(obj, _NicSlot)]:
            slot.close_requested.set()
        for slot in [obj for obj in self.objects.values() if isinstance(obj, _NicSlot)]:
            await slot.closed.wait()
        self.objects.clear()
        self.owner.clear()
