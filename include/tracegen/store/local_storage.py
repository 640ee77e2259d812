"""A local directory as an output root: atomic writes by rename or link of an fsynced temp file, and reads
that never follow a link inside the root (every open is O_NOFOLLOW, relative to the root's descriptor)."""

from __future__ import annotations

import errno
import fcntl
import hashlib
import os
import secrets
import stat
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

from tracegen.store.storage_base import (
    _TMP_PREFIX,
    Fenced,
    Storage,
    StorageError,
    StorageKeyError,
    StorageLinkError,
    StorageRootError,
    _check_prefix,
    _check_range,
    check_key,
)

_ROOT_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC
# Below the root every component is opened without following links: a link inside the root is data.
_DIR_FLAGS = _ROOT_FLAGS | os.O_NOFOLLOW
# O_NONBLOCK: a FIFO planted under a key must not hang the reader before fstat says it is no file.
_READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
_TMP_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
# The root's lock (an flock) for conditional writes. Its name starts like a temp file's: no key can name it
# (`check_key`) and listings hide it.
_LOCK_NAME = f"{_TMP_PREFIX}root.lock"


class LocalStorage(Storage):
    """A directory. put = temp file in the same dir + fsync + os.replace + fsync(dir).

    The root path is the operator's configuration: links in it (the root itself a link to a volume) are
    followed, once, when the root is opened. Everything below it is data: each component is opened with
    O_NOFOLLOW relative to its parent's descriptor, so no read, write, listing or delete ever leaves the
    root through a link, and a link swapped in between a check and an open is refused too. Listings skip
    links (and FIFOs, sockets, devices); reading one is a `StorageLinkError`.

    Opening creates nothing: a reader of a missing root sees no objects (`require_root` makes that an
    error naming the path), and only `put` creates the root and its directories.
    """

    def __init__(self, root: str | os.PathLike[str]) -> None:
        path = Path(root)
        if not path.is_absolute():
            raise ValueError(f"local storage root must be an absolute path, got {str(root)!r}")
        self.root = path
        self.uri = path.as_uri() + "/"

    def require_root(self) -> None:
        try:
            st = os.stat(self.root)
        except (FileNotFoundError, NotADirectoryError):
            if os.path.islink(self.root):
                raise StorageRootError(
                    f"output root {self.root} does not exist: it is a symbolic link to "
                    f"{os.readlink(self.root)!r}, which is missing (nothing was created)"
                ) from None
            raise StorageRootError(
                f"output root {self.root} does not exist (nothing was created; check the path)"
            ) from None
        if not stat.S_ISDIR(st.st_mode):
            raise StorageRootError(f"output root {self.root} is not a directory")

    def _open_root(self, create: bool) -> int:
        try:
            return os.open(self.root, _ROOT_FLAGS)
        except FileNotFoundError:
            if not create:
                raise
            if os.path.islink(self.root):
                # A dangling link is often an unmounted volume: creating its target would write elsewhere.
                raise StorageRootError(
                    f"output root {self.root} is a symbolic link to {os.readlink(self.root)!r}, which does not "
                    "exist; not creating it"
                ) from None
            os.makedirs(self.root, exist_ok=True)
            return os.open(self.root, _ROOT_FLAGS)
        except NotADirectoryError:
            raise StorageError(f"output root {self.root} is not a directory") from None

    def _link_error(self, key: str, parent_fd: int, name: str, shown: str) -> StorageLinkError | None:
        """A StorageLinkError when `name` (under `parent_fd`) is a link, else None."""
        try:
            st = os.stat(name, dir_fd=parent_fd, follow_symlinks=False)
        except OSError:
            return None
        if stat.S_ISLNK(st.st_mode):
            return StorageLinkError(self.uri + key, f"{shown} is a symbolic link")
        return None

    def _dir_fd(self, dirs: list[str], key: str, *, create: bool = False) -> int:
        """A descriptor of root/dirs[0]/dirs[1]/..., no component below the root followed if it is a link.
        FileNotFoundError / NotADirectoryError when a component is missing or not a directory (a reader's
        missing key), StorageLinkError when one is a link; with `create`, missing ones are made."""
        fd = self._open_root(create)
        try:
            for i, name in enumerate(dirs):
                try:
                    sub = os.open(name, _DIR_FLAGS, dir_fd=fd)
                except FileNotFoundError:
                    if not create:
                        raise
                    try:
                        os.mkdir(name, dir_fd=fd)
                    except FileExistsError:  # a concurrent writer made it (or it is a dangling link: see below)
                        pass
                    try:
                        sub = os.open(name, _DIR_FLAGS, dir_fd=fd)
                    except NotADirectoryError:
                        raise self._link_error(key, fd, name, "/".join(dirs[: i + 1])) or StorageError(
                            f"{self.uri}{'/'.join(dirs[: i + 1])} is not a directory (writing {key})"
                        ) from None
                except NotADirectoryError:  # a file, or (O_NOFOLLOW | O_DIRECTORY) a link
                    link = self._link_error(key, fd, name, "/".join(dirs[: i + 1]))
                    if link is not None:
                        raise link from None
                    raise
                os.close(fd)
                fd = sub
        except BaseException:
            os.close(fd)
            raise
        return fd

    @contextmanager
    def _parent(self, key: str, *, create: bool = False) -> Iterator[tuple[int, str]]:
        """(descriptor of the key's directory, the key's last segment); StorageKeyError if it is missing."""
        parts = check_key(key).split("/")
        try:
            fd = self._dir_fd(parts[:-1], key, create=create)
        except (FileNotFoundError, NotADirectoryError):
            raise StorageKeyError(self.uri_for(key)) from None
        try:
            yield fd, parts[-1]
        finally:
            os.close(fd)

    def _open_read(self, key: str) -> int:
        """A descriptor of the regular file at `key`, read-only; never through a link."""
        with self._parent(key) as (dfd, name):
            try:
                fd = os.open(name, _READ_FLAGS, dir_fd=dfd)
            except (FileNotFoundError, NotADirectoryError):
                raise StorageKeyError(self.uri_for(key)) from None
            except OSError as exc:
                if exc.errno == errno.ELOOP:
                    raise StorageLinkError(self.uri_for(key), f"{key} is a symbolic link") from None
                raise
        try:
            st = os.fstat(fd)
        except BaseException:
            os.close(fd)
            raise
        if stat.S_ISREG(st.st_mode):
            return fd
        os.close(fd)
        if stat.S_ISDIR(st.st_mode):  # a directory is not an object
            raise StorageKeyError(self.uri_for(key))
        raise StorageLinkError(self.uri_for(key), f"{key} is not a regular file")

    def _lstat(self, key: str) -> os.stat_result:
        with self._parent(key) as (dfd, name):
            try:
                return os.stat(name, dir_fd=dfd, follow_symlinks=False)
            except (FileNotFoundError, NotADirectoryError):
                raise StorageKeyError(self.uri_for(key)) from None

    def put(self, key: str, data: bytes) -> None:
        with self._parent(key, create=True) as (dfd, name):
            tmp = _write_temp(dfd, data)
            try:
                # Replaces a link planted at `key` itself, never writes through it.
                os.replace(tmp, name, src_dir_fd=dfd, dst_dir_fd=dfd)
            except BaseException:
                _discard(tmp, dfd)
                raise
            # The rename is durable only once the directory entry is on disk.
            os.fsync(dfd)

    def create(self, key: str, data: bytes) -> bool:
        with self._parent(key, create=True) as (dfd, name):
            tmp = _write_temp(dfd, data)
            try:
                # link() fails with EEXIST when the name exists (a link planted there too), atomically: the
                # whole object appears or none.
                try:
                    os.link(tmp, name, src_dir_fd=dfd, dst_dir_fd=dfd, follow_symlinks=False)
                except FileExistsError:
                    return False
            finally:
                _discard(tmp, dfd)
            os.fsync(dfd)
            return True

    @contextmanager
    def _locked(self) -> Iterator[None]:
        """The root's lock, held across processes (and threads: each holder opens its own descriptor) by
        flock, which the kernel drops when a holder dies. A holder stopped (SIGSTOP) keeps it: conditional
        writes of the root then wait for it, which is the point, since it may still write."""
        root_fd = self._open_root(create=True)
        try:
            fd = os.open(_LOCK_NAME, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=root_fd)
        finally:
            os.close(root_fd)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)

    def _version_or_none(self, key: str) -> str | None:
        try:
            return hashlib.sha256(self.get(key)).hexdigest()
        except StorageKeyError:
            return None

    def version(self, key: str) -> str:
        return hashlib.sha256(self.get(key)).hexdigest()

    def swap(self, key: str, data: bytes, expected: str | None, *, deadline: float | None = None) -> str | None:
        with self._locked():
            if self._version_or_none(key) != expected:
                return None
            if deadline is not None and time.monotonic() > deadline:
                raise Fenced(f"not writing {self.uri_for(key)}: its deadline passed")
            self.put(key, data)
        return hashlib.sha256(data).hexdigest()

    def remove_if(self, key: str, expected: str) -> bool:
        with self._locked():
            if self._version_or_none(key) != expected:
                return False
            self.delete(key)
        return True

    def put_guarded(self, key: str, data: bytes, guards: Mapping[str, str], deadline: float) -> None:
        with self._locked():
            for guard, version in guards.items():
                if self._version_or_none(guard) != version:
                    raise Fenced(f"not writing {self.uri_for(key)}: {self.uri_for(guard)} was replaced or removed")
            if time.monotonic() > deadline:
                raise Fenced(f"not writing {self.uri_for(key)}: its fence's deadline passed")
            self.put(key, data)

    def modified(self, key: str) -> float:
        st = self._lstat(key)
        if not stat.S_ISREG(st.st_mode):
            raise StorageKeyError(self.uri_for(key))
        return st.st_mtime

    def get(self, key: str) -> bytes:
        with os.fdopen(self._open_read(key), "rb") as f:
            return f.read()

    def get_range(self, key: str, start: int, length: int) -> bytes:
        _check_range(start, length)
        with os.fdopen(self._open_read(key), "rb") as f:
            f.seek(start)
            return f.read(length)

    def exists(self, key: str) -> bool:
        try:
            return stat.S_ISREG(self._lstat(key).st_mode)
        except StorageKeyError:  # missing, or a link on the way
            return False

    def size(self, key: str) -> int:
        st = self._lstat(key)
        if stat.S_ISREG(st.st_mode):
            return st.st_size
        if stat.S_ISLNK(st.st_mode):
            raise StorageLinkError(self.uri_for(key), f"{key} is a symbolic link")
        raise StorageKeyError(self.uri_for(key))

    def list(self, prefix: str = "") -> list[str]:
        return sorted(self._scan(prefix))

    def sizes(self, prefix: str = "") -> dict[str, int]:
        # The walk's own lstat gives the sizes: no second walk down to each key.
        return dict(sorted(self._scan(prefix, with_sizes=True).items()))

    def _scan(self, prefix: str, with_sizes: bool = False) -> dict[str, int]:
        """Regular files under the root whose keys start with `prefix`. Walks only the deepest directory the
        prefix names, never into a link, and skips links, FIFOs, sockets and crashed writers' temp files."""
        _check_prefix(prefix)
        base = prefix.rsplit("/", 1)[0] if "/" in prefix else ""
        try:
            fd = self._dir_fd(base.split("/") if base else [], prefix or ".")
        except (FileNotFoundError, NotADirectoryError, StorageLinkError):
            return {}  # nothing there, or a link: nothing listed
        out: dict[str, int] = {}
        try:
            self._scan_dir(fd, base, prefix, with_sizes, out)
        finally:
            os.close(fd)
        return out

    def _scan_dir(self, fd: int, rel: str, prefix: str, with_sizes: bool, out: dict[str, int]) -> None:
        subdirs = []
        with os.scandir(fd) as entries:
            for entry in entries:
                key = f"{rel}/{entry.name}" if rel else entry.name
                if not key.startswith(prefix):
                    continue
                if entry.is_dir(follow_symlinks=False):
                    subdirs.append((entry.name, key))
                elif entry.is_file(follow_symlinks=False) and not entry.name.startswith(_TMP_PREFIX):
                    out[key] = entry.stat(follow_symlinks=False).st_size if with_sizes else 0
        # One directory open at a time per level: a root with thousands of runs needs no more descriptors.
        for name, key in subdirs:
            try:
                sub = os.open(name, _DIR_FLAGS, dir_fd=fd)
            except (FileNotFoundError, NotADirectoryError):  # gone since, or swapped for a link
                continue
            try:
                self._scan_dir(sub, key, prefix, with_sizes, out)
            finally:
                os.close(sub)

    def delete(self, key: str) -> None:
        try:
            with self._parent(key) as (dfd, name):
                os.unlink(name, dir_fd=dfd)  # a link at `key` itself is removed, never followed
        except StorageLinkError:
            raise
        except (StorageKeyError, FileNotFoundError):
            pass

    def uri_for(self, key: str) -> str:
        return self.uri + check_key(key)


def _write_temp(dfd: int, data: bytes) -> str:
    """`data` in a fresh, fsynced temp file of the directory `dfd`: the name to rename or link into place.
    A failed write removes it."""
    tmp = f"{_TMP_PREFIX}{secrets.token_hex(8)}"
    fd = os.open(tmp, _TMP_FLAGS, 0o600, dir_fd=dfd)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
    except BaseException:
        _discard(tmp, dfd)
        raise
    return tmp


def _discard(tmp: str, dfd: int) -> None:
    """Remove a temp file of the directory `dfd`: one a failed write left, or the name a link made redundant."""
    try:
        os.unlink(tmp, dir_fd=dfd)
    except FileNotFoundError:
        pass


def fsync_dir(path: str | os.PathLike[str]) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


