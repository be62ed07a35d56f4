"""The options an emulated NIC takes (emulator.py reads them), and their checks, run before a process starts."""
from __future__ import annotations

import ipaddress
import os
from typing import Any

from .pcie import DEFAULT_PCIE_PATH, PCIE_PATHS
from .phy import DEFAULT_LINK_DELAY_MS
from .port import DEFAULT_MTU as DEFAULT_PORT_MTU
from .port import check_mtu
from .profiles import DEFAULT_PROFILE, PROFILES

FAULTS = ("loss", "dup", "reorder", "corrupt")  # wire faults, each a probability per packet
TRANSPORTS = ("udp", "raw")
# Every option the emulator reads, plus netns and process, which place the NIC's process.
OPTIONS = ("ip", "mac", "fw_latency_us", "transport", *FAULTS, "seed", "pcap", "pcap_max_bytes", "netns", "port_mtu",
           "profile", "pcie_path", "process", "link_delay_ms")


def check_options(options: dict[str, Any]) -> dict[str, Any]:
    """The options as the emulator takes them (None means the default); ValueError naming any it would choke on,
    so that it is refused before a process starts."""
    options = {key: value for key, value in options.items() if value is not None}
    unknown = sorted(set(options) - set(OPTIONS))
    if unknown:
        raise ValueError(f"unknown emulated-NIC option{'s' * (len(unknown) > 1)} {', '.join(unknown)}; "
                         f"valid options: {', '.join(OPTIONS)}")
    for name in FAULTS:
        value = options.get(name, 0.0)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < 1:
            raise ValueError(f"{name}={value!r}: a fault probability must be a number in [0, 1)")
    if options.get("transport", "udp") not in TRANSPORTS:
        raise ValueError(f"transport={options['transport']!r}: choose one of {', '.join(TRANSPORTS)}")
    if "ip" in options:
        try:
            ip = ipaddress.IPv4Address(str(options["ip"]))
        except ValueError:
            raise ValueError(f"ip={options['ip']!r} is not an IPv4 address") from None
        if ip.is_unspecified or ip.is_multicast:
            raise ValueError(f"ip={options['ip']!r}: a NIC needs a unicast address")
        options["ip"] = str(ip)
    latency = options.get("fw_latency_us", 0)
    if isinstance(latency, bool) or not isinstance(latency, (int, float)) or not 0 <= latency <= 1e7:  # nan, inf
        raise ValueError(f"fw_latency_us={latency!r}: must be a number >= 0, at most 1e7 (10 s a command)")
    delay = options.get("link_delay_ms", DEFAULT_LINK_DELAY_MS)
    if isinstance(delay, bool) or not isinstance(delay, (int, float)) or not 0 <= delay <= 60_000:  # nan, inf
        raise ValueError(f"link_delay_ms={delay!r}: must be a number >= 0, at most 60000 (a minute of link training)")
    if options.get("profile", DEFAULT_PROFILE) not in PROFILES:
        raise ValueError(f"profile={options['profile']!r}: choose one of {', '.join(PROFILES)}")
    if options.get("pcie_path", DEFAULT_PCIE_PATH) not in PCIE_PATHS:
        raise ValueError(f"pcie_path={options['pcie_path']!r}: choose one of {', '.join(PCIE_PATHS)}")
    seed = options.get("seed", 0)
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ValueError(f"seed={seed!r}: must be an int")
    check_mtu(options.get("port_mtu", DEFAULT_PORT_MTU))
    mac = options.get("mac")
    if mac is not None:
        try:
            if len(bytes.fromhex(mac.replace(":", ""))) != 6:
                raise ValueError
        except (AttributeError, ValueError):
            raise ValueError(f"mac={mac!r}: expected six hex bytes like 02:0a:f0:00:00:01") from None
    if "pcap" in options:
        options["pcap"] = os.fspath(options["pcap"])
    limit = options.get("pcap_max_bytes", 24)
    if isinstance(limit, bool) or not isinstance(limit, int) or limit < 24:
        raise ValueError(f"pcap_max_bytes={limit!r}: must be an int >= 24 (the pcap file header)")
    for name in ("pcap", "netns", "process"):
        if name in options and not isinstance(options[name], str):
            raise ValueError(f"{name}={options[name]!r}: must be a string")
    return options
