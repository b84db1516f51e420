"""Places per model, and who gets the next one when every replica is busy (R-6.17).

A model's capacity is the sum over its serving endpoints of what one replica accepts at once:
`RoutedModel.concurrency` when the profile sets it, else DEFAULT_REPLICA_CONCURRENCY (the router
does not learn a llama-server's slot count, and vLLM's own queue is a load signal, not a limit).
A request takes a place before an endpoint is chosen and gives it back when its answer is over.
While places are free a request takes one at once (a counter); beyond that it waits in its key's
FIFO queue. When a place frees, the next request comes from the highest `KeyEntry.priority` class
that has one waiting, and within the class from the key whose head has the smallest start tag of
start-time fair queueing: a request's start tag is max(the class's virtual time, the finish tag
of the key's previous request), its finish tag that plus 1/weight, and the virtual time is the
start tag of the request last given a place. A key of weight 2 so gets two places for every one
of a key of weight 1 while both have requests waiting; a class's tags start again from zero once
nobody in it waits.

A wait is bounded (`GatewaySettings.queue_wait`): after it the request is refused with
QueueTimeout, a 503 whose Retry-After is estimated from the measured service time (an EWMA of how
long a place is held) and the requests ahead of it. A request that took a place and must be sent
again (its engine failed before a first byte) comes back at the head of its class, since it
already had its turn. A waiter whose client is gone (its task cancelled) leaves the queue at once;
a place given to it just then is passed on. A model with no endpoints has no capacity to share:
its requests are not held here (the no-replica and on-demand paths answer them).

The capacity a FairQueue is given is its router's part: with several routers (workers, hosts) the
router divides each model's places among the routers of its last leases (`app.router_share`), so
each router's queue is fair among the requests it holds and together they give a replica no more
than it accepts.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import deque

from llmgw.router.errors import NoCapacity

DEFAULT_REPLICA_CONCURRENCY = 64  # requests one replica is given at once when its profile does not say
SERVICE_EWMA_ALPHA = 0.2  # weight of the newest hold time in the measured service time
FALLBACK_RETRY_AFTER = 5  # seconds, before any service time is measured
NOBODY: tuple[()] = ()  # the waiters given a place when nobody waits


class QueueTimeout(NoCapacity):
    """Every place of the model stayed taken for the whole bounded wait."""

    code = "queue_timeout"


class Waiter:
    __slots__ = ("key_id", "priority", "start", "seq", "future", "queued", "granted")

    def __init__(self, key_id: str, priority: int, start: float, seq: int, future: asyncio.Future | None):
        self.key_id, self.priority, self.start, self.seq = key_id, priority, start, seq
        self.future = future
        self.queued = True
        self.granted = False


class _Class:
    """One priority class of one model: its keys' FIFO queues and their fair-queueing tags."""

    __slots__ = ("vtime", "finish", "queues", "count")

    def __init__(self):
        self.vtime = 0.0
        self.finish: dict[str, float] = {}  # finish tag of each key's latest request in this busy period
        self.queues: dict[str, deque[Waiter]] = {}  # keys with requests waiting
        self.count = 0

    def head(self) -> deque[Waiter]:
        return min(self.queues.values(), key=lambda q: (q[0].start, q[0].seq))


