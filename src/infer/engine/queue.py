"""Waiting-queue policies. No torch.

``fcfs``: arrival order; a preempted request goes back to the front (it was admitted first).
``priority``: lower ``priority`` value first, ties by arrival; with ``max_wait_steps`` a request
that has waited that many steps is treated as top priority (aging), so low-priority work
cannot starve behind a steady stream of urgent requests.
"""

from __future__ import annotations

import heapq
import itertools
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Iterator

from infer.core.request import Request


class RequestQueue(ABC):
    @abstractmethod
    def add(self, request: Request) -> None: ...

    @abstractmethod
    def add_preempted(self, request: Request) -> None:
        """Put back a request taken out of the running set."""

    @abstractmethod
    def peek(self) -> Request: ...

    @abstractmethod
    def pop(self) -> Request: ...

    @abstractmethod
    def remove(self, request: Request) -> None: ...

    @abstractmethod
    def __len__(self) -> int: ...

    @abstractmethod
    def __iter__(self) -> Iterator[Request]: ...

    def tick(self) -> None:
        """One scheduler step passed (for aging policies)."""

    def sort_key(self, request: Request) -> tuple:
        """Smaller is more urgent; the scheduler preempts the running request with the largest."""
        return (request.timings.arrival,)


class FCFSQueue(RequestQueue):
    def __init__(self) -> None:
        self._q: deque[Request] = deque()

    def add(self, request: Request) -> None:
        self._q.append(request)

    def add_preempted(self, request: Request) -> None:
        self._q.appendleft(request)

    def peek(self) -> Request:
        return self._q[0]

    def pop(self) -> Request:
        return self._q.popleft()

    def remove(self, request: Request) -> None:
        self._q.remove(request)

    def __len__(self) -> int:
        return len(self._q)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._q)


class PriorityQueue(RequestQueue):
    def __init__(self, max_wait_steps: int | None = None) -> None:
        self.max_wait_steps = max_wait_steps
        self._heap: list[tuple[tuple, int, Request]] = []
        self._seq = itertools.count()
        self._removed: set[int] = set()  # ids of requests removed lazily from the heap
        self._waited: dict[str, int] = {}  # request id -> steps spent waiting

    def sort_key(self, request: Request) -> tuple:
        # NOTE: an aged request keeps its promotion once admitted, so the requests it waited
        # behind cannot preempt it straight back out.
        return (0 if request.aged else 1, request.priority, request.timings.arrival)

    def add(self, request: Request) -> None:
        self._waited.setdefault(request.request_id, 0)
        heapq.heappush(self._heap, (self.sort_key(request), next(self._seq), request))

    def add_preempted(self, request: Request) -> None:
        self.add(request)

    def _prune(self) -> None:
        while self._heap and id(self._heap[0][2]) in self._removed:
            self._removed.discard(id(heapq.heappop(self._heap)[2]))

    def peek(self) -> Request:
        self._prune()
        return self._heap[0][2]

    def pop(self) -> Request:
        self._prune()
        request = heapq.heappop(self._heap)[2]
        self._waited.pop(request.request_id, None)
        return request

    def remove(self, request: Request) -> None:
        self._removed.add(id(request))
        self._waited.pop(request.request_id, None)

    def __len__(self) -> int:
        return len(self._heap) - len(self._removed)

    def __iter__(self) -> Iterator[Request]:
        live = [e for e in self._heap if id(e[2]) not in self._removed]
        return iter(r for _, _, r in sorted(live, key=lambda e: (e[0], e[1])))

    def tick(self) -> None:
        if self.max_wait_steps is None:
            return
        live = [r for _, _, r in self._heap if id(r) not in self._removed]
        newly_aged = False
        for r in live:
            self._waited[r.request_id] = self._waited.get(r.request_id, 0) + 1
            if self._waited[r.request_id] >= self.max_wait_steps and not r.aged:
                r.aged = newly_aged = True
        if newly_aged:
            self._heap = []
            self._removed.clear()
            for r in live:
                heapq.heappush(self._heap, (self.sort_key(r), next(self._seq), r))


def make_queue(policy: str, max_wait_steps: int | None = None) -> RequestQueue:
    if policy == "fcfs":
        return FCFSQueue()
    if policy == "priority":
        return PriorityQueue(max_wait_steps)
    raise ValueError(f"unknown scheduling policy {policy!r}")
