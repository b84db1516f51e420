"""Choosing an endpoint (R-6.5): least loaded, ties round-robin, or prefix affinity with bounded
load; ejection (R-6.6).

An endpoint's load is the requests llmgw has in flight to it plus those its engine holds beyond
them: the engine's running and waiting requests as last polled, less llmgw's own at that poll
(llmgw.router.engineload.others), since the engine counts ours too. So the load is the engine's
own count as of the poll, kept current with llmgw's requests since; an engine that does not
report a queue adds nothing.

`routing: prefix` places each replica at RING_POINTS points of a hash ring, from its replica id
alone, so every router worker and host builds the same ring. A request's affinity key
(llmgw.router.affinity) has a home replica, and the request goes there while that replica's load
stays within the bound, else to the next replica clockwise within it (consistent hashing with
bounded loads).

A request whose key is not live goes by load: no engine caches the key, so it pays its whole
prefill wherever it goes (least-outstanding's choice, a replica without room for one more live
key counted as holding a request more). The key's home is the replica whose engine accepted that
request (an answer below 400), where its prefix is now cached, while that replica has room and is
not pressed (else _place), and it is kept while the key is live (a request within
KEY_IDLE_SECONDS; at most KEYS_KEPT keys per model, the least recently used forgotten first, and at
most KEYS_PER_API_KEY per API key that made them; past that the API key's requests with new keys
are balanced by load and home nothing). Room: a replica's count of live keys, this one counted,
stays within KEY_BOUND times the mean (no rounding up, never below the even spread). Keys are
what the engines cache, so this keeps the caches' working sets even: hashing alone splits a few
keys unevenly (10 keys over 2 replicas 7 / 3 or worse about a third of the time), and the replica
given most keys evicts them from its cache while the other's stays half empty. Once placed, a key
stays, since moving it would pay its prefill again. Every key is counted alike, whatever its
prefix's length. New keys placed by the ring alone (before load was their rule), with the looser
bound below, piled on one engine: on vLLM's own bench with a key per prompt one engine held 6 or
more of the 8 requests in flight at 68 % of the choices while the other idled.

The load bound is PREFIX_BOUND times the mean load with this request counted, as a real number
(no rounding up), but never below the fewest requests the busiest replica must hold,
ceil((total + 1) / n): a replica takes the request while its load + 1 <= max(PREFIX_BOUND *
(total + 1) / n, ceil((total + 1) / n)). The floor keeps a choice possible (the least loaded
replica is always within it); rounding up only there leaves the chosen replica within
PREFIX_BOUND times the mean wherever the counts allow it, and at the even spread where they do
not (about one request per replica, where any rounded-up multiple of the mean would let one
replica hold two or three times it). A replica whose engine said at its last poll that nothing
waits in it (a known `waiting` of 0: vLLM's num_requests_waiting, llama-server's deferred
requests, SGLang's queue) has the looser bound IDLE_ENGINE_BOUND instead: while the engine runs
everything it is given, a request kept on the replica that caches its prefix waits for nothing,
and one spilled pays its whole prefill elsewhere and evicts that engine's own keys; once the
engine queues, the tight bound applies again. An engine that does not report its queue gets the
tight bound. With two replicas IDLE_ENGINE_BOUND lets the home take every request of its keys
while its engine runs them all: what stops it is the engine's memory (below), not a tighter
bound, which on vLLM's own prefix_repetition bench (two engines) cost a quarter of the cache hits
(1.5x the mean: hit rate 0.63; 2x: 0.86, the best possible being 0.89) and throughput with them;
so did sending a live key's request to a peer with nothing in flight (hit rate 0.66 against
0.89): an engine caught in a prefill often holds 7 of the 8 requests while the other has none,
and each request sent over evicts a prefix there.

The engine's memory (R-6.5g): from two successive polls (note_reading) a replica is *pressed*
when its KV cache is KV_FULL or fuller, when it preempted requests between them, or when its
prefix-cache hit rate between them is below THRASH_RATIO times its best peer's (weigh_pressure,
after every poll). A pressed replica takes a request only while it holds less than every
unpressed peer, never with the looser bound; a new key is homed on an unpressed replica first.

Membership: a replica leaving frees only the keys homed on it (placed again at their next
request); a replica joining takes only the live keys whose ring point it now owns, up to its
room (inherit), so the others' keys stay where they are cached.

Where routers agree (R-6.5d): each router reports the keys it homed or sent home (`touched`,
drained by take_homes into its reports); the control plane keeps the first home reported per key
and feeds it back, and set_homes makes it this router's home for the key, replacing its own. So
a key placed off its ring point (its owner full) by one router goes to the same replica from
every router once the feed carries it. Near the load bound, each router sees its own in-flight
counts and the engine queue as of its last poll, so two routers may spill the same key to
different replicas.

Runs on the event loop only, on every request: plain attributes and integer counters, no locks.
"""

