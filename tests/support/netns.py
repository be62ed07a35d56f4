"""Test hosts in network namespaces: create them, join them with veth pairs, sweep what killed runs left behind.

Names carry the creating pid (veths: the pid modulo VETH_MODULUS, interface names have at most 15 characters), so a
run that was killed before its clean-up is swept by the next one: a namespace or veth is stale when no running process
matches its number. Addresses live only inside the namespaces the tests create.
"""
from __future__ import annotations

import contextlib
import os
import re
import shutil
import subprocess
from typing import Iterator

import pytest

VETH_MODULUS = 100000


def ip(*args: str) -> str:
    return subprocess.run(["ip", *args], check=True, capture_output=True, timeout=20, text=True).stdout


def quietly(*args: str) -> None:
    subprocess.run(["ip", *args], capture_output=True, timeout=20)


def sweep_stale_runs(namespaces: re.Pattern, veths: re.Pattern) -> list[str]:
    """Delete the namespaces and veths (group 1 of each pattern: the number in the name) whose creator is gone."""
    live = {int(entry) for entry in os.listdir("/proc") if entry.isdigit()}
    tags = {pid % VETH_MODULUS for pid in live}
    deleted = []
    for line in ip("netns", "list").splitlines():
        name = line.split()[0] if line.strip() else ""
        match = namespaces.fullmatch(name)
        if match and int(match.group(1)) not in live:
            quietly("netns", "del", name)
            deleted.append(name)
    for line in ip("-o", "link", "show", "type", "veth").splitlines():
        name = line.split(":")[1].strip().split("@")[0]
        match = veths.fullmatch(name)
        if match and int(match.group(1)) not in tags:
            quietly("link", "del", name)
            deleted.append(name)
    return deleted


def require_netns(namespaces: re.Pattern, veths: re.Pattern, first: str) -> None:
    """Skip (with the reason) where `ip netns` cannot be used; else sweep stale runs and create `first`."""
    if os.geteuid() != 0 or not shutil.which("ip"):
        pytest.skip("network namespaces need root and iproute2")
    try:
        sweep_stale_runs(namespaces, veths)
        ip("netns", "add", first)
    except subprocess.CalledProcessError as exc:
        pytest.skip(f"ip netns unavailable here: {exc.stderr.strip()}")


@contextlib.contextmanager
def two_hosts(names: tuple[str, str], veths: tuple[str, str], addresses: tuple[str, str],
              stale: tuple[re.Pattern, re.Pattern]) -> Iterator[None]:
    """Namespaces `names` joined by the veth pair `veths`, addressed /24, MTU 9000 (RoCE frames at MTU 4096 fit);
    removed afterwards, even when setting up stopped halfway."""
    require_netns(*stale, names[0])
    try:
        ip("netns", "add", names[1])
        ip("link", "add", veths[0], "type", "veth", "peer", "name", veths[1])
        for i in (0, 1):
            ip("link", "set", veths[i], "netns", names[i])
            ip("-n", names[i], "addr", "add", f"{addresses[i]}/24", "dev", veths[i])
            ip("-n", names[i], "link", "set", veths[i], "mtu", "9000", "up")
            ip("-n", names[i], "link", "set", "lo", "up")
        yield
    finally:
        for name in names:  # deleting a namespace deletes the veth end inside it, and with it the pair
            quietly("netns", "del", name)
        quietly("link", "del", veths[0])  # if it never moved
