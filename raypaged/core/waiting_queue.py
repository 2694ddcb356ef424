"""The scheduler's waiting queue: policy order, with O(1) removal (aborts never scan the queue)."""

from __future__ import annotations

import heapq
import itertools
from collections import OrderedDict
from collections.abc import Iterator

from raypaged.core.request import Request


class WaitingQueue:
    """Requests waiting for admission, in policy order.

    ``fcfs``: arrival order, with preempted requests put back at the front; push,
    remove and the head are O(1). ``priority``: ``(priority, arrival)`` order, ties in
    the order pushed; push is O(log n), remove O(1) (the entry is dropped lazily when
    it reaches the head), the head amortized O(log n). Iteration is in order.
    """

    def __init__(self, policy: str) -> None:
        self._by_priority = policy == "priority"
        self._fcfs: OrderedDict[Request, None] = OrderedDict()
        self._heap: list[list] = []  # [priority, arrival, tie, request or None when removed]
        self._entries: dict[Request, list] = {}
        self._tie = itertools.count()

    def __len__(self) -> int:
        return len(self._entries) if self._by_priority else len(self._fcfs)

    def __bool__(self) -> bool:
        return len(self) > 0

    def __contains__(self, request: Request) -> bool:
        return request in (self._entries if self._by_priority else self._fcfs)

    def __iter__(self) -> Iterator[Request]:
        if not self._by_priority:
            return iter(list(self._fcfs))
        return iter([entry[3] for entry in sorted(self._entries.values())])

    def push(self, request: Request, front: bool = False) -> None:
        """Queue ``request``; ``front`` (FCFS only) puts it before every other."""
        if self._by_priority:
            entry = [request.priority, request.arrival_time, next(self._tie), request]
            self._entries[request] = entry
            heapq.heappush(self._heap, entry)
            return
        self._fcfs[request] = None
        if front:
            self._fcfs.move_to_end(request, last=False)

    def move_to_front(self, requests: list[Request]) -> None:
        """FCFS: these requests (all queued), in this order, before every other."""
        if self._by_priority:
            return
        for request in reversed(requests):
            self._fcfs.move_to_end(request, last=False)

    def remove(self, request: Request) -> None:
        if self._by_priority:
            self._entries.pop(request)[3] = None
            return
        del self._fcfs[request]

    def head(self) -> Request:
        """The next request to admit (the queue must not be empty)."""
        if not self._by_priority:
            return next(iter(self._fcfs))
        while self._heap[0][3] is None:
            heapq.heappop(self._heap)
        return self._heap[0][3]
