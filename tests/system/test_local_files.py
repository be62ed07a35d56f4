"""Local files on a shared host, where other local users are the attacker: the C-kernel cache (a library found there
runs as us), capture files (a symlink planted where root writes one, a capture others can read, a server filling
the disk) and the device-lock directory (a name under /tmp another user takes first)."""
import ctypes
import json
import logging
import os
import re
import select
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from aiofabric import sched
from aiofabric.pci import PCIError
from aiofabric.pci.emulated import SimPCIDevice
from aiofabric.pci.device_lock import DeviceLock
from aiofabric.peer.policy import ServerPolicy
from aiofabric.sched import kernels
from aiofabric.sim.pcap import PcapWriter
from tests.support.processes import CLI, LIMITS, ServerProcess
from tests.support.sysfs import ADDR

NOBODY = 65534  # another user: nothing of ours is owned by it
ROOT = os.geteuid() == 0
needs_root = pytest.mark.skipif(not ROOT, reason="making a file another user's (chown) or running as one needs root")
needs_cc = pytest.mark.skipif(shutil.which(os.environ.get("CC", "cc")) is None, reason="no C compiler")


# -- the C-kernel cache ------------------------------------------------------------------------------------------------
def answer_source(name: str, value: int) -> str:
    return f"#include <stdint.h>\nvoid {name}(int64_t *out) {{ *out = {value}; }}\n"


def call(kernel: sched.CKernel) -> int:
    out = ctypes.c_int64()
    kernel.function(ctypes.byref(out))
    return out.value


def library_name(source: str, name: str, tmp_path: Path) -> str:
    """The file name a kernel is cached under, learnt from a child (this process must not load it before the test)."""
    scratch = tmp_path / "scratch-cache"
    child = subprocess.run([sys.executable, "-c", "import sys; from aiofabric.sched import CKernel; "
                            "print(CKernel(sys.argv[1], sys.argv[2]).build['library'])", source, name],
                           env={**os.environ, "AIOFABRIC_CACHE": str(scratch)}, capture_output=True, text=True,
                           timeout=60)
    assert child.returncode == 0, child.stderr
    return Path(child.stdout.strip()).name


def planted_library(name: str, tmp_path: Path) -> Path:
    """What another user plants: a library of the kernel's name that computes 666 instead of 42."""
    source, built = tmp_path / "evil.c", tmp_path / "evil.so"
    source.write_text(answer_source(name, 666))
    subprocess.run([shutil.which(os.environ.get("CC", "cc")), "-shared", "-fPIC", "-o", str(built), str(source)],
                   check=True, timeout=60)
    return built


def refused_cache(cache: Path, problem: str) -> str:
    return "^" + re.escape(f"C kernel cache $AIOFABRIC_CACHE={cache} {problem}: refusing to build or load kernels "
                           "there (point it at a directory only you can write)") + "$"


