"""`server`: an SSH server on 127.0.0.1 for the peer tests (tests/support/ssh_servers.py): the asyncssh one in this
process, or OpenSSH's sshd where a test is parametrized with `@BOTH_SERVERS` (skipped with the reason where it cannot
run)."""
import anyio
import pytest

from tests.support import openssh, sshd
from tests.support.ssh_servers import Server


@pytest.fixture
async def server(request, tmp_path):
    keys = sshd.make_keys(str(tmp_path))
    if getattr(request, "param", "asyncssh") == "openssh":
        daemon = openssh.OpenSSHServer(tmp_path, keys["host"], keys["client"] + ".pub")
        try:
            port = daemon.start()
        except openssh.Unavailable as exc:
            pytest.skip(str(exc))
        try:
            yield Server("openssh", tmp_path, keys, port, daemon.commands_started)
        finally:
            daemon.stop()
        return
    home = tmp_path / "home"  # the remote commands' working directory: aiofabric is not importable from it
    home.mkdir()
    acceptor = await sshd.start_server("127.0.0.1", 0, keys["host"], keys["client"] + ".pub", str(home))
    before = len(sshd.STARTED)
    try:
        yield Server("asyncssh", tmp_path, keys, acceptor.sockets[0].getsockname()[1],
                     lambda: len(sshd.STARTED) - before)
    finally:
        acceptor.close()
        with anyio.move_on_after(5):  # let the handlers reap their commands before the loop closes
            while sshd.CHILDREN:
                await anyio.sleep(0.05)
