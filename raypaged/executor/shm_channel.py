"""The step channel of a shard group whose shards share the driver's node: shared memory
plus doorbells, no Ray on the per-step path.

Each step the driver pickles the ``SchedulerOutput`` once into a shared-memory ring that
every shard reads (:class:`ShmRing`: one writer, ``n`` readers, each reader acknowledging
the sequence number it has copied out), then rings each shard's doorbell (:class:`Doorbell`,
a Unix datagram socket in Linux's abstract namespace: a blocked ``recv`` wakes in
microseconds and costs nothing while it waits, where a spinning reader would take a core
from the shards' forward on a small CPU box). Each shard answers through its own
one-reader ring and rings the driver's doorbell with its rank.

A message larger than a slot goes to a file of its own beside the ring (named by the ring
and the message's sequence number), removed by the writer once every reader has
acknowledged it. The ring files are unlinked as soon as every shard has mapped them, so
nothing is left in ``/dev/shm`` when a process dies.

Ray still places, starts, watches and restarts the shard actors: each shard's loop
(:func:`serve_steps`) runs as one long actor call, so a shard that dies ends that call
with an error, which the driver checks for while it waits (``on_wait``).
"""

from __future__ import annotations

import mmap
import os
import pickle
import socket
import struct
import sys
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

SHM_DIR = "/dev/shm"
_FIELD = struct.Struct("<Q")
_SLOT_HEADER = struct.Struct("<QQQ")  # sequence number, payload length, 1 if the payload is in its own file
_RING_HEADER = struct.Struct("<QQQ")  # readers, slots, slot bytes; then one acknowledged seq per reader
_WAIT_SLICE_S = 0.1  # how often a waiting driver looks for a shard that died
_STOP = None  # the message that ends a shard's loop


class ChannelTimeout(TimeoutError):
    """No message within the timeout."""


class PeerGone(ConnectionError):
    """A doorbell's owner is gone (its socket is closed: the process died or left its loop)."""


def available() -> bool:
    """Whether this machine has what the channel needs: Linux (abstract sockets) and a writable /dev/shm."""
    return sys.platform.startswith("linux") and os.access(SHM_DIR, os.W_OK)


class ShmRing:
    """A ring of fixed-size slots in one shared-memory file: one writer, ``num_readers`` readers.

    The writer's ``put`` waits until every reader has acknowledged the message that last used
    the slot; a reader's ``get(reader, seq)`` copies message ``seq`` out and acknowledges it.
    Who reads when is the doorbells' business: the ring only stores and checks order.
    """

    def __init__(
        self, path: str, create: bool, num_readers: int = 1, num_slots: int = 2, slot_bytes: int = 1 << 20
    ) -> None:
        self.path = path
        if create:
            size = _slots_offset(num_readers) + num_slots * (_SLOT_HEADER.size + slot_bytes)
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
            try:
                os.ftruncate(fd, size)
                self._map = mmap.mmap(fd, size)
            finally:
                os.close(fd)
            _RING_HEADER.pack_into(self._map, 0, num_readers, num_slots, slot_bytes)
        else:
            fd = os.open(path, os.O_RDWR)
            try:
                self._map = mmap.mmap(fd, os.fstat(fd).st_size)
            finally:
                os.close(fd)
            num_readers, num_slots, slot_bytes = _RING_HEADER.unpack_from(self._map, 0)
        self._slots_at = _slots_offset(num_readers)
        self.num_readers, self.num_slots, self.slot_bytes = num_readers, num_slots, slot_bytes
        self._seq = 0  # the writer's last message
        self._overflow: dict[int, str] = {}  # seq -> its own file, until every reader acknowledged it
        self._linked = create

    def _slot(self, seq: int) -> int:
        return self._slots_at + (seq % self.num_slots) * (_SLOT_HEADER.size + self.slot_bytes)

    def acknowledged(self, reader: int) -> int:
        return _FIELD.unpack_from(self._map, _RING_HEADER.size + _FIELD.size * reader)[0]

    def _all_acknowledged(self) -> int:
        return min(self.acknowledged(r) for r in range(self.num_readers))

    def put(self, payload: bytes, timeout: float) -> int:
        """Store ``payload`` as the next message; its sequence number (1, 2, ...)."""
        seq = self._seq + 1
        deadline = time.monotonic() + timeout
        while (acknowledged := self._all_acknowledged()) < seq - self.num_slots:  # the slot's last message is unread
            if time.monotonic() > deadline:
                raise ChannelTimeout(f"{self.path}: message {seq - self.num_slots} was not read within {timeout:g} s")
            time.sleep(0.0002)
        self._drop_overflow(acknowledged)
        at = self._slot(seq)
        if len(payload) <= self.slot_bytes:
            self._map[at + _SLOT_HEADER.size : at + _SLOT_HEADER.size + len(payload)] = payload
            _SLOT_HEADER.pack_into(self._map, at, seq, len(payload), 0)
        else:
            path = f"{self.path}.{seq}"
            with open(path, "wb") as f:
                f.write(payload)
            self._overflow[seq] = path
            _SLOT_HEADER.pack_into(self._map, at, seq, len(payload), 1)
        self._seq = seq
        return seq

    def get(self, reader: int, seq: int) -> bytes:
        """Message ``seq`` (copied out, then acknowledged for ``reader``)."""
        at = self._slot(seq)
        stored, length, in_file = _SLOT_HEADER.unpack_from(self._map, at)
        if stored != seq:
            raise RuntimeError(f"{self.path}: expected message {seq}, the slot holds {stored}")
        if in_file:
            with open(f"{self.path}.{seq}", "rb") as f:
                payload = f.read()
        else:
            payload = self._map[at + _SLOT_HEADER.size : at + _SLOT_HEADER.size + length]
        _FIELD.pack_into(self._map, _RING_HEADER.size + _FIELD.size * reader, seq)
        return payload

    def _drop_overflow(self, acknowledged: int) -> None:
        for seq in [s for s in self._overflow if s <= acknowledged]:
            _unlink(self._overflow.pop(seq))

    def unlink(self) -> None:
        """Remove the ring's file (mappings stay valid); the writer's overflow files go at ``close``."""
        if self._linked:
            self._linked = False
            _unlink(self.path)

    def close(self) -> None:
        self.unlink()
        for path in self._overflow.values():
            _unlink(path)
        self._overflow.clear()
        self._map.close()


