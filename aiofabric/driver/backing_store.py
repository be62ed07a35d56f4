"""The backing store: host memory the firmware keeps its contexts in (QPs, CQs, MRs and its own), one area per context
type, handed to it at boot as Linux's bnxt_en does (bnxt.c bnxt_backing_store_cfg_v2): the types walked by
`next_valid_type`, only those bnxt_en sizes configured (no trace buffers), their memory initialised only when the
firmware asks (ENABLE_CTX_KIND_INIT). Only version 2 is spoken: firmware without it wants v1
(FUNC_BACKING_STORE_QCAPS/CFG, bnxt_backing_store_cfg), whose layouts the bindings lack."""
from __future__ import annotations

import ctypes
from typing import Awaitable, Callable

from .rings import page_table
from ..autogen import bnxt
from ..errors import PCIError
from ..hw.firmware import CONFIGURED_CONTEXT_TYPES, BackingStoreType
from ..pci import PCIDevice

EXTRA_QPS, EXTRA_MRS = 1024, 4096  # RoCE objects the backing store is sized for, beyond the firmware's L2 needs
Hwrm = Callable[..., Awaitable[ctypes.Structure]]  # Device.hwrm: a command by name, its fields as keywords


async def configure(pci: PCIDevice, hwrm: Hwrm, flags_ext: int, on_quiesced: Callable[[Callable[[], None]], None]
                    ) -> None:
    """One FUNC_BACKING_STORE_CFG_V2 per instance of each valid type in CONFIGURED_CONTEXT_TYPES. `flags_ext` is
    FUNC_QCAPS's; the memory is freed through `on_quiesced`, once the device can no longer write it."""
    if not flags_ext & bnxt.FUNC_QCAPS_RESP_FLAGS_EXT_BS_V2_SUPPORTED:
        raise PCIError(f"{pci.address}: backing store v1 (pre-Thor2 firmware) is not supported (FUNC_QCAPS "
                       "flags_ext has no BS_V2_SUPPORTED)")
    plan, kind, seen = [], 0, set()
    while kind != BackingStoreType.INVALID and kind not in seen:
        seen.add(kind)
        caps = await hwrm("func_backing_store_qcaps_v2", type=kind)
        valid = caps.flags & bnxt.FUNC_BACKING_STORE_QCAPS_V2_RESP_FLAGS_TYPE_VALID and caps.entry_size
        if valid and kind in CONFIGURED_CONTEXT_TYPES:
            plan.append((kind, caps))
        kind = caps.next_valid_type
    counts: dict[int, int] = {}
    steps = [(kind, caps, instance) for kind, caps in plan
             for instance in ([i for i in range(32) if caps.instance_bit_map >> i & 1] or [0])]
    for number, (kind, caps, instance) in enumerate(steps):
        splits = [getattr(caps, f"split_entry_{j}") for j in range(min(caps.subtype_valid_cnt, 4))]
        entries = counts.setdefault(kind, _entries(kind, caps, splits, counts))
        memory = pci.alloc_dma(max(entries * caps.entry_size, 1))
        if caps.flags & bnxt.FUNC_BACKING_STORE_QCAPS_V2_RESP_FLAGS_ENABLE_CTX_KIND_INIT and caps.ctx_init_value:
            start = caps.ctx_init_offset * 4  # units of 4 bytes (bnxt_init_ctx_initializer)
            memory.view[start:entries * caps.entry_size:caps.entry_size] = \
                bytes([caps.ctx_init_value]) * len(range(start, entries * caps.entry_size, caps.entry_size))
        table = page_table(pci, memory.bus_addrs, queue=False)
        last = number == len(steps) - 1
        await hwrm("func_backing_store_cfg_v2", type=kind, instance=instance, entry_size=caps.entry_size,
                   num_entries=entries, page_dir=table.base, page_size_pbl_level=table.level,
                   subtype_valid_cnt=len(splits),
                   flags=bnxt.FUNC_BACKING_STORE_CFG_V2_REQ_FLAGS_BS_CFG_ALL_DONE if last else 0,
                   **{f"split_entry_{j}": v for j, v in enumerate(splits)})
        on_quiesced(table.free)
        on_quiesced(memory.free)


def _entries(kind: int, caps: ctypes.Structure, splits: list[int], counts: dict[int, int]) -> int:
    """Entries for one backing-store type, as bnxt_en sizes them for a RoCE-capable function."""
    base = sum(splits)
    extras: dict[int, int] = {BackingStoreType.QP: EXTRA_QPS, BackingStoreType.SRQ: EXTRA_QPS // 2,
                              BackingStoreType.CQ: 2 * EXTRA_QPS, BackingStoreType.MRAV: EXTRA_MRS}
    extra = extras.get(kind, 0)
    entries = counts.get(BackingStoreType.QP, base + EXTRA_QPS) if kind == BackingStoreType.TIM else base + extra
    multiple = max(caps.entry_multiple, 1)
    entries = -(-entries // multiple) * multiple
    return max(caps.min_num_entries, min(entries, caps.max_num_entries or entries))
