"""The emulated port's PHY as its firmware runs it (sans-IO): what PORT_PHY_QCAPS and PORT_PHY_QCFG report, what
PORT_PHY_CFG and FUNC_DRV_IF_CHANGE do to the link, and when a link that trains comes up.

It starts where Linux's bnxt_en leaves a port it is unbound from with its interface up: bnxt_close forced the link
down (bnxt_hwrm_shutdown_link: PORT_PHY_CFG with FORCE_LINK_DWN) and told the firmware the interface is down
(bnxt_hwrm_if_change). A driver brings it back as bnxt_en's open does: FUNC_DRV_IF_CHANGE(UP), then, while
PORT_PHY_QCFG says the link is down, PORT_PHY_CFG with its autoneg or forced-speed settings and RESET_PHY
(bnxt_update_phy_setting, bnxt_hwrm_set_link_common). The link then trains for `delay` seconds (the emulator option
link_delay_ms) and comes up; `on_change` posts LINK_STATUS_CHANGE, as firmware does whenever the link goes up or down.
While the link is down the port carries nothing (port.py). Thor2's PHY takes the SPEEDS2 fields (PORT_PHY_QCAPS
flags2 SPEEDS2_SUPPORTED, Linux BNXT_PHY_FL_SPEEDS2), Thor's the older NRZ and PAM4 ones.

Inferred (Linux shows only the driver's side): the firmware releases a forced-down link only on a PORT_PHY_CFG with
RESET_PHY sent after the driver's FUNC_DRV_IF_CHANGE(UP); one sent before it, or without RESET_PHY, keeps its
settings but leaves the link down (an error noted, the command answered). FUNC_DRV_IF_CHANGE needs a registered
driver (FUNC_DRV_RGTR first, as Linux, which learns from its answer whether to send it). IF_CHANGE(down),
FUNC_DRV_UNRGTR and FUNC_RESET end the interface's UP but leave the link as it is: Linux takes it down with its own
PORT_PHY_CFG. The speeds this PHY offers, its refusals (fields of the other PHY generation, a speed it lacks, both
FORCE and RESTART_AUTONEG) and the error code they get (INVALID_PARAMS) are this emulator's choices.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from .objects import CommandError
from .port import Port
from ..autogen import bnxt

INVALID_PARAMS = bnxt.HWRM_ERR_CODE_INVALID_PARAMS
DEFAULT_LINK_DELAY_MS = 5.0  # from the PORT_PHY_CFG that releases the link to link up (real ones take seconds)
CFG, QCFG = "PORT_PHY_CFG_REQ_", "PORT_PHY_QCFG_RESP_"
FORCE_LINK_DOWN = bnxt.PORT_PHY_CFG_REQ_FLAGS_FORCE_LINK_DWN
RESET_PHY, RESTART_AUTONEG, FORCE = (getattr(bnxt, f"{CFG}FLAGS_{name}") for name in
                                     ("RESET_PHY", "RESTART_AUTONEG", "FORCE"))
AUTO_MODES = (bnxt.PORT_PHY_CFG_REQ_AUTO_MODE_ALL_SPEEDS, bnxt.PORT_PHY_CFG_REQ_AUTO_MODE_SPEED_MASK)


@dataclass(frozen=True)
class Speed:
    """One speed the PHY offers: its bit in the supported and advertised masks, its forced-speed code, and
    PORT_PHY_QCFG's link_speed while the link is up at it."""
    mask: int
    force: int
    link_speed: int


@dataclass(frozen=True)
class Fields:
    """Where one family of speeds lives in PORT_PHY_CFG (enable bits, mask and force fields) and PORT_PHY_QCFG."""
    auto_enable: int
    auto_mask: str
    force_enable: int  # 0: the forced speed needs no enable bit (the legacy NRZ field)
    force: str
    qcfg_support: str
    qcfg_auto: str
    qcfg_force: str
    speeds: tuple[Speed, ...]


def _speeds(mask_prefix: str, force_prefix: str, *names: str) -> tuple[Speed, ...]:
    """Each of `names`, "MASK FORCE LINK": the suffixes of its mask bit, forced-speed code and link_speed code."""
    return tuple(Speed(getattr(bnxt, mask_prefix + mask), getattr(bnxt, force_prefix + force),
                       getattr(bnxt, f"{QCFG}LINK_SPEED_{link}")) for mask, force, link in map(str.split, names))


SPEEDS2 = Fields(bnxt.PORT_PHY_CFG_REQ_ENABLES_AUTO_LINK_SPEEDS2_MASK, "auto_link_speeds2_mask",
                 bnxt.PORT_PHY_CFG_REQ_ENABLES_FORCE_LINK_SPEEDS2, "force_link_speeds2",
                 "support_speeds2", "auto_link_speeds2", "force_link_speeds2",
                 _speeds(f"{CFG}AUTO_LINK_SPEEDS2_MASK_", f"{CFG}FORCE_LINK_SPEEDS2_", "100GB 100GB 100GB",
                         "200GB_PAM4_56 200GB_PAM4_56 200GB", "400GB_PAM4_56 400GB_PAM4_56 400GB",
                         "400GB_PAM4_112 400GB_PAM4_112 400GB"))