def _slots_offset(num_readers: int) -> int:
    """Where a ring's slots start: after its header and one acknowledged seq per reader, on a cache line."""
    return -(-(_RING_HEADER.size + _FIELD.size * num_readers) // 64) * 64


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


class Doorbell:
    """A datagram socket bound to ``name`` in the abstract namespace: ``wait`` blocks until a ``ring``."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind("\0" + name)

    def wait(self, timeout: float | None) -> bytes:
        """The next ring's data; :class:`ChannelTimeout` after ``timeout`` seconds (``None``: forever)."""
        self.sock.settimeout(timeout)
        try:
            return self.sock.recv(64)
        except TimeoutError:
            raise ChannelTimeout(f"no ring on {self.name} within {timeout:g} s") from None

    def close(self) -> None:
        self.sock.close()


def ring(sock: socket.socket, name: str, data: bytes = b"") -> None:
    """Wake the owner of doorbell ``name``; :class:`PeerGone` when there is none."""
    try:
        sock.sendto(data, "\0" + name)
    except (ConnectionRefusedError, FileNotFoundError) as err:
        raise PeerGone(f"doorbell {name} has no owner") from err


@dataclass(frozen=True)
class ShardEndpoints:
    """What one shard's loop needs to join the channel (sent to it once, by a plain actor call)."""

    rank: int
    steps_path: str
    result_path: str
    driver_bell: str
    own_bell: str


class ShmStepChannel:
    """The driver's end: broadcast a step to every shard, collect each shard's reply.

    Up to ``depth`` steps may be sent before the first one's replies are collected (pipeline parallelism's
    micro-batches: the first stage starts the next step while the last one finishes this one); ``receive``
    collects them in the order they were sent."""

    def __init__(self, num_ranks: int, slot_bytes: int = 1 << 20, depth: int = 1) -> None:
        token = f"raypaged-{os.getpid()}-{uuid.uuid4().hex[:12]}"
        self.num_ranks = num_ranks
        num_slots = max(2, depth + 1)
        self._steps = ShmRing(
            os.path.join(SHM_DIR, token + "-steps"), True, num_ranks, num_slots=num_slots, slot_bytes=slot_bytes
        )
        self._results: list[ShmRing] = []
        try:
            for rank in range(num_ranks):
                path = os.path.join(SHM_DIR, f"{token}-result{rank}")
                self._results.append(ShmRing(path, True, 1, num_slots=num_slots, slot_bytes=slot_bytes))
            self._bell = Doorbell(token + "-driver")
        except BaseException:
            self.close()
            raise
        self._bells = [f"{token}-rank{rank}" for rank in range(num_ranks)]
        self._sender = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._seq = 0  # the last message sent (the step ring's sequence number)
        self._received = 0  # the last message whose replies were collected
        self._unread = [0] * num_ranks  # replies each shard has rung for that no receive has taken yet

    def endpoints(self, rank: int) -> ShardEndpoints:
        return ShardEndpoints(rank, self._steps.path, self._results[rank].path, self._bell.name, self._bells[rank])

    def wait_attached(self, timeout: float, on_wait: Callable[[], None]) -> None:
        """Wait until every shard has mapped the rings and bound its doorbell, then unlink the files."""
        self._collect(timeout, on_wait, lambda rank: False)
        self._unread = [0] * self.num_ranks  # those rings said "attached", not "replied"
        self._steps.unlink()
        for ring_ in self._results:
            ring_.unlink()

    def send(self, message: Any, timeout: float) -> int:
        """``message`` to every shard (``None`` ends their loops); its sequence number. :class:`PeerGone` if a
        shard left."""
        self._seq = self._steps.put(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL), timeout)
        for name in self._bells:
            ring(self._sender, name)
        return self._seq

    def receive(self, timeout: float, on_wait: Callable[[], None]) -> list[Any]:
        """Every shard's reply to the oldest message whose replies are not collected yet, by rank, or as
        soon as one reply is an ``("error", ...)``, the replies so far (``None`` for the others: a failed
        shard's peers may wait for it forever). ``on_wait`` runs every 0.1 s while waiting (it raises to
        give up); :class:`ChannelTimeout` after ``timeout`` seconds."""
        if self._received >= self._seq:
            raise RuntimeError("receive() without a message whose replies are still to come")
        replies: list[Any] = [None] * self.num_ranks
        seq = self._received + 1

        def take(rank: int) -> bool:
            replies[rank] = pickle.loads(self._results[rank].get(0, seq))
            return replies[rank][0] == "error"

        try:
            self._collect(timeout, on_wait, take)
        except BaseException:  # the message stays uncollected: a retry takes the replies read so far again
            for rank, reply in enumerate(replies):
                self._unread[rank] += reply is not None
            raise
        self._received = seq
        return replies

    def _collect(self, timeout: float, on_wait: Callable[[], None], take: Callable[[int], bool]) -> None:
        """One ring of each shard, each handed to ``take`` (True: stop). A shard that rang before (for a
        later message's reply, while an earlier one was collected) counts at once."""
        unread = self._unread
        waiting = set(range(self.num_ranks))
        for rank in range(self.num_ranks):
            if unread[rank]:
                unread[rank] -= 1
                waiting.discard(rank)
                if take(rank):
                    return
        deadline = time.monotonic() + timeout
        while waiting:
            left = deadline - time.monotonic()
            if left <= 0:
                raise ChannelTimeout(f"ranks {sorted(waiting)} did not answer within {timeout:g} s")
            try:
                rank = _FIELD.unpack(self._bell.wait(min(left, _WAIT_SLICE_S)))[0]
            except ChannelTimeout:
                on_wait()
                continue
            if rank not in waiting:  # its reply to a later message
                unread[rank] += 1
                continue
            waiting.discard(rank)
            if take(rank):
                return

    def close(self) -> None:
        for ring_ in [getattr(self, "_steps", None), *self._results]:
            if ring_ is not None:
                ring_.close()
        for sock in (getattr(self, "_bell", None), getattr(self, "_sender", None)):
            if sock is not None:
                sock.close()


