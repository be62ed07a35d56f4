"""nccl-tests' collectives (allreduce, reducescatter, allgather, broadcast, reduce, gather, scatter, sendrecv,
alltoall): a size sweep over a ring of NICs, one rank each, every element checked, printed as nccl-tests prints it;
the ranks in this process (--ranks), one per process under a launcher (torchrun, mpirun, mpiexec, srun), or one per
host (or slot) started over SSH (--hosts). nccl-tests' flags are in nccl_flags.py."""
from __future__ import annotations

import argparse
import collections
import json
import math
import os
import socket
import sys
import time
from typing import Any, Callable, TextIO

import anyio
import anyio.abc

from .ssh import add_ssh_flags, parsed_hosts, ssh_options
from ..arguments import Subcommands, add_wire_flags, integer, ipv4, ipv4_or_ssh, seconds, sized
from ..bench_config import MAX_NICS, MAX_SIZE
from ..introspect import emulator_processes
from ..nccl_flags import add_nccl_flags, check_nccl_flags, nccl_config
from ..options import WireOptions
from ...collectives import nccl_format
from ...collectives.layout import PIECE_BYTES, alltoall_landing
from ...pci.emulated import FAULTS
from ...version import __version__

# nccl-tests' binaries, without _perf: the collective each runs
COLLECTIVE_COMMANDS = {"allreduce": "allreduce", "reducescatter": "reduce_scatter", "allgather": "allgather",
                       "broadcast": "broadcast", "reduce": "reduce", "gather": "gather", "scatter": "scatter",
                       "sendrecv": "sendrecv", "alltoall": "alltoall"}
DEFAULT_RANKS = 2
HYPERCUBE_WHY = ("hypercube_perf is not here: its exchanges are between rank and rank ^ 2^k, and the ring links each "
                 "rank to its neighbours only; allgather computes the same result")
ENV_PREFIXES = ("NCCL_", "AIOFABRIC_", "MASTER_", "RANK", "WORLD_SIZE", "LOCAL_RANK", "OMPI_COMM_WORLD_", "SLURM_",
                "PMI_", "PMIX_RANK", "MPI_LOCAL")  # what -J records of the environment (nccl-tests records all of it)
MAX_LOCAL_RANKS = MAX_NICS  # each rank of --ranks is an emulator process with its own DMA arena on this host
RANKS_WHY = (": each rank of --ranks is an emulator process (or a PCI function) of this host, as bench's --nics; more "
             "ranks run one per process (torchrun, mpirun, srun) or per host (--hosts)")
# the flags a launcher passes on to every rank (dest, flag)
RANK_FLAGS = (("minbytes", "-b"), ("maxbytes", "-e"), ("stepbytes", "-i"), ("stepfactor", "-f"), ("iters", "-n"),
              ("agg_iters", "-m"), ("warmup_iters", "-w"), ("run_cycles", "-N"), ("blocking", "-z"),
              ("average", "-a"), ("datatype", "-d"), ("op", "-o"), ("root", "-r"), ("verify", "-c"),
              ("piece", "--piece"),
              ("timeout", "--timeout"), ("rendezvous_timeout", "--rendezvous-timeout"), ("size", "--size"),
              *((fault, f"--{fault}") for fault in FAULTS), ("seed", "--seed"), ("pcap", "--pcap"),
              ("profile", "--profile"))


