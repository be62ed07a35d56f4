"""OpenSSH's sshd for the peer tests, next to the asyncssh server of sshd.py: the one users run, which (unlike
sshd.py) does not signal a command when its channel closes; the command only sees its stdin and stdout close.

`OpenSSHServer(directory, host_key, authorized_key).start()` runs `sshd -D -f CONFIG -p PORT` on 127.0.0.1 on a free
port, with its config, log and pid file in `directory`: the system's sshd configuration is neither read nor changed.
Where sshd is missing or cannot start, `start` raises `Unavailable` with the reason (the tests skip with it).
"""
from __future__ import annotations

import os
import shutil
import subprocess
import time
from pathlib import Path

from tests.support.processes import free_port

SSHD_DIRS = "/usr/sbin:/usr/local/sbin:/usr/bin:/usr/local/bin"
PRIVSEP_DIR = "/run/sshd"  # Debian's sshd, as root, insists on it; its service unit makes it at start


class Unavailable(Exception):
    """sshd cannot run here; the message says why."""


class OpenSSHServer:
    """sshd on 127.0.0.1, public-key authentication only (the key in `authorized_key`), SFTP by its own sftp-server."""

    def __init__(self, directory: Path, host_key: str, authorized_key: str) -> None:
        self.directory = directory
        self.host_key, self.authorized_key = host_key, authorized_key
        self.log = directory / "sshd.log"
        self.port = 0
        self.process: subprocess.Popen | None = None

    def _config(self, sftp_server: str) -> Path:
        config = self.directory / "sshd_config"
        config.write_text(
            f"ListenAddress 127.0.0.1\nHostKey {self.host_key}\nAuthorizedKeysFile {self.authorized_key}\n"
            f"PidFile {self.directory / 'sshd.pid'}\n"
            "StrictModes no\n"  # the keys live under /tmp, which is world-writable
            "PubkeyAuthentication yes\nPasswordAuthentication no\nKbdInteractiveAuthentication no\nUsePAM no\n"
            "PermitRootLogin prohibit-password\nLogLevel VERBOSE\n"
            f"Subsystem sftp {sftp_server}\n")
        return config

    def start(self, timeout: float = 10.0) -> int:
        """Start sshd and wait until it listens; its port."""
        sshd = shutil.which("sshd", path=SSHD_DIRS)
        if sshd is None:
            raise Unavailable("OpenSSH's sshd is not installed (.ci/run installs Debian's openssh-server)")
        sftp_server = next((path for path in ("/usr/lib/openssh/sftp-server", "/usr/libexec/sftp-server",
                                              "/usr/libexec/openssh/sftp-server") if os.path.exists(path)),
                           "internal-sftp")
        if os.geteuid() == 0 and not os.path.isdir(PRIVSEP_DIR):
            try:
                os.makedirs(PRIVSEP_DIR, 0o755)
            except OSError as exc:
                raise Unavailable(f"sshd needs {PRIVSEP_DIR}: {exc}") from None
        config = self._config(sftp_server)
        for _ in range(3):  # another process may take the free port before sshd binds it
            self.port = free_port()
            offset = self.log.stat().st_size if self.log.exists() else 0
            self.process = subprocess.Popen([sshd, "-D", "-f", str(config), "-p", str(self.port), "-E", str(self.log)],
                                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                            stderr=subprocess.STDOUT)
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline and self.process.poll() is None:
                if f"Server listening on 127.0.0.1 port {self.port}" in self.log_text(offset):
                    return self.port
                time.sleep(0.02)
            self.stop()
            reason = self.log_text(offset).strip().splitlines()
            if not any("Address already in use" in line for line in reason):
                raise Unavailable(f"sshd did not start: {reason[-1] if reason else 'no log'}")
        raise Unavailable("sshd found no free port")

    def log_text(self, offset: int = 0) -> str:
        try:
            with open(self.log, errors="replace") as log:
                log.seek(offset)
                return log.read()
        except FileNotFoundError:
            return ""

    def commands_started(self) -> int:
        """Commands sshd ran (sessions it started for a command, not for a subsystem such as SFTP)."""
        return self.log_text().count("Starting session: command")

    def stop(self) -> None:
        """Stop the listener (SIGTERM). Sessions still open keep their own sshd processes, as in production."""
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(5)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
