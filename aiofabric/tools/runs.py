"""What bench's and lat's runs do alike around their loops: open the local NICs and wait for their links, fit the path
MTU to their ports, turn a port back on itself, and, after a failure, find what stopped (or whose link is down) and
release what is left within a bound."""
from __future__ import annotations

import contextlib
import functools
import itertools
import logging
import os
import sys
from typing import Any, AsyncIterator, Awaitable, Callable, Iterable

import anyio

if sys.version_info < (3, 11):
    from exceptiongroup import BaseExceptionGroup

from .options import PerftestOptions
from ..autogen import bnxt
from ..driver.close_budget import CLOSE_TIMEOUT
from ..driver.link import LINK_UP_TIMEOUT
from ..errors import FabricError, LinkDownError
from ..hw.verbs import ROCE_OVERHEAD, path_mtu_for_port
from ..verbs import NIC
from ..verbs import PROBE_SECONDS as FIRMWARE_PROBE_SECONDS
from ..verbs import open_nic, settle

log = logging.getLogger("aiofabric.tools.runs")
REMOTE_CLOSE_AFTER_FAILURE = 2.0  # seconds for a peer's objects after a failure: its connection's end frees them too
RELEASE_SECONDS = 30  # for a run's objects after it went well (shielded: a cancellation does not skip it)

_runs_started = itertools.count()


class NICStoppedError(FabricError):
    """A NIC of the run stopped (its device gone, or its firmware silent): the message names it, then the failure
    the run saw."""


@contextlib.asynccontextmanager
async def open_nics(options: PerftestOptions, count: int) -> AsyncIterator[list[NIC]]:
    """`count` local NICs as `options` say (emulated: NIC i's faults seeded --seed + i, its capture FILE.i), each with
    its link up (`wait_for_links`). After a failure (or a cancellation) they are closed at once, together: one that
    stopped answering with no budget (`settle`), the others each within its own, so the whole close takes one budget,
    not one per NIC."""
    nics: list[NIC] = []
    async with contextlib.AsyncExitStack() as stack:
        stack.push_async_exit(functools.partial(_close_after_failure, nics))
        shared = f"run{next(_runs_started)}"  # --shared-emulator: this run's NICs, not another's of this process
        for i in range(count):
            if not options.emulated:  # a real NIC: no emulator options
                nics.append(await stack.enter_async_context(open_nic(options.nic, ip=options.ip)))
                continue
            emulator = {**options.faults(seed=i), **options.chip()}
            if options.shared_emulator:
                emulator["process"] = shared
            if options.pcap:
                emulator["pcap"] = options.pcap if i == 0 else f"{options.pcap}.{i}"  # NIC N>0: FILE.N
            name = options.nic.partition(":")[2] or f"bench{os.getpid()}"
            nics.append(await stack.enter_async_context(open_nic(f"sim:{name}-{i}", ip=options.ip if i == 0 else None,
                                                                 **emulator)))
        for nic in nics:
            if options.events:  # perftest's -e: no polling before sleeping on the interrupt
                nic.poller.spin = 0.0
        await wait_for_links(nics)
        yield nics


async def wait_for_links(nics: list[NIC], timeout: float = LINK_UP_TIMEOUT) -> None:
    """Every NIC's link up, within `timeout` seconds for them all: the open brings a link up without waiting for it
    (a real one trains for a second or more), and a run's first packets would be lost. LinkDownError naming the first
    NIC whose link stays down and what its PHY reports (perftest refuses a port that is not ACTIVE likewise)."""
    deadline = anyio.current_time() + timeout
    for nic in nics:
        await nic.wait_for_link(max(0.0, deadline - anyio.current_time()))


async def _close_after_failure(nics: list[NIC], kind: Any, error: Any, traceback: Any) -> bool:
    """An exit callback of open_nics' stack, run before the NICs' own exits (which then find them closed)."""
    if error is None:
        return False
    await settle(nics)
    with anyio.CancelScope(shield=True), anyio.move_on_after(CLOSE_TIMEOUT + 5):
        async with anyio.create_task_group() as tasks:
            for nic in nics:
                tasks.start_soon(nic.close)
    return False


def first_error(error: BaseException) -> BaseException:
    """The first leaf of nested exception groups that is not a cancellation (anyio groups a task's error once per
    task group it crosses): the failure that came first, not the ones it caused."""
    cancelled = anyio.get_cancelled_exc_class()
    while isinstance(error, BaseExceptionGroup):
        real = [e for e in error.exceptions if not isinstance(e, cancelled)]
        error = (real or list(error.exceptions))[0]
    return error


def one_line(text: str) -> str:
    return " ".join(text.split())


def error_text(error: BaseException) -> str:
    """`TypeName: message` on one line."""
    message = one_line(str(error))
    return f"{type(error).__name__}: {message}" if message else type(error).__name__


