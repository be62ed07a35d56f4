"""Slurm as srun starts a job's tasks, from the variables it sets (Slurm's src/common/env.c). Pure.

A task srun started has SLURM_PROCID (its rank), SLURM_STEP_NUM_TASKS and SLURM_NTASKS (the step's tasks; with
srun -E, SLURM_NTASKS stays the job's), SLURM_LOCALID (its rank on its node), SLURM_STEP_ID (the step's number) and
SLURM_STEP_NODELIST (the step's nodes, compressed as Slurm writes host lists: `node[01-04,07],gpu5`). A batch
script (sbatch) has SLURM_PROCID=0 and the job's SLURM_NTASKS too, but it is the one process of the batch step: no
SLURM_STEP_ID (or the batch step's special ID, printed as a signed number by some versions), as in salloc's
interactive step. srun places task 0 on the first node of its step (block and cyclic distributions), so that node
is rank 0's host when nothing says otherwise.
"""
from __future__ import annotations

import re
from typing import Mapping

# Slurm's slurm.h: step IDs above SLURM_MAX_NORMAL_STEP_ID are not steps srun started
MAX_NORMAL_STEP_ID = 0xfffffff0
SPECIAL_STEPS = {0xfffffffb: "sbatch's batch script", 0xfffffffa: "salloc's interactive step",
                 0xfffffffc: "the extern step"}
NODE_LISTS = ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST")  # the step's first: its task 0's
MAX_HOSTS = 1 << 16  # hosts one list may expand to (Slurm's MAX_RANGE is 64 Ki hosts a range)
MAX_BRACKETS = 16  # in one entry (each multiplies the hosts)
SEPARATORS = " ,\t\n"
NUMBER = re.compile(r"[0-9]+")


def expand_hostlist(text: str) -> list[str]:
    """Every host of a Slurm host list, in its order: `node[01-03,07],gpu5` is node01, node02, node03, node07, gpu5.
    As Slurm's hostlist.c reads it: entries are split at commas and blanks outside brackets; an entry's last
    bracket holds ranges `lo-hi` or numbers, padded with zeros to the width `lo` is written in, and may be followed
    by a suffix; brackets before it multiply (`rack[1-2]-n[1-2]` is rack1-n1, rack1-n2, rack2-n1, rack2-n2).
    ValueError names a malformed entry."""
    hosts: list[str] = []
    for entry in _entries(text):
        if entry.count("[") > MAX_BRACKETS:
            raise ValueError(f"host list entry {entry[:80]!r}: more than {MAX_BRACKETS} brackets")
        for host in _expand(entry, entry):
            hosts.append(host)
            if len(hosts) > MAX_HOSTS:
                raise ValueError(f"{text[:80]!r}: more than {MAX_HOSTS} hosts")
    return hosts


def _entries(text: str) -> list[str]:
    """The entries of a host list: split at separators outside brackets."""
    entries, current, depth = [], "", 0
    for char in text:
        if char in SEPARATORS and depth == 0:
            if current:
                entries.append(current)
            current = ""
            continue
        if char == "[":
            depth += 1
        elif char == "]" and depth:
            depth -= 1
        current += char
    if current:
        entries.append(current)
    return entries


def _expand(pattern: str, entry: str) -> list[str]:
    """`pattern` with its brackets expanded, the last one innermost (Slurm's _push_range_list)."""
    opening = pattern.rfind("[")
    if opening < 0:
        if "]" in pattern:
            raise ValueError(f"host list entry {entry!r}: a ']' without its '['")
        return [pattern]
    closing = pattern.find("]", opening)
    if closing < 0:
        raise ValueError(f"host list entry {entry!r}: a '[' without its ']'")
    numbers = _ranges(pattern[opening + 1:closing], entry)
    suffix = pattern[closing + 1:]
    if "]" in suffix:
        raise ValueError(f"host list entry {entry!r}: a ']' without its '['")
    heads = _expand(pattern[:opening], entry)
    if len(heads) * len(numbers) > MAX_HOSTS:
        raise ValueError(f"host list entry {entry!r}: more than {MAX_HOSTS} hosts")
    return [f"{head}{number}{suffix}" for head in heads for number in numbers]


def _ranges(text: str, entry: str) -> list[str]:
    """A bracket's `1-3,07,10-12` as the numbers it names, each padded to the width its range's start is written in."""
    numbers: list[str] = []
    for part in text.split(","):
        low, dash, high = part.partition("-")
        if not NUMBER.fullmatch(low) or (dash and not NUMBER.fullmatch(high)):
            raise ValueError(f"host list entry {entry!r}: {part!r} is not a number or a range lo-hi")
        first, last = int(low), int(high) if dash else int(low)
        if first > last:
            raise ValueError(f"host list entry {entry!r}: the range {part!r} goes down")
        if last - first + len(numbers) >= MAX_HOSTS:
            raise ValueError(f"host list entry {entry!r}: more than {MAX_HOSTS} hosts")
        numbers += [str(number).zfill(len(low)) for number in range(first, last + 1)]
    return numbers


def not_a_task(environ: Mapping[str, str]) -> str | None:
    """Why this process is not a task srun started although it has SLURM_PROCID (a batch script, salloc's
    interactive step), or None when it is one."""
    text = environ.get("SLURM_STEP_ID", environ.get("SLURM_STEPID"))
    if text is None:
        return "no SLURM_STEP_ID: sbatch's batch script"
    try:
        step = int(text) & 0xffffffff  # some versions print the special IDs as signed numbers
    except ValueError:
        return f"SLURM_STEP_ID={text!r} is not a step's number"
    if step > MAX_NORMAL_STEP_ID:
        return f"SLURM_STEP_ID={text}: {SPECIAL_STEPS.get(step, 'a special step')}"
    return None


def srun_task(environ: Mapping[str, str]) -> tuple[int, int] | None:
    """(SLURM_PROCID, the step's tasks) of a task srun started; None for any other process."""
    if "SLURM_PROCID" not in environ or not_a_task(environ) is not None:
        return None
    try:
        return int(environ["SLURM_PROCID"]), int(environ.get("SLURM_STEP_NUM_TASKS", environ.get("SLURM_NTASKS", "")))
    except ValueError:
        return None


def first_host(environ: Mapping[str, str]) -> tuple[str, str] | None:
    """(the first host of the step's node list, the variable it came from), or None without a node list. A
    malformed list is a ValueError naming its variable."""
    for name in NODE_LISTS:
        if environ.get(name, "").strip():
            try:
                hosts = expand_hostlist(environ[name])
            except ValueError as error:
                raise ValueError(f"{name}: {error}") from None
            if not hosts:
                raise ValueError(f"{name}={environ[name]!r} names no host")
            return hosts[0], name
    return None