def add_collectives(sub: Subcommands) -> None:
    for command, kind in {**COLLECTIVE_COMMANDS, "hypercube": "hypercube"}.items():  # hypercube: refused, saying why
        coll = sub.add_parser(command, help=f"nccl-tests' {kind}_perf over a ring of emulated (or PCI) NICs in this "
                                            "process: a size sweep, every element checked" if kind != "hypercube" else
                              "nccl-tests' hypercube_perf: refused, saying why")
        coll.add_argument("--ranks", type=integer(1, MAX_LOCAL_RANKS, RANKS_WHY),
                          help="ranks in this process, one NIC each (default 2; under torchrun, mpirun or srun: this "
                               "process is one rank of their job, rendezvous at MASTER_ADDR:MASTER_PORT)")
        coll.add_argument("--nic", default="sim", metavar="NIC|A,B,...",
                          help="with a launcher: this rank's NIC (default sim); a list names one per local rank "
                               "(the rank on its host: LOCAL_RANK, SLURM_LOCALID, ...)")
        coll.add_argument("--ip", type=ipv4,
                          help="with a launcher: this rank's NIC's IPv4 address (emulated: a free 127.0.0.x)")
        coll.add_argument("--nics", metavar="A,B,...", help="PCI NICs, one per rank (default: emulated NICs)")
        coll.add_argument("--shared-emulator", action=argparse.BooleanOptionalAction, default=True,
                          help="with --ranks: run the ranks' emulated NICs in one emulator process (default: yes; a "
                               "message between two ranks wakes no other process, and fewer processes wait for a CPU); "
                               "--no-shared-emulator: a process per NIC")
        add_nccl_flags(coll)
        coll.add_argument("--timeout", type=seconds, default=60.0, help="seconds one collective may take before every "
                                                                     "rank fails naming what it waited for (60)")
        coll.add_argument("--rendezvous-timeout", type=seconds, default=60.0,
                          help="with a launcher: seconds for every rank to join (60)")
        coll.add_argument("--piece", type=sized(1, MAX_SIZE), default=PIECE_BYTES,
                          help="bytes per RDMA message (default 512K): pieces pipeline transfers with reductions")
        add_wire_flags(coll)
        coll.add_argument("--hosts", metavar="FILE|h1,h2", help="one rank per host (slots=N: N), started over SSH "
                                                              "(`python -m aiofabric` there); the rendezvous is "
                                                              "relayed over SSH")
        coll.add_argument("--remote-nic", default="sim", metavar="NIC|A,B,...",
                          help="with --hosts: each host's NIC (default sim); a list names one per rank of a host "
                               "(slots=N)")
        coll.add_argument("--remote-ip", type=ipv4_or_ssh,
                          help="with --hosts: each host's NIC address ('ssh': the address SSH reached)")
        add_ssh_flags(coll)
        coll.add_argument("--json", action="store_true", help="print one JSON object")
        coll.set_defaults(run=cmd_collective, kind=kind,
                          check=_check_collective(coll) if kind != "hypercube" else _refuse(coll, HYPERCUBE_WHY))


