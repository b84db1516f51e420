"""Places per model, and who gets the next one when every replica is busy (R-6.17).

A model's capacity is the sum over its serving endpoints of what one replica accepts at once
(`replica_places`): the profile's `concurrency` when the operator set it (an explicit choice
wins), else the slot count its engine reports (llama-server's `--parallel`, read by
llmgw.router.engineload beside the engine's load), else DEFAULT_REPLICA_CONCURRENCY (vLLM's and
SGLang's own queues are a load signal, not a limit). The router sets it with every snapshot and
after each poll in which a slot count changed, so a reading may raise it (waiters get the new
places at once) or lower it (places are taken back as they are given back).
A request takes a place before an endpoint is chosen and gives it back when its answer is over.
While places are free a request takes one at once (a counter); beyond that it waits in its key's
FIFO queue. When a place frees, the next request comes from the highest `KeyEntry.priority` class
that has one waiting, and within the class from the key whose head has the smallest start tag of
start-time fair queueing: a request's start tag is max(the class's virtual time, the finish tag
of the key's previous request), its finish tag that plus 1/weight, and the virtual time is the
start tag of the request last given a place. A key of weight 2 so gets two places for every one
of a key of weight 1 while both have requests waiting; a class's tags start again from zero once
nobody in it waits.

Headroom. Order alone cannot keep a light key's latency near its idle latency: without
preemption, a request arriving while every place is held waits for the first of C places to end.
With places busy for a service time S each, ending at independent uniform points of it, the
wait exceeds w with probability (1 - w/S)^C, so its 99th percentile is (1 - 0.01^(1/C)) x S:
0.68 S at C = 4, 0.44 S at C = 8, 0.07 S at C = 64 — about 1.68x the idle p99 at C = 4, whatever
the order of the queue. A model therefore also has a headroom, per replica its places / 8
rounded up (HEADROOM_DIVISOR), none for a replica whose places are its engine's slots (a
llama-server runs that many and defers the rest itself, so a request past them gains nothing):
a request of a key that holds fewer places than its weighted share of the capacity (capacity x
weight / the weights of the keys holding or waiting for a place, itself counted), with no request
of its own or of a higher class waiting, takes a place of the headroom at once; and a freed place
of the headroom goes to the first waiter, in order within the highest class waiting, of a key
below its share. A key alone never reaches the headroom (its share is the whole capacity), nor
does one holding its share, however long its backlog. So an engine is given at most its places plus the headroom,
never more than an eighth more (one request for a replica of up to 8); for a batching engine one
more request in its batch costs little, and the key that sends a little is served at once
instead of after a place of the backlog ends. This is the router's counterpart of admitting the
least-served client into a continuous batch as soon as there is room (the Virtual Token Counter
of Sheng et al., "Fairness in Serving Large Language Models", OSDI 2024), with the room bounded.

How many requests of one key wait in one router, over all its models, is bounded too
(`GatewaySettings.max_waiting_per_key`, R-6.17a): one more is refused at once with TooManyWaiting,
a 429, so a key's backlog costs the router a bounded amount of memory; a request sent again
after an engine failure had its place already and is never refused for it.
A wait is bounded (`GatewaySettings.queue_wait`): after it the request is refused with
QueueTimeout, a 503 whose Retry-After is estimated from the measured service time (an EWMA of how
long a place is held) and the requests ahead of it. A request that took a place and must be sent
again (its engine failed before a first byte) comes back at the head of its class, since it
already had its turn. A waiter whose client is gone (its task cancelled) leaves the queue at once;
a place given to it just then is passed on. A model with no endpoints has no capacity to share:
its requests are not held here (the no-replica and on-demand paths answer them).

The capacity a FairQueue is given is its router's part: with several routers (workers, hosts) the
router divides each model's places among the routers of its last leases (`feedstate.router_share`), so
each router's queue is fair among the requests it holds and together they give a replica no more
than it accepts.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import deque

from llmgw.contracts.errors import Category
from llmgw.router.errors import NoCapacity, RouterError

DEFAULT_REPLICA_CONCURRENCY = 64  # requests one replica is given at once when neither its profile nor its engine says
HEADROOM_DIVISOR = 8  # a replica's headroom: its places / 8, rounded up (see the module docstring)
SERVICE_EWMA_ALPHA = 0.2  # weight of the newest hold time in the measured service time
FALLBACK_RETRY_AFTER = 5  # seconds, before any service time is measured
NOBODY: tuple[()] = ()  # the waiters given a place when nobody waits
DEFAULT_MAX_WAITING_PER_KEY = 256  # until the first snapshot says otherwise (GatewaySettings.max_waiting_per_key)


class QueueTimeout(NoCapacity):
    """Every place of the model stayed taken for the whole bounded wait."""

    code = "queue_timeout"


class TooManyWaiting(RouterError):
    """The key already has gateway.max_waiting_per_key requests waiting in this router."""

    status, type, code = 429, "rate_limit_error", "rate_limit_exceeded"
    category = Category.CAPACITY


def replica_places(concurrency: int | None, slots: int | None) -> tuple[int, int]:
    """(places, headroom) of one replica: its profile's `concurrency` when the operator set it (an
    explicit choice wins over what the engine says), else its engine's slot count, else
    DEFAULT_REPLICA_CONCURRENCY. The headroom is places / HEADROOM_DIVISOR rounded up, none where
    the places are the engine's slots: a llama-server runs that many, and defers the rest itself."""
    if concurrency is not None:
        return concurrency, -(-concurrency // HEADROOM_DIVISOR)
    if slots is not None:
        return slots, 0
    return DEFAULT_REPLICA_CONCURRENCY, -(-DEFAULT_REPLICA_CONCURRENCY // HEADROOM_DIVISOR)


class Waiter:
    __slots__ = ("key_id", "priority", "weight", "start", "seq", "future", "queued", "granted")

    def __init__(self, key_id: str, priority: int, weight: int, start: float, seq: int, future: asyncio.Future | None):
        self.key_id, self.priority, self.weight, self.start, self.seq = key_id, priority, weight, start, seq
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

    __slots__ = ("capacity", "headroom", "held", "waiting", "service", "_classes", "_seq", "_keys", "_weight")

    def __init__(self, capacity: int = 0, headroom: int = 0):
        self.capacity = capacity  # 0: no endpoints, nothing is held back
        self.headroom = headroom  # places beyond the capacity for a key below its share
        self.held = 0
        self.waiting = 0
        self.service: float | None = None  # EWMA of seconds a place is held; None until measured
        self._classes: dict[int, _Class] = {}
        self._seq = 0
        self._keys: dict[str, list[int]] = {}  # key id -> [places held, requests waiting, weight] while either
        self._weight = 0  # the weights of those keys, summed

    def take(self, key_id: str = "", priority: int = 0, weight: int = 1) -> bool:
        """A place at once when one is free and nobody waits for it (the fast path), or a place of
        the headroom for a key below its share with nothing of its own or of a higher class waiting."""
        if self.waiting == 0 and (self.held < self.capacity or self.capacity == 0):
            self.held += 1
            self._count(key_id, weight, 1, 0)
            return True
        if self.held < self.capacity + self.headroom and self.capacity and self._below_share(key_id) \
                and not any(p > priority for p in self._classes):
            self.held += 1
            self._count(key_id, weight, 1, 0)
            return True
        return False

    def _below_share(self, key_id: str) -> bool:
        """Whether the key holds fewer places than its weighted share of the capacity among the keys
        holding or waiting for one (itself counted), with none of its own requests waiting."""
        entry = self._keys.get(key_id)
        if entry is None:
            return True  # it holds nothing, and any share is a part of a place at least
        return entry[1] == 0 and self._below(key_id)

    def _count(self, key_id: str, weight: int, held: int, waiting: int) -> None:
        entry = self._keys.get(key_id)
        if entry is None:
            entry = self._keys[key_id] = [0, 0, max(1, weight)]
            self._weight += entry[2]
        entry[0] += held
        entry[1] += waiting
        if entry[0] <= 0 and entry[1] <= 0:
            del self._keys[key_id]
            self._weight -= entry[2]

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
            waiter = Waiter(key_id, priority, weight, cls.vtime, -self._seq, future)
            queue.appendleft(waiter)
        else:
            start = max(cls.vtime, cls.finish.get(key_id, 0.0))
            cls.finish[key_id] = start + 1.0 / max(1, weight)
            waiter = Waiter(key_id, priority, weight, start, self._seq, future)
            queue.append(waiter)
        cls.count += 1
        self.waiting += 1
        self._count(key_id, weight, 0, 1)
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
        self._count(waiter.key_id, waiter.weight, 0, -1)
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

    def leave(self, held_for: float | None, key_id: str = "") -> list[Waiter] | tuple[()]:
        """Give a place of a key back (`held_for`: seconds it was held, for the service time); the
        waiters that get a place now, already counted as holding it."""
        if self.held > 0:
            self.held -= 1
        if key_id in self._keys:
            self._count(key_id, 1, -1, 0)
        if held_for is not None:
            service = self.service
            self.service = held_for if service is None else service + SERVICE_EWMA_ALPHA * (held_for - service)
        return self.fill() if self.waiting else NOBODY

    def fill(self) -> list[Waiter]:
        """Give free places to waiters, in order, then free places of the headroom to the first
        waiters in order, within the highest class, of keys below their share; the ones given one
        (none when nobody waits)."""
        given = []
        while self.waiting and (self.held < self.capacity or self.capacity == 0):
            given.append(self._grant(self.pop()))
        while self.waiting and self.held < self.capacity + self.headroom:
            cls = self._classes[max(self._classes)]
            below = [queue for key_id, queue in cls.queues.items() if self._below(key_id)]
            if not below:
                break
            queue = min(below, key=lambda q: (q[0].start, q[0].seq))
            waiter = queue.popleft()
            cls.vtime = max(cls.vtime, waiter.start)
            self._dequeued(cls, queue, waiter)
            given.append(self._grant(waiter))
        return given

    def _grant(self, waiter: Waiter) -> Waiter:
        self.held += 1
        self._count(waiter.key_id, waiter.weight, 1, 0)
        waiter.granted = True
        return waiter

    def _below(self, key_id: str) -> bool:
        """Whether a key holding or waiting for a place holds fewer places than its share."""
        held, _, own = self._keys[key_id]
        return held * self._weight < self.capacity * own


class FairQueue:
    """Every model's ModelQueue, and the waiting on the loop."""

    def __init__(self):
        self.models: dict[str, ModelQueue] = {}
        self.max_waiting_per_key = DEFAULT_MAX_WAITING_PER_KEY
        self._waiting_by_key: dict[str, int] = {}  # key id -> its requests in `wait`, over every model

    def set_capacity(self, model: str, capacity: int, headroom: int = 0) -> None:
        """A model's capacity and headroom now (0: no endpoints); waiters get the places it frees."""
        queue = self.models.get(model)
        if queue is None:
            self.models[model] = ModelQueue(capacity, headroom)
            return
        queue.capacity = capacity
        queue.headroom = headroom
        _wake(queue.fill())

    def set_capacities(self, capacities: dict[str, int], headrooms: dict[str, int] | None = None) -> None:
        """Every model's capacity (and headroom, none where not given); a model left out is gone
        (dropped once nothing of it is held)."""
        for model in [m for m in self.models if m not in capacities]:
            queue = self.models[model]
            queue.capacity = queue.headroom = 0
            _wake(queue.fill())
            if queue.held <= 0:
                del self.models[model]
        headrooms = headrooms or {}
        for model, capacity in capacities.items():
            self.set_capacity(model, capacity, headrooms.get(model, 0))

    def take(self, model: str, key_id: str = "", priority: int = 0, weight: int = 1) -> bool:
        """The fast path: True when a place was free for this key (or the model holds nothing
        back); a model the router does not know is not held back (its request is refused before
        it gets here)."""
        queue = self.models.get(model)
        return queue is None or queue.take(key_id, priority, weight)

    async def wait(self, model: str, key_id: str, priority: int, weight: int, timeout: float,
                   resumed: bool = False) -> None:
        """Wait for a place of `model` (after `take` said no); QueueTimeout after `timeout` seconds."""
        queue = self.models.get(model)
        if queue is None:
            return
        if queue.take(key_id, priority, weight):
            return
        waiting = self._waiting_by_key.get(key_id, 0)
        if waiting >= self.max_waiting_per_key and not resumed:
            raise TooManyWaiting(f"this key already has {waiting} requests waiting for a place in this router "
                                 f"(gateway.max_waiting_per_key is {self.max_waiting_per_key}); send fewer at once, "
                                 "or retry when some have been answered", retry_after=queue.retry_after(queue.waiting))
        self._waiting_by_key[key_id] = waiting + 1
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
                _wake(queue.leave(None, key_id))
            else:
                queue.remove(waiter)
            raise
        finally:
            timer.cancel()
            left = self._waiting_by_key[key_id] - 1
            if left:
                self._waiting_by_key[key_id] = left
            else:
                del self._waiting_by_key[key_id]

    def leave(self, model: str, since: float, key_id: str = "") -> None:
        """Give back a place a key took at time.monotonic() `since`."""
        queue = self.models.get(model)
        if queue is not None:
            _wake(queue.leave(time.monotonic() - since, key_id))

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
