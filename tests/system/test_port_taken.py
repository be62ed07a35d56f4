"""UDP 4791 held by another user's wildcard socket: an emulated NIC that picks its own address moves to this user's
private network namespace and says so once; one given ip= fails naming the holder.

The scenarios run in a network and mount namespace of their own (`unshare`, a tmpfs on /run, XDG_RUNTIME_DIR in it),
so neither the host's 4791 nor its `ip netns` list nor its /tmp is touched: what the library creates there dies with
the scenario.
Skipped with the reason without root or unshare (and, for the unprivileged user, a Python it may run).
"""
import contextlib
import json
import os
import pwd
import re
import shutil
import signal
import site
import socket
import subprocess
import sys
import textwrap

import pytest

import aiofabric
from aiofabric.pci import PCIError
from aiofabric.pci.emulated import SimPCIDevice
from aiofabric.sim import netns
from aiofabric.sim.packets import ROCE_PORT
from aiofabric.sim.netns import NoPrivateNetns

HOLDER_USER = "nobody"
# Another user's socket on every address's 4791: it says its pid, then counts what reaches it until stdin closes.
HOLDER = textwrap.dedent("""
    import os, select, socket, sys
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.bind(("0.0.0.0", 4791))
    print(os.getpid(), flush=True)
    received = 0
    while True:
        ready, _, _ = select.select([sock, sys.stdin], [], [], 60)
        if sock in ready:
            sock.recv(65536)
            received += 1
        if sys.stdin in ready or not ready:
            break
    print(received, flush=True)
""")
# What a user does while the holder holds 0.0.0.0:4791: the CLI's loopback, a two-NIC verified WRITE through the API,
# and a NIC given ip= whose port the holder has, alone and in a process that moved. Prints what the test checks, as
# JSON.
CLIENT = textwrap.dedent("""
    import json, logging, random, subprocess, sys
    import anyio
    from aiofabric import open_nic
    from aiofabric.pci.seam import PCIError
    from aiofabric.pci.emulated import SimPCIDevice

    logging.basicConfig(format="%(name)s: %(message)s")  # the driver's notice, on stderr
    result = {}
    cli = subprocess.run([sys.executable, "-m", "aiofabric", "loopback", "--json"], capture_output=True, text=True,
                         timeout=60)
    result["cli"] = {"code": cli.returncode, "stdout": cli.stdout, "stderr": cli.stderr}

    async def write() -> None:
        async with open_nic("sim:pt-a") as a, open_nic("sim:pt-b") as b:
            cq_a, cq_b = await a.create_cq(64), await b.create_cq(64)
            qa, qb = await a.create_qp(cq_a), await b.create_qp(cq_b)
            await qa.connect(qb.info())
            await qb.connect(qa.info())
            source, target = await a.register_mr(1 << 16), await b.register_mr(1 << 16)
            source.view[:] = random.randbytes(1 << 16)
            with anyio.fail_after(20):
                await qa.write(source, target, 1 << 16)
            result["api"] = {"verified": bytes(target.view) == bytes(source.view), "ips": [a.pci.ip, b.pci.ip],
                             "netns": [a.pci.netns, b.pci.netns], "processes": len({a.pci.pid, b.pci.pid})}
    anyio.run(write)
    try:
        SimPCIDevice("pt-fixed", ip="127.0.0.9").close()
        result["fixed"] = None
    except PCIError as exc:
        result["fixed"] = str(exc)
    shared = SimPCIDevice("pt-s1", process="pt")  # moves its process; then one given ip= joins that process
    try:
        SimPCIDevice("pt-s2", ip="127.0.0.9", process="pt").close()
        result["shared_fixed"] = None
    except PCIError as exc:
        result["shared_fixed"] = str(exc)
    finally:
        shared.close()
    print(json.dumps(result))
""")
# As root inside the namespaces: start the holder as HOLDER_USER, run CLIENT with the Python argv[4:] names (as root
# or as another user), then stop the holder; one JSON line.
SCENARIO = textwrap.dedent("""
    import json, os, subprocess, sys
    holder = subprocess.Popen(["runuser", "-u", sys.argv[1], "--", "/usr/bin/python3", "-c", sys.argv[2]],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    holder_pid = int(holder.stdout.readline())
    runtime = "/run/user-runtime"  # the client's own, as a login session's /run/user/UID: 0700, theirs
    os.mkdir(runtime, 0o700)
    if sys.argv[4] == "runuser":
        import pwd
        user = pwd.getpwnam(sys.argv[6])
        os.chown(runtime, user.pw_uid, user.pw_gid)
    client = subprocess.run([*sys.argv[4:], "-c", sys.argv[3]], capture_output=True, text=True, timeout=90,
                            env={**os.environ, "XDG_RUNTIME_DIR": runtime})
    holder.stdin.close()
    received = int(holder.stdout.readline())
    holder.wait(timeout=20)
    if client.returncode != 0:
        sys.exit(f"the client failed: {client.stderr}")
    print(json.dumps({**json.loads(client.stdout), "holder_pid": holder_pid, "holder_received": received,
                      "client_stderr": client.stderr}))
""")


