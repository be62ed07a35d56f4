"""The emulated firmware's backing-store commands (FUNC_BACKING_STORE_QCAPS_V2 and CFG_V2), as Linux's bnxt_en
drives them (bnxt.c: bnxt_backing_store_cfg_v2, bnxt_alloc_ctx_mem): the function's context types are offered one by
one, and each is configured only after its QCAPS, with entries, instances and page tables the firmware accepts.
"""
from __future__ import annotations

from typing import Any

from .function import CONTEXT_TYPES, CTX_INIT, NEXT_CONTEXT_TYPE, TYPE_VALID, ContextType, FunctionState
from .objects import BackingStoreArea, CommandError, PageList, map_memory
from ..autogen import bnxt
from ..hw.firmware import PAGE_SIZE_CODES
from ..hw.firmware import BackingStoreType as BS

INVALID_PARAMS = bnxt.HWRM_ERR_CODE_INVALID_PARAMS
ALL_DONE = bnxt.FUNC_BACKING_STORE_CFG_V2_REQ_FLAGS_BS_CFG_ALL_DONE
CTX_INIT_SAMPLE = 16  # backing-store pages: one in this many has its context initialisation checked


class BackingStoreCommands(FunctionState):
    """The function's state and its two backing-store commands (the firmware dispatches to `_func_...` by name)."""

    def _func_backing_store_qcaps_v2(self, request: Any) -> dict[str, Any]:
        ctx = CONTEXT_TYPES.get(request.type)
        if ctx is None:
            raise CommandError(INVALID_PARAMS, f"backing-store type {request.type:#x} does not exist")
        self.queried_context_types.add(ctx.kind)
        return {"type": ctx.kind, "entry_size": ctx.entry_size, "flags": ctx.flags,
                "instance_bit_map": ctx.instance_bit_map, "ctx_init_value": ctx.init_value,
                "ctx_init_offset": ctx.init_offset, "entry_multiple": ctx.entry_multiple,
                "max_num_entries": ctx.max_entries, "min_num_entries": ctx.min_entries,
                "next_valid_type": NEXT_CONTEXT_TYPE[ctx.kind], "subtype_valid_cnt": len(ctx.splits),
                "max_instance_count": len(ctx.instances),
                **{f"split_entry_{i}": entries for i, entries in enumerate(ctx.splits)}}

    def _func_backing_store_cfg_v2(self, request: Any) -> dict[str, Any]:
        ctx = CONTEXT_TYPES.get(request.type)
        if ctx is None or not ctx.flags & TYPE_VALID:
            raise CommandError(INVALID_PARAMS, f"backing-store type {request.type:#x} cannot be configured")
        if ctx.kind not in self.queried_context_types:
            raise CommandError(INVALID_PARAMS, f"backing-store type {ctx.kind:#x} configured before its QCAPS_V2")
        if request.instance not in ctx.instances:
            raise CommandError(INVALID_PARAMS, f"type {ctx.kind:#x} has no instance {request.instance} "
                                            f"(instance_bit_map {ctx.instance_bit_map:#x})")
        if request.entry_size != ctx.entry_size:
            raise CommandError(INVALID_PARAMS, f"type {ctx.kind:#x} entries are {ctx.entry_size} bytes, "
                                            f"not {request.entry_size}")
        if not ctx.min_entries <= request.num_entries <= ctx.max_entries:
            raise CommandError(INVALID_PARAMS, f"type {ctx.kind:#x}: {request.num_entries} entries is outside "
                                            f"[{ctx.min_entries}, {ctx.max_entries}]")
        own = sum(ctx.splits[:2]) if ctx.kind == BS.QP else sum(ctx.splits[:1]) if ctx.kind == BS.CQ else 0
        if request.num_entries < own:  # Inferred: DPDK's L2-only sizing (the HSI: QP1 entries even without RoCE)
            raise CommandError(INVALID_PARAMS, f"type {ctx.kind:#x}: {request.num_entries} entries leave no room for "
                                            f"the firmware's own {own} (its L2 rings and QP1s)")
        level = request.page_size_pbl_level & bnxt.FUNC_BACKING_STORE_CFG_V2_REQ_PBL_LEVEL_MASK
        page_code = request.page_size_pbl_level >> bnxt.FUNC_BACKING_STORE_CFG_V2_REQ_PAGE_SIZE_SFT
        if level > 2 or page_code not in PAGE_SIZE_CODES:
            raise CommandError(INVALID_PARAMS, f"page_size_pbl_level {request.page_size_pbl_level:#x}")
        pages = map_memory(self.mem, level, request.page_dir, request.num_entries * ctx.entry_size,
                           PAGE_SIZE_CODES[page_code])
        if ctx.flags & CTX_INIT and ctx.init_value and not self._contexts_initialised(ctx, pages, request.num_entries):
            self.stats["ctx_init_missing"] += 1  # real firmware would run on garbage contexts; we only note it
        splits = tuple(getattr(request, f"split_entry_{i}") for i in range(min(request.subtype_valid_cnt, 4)))
        self.backing_store[ctx.kind, request.instance] = BackingStoreArea(
            ctx.kind, request.instance, request.num_entries, ctx.entry_size, pages, level, splits)
        if request.flags & ALL_DONE:
            self.backing_store_done = True
        return {}

    def _contexts_initialised(self, ctx: ContextType, pages: PageList, entries: int) -> bool:
        """The init byte of every entry (at init_offset units of 4 bytes: bnxt_init_ctx_initializer) holds the value,
        in the first page, the last and every CTX_INIT_SAMPLE-th: reading all of a large backing store (150 MiB
        for Linux's own caps) would cost a boot more than the note is worth."""
        offset, end, size = ctx.init_offset * 4, entries * ctx.entry_size, pages.page_size
        last = -(-end // size) - 1
        for index in sorted({*range(0, last, CTX_INIT_SAMPLE), last}):
            low, high = index * size, min(index * size + size, end)
            first = low + (offset - low) % ctx.entry_size
            if first < high:
                found = self.mem.view(pages.address(first), high - first)[::ctx.entry_size]
                if found.tobytes() != bytes([ctx.init_value]) * len(found):
                    return False
        return True
