"""Classic pcap files of the emulated wire, for Wireshark and tshark (which decode UDP 4791 as RRoCE).

Classic pcap rather than pcapng because every tool reads it and it is 24 bytes of header plus 16 per frame.
Frames are Ethernet II without FCS (LINKTYPE_ETHERNET), the way a capture on a real interface looks.
"""
from __future__ import annotations

import errno
import logging
import os
import struct
import time
from pathlib import Path
from types import TracebackType

LINKTYPE_ETHERNET = 1
ETHERTYPE_IPV4 = 0x0800
SNAPLEN = 262144  # what tcpdump and Wireshark write; our frames are at most ~4.2 KB
_FILE_HEADER = struct.Struct("<IHHiIII")  # magic, version 2.4, thiszone, sigfigs, snaplen, linktype
_RECORD_HEADER = struct.Struct("<IIII")  # seconds, microseconds, captured length, original length
HEADER_BYTES = _FILE_HEADER.size
log = logging.getLogger(__name__)


class PcapWriter:
    """Appends Ethernet frames carrying IPv4 packets to a new pcap file. Buffered: call close() (or use `with`).

    The file is made new, mode 0600: a capture shows PSNs, rkeys and addresses, so it is its owner's alone, and an
    existing file or symlink at `path` is refused rather than followed or overwritten (as root in a directory others
    can write, a planted symlink would otherwise have us clobber the file it names). `max_bytes` bounds the file,
    header included: the first record that would cross it and every one after are dropped (the capture stays a
    prefix of the traffic), counted in `dropped` and logged once."""

    def __init__(self, path: str | Path, max_bytes: int | None = None) -> None:
        if max_bytes is not None and max_bytes < HEADER_BYTES:
            raise ValueError(f"pcap max_bytes must be at least the {HEADER_BYTES}-byte file header, not {max_bytes}")
        self.path = Path(path)
        self.max_bytes, self.size, self.dropped = max_bytes, HEADER_BYTES, 0
        try:
            fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        except FileExistsError:  # a symlink too: O_EXCL never follows one
            raise FileExistsError(errno.EEXIST, "exists; refusing to overwrite it (remove it or choose another name)",
                                  str(self.path)) from None
        self._file = open(fd, "wb")
        self._file.write(_FILE_HEADER.pack(0xA1B2C3D4, 2, 4, 0, 0, SNAPLEN, LINKTYPE_ETHERNET))

    def write(self, ipv4_packet: bytes, src_mac: bytes, dst_mac: bytes, timestamp: float | None = None) -> None:
        """Record one IPv4 packet as an Ethernet frame sent at `timestamp` (seconds since the epoch; default now)."""
        length = 14 + len(ipv4_packet)
        if self.dropped or (self.max_bytes is not None and self.size + _RECORD_HEADER.size + length > self.max_bytes):
            if not self.dropped:
                log.warning("pcap %s: reached its limit of %d bytes; the packets after it are not recorded",
                            self.path, self.max_bytes)
            self.dropped += 1
            return
        if timestamp is None:
            timestamp = time.time()
        seconds = int(timestamp)
        microseconds = min(round((timestamp - seconds) * 1e6), 999_999)
        self.size += _RECORD_HEADER.size + length
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