def require_namespaces() -> None:
    if os.geteuid() != 0 or not all(map(shutil.which, ("unshare", "runuser", "useradd", "pgrep"))):
        pytest.skip("the scenario needs root, unshare, runuser, useradd and pgrep (its own network and mount "
                    "namespaces, other users)")
    try:
        pwd.getpwnam(HOLDER_USER)
    except KeyError:
        pytest.skip(f"no user {HOLDER_USER} to hold the port")


def run_scenario(tmp_path, runner: list[str]) -> dict:
    """SCENARIO in fresh network and mount namespaces; `runner` is the command line of the Python that runs CLIENT."""
    (tmp_path / "scenario.py").write_text(SCENARIO)
    inside = ("mount -t tmpfs aiofabric-test /run && mkdir -m 1777 /run/tmp && ip link set lo up && "
              "exec \"$0\" \"$@\"")
    done = subprocess.run(["unshare", "--mount", "--net", "--propagation", "private", "sh", "-c", inside,
                           sys.executable, str(tmp_path / "scenario.py"), HOLDER_USER, HOLDER,
                           CLIENT, *runner], capture_output=True, text=True, timeout=150)
    if done.returncode != 0 and "unshare failed" in done.stderr:
        pytest.skip(f"unshare unavailable here: {done.stderr.strip()}")
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.splitlines()[-1])


def check_moved(result: dict, namespace: str, holder: str) -> None:
    """Both the CLI and the API worked in `namespace`, said so once each, and the holder saw none of it."""
    cli = result["cli"]
    assert cli["code"] == 0 and json.loads(cli["stdout"])["verified"] is True, cli
    notice = (rf"aiofabric\.sim: UDP 4791 on 127\.0\.0\.\d+ is held by {re.escape(holder)}; the emulated NICs of "
              rf"this user run in network namespace {re.escape(namespace)} instead\n")
    assert len(re.findall(notice, cli["stderr"])) == 1, cli["stderr"]
    assert len(re.findall(notice, result["client_stderr"])) == 1, result["client_stderr"]  # two NICs, said once
    api = result["api"]
    assert api["verified"] is True and api["netns"] == [namespace.split()[0]] * 2 and api["processes"] == 2
    assert all(ip.startswith("127.0.0.") for ip in api["ips"])
    assert result["holder_received"] == 0  # nothing of ours reached the holder's socket


def fixed_address_refused(name: str, ip: str, holder: str) -> str:
    return (f"sim:{name}: emulator failed to start: cannot open the udp transport: UDP {ip}:4791 is taken by "
            f"{holder}; the NIC was given this address (ip=), so it does not move to another (leave ip= out to let "
            "it pick one)")


def test_a_wildcard_holder_moves_roots_nics_to_a_private_namespace(tmp_path):
    require_namespaces()
    result = run_scenario(tmp_path, [sys.executable])
    holder = f"python3 (pid {result['holder_pid']}, user {HOLDER_USER})"
    check_moved(result, "aiofabric-0", holder)
    assert result["fixed"] == fixed_address_refused("pt-fixed", "127.0.0.9", holder)
    assert result["shared_fixed"] == fixed_address_refused("pt-s2", "127.0.0.9", holder)  # bound at home, not moved


@contextlib.contextmanager
def throwaway_user():
    name = f"aiofpt{os.getpid() % 100000}"
    subprocess.run(["useradd", "-M", "-s", "/usr/sbin/nologin", name], check=True, capture_output=True, timeout=20)
    try:
        yield name
    finally:  # its namespace holder would outlive the scenario by ~10 s
        for pid in subprocess.run(["pgrep", "-u", name], capture_output=True, text=True).stdout.split():
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(pid), signal.SIGKILL)
        subprocess.run(["userdel", name], capture_output=True, timeout=20)


