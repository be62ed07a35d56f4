"""nccl-tests' collectives (allreduce, reducescatter, allgather, broadcast): a size sweep over a ring of NICs, one
rank each, every element checked; the ranks in this process (--ranks), one per process under a launcher (torchrun,
mpirun, srun), or one per host started over SSH (--hosts)."""
from __future__ import annotations

import argparse
import json
import math
import os
import socket
import sys
from typing import Any, Callable

import anyio
import anyio.abc

from .ssh import add_ssh_flags, parsed_hosts, ssh_options
from ..arguments import Subcommands, add_wire_flags, integer, ipv4, ipv4_or_ssh, seconds, size, sized
from ..bench_config import MAX_NICS, MAX_SIZE
from ..options import WireOptions
from ..units import sweep
from ...collectives.layout import DTYPE_NAMES, PIECE_BYTES
from ...pci.emulated import FAULTS

# nccl-tests' binaries, without _perf: the collective each runs
COLLECTIVE_COMMANDS = {"allreduce": "allreduce", "reducescatter": "reduce_scatter", "allgather": "allgather",
                       "broadcast": "broadcast"}
DEFAULT_RANKS = 2
MAX_LOCAL_RANKS = MAX_NICS  # each rank of --ranks is an emulator process with its own DMA arena on this host
RANKS_WHY = (": each rank of --ranks is an emulator process (or a PCI function) of this host, as bench's --nics; more "
             "ranks run one per process (torchrun, mpirun, srun) or per host (--hosts)")
# the flags a launcher passes on to every rank (dest, flag)
RANK_FLAGS = (("minbytes", "-b"), ("maxbytes", "-e"), ("stepfactor", "-f"), ("iters", "-n"), ("warmup_iters", "-w"),
              ("datatype", "-d"), ("op", "-o"), ("root", "-r"), ("verify", "-c"), ("piece", "--piece"),
              ("timeout", "--timeout"), ("rendezvous_timeout", "--rendezvous-timeout"), ("size", "--size"),
              *((fault, f"--{fault}") for fault in FAULTS), ("seed", "--seed"), ("pcap", "--pcap"),
              ("profile", "--profile"))


def add_collectives(sub: Subcommands) -> None:
    for command, kind in COLLECTIVE_COMMANDS.items():
        coll = sub.add_parser(command, help=f"nccl-tests' {kind}_perf over a ring of emulated (or PCI) NICs in this "
                                            "process: a size sweep, every element checked")
        coll.add_argument("--ranks", type=integer(1, MAX_LOCAL_RANKS, RANKS_WHY),
                          help="ranks in this process, one NIC each (default 2; under torchrun, mpirun or srun: this "
                               "process is one rank of their job, rendezvous at MASTER_ADDR:MASTER_PORT)")
        coll.add_argument("--nic", default="sim", help="with a launcher: this rank's NIC (default sim)")
        coll.add_argument("--ip", type=ipv4,
                          help="with a launcher: this rank's NIC's IPv4 address (emulated: a free 127.0.0.x)")
        coll.add_argument("--nics", metavar="A,B,...", help="PCI NICs, one per rank (default: emulated NICs)")
        coll.add_argument("-b", "--minbytes", type=sized(1), default=32 << 10,
                          help="smallest size (default 32K); K/M/G suffixes are powers of 1024")
        coll.add_argument("-e", "--maxbytes", type=sized(1), default=32 << 20,
                          help="largest size (default 32M)")
        coll.add_argument("-f", "--stepfactor", type=integer(2), default=2,
                          help="multiply the size by this each step (2)")
        coll.add_argument("--size", type=size, help="one size instead of a sweep")
        coll.add_argument("-n", "--iters", type=integer(0), default=20, help="timed iterations per size (default 20)")
        coll.add_argument("-w", "--warmup_iters", type=integer(0), default=5,
                          help="untimed iterations first (default 5)")
        coll.add_argument("-d", "--datatype", default="float", choices=sorted(DTYPE_NAMES),
                          help="element type (default float)")
        coll.add_argument("-o", "--op", default="sum", choices=("sum", "prod", "min", "max"),
                          help="reduction (default sum)")
        coll.add_argument("-r", "--root", type=integer(0), default=0, help="broadcast's root rank (default 0)")
        coll.add_argument("-c", "--check", dest="verify", type=int, default=1, choices=(0, 1),
                          help="check every element of one run per size (default 1)")
        coll.add_argument("--timeout", type=seconds, default=60.0, help="seconds one collective may take before every "
                                                                     "rank fails naming what it waited for (60)")
        coll.add_argument("--rendezvous-timeout", type=seconds, default=60.0,
                          help="with a launcher: seconds for every rank to join (60)")
        coll.add_argument("--piece", type=sized(1, MAX_SIZE), default=PIECE_BYTES,
                          help="bytes per RDMA message (default 512K): pieces pipeline transfers with reductions")
        add_wire_flags(coll)
        coll.add_argument("--hosts", metavar="FILE|h1,h2", help="one rank per host, started over SSH (`python -m "
                                                              "aiofabric` there); the rendezvous is relayed over SSH")
        coll.add_argument("--remote-nic", default="sim", help="with --hosts: each host's NIC (default sim)")
        coll.add_argument("--remote-ip", type=ipv4_or_ssh,
                          help="with --hosts: each host's NIC address ('ssh': the address SSH reached)")
        add_ssh_flags(coll)
        coll.add_argument("--json", action="store_true", help="print one JSON object")
        coll.set_defaults(run=cmd_collective, kind=kind, check=_check_collective(coll))