from __future__ import annotations

import bisect
import hashlib
import random
import struct
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence

from yarl import URL

from llmgw.contracts.endpoints import Endpoint
from llmgw.contracts.feed import HOME_IDLE_SECONDS, HOMES_KEPT, HOMES_PER_REPORT, RoutingPolicy

EJECT_SECONDS = 5.0  # long enough to stop hammering a dead engine, short enough to notice it is back
LEAST_OUTSTANDING = RoutingPolicy.LEAST_OUTSTANDING
PREFIX = RoutingPolicy.PREFIX
PREFIX_BOUND = 1.25  # over the mean load with the request counted; see the module docstring
# The bound for a replica whose engine said at its last poll that it queues nothing: room there
# costs no wait, and a request sent elsewhere pays its whole prefill again and evicts what the
# other engine had cached for its own keys.
IDLE_ENGINE_BOUND = 2.0
RING_POINTS = 64  # per replica: enough that shares stay within a few percent of even
# Live keys per replica over the mean: tight, since placing a new key off its ring point costs no
# cache (none holds it yet); 10 keys over 2 replicas split 5 / 5, 32 over 16 at most 2 each.
KEY_BOUND = 1.1
KEY_IDLE_SECONDS = HOME_IDLE_SECONDS  # a key with no request for this long is no longer counted as cached
KEYS_KEPT = HOMES_KEPT  # live keys remembered per model; the least recently used is forgotten first
# Live keys one API key may have homed per model: past it, its requests with a new key are balanced
# by load and home nothing, so that one API key's cheap requests cannot churn the others' homes.
KEYS_PER_API_KEY = 1024
# An engine's memory is short (R-6.5g) when its KV cache is this full (vLLM's kv_cache_usage_perc
# counts the blocks running requests hold, not the cached ones it may evict), when it preempted
# requests since the previous poll, or when its prefix-cache hit rate over the last poll is below
# THRASH_RATIO of its best peer's, measured on at least THRASH_MIN_QUERIES prompt tokens.
KV_FULL = 0.9
THRASH_RATIO = 0.5
THRASH_MIN_QUERIES = 2048

# Sent to every engine, so that aiohttp adds none of its own: no compressed answers (the router
# relays bytes as they come), and a name in the engine's log. Giving them beats the session's
# skip_auto_headers, which aiohttp turns into a new header dict on every request.
ENGINE_HEADERS = {"Accept-Encoding": "identity", "User-Agent": "llmgw"}


