"""Memory regions: registered DMA memory (`MemoryRegion`), and how a work request names a range of one, locally
(`local_sge`) or at a peer (`remote_address`)."""
from __future__ import annotations

import weakref

import anyio

from .types import Access, LocalBuffer, RemoteRegion, check_range
from .workqueue import ADDRESS_MAX, KEY_MAX, Sge
from ..autogen import bnxt
from ..driver import log, mr_pages
from ..driver.device import Device
from ..driver.rings import page_table
from ..errors import ClosedError, DeviceLostError, FabricError
from ..pci import PAGE_SIZE, DmaBuffer

__all__ = ["MemoryRegion", "local_sge", "remote_address"]
PD = 0  # the one protection domain every region and QP of a NIC shares


class MemoryRegion:
    """A registered range of DMA memory: `lkey` for local SGEs, `rkey` for peers, `addr` as the peer's remote VA.
    Made by `NIC.register_mr` (`register`)."""

    release_order = 1  # at the NIC's close: after the QPs that may still be reading or writing it

    def __init__(self, device: Device, buffer: DmaBuffer, access: Access, owns_buffer: bool = False) -> None:
        self.device, self.buffer, self.access, self.owns_buffer = device, buffer, access, owns_buffer
        self.addr, self.length = buffer.bus_addr, buffer.size
        self.page_size = mr_pages.page_size(buffer)  # the largest its bus addresses allow, as Linux picks it
        self.table = page_table(device.pci, mr_pages.pages(buffer, self.page_size), queue=False)
        self.lkey = self.rkey = -1
        self.closed = False

    @classmethod
    async def register(cls, device: Device, buffer: DmaBuffer, access: Access,
                       owns_buffer: bool = False) -> MemoryRegion:
        """REGISTER_MR of `buffer` (freed with the region if `owns_buffer`)."""
        try:
            mr = cls(device, buffer, access, owns_buffer)
        except BaseException:  # its pages cannot be listed: nothing was registered
            if owns_buffer:
                buffer.free()
            raise
        await mr._register()
        return mr

    async def _register(self) -> None:
        """REGISTER_MR, its key allocated by it (ALLOC_MR, the key field naming the PD) where QUERY_FUNC offers
        MR_REGISTER_ALLOC, else by ALLOCATE_MRW first (Linux bnxt_re_reg_user_mr, bnxt_qplib_alloc_mrw)."""
        allocated = -1
        try:
            if not self.device.mr_register_alloc:
                allocated = (await self.device.rcfw("allocate_mrw", pd_id=PD,
                                                    mrw_flags=bnxt.CMDQ_ALLOCATE_MRW_MRW_FLAGS_MR)).xid
            reply = await self.device.rcfw(
                "register_mr", flags=bnxt.CMDQ_REGISTER_MR_FLAGS_ALLOC_MR if allocated < 0 else 0,
                access=self.access.for_mr(), log2_pg_size_lvl=self.table.level << bnxt.CMDQ_REGISTER_MR_LVL_SFT
                | self.page_size.bit_length() - 1 << bnxt.CMDQ_REGISTER_MR_LOG2_PG_SIZE_SFT,
                log2_pbl_pg_size=PAGE_SIZE.bit_length() - 1,
                key=PD if allocated < 0 else allocated, pbl=self.table.base, va=self.addr, mr_size=self.length)
        except BaseException:
            if allocated >= 0:  # the key ALLOCATE_MRW made goes again, as Linux frees it (free_mrw)
                with anyio.CancelScope(shield=True):
                    await self._deallocate(allocated, quiet=True)
            self._free_memory()
            raise
        self.lkey = self.rkey = reply.xid if allocated < 0 else allocated  # no checkpoint from the reply to here
        self.device.attach(self)  # (see QueuePairLife._create)
        _registered[self.device.gid, self.rkey] = self

    def check_open(self) -> None:
        if self.closed:
            raise ClosedError(f"memory region (lkey {self.lkey:#x}) was deregistered")

    @property
    def view(self) -> memoryview:
        """The CPU's view of the region's memory (raises ClosedError once deregistered: it may be reused)."""
        self.check_open()
        return self.buffer.view

    def sge(self, offset: int = 0, length: int | None = None) -> LocalBuffer:
        """`length` bytes at `offset` of the region as one scatter/gather element (for SGE lists)."""
        length, _ = local_sge(self, offset, length)
        return LocalBuffer(self.addr + offset, self.lkey, length)

    def remote(self, offset: int = 0, length: int | None = None) -> RemoteRegion:
        """How a peer names this region (send it over the out-of-band channel)."""
        self.check_open()
        return RemoteRegion(self.addr + offset, self.rkey, self.length - offset if length is None else length)

    def device_lost(self, error: DeviceLostError) -> None:
        pass  # nothing in flight belongs to an MR

    async def release(self) -> None:
        await self.deregister()

    def forget(self) -> None:
        if not self.closed:
            self.closed = True
            self._unregistered()

    async def deregister(self) -> None:
        """DEALLOCATE_KEY, which deregisters the region and frees its key however it was made (Linux
        bnxt_re_dereg_mr, bnxt_qplib_free_mrw), and free its memory; every later use raises ClosedError."""
        if self.closed:
            return
        self.closed = True
        try:
            await self._deallocate(self.lkey)
        except BaseException:  # refused, timed out or cancelled: still registered, so still ours (a retry works)
            self.closed = False
            raise
        self.device.detach(self)
        self._unregistered()

    async def _deallocate(self, key: int, quiet: bool = False) -> None:
        """DEALLOCATE_KEY of `key` (an MR's); `quiet`: a failure is logged, not raised (a key left behind is the
        firmware's to drop at the next reset)."""
        try:
            await self.device.rcfw_release("deallocate_key", mrw_flags=bnxt.CMDQ_DEALLOCATE_KEY_MRW_FLAGS_MR, key=key)
        except FabricError as exc:
            if not quiet:
                raise
            log.warning("%s: MR key %#x: %s", self.device.pci.address, key, exc)

    def _unregistered(self) -> None:
        """The firmware let go of the region (or the device is quiesced): forget its key, free its memory."""
        _registered.pop((self.device.gid, self.rkey), None)
        self._free_memory()

    def _free_memory(self) -> None:
        self.table.free()
        if self.owns_buffer:
            self.buffer.free()

    @staticmethod
    def registered_here(gid: bytes, rkey: int) -> MemoryRegion | None:
        """The MR a peer at `gid` names by `rkey`, if a NIC of this process registered it (two ranks or a loopback
        pair in one process): the memory a remote access to it really touches."""
        return _registered.get((gid, rkey))


