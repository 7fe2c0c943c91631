"""The engine's file in shared memory: its name while it is needed, and
files left by engines that have exited.

vLLM keeps an engine's primary tier in ``/dev/shm/vllm_offload_<engine
id>.mmap``. Its workers create and map it by that name; the scheduler, which
vLLM builds after every worker has mapped the region, maps it last. From
then on nobody needs the name: peers on this host open the region through
the owner's fd in ``/proc`` (:mod:`p2p_kv.data.shm_copy`), and the memory lives
as long as some process maps or holds it. So :func:`release_name` unlinks
the name once the scheduler has mapped the file, and the memory goes when
the engine's last process exits, however it exits (vLLM's own shutdown
SIGKILLs its engine processes a moment after asking them to stop, too soon
for any cleanup of theirs to run).

An engine killed before that point (during its start), or one whose region
is vLLM's own, leaves its file behind: each start takes a new engine id, so
such files pile up. :func:`sweep` removes those that no live process holds
open or mapped, as the kernel proves it (a write lease) or, failing that,
``/proc`` (:func:`p2p_kv.data.procfs.holders`).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import signal
import stat

from p2p_kv.data.procfs import holders, sees_every_process

__all__ = ["OFFLOAD_PREFIX", "names_file", "offload_path", "release_name", "sweep"]

log = logging.getLogger("vllm.p2p_kv.data.shm_file")

SHM_DIR = "/dev/shm"
OFFLOAD_PREFIX = "vllm_offload_"
OFFLOAD_SUFFIX = ".mmap"


def offload_path(engine_id: str) -> str:
    """The name vLLM gives an engine's shared region file."""
    return os.path.join(SHM_DIR, f"{OFFLOAD_PREFIX}{engine_id}{OFFLOAD_SUFFIX}")


def names_file(path: str, fd: int) -> bool:
    """Whether ``path`` names the file open as our ``fd``."""
    try:
        named = os.stat(path, follow_symlinks=False)
        held = os.fstat(fd)
    except OSError:
        return False
    return (named.st_dev, named.st_ino) == (held.st_dev, held.st_ino)


def release_name(path: str, fd: int) -> bool:
    """Unlink ``path`` if it still names our open file ``fd``; True if it
    did. Call it only once every process that opens the file by name has
    done so."""
    if not names_file(path, fd):
        return False
    try:
        os.unlink(path)
    except FileNotFoundError:
        return False
    log.info(
        "p2p_kv: unlinked %s: the engine's processes all have it mapped; "
        "its memory goes when the last of them exits",
        path,
    )
    return True


def sweep(
    directory: str = SHM_DIR,
    prefix: str = OFFLOAD_PREFIX,
    suffix: str = OFFLOAD_SUFFIX,
) -> list[tuple[str, int]]:
    """Remove the ``<prefix>*<suffix>`` files of ``directory`` that are
    ours (our effective uid owns them) and that no live process holds open
    or mapped; one log line per file removed, with its size. Returns
    ``(path, bytes)`` per file removed. Costs a directory listing while
    there is nothing to remove.

    The kernel proves a file unused: it grants a write lease
    (``F_SETLEASE``) only on a file no other process has open or mapped, in
    any pid namespace, and while we hold the lease nobody can open it
    unnoticed, so the unlink happens under the proof. Where leases are not
    to be had (``/proc/sys/fs/leases-enable`` off, a filesystem without
    them), ``/proc`` is the proof (:func:`p2p_kv.data.procfs.holders`), and
    only where it lists every process of the host and lets us read the
    fds and maps of each; otherwise every file stays, and one line says
    why."""
    try:
        entries = list(os.scandir(directory))
    except OSError:
        return []
    uid = os.geteuid()
    files: dict[tuple[int, int], tuple[str, int]] = {}
    for entry in entries:
        if not (entry.name.startswith(prefix) and entry.name.endswith(suffix)):
            continue
        try:
            st = entry.stat(follow_symlinks=False)
        except OSError:
            continue
        if stat.S_ISREG(st.st_mode) and st.st_uid == uid:
            files[(st.st_dev, st.st_ino)] = (entry.path, st.st_size)
    removed: list[tuple[str, int]] = []
    unproven: dict[tuple[int, int], tuple[str, int]] = {}
    for key, (path, size) in files.items():
        verdict = _remove_if_unused(path, key)
        if verdict is None:
            unproven[key] = (path, size)
        elif verdict:
            removed.append((path, size))
    if unproven:
        removed.extend(_sweep_by_proc(unproven))
    for path, size in removed:
        log.info(
            "p2p_kv: removed %s (%.1f MiB), left by an engine that has "
            "exited: no process holds it",
            path,
            size / (1 << 20),
        )
    return removed


def _remove_if_unused(path: str, key: tuple[int, int]) -> bool | None:
    """Unlink ``path`` (the file ``key``) under a write lease: True if
    removed, False if some process holds it (or it changed meanwhile),
    None if no lease was to be had."""
    try:
        # O_NONBLOCK: a file under someone's lease refuses at once.
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        st = os.fstat(fd)
        if (st.st_dev, st.st_ino) != key:
            return False
        try:
            # Should anyone open the file while we hold the lease, the
            # kernel signals us: SIGURG, ignored unless handled, not
            # SIGIO, whose default action ends the process.
            fcntl.fcntl(fd, fcntl.F_SETSIG, signal.SIGURG)
            fcntl.fcntl(fd, fcntl.F_SETLEASE, fcntl.F_WRLCK)
        except OSError as exc:
            if exc.errno in (errno.EAGAIN, errno.EBUSY):
                return False
            return None
        try:
            if not names_file(path, fd):
                return False
            os.unlink(path)
            return True
        finally:
            fcntl.fcntl(fd, fcntl.F_SETLEASE, fcntl.F_UNLCK)
    except OSError:
        return False
    finally:
        os.close(fd)


def _sweep_by_proc(
    files: dict[tuple[int, int], tuple[str, int]],
) -> list[tuple[str, int]]:
    if not sees_every_process():
        _left(files, "this process does not see every process of the host")
        return []
    held, hidden = holders({key: os.path.basename(p) for key, (p, _) in files.items()})
    if hidden:
        _left(files, f"the fds or maps of pid {hidden[0]} may not be read")
        return []
    removed: list[tuple[str, int]] = []
    for key, (path, size) in files.items():
        if key in held:
            continue
        with contextlib.suppress(OSError):
            st = os.stat(path, follow_symlinks=False)
            if (st.st_dev, st.st_ino) != key:
                continue  # replaced meanwhile
            os.unlink(path)
            removed.append((path, size))
    return removed


def _left(files: dict[tuple[int, int], tuple[str, int]], why: str) -> None:
    total = sum(size for _, size in files.values())
    log.info(
        "p2p_kv: left %d engine file(s) in shared memory (%.1f MiB, e.g. %s) "
        "that may belong to exited engines: no lease to prove them unused, "
        "and %s",
        len(files),
        total / (1 << 20),
        next(iter(files.values()))[0],
        why,
    )
