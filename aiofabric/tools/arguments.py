"""argparse value types every command shares: each refuses, naming the value and the range, whatever its flag cannot
hold, so a usage error exits 2 before anything runs ("argument --ranks: must be in [1, 16], not 0"). And the flags of
the emulated wire and NICs, which bench, lat and the collectives take alike (options.WireOptions holds their
values)."""
from __future__ import annotations

import argparse
import ipaddress
import math
from typing import Any, Callable, TypeAlias

from .units import parse_size
from ..pci import ADDRESS
from ..pci.emulated import DEFAULT_PROFILE, FAULTS, PROFILES

Subcommands: TypeAlias = "argparse._SubParsersAction[Any]"  # where a command adds its parser (cli.Parser's)


def _range_text(low: int, high: float) -> str:
    return f"at least {low}" if high == math.inf else f"in [{low}, {int(high)}]"


def integer(low: int, high: float = math.inf, why: str = "") -> Callable[[str], int]:
    """An integer in [low, high] ("0x10" and "1_000" are not: perftest's flags are decimal); `why` ends a refusal."""
    def convert(text: str) -> int:
        try:
            value = int(text.strip(), 10)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"must be {_range_text(low, high)}, not {value}{why}")
        return value
    convert.__name__ = "integer"
    return convert


positive_int = integer(1)


def sized(low: int = 0, high: float = math.inf, why: str = "") -> Callable[[str], int]:
    """Bytes ("4096", "64K", "1M": powers of 1024) in [low, high]."""
    def convert(text: str) -> int:
        try:
            value = parse_size(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"must be a size {'of ' * (high == math.inf)}{_range_text(low, high)}, "
                                             f"not {value}{why}")
        return value
    convert.__name__ = "size"
    return convert


size = sized()


def _number(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None


def seconds(text: str) -> float:
    """A positive, finite number of seconds (a timeout: nan or inf would never end, or end at once)."""
    value = _number(text)
    if not 0 < value < math.inf:
        raise argparse.ArgumentTypeError(f"must be a positive, finite number of seconds, not {text}")
    return value


def seconds_or_zero(text: str) -> float:
    """A finite number of seconds, zero included (a margin)."""
    value = _number(text)
    if not 0 <= value < math.inf:
        raise argparse.ArgumentTypeError(f"must be a finite number of seconds of at least 0, not {text}")
    return value


def probability(text: str) -> float:
    """A per-packet probability in [0, 1) (1 would drop, or damage, every packet: nothing would get through)."""
    value = _number(text)
    if not 0 <= value < 1:
        raise argparse.ArgumentTypeError(f"must be a probability in [0, 1), not {text}")
    return value


def port_number(text: str) -> int:
    """A TCP port; 0 lets the OS choose (a server's)."""
    value = integer(0)(text)
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"a port is in [0, 65535], not {value}")
    return value


def ipv4(text: str) -> str:
    """A NIC's IPv4 address (its GID is ::ffff:a.b.c.d): unicast."""
    try:
        address = ipaddress.IPv4Address(text.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an IPv4 address (a.b.c.d)") from None
    if address.is_unspecified or address.is_multicast:
        raise argparse.ArgumentTypeError(f"{text}: a NIC needs a unicast address")
    return str(address)


def ipv4_or_ssh(text: str) -> str:
    """A remote NIC's IPv4 address, or 'ssh': the address the SSH connection reached."""
    return "ssh" if text == "ssh" else ipv4(text)


def readable_file(text: str) -> str:
    """A file that exists and can be read (an SSH identity: refused here rather than as an SSH failure later)."""
    try:
        with open(text, "rb"):
            pass
    except OSError as exc:
        raise argparse.ArgumentTypeError(f"{text}: cannot read it: {exc.strerror or exc}") from None
    return text


def pci_address(text: str) -> str:
    """A PCI address (domain:bus:device.function)."""
    if not ADDRESS.fullmatch(text.lower()):
        raise argparse.ArgumentTypeError(f"bad PCI address {text!r}: expected domain:bus:device.function, "
                                         "e.g. 0000:41:00.0")
    return text.lower()


def add_wire_flags(parser: Any) -> None:
    """The emulated wire's faults and capture (bench, lat, the collectives)."""
    for fault in FAULTS:
        parser.add_argument(f"--{fault}", type=probability, default=0.0, metavar="P",
                            help=f"probability of {fault} per packet on the emulated wire")
    parser.add_argument("--seed", type=int, default=0, help="seed of the wire faults (default 0)")
    parser.add_argument("--pcap", metavar="FILE", help="write every packet NIC 0 sends and receives (NIC N: FILE.N)")
    parser.add_argument("--profile", choices=PROFILES, help=f"the chip and firmware this host's emulated NICs play "
                                                           f"(default {DEFAULT_PROFILE}; see docs/emulator.md)")
