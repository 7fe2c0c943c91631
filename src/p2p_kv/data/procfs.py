"""What ``/proc`` tells about this process, its sockets and its peers.

The same-host copy path trusts a peer's shared file only after ``/proc``
has shown that the peer is who it says: on this boot, holding the far end of
our own control connection, naming a file in shared memory. The control
plane names its connections' sockets here (once a dial connects) so that
proof can be made later, and the GPU copier finds the CUDA
runtime torch loaded. Every reader is cheap enough for once-per-peer use
and returns None/False rather than raising when ``/proc`` says nothing.
:func:`holders` (which processes hold a file) is one pass over every
process, for the rare sweep of files in shared memory (:mod:`p2p_kv.data.shm_file`).
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
from collections.abc import Iterator, Mapping
from functools import cache

__all__ = [
    "boot_id",
    "holders",
    "holds_connection",
    "loaded_library",
    "mapping_of",
    "process_dir",
    "process_uids",
    "sees_every_process",
    "shm_devices",
    "socket_inode",
]


@cache
def boot_id() -> str:
    """This boot of this host (processes in containers on one host share it)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""


def _maps(
    text: str | None = None,
) -> Iterator[tuple[int, int, str, int, int, int, str]]:
    """Our mappings, from ``/proc/self/maps`` (or ``text`` in its format):
    ``(start, end, perms, file offset, dev, inode, path)``."""
    if text is None:
        try:
            with open("/proc/self/maps") as f:
                text = f.read()
        except OSError:
            return
    for line in text.splitlines():
        fields = line.split(maxsplit=5)
        if len(fields) < 5:
            continue
        lo, _, hi = fields[0].partition("-")
        major, _, minor = fields[3].partition(":")
        yield (
            int(lo, 16),
            int(hi, 16),
            fields[1],
            int(fields[2], 16),
            os.makedev(int(major, 16), int(minor, 16)),
            int(fields[4]),
            fields[5].strip() if len(fields) > 5 else "",
        )


def mapping_of(addr: int) -> tuple[int, int, str, int, int, int] | None:
    """``(start, end, perms, file offset, dev, ino)`` of our mapping at
    ``addr``."""
    for start, end, perms, offset, dev, ino, _ in _maps():
        if start <= addr < end:
            return start, end, perms, offset, dev, ino
    return None


def _endpoint(
    hexaddr: str,
) -> tuple[ipaddress.IPv4Address | ipaddress.IPv6Address, int]:
    """``/proc/net/tcp*``'s ``ADDR:PORT`` (hex, address in host order per
    32-bit word) as (address, port); IPv4-mapped IPv6 becomes IPv4, so the
    two ends of one connection compare equal across the two tables."""
    addr, _, port = hexaddr.rpartition(":")
    raw = b"".join(
        int(addr[i : i + 8], 16).to_bytes(4, "little") for i in range(0, len(addr), 8)
    )
    ip = ipaddress.ip_address(raw)
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return ip, int(port, 16)


def _tcp_sockets() -> list[tuple[str, str, str]]:
    """``(local, remote, inode)`` of every TCP socket in our network
    namespace, endpoints as raw ``/proc/net/tcp*`` fields."""
    out: list[tuple[str, str, str]] = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                next(f)  # the header
                out.extend((row[1], row[2], row[9]) for row in map(str.split, f))
        except (OSError, StopIteration):
            continue
    return out


def socket_inode(fd: int) -> str | None:
    """The inode of our socket ``fd`` (``socket:[N]`` in ``/proc``)."""
    try:
        link = os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return None
    if not (link.startswith("socket:[") and link.endswith("]")):
        return None
    return link[8:-1]


