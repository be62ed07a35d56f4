"""Classic pcap files of the emulated wire, for Wireshark and tshark (which decode UDP 4791 as RRoCE).

Classic pcap rather than pcapng because every tool reads it and it is 24 bytes of header plus 16 per frame.
Frames are Ethernet II without FCS (LINKTYPE_ETHERNET), the way a capture on a real interface looks.
"""
from __future__ import annotations

import struct
import time
from pathlib import Path
from types import TracebackType

LINKTYPE_ETHERNET = 1
ETHERTYPE_IPV4 = 0x0800
SNAPLEN = 262144  # what tcpdump and Wireshark write; our frames are at most ~4.2 KB
_FILE_HEADER = struct.Struct("<IHHiIII")  # magic, version 2.4, thiszone, sigfigs, snaplen, linktype
_RECORD_HEADER = struct.Struct("<IIII")  # seconds, microseconds, captured length, original length


class PcapWriter:
    """Appends Ethernet frames carrying IPv4 packets to a new pcap file. Buffered: call close() (or use `with`)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._file = open(self.path, "wb")
        self._file.write(_FILE_HEADER.pack(0xA1B2C3D4, 2, 4, 0, 0, SNAPLEN, LINKTYPE_ETHERNET))

    def write(self, ipv4_packet: bytes, src_mac: bytes, dst_mac: bytes, timestamp: float | None = None) -> None:
        """Record one IPv4 packet as an Ethernet frame sent at `timestamp` (seconds since the epoch; default now)."""
        if timestamp is None:
            timestamp = time.time()
        seconds = int(timestamp)
        microseconds = min(round((timestamp - seconds) * 1e6), 999_999)
        length = 14 + len(ipv4_packet)
        self._file.write(b"".join((_RECORD_HEADER.pack(seconds, microseconds, length, length), dst_mac, src_mac,
                                   ETHERTYPE_IPV4.to_bytes(2, "big"), ipv4_packet)))

    def flush(self) -> None:
        self._file.flush()

    def close(self) -> None:
        self._file.close()

    def __enter__(self) -> PcapWriter:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 traceback: TracebackType | None) -> None:
        self.close()