async def cmd_collective(args: argparse.Namespace) -> dict[str, Any]:
    from ...collectives import join, local
    from ...collectives.devices import LINE_BYTES
    world, sizes, ranks = args.world, args.sizes, args.rank_count  # _check_collective's
    leader = world is None or world.rank == 0  # prints the table, as nccl-tests' rank 0 does
    started = time.strftime(nccl_format.TIME_FORMAT)
    json_path, json_file = _open_json(args.output_file) if leader and args.output_file else ("", None)
    nics = args.nics.split(",") if args.nics else None
    options = {} if nics or args.hosts else WireOptions.from_args(args).nic_options()
    buffer_bytes = max(*sizes, LINE_BYTES * ranks)  # the device lines are gathered through the buffers too
    # an alltoall's parts passing through each rank (the most elements: 1-byte ones)
    landing_bytes = max(alltoall_landing(ranks, size // ranks) for size in sizes) if args.kind == "alltoall" else 0
    try:
        if args.hosts:
            result = await _collective_over_ssh(args)
        elif world is not None:
            async with join(world, nic=args.nic, ip=args.ip, buffer_bytes=buffer_bytes, landing_bytes=landing_bytes,
                            piece_bytes=args.piece, timeout=args.timeout, rendezvous_timeout=args.rendezvous_timeout,
                            **options) as comm:
                result = await _sweep(args, [comm], [0], leader)
            result["launcher"] = world.launcher
        else:
            async with local(ranks, nics=nics, buffer_bytes=buffer_bytes, landing_bytes=landing_bytes,
                             piece_bytes=args.piece, timeout=args.timeout, shared_emulator=args.shared_emulator,
                             **options) as comms:
                result = await _sweep(args, comms, list(range(ranks)), leader)
                result["emulator_processes"] = await emulator_processes([comm.nic for comm in comms])
        if json_file is not None:
            _write_json(json_file, args, result, started)
    except BaseException:
        if json_file is not None:  # ours (created new): no empty document is left behind
            os.unlink(json_path)
        raise
    finally:
        if json_file is not None:
            json_file.close()
    return result


async def _sweep(args: argparse.Namespace, comms: list[Any], devices: list[int], leader: bool) -> dict[str, Any]:
    """The devices' lines, the preamble and header (on the leader's stdout, unless --json), the sweep with each row
    printed as it is measured, the closing lines; the minimum bandwidth checked."""
    from ...collectives.devices import job_devices
    from ...collectives.perf import PerfConfig, run_perf
    config = nccl_config(args, f"aiofabric-{__version__}", nccl_format.PROGRAMS[args.kind])
    text = leader and not args.json
    devices_seen = await job_devices(comms, devices)
    if text:
        _print(*nccl_format.preamble(config, devices_seen), *nccl_format.header())
    perf = PerfConfig(args.kind, args.sizes, iters=args.iters, warmup=args.warmup_iters, dtypes=args.dtypes,
                      ops=args.ops, roots=args.roots, check=args.verify, agg=args.agg_iters, cycles=args.run_cycles,
                      average=args.average, blocking=args.blocking, warmup_sizes=args.warmup_sizes)
    result = await run_perf(comms, perf, _print if text else None)
    result |= {"nccl": config, "devices": devices_seen}
    _check_min_bw(result, args.min_bw)
    if text:
        _print(*nccl_format.footer(result["out_of_bounds"], result["avg_busbw_GBps"], args.min_bw, config["program"]))
    return result


def _check_min_bw(result: dict[str, Any], min_bw: float | None) -> None:
    """NCCL_TESTS_MIN_BW: an average bus bandwidth below 90% of it fails the run, as in nccl-tests."""
    if min_bw is None:
        return
    result["min_bw_GBps"] = min_bw
    if result["avg_busbw_GBps"] < min_bw * 0.9 and "error" not in result:
        result["error"] = (f"average bus bandwidth {result['avg_busbw_GBps']:g} GB/s is below 90% of "
                           f"NCCL_TESTS_MIN_BW={min_bw:g}")


def _print(*lines: str) -> None:
    for line in lines:
        print(line, flush=True)


def _open_json(path: str) -> tuple[str, TextIO]:
    """nccl-tests' -J file, created new: FILE, else FILE.0, FILE.1, ... (never overwritten, no symlink followed)."""
    candidates = [path, *(f"{path}.{n}" for n in range(1000))]
    for candidate in candidates:
        try:
            fd = os.open(candidate, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
        except FileExistsError:
            continue
        except OSError as exc:
            raise OSError(f"-J {candidate}: cannot create it: {exc.strerror or exc}") from None
        print(f"# Writing JSON output to {candidate}", flush=True)
        return candidate, os.fdopen(fd, "w")
    raise OSError(f"-J {path}: it and {path}.0 to .999 all exist")


def _write_json(file: TextIO, args: argparse.Namespace, result: dict[str, Any], started: str) -> None:
    env = sorted(f"{name}={value}" for name, value in os.environ.items() if name.startswith(ENV_PREFIXES))
    document = nccl_format.json_document(result["nccl"], result["devices"], result, args=sys.argv, env=env,
                                         start_time=started, end_time=time.strftime(nccl_format.TIME_FORMAT))
    json.dump(document, file, indent=1)
    file.write("\n")


def _refuse(parser: argparse.ArgumentParser, why: str) -> Callable[[argparse.Namespace], None]:
    def check(args: argparse.Namespace) -> None:
        parser.error(why)
    return check


def _check_collective(parser: argparse.ArgumentParser) -> Callable[[argparse.Namespace], None]:
    """Where the ranks run and how many there are (--ranks, --hosts, or a launcher's variables), and what depends
    on it (-r, --nics), checked before anything starts; the sweep's sizes. Sets args.world, rank_count, sizes,
    host_list."""
    def check(args: argparse.Namespace) -> None:
        from ...collectives.env_ranks import local_choice
        from ...collectives.world import from_environment
        args.world, args.host_list = None, None
        if args.hosts is not None and args.ranks is not None:
            parser.error("--ranks and --hosts both say where the ranks run: give one (--hosts: one rank per host)")
        if args.hosts is not None:
            args.host_list = parsed_hosts(parser, args.hosts, args.port)
            if not args.host_list:
                parser.error(f"--hosts {args.hosts}: names no host")
            args.rank_count = len(args.host_list)
            _check_slots(parser, args)
        elif args.ranks is None:
            try:
                args.world = from_environment(os.environ)
            except ValueError as exc:
                parser.error(str(exc))
            if args.world is not None:
                _check_resolvable(parser, args.world)
                try:
                    args.nic = local_choice(args.nic, "--nic", args.world.launcher, args.world.local_rank)
                except ValueError as exc:
                    parser.error(str(exc))
            args.rank_count = args.world.size if args.world is not None else DEFAULT_RANKS
        else:
            args.rank_count = args.ranks
        if args.nics and len(args.nics.split(",")) != args.rank_count:
            parser.error(f"--nics names {len(args.nics.split(','))} NICs for {args.rank_count} ranks: one per rank")
        check_nccl_flags(parser, args, args.rank_count)
    return check


def _check_slots(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """A host of several slots runs several ranks: --remote-nic names a NIC for each of them, and no one address
    (--remote-ip) can serve two NICs."""
    crowded, most = collections.Counter(args.host_list).most_common(1)[0]
    nics = args.remote_nic.split(",")
    if "" in (nic.strip() for nic in nics):
        parser.error(f"--remote-nic {args.remote_nic}: an empty name in the list")
    if len(nics) > 1 and len(nics) < most:
        parser.error(f"--remote-nic {args.remote_nic} names {len(nics)}, one per rank of a host, and {crowded[1]} "
                     f"runs {most} ranks (its slots): name one for each")
    if args.remote_ip is not None and most > 1:
        parser.error(f"--remote-ip {args.remote_ip}: {crowded[1]} runs {most} ranks (its slots), whose NICs cannot "
                     "share one address: leave --remote-ip out (emulated NICs pick their own)")


def _check_resolvable(parser: argparse.ArgumentParser, world: Any) -> None:
    """Rank 0's host (MASTER_ADDR, or srun's first node): one the resolver does not know is a usage error now, not
    a rendezvous that never answers (a busy resolver, EAI_AGAIN, is left to the rendezvous's retries)."""
    host, given = world.addr, world.addr_from == "MASTER_ADDR"
    named, advice = (f"MASTER_ADDR={host}", "") if given else (f"{host} ({world.addr_from})",
                                                              "; set MASTER_ADDR to rank 0's host")
    try:
        socket.getaddrinfo(host, world.port, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        if exc.errno != socket.EAI_AGAIN:
            parser.error(f"{named}: cannot be resolved ({exc.strerror or exc}){advice}")
    except UnicodeError as exc:  # a label too long for IDNA
        parser.error(f"{named}: not a host name ({exc}){advice}")


def _format(result: dict[str, Any]) -> str:
    """A result's text as nccl-tests prints it (a remote rank 0's: --hosts)."""
    rows = result["rows"]
    lines = [nccl_format.row_start(row["size"], row["count"], row["type"], row["op"], row["root"])
             + nccl_format.row_body(row["time_us"], row["algbw_GBps"], row["busbw_GBps"], row["wrong"])
             + nccl_format.row_body(other["time_us"], other["algbw_GBps"], other["busbw_GBps"], other["wrong"])
             for row, other in zip(rows[::2], rows[1::2])]
    program = result["nccl"]["program"]
    return "\n".join([*nccl_format.preamble(result["nccl"], result["devices"]), *nccl_format.header(), *lines,
                      *nccl_format.footer(result["out_of_bounds"], result["avg_busbw_GBps"],
                                          result.get("min_bw_GBps"), program)])


async def _collective_over_ssh(args: argparse.Namespace) -> dict[str, Any]:
    """One rank per host: each runs this command over SSH with the launchers' variables, meeting at a rendezvous
    served here and forwarded to each host's 127.0.0.1 over its SSH connection. Rank 0's result is the table."""
    from ...collectives.communicator import CollectiveError
    from ...collectives.rendezvous import RendezvousServer
    from ...peer.remote_run import run_remote
    from ...peer.hostfile import local_ranks
    hosts = args.host_list  # _check_collective's: a host of N slots N times
    local, slots = local_ranks(hosts), collections.Counter(hosts)
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
                env={"RANK": str(index), "WORLD_SIZE": str(len(hosts)), "LOCAL_RANK": str(local[index]),
                     "LOCAL_WORLD_SIZE": str(slots[hosts[index]]), "AIOFABRIC_RENDEZVOUS": "external"},
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