def bound_capacity(total: int, replicas: int, bound: float = PREFIX_BOUND) -> float:
    """The most load a replica may have after taking one more request, `total` being in flight
    over `replicas` before it: `bound` times the mean, or the even spread when that is less."""
    placed = total + 1
    return max(bound * placed / replicas, -(-placed // replicas))


def _queues_nothing(up: Upstream) -> bool:
    """The engine said at its last poll that no request waits in it (unknown is not nothing)."""
    engine = up.engine
    return engine is not None and engine.waiting == 0


def note_reading(up: Upstream, previous, reading) -> None:
    """What two successive engine readings say of the engine's memory (R-6.5g): preemptions
    between them, and the prefix-cache hit rate of the prompt tokens asked of it between them
    (None when it was asked fewer than THRASH_MIN_QUERIES, or either reading does not say)."""
    up.preempting = False
    up.hit_rate = None
    if reading is None or previous is None:
        return
    if reading.preemptions is not None and previous.preemptions is not None:
        up.preempting = reading.preemptions > previous.preemptions
    if None not in (reading.prefix_hits, reading.prefix_queries, previous.prefix_hits, previous.prefix_queries):
        asked = reading.prefix_queries - previous.prefix_queries
        if asked >= THRASH_MIN_QUERIES:
            up.hit_rate = max(0.0, min(1.0, (reading.prefix_hits - previous.prefix_hits) / asked))


def is_pressed(up: Upstream, best_hit_rate: float | None) -> bool:
    """Whether the engine's memory is short (R-6.5g): its KV cache at KV_FULL or more, requests
    preempted since the previous poll, or its prefix cache thrashing: a hit rate below
    THRASH_RATIO times the best of its pool's peers over the same interval."""
    engine = up.engine
    if engine is None:
        return False  # unknown is not short
    if engine.kv_cache is not None and engine.kv_cache >= KV_FULL:
        return True
    if up.preempting:
        return True
    return up.hit_rate is not None and best_hit_rate is not None and up.hit_rate < THRASH_RATIO * best_hit_rate


def _weight(up: Upstream) -> int:
    """Least-outstanding's order: the load, a pressed replica after an unpressed one of equal load
    (so it is never given more than its peers)."""
    return 2 * (up.outstanding + up.queued) + up.pressed


def ring_hash(data: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "big")


_RING_FORMAT = struct.Struct(f">{RING_POINTS}Q")


def ring_points(replica_id: str) -> tuple[int, ...]:
    """A replica's RING_POINTS positions on the ring, from its id alone: one hash call for all of
    them (a snapshot of hundreds of prefix-routed models places thousands of replicas at once)."""
    return _RING_FORMAT.unpack(hashlib.shake_128(replica_id.encode()).digest(_RING_FORMAT.size))


class Upstream:
    """The router's live view of one endpoint: what is in flight to it and whether it is ejected."""

    __slots__ = ("endpoint", "replica_id", "model", "adapters", "node", "outstanding", "queued", "engine", "slots",
                 "ejected_until", "headers", "stream_headers", "base_url", "preempting", "hit_rate", "pressed",
                 "adapter_use")

    def __init__(self, endpoint: Endpoint):
        self.endpoint = endpoint
        self.replica_id = endpoint.replica_id
        self.model = endpoint.model
        self.adapters = endpoint.adapters  # the LoRA adapters its engine holds, in launch order
        # adapter -> [its requests in flight here, unix time of the last]: what the control plane
        # unloads by; made at the first adapter request.
        self.adapter_use: dict[str, list] | None = None
        self.node = endpoint.node  # where its engine answers, for the request log; None: not known
        self.outstanding = 0
        self.queued = 0  # requests the engine held beyond ours at the last poll; 0 while not known
        self.engine = None  # engineload.EngineLoad as last polled, None while unknown
        self.slots: int | None = None  # the engine's slot count as last reported (kept while it does not answer)
        self.ejected_until = 0.0
        # The engine's memory as of the last two polls (see note_reading): whether it preempted
        # requests between them, its prefix-cache hit rate between them (None: too few queries to
        # say), and whether that makes it pressed among its pool's members (weigh_pressure).
        self.preempting = False
        self.hit_rate: float | None = None
        self.pressed = False
        # Built once: the request path reuses these mappings for every request to this endpoint.
        headers = {"Content-Type": "application/json", **ENGINE_HEADERS}
        if endpoint.api_key:
            headers["Authorization"] = "Bearer " + endpoint.api_key
        self.headers = headers
        self.stream_headers = {**headers, "Accept": "text/event-stream"}
        self.base_url = str(URL(endpoint.url))  # percent-encoded once: the forwarder appends route paths to it as they are

    def __repr__(self) -> str:
        return f"Upstream({self.replica_id} {self.endpoint.url} outstanding={self.outstanding})"


def _least_loaded(pool: Pool, now: float, exclude: Iterable[Upstream], include_ejected: bool,
                  weight: Callable[[Upstream], int]) -> Upstream | None:
    """The eligible member of least `weight`, ties round-robin."""
    members = pool.members
    count = len(members)
    start = pool.next
    pool.next = start + 1 if start + 1 < count else 0
    best = best_weight = None
    for offset in range(count):
        index = start + offset
        up = members[index if index < count else index - count]
        if (up.ejected_until > now and not include_ejected) or (exclude and up in exclude):
            continue
        w = weight(up)
        if best is None or w < best_weight:
            best, best_weight = up, w
    return best


class Policy:
    """How a pool chooses among its members (R-6.5): one object per policy, given to each pool
    once. `choose` picks the member for one request and counts nothing; the Balancer does."""

    name: RoutingPolicy

    def choose(self, pool: Pool, now: float, exclude: Iterable[Upstream], include_ejected: bool,
               key: bytes | None, owner: str | None) -> Upstream | None:
        raise NotImplementedError


class LeastOutstanding(Policy):
    """The least loaded member, a pressed one after an unpressed one of equal load, ties
    round-robin; affinity keys are ignored."""

    name = RoutingPolicy.LEAST_OUTSTANDING

    def choose(self, pool, now, exclude, include_ejected, key, owner):
        return _least_loaded(pool, now, exclude, include_ejected, _weight)


class PrefixAffinity(Policy):
    """Consistent hashing with bounded loads on the request's affinity key (the module docstring)."""

    name = RoutingPolicy.PREFIX

    def __init__(self, bound: float = PREFIX_BOUND):
        self.bound = bound  # the load bound over the mean; other values for benches

    def choose(self, pool, now, exclude, include_ejected, key, owner):
        if key is None:
            return _least_loaded(pool, now, exclude, include_ejected, _weight)
        point = ring_hash(key)
        if owner is not None and pool.capped(point, owner):  # its API key homed its share already
            return _least_loaded(pool, now, exclude, include_ejected, _weight)
        home = pool.live(point, now)
        if home is not None:
            return self._near_home(pool, home, point, now, exclude, include_ejected)
        # No engine caches the key: wherever it goes it pays its whole prefill, so it is balanced
        # by load like least-outstanding (a replica without room for one more live key counted a
        # request busier), and homed where its engine accepts it (keep_home). Placed by the ring,
        # new keys piled on one engine while the other idled; the room is a request's weight, not
        # a rule, since where every key is new (no prompt shares a prefix) a rule would send them
        # wherever there is room, whatever the load.
        homed, room = pool.homed, pool.key_room()
        best = _least_loaded(pool, now, exclude, include_ejected,
                             lambda up: _weight(up) + 2 * (homed.get(up, 0) + 1 > room))
        if best is not None and owner is None:
            pool.keep(point, now, None, best)
        return best

    def _near_home(self, pool: Pool, home: Upstream, point: int, now: float, exclude: Iterable[Upstream],
                   include_ejected: bool) -> Upstream | None:
        """The live key's `home` if it is eligible and within the bound, else clockwise from the
        key's ring point the first eligible replica within it, else the least loaded eligible one
        (only when every eligible one is over the bound)."""
        eligible = [up for up in pool.members
                    if not ((up.ejected_until > now and not include_ejected) or (exclude and up in exclude))]
        if not eligible:
            return None
        total = sum(up.outstanding + up.queued for up in eligible)
        capacity = bound_capacity(total, len(eligible), self.bound)
        idle_capacity = bound_capacity(total, len(eligible), max(IDLE_ENGINE_BOUND, self.bound))
        allowed = {id(up) for up in eligible}
        # A pressed replica (R-6.5g) takes a request only while it has less than every unpressed
        # one, and never the looser bound: it is not given more work than its peers.
        spare = min((up.outstanding + up.queued for up in eligible if not up.pressed), default=None)

        def within(up: Upstream) -> bool:
            load = up.outstanding + up.queued + 1
            if up.pressed:
                return load <= capacity and (spare is None or load <= spare)
            return load <= capacity or (load <= idle_capacity and _queues_nothing(up))

        if id(home) in allowed and within(home):
            return home
        for up in pool.clockwise(point):
            if up is not home and id(up) in allowed and within(up):
                return up
        return min(eligible, key=_weight)


class Pool:
    __slots__ = ("members", "next", "chooser", "_ring", "homes", "homed", "owned", "touched", "canary")

    def __init__(self, members: list[Upstream], chooser: Policy | None = None):
        self.members = members
        # A canary revision's share of the model's requests and its members; None: none.
        self.canary: tuple[int, frozenset[Upstream]] | None = None
        self.next = 0
        self.chooser = chooser if chooser is not None else LeastOutstanding()  # chosen once per pool
        self._ring: tuple[list[int], list[Upstream]] | None = None
        # Prefix routing's live keys: the key's ring position -> [its home, the time of its last
        # request, the API key id that homed it], least recently used first; how many live keys
        # each member is home to, and how many each API key homed.
        self.homes: OrderedDict[int, list] = OrderedDict()
        self.homed: dict[Upstream, int] = {}
        self.owned: dict[str | None, int] = {}
        # The live keys homed or used here since the last report (point -> home): what the
        # router tells the control plane, whose table every router follows (R-6.5d).
        self.touched: dict[int, Upstream] = {}

    def ring(self) -> tuple[list[int], list[Upstream]]:
        """(sorted ring positions, owners[i] holding points[i]); empty unless the policy is prefix.

        Made at the first request that needs it, not when the lists arrive: a snapshot with
        hundreds of prefix-routed models is applied without placing every replica's points."""
        if self._ring is None:
            owner: dict[int, Upstream] = {}
            if self.chooser.name == PREFIX:
                for up in self.members:  # 64-bit points: two replicas on one point is left to chance
                    owner.update(dict.fromkeys(ring_points(up.replica_id), up))
            points = sorted(owner)
            self._ring = (points, [owner[point] for point in points])
        return self._ring

    def owner(self, point: int) -> Upstream:
        """The member holding the first ring point clockwise from `point`."""
        points, owners = self.ring()
        return owners[bisect.bisect_left(points, point) % len(points)]

    def clockwise(self, point: int) -> Iterator[Upstream]:
        """Each member once, in ring order from `point`: its owner first."""
        points, owners = self.ring()
        size = len(points)
        start = bisect.bisect_left(points, point)
        seen: set[int] = set()
        for step in range(size):
            if len(seen) >= len(self.members):
                return
            up = owners[(start + step) % size]
            if id(up) not in seen:
                seen.add(id(up))
                yield up

    def live(self, point: int, now: float) -> Upstream | None:
        """The home of the live key at ring position `point` (its use noted), None when it is not live."""
        homes = self.homes
        horizon = now - KEY_IDLE_SECONDS
        while homes:  # forget the keys gone idle, least recently used first
            oldest = next(iter(homes.values()))
            if oldest[1] >= horizon:
                break
            homes.popitem(last=False)
            self._unhome(oldest)
        entry = homes.get(point)
        if entry is None:
            return None
        entry[1] = now
        homes.move_to_end(point)
        self.touched[point] = entry[0]
        return entry[0]

    def capped(self, point: int, owner: str) -> bool:
        """Whether a request of API key `owner` with this key may not make it a home (KEYS_PER_API_KEY)."""
        return point not in self.homes and self.owned.get(owner, 0) >= KEYS_PER_API_KEY

    def key_room(self) -> float:
        """The most live keys a member may be home to once one more key is homed (KEY_BOUND)."""
        return bound_capacity(len(self.homes), len(self.members), KEY_BOUND)

    def keep(self, point: int, now: float, owner: str | None, up: Upstream | None = None) -> None:
        """The engine of `up` accepted a request of API key `owner` with this key: home it if it is
        not live, on `up` itself (its engine now caches the prefix) while `up` is a member with
        room for one more key and its memory is not short (R-6.5g), else where _place puts it."""
        if self.live(point, now) is not None or (owner is not None and self.capped(point, owner)):
            return
        if up is None or up.pressed or not any(member is up for member in self.members) \
                or self.homed.get(up, 0) + 1 > self.key_room():
            up = self._place(point, now)
        self._add(point, up, now, owner)

    def _add(self, point: int, up: Upstream, now: float, owner: str | None, touched: bool = True) -> None:
        homes = self.homes
        homes[point] = [up, now, owner]
        self.homed[up] = self.homed.get(up, 0) + 1
        self.owned[owner] = self.owned.get(owner, 0) + 1
        if touched:
            self.touched[point] = up
        if len(homes) > KEYS_KEPT:
            self._unhome(homes.popitem(last=False)[1])

    def adopt(self, point: int, up: Upstream, now: float) -> None:
        """The control plane's home for the key at `point` (R-6.5d): it replaces this router's
        own, and counts as a request now."""
        entry = self.homes.get(point)
        if entry is None:
            self._add(point, up, now, None, touched=False)
            return
        self.homes.move_to_end(point)
        entry[1] = now
        if entry[0] is not up:
            self._unhome(entry)
            entry[0] = up
            self.homed[up] = self.homed.get(up, 0) + 1
            self.owned[entry[2]] = self.owned.get(entry[2], 0) + 1
        if point in self.touched:
            self.touched[point] = up

    def _unhome(self, entry: list) -> None:
        up, _, owner = entry
        left = self.homed[up] - 1
        if left:
            self.homed[up] = left
        else:
            del self.homed[up]
        left = self.owned[owner] - 1
        if left:
            self.owned[owner] = left
        else:
            del self.owned[owner]

    def _place(self, point: int, now: float) -> Upstream:
        """A new key's home where the replica that ran its first request has no room for it:
        clockwise from its point, the first replica not ejected with room for one more key within
        KEY_BOUND, one whose engine is not pressed (R-6.5g) first, since a new key pays its
        prefill wherever it goes; when every one is ejected, the key's ring owner."""
        capacity = self.key_room()
        homed = self.homed
        fewest: Upstream | None = None
        pressed: Upstream | None = None
        for up in self.clockwise(point):
            if up.ejected_until > now:
                continue
            count = homed.get(up, 0)
            if count + 1 <= capacity:
                if not up.pressed:
                    return up
                if pressed is None:
                    pressed = up
            if fewest is None or count < homed.get(fewest, 0):
                fewest = up
        if pressed is not None:
            return pressed
        return fewest if fewest is not None else self.owner(point)

    def inherit(self, old: Pool) -> None:
        """Keep the live keys of `old` (the same model's previous pool) whose home is still a
        member (by replica id: a new key or address leaves the replica's cache as it was): a
        leaver frees its own keys (placed again at their next request), and a joiner takes the
        live keys whose ring point it owns while it has room for them (KEY_BOUND), so that it has
        a share of the work; the rest stay where their engines cache them."""
        members = {up.replica_id: up for up in self.members}
        joined = set(members).difference(up.replica_id for up in old.members)
        kept = [(point, entry) for point, entry in old.homes.items() if entry[0].replica_id in members]
        room = bound_capacity(len(kept) - 1, len(self.members), KEY_BOUND)
        homes, homed, owned = self.homes, self.homed, self.owned
        for point, (was, seen, owner) in kept:
            up = members[was.replica_id]
            if joined:
                joiner = self.owner(point)
                if joiner.replica_id in joined and homed.get(joiner, 0) + 1 <= room:
                    up = joiner
                    self.touched[point] = up
            homes[point] = [up, seen, owner]
            homed[up] = homed.get(up, 0) + 1
            owned[owner] = owned.get(owner, 0) + 1
        for point in old.touched:  # not reported yet
            entry = homes.get(point)
            if entry is not None:
                self.touched[point] = entry[0]

    def same(self, members: Sequence[Endpoint], policy: str) -> bool:
        """Whether this pool already is `members` under `policy` (then it is kept as it is)."""
        if policy != self.chooser.name or len(members) != len(self.members):
            return False
        for up, endpoint in zip(self.members, members):
            mine = up.endpoint
            if mine is not endpoint and (mine.replica_id != endpoint.replica_id or mine.url != endpoint.url
                                         or mine.api_key != endpoint.api_key or mine.model != endpoint.model
                                         or mine.adapters != endpoint.adapters
                                         or mine.adapter_errors != endpoint.adapter_errors):
                return False
        return True

    def set_canary(self, members: Sequence[Endpoint]) -> None:
        """The canary share the endpoints carry (R-4.13), `members` in the order of self.members."""
        share = next((e.canary for e in members if e.canary is not None), None)
        if share is None:
            self.canary = None
            return
        chosen = frozenset(up for up, e in zip(self.members, members) if e.canary is not None)
        self.canary = (share, chosen) if len(chosen) < len(self.members) else None


def canary_draw(key: bytes | None) -> float:
    """Where a request falls in [0, 100) for a canary's share: by its affinity key, so that a
    conversation stays on one revision whichever router it reaches; at random without one."""
    if key is None:
        return random.random() * 100
    return int.from_bytes(hashlib.blake2b(key, digest_size=8, person=b"llmgw-canary").digest(), "big") % 10000 / 100


class Balancer:
    """Endpoints per model and the choice among them."""

    def __init__(self, eject_seconds: float = EJECT_SECONDS, prefix_bound: float = PREFIX_BOUND):
        self.eject_seconds = eject_seconds
        # One object per policy, each pool given its own once; `prefix_bound`, the load
        # bound over the mean (R-6.5b), takes other values in benches.
        self._choosers: dict[str, Policy] = {LEAST_OUTSTANDING: LeastOutstanding(),
                                             PREFIX: PrefixAffinity(prefix_bound)}
        self._pools: dict[str, Pool] = {}
        # Each LoRA adapter's pool, by the adapter's name: members of its base's pool.
        self._adapter_pools: dict[str, Pool] = {}
        self._adapter_errors: dict[str, str] = {}  # adapter -> why its latest load failed
        # The base models whose LoRA adapters are loaded on demand: the poller reads which
        # adapters their engines hold. Set with each catalog.
        self.loading_bases: frozenset[str] = frozenset()
        self._by_replica: dict[str, list[Upstream]] = {}
        self._retired: list[Upstream] = []  # taken off the lists with requests still in flight
        self._last_used: dict[str, float] = {}  # replica_id -> time.monotonic() of the last acquire

    def replace(self, endpoints: Mapping[str, Sequence[Endpoint]],
                policies: Mapping[str, str] | None = None) -> None:
        """Install a full new set of endpoints; an endpoint that stays keeps its counters, ejection and
        engine load. `policies` names each model's routing policy; absent means least-outstanding."""
        previous = {(up.replica_id, up.endpoint.url, up.endpoint.api_key): up
                    for pool in self._pools.values() for up in pool.members}
        pools = {}
        policies = policies or {}
        old_pools = self._pools
        for model, members in endpoints.items():
            policy = policies.get(model, LEAST_OUTSTANDING)
            old = old_pools.get(model)
            if old is not None and old.same(members, policy):  # unchanged: kept, ring and round-robin too
                pools[model] = old
                old.set_canary(members)
                continue
            ups = []
            for endpoint in members:
                up = previous.get((endpoint.replica_id, endpoint.url, endpoint.api_key))
                if up is None or up.endpoint.model != endpoint.model:
                    up = Upstream(endpoint)
                elif up.adapters != endpoint.adapters or up.endpoint.adapter_errors != endpoint.adapter_errors:
                    # The same engine, which loaded or dropped an adapter: its counters stay.
                    # (llama-server's adapters, whose order is its ids, change only with a new replica.)
                    up.endpoint = endpoint
                    up.adapters = endpoint.adapters
                ups.append(up)
            pool = pools[model] = Pool(ups, self._choosers.get(policy, self._choosers[LEAST_OUTSTANDING]))
            pool.set_canary(members)
            if old is not None and old.homes and policy == PREFIX and ups:
                pool.inherit(old)
        self._pools = pools
        self._adapter_pools = self._adapter_pools_of(pools) if self._adapter_pools or any(
            up.adapters for pool in pools.values() for up in pool.members) else {}
        self._adapter_errors = {name: why for pool in pools.values() for up in pool.members
                                for name, why in up.endpoint.adapter_errors}
        by_replica: dict[str, list[Upstream]] = {}
        for pool in pools.values():
            for up in pool.members:
                by_replica.setdefault(up.replica_id, []).append(up)
        self._by_replica = by_replica
        kept = {id(up) for members in by_replica.values() for up in members}
        self._retired = [up for up in [*self._retired, *previous.values()]
                         if up.outstanding > 0 and id(up) not in kept]
        alive = set(by_replica)
        self._last_used = {rid: t for rid, t in self._last_used.items() if rid in alive}

    def _adapter_pools_of(self, pools: Mapping[str, Pool]) -> dict[str, Pool]:
        """Each LoRA adapter's pool (R-8.8): the members of its base's pool whose engines hold it,
        the very Upstreams of the base's pool (one load, whichever model a request names), chosen
        among by the base's policy, with the base's canary split. An adapter's pool whose members
        stay is kept as it was: its round-robin, ring and homes too."""
        held: dict[str, tuple[Pool, list[Upstream]]] = {}
        for pool in pools.values():
            for up in pool.members:
                for adapter in up.adapters:
                    entry = held.get(adapter)
                    if entry is None:
                        held[adapter] = (pool, [up])
                    elif entry[0] is pool:  # an adapter is one base's (a catalog's names are unique)
                        entry[1].append(up)
        old_pools = self._adapter_pools
        out = {}
        for adapter, (base, members) in held.items():
            old = old_pools.get(adapter)
            if old is not None and old.chooser is base.chooser and len(old.members) == len(members) \
                    and all(mine is up for mine, up in zip(old.members, members)):
                pool = old
            else:
                pool = Pool(members, base.chooser)
                if old is not None and old.homes and base.chooser.name == PREFIX:
                    pool.inherit(old)
            canary = base.canary
            if canary is not None:
                chosen = canary[1].intersection(members)
                canary = (canary[0], chosen) if 0 < len(chosen) < len(members) else None
            pool.canary = canary
            out[adapter] = pool
        return out

    def _pool(self, model: str) -> Pool | None:
        """The model's pool, or the adapter's (R-8.8) when `model` names a LoRA adapter."""
        pool = self._pools.get(model)
        return pool if pool is not None else self._adapter_pools.get(model)

    def adapter_error(self, adapter: str) -> str | None:
        """Why the control plane's latest load of `adapter` failed, while it says so (R-8.8)."""
        return self._adapter_errors.get(adapter)

    def adapter_pressed(self, adapter: str, base: str) -> bool:
        """Whether every replica holding `adapter` is over the load bound among its base's
        replicas (prefix routing's bound, R-6.5b) while some replica of the base does not hold
        it: then another should load it (R-8.8)."""
        pool, whole = self._adapter_pools.get(adapter), self._pools.get(base)
        if pool is None or whole is None or len(pool.members) >= len(whole.members):
            return False
        total = sum(up.outstanding + up.queued for up in whole.members)
        capacity = bound_capacity(total, len(whole.members))
        return all(up.outstanding + up.queued + 1 > capacity for up in pool.members)

    def adapter_use(self) -> dict[str, dict[str, tuple[int, float]]]:
        """replica id -> adapter -> (requests in flight, unix time of the last) (R-8.8)."""
        out: dict[str, dict[str, tuple[int, float]]] = {}
        for up in [*self.upstreams(), *self._retired]:
            if up.adapter_use:
                mine = out.setdefault(up.replica_id, {})
                for adapter, (count, last) in up.adapter_use.items():
                    before = mine.get(adapter, (0, 0.0))
                    mine[adapter] = (before[0] + count, max(before[1], last))
        return out

    def endpoints(self, model: str) -> list[Upstream]:
        pool = self._pool(model)
        return list(pool.members) if pool is not None else []

    def has_endpoints(self, model: str) -> bool:
        pool = self._pool(model)
        return pool is not None and bool(pool.members)

    def has_canary(self, model: str) -> bool:
        """Whether the model's requests are split with a canary revision (R-4.13)."""
        pool = self._pool(model)
        return pool is not None and pool.canary is not None

    def policy(self, model: str) -> str:
        pool = self._pool(model)
        return pool.chooser.name if pool is not None else LEAST_OUTSTANDING

    def acquire(self, model: str, now: float, exclude: Iterable[Upstream] = (),
                include_ejected: bool = False, key: bytes | None = None, owner: str | None = None) -> Upstream | None:
        """The endpoint with the least load (ties: round-robin), now counted as busy; for a model
        routed by prefix and a request with an affinity `key`, the key's replica on the ring
        within the load bound.

        Ejected endpoints and those in `exclude` (already tried by this request) are skipped,
        unless `include_ejected` asks for a last resort when every endpoint is ejected.

        `owner`, the id of the request's API key: a key not live yet is homed only by keep_home,
        once the engine accepts the request, and an owner at KEYS_PER_API_KEY is balanced by
        load. Without one (benches, placement tests) the key is homed at once.

        `model` may name a LoRA adapter (R-8.8): then the members of its base's pool that hold it.
        """
        pool = self._pools.get(model)
        if pool is None:
            pool = self._adapter_pools.get(model)
        if pool is None or not pool.members:
            return None
        canary = pool.canary
        if canary is None:
            best = pool.chooser.choose(pool, now, exclude, include_ejected, key, owner)
        else:  # the canary's share to its revision, the rest to the others; either side if one has none
            share, chosen = canary
            side = canary_draw(key) < share
            other = [up for up in pool.members if (up in chosen) != side]
            best = pool.chooser.choose(pool, now, [*exclude, *other], include_ejected, key, owner) or \
                pool.chooser.choose(pool, now, exclude, include_ejected, key, owner)
        if best is not None:
            best.outstanding += 1
            self._last_used[best.replica_id] = now  # noted on the request path, cheaply
        return best

    def acquire_replica(self, replica_id: str, model: str, now: float) -> Upstream | None:
        """That replica's endpoint for `model` (ejected or not: no other replica would do), now counted as busy."""
        for up in self._by_replica.get(replica_id, ()):
            if up.model == model:
                up.outstanding += 1
                self._last_used[replica_id] = now
                return up
        return None

    def keep_home(self, model: str, key: bytes, owner: str, now: float, up: Upstream | None = None) -> None:
        """The engine of `up` accepted a request of API key `owner` with affinity `key`: the key is
        homed if it is not live (within KEYS_PER_API_KEY), on `up` while it has room for it."""
        pool = self._pool(model)
        if pool is not None and pool.chooser.name == PREFIX and pool.members:
            pool.keep(ring_hash(key), now, owner, up)

    def set_homes(self, homes: Mapping[str, Mapping[int, str | None]], now: float) -> None:
        """The control plane's homes (R-6.5d), model -> ring point -> replica id: each replaces
        this router's own for its key. None (forgotten there) and a replica that is not a member
        of the model's pool change nothing: a key lives on here as long as this router uses it."""
        for model, entries in homes.items():
            pool = self._pool(model)
            if pool is None or pool.chooser.name != PREFIX or not pool.members:
                continue
            members = {up.replica_id: up for up in pool.members}
            for point, replica_id in entries.items():
                up = members.get(replica_id) if replica_id is not None else None
                if up is not None:
                    pool.adopt(point, up, now)

    def take_homes(self, limit: int = HOMES_PER_REPORT) -> dict[str, dict[int, str]]:
        """model -> ring point -> replica id of the keys homed or sent home since the last call, at
        most `limit` of them (the rest at the next call): what a report tells the control plane."""
        out: dict[str, dict[int, str]] = {}
        left = limit
        for model, pool in [*self._pools.items(), *self._adapter_pools.items()]:
            touched = pool.touched
            if not touched or left <= 0:
                continue
            if len(touched) <= left:
                out[model] = {point: up.replica_id for point, up in touched.items()}
                left -= len(touched)
                pool.touched = {}
            else:
                taken = out[model] = {}
                for point in list(touched)[:left]:
                    taken[point] = touched.pop(point).replica_id
                left = 0
        return out

    def weigh_pressure(self) -> None:
        """After a poll: which endpoints are pressed (R-6.5g), each against the best hit rate
        among its pool's members."""
        for pool in self._pools.values():
            best = max((up.hit_rate for up in pool.members if up.hit_rate is not None), default=None)
            for up in pool.members:
                up.pressed = is_pressed(up, best)

    @staticmethod
    def release(up: Upstream) -> None:
        up.outstanding -= 1

    def eject(self, up: Upstream, now: float) -> None:
        up.ejected_until = now + self.eject_seconds

    def outstanding(self, replica_id: str) -> int:
        """Requests in flight to a replica, including after it was taken off the lists (drain)."""
        return sum(up.outstanding for up in self._by_replica.get(replica_id, ())) + \
            sum(up.outstanding for up in self._retired if up.replica_id == replica_id)

    def counted(self) -> list[Upstream]:
        """Every endpoint whose requests in flight count: the listed ones and the retired ones."""
        return [*self.upstreams(), *self._retired]

    def upstreams(self) -> list[Upstream]:
        """Every listed endpoint, once: what the engine-load poller reads."""
        return [up for members in self._by_replica.values() for up in members]

    def engine_load(self, replica_id: str):
        """The replica's engine load as last polled (engineload.EngineLoad), None when unknown."""
        for up in self._by_replica.get(replica_id, ()):
            if up.engine is not None:
                return up.engine
        return None

    def live_keys(self, model: str) -> dict[str, int]:
        """replica_id -> the live affinity keys homed on it (prefix routing; R-6.5b)."""
        pool = self._pool(model)
        return {up.replica_id: count for up, count in pool.homed.items()} if pool is not None else {}

    def outstanding_by_model(self) -> dict[str, int]:
        return {model: sum(up.outstanding for up in pool.members) for model, pool in self._pools.items()}

    def last_used(self) -> dict[str, float]:
        """replica_id -> unix time of the last request sent to it; never-used replicas are absent."""
        offset = time.time() - time.monotonic()
        return {rid: t + offset for rid, t in self._last_used.items()}