async def after_failure(error: BaseException, nics: Iterable[NIC], peer: Any = None, remote_nic: Any = None
                        ) -> BaseException | None:
    """What stopped, once a run failed with `error` (shielded, a second or so): the local NICs that stopped
    answering (`settle` closes them at once, so the clean-up spends nothing on them) and, with a peer, the peer's
    NIC as its endpoint reports it (op nic_status). A `NICStoppedError` naming them, `error` after them; else a
    `LinkDownError` naming the local NICs whose link is down (their packets went nowhere); None when every NIC
    answers with its link up, or the run was cancelled (the cancellation stays the outcome)."""
    nics = list(nics)
    stopped = [f"{address} stopped: {why}" for address, why in (await settle(nics)).items()]
    down = [f"{nic.pci.address}'s link is down ({nic.device.port_link.phy_state})" for nic in nics
            if nic.alive and not nic.device.link.up]
    cancelled = isinstance(first_error(error), anyio.get_cancelled_exc_class())
    if peer is not None and remote_nic is not None and not cancelled and getattr(peer, "failure", None) is None:
        with anyio.CancelScope(shield=True):
            status = await remote_nic_status(peer, remote_nic)
        if status is not None and status.get("stopped"):
            stopped.append(f"the server's NIC {status.get('nic', '?')} at {peer.host} stopped: {status['stopped']}")
    if cancelled or not (stopped or down):
        return None
    if not stopped:
        return LinkDownError(f"{'; '.join(down)}; what the run saw: {error_text(first_error(error))}")
    return NICStoppedError(f"{'; '.join(stopped)}; what the run saw: {error_text(first_error(error))}")


async def remote_nic_status(peer: Any, remote_nic: Any) -> dict[str, Any] | None:
    """The peer's word on its NIC (op nic_status: {"nic", "stopped": why or null}), or None if it cannot say (an
    endpoint without the op, or no answer in time: the peer itself is then failed)."""
    from ..peer import PeerError
    try:
        return await peer.request("nic_status", nic=remote_nic.handle, probe=FIRMWARE_PROBE_SECONDS,
                                  timeout=FIRMWARE_PROBE_SECONDS + 4)
    except PeerError:
        return None


async def release_after_failure(release: Callable[[], Awaitable[None]], what: str) -> None:
    """Run a failed run's clean-up `release` within the close budget, shielded; its own error is logged, never
    raised: the run's first error stays the one reported."""
    with anyio.CancelScope(shield=True), anyio.move_on_after(CLOSE_TIMEOUT):
        try:
            await release()
        except Exception as exc:
            log.info("after the failure, %s: %s", what, error_text(exc))


async def release_steps(steps: list[Callable[[], Awaitable[Any]]], quiet: bool) -> None:
    """Run each release step in order; `quiet` (after a failure): one that fails is logged and the rest still run,
    so the first error stays the one reported."""
    for step in steps:
        try:
            await step()
        except Exception as exc:
            if not quiet:
                raise
            log.info("after the failure: %s", error_text(exc))


async def close_remote_after_failure(peer: Any, handle: Any) -> None:
    """Close `handle` at `peer` after a failure: shielded, within REMOTE_CLOSE_AFTER_FAILURE, its errors dropped (the
    end of the peer's connection frees it anyway)."""
    with anyio.CancelScope(shield=True), anyio.move_on_after(REMOTE_CLOSE_AFTER_FAILURE):
        with contextlib.suppress(Exception):
            await peer.close(handle)


def fit_mtu(requested: int, nics: Iterable[NIC], what: str) -> int:
    """The path MTU to connect with: `requested`, or, when a NIC's port cannot carry its packets, the largest path
    MTU every port carries (Linux picks a RoCE port's MTU so: iboe_get_mtu of the netdev's MTU), said on stderr. A
    port whose MTU is not known (0) limits nothing."""
    ports = {nic.pci.address: nic.device.port_mtu for nic in nics if nic.device.port_mtu}
    if not ports:
        return requested
    address, port_mtu = min(ports.items(), key=lambda item: item[1])
    fitting = path_mtu_for_port(port_mtu)
    if fitting >= requested:
        return requested
    if not fitting:
        raise ValueError(f"{address}'s port MTU {port_mtu} is too small for any RoCE packet (the headers take "
                         f"{ROCE_OVERHEAD} bytes, the smallest path MTU is 256)")
    print(f"{what}: path MTU {requested} does not fit the port MTU {port_mtu} of {address} (RoCE headers take "
          f"{ROCE_OVERHEAD} bytes): using {fitting}", file=sys.stderr, flush=True)
    return fitting


@contextlib.asynccontextmanager
async def phy_loopback(nic: NIC) -> AsyncIterator[None]:
    """`nic`'s port turned back on itself (port_phy_cfg LPBK_LOCAL) for the block: what it sends, it receives."""
    await nic.set_loopback(bnxt.PORT_PHY_CFG_REQ_LPBK_LOCAL)
    try:
        yield
    finally:
        await nic.set_loopback(bnxt.PORT_PHY_CFG_REQ_LPBK_NONE)