@contextlib.contextmanager
def process_dir(pid: int) -> Iterator[int | None]:
    """``/proc/<pid>`` as a directory fd (None if there is no such process)
    for the lookups of one proof. Pids are reused: a proof made of several
    lookups by pid could mix two processes, the peer and one given its pid
    after it exited. Lookups through this fd are all of the process it was
    opened for, and fail (ESRCH) once that one has exited."""
    try:
        fd = os.open(f"/proc/{pid}", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        yield None
        return
    try:
        yield fd
    finally:
        os.close(fd)


def holds_connection(proc: int | None, ours: str) -> bool:
    """Whether the process of ``proc`` (a :func:`process_dir`) holds the far
    end of our TCP connection (socket inode ``ours``): proof that it is the
    peer we talk to, which a listener on the same port number elsewhere is
    not."""
    if proc is None:
        return False
    sockets = _tcp_sockets()
    mine = [(_endpoint(lo), _endpoint(re)) for lo, re, ino in sockets if ino == ours]
    if not mine:
        return False
    local, remote = mine[0]
    wanted = {
        f"socket:[{ino}]"
        for lo, re, ino in sockets
        if ino != "0" and _endpoint(lo) == remote and _endpoint(re) == local
    }
    if not wanted:
        return False
    try:
        fds = os.open("fd", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC, dir_fd=proc)
    except OSError:
        return False
    try:
        for name in os.listdir(fds):
            with contextlib.suppress(OSError):
                if os.readlink(name, dir_fd=fds) in wanted:
                    return True
    except OSError:
        pass
    finally:
        os.close(fds)
    return False


def process_uids(proc: int | None) -> tuple[int, int] | None:
    """The real and effective uids of the process of ``proc`` (a
    :func:`process_dir`), or None once it has exited (``fstat`` of the
    directory would still answer then, with root's uid)."""
    if proc is None:
        return None
    try:
        fd = os.open("status", os.O_RDONLY | os.O_CLOEXEC, dir_fd=proc)
        with os.fdopen(fd) as f:
            for line in f:
                if line.startswith("Uid:"):
                    real, effective = line.split()[1:3]
                    return int(real), int(effective)
    except (OSError, ValueError, IndexError):
        pass
    return None


@cache
def shm_devices() -> frozenset[int]:
    """Devices of memory-backed files: ``/dev/shm`` and memfds. A file
    anywhere else (a FUSE or network filesystem) could stall a read."""
    devs = set()
    with contextlib.suppress(OSError):
        devs.add(os.stat("/dev/shm").st_dev)
    with contextlib.suppress(OSError):
        probe = os.memfd_create("p2p_kv-probe", os.MFD_CLOEXEC)
        try:
            devs.add(os.fstat(probe).st_dev)
        finally:
            os.close(probe)
    return frozenset(devs)


def loaded_library(stem: str, maps: str | None = None) -> str | None:
    """Path of the first shared object named ``<stem>.so*`` or
    ``<stem>-*.so*`` that this process has mapped (``maps``: a
    ``/proc/self/maps`` text, for tests): the CUDA runtime torch loaded,
    whatever its wheel called it, so we never load a second one."""
    for *_, path in _maps(maps):
        name = os.path.basename(path)
        rest = name[len(stem) :] if name.startswith(stem) else ""
        if rest.startswith((".so", "-")) and ".so" in rest:
            return path
    return None


#: The inode of ``/proc/self/ns/pid`` in the host's first pid namespace
#: (the kernel's ``PROC_PID_INIT_INO``).
_INIT_PID_NS = 0xEFFFFFFC


def sees_every_process() -> bool:
    """Whether ``/proc`` lists every process of this host: we run in the
    host's pid namespace and ``/proc`` is mounted for it. Elsewhere (a
    container) processes of other namespaces are invisible here, and
    nothing ``/proc`` says about who holds a file is a proof."""
    try:
        return os.stat("/proc/self/ns/pid").st_ino == _INIT_PID_NS and os.readlink(
            "/proc/self"
        ) == str(os.getpid())
    except OSError:
        return False


def _holds_files(
    proc: int, files: Mapping[tuple[int, int], str]
) -> set[tuple[int, int]] | None:
    """Which of ``files`` the process of ``proc`` (a :func:`process_dir`)
    holds: open (an fd) or mapped. None if we may not read its fds or
    maps; nothing once it has exited."""
    found: set[tuple[int, int]] = set()
    names = set(files.values())
    try:
        fds = os.open("fd", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC, dir_fd=proc)
    except PermissionError:
        return None
    except OSError:
        return found
    try:
        for name in os.listdir(fds):
            try:
                link = os.readlink(name, dir_fd=fds)
                # Only a link ending in one of the names is stat'ed: a
                # stat of a file on a network filesystem could stall.
                if os.path.basename(link.removesuffix(" (deleted)")) not in names:
                    continue
                st = os.stat(name, dir_fd=fds)
            except PermissionError:
                return None  # the directory lists, each link is refused
            except OSError:
                continue  # closed meanwhile
            if (st.st_dev, st.st_ino) in files:
                found.add((st.st_dev, st.st_ino))
    except PermissionError:
        return None
    except OSError:
        return found
    finally:
        os.close(fds)
    try:
        maps = os.open("maps", os.O_RDONLY | os.O_CLOEXEC, dir_fd=proc)
        with os.fdopen(maps) as f:
            text = f.read()
    except PermissionError:
        return None
    except OSError:
        return found
    if any(f" {ino} " in text for _, ino in files):
        found.update(
            (dev, ino) for *_, dev, ino, _ in _maps(text) if (dev, ino) in files
        )
    return found


def holders(
    files: Mapping[tuple[int, int], str],
) -> tuple[set[tuple[int, int]], list[int]]:
    """Which of ``files`` (``(st_dev, st_ino)`` to the file's name) some
    live process holds, open or mapped, and the pids whose fds or maps we
    may not read: any of those might hold any of them. One pass over
    ``/proc``, a readlink per fd (a stat only where the link ends in one
    of the names), one read of each process's maps. A file no process
    holds can still be opened by name meanwhile: only its maker's
    protocol (an engine id no live engine uses) makes that moot."""
    held: set[tuple[int, int]] = set()
    hidden: list[int] = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        with process_dir(int(entry.name)) as proc:
            if proc is None:
                continue  # exited
            found = _holds_files(proc, files)
        if found is None:
            hidden.append(int(entry.name))
        else:
            held |= found
    return held, hidden
