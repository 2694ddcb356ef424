"""The waiting queue keeps policy order through pushes, front pushes and removals."""

from raypaged.core.waiting_queue import WaitingQueue
from tests.core.test_scheduler import make_request


def ids(queue: WaitingQueue) -> list[str]:
    return [r.request_id for r in queue]


def test_fcfs_order_with_front_pushes_and_removals():
    queue = WaitingQueue("fcfs")
    a, b, c, d = (make_request(name, 2) for name in "abcd")
    for request in (a, b, c):
        queue.push(request)
    queue.push(d, front=True)
    assert ids(queue) == ["d", "a", "b", "c"] and queue.head() is d
    queue.remove(a)
    queue.remove(d)
    assert ids(queue) == ["b", "c"] and queue.head() is b and len(queue) == 2
    assert a not in queue and b in queue
    queue.move_to_front([c])
    assert ids(queue) == ["c", "b"]


def test_priority_order_ties_in_push_order_and_lazy_removal():
    queue = WaitingQueue("priority")
    requests = {name: make_request(name, 2) for name in ("low", "high", "mid", "mid2")}
    requests["low"].priority, requests["high"].priority = 5, -1
    requests["mid"].priority = requests["mid2"].priority = 2
    requests["mid2"].arrival_time = requests["mid"].arrival_time  # a tie: push order decides
    for name in ("low", "mid", "high", "mid2"):
        queue.push(requests[name], front=name == "mid2")  # front means nothing under priority
    assert ids(queue) == ["high", "mid", "mid2", "low"]
    queue.remove(requests["high"])
    assert queue.head() is requests["mid"] and len(queue) == 3
    queue.remove(requests["mid"])
    queue.remove(requests["mid2"])
    assert queue.head() is requests["low"] and ids(queue) == ["low"]
    queue.remove(requests["low"])
    assert not queue and ids(queue) == []
