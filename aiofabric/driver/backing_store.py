"""The backing store: host memory the firmware keeps its contexts in (QPs, CQs, MRs and its own), one area per context
type, handed to it at boot as Linux's bnxt_en does (bnxt.c bnxt_alloc_ctx_mem, bnxt_backing_store_cfg_v2): the types
walked by `next_valid_type`, the nine bnxt_en sizes for a RoCE function sized as it sizes them (context_sizes.py) and
configured (no trace buffers), their memory initialised only when the firmware asks (ENABLE_CTX_KIND_INIT). Only
version 2 is spoken: firmware without it wants v1 (FUNC_BACKING_STORE_QCAPS/CFG, bnxt_hwrm_func_backing_store_cfg),
refused with that reason."""
from __future__ import annotations

import ctypes
from typing import Awaitable, Callable

from .context_sizes import TypeCaps, plan
from .rings import page_table
from ..autogen import bnxt
from ..errors import PCIError
from ..hw.firmware import CONFIGURED_CONTEXT_TYPES, BackingStoreType
from ..pci import PCIDevice

Hwrm = Callable[..., Awaitable[ctypes.Structure]]  # Device.hwrm: a command by name, its fields as keywords
MAX_SPLITS = 4  # BNXT_MAX_SPLIT_ENTRY: split_entry_0..3


async def configure(pci: PCIDevice, hwrm: Hwrm, flags_ext: int, flags_ext2: int,
                    on_quiesced: Callable[[Callable[[], None]], None]) -> None:
    """One FUNC_BACKING_STORE_CFG_V2 per instance of each type in CONFIGURED_CONTEXT_TYPES, ALL_DONE on the last.
    `flags_ext` and `flags_ext2` are FUNC_QCAPS's; the memory is freed through `on_quiesced`, once the device can no
    longer write it."""
    if not flags_ext & bnxt.FUNC_QCAPS_RESP_FLAGS_EXT_BS_V2_SUPPORTED:
        raise PCIError(f"{pci.address}: the firmware offers only backing store v1 (FUNC_QCAPS flags_ext has no "
                       "BS_V2_SUPPORTED: older Thor firmware), which this driver does not speak; update the NIC "
                       "firmware to one with backing store v2")
    offered, kind, seen = {}, 0, set()
    while kind != BackingStoreType.INVALID and kind not in seen:
        seen.add(kind)
        caps = await hwrm("func_backing_store_qcaps_v2", type=kind)
        if caps.flags & bnxt.FUNC_BACKING_STORE_QCAPS_V2_RESP_FLAGS_TYPE_VALID and kind in CONFIGURED_CONTEXT_TYPES:
            offered[kind] = caps
        kind = caps.next_valid_type
    try:
        plans = plan({kind: TypeCaps(caps.entry_size, caps.entry_multiple, caps.min_num_entries, caps.max_num_entries,
                                     tuple(getattr(caps, f"split_entry_{j}")
                                           for j in range(min(caps.subtype_valid_cnt, MAX_SPLITS))))
                      for kind, caps in offered.items()},
                     bool(flags_ext2 & bnxt.FUNC_QCAPS_RESP_FLAGS_EXT2_SW_MAX_RESOURCE_LIMITS_SUPPORTED))
    except ValueError as error:
        raise PCIError(f"{pci.address}: {error}") from None
    steps = [(kind, instance) for kind in sorted(plans)
             for instance in ([i for i in range(32) if offered[kind].instance_bit_map >> i & 1] or [0])]
    for number, (kind, instance) in enumerate(steps):
        caps, sizing = offered[kind], plans[kind]
        size = sizing.entries * caps.entry_size
        memory = pci.alloc_dma(size)
        on_quiesced(memory.free)
        if caps.flags & bnxt.FUNC_BACKING_STORE_QCAPS_V2_RESP_FLAGS_ENABLE_CTX_KIND_INIT and caps.ctx_init_value:
            start = caps.ctx_init_offset * 4  # units of 4 bytes (bnxt_init_ctx_initializer)
            memory.view[start:size:caps.entry_size] = \
                bytes([caps.ctx_init_value]) * len(range(start, size, caps.entry_size))
        table = page_table(pci, memory.bus_addrs, queue=False, min_level=sizing.level)
        on_quiesced(table.free)
        await hwrm("func_backing_store_cfg_v2", type=kind, instance=instance, entry_size=caps.entry_size,
                   num_entries=sizing.entries, page_dir=table.base, page_size_pbl_level=table.level,
                   subtype_valid_cnt=len(sizing.splits),
                   flags=bnxt.FUNC_BACKING_STORE_CFG_V2_REQ_FLAGS_BS_CFG_ALL_DONE if number == len(steps) - 1 else 0,
                   **{f"split_entry_{j}": value for j, value in enumerate(sizing.splits)})