_registered: weakref.WeakValueDictionary[tuple[bytes, int], MemoryRegion] = weakref.WeakValueDictionary()


def local_sge(local: MemoryRegion | LocalBuffer, offset: int, size: int | None) -> tuple[int, Sge | None]:
    """(size, the SGE) for `size` bytes (None: to the end) at `offset` of `local`; no SGE for a zero-length
    transfer."""
    check_range("local_offset", offset, 0, ADDRESS_MAX)
    if size is None:
        size = local.length - offset
    check_range("size", size, 0, KEY_MAX)  # an SGE's length field
    if isinstance(local, MemoryRegion):
        local.check_open()
        if offset < 0 or size < 0 or offset + size > local.length:
            raise ValueError(f"{size} bytes at offset {offset} exceed the {local.length}-byte memory region")
    check_range("local address", local.addr + offset, 0, ADDRESS_MAX - size + 1)
    return size, ((local.addr + offset, local.lkey, size) if size else None)


def remote_address(remote: RemoteRegion | MemoryRegion, offset: int, size: int) -> tuple[int, int]:
    """(address, rkey) of `size` bytes at `offset` of a peer's region, checked against its length and 64 bits."""
    check_range("remote_offset", offset, 0, ADDRESS_MAX)
    if isinstance(remote, MemoryRegion):
        remote.check_open()
    if remote.length is not None and (offset < 0 or offset + size > remote.length):
        raise ValueError(f"{size} bytes at remote offset {offset} exceed the {remote.length}-byte remote region")
    check_range("remote address", remote.addr + offset, 0, ADDRESS_MAX - size + 1)
    return remote.addr + offset, remote.rkey