def serve_steps(endpoints: ShardEndpoints, handle: Callable[[Any], Any]) -> int:
    """A shard's loop: join the channel, then answer each step with ``("ok", handle(step))`` or
    ``("error", exception)`` until the stop message; returns the number of steps served."""
    bell = Doorbell(endpoints.own_bell)
    steps = ShmRing(endpoints.steps_path, create=False)
    results = ShmRing(endpoints.result_path, create=False)
    sender = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    rank = _FIELD.pack(endpoints.rank)
    seq = 0
    try:
        ring(sender, endpoints.driver_bell, rank)  # attached
        while True:
            bell.wait(None)
            seq += 1
            message = pickle.loads(steps.get(endpoints.rank, seq))
            if message is _STOP:
                return seq - 1
            try:
                reply = pickle.dumps(("ok", handle(message)), protocol=pickle.HIGHEST_PROTOCOL)
            except Exception as err:  # the driver decides what a failed shard means
                reply = _pickled_error(err)
            results.put(reply, timeout=60.0)
            ring(sender, endpoints.driver_bell, rank)
    finally:
        sender.close()
        bell.close()
        steps.close()
        results.close()


def _pickled_error(err: Exception) -> bytes:
    try:
        return pickle.dumps(("error", err), protocol=pickle.HIGHEST_PROTOCOL)
    except Exception:  # an exception that does not pickle travels as its text
        return pickle.dumps(("error", RuntimeError(f"{type(err).__name__}: {err}")), protocol=pickle.HIGHEST_PROTOCOL)
