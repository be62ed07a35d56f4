"""The command line as other processes run it: `aiofabric ...` with this interpreter (CLI), a free TCP port on
127.0.0.1, and a `bench|lat --server` process (ServerProcess) with the tight limits a server facing hostile clients
runs under (LIMITS)."""
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

CLI = [sys.executable, "-m", "aiofabric"]
IDLE = 2.0  # seconds: the idle timeout of LIMITS
LIMITS = ["--idle-timeout", str(IDLE), "--max-memory", "64M", "--max-requests", "8", "--max-line", "64K",
          "--max-depth", "16", "--max-nics", "1"]


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class ServerProcess:
    """`aiofabric bench write --server` (or `lat`, another `test`) with `flags` (a bench client must run with the same
    symmetric ones), as a process in `workdir` on 127.0.0.1 and a port the OS picks: its port, log (stderr) and
    output (stdout)."""

    def __init__(self, workdir: Path, *flags: str, command: str = "bench", test: str = "write",
                 preexec_fn: Callable[[], None] | None = None) -> None:
        self.workdir = workdir
        self.log, self.out = workdir / "server.log", workdir / "server.out"
        with open(self.log, "w") as log, open(self.out, "w") as out:
            self.process = subprocess.Popen([*CLI, command, test, "--server", "--bind", "127.0.0.1", "--port", "0",
                                             *flags], cwd=workdir, stdout=out, stderr=log, preexec_fn=preexec_fn)
        deadline = time.monotonic() + 30
        while not (found := re.search(r"TCP port (\d+)", self.log.read_text())):
            assert self.process.poll() is None and time.monotonic() < deadline, self.log.read_text()
            time.sleep(0.05)
        self.port = int(found[1])

    def children(self) -> list[int]:
        """The emulated NICs' processes (the server's children)."""
        pids = []
        for entry in os.listdir("/proc"):
            try:
                if entry.isdigit() and int(Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[1]) \
                        == self.process.pid:
                    pids.append(int(entry))
            except (OSError, IndexError, ValueError):
                continue
        return pids

    def rss_mb(self) -> float:
        status = Path(f"/proc/{self.process.pid}/status").read_text()
        return int(re.search(r"VmRSS:\s+(\d+) kB", status)[1]) / 1024

    def stop(self) -> int:
        """SIGINT, as Ctrl-C: its exit code."""
        self.process.send_signal(signal.SIGINT)
        try:
            return self.process.wait(30)
        finally:
            if self.process.poll() is None:
                self.process.kill()