class ModelQueue:
    """The places of one model and its waiting requests. Synchronous: `take`, `push`, `leave`."""

    __slots__ = ("capacity", "held", "waiting", "service", "_classes", "_seq")

    def __init__(self, capacity: int = 0):
        self.capacity = capacity  # 0: no endpoints, nothing is held back
        self.held = 0
        self.waiting = 0
        self.service: float | None = None  # EWMA of seconds a place is held; None until measured
        self._classes: dict[int, _Class] = {}
        self._seq = 0

    def take(self) -> bool:
        """A place at once when one is free and nobody waits for it (the fast path)."""
        if self.waiting == 0 and (self.held < self.capacity or self.capacity == 0):
            self.held += 1
            return True
        return False

    def push(self, key_id: str, priority: int, weight: int, future: asyncio.Future | None = None,
             resumed: bool = False) -> Waiter:
        """Queue a request of a key; `resumed`: it had a place already and goes first in its class."""
        cls = self._classes.get(priority)
        if cls is None:
            cls = self._classes[priority] = _Class()
        self._seq += 1
        queue = cls.queues.get(key_id)
        if queue is None:
            queue = cls.queues[key_id] = deque()
        if resumed:
            waiter = Waiter(key_id, priority, cls.vtime, -self._seq, future)
            queue.appendleft(waiter)
        else:
            start = max(cls.vtime, cls.finish.get(key_id, 0.0))
            cls.finish[key_id] = start + 1.0 / max(1, weight)
            waiter = Waiter(key_id, priority, start, self._seq, future)
            queue.append(waiter)
        cls.count += 1
        self.waiting += 1
        return waiter

    def pop(self) -> Waiter | None:
        """The request that gets the next place (highest class, then smallest start tag), dequeued."""
        if not self.waiting:
            return None
        priority = max(p for p, c in self._classes.items() if c.count)
        cls = self._classes[priority]
        queue = cls.head()
        waiter = queue.popleft()
        cls.vtime = waiter.start
        self._dequeued(cls, queue, waiter)
        return waiter

    def remove(self, waiter: Waiter) -> None:
        """Take a waiter out of the queue (its wait ended); nothing when it is no longer queued."""
        if not waiter.queued:
            return
        cls = self._classes[waiter.priority]
        queue = cls.queues[waiter.key_id]
        queue.remove(waiter)
        self._dequeued(cls, queue, waiter)

    def _dequeued(self, cls: _Class, queue: deque, waiter: Waiter) -> None:
        waiter.queued = False
        cls.count -= 1
        self.waiting -= 1
        if not queue:
            del cls.queues[waiter.key_id]
        if not cls.count:  # the class's busy period is over: its tags start again
            del self._classes[waiter.priority]

    def ahead(self, waiter: Waiter) -> int:
        """Requests that would get a place before this one."""
        count = 0
        for priority, cls in self._classes.items():
            if priority > waiter.priority:
                count += cls.count
            elif priority == waiter.priority:
                order = (waiter.start, waiter.seq)
                count += sum(1 for queue in cls.queues.values() for w in queue if (w.start, w.seq) < order)
        return count

    def retry_after(self, ahead: int) -> int:
        """Seconds until a request with `ahead` requests before it would likely get a place."""
        if self.service is None or self.capacity == 0:
            return FALLBACK_RETRY_AFTER
        return max(1, math.ceil(self.service * (ahead + 1) / self.capacity))

    def leave(self, held_for: float | None) -> list[Waiter] | tuple[()]:
        """Give a place back (`held_for`: seconds it was held, for the service time); the waiters
        that get a place now, already counted as holding it."""
        if self.held > 0:
            self.held -= 1
        if held_for is not None:
            service = self.service
            self.service = held_for if service is None else service + SERVICE_EWMA_ALPHA * (held_for - service)
        return self.fill() if self.waiting else NOBODY

    def fill(self) -> list[Waiter]:
        """Give free places to waiters, in order; the ones given one (none when nobody waits)."""
        given = []
        while self.waiting and (self.held < self.capacity or self.capacity == 0):
            waiter = self.pop()
            self.held += 1
            waiter.granted = True
            given.append(waiter)
        return given


class FairQueue:
    """Every model's ModelQueue, and the waiting on the loop."""

    def __init__(self):
        self.models: dict[str, ModelQueue] = {}

    def set_capacity(self, model: str, capacity: int) -> None:
        """A model's capacity now (0: no endpoints); waiters get the places it frees."""
        queue = self.models.get(model)
        if queue is None:
            self.models[model] = ModelQueue(capacity)
            return
        queue.capacity = capacity
        _wake(queue.fill())

    def set_capacities(self, capacities: dict[str, int]) -> None:
        """Every model's capacity; a model left out is gone (dropped once nothing of it is held)."""
        for model in [m for m in self.models if m not in capacities]:
            queue = self.models[model]
            queue.capacity = 0
            _wake(queue.fill())
            if queue.held <= 0:
                del self.models[model]
        for model, capacity in capacities.items():
            self.set_capacity(model, capacity)

    def take(self, model: str) -> bool:
        """The fast path: True when a place was free (or the model holds nothing back); a model
        the router does not know is not held back (its request is refused before it gets here)."""
        queue = self.models.get(model)
        return queue is None or queue.take()

    async def wait(self, model: str, key_id: str, priority: int, weight: int, timeout: float,
                   resumed: bool = False) -> None:
        """Wait for a place of `model` (after `take` said no); QueueTimeout after `timeout` seconds."""
        queue = self.models.get(model)
        if queue is None:
            return
        if queue.take():
            return
        loop = asyncio.get_running_loop()
        waiter = queue.push(key_id, priority, weight, loop.create_future(), resumed)
        # A timer rather than asyncio.wait_for, which can swallow a cancellation that comes just as
        # the place is given: the client is gone and its request must not go on.
        timer = loop.call_later(timeout, _expire, waiter.future)
        try:
            await waiter.future
        except asyncio.TimeoutError:
            if waiter.granted:  # given a place as the wait ran out: keep it
                return
            ahead = queue.ahead(waiter)
            queue.remove(waiter)
            raise QueueTimeout(f"every replica of {model!r} stayed busy for the {timeout:g} s a request may "
                               f"wait (gateway.queue_wait); {ahead} requests were ahead of this one; retry later",
                               retry_after=queue.retry_after(ahead)) from None
        except asyncio.CancelledError:
            if waiter.granted:  # the place it was just given goes to the next one
                _wake(queue.leave(None))
            else:
                queue.remove(waiter)
            raise
        finally:
            timer.cancel()

    def leave(self, model: str, since: float) -> None:
        """Give back a place taken at time.monotonic() `since`."""
        queue = self.models.get(model)
        if queue is not None:
            _wake(queue.leave(time.monotonic() - since))

    def waiting(self) -> dict[str, int]:
        """Requests waiting for a place, by model (models that hold places back)."""
        return {model: queue.waiting for model, queue in list(self.models.items())}


def _expire(future: asyncio.Future) -> None:
    if not future.done():
        future.set_exception(asyncio.TimeoutError())


def _wake(given: list[Waiter] | tuple[()]) -> None:
    for waiter in given:
        if not waiter.future.done():
            waiter.future.set_result(None)
