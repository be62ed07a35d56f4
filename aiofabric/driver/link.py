"""The port's link: the interface's UP and DOWN told to the firmware, the link brought up, and its state kept current,
as Linux's bnxt_en does when it opens and closes its netdev.

Unbinding bnxt_en from a function whose interface is up runs bnxt_close, which forces the link down
(bnxt_hwrm_shutdown_link: PORT_PHY_CFG with FORCE_LINK_DWN) and tells the firmware the interface is down
(bnxt_hwrm_if_change(bp, false)). A driver that only reads the link finds it down for good. bnxt_en's open brings it
back, and so does `PortLink`:

- `interface_up`, before any ring is allocated (HSI: "at the beginning of the driver's open call before resources are
  allocated"): FUNC_DRV_IF_CHANGE with flags UP, only if FUNC_DRV_RGTR's answer had IF_CHANGE_SUPPORTED, retried
  while the firmware answers BUSY or HOT_RESET_PROGRESS (bnxt_hwrm_if_change: BNXT_FW_IF_RETRY tries, 50 ms apart).
  Its answer can say the firmware changed under the driver: RESC_CHANGE (the reservation may have changed),
  HOT_FW_RESET_DONE (the firmware was reset) or CAPS_CHANGE. Linux then queries and reserves again, or starts over
  with bnxt_fw_init_one; here the boot stops with an error naming the flag, and the next open starts afresh (its
  close has told the firmware the interface is down again).
- `update_phy_setting`, once the rings and the event ring are up (bnxt_update_phy_setting): PORT_PHY_QCFG, and while
  the link is down, PORT_PHY_CFG with the firmware's own settings, autoneg or forced speed, and RESET_PHY
  (bnxt_hwrm_set_link_common: Linux seeds its settings from the firmware's, bnxt_init_ethtool_link_settings, and
  says "the last close may have shutdown the link"). A function that shares its port (NPAR, multi-host) leaves the
  PHY to the firmware, as Linux's BNXT_SINGLE_PF gate does.
- `interface_down` at close, after every ring is freed and before FUNC_DRV_UNRGTR: FUNC_DRV_IF_CHANGE without UP.

The link is not forced down at close, unlike bnxt_close: that is bnxt_en's policy for an interface its administrator
takes down (`ip link set down`), who expects the port dark, and even bnxt_en skips it on a port it shares (NPAR,
multi-host, VFs without firmware-managed link-down). This driver's close leaves the port to whoever opens the
function next, and no later driver relies on finding the link down: bnxt_en's open brings it up itself when it finds
it down ("the last close may have shutdown the link"), and so does this one's; a port left up only spares the next
open the seconds a link takes to train.

Like Linux's open, the boot does not wait for the link: it comes up later, and LINK_STATUS_CHANGE says so
(firmware_events.py re-reads PORT_PHY_QCFG, `query`). `wait_up` waits for it, bounded.
"""
from __future__ import annotations

from typing import Any

import anyio

from . import log
from .firmware_events import Link
from .hwrm_channel import HwrmChannel
from ..autogen import bnxt
from ..errors import FirmwareError, LinkDownError
from ..hw.firmware import LINK_SPEED_MBPS

IF_CHANGE_TRIES = 10  # Linux BNXT_FW_IF_RETRY
IF_CHANGE_RETRY_INTERVAL = 0.05
IF_CHANGE_BUSY = frozenset({bnxt.HWRM_ERR_CODE_BUSY, bnxt.HWRM_ERR_CODE_HOT_RESET_PROGRESS})  # Linux: -EAGAIN
IF_CHANGE_REFUSED = {  # FUNC_DRV_IF_CHANGE's answer flags a boot cannot go on from: their names, what each means
    bnxt.FUNC_DRV_IF_CHANGE_RESP_FLAGS_RESC_CHANGE: ("RESC_CHANGE", "the resources reserved for this function may "
                                                                    "have changed"),
    bnxt.FUNC_DRV_IF_CHANGE_RESP_FLAGS_HOT_FW_RESET_DONE: ("HOT_FW_RESET_DONE", "the firmware was reset"),
    bnxt.FUNC_DRV_IF_CHANGE_RESP_FLAGS_CAPS_CHANGE: ("CAPS_CHANGE", "the function's capabilities may have changed"),
}
NPAR = frozenset(getattr(bnxt, f"FUNC_QCFG_RESP_PORT_PARTITION_TYPE_{kind}") for kind in
                 ("NPAR1_0", "NPAR1_2", "NPAR1_5", "NPAR2_0"))  # the partitions Linux's BNXT_NPAR counts
