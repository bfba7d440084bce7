"""The scheduler's waiting requests, taken fairly between the clients' requests.

First come, first served let one HTTP request of many sequences (n = 128, or hundreds of
prompts) make a one-token request arriving after it wait for all of them. Here each waiting
sequence belongs to a group (the client request it came from: `Request.group`); the next one to
admit is the head of the group with the fewest sequences running, ties going to the group that
arrived first. Preempted sequences come back before everything else, as before, so a preempted
request is never starved. Each operation is O(number of groups), not O(waiting sequences).
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Iterator

from qserve.engine.request import Request


class WaitingQueue:
    def __init__(self) -> None:
        self._preempted: deque[Request] = deque()
        self._groups: dict[str, deque[Request]] = {}  # insertion order: group arrival order

    def __len__(self) -> int:
        return len(self._preempted) + sum(len(q) for q in self._groups.values())

    def __bool__(self) -> bool:
        return bool(self._preempted or self._groups)

    def __iter__(self) -> Iterator[Request]:
        yield from self._preempted
        for queue in self._groups.values():
            yield from queue

    def append(self, request: Request) -> None:
        self._groups.setdefault(request.group, deque()).append(request)

    def appendleft(self, request: Request) -> None:
        """A preempted request: admitted again before any other."""
        self._preempted.appendleft(request)

    def peek(self, running: Counter[str]) -> Request | None:
        """The request to admit next, given how many sequences each group has running."""
        if self._preempted:
            return self._preempted[0]
        if not self._groups:
            return None
        group = min(self._groups, key=lambda g: running[g])  # first of the least served
        return self._groups[group][0]

    def remove(self, request: Request) -> None:
        if self._preempted and request in self._preempted:
            self._preempted.remove(request)
            return
        queue = self._groups[request.group]
        queue.remove(request)  # the head, when admitted: O(1)
        if not queue:
            del self._groups[request.group]