NRZ = Fields(bnxt.PORT_PHY_CFG_REQ_ENABLES_AUTO_LINK_SPEED_MASK, "auto_link_speed_mask", 0, "force_link_speed",
             "support_speeds", "auto_link_speed_mask", "force_link_speed",
             _speeds(f"{CFG}AUTO_LINK_SPEED_MASK_", f"{CFG}FORCE_LINK_SPEED_", "100GB 100GB 100GB"))
PAM4 = Fields(bnxt.PORT_PHY_CFG_REQ_ENABLES_AUTO_PAM4_LINK_SPEED_MASK, "auto_link_pam4_speed_mask",
              bnxt.PORT_PHY_CFG_REQ_ENABLES_FORCE_PAM4_LINK_SPEED, "force_pam4_link_speed",
              "support_pam4_speeds", "auto_pam4_link_speed_mask", "force_pam4_link_speed",
              _speeds(f"{CFG}AUTO_LINK_PAM4_SPEED_MASK_", f"{CFG}FORCE_PAM4_LINK_SPEED_", "50G 50GB 50GB",
                      "100G 100GB 100GB", "200G 200GB 200GB"))


class Phy:
    """The PHY of `port`: it sets the port's `up` and `speed`, and calls `on_change` when the link goes up or down by
    its own doing (training done, forced down, reset); `interface_up` is the driver's FUNC_DRV_IF_CHANGE."""

    def __init__(self, port: Port, speeds2: bool, on_change: Callable[[], None]) -> None:
        self.port, self.on_change = port, on_change
        self.families = (SPEEDS2,) if speeds2 else (NRZ, PAM4)
        self.delay = DEFAULT_LINK_DELAY_MS / 1000
        self.interface_up = False
        self.forced_down = True  # as bnxt_en's close leaves it
        self.cable = True  # a link partner on the wire (the debug channel's link_down / link_up pull and plug it)
        self.auto_mode = bnxt.PORT_PHY_CFG_REQ_AUTO_MODE_SPEED_MASK  # autoneg, advertising every speed
        self.advertised = {family.auto_mask: sum(s.mask for s in family.speeds) for family in self.families}
        self.forced: Speed | None = None
        self.training = False
        self._due: float | None = None  # when training ends (time.monotonic()), once the shell has timed it

    # -- time ----------------------------------------------------------------------------------------------------------
    @property
    def due(self) -> float | None:
        """When the shell must call `tick` next: None while not training, 0.0 (at once) until it has timed it."""
        return (self._due or 0.0) if self.training else None

    def tick(self, now: float) -> None:
        """Time passes (the I/O shell calls this every step): a link that trains comes up `delay` after training
        began, if nothing took it down meanwhile."""
        if not self.training:
            return
        if self._due is None:
            self._due = now + self.delay
        if now >= self._due:
            self.training, self._due = False, None
            self._set(self.cable and not self.forced_down)

    def _set(self, up: bool) -> None:
        if up == self.port.up:
            return
        self.port.up = up
        self.port.speed = self._speed().link_speed if up else 0
        self.on_change()

    def _speed(self) -> Speed:
        """The speed the link comes up at: the forced one, or the fastest advertised (the partner takes every one)."""
        if self.forced is not None:
            return self.forced
        offered = [s for f in self.families for s in f.speeds if self.advertised[f.auto_mask] & s.mask]
        return max(offered, key=lambda s: s.link_speed)

    # -- the cable (the debug channel) ---------------------------------------------------------------------------------
    def plug(self, cable: bool) -> None:
        """Pull (False) or plug (True) the cable: a configured link is up again at once, a forced-down one stays
        down. The caller reports LINK_STATUS_CHANGE."""
        self.cable = cable
        up = cable and not self.forced_down and not self.training
        self.port.up, self.port.speed = up, self._speed().link_speed if up else 0

    # -- commands ------------------------------------------------------------------------------------------------------
    def interface(self, up: bool) -> None:
        """FUNC_DRV_IF_CHANGE (or the driver gone: False)."""
        self.interface_up = up

    def configure(self, request: Any, note: Callable[[str], None]) -> None:
        """PORT_PHY_CFG's link part (its loopback is the firmware's): FORCE_LINK_DWN takes the link down and keeps it
        so; link settings are checked and kept, and with RESET_PHY after FUNC_DRV_IF_CHANGE(UP) the link retrains
        with them. `note` records why a link stays down."""
        flags = request.flags
        if flags & FORCE_LINK_DOWN:
            self.forced_down, self.training, self._due = True, False, None
            self._set(False)
            return
        if not flags & (RESET_PHY | RESTART_AUTONEG | FORCE):
            return  # no link settings (a loopback change)
        self._settings(request)
        if not flags & RESET_PHY:
            if self.forced_down:
                note("link settings without RESET_PHY: the forced-down link stays down until a PHY reset")
            return
        if not self.interface_up:
            note("RESET_PHY before FUNC_DRV_IF_CHANGE(UP): the link stays down (bnxt_en's open sends IF_CHANGE first)")
            return
        self.forced_down, self.training, self._due = False, True, None
        self._set(False)  # the PHY resets: a link that was up drops, and trains again

    def _settings(self, request: Any) -> None:
        flags, enables = request.flags, request.enables
        if flags & RESTART_AUTONEG and flags & FORCE:
            raise CommandError(INVALID_PARAMS, "flags FORCE and RESTART_AUTONEG together")
        others = [f for f in (SPEEDS2, NRZ, PAM4) if f not in self.families]
        used = [f.auto_mask for f in others if enables & f.auto_enable or f.force_enable and enables & f.force_enable]
        if used:
            raise CommandError(INVALID_PARAMS, f"{', '.join(used)}: this PHY takes the "
                                               f"{'speeds2' if self.families == (SPEEDS2,) else 'NRZ and PAM4'} fields "
                                               "(PORT_PHY_QCAPS flags2 SPEEDS2_SUPPORTED)")
        if flags & FORCE:
            self.forced = self._forced_speed(request)
            return
        if enables & bnxt.PORT_PHY_CFG_REQ_ENABLES_AUTO_MODE:
            if request.auto_mode not in AUTO_MODES:
                raise CommandError(INVALID_PARAMS, f"auto_mode {request.auto_mode}: this PHY takes ALL_SPEEDS (1) or "
                                                   "SPEED_MASK (4)")
            self.auto_mode, self.forced = request.auto_mode, None
        advertised = dict(self.advertised)
        for family in self.families:
            supported = sum(s.mask for s in family.speeds)
            if self.auto_mode == bnxt.PORT_PHY_CFG_REQ_AUTO_MODE_ALL_SPEEDS:
                advertised[family.auto_mask] = supported
            elif enables & family.auto_enable:
                mask = getattr(request, family.auto_mask)
                if mask & ~supported:
                    raise CommandError(INVALID_PARAMS, f"{family.auto_mask} {mask:#x}: this PHY offers {supported:#x}")
                advertised[family.auto_mask] = mask
        if not any(advertised.values()):
            raise CommandError(INVALID_PARAMS, "autoneg advertising no speed")
        self.advertised = advertised

    def _forced_speed(self, request: Any) -> Speed:
        for family in self.families:
            code = getattr(request, family.force)
            if family.force_enable and not request.enables & family.force_enable:
                continue
            for speed in family.speeds:
                if code == speed.force:
                    return speed
        raise CommandError(INVALID_PARAMS, "FORCE without a forced speed this PHY has: " + ", ".join(
            f"{f.force} {[hex(s.force) for s in f.speeds]}" for f in self.families))

    # -- what the firmware reports -------------------------------------------------------------------------------------
    def qcaps(self) -> dict[str, Any]:
        """PORT_PHY_QCAPS: the speeds this PHY supports and whether it is a SPEEDS2 one."""
        masks = {family: sum(s.mask for s in family.speeds) for family in self.families}
        if self.families == (SPEEDS2,):
            return {"flags2": bnxt.PORT_PHY_QCAPS_RESP_FLAGS2_SPEEDS2_SUPPORTED, "port_cnt": 1,
                    "supported_speeds2_auto_mode": masks[SPEEDS2], "supported_speeds2_force_mode": masks[SPEEDS2]}
        return {"port_cnt": 1, "supported_speeds_auto_mode": masks[NRZ], "supported_speeds_force_mode": masks[NRZ],
                "supported_pam4_speeds_auto_mode": masks[PAM4], "supported_pam4_speeds_force_mode": masks[PAM4]}

    def qcfg(self) -> dict[str, Any]:
        """PORT_PHY_QCFG's link and PHY settings."""
        up = self.port.up
        fields: dict[str, Any] = {
            "link": bnxt.PORT_PHY_QCFG_RESP_LINK_LINK if up else bnxt.PORT_PHY_QCFG_RESP_LINK_NO_LINK,
            "link_speed": self.port.speed if up else 0, "duplex_cfg": bnxt.PORT_PHY_QCFG_RESP_DUPLEX_CFG_FULL,
            "duplex_state": bnxt.PORT_PHY_QCFG_RESP_DUPLEX_STATE_FULL,
            "auto_mode": bnxt.PORT_PHY_QCFG_RESP_AUTO_MODE_NONE if self.forced else self.auto_mode,
            "link_down_reason": 0 if self.cable else bnxt.PORT_PHY_QCFG_RESP_LINK_DOWN_REASON_CABLE_REMOVED}
        if self.families == (SPEEDS2,):
            fields["option_flags"] = bnxt.PORT_PHY_QCFG_RESP_OPTION_FLAGS_SPEEDS2_SUPPORTED
        for family in self.families:
            fields[family.qcfg_support] = sum(s.mask for s in family.speeds)
            fields[family.qcfg_auto] = self.advertised[family.auto_mask]
            fields[family.qcfg_force] = self.forced.force if self.forced in family.speeds else 0
        return fields