@needs_root
@needs_cc
def test_a_cache_directory_owned_by_another_user_is_refused(tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    cache.mkdir(mode=0o755)
    os.chown(cache, NOBODY, NOBODY)
    monkeypatch.setenv("AIOFABRIC_CACHE", str(cache))
    with pytest.raises(sched.KernelBuildError, match=refused_cache(cache, f"is owned by uid {NOBODY}, not by us "
                                                                          f"(uid {os.geteuid()})")):
        sched.CKernel(answer_source("owned_elsewhere", 42), "owned_elsewhere")
    assert list(cache.iterdir()) == []


@needs_cc
@pytest.mark.parametrize("mode, writers", [(0o777, "group and others"), (0o1777, "group and others"),
                                           (0o770, "group"), (0o702, "others")])
def test_a_cache_directory_others_can_write_is_refused(tmp_path, monkeypatch, mode, writers):
    cache = tmp_path / "cache"
    cache.mkdir()
    cache.chmod(mode)
    monkeypatch.setenv("AIOFABRIC_CACHE", str(cache))
    with pytest.raises(sched.KernelBuildError, match=refused_cache(cache, f"is writable by {writers} (mode {mode:o})")):
        sched.CKernel(answer_source("open_to_all", 42), "open_to_all")
    assert list(cache.iterdir()) == []


@needs_cc
def test_a_symlinked_cache_directory_is_refused_not_followed(tmp_path, monkeypatch):
    elsewhere = tmp_path / "elsewhere"  # ours here; another user's in the attack: either way not followed
    elsewhere.mkdir(mode=0o700)
    (tmp_path / "cache").symlink_to(elsewhere)
    monkeypatch.setenv("AIOFABRIC_CACHE", str(tmp_path / "cache"))
    with pytest.raises(sched.KernelBuildError, match=refused_cache(tmp_path / "cache", "is a symlink")):
        sched.CKernel(answer_source("through_a_link", 42), "through_a_link")
    assert list(elsewhere.iterdir()) == []


@needs_cc
@pytest.mark.parametrize("how", ["group-writable", pytest.param("another user's", marks=needs_root), "symlink"])
def test_a_library_planted_in_our_cache_is_rebuilt_not_loaded(tmp_path, monkeypatch, caplog, how):
    name = "answer_" + re.sub(r"\W", "_", how)
    source = answer_source(name, 42)
    cache = tmp_path / "cache"
    cache.mkdir(mode=0o700)
    library = cache / library_name(source, name, tmp_path)
    evil = planted_library(name, tmp_path)
    if how == "symlink":
        library.symlink_to(evil)
        problem = "is a symlink"
    else:
        shutil.copy(evil, library)
        if how == "group-writable":
            library.chmod(0o775)
            problem = "is writable by group (mode 775)"
        else:
            library.chmod(0o755)
            os.chown(library, NOBODY, NOBODY)
            problem = f"is owned by uid {NOBODY}, not by us (uid {os.geteuid()})"
    monkeypatch.setenv("AIOFABRIC_CACHE", str(cache))
    with caplog.at_level(logging.WARNING, logger="aiofabric.sched.kernels"):
        kernel = sched.CKernel(source, name)
    assert call(kernel) == 42 and not kernel.build["cached"]
    assert [r.getMessage() for r in caplog.records] == [
        f"C kernel {name!r}: {library} {problem}: not loading it, building it again"]
    info = os.lstat(library)  # replaced by our own build
    assert stat.S_ISREG(info.st_mode) and info.st_uid == os.geteuid() and stat.S_IMODE(info.st_mode) == 0o755
    assert library.read_bytes() != evil.read_bytes()


@needs_root
@needs_cc
def test_the_temp_fallback_planted_by_another_user_is_skipped_for_a_private_one(tmp_path, monkeypatch):
    """No $AIOFABRIC_CACHE, no usable home: another user made /tmp/aiofabric-kernels-<our uid> first and put a
    library of the right name in it. It is not used: a fresh private directory is."""
    name = "answer_fallback"
    source = answer_source(name, 42)
    filename = library_name(source, name, tmp_path)
    temp = tmp_path / "tmp"  # the shared /tmp
    temp.mkdir()
    temp.chmod(0o1777)
    planted = temp / f"aiofabric-kernels-{os.geteuid()}"
    planted.mkdir(mode=0o755)
    shutil.copy(planted_library(name, tmp_path), planted / filename)
    for path in (planted / filename, planted):
        os.chown(path, NOBODY, NOBODY)
    monkeypatch.delenv("AIOFABRIC_CACHE", raising=False)
    monkeypatch.setenv("HOME", "/proc/no-home")  # HOME=/nonexistent: not even root can make this one
    monkeypatch.setattr(tempfile, "tempdir", str(temp))
    monkeypatch.setattr(kernels, "_private_fallback", None, raising=False)
    kernel = sched.CKernel(source, name)
    assert call(kernel) == 42
    used = Path(kernel.build["library"]).parent
    assert used != planted and used.parent == temp and used.name.startswith("aiofabric-kernels-")
    info = os.lstat(used)
    assert info.st_uid == os.geteuid() and stat.S_IMODE(info.st_mode) == 0o700
    assert kernels.cache_dir() == used  # one per process


@needs_cc
def test_the_cache_is_made_private_and_still_caches(tmp_path, monkeypatch):
    cache = tmp_path / "made" / "cache"
    monkeypatch.setenv("AIOFABRIC_CACHE", str(cache))
    old_umask = os.umask(0)  # whatever the umask: a directory only we can write, a library only we can write
    try:
        first = sched.CKernel(answer_source("answer_happy", 42), "answer_happy")
    finally:
        os.umask(old_umask)
    again = sched.CKernel(answer_source("answer_happy", 42), "answer_happy")
    assert call(first) == call(again) == 42 and not first.build["cached"] and again.build["cached"]
    assert stat.S_IMODE(cache.stat().st_mode) == 0o700
    assert stat.S_IMODE(os.stat(first.build["library"]).st_mode) == 0o755
    assert [p.name for p in cache.iterdir()] == [Path(first.build["library"]).name]  # no scratch left behind


@needs_cc
def test_a_kernels_relative_include_flag_means_the_working_directory(tmp_path, monkeypatch):
    """The compiler runs where the user does, so `-Iinclude` finds ./include, as it would on their command line;
    the source itself is written into a private scratch directory."""
    monkeypatch.setenv("AIOFABRIC_CACHE", str(tmp_path / "cache"))
    (tmp_path / "work" / "include").mkdir(parents=True)
    (tmp_path / "work" / "include" / "answer.h").write_text("#define ANSWER 41\n")
    monkeypatch.chdir(tmp_path / "work")
    source = "#include <stdint.h>\n#include \"answer.h\"\nvoid answer_included(int64_t *out) { *out = ANSWER; }\n"
    kernel = sched.CKernel(source, "answer_included", flags=("-O2", "-shared", "-fPIC", "-Iinclude"))
    assert call(kernel) == 41


# -- captures ----------------------------------------------------------------------------------------------------------
FRAME = 16 + 14  # a record's header and Ethernet header around its IPv4 packet
PACKET = bytes(100)
MAC_A, MAC_B = bytes.fromhex("020000000001"), bytes.fromhex("020000000002")


def refused_capture(path: Path) -> str:
    return "^" + re.escape(f"[Errno 17] exists; refusing to overwrite it (remove it or choose another name): "
                           f"'{path}'") + "$"


def test_a_symlink_at_the_capture_path_is_refused_and_its_target_unchanged(tmp_path):
    """As root in a directory another user can write: the link they planted names a file only root may write."""
    secret = tmp_path / "root-only"
    secret.write_text("root's\n")
    secret.chmod(0o600)
    link = tmp_path / "capture.pcap"
    link.symlink_to(secret)
    with pytest.raises(FileExistsError, match=refused_capture(link)):
        PcapWriter(link)
    assert secret.read_text() == "root's\n" and stat.S_IMODE(secret.stat().st_mode) == 0o600
    dangling = tmp_path / "dangling.pcap"  # O_CREAT through a dangling link would make its target
    dangling.symlink_to(tmp_path / "made-through-the-link")
    with pytest.raises(FileExistsError, match=refused_capture(dangling)):
        PcapWriter(dangling)
    assert not (tmp_path / "made-through-the-link").exists()


def test_the_emulator_refuses_an_existing_capture_in_one_line(tmp_path):
    existing = tmp_path / "run.pcap"
    existing.write_bytes(b"an earlier capture")
    with pytest.raises(PCIError) as raised:
        SimPCIDevice("bad", pcap=str(existing))
    assert str(raised.value) == (f"sim:bad: emulator failed to start: cannot write pcap {existing}: [Errno 17] exists; "
                                 "refusing to overwrite it (remove it or choose another name)")
    assert existing.read_bytes() == b"an earlier capture"


def test_a_capture_is_made_0600_whatever_the_umask(tmp_path):
    old_umask = os.umask(0)
    try:
        with PcapWriter(tmp_path / "wire.pcap") as pcap:
            pcap.write(PACKET, MAC_A, MAC_B, 1.0)
    finally:
        os.umask(old_umask)
    assert stat.S_IMODE((tmp_path / "wire.pcap").stat().st_mode) == 0o600


@pytest.mark.parametrize("slack, kept", [(0, 2), (-1, 1)], ids=["ends-exactly-at-the-limit", "one-byte-over"])
def test_the_byte_limit_keeps_a_record_ending_at_it_and_drops_one_crossing_it(tmp_path, caplog, slack, kept):
    limit = 24 + 2 * (FRAME + len(PACKET)) + slack
    path = tmp_path / "bounded.pcap"
    with caplog.at_level(logging.WARNING, logger="aiofabric.sim.pcap"), PcapWriter(path, max_bytes=limit) as pcap:
        for i in range(4):  # the 2nd record ends exactly at the limit, or crosses it by a byte
            pcap.write(PACKET, MAC_A, MAC_B, float(i))
        pcap.write(b"", MAC_A, MAC_B, 9.0)  # small enough to fit after a drop: not recorded (a prefix, no holes)
    assert path.stat().st_size == 24 + kept * (FRAME + len(PACKET)) <= limit
    assert pcap.dropped == 5 - kept
    assert [r.getMessage() for r in caplog.records] == [
        f"pcap {path}: reached its limit of {limit} bytes; the packets after it are not recorded"]  # once
    with pytest.raises(ValueError, match="^pcap max_bytes must be at least the 24-byte file header, not 23$"):
        PcapWriter(tmp_path / "tiny.pcap", max_bytes=23)


def test_the_server_writes_at_most_its_file_limit_of_captures(caplog):
    policy = ServerPolicy(pcap="/srv/cap.pcap", pcap_max_files=2, pcap_max_bytes=4096)
    with caplog.at_level(logging.WARNING, logger="aiofabric.peer.policy"):
        options = [policy.nic_options() for _ in range(4)]
    assert options == [{"pcap": "/srv/cap.pcap", "pcap_max_bytes": 4096},
                       {"pcap": "/srv/cap.pcap.1", "pcap_max_bytes": 4096}, {}, {}]
    assert [r.getMessage() for r in caplog.records] == [
        "/srv/cap.pcap: 2 capture files written (the server's --pcap-max-files); the NICs of later clients are not "
        "captured"]
    for bad, message in (({"pcap_max_files": 0}, "pcap_max_files must be at least 1, not 0"),
                         ({"pcap_max_bytes": 23}, "pcap_max_bytes must be at least 24 (the pcap file header), not 23")):
        with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
            ServerPolicy(pcap="/srv/cap.pcap", **bad)


def test_a_forever_server_bounds_its_captures_end_to_end(tmp_path):
    capture = tmp_path / "server.pcap"
    server = ServerProcess(tmp_path, *LIMITS, "--forever", "--pcap", str(capture), "--pcap-max-files", "1",
                           "--pcap-max-bytes", "4K", "--iters", "20", "--size", "4K", test="read")
    try:
        for _ in range(2):  # the second client's NIC is past the file limit
            run = subprocess.run([*CLI, "bench", "read", "127.0.0.1", "--port", str(server.port), "--iters", "20",
                                  "--size", "4K", "--json"], capture_output=True, text=True, timeout=90)
            assert run.returncode == 0, run.stderr[-3000:]
            assert json.loads(run.stdout)["ok"]
    finally:
        assert server.stop() == 130
    assert sorted(p.name for p in tmp_path.glob("server.pcap*")) == ["server.pcap"]
    assert 24 < capture.stat().st_size <= 4096 and stat.S_IMODE(capture.stat().st_mode) == 0o600
    log = server.log.read_text()
    assert f"pcap {capture}: reached its limit of 4096 bytes" in log
    assert f"{capture}: 1 capture files written (the server's --pcap-max-files)" in log


@pytest.mark.anyio
@pytest.mark.loop_agnostic
async def test_each_local_rank_captures_to_its_own_file(tmp_path):
    """As bench's NIC N: rank N > 0 writes FILE.N (one file for all would be refused: it exists)."""
    import numpy as np

    from aiofabric import collectives
    capture = tmp_path / "ring.pcap"
    async with collectives.local(3, buffer_bytes=1 << 16, pcap=str(capture)) as comms:
        xs = [np.full(100, rank, np.int32) for rank in range(3)]
        await collectives.run_ranks([lambda c=c, x=x: c.allreduce(x) for c, x in zip(comms, xs)])
    assert all(np.array_equal(x, np.full(100, 3, np.int32)) for x in xs)
    names = ["ring.pcap", "ring.pcap.1", "ring.pcap.2"]
    assert sorted(p.name for p in tmp_path.iterdir()) == names
    assert all((tmp_path / name).stat().st_size > 24 for name in names)  # packets, not only the header


# -- the device-lock directory -----------------------------------------------------------------------------------------
def refused_lock(message: str) -> str:
    return "^" + re.escape(f"pre-flight lock: {message}") + "$"


@needs_root
def test_a_lock_directory_owned_by_another_user_is_refused(tmp_path):
    locks = tmp_path / "run-aiofabric"
    locks.mkdir(mode=0o755)
    os.chown(locks, NOBODY, NOBODY)
    with pytest.raises(PCIError, match=refused_lock(
            f"the device-lock directory {locks} is owned by uid {NOBODY}, not by us (uid 0); fix: remove it unless it "
            f"was made so on purpose (rm -r {locks}); aiofabric makes it again")):
        DeviceLock(ADDR, str(locks))
    assert list(locks.iterdir()) == []


@pytest.mark.parametrize("how", ["world-writable", "symlink"])
def test_a_lock_directory_others_can_write_or_a_symlink_is_refused(tmp_path, how):
    locks = tmp_path / "locks"
    if how == "symlink":
        (tmp_path / "elsewhere").mkdir(mode=0o755)
        locks.symlink_to(tmp_path / "elsewhere")
        problem = "is a symlink"
    else:
        locks.mkdir()
        locks.chmod(0o1777)  # what the fallback used to make
        problem = "is writable by group and others (mode 1777)"
    with pytest.raises(PCIError, match=refused_lock(f"the device-lock directory {locks} {problem}; fix: remove it "
                                                    f"unless it was made so on purpose (rm -r {locks}); aiofabric "
                                                    "makes it again")):
        DeviceLock(ADDR, str(locks))


def test_the_lock_directory_is_made_owner_only_writable_and_a_second_lock_names_the_holder(tmp_path):
    locks = tmp_path / "run" / "aiofabric"
    old_umask = os.umask(0)
    try:
        lock = DeviceLock(ADDR, str(locks))
    finally:
        os.umask(old_umask)
    try:
        assert stat.S_IMODE(locks.stat().st_mode) == 0o755 and lock.path == str(locks / f"{ADDR}.lock")
        assert stat.S_IMODE(os.stat(lock.path).st_mode) == 0o644
        with pytest.raises(PCIError, match=rf"^pre-flight lock: {ADDR} is in use by pid {os.getpid()} "):
            DeviceLock(ADDR, str(locks))
    finally:
        lock.release()


def lock_as_nobody(preferred: Path, runtime: Path | None) -> dict:
    """DeviceLock(ADDR, preferred) in a forked child that became uid NOBODY (a real other user, no capabilities):
    {"path", "mode"} of the lock it took, or {"error"}."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: only os calls and the lock, then _exit
        try:
            os.close(read)
            os.setgroups([])
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            os.environ.pop("XDG_RUNTIME_DIR", None)
            if runtime is not None:
                os.environ["XDG_RUNTIME_DIR"] = str(runtime)
            try:
                lock = DeviceLock(ADDR, str(preferred))
                answer = {"path": lock.path, "mode": stat.S_IMODE(os.stat(os.path.dirname(lock.path)).st_mode)}
            except PCIError as exc:
                answer = {"error": str(exc)}
            os.write(write, json.dumps(answer).encode())
        except BaseException as exc:
            os.write(write, json.dumps({"crashed": repr(exc)}).encode())
        finally:
            os._exit(0)
    os.close(write)
    ready: list[int] = []
    try:
        ready, _, _ = select.select([read], [], [], 30)
        assert ready, "the child answered nothing in 30 s"
        data = b""
        while chunk := os.read(read, 65536):  # until the child exits
            data += chunk
    finally:
        os.close(read)
        if not ready:
            os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    return json.loads(data)


@needs_root
def test_a_user_keeps_locks_in_their_runtime_dir_and_without_one_is_refused_not_sent_to_tmp():
    """A real user (uid 65534) who cannot make the preferred directory (/run/aiofabric is root's to make)."""
    base = Path(tempfile.mkdtemp(prefix="aiofabric-test-locks-"))  # not under pytest's 0700 tmp: the user reads it
    try:
        base.chmod(0o755)
        preferred = base / "run" / "aiofabric"
        (base / "run").mkdir(mode=0o755)  # root's, as /run is: the user cannot make aiofabric in it
        assert lock_as_nobody(preferred, None) == {"error": (
            f"pre-flight lock: no directory for device locks: {preferred} cannot be made (Permission denied), and "
            "XDG_RUNTIME_DIR is not set (a user's locks live in $XDG_RUNTIME_DIR/aiofabric, never under a name in "
            "/tmp another user could take first); fix: run as root, or in a login session (it sets XDG_RUNTIME_DIR "
            "to /run/user/UID, a directory only you can write)")}
        runtime = base / "user"
        runtime.mkdir(mode=0o700)
        os.chown(runtime, NOBODY, NOBODY)
        assert lock_as_nobody(preferred, runtime) == {"path": f"{runtime}/aiofabric/{ADDR}.lock", "mode": 0o700}
        preferred.mkdir(mode=0o755)  # root's own /run/aiofabric: the user still uses theirs
        assert lock_as_nobody(preferred, runtime) == {"path": f"{runtime}/aiofabric/{ADDR}.lock", "mode": 0o700}
        someone_elses = base / "other"
        someone_elses.mkdir(mode=0o755)
        assert lock_as_nobody(base / "run" / "missing", someone_elses)["error"] == (
            f"pre-flight lock: no directory for device locks: {base}/run/missing cannot be made (Permission denied), "
            f"and {someone_elses} is owned by uid 0, not by us (uid {NOBODY}); fix: run as root, or in a login "
            "session (it sets XDG_RUNTIME_DIR to /run/user/UID, a directory only you can write)")
    finally:
        shutil.rmtree(base)