def python_for(user: str) -> list[str]:
    """A command that runs Python with aiofabric importable as `user`: ours, or the system's of the same version
    (ours may live where only root can look)."""
    path = os.pathsep.join([os.path.dirname(os.path.dirname(aiofabric.__file__)), *site.getsitepackages()])
    for python in (sys.executable, f"/usr/bin/python{sys.version_info[0]}.{sys.version_info[1]}"):
        command = ["runuser", "-u", user, "--", "env", f"PYTHONPATH={path}", python]
        if subprocess.run([*command, "-c", "import aiofabric, anyio"], capture_output=True, cwd="/",
                          timeout=60).returncode == 0:
            return command
    pytest.skip(f"no Python here that user {user} may run with aiofabric")


def test_an_unprivileged_users_nics_move_to_a_user_namespace(tmp_path):
    require_namespaces()
    with throwaway_user() as user:
        runner = python_for(user)
        result = run_scenario(tmp_path, runner)
        uid = pwd.getpwnam(user).pw_uid
        holder = f"a socket of user {HOLDER_USER} (its process is not one we may look at)"
        match = re.search(rf"network namespace aiofabric-{uid} \(a user namespace held by pid (\d+): `nsenter -t \d+ "
                          r"-U -n`\)", result["cli"]["stderr"])
        assert match, result["cli"]["stderr"]
        check_moved(result, f"aiofabric-{uid} (a user namespace held by pid {match[1]}: `nsenter -t {match[1]} -U -n`)",
                    holder)
        assert result["fixed"] == fixed_address_refused("pt-fixed", "127.0.0.9", holder)
        assert re.fullmatch(  # a process in a user namespace cannot go back: that NIC needs a process of its own
            rf"sim:pt-s2: emulator failed to start: cannot open the udp transport: ip=127\.0\.0\.9: this emulator "
            rf"process runs its NICs in aiofabric-{uid} \(UDP 4791 on 127\.0\.0\.\d+ is held by {re.escape(holder)}\) "
            r"and cannot bind on the host from there \(setns: Operation not permitted\); open this NIC in a process "
            r"of its own \(without process=\)", result["shared_fixed"]), result["shared_fixed"]


def test_a_given_address_whose_port_is_taken_fails_naming_the_holder():
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as squatter:
        for host in range(254, 200, -1):  # one we can take ourselves
            try:
                squatter.bind((f"127.0.0.{host}", ROCE_PORT))
                break
            except OSError:
                continue
        with open("/proc/self/comm") as f:
            command = f.read().strip()
        with pytest.raises(PCIError) as raised:
            SimPCIDevice(f"taken{os.getpid()}", ip=f"127.0.0.{host}")
    me = f"{command} (pid {os.getpid()}, user {pwd.getpwuid(os.geteuid()).pw_name})"
    assert str(raised.value) == fixed_address_refused(f"taken{os.getpid()}", f"127.0.0.{host}", me)


def test_a_rendezvous_directory_others_could_have_made_or_can_enter_is_refused(tmp_path, monkeypatch):
    def refused(detail: str, path=None) -> str:
        return f"no directory for this user's namespace holder: {path or directory} {detail}; run in a login " \
               "session (it sets XDG_RUNTIME_DIR to /run/user/UID, a directory only you can write), or remove " \
               "what is wrong"

    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    directory, uid = tmp_path / "aiofabric", os.geteuid()
    directory.mkdir()
    os.chmod(directory, 0o755)  # another user could enter it
    with pytest.raises(NoPrivateNetns) as raised:
        netns.user_netns_dir()
    assert str(raised.value) == refused("is open to group and others (mode 755)")
    os.chmod(directory, 0o700)
    assert netns.user_netns_dir() == str(directory)
    if uid == 0:  # made by another user first
        holder = pwd.getpwnam(HOLDER_USER).pw_uid
        os.chown(directory, holder, -1)
        with pytest.raises(NoPrivateNetns) as raised:
            netns.user_netns_dir()
        assert str(raised.value) == refused(f"is owned by uid {holder}, not by us (uid 0)")
    directory.rename(tmp_path / "elsewhere")
    directory.symlink_to(tmp_path / "elsewhere")  # a link is not the directory itself
    with pytest.raises(NoPrivateNetns) as raised:
        netns.user_netns_dir()
    assert str(raised.value) == refused("is a symlink")
    monkeypatch.delenv("XDG_RUNTIME_DIR")  # never a name under /tmp instead
    with pytest.raises(NoPrivateNetns) as raised:
        netns.user_netns_dir()
    assert str(raised.value) == refused("is not set", "$XDG_RUNTIME_DIR")