LINK_UP_TIMEOUT = 10.0  # how long a caller waits for a link by default: real ones train for a second or more
LINK_POLL = 0.5  # while waiting for the link, PORT_PHY_QCFG is read this often too, in case its event is lost
LINK_STATES = {bnxt.PORT_PHY_QCFG_RESP_LINK_NO_LINK: "NO_LINK", bnxt.PORT_PHY_QCFG_RESP_LINK_SIGNAL: "SIGNAL",
               bnxt.PORT_PHY_QCFG_RESP_LINK_LINK: "LINK", bnxt.PORT_PHY_QCFG_RESP_LINK_NO_SD: "NO_SD",
               bnxt.PORT_PHY_QCFG_RESP_LINK_NO_LOCK: "NO_LOCK"}
DOWN_REASONS = {getattr(bnxt, name): name.removeprefix("PORT_PHY_QCFG_RESP_LINK_DOWN_REASON_")
                for name in dir(bnxt) if name.startswith("PORT_PHY_QCFG_RESP_LINK_DOWN_REASON_")}


class PortLink:
    """The function's view of its port's link (`link`), and the commands that bring it up."""

    def __init__(self, channel: HwrmChannel, address: str) -> None:
        self.channel, self.address = channel, address
        self.port_id = 0
        self.link = Link(up=False, speed_mbps=0)  # PORT_PHY_QCFG's, from boot on
        self.phy_state = ""  # the last PORT_PHY_QCFG, in words, for a link that stays down
        self.if_change = False  # FUNC_DRV_RGTR said IF_CHANGE_SUPPORTED
        self.interface_is_up = False  # the firmware was told UP and not DOWN since
        self._changed = anyio.Event()  # set (and replaced) whenever `link` is read again

    def registered(self, flags: int, port_id: int) -> None:
        """FUNC_DRV_RGTR's answer `flags` (Linux bnxt_hwrm_func_drv_rgtr: BNXT_FW_CAP_IF_CHANGE), and the port."""
        self.if_change = bool(flags & bnxt.FUNC_DRV_RGTR_RESP_FLAGS_IF_CHANGE_SUPPORTED)
        self.port_id = port_id

    async def interface_up(self) -> None:
        """FUNC_DRV_IF_CHANGE(UP) (bnxt_hwrm_if_change(bp, true)); FirmwareError if the firmware stays busy, refuses,
        or says it changed under the driver."""
        if not self.if_change:
            return
        for attempt in range(1, IF_CHANGE_TRIES + 1):
            try:
                answer = await self.channel.command("func_drv_if_change", flags=bnxt.FUNC_DRV_IF_CHANGE_REQ_FLAGS_UP)
                break
            except FirmwareError as exc:
                if exc.status not in IF_CHANGE_BUSY or attempt == IF_CHANGE_TRIES:
                    raise
                await anyio.sleep(IF_CHANGE_RETRY_INTERVAL)
        self.interface_is_up = True  # answered: the close must say DOWN, whatever the flags
        changed = [named for flag, named in IF_CHANGE_REFUSED.items() if answer.flags & flag]
        if changed:
            raise FirmwareError("HWRM func_drv_if_change", 0, "|".join(name for name, _ in changed),
                                f"{self.address}: {'; '.join(what for _, what in changed)} (answer flags "
                                f"{answer.flags:#x}), so what this boot learned and reserved may not hold: open the "
                                "NIC again, and the new boot queries and reserves afresh")

    async def interface_down(self) -> None:
        """FUNC_DRV_IF_CHANGE without UP, once the interface was up (bnxt_hwrm_if_change(bp, false))."""
        if self.interface_is_up:
            await self.channel.command("func_drv_if_change", flags=0)
            self.interface_is_up = False

    async def update_phy_setting(self, single_pf: bool) -> None:
        """Read the link and, while it is down on a port this function owns alone, configure the PHY with the
        firmware's own settings and reset it (bnxt_update_phy_setting); the link comes up later."""
        phy = await self.query()
        if self.link.up or not single_pf:
            return
        caps = await self.channel.command("port_phy_qcaps", port_id=self.port_id)
        speeds2 = bool(caps.flags2 & bnxt.PORT_PHY_QCAPS_RESP_FLAGS2_SPEEDS2_SUPPORTED)  # Linux BNXT_PHY_FL_SPEEDS2
        await self.channel.command("port_phy_cfg", port_id=self.port_id, **phy_settings(phy, speeds2))
        log.info("%s: link down (%s): PHY configured and reset", self.address, self.phy_state)

    async def query(self) -> Any:
        """Read the link from PORT_PHY_QCFG (bnxt_update_link), wake whoever waits on it; the answer."""
        phy = await self.channel.command("port_phy_qcfg", port_id=self.port_id)
        up = phy.link == bnxt.PORT_PHY_QCFG_RESP_LINK_LINK
        self.link = Link(up, LINK_SPEED_MBPS.get(phy.link_speed, 0) if up else 0)
        reasons = [name for bit, name in DOWN_REASONS.items() if phy.link_down_reason & bit]
        self.phy_state = f"PORT_PHY_QCFG link {LINK_STATES.get(phy.link, hex(phy.link))}" + (
            f", link_down_reason {'|'.join(reasons)}" if reasons else "")
        self._changed.set()
        self._changed = anyio.Event()
        return phy

    async def wait_up(self, timeout: float) -> Link:
        """The link once it is up, waited for at most `timeout` seconds; LinkDownError saying what the PHY reports
        if it stays down."""
        with anyio.move_on_after(timeout):
            while not self.link.up:
                with anyio.move_on_after(LINK_POLL):
                    await self._changed.wait()
                if not self.link.up:
                    await self.query()
            return self.link
        raise LinkDownError(f"{self.address}: the link is still down after {timeout:.3g} s ({self.phy_state}): check "
                            "the cable, the transceiver and the switch port")


