"""`--hosts`: the hosts of a ring or of a job, `[user@]host[:port]` each, with MPI hostfiles' slot counts in Open
MPI's syntax (PRRTE's hostfile parser is the reference): `node01 slots=4`, `node02 slots=2 max_slots=8`, comments
from `#`, blank lines. Pure.

A host with slots=N (count=N and cpu=N say the same) takes N ranks; without it, one; with slots=0, none. max_slots=M
(or slots_max, max-slots, ...: Open MPI's cap on oversubscribing a host) may not be below the slots, as Open MPI
refuses it, and alone it gives the host M slots. A host listed more than once takes all its slots, and the ranks
fill each host's slots in turn, in the order the hosts first appear (as mpirun maps by slot). Unlike an MPICH
machine file's `host:N`, `:N` is the SSH port.
"""
from __future__ import annotations

import re
from typing import Sequence

from .client import parse_host

Host = tuple[str | None, str, int]  # (user, host, SSH port)
SLOTS = ("slots", "count", "cpu")
MAX_SLOTS = tuple(f"{a}{sep}{b}" for word in ("slots", "cpu", "count") for a, b in ((word, "max"), ("max", word))
                  for sep in "_-")
MAX_RANKS = 4096  # slots of one hostfile: a rank is an SSH connection and a process
SETTING = re.compile(r"\s*=\s*")


def host_slots(entries: Sequence[str], default_port: int, *, numbered: bool) -> list[Host]:
    """The hosts of `entries` (a file's lines when `numbered`, whose errors name the line; else a list's items),
    one per slot, each host's slots together. ValueError names what is wrong."""
    slots: dict[Host, int] = {}
    for number, entry in enumerate(entries, 1):
        text = SETTING.sub("=", entry.split("#")[0].strip())
        if not text:
            continue
        try:
            host, count = _entry(text, default_port)
        except ValueError as error:
            raise ValueError(f"line {number}: {error}" if numbered else str(error)) from None
        slots[host] = slots.get(host, 0) + count
        if sum(slots.values()) > MAX_RANKS:
            raise ValueError(f"more than {MAX_RANKS} slots in all")
    return [host for host, count in slots.items() for _ in range(count)]


def _entry(text: str, default_port: int) -> tuple[Host, int]:
    """One host and its slots from `[user@]host[:port] [slots=N] [max_slots=M]`."""
    spec, *settings = text.split()
    host = parse_host(spec, default_port)
    slots: int | None = None
    most: int | None = None
    for setting in settings:
        key, equals, value = setting.partition("=")
        if not equals or key.lower() not in SLOTS + MAX_SLOTS:
            raise ValueError(f"{spec}: {setting!r} is not a setting of a host here (slots=N, max_slots=M)")
        if not value.isascii() or not value.isdecimal():
            raise ValueError(f"{spec}: {setting!r}: {key} is a whole number, 0 or more")
        if key.lower() in SLOTS:
            if slots is not None:
                raise ValueError(f"{spec}: the slots are given twice")
            slots = int(value)
        else:
            most = int(value)
    if most is not None and slots is not None and most < slots:
        raise ValueError(f"{spec}: max_slots={most} is below slots={slots}")
    return host, slots if slots is not None else most if most is not None else 1


def local_ranks(hosts: Sequence[Host]) -> list[int]:
    """Each slot's rank among the slots of its host."""
    seen: dict[Host, int] = {}
    ranks = []
    for host in hosts:
        ranks.append(seen.get(host, 0))
        seen[host] = ranks[-1] + 1
    return ranks
