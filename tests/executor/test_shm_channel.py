"""The shared-memory step channel on its own: real processes, no Ray."""

from __future__ import annotations

import multiprocessing
import os
import socket

import pytest

from raypaged.executor import shm_channel
from raypaged.executor.shm_channel import ChannelTimeout, PeerGone, ShmRing, ShmStepChannel

pytestmark = pytest.mark.skipif(not shm_channel.available(), reason="needs Linux and /dev/shm")


def echo(message):
    """What a shard answers: a step's length and its first byte, or a failure on request."""
    if message == b"fail":
        raise ValueError("asked to fail")
    return len(message), message[:1]


def ours() -> set[str]:
    return {name for name in os.listdir(shm_channel.SHM_DIR) if name.startswith(f"raypaged-{os.getpid()}-")}


@pytest.fixture
def shards():
    """A channel to three shard processes running ``serve_steps(echo)``; each process's exit code
    (the steps it served) is checked by the test through ``channel.processes``."""
    channel = ShmStepChannel(3, slot_bytes=4096)
    context = multiprocessing.get_context("spawn")
    channel.processes = [context.Process(target=serve_and_exit, args=(channel.endpoints(rank),)) for rank in range(3)]
    for process in channel.processes:
        process.start()
    try:
        yield channel
    finally:
        for process in channel.processes:
            process.kill()
            process.join()
        channel.close()


def serve_and_exit(endpoints) -> None:
    os._exit(shm_channel.serve_steps(endpoints, echo))


def never_gives_up() -> None:
    pass


def test_broadcast_replies_overflow_errors_and_stop(shards):
    assert len(ours()) == 4  # the step ring and one reply ring per shard
    shards.wait_attached(60.0, never_gives_up)
    assert ours() == set()  # unlinked once every shard has mapped them
    shards.send(b"step one", 5.0)
    assert shards.receive(5.0, never_gives_up) == [("ok", (8, b"s"))] * 3
    big = b"x" * 50_000  # larger than a 4 KiB slot: its own file until every shard has read it
    shards.send(big, 5.0)
    assert shards.receive(5.0, never_gives_up) == [("ok", (50_000, b"x"))] * 3
    assert len(ours()) == 1
    for step in range(20):
        shards.send(bytes([step]) * (step + 1), 5.0)
        assert shards.receive(5.0, never_gives_up) == [("ok", (step + 1, bytes([step])))] * 3
    assert ours() == set()  # the big step's file went with the next message
    shards.send(b"fail", 5.0)
    replies = shards.receive(5.0, never_gives_up)  # returns at the first failure, not waiting for all
    [failed] = [reply for reply in replies if reply is not None]
    assert failed[0] == "error" and repr(failed[1]) == "ValueError('asked to fail')"
    shards.send(None, 5.0)
    for process in shards.processes:
        process.join(30)
    assert [process.exitcode for process in shards.processes] == [23] * 3


def test_a_silent_shard_times_out_and_on_wait_can_give_up(shards):
    shards.wait_attached(60.0, never_gives_up)
    shards.processes[2].kill()
    shards.processes[2].join()
    with pytest.raises(PeerGone, match=r"^doorbell raypaged-\d+-[0-9a-f]{12}-rank2 has no owner$"):
        shards.send(b"step", 5.0)
    with pytest.raises(ChannelTimeout, match=r"^ranks \[2\] did not answer within 0.3 s$"):
        shards.receive(0.3, never_gives_up)
    calls = []

    def give_up() -> None:
        calls.append(1)
        raise RuntimeError("shard 2 is dead")

    with pytest.raises(RuntimeError, match="shard 2 is dead"):
        shards.receive(5.0, give_up)
    assert calls == [1]


def test_ring_waits_for_every_reader_before_reusing_a_slot(tmp_path):
    path = str(tmp_path / "ring")
    writer = ShmRing(path, create=True, num_readers=2, num_slots=2, slot_bytes=16)
    reader = ShmRing(path, create=False)
    try:
        assert (reader.num_readers, reader.num_slots, reader.slot_bytes) == (2, 2, 16)
        assert writer.put(b"a", 1.0) == 1 and writer.put(b"b", 1.0) == 2
        with pytest.raises(ChannelTimeout, match=r"ring: message 1 was not read within 0.05 s$"):
            writer.put(b"c", 0.05)
        assert reader.get(0, 1) == b"a"
        with pytest.raises(ChannelTimeout):  # reader 1 has not read message 1 yet
            writer.put(b"c", 0.05)
        assert reader.get(1, 1) == b"a"
        assert writer.put(b"c", 1.0) == 3
        assert reader.get(0, 2) == b"b" and reader.get(0, 3) == b"c"
        with pytest.raises(RuntimeError, match=r"ring: expected message 1, the slot holds 3$"):
            reader.get(1, 1)
    finally:
        reader.close()
        writer.close()
    assert not os.path.exists(path)


def test_ring_to_nobody_is_peer_gone():
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        with pytest.raises(PeerGone, match="^doorbell raypaged-test-nobody has no owner$"):
            shm_channel.ring(sock, "raypaged-test-nobody")
