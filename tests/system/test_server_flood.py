"""`bench --server` and `lat --server` under a flood of TCP connections: a server process whose descriptors are few
(RLIMIT_NOFILE 64, so accept(2) fails with EMFILE at once) takes a flood of connections from this test while it
serves a client, and lives: the client being served finishes its run, and the next client is served too.

Loopback only; the flood is a bounded number of connections, held for a moment and closed.
"""
import json
import resource
import signal
import socket
import subprocess
import time

from tests.support.processes import CLI, ServerProcess

NOFILE = 32  # a served bench client needs up to 27 of the server's descriptors (21 mid-run): a flood gets the rest
FLOOD = 300  # connections: several times what the server could hold


def _few_descriptors() -> None:
    resource.setrlimit(resource.RLIMIT_NOFILE, (NOFILE, NOFILE))


def _flood(port: int) -> int:
    """FLOOD connections at once (non-blocking connects into the listen backlog), held 1 s, closed; how many
    connected."""
    socks, connected = [], 0
    try:
        for _ in range(FLOOD):
            sock = socket.socket()
            sock.setblocking(False)
            socks.append(sock)
            if sock.connect_ex(("127.0.0.1", port)) in (0, 115):  # EINPROGRESS
                connected += 1
        time.sleep(1.0)  # the server accepts them meanwhile: without descriptors to spare, EMFILE
    finally:
        for sock in socks:
            sock.close()
    return connected


def test_a_flood_of_connections_neither_kills_the_server_nor_cuts_off_its_client(tmp_path):
    endless = ("--run-infinitely", "-D", "0.5")  # the server's flags are its clients'
    server = ServerProcess(tmp_path, "--forever", *endless, preexec_fn=_few_descriptors)
    try:
        # --run-infinitely prints perftest's banner once the QPs are set up: then the client's setup on the server
        # is over (the descriptors it needs are open) and its run is under way
        client = subprocess.Popen([*CLI, "bench", "write", "127.0.0.1", "--port", str(server.port), *endless,
                                   "--json"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            assert client.stderr.readline(), client.communicate()  # the table goes to stderr with --json
            assert _flood(server.port) == FLOOD
            assert client.poll() is None, client.communicate()
            client.send_signal(signal.SIGINT)  # the graceful stop of --run-infinitely
            out, err = client.communicate(timeout=60)
        finally:
            if client.poll() is None:
                client.kill()
        assert client.returncode == 0, out[-2000:] + err[-3000:] + server.log.read_text()[-3000:]
        assert json.loads(out.splitlines()[-1])["verified"]
        assert server.process.poll() is None, server.log.read_text()[-3000:]
        log = server.log.read_text()
        assert "accept failed: Too many open files; retrying every 0.1 s (further failures are counted)" in log
        assert log.count("turned away") == 20  # the first 20 one by one, then counted

        # the next client is served by the same server, the flood long gone
        again = subprocess.Popen([*CLI, "bench", "write", "127.0.0.1", "--port", str(server.port), *endless,
                                  "--json"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            assert again.stderr.readline(), again.communicate()
            again.send_signal(signal.SIGINT)
            out, err = again.communicate(timeout=60)
        finally:
            if again.poll() is None:
                again.kill()
        assert again.returncode == 0, out[-2000:] + err[-3000:] + server.log.read_text()[-3000:]
        assert json.loads(out.splitlines()[-1])["verified"]
    finally:
        assert server.stop() == 130, server.log.read_text()[-3000:]
