"""Makes the datatrace root match the desired switch files, never stepping outside it.

Every operation is relative to a descriptor of the root opened with O_NOFOLLOW, and every name
below it is opened with O_NOFOLLOW too: a symlink planted in the tree is refused, never followed.
No operation ever falls back to a path of its own: a job directory removed by someone else while
it is being made is made again (or the pass fails and is retried), never written around.
Files are replaced atomically (temporary file in the same directory, fsync, rename, fsync of the
directory), so TaskD, which polls the file every second, reads the old switch or the new one.
Only directories named `<namespace>.data-trace-<job>` with valid names are ever removed, and only
when they hold nothing but the switch file (and our own temporary files).
"""

from __future__ import annotations

import errno
import logging
import os
import stat
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from agent.datatrace.desired import SWITCH_KEY, Keep, parse_directory_name

log = logging.getLogger(__name__)

TMP_PREFIX = f".{SWITCH_KEY}.tmp-"
DIR_MODE, FILE_MODE = 0o755, 0o644
DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
MAKE_ATTEMPTS = 3  # a job directory removed between its mkdir and its open this often: the pass fails


class UnsafePath(Exception):
    """A path the writer will not use (a symlink or not a directory where one belongs)."""


@dataclass
class ApplyResult:
    written: int = 0
    removed_files: int = 0
    removed_dirs: int = 0
    in_force: int = 0  # switch files present after the pass
    errors: int = 0


class SwitchFiles:
    def __init__(self, root: Path):
        self.root = Path(root)
        self.counters: Counter[str] = Counter()
        self._complained: set[str] = set()

    def apply(self, directories: dict[str, bytes | Keep | None], remove_others: bool) -> ApplyResult:
        """Write what `directories` says; with `remove_others`, remove the directories it does not list."""
        result = ApplyResult()
        try:
            root_fd = self._open_root()
        except (OSError, UnsafePath) as exc:
            self._complain("root", "datatrace root unusable; nothing written", root=str(self.root), error=str(exc))
            result.errors += 1
            return result
        try:
            for name, content in directories.items():
                try:
                    present = self._ensure(root_fd, name, content, result)
                    result.in_force += present
                except (OSError, UnsafePath) as exc:
                    result.errors += 1
                    self._complain(name, "cannot update a profiling switch", directory=name, error=str(exc))
            if remove_others:
                for name in os.listdir(root_fd):
                    if name not in directories and parse_directory_name(name) is not None:
                        try:
                            self._remove(root_fd, name, result)
                        except (OSError, UnsafePath) as exc:
                            result.errors += 1
                            self._complain(name, "cannot remove a profiling switch directory",
                                           directory=name, error=str(exc))
        finally:
            os.close(root_fd)
        for key in ("written", "removed_files", "removed_dirs", "errors"):
            self.counters[key] += getattr(result, key)
        return result

    # ---- the pieces ---------------------------------------------------------------------------

    def _open_root(self) -> int:
        self.root.mkdir(parents=True, exist_ok=True)  # hostPath DirectoryOrCreate does the same
        fd = os.open(self.root, DIR_FLAGS)
        self._complained.discard("root")
        return fd

    def _open_dir(self, root_fd: int, name: str, create: bool) -> int:
        """A descriptor of directory `name` under the root, made first if `create`; FileNotFoundError
        if it is not there (or, with `create`, was removed again each time it was made)."""
        for _ in range(MAKE_ATTEMPTS if create else 1):
            if create:
                try:
                    os.mkdir(name, DIR_MODE, dir_fd=root_fd)
                except FileExistsError:
                    pass
            try:
                return os.open(name, DIR_FLAGS, dir_fd=root_fd)
            except FileNotFoundError:
                if not create:
                    raise
                continue  # removed since it was made (a job's directory being cleaned up): again
            except OSError as exc:
                if exc.errno in (errno.ELOOP, errno.ENOTDIR):
                    raise UnsafePath(f"{name} is a symlink or not a directory; left alone") from None
                raise
        raise FileNotFoundError(errno.ENOENT, "directory removed as soon as it was made", name)

    def _ensure(self, root_fd: int, name: str, content: bytes | Keep | None, result: ApplyResult) -> bool:
        """Make one directory right; whether a switch file is in force there afterwards."""
        dir_fd = self._open_dir(root_fd, name, create=True)
        try:
            current = self._read(dir_fd)
            if content is Keep.PREVIOUS:
                return current is not None
            if content is None:
                if current is not None:
                    os.unlink(SWITCH_KEY, dir_fd=dir_fd)
                    os.fsync(dir_fd)
                    result.removed_files += 1
                    log.info("profiling switch removed (its ConfigMap is gone)", extra={"directory": name})
                return False
            if current != content:
                self._replace(dir_fd, content)
                result.written += 1
                log.info("profiling switch written", extra={"directory": name, "bytes": len(content),
                                                            "value": content[:200].decode("utf-8", "replace")})
            self._complained.discard(name)
            return True
        finally:
            os.close(dir_fd)

    def _read(self, dir_fd: int) -> bytes | None:
        try:
            fd = os.open(SWITCH_KEY, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
        except FileNotFoundError:
            return None
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise UnsafePath(f"{SWITCH_KEY} is a symlink; left alone") from None
            raise
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise UnsafePath(f"{SWITCH_KEY} is not a regular file; left alone")
            chunks = []
            while chunk := os.read(fd, 1 << 20):
                chunks.append(chunk)
            return b"".join(chunks)
        finally:
            os.close(fd)

    def _replace(self, dir_fd: int, content: bytes) -> None:
        tmp = TMP_PREFIX + os.urandom(4).hex()
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, FILE_MODE,
                     dir_fd=dir_fd)
        try:
            try:
                view = memoryview(content)
                while view:
                    view = view[os.write(fd, view):]
                os.fchmod(fd, FILE_MODE)  # whatever the umask: training containers must read it
                os.fsync(fd)
            finally:
                os.close(fd)
            os.rename(tmp, SWITCH_KEY, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
        except BaseException:
            try:
                os.unlink(tmp, dir_fd=dir_fd)
            except OSError:
                pass
            raise
        os.fsync(dir_fd)

    def _remove(self, root_fd: int, name: str, result: ApplyResult) -> None:
        try:
            dir_fd = self._open_dir(root_fd, name, create=False)
        except FileNotFoundError:
            return  # gone already
        try:
            for entry in os.listdir(dir_fd):
                if entry == SWITCH_KEY or entry.startswith(TMP_PREFIX):
                    if not stat.S_ISREG(os.stat(entry, dir_fd=dir_fd, follow_symlinks=False).st_mode):
                        raise UnsafePath(f"{name}/{entry} is not a regular file; directory left alone")
                    os.unlink(entry, dir_fd=dir_fd)
                    result.removed_files += entry == SWITCH_KEY
        finally:
            os.close(dir_fd)
        try:
            os.rmdir(name, dir_fd=root_fd)
        except OSError as exc:
            if exc.errno == errno.ENOTEMPTY:
                raise UnsafePath(f"{name} holds files that are not ours; directory left") from None
            raise
        os.fsync(root_fd)
        result.removed_dirs += 1
        log.info("profiling switch directory removed (no pod of the job left on this node)",
                 extra={"directory": name})

    def _complain(self, key: str, message: str, **fields) -> None:
        """Log a persisting problem once, not on every pass."""
        if key not in self._complained:
            self._complained.add(key)
            log.error(message, extra=fields)