async def cmd_collective(args: argparse.Namespace) -> dict[str, Any]:
    from ...collectives import join, local
    from ...collectives.perf import PerfConfig, run_perf
    world, sizes, ranks = args.world, args.sizes, args.rank_count  # _check_collective's
    if args.hosts:
        return await _collective_over_ssh(args)
    nics = args.nics.split(",") if args.nics else None
    options = {} if nics else WireOptions.from_args(args).nic_options()
    leader = world is None or world.rank == 0  # prints the table, as nccl-tests' rank 0 does
    config = PerfConfig(args.kind, sizes, iters=args.iters, warmup=args.warmup_iters, dtype=DTYPE_NAMES[args.datatype],
                        op=args.op, root=args.root, check=bool(args.verify),
                        progress=leader and not args.json and sys.stdout.isatty())
    if world is not None:
        async with join(world, nic=args.nic, ip=args.ip, buffer_bytes=max(sizes), piece_bytes=args.piece,
                        timeout=args.timeout, rendezvous_timeout=args.rendezvous_timeout, **options) as comm:
            result = await run_perf([comm], config)
        result["launcher"] = world.launcher
    else:
        async with local(ranks, nics=nics, buffer_bytes=max(sizes), piece_bytes=args.piece, timeout=args.timeout,
                         **options) as comms:
            result = await run_perf(comms, config)
    if not args.json and leader:
        print(_format(result))
    return result


def _check_collective(parser: argparse.ArgumentParser) -> Callable[[argparse.Namespace], None]:
    """Where the ranks run and how many there are (--ranks, --hosts, or a launcher's variables), and what depends
    on it (-r, --nics), checked before anything starts; the sweep's sizes. Sets args.world, rank_count, sizes,
    host_list."""
    def check(args: argparse.Namespace) -> None:
        from ...collectives.world import from_environment
        args.world, args.host_list = None, None
        if args.hosts is not None and args.ranks is not None:
            parser.error("--ranks and --hosts both say where the ranks run: give one (--hosts: one rank per host)")
        if args.hosts is not None:
            args.host_list = parsed_hosts(parser, args.hosts, args.port)
            if not args.host_list:
                parser.error(f"--hosts {args.hosts}: names no host")
            args.rank_count = len(args.host_list)
        elif args.ranks is None:
            try:
                args.world = from_environment(os.environ)
            except ValueError as exc:
                parser.error(str(exc))
            if args.world is not None:
                _check_resolvable(parser, args.world.addr, args.world.port)
            args.rank_count = args.world.size if args.world is not None else DEFAULT_RANKS
        else:
            args.rank_count = args.ranks
        if args.nics and len(args.nics.split(",")) != args.rank_count:
            parser.error(f"--nics names {len(args.nics.split(','))} NICs for {args.rank_count} ranks: one per rank")
        if not 0 <= args.root < args.rank_count:
            parser.error(f"-r/--root {args.root}: must be a rank in [0, {args.rank_count - 1}] ({args.rank_count} "
                         "ranks)")
        if args.size is None and args.minbytes > args.maxbytes:
            parser.error(f"-b/--minbytes {args.minbytes} is larger than -e/--maxbytes {args.maxbytes}: a sweep goes up")
        args.sizes = [args.size] if args.size is not None else sweep(args.minbytes, args.maxbytes, args.stepfactor)
    return check


