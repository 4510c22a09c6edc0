"""File discovery: processes on one host share a directory.

Layout under ``directory``::

    keys/k{percent-encoded key}   msgpack [lease_id, value]; lease_id 0 = no lease
    leases/{lease_id:x}           heartbeat: its text is the TTL in seconds, its mtime
                                  the last keep-alive

Every write is a temp file (``.tmp-*``) plus ``os.replace``, so a reader sees a whole
old or whole new file. A lease is alive while its heartbeat file exists and its mtime
is at most TTL seconds old (wall clock; all processes share the host's clock). Keys
bound to a dead lease are invisible, and whoever reads them first deletes them and the
stale heartbeat file. The owner touches its heartbeat every TTL/3 from a task owned
by the :class:`FileDiscovery` that granted it.

The directory is this user's alone: ``connect`` creates it with mode 0700, tightens
a directory of ours that others could write to, and refuses one owned by another user
(who could otherwise create it first under ``$TMPDIR`` and inject workers).

``watch_prefix`` polls every ``poll_interval_s`` and yields the difference with the
previous poll, so a put followed by a delete within one interval is never seen, and a
put that leaves the value unchanged yields nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import os
import secrets
import stat
import time
from collections.abc import AsyncGenerator
from pathlib import Path
from urllib.parse import quote, unquote

import msgspec

from kvmesh.errors import InvalidArgument
from kvmesh.runtime.discovery.base import Discovery, Lease, LeaseTasks, WatchEvent

__all__ = ["FileDiscovery", "FileLease"]

log = logging.getLogger("kvmesh.discovery.file")

_MAX_NAME = 255  # bytes in one file name on common Linux file systems


class _Record(msgspec.Struct, array_like=True, frozen=True):
    lease_id: int
    value: bytes


_encode_record = msgspec.msgpack.Encoder().encode
_decode_record = msgspec.msgpack.Decoder(_Record).decode
_RECORD_OVERHEAD = 16  # msgpack: the array, the lease id, the value's header
# what _read_record returns for a file larger than the bound (its lease is not read):
# the entry's value is then one byte over the bound, so the read bound refuses it
_OVERSIZED = _Record(0, b"")


class _Touch(enum.Enum):
    OK = "ok"
    GONE = "gone"  # removed by someone else, or already stale: the lease is over
    FAILED = "failed"  # could not write; retry until the TTL runs out


class FileLease(Lease):
    def __init__(self, owner: FileDiscovery, lease_id: int, ttl_s: float) -> None:
        super().__init__(lease_id, ttl_s)
        self._owner = owner

    async def revoke(self) -> None:
        await self._owner._revoke(self)


class FileDiscovery(Discovery):
    name = "file"

    def __init__(self, directory: str | os.PathLike[str], *, poll_interval_s: float = 0.1) -> None:
        if poll_interval_s <= 0:
            raise ValueError(f"poll_interval_s must be > 0, got {poll_interval_s}")
        super().__init__()
        root = Path(directory)
        self._root = root
        self._keys = root / "keys"
        self._leases = root / "leases"
        self._poll_interval_s = poll_interval_s
        self._heartbeats = LeaseTasks("file")
        self._ttls: dict[int, float] = {}  # lease id -> TTL read from its heartbeat file
        self._oversized = b""  # the value of an entry over the read bound (see _live_value)
        self._closed = asyncio.Event()

    # ------------------------------------------------------------------ lifecycle
    async def connect(self) -> None:
        for folder in (self._root, self._keys, self._leases):
            _private_dir(folder)

    async def close(self) -> None:
        """Stop heartbeats and end watches. Heartbeat files stay, so this process's keys
        vanish for others one TTL later (revoke first to remove them at once)."""
        self._closed.set()
        await self._heartbeats.stop_all()

    # ------------------------------------------------------------------ leases
    async def grant_lease(self, ttl_s: float) -> Lease:
        if ttl_s <= 0:
            raise ValueError(f"lease TTL must be > 0, got {ttl_s}")
        lease = FileLease(self, _new_lease_id(), ttl_s)
        _write_atomic(self._lease_path(lease.id), f"{ttl_s!r}\n".encode())
        self._heartbeats.start(lease.id, self._heartbeat(lease))
        return lease

    async def _revoke(self, lease: FileLease) -> None:
        await self._heartbeats.stop(lease.id)
        # Removing the heartbeat hides the keys from every reader at once.
        _unlink(self._lease_path(lease.id))
        lease.lost.set()
        self._drop_keys_of(lease.id)

    async def _heartbeat(self, lease: FileLease) -> None:
        last_ok = time.monotonic()
        while True:
            await asyncio.sleep(lease.ttl_s / 3)
            outcome = self._touch(lease)
            if outcome is _Touch.OK:
                last_ok = time.monotonic()
            elif outcome is _Touch.GONE or time.monotonic() - last_ok > lease.ttl_s:
                log.warning("file lease %x lost (%s)", lease.id, outcome.value)
                lease.expired = outcome is not _Touch.GONE
                lease.lost.set()
                with contextlib.suppress(OSError):  # readers collect them otherwise
                    self._drop_keys_of(lease.id)
                return

    def _touch(self, lease: FileLease) -> _Touch:
        path = self._lease_path(lease.id)
        try:
            if time.time() - path.stat().st_mtime > lease.ttl_s:
                # Readers already count this lease as expired and may have removed its
                # keys: reviving it would leave a live lease without its keys.
                _unlink(path)
                return _Touch.GONE
            os.utime(path)
            return _Touch.OK
        except FileNotFoundError:
            return _Touch.GONE
        except OSError as exc:
            log.warning("cannot touch heartbeat of lease %x: %s", lease.id, exc)
            return _Touch.FAILED

    def _lease_path(self, lease_id: int) -> Path:
        return self._leases / f"{lease_id:x}"

    def _lease_alive(self, lease_id: int, now: float) -> bool:
        """Whether the heartbeat is fresh; a stale one is deleted on the way."""
        path = self._lease_path(lease_id)
        try:
            mtime = path.stat().st_mtime
            ttl = self._lease_ttl(lease_id, path)
        except (FileNotFoundError, ValueError):
            self._ttls.pop(lease_id, None)
            return False
        if now - mtime <= ttl:
            return True
        _unlink(path)
        self._ttls.pop(lease_id, None)
        return False

    def _lease_ttl(self, lease_id: int, path: Path) -> float:
        ttl = self._ttls.get(lease_id)
        if ttl is None:
            ttl = self._ttls[lease_id] = float(path.read_text())
        return ttl

    # ------------------------------------------------------------------ keys
    async def put(self, key: str, value: bytes, lease_id: int | None = None) -> None:
        path = self._keys / _key_name(key)
        if lease_id and not self._lease_alive(lease_id, time.time()):
            raise InvalidArgument(f"lease {lease_id:x} not found")
        _write_atomic(path, _encode_record(_Record(lease_id or 0, bytes(value))))

    async def delete(self, key: str) -> None:
        _unlink(self._keys / _key_name(key))

    async def _get_prefix(self, prefix: str) -> dict[str, bytes]:
        return self._scan(prefix)

    def _scan(self, prefix: str) -> dict[str, bytes]:
        """Live entries under ``prefix``; entries of dead leases are deleted."""
        head = "k" + _quote(prefix)  # the encoding keeps prefixes: compare names only
        now = time.time()
        alive: dict[int, bool] = {}  # each heartbeat is checked once per scan
        found: dict[str, bytes] = {}
        with os.scandir(self._keys) as entries:
            for entry in entries:
                if entry.name.startswith(head):
                    value = self._live_value(entry, alive, now)
                    if value is not None:
                        found[unquote(entry.name[1:])] = value
        return found

    def _live_value(self, entry: os.DirEntry[str], alive: dict[int, bool], now: float) -> bytes | None:
        record = _read_record(entry.path, self.max_value_bytes + _RECORD_OVERHEAD)
        if record is _OVERSIZED:
            if len(self._oversized) != self.max_value_bytes + 1:
                self._oversized = bytes(self.max_value_bytes + 1)
            return self._oversized  # the same value each scan: a watch sees it once
        if record is None or not record.lease_id:
            return None if record is None else record.value
        if record.lease_id not in alive:
            alive[record.lease_id] = self._lease_alive(record.lease_id, now)
        if alive[record.lease_id]:
            return record.value
        _collect(entry)
        return None

    def _drop_keys_of(self, lease_id: int) -> None:
        with os.scandir(self._keys) as entries:
            for entry in entries:
                record = None if entry.name.startswith(".") else _read_record(entry.path, self.max_value_bytes + _RECORD_OVERHEAD)
                if record is not None and record.lease_id == lease_id:
                    _collect(entry)

    # ------------------------------------------------------------------ watch
    async def _watch_prefix(self, prefix: str) -> AsyncGenerator[WatchEvent, None]:
        known: dict[str, bytes] = {}
        while not self._closed.is_set():
            try:
                current = self._scan(prefix)
            except OSError as exc:
                # An unreadable directory is an outage, not a deletion: keep the view.
                log.warning("file discovery scan of %s failed: %s", self._keys, exc)
                current = known
            for event in _diff(known, current):
                yield event
            known = current
            await self._pause(self._poll_interval_s)

    async def _pause(self, seconds: float) -> None:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._closed.wait(), seconds)


def _private_dir(folder: Path) -> None:
    """Create ``folder`` with mode 0700, or check that an existing one is ours (and
    make it 0700); InvalidArgument when another user owns it or it is not a folder."""
    with contextlib.suppress(FileExistsError):
        folder.mkdir(mode=0o700, parents=True)
    st = os.lstat(folder)
    if not stat.S_ISDIR(st.st_mode):
        raise InvalidArgument(f"file discovery: {folder} is not a directory (a symlink or a file); remove it or pick another --file-discovery-dir")
    if st.st_uid != os.getuid():
        raise InvalidArgument(
            f"file discovery: {folder} is owned by user {st.st_uid}, not by this user ({os.getuid()});"
            " refusing it (anyone who owns it can inject workers); remove it or pick another --file-discovery-dir"
        )
    if st.st_mode & 0o077:
        log.warning("file discovery: %s was open to other users (mode %o); making it 0700", folder, st.st_mode & 0o777)
        os.chmod(folder, 0o700)


def _diff(old: dict[str, bytes], new: dict[str, bytes]) -> list[WatchEvent]:
    events = [WatchEvent("delete", key) for key in old if key not in new]
    events += [WatchEvent("put", key, value) for key, value in new.items() if old.get(key) != value]
    return events


def _quote(text: str) -> str:
    # Every character maps to itself or to %XX, so the encoding is reversible and the
    # encoding of a prefix is a prefix of the encoding of every key that has it.
    return quote(text, safe="")


def _key_name(key: str) -> str:
    # The "k" keeps names off "." / ".." and off the ".tmp-" prefix of temp files.
    name = "k" + _quote(key)
    if len(name.encode()) > _MAX_NAME:
        raise InvalidArgument(f"key too long for file discovery ({len(key)} chars): {key[:64]}...")
    return name


def _read_record(path: str, limit: int) -> _Record | None:
    """The record in ``path``; ``_OVERSIZED`` if it is over ``limit`` bytes (not read)."""
    try:
        with open(path, "rb") as f:
            data = f.read(limit + 1)
        return _OVERSIZED if len(data) > limit else _decode_record(data)
    except FileNotFoundError:
        return None  # deleted between listing and reading
    except msgspec.DecodeError:
        log.warning("ignoring unreadable discovery entry %s", path)
        return None


def _collect(entry: os.DirEntry[str]) -> None:
    """Delete a dead entry unless it was replaced since it was listed.

    NOTE: a put that replaces the file between the inode check and the unlink is still
    lost; keys carry their lease id in practice, so a dead lease's key is not re-put.
    """
    with contextlib.suppress(FileNotFoundError):
        if os.stat(entry.path).st_ino == entry.inode():
            os.unlink(entry.path)


def _write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".tmp-{os.getpid()}-{secrets.token_hex(6)}")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        _unlink(tmp)
        raise


def _unlink(path: Path | str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


def _new_lease_id() -> int:
    # Random 63-bit, never 0 (0 means "no lease" in a record).
    return secrets.randbits(63) or 1
