"""One completion poller per NIC: drains CQEs in batches and completes awaitables; sleeps when idle.

Adaptive, like a NAPI loop: while completions keep coming it polls; when they stop it spins a bounded time (yielding
to other tasks between polls), then arms the busy CQs (CQ_ARMALL), re-checks to close the race, and sleeps on the
notification queue's interrupt eventfd (interrupt_wait.py), with a slow safety poll in case an interrupt is ever
lost. The safety poll backs off while sleeps keep ending without an interrupt (work outstanding but quiet, like
posted receives); once one ended so with nothing outstanding, there is nothing to lose: the poller sleeps without
one (an idle NIC wakes nobody) until the next post wakes it. Work posted while completions keep coming wakes nobody.
A wake-up's NQ doorbells (CQ_ARMENA for each notified CQ, the NQ's re-arm) wait for the next sleep's arms: one kick
to the NIC per sleep, not two (no CQ can notify before its CQ_ARMENA, so none is missed meanwhile).
"""
from __future__ import annotations

import time
from typing import Protocol

import anyio
import anyio.lowlevel

from ..autogen import bnxt
from ..driver.device import Device
from ..driver.interrupts import NQ_VECTOR, wake
from ..hw.cqe import NQ_CQ_NOTIFICATION, NQ_ENTRY, notification_fields
from ..pci import read_barrier
from .interrupt_wait import InterruptWait

SPIN_SECONDS = 80e-6
SAFETY_POLL = 0.1  # the first safety poll after an interrupt or a completion ...
QUIET_SAFETY_POLL = 1.0  # ... doubling up to this while nothing comes: each wake-up of a quiet process costs ~0.5 ms
CQ_NOTIFICATION = bnxt.NQ_CN_TYPE_CQ_NOTIFICATION


class Pollable(Protocol):
    handle: int
    armed: bool

    @property
    def busy(self) -> bool: ...  # has work requests outstanding
    def poll(self) -> int: ...  # drain CQEs; return how many
    def arm(self) -> None: ...  # CQ_ARMALL: notify on the next CQE
    def arm_doorbell(self) -> int: ...  # the same, as the doorbell value for the caller to ring
    def notified(self, toggle: int) -> int: ...  # disarmed by a notification: the CQ_ARMENA doorbell to ring
    def fail_all(self, error: BaseException) -> None: ...


class Poller:
    def __init__(self, device: Device, spin: float = SPIN_SECONDS) -> None:
        self.device, self.spin = device, spin
        self.cqs: dict[int, Pollable] = {}  # by cq_handle, as NQ notifications name them
        self.sleeping = False
        self.safety: float | None = SAFETY_POLL  # the safety poll of the next (or this) sleep; None: none
        self.nq_armed = False
        self.due: list[int] = []  # doorbells of the last wake-up's notifications, rung with the next sleep's arms
        self.stats = {"wakeups": 0, "polls": 0, "cqes": 0, "spins_found": 0}

    def add(self, cq: Pollable) -> None:
        self.cqs[cq.handle] = cq

    def remove(self, cq: Pollable) -> None:
        self.cqs.pop(cq.handle, None)

    def poll_all(self) -> int:
        found = 0
        for cq in list(self.cqs.values()):
            if cq.busy:
                found += cq.poll()
        self.stats["polls"] += 1
        self.stats["cqes"] += found
        if found:
            self.safety = SAFETY_POLL
        return found

    def work_posted(self, cq: Pollable) -> None:
        """Called after a post: a sleeping poller only hears about CQs that are armed, and one sleeping without the
        first, short safety poll is woken to start it: new work is insured against a lost interrupt within 0.1 s."""
        if not self.sleeping:
            return
        if not cq.armed:
            cq.arm()
        if self.safety != SAFETY_POLL:
            self.safety = SAFETY_POLL
            wake(self.device.interrupt_fd(NQ_VECTOR))

    async def run(self) -> None:
        nq, waiter = self.device.nq, InterruptWait(self.device.interrupt_fd(NQ_VECTOR))
        try:
            while self.device.alive:
                if self.poll_all():
                    await anyio.lowlevel.checkpoint()
                    continue
                if any(cq.busy for cq in self.cqs.values()) and await self._spin():
                    continue
                self.sleeping = True
                try:
                    arms, self.due = self.due, []
                    self._drain_nq(nq, arms)  # a CQ's CQ_ARMENA before its arm
                    for cq in self.cqs.values():
                        if cq.busy and not cq.armed:  # new work, or work whose notification came: the short poll
                            arms.append(cq.arm_doorbell())
                            self.safety = SAFETY_POLL
                    self._ring(arms)  # the CQ and NQ arms in one kick
                    if self.poll_all():
                        continue
                    if self.safety != SAFETY_POLL and not any(cq.busy for cq in self.cqs.values()):
                        self.safety = None  # quiet and nothing outstanding: no interrupt to lose
                    if await waiter.sleep(self.safety):
                        self.safety = SAFETY_POLL
                    elif self.safety is not None:  # quiet: the next safety poll waits longer
                        self.safety = min(2 * self.safety, QUIET_SAFETY_POLL)
                    self.stats["wakeups"] += 1
                    self._drain_nq(nq, self.due)
                finally:
                    self.sleeping = False
        finally:
            waiter.close()
        error = self.device.lost
        assert error is not None  # the loop runs while the device is alive
        for cq in self.cqs.values():
            cq.fail_all(error)

    async def _spin(self) -> bool:
        deadline = time.perf_counter() + self.spin
        while time.perf_counter() < deadline:
            await anyio.lowlevel.checkpoint()
            if self.poll_all():
                self.stats["spins_found"] += 1
                return True
        return False

    def _drain_nq(self, nq, doorbells: list[int]) -> None:
        """Consume CQ notifications (each one disarms its CQ, which CQ_ARMENA lets be armed again), adding those
        doorbells to `doorbells`; one consumed leaves the NQ disarmed."""
        view = nq.view
        while True:
            offset = nq.offset(nq.consumer)
            if not NQ_ENTRY.is_new(view, offset, nq.consumer, nq.depth):
                break
            read_barrier()  # the entry's body after its valid bit (Linux dma_rmb in bnxt_qplib_service_nq)
            entry_type, low, _, high = NQ_CQ_NOTIFICATION.unpack_from(view, offset)
            kind, toggle, handle = notification_fields(entry_type, low, high)
            if kind == CQ_NOTIFICATION:
                cq = self.cqs.get(handle)
                if cq is not None:
                    doorbells.append(cq.notified(toggle))
            nq.consumer += 1
            self.nq_armed = False  # an NQ that fired is disarmed; one that did not is still armed

    def _ring(self, doorbells: list[int]) -> None:
        """Ring `doorbells` (CQ_ARMENAs before the arms that need them) and the NQ's re-arm in one write."""
        if not self.nq_armed:
            doorbells.append(self.device.nq.doorbell(self.device.nq_id, bnxt.DBC_DBC_TYPE_NQ_ARM))
            self.nq_armed = True
        if doorbells:
            self.device.doorbells.write64_doorbells(self.device.db_offset, doorbells)