def _check_resolvable(parser: argparse.ArgumentParser, host: str, port: int) -> None:
    """MASTER_ADDR names a host: one the resolver does not know is a usage error now, not a rendezvous that
    never answers (a busy resolver, EAI_AGAIN, is left to the rendezvous's retries)."""
    try:
        socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        if exc.errno != socket.EAI_AGAIN:
            parser.error(f"MASTER_ADDR={host}: cannot be resolved ({exc.strerror or exc})")
    except UnicodeError as exc:  # a label too long for IDNA
        parser.error(f"MASTER_ADDR={host!r}: not a host name ({exc})")


def _format(result: dict[str, Any]) -> str:
    from ...collectives.perf import format_table
    return format_table(result)


async def _collective_over_ssh(args: argparse.Namespace) -> dict[str, Any]:
    """One rank per host: each runs this command over SSH with the launchers' variables, meeting at a rendezvous
    served here and forwarded to each host's 127.0.0.1 over its SSH connection. Rank 0's result is the table."""
    from ...collectives.communicator import CollectiveError
    from ...collectives.rendezvous import RendezvousServer
    from ...peer.remote_run import run_remote
    hosts = args.host_list  # _check_collective's
    ssh = ssh_options(args)
    ssh.pop("command_timeout")
    flags = [word for dest, flag in RANK_FLAGS if getattr(args, dest) is not None
             for word in (flag, str(getattr(args, dest)))]
    server = RendezvousServer(len(hosts), args.rendezvous_timeout)
    listener = await anyio.create_tcp_listener(local_host="127.0.0.1")
    port = listener.extra(anyio.abc.SocketAttribute.local_port)
    results: list[Any] = [None] * len(hosts)
    failed: list[str] = []
    async with anyio.create_task_group() as group:
        group.start_soon(server.serve, listener)

        async def rank(index: int) -> None:
            user, host, ssh_port = hosts[index]
            ip = host if args.remote_ip == "ssh" else args.remote_ip
            run = await run_remote(
                host, ssh_port, user=user or args.user, args=[args.command, *flags, "--nic", args.remote_nic,
                                                              *(["--ip", ip] if ip else []), "--json"],
                env={"RANK": str(index), "WORLD_SIZE": str(len(hosts)), "AIOFABRIC_RENDEZVOUS": "external"},
                tunnel=("127.0.0.1", port), timeout=math.inf, **ssh)
            lines = run.stdout.strip().splitlines()
            result = json.loads(lines[-1]) if lines and lines[-1].startswith("{") else None
            if result is None or not result.get("ok"):
                why = result["error"] if result else (run.stopped or f"exit status {run.exit_status}; stderr: "
                                                      + " | ".join(run.stderr_tail))
                failed.append(f"rank {index} on {run.host} failed: {why}")
                ranks.cancel_scope.cancel()  # the first failure is the cause: the others would only wait for it
            results[index] = result
        async with anyio.create_task_group() as ranks:
            for index in range(len(hosts)):
                ranks.start_soon(rank, index)
        group.cancel_scope.cancel()
    if failed:
        raise CollectiveError(failed[0])
    result = {**results[0], "hosts": [f"{user + '@' if user else ''}{host}:{port}" for user, host, port in hosts]}
    if not args.json:
        print(_format(result))
    return result
