"""Files written whole or not at all, and output paths checked before any work."""
from __future__ import annotations

import contextlib
import errno
import os
import stat
from typing import IO, Callable, Iterator, Optional


def atomic_write(path: str, dump: Callable[[IO[bytes]], None], *, fsync: bool = False) -> str:
    """Call `dump(f)` on a temporary file beside `path`, then rename it to `path`.

    A crash, a kill or a full disk mid-write leaves the old file (or none), never half a
    new one, and no temporary file behind where Python still runs. A file it replaces
    keeps its permission bits, and a read-only one is refused (`replaceable_mode`).
    A symbolic link (a checkpoint linked into a mounted drive) is written through, as
    `open(path, "wb")` would: the file it points to is replaced, beside itself, and the
    link stays; a dangling link gets its file made.

    Example:
        >>> import os, tempfile
        >>> path = os.path.join(tempfile.mkdtemp(), "a.bin")
        >>> _ = atomic_write(path, lambda f: f.write(b"abc"))
        >>> open(path, "rb").read()
        b'abc'
    """
    target = _through_links(path)
    mode = replaceable_mode(target)
    tmp = f"{target}.tmp-{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            dump(f)
            if fsync:
                f.flush()
                os.fsync(f.fileno())
        if mode is not None:  # the file it replaces keeps its permissions
            os.chmod(tmp, mode)
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    return path


def _through_links(path: str) -> str:
    """The file `path` names once its symbolic links are followed (the path itself when it
    is none): where `open(path, "wb")` would write. A link that leads back to itself is
    refused, as open refuses it."""
    if not os.path.islink(path):
        return path
    target = os.path.realpath(path)
    if os.path.islink(target):  # realpath stops inside a loop
        raise OSError(errno.ELOOP, "a symbolic link that leads back to itself", path)
    return target


def replaceable_mode(path: str) -> Optional[int]:
    """The permission bits of the file at `path` that a write may replace (None: no file).

    A rename replaces a file whatever its permissions; a file its owner may not write
    (`chmod 444 best.pt`) was protected on purpose, so it is refused, as `open(path, "w")`
    refuses it for anyone but root.

    Example:
        >>> import os, tempfile
        >>> path = os.path.join(tempfile.mkdtemp(), "best.pt")
        >>> replaceable_mode(path) is None
        True
    """
    try:
        st = os.stat(path)
    except OSError:
        return None
    if not stat.S_ISREG(st.st_mode):
        return None
    if not st.st_mode & stat.S_IWUSR or not os.access(path, os.W_OK):
        raise PermissionError(errno.EACCES, f"read-only (mode {stat.S_IMODE(st.st_mode):o}), "
                              f"so it is protected: make it writable (chmod u+w) to replace "
                              f"it, or write another name", path)
    return stat.S_IMODE(st.st_mode)


def check_writable(path: Optional[str], argument: str) -> None:
    """Before any work: `path`'s folder exists (made if not) and takes a new file, and a
    file already there is not read-only; the error names the argument and the cause.

    Example:
        >>> import os, tempfile
        >>> check_writable(os.path.join(tempfile.mkdtemp(), "new", "best.pt"), "save_best")
    """
    if path is None:
        return
    try:  # a link is written through: the file it names is the one to check
        target = _through_links(path)
    except OSError as e:
        raise OSError(e.errno, f"{argument}={path!r} cannot be written: it is {e.strerror}") from None
    directory = os.path.dirname(os.path.abspath(target))
    probe = os.path.join(directory, f".tpu_utility-probe-{os.getpid()}")
    try:
        os.makedirs(directory, exist_ok=True)
        with open(probe, "wb"):
            pass
        os.remove(probe)
    except OSError as e:
        blocker = _file_in_the_way(directory)
        if blocker is not None:
            raise NotADirectoryError(errno.ENOTDIR, f"{argument}={path!r} cannot be written: "
                                     f"{blocker} is a file, not a folder; pick another path")
        raise OSError(e.errno, f"{argument}={path!r} cannot be written ({e.strerror or e} in "
                      f"{directory}): pick a writable folder, such as /kaggle/working or the "
                      f"current directory") from None
    if os.path.isdir(target):
        raise IsADirectoryError(f"{argument}={path!r} is a folder: give a file name in it")
    try:  # a protected file is refused now, not after the work meant for it
        replaceable_mode(target)
    except PermissionError as e:
        raise PermissionError(e.errno, f"{argument}={path!r} is {e.strerror}") from None


def _file_in_the_way(directory: str) -> Optional[str]:
    """The nearest existing ancestor of `directory` (itself included) when it is not a folder."""
    while not os.path.exists(directory):
        parent = os.path.dirname(directory)
        if parent == directory:
            return None
        directory = parent
    return None if os.path.isdir(directory) else directory


@contextlib.contextmanager
def exclusive(path: str, argument: str) -> Iterator[None]:
    """Hold `path` for this process alone while inside: a second live run on the same
    path is refused, naming the process that holds it.

    The lock is a POSIX lock on `path + ".lock"`, which the kernel drops when the holder
    dies however it dies, so a killed run never leaves a stale lock behind. Where the file
    system has no locks, nothing is held.

    Example:
        >>> import os, tempfile
        >>> path = os.path.join(tempfile.mkdtemp(), "run.pt")
        >>> with exclusive(path, "checkpoint"):
        ...     os.path.exists(path + ".lock")
        True
        >>> os.path.exists(path + ".lock")
        False
    """
    import fcntl
    lock = f"{path}.lock"
    for _ in range(3):
        fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            # A POSIX record lock, not flock: it belongs to this process alone, so the
            # DataLoader workers it forks do not keep it after this process is killed.
            fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except (BlockingIOError, PermissionError):
            holder = os.read(fd, 32).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise RuntimeError(f"{argument}={path!r} is in use by another run that is still "
                               f"going (process {holder}), and two runs on one path would "
                               f"overwrite each other's work: give each run its own path (one "
                               f"per fold in a k-fold loop), or wait for that run to end") from None
        except OSError:
            os.close(fd)  # no locks here (some network file systems): nothing to hold
            yield
            return
        try:  # the holder before us may have removed the file between our open and lock
            same = os.fstat(fd).st_ino == os.stat(lock).st_ino
        except FileNotFoundError:
            same = False
        if same:
            break
        os.close(fd)
    else:
        raise RuntimeError(f"{argument}={path!r}: could not lock {lock}, which other runs keep "
                           f"replacing: give this run its own path")
    try:
        os.ftruncate(fd, 0)
        os.write(fd, str(os.getpid()).encode())
        yield
    finally:
        with contextlib.suppress(OSError):
            os.remove(lock)  # while still held: no one can take the removed file's lock after
        os.close(fd)