def single_pf(qcfg: Any) -> bool:
    """Whether a function's FUNC_QCFG says it owns its port alone (Linux BNXT_SINGLE_PF: not NPAR, not multi-host):
    only then does Linux configure the PHY."""
    return not qcfg.flags & bnxt.FUNC_QCFG_RESP_FLAGS_MULTI_HOST and qcfg.port_partition_type not in NPAR


def phy_settings(phy: Any, speeds2: bool) -> dict[str, int]:
    """PORT_PHY_CFG's fields that restart the link with PORT_PHY_QCFG's settings `phy` (Linux
    bnxt_init_ethtool_link_settings, then bnxt_hwrm_set_link_common): autoneg over the speeds the firmware advertises
    (auto_mode SPEED_MASK, RESTART_AUTONEG), or its forced speed (FORCE); RESET_PHY always ("the setting takes effect
    immediately"). A SPEEDS2 PHY (Thor2) takes the speeds2 fields, an older one the NRZ and PAM4 ones."""
    flags, enables, fields = bnxt.PORT_PHY_CFG_REQ_FLAGS_RESET_PHY, 0, {}
    if bnxt.PORT_PHY_QCFG_RESP_AUTO_MODE_NONE < phy.auto_mode <= bnxt.PORT_PHY_QCFG_RESP_AUTO_MODE_SPEED_MASK:
        flags |= bnxt.PORT_PHY_CFG_REQ_FLAGS_RESTART_AUTONEG
        enables |= bnxt.PORT_PHY_CFG_REQ_ENABLES_AUTO_MODE
        fields["auto_mode"] = bnxt.PORT_PHY_CFG_REQ_AUTO_MODE_SPEED_MASK
        if speeds2:
            enables |= bnxt.PORT_PHY_CFG_REQ_ENABLES_AUTO_LINK_SPEEDS2_MASK
            fields["auto_link_speeds2_mask"] = phy.auto_link_speeds2
        else:
            if phy.auto_link_speed_mask:
                enables |= bnxt.PORT_PHY_CFG_REQ_ENABLES_AUTO_LINK_SPEED_MASK
                fields["auto_link_speed_mask"] = phy.auto_link_speed_mask
            if phy.auto_pam4_link_speed_mask:
                enables |= bnxt.PORT_PHY_CFG_REQ_ENABLES_AUTO_PAM4_LINK_SPEED_MASK
                fields["auto_link_pam4_speed_mask"] = phy.auto_pam4_link_speed_mask
    else:
        flags |= bnxt.PORT_PHY_CFG_REQ_FLAGS_FORCE
        if speeds2:
            enables |= bnxt.PORT_PHY_CFG_REQ_ENABLES_FORCE_LINK_SPEEDS2
            fields["force_link_speeds2"] = phy.force_link_speeds2
        elif phy.force_pam4_link_speed:
            enables |= bnxt.PORT_PHY_CFG_REQ_ENABLES_FORCE_PAM4_LINK_SPEED
            fields["force_pam4_link_speed"] = phy.force_pam4_link_speed
        else:
            fields["force_link_speed"] = phy.force_link_speed  # the legacy field has no enable bit
    return {"flags": flags, "enables": enables, **fields}
