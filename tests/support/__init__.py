"""What the tests share, one copy each (fixtures are in the conftest.py files):

- backends.py: the event loops an anyio test runs on, and how a test picks some of them;
- emulator.py, firmware.py: the emulated NIC in this process, without I/O: hosts on an in-memory wire, and just
  enough of a driver to drive its firmware;
- nics.py: emulated NICs: a name of this run's own, QP pairs connected both ways, their counters, wake-ups;
- sysfs.py: a fake sysfs tree of one PCI function;
- processes.py: the command line as a process, a free port, a `bench|lat --server` process;
- rendezvous.py: a collectives rendezvous in this process, and ranks that meet there;
- sshd.py, openssh.py, ssh_servers.py: the SSH servers the peer tests run against, and what a run leaves behind;
- netns.py: hosts in network namespaces;
- results.py: a --json line checked against the schema the package ships.
"""
from pathlib import Path

CHECKOUT = Path(__file__).resolve().parents[2]  # the repository these tests belong to
