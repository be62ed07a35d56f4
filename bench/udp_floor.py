"""The floor of a one-way hop through an emulator process: 64 B UDP datagrams ping-ponged between two Python
processes on loopback (standard library only: bench/hotpath.py runs it beside trees of any age)."""
from __future__ import annotations

import multiprocessing
import multiprocessing.connection
import socket
import statistics
import time


class FloorError(RuntimeError):
    """The far end did not start, or a ping got no answer."""


def _echo(conn: multiprocessing.connection.Connection, address: str, count: int) -> None:
    """The far end: echo up to `count` datagrams; stop at the first 5 s of silence."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.bind((address, 0))
        sock.settimeout(5.0)
        conn.send(sock.getsockname())
        conn.close()
        for _ in range(count):
            try:
                data, peer = sock.recvfrom(2048)
            except TimeoutError:
                return
            sock.sendto(data, peer)


def udp_pingpong(addresses: tuple[str, str], trips: int, warmup: int = 100) -> float:
    """Median half round trip (us) of `trips` pings after `warmup`, from addresses[1] to an echo on addresses[0]."""
    context = multiprocessing.get_context("spawn")
    parent, child = context.Pipe(duplex=False)
    echo = context.Process(target=_echo, args=(child, addresses[0], warmup + trips), daemon=True)
    echo.start()
    try:
        if not parent.poll(30):
            raise FloorError("the echo process did not start")
        far = parent.recv()
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
            sock.bind((addresses[1], 0))
            sock.settimeout(2.0)
            payload, rtts = bytes(64), []
            for _ in range(warmup + trips):
                started = time.perf_counter_ns()
                sock.sendto(payload, far)
                try:
                    sock.recvfrom(2048)
                except TimeoutError:
                    raise FloorError("a ping got no answer in 2 s") from None
                rtts.append(time.perf_counter_ns() - started)
        return statistics.median(rtts[warmup:]) / 2 / 1e3
    finally:
        echo.join(10)
        if echo.is_alive():
            echo.kill()
            echo.join(5)
