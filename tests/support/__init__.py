"""What the tests share, one copy each: the in-process emulator harnesses (emulator.py: hosts on an in-memory wire;
firmware.py: just enough of a driver), emulated NICs with connected QP pairs (nics.py), the fake sysfs tree
(sysfs.py), the SSH servers (sshd.py, openssh.py, ssh_servers.py) and network-namespace hosts (netns.py), the
command line as a process and a `bench|lat --server` process (processes.py), and a rendezvous server
(rendezvous.py). Fixtures are in the conftest.py files."""
from pathlib import Path

CHECKOUT = Path(__file__).resolve().parents[2]  # the repository these tests belong to
