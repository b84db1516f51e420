"""Prefix affinity with bounded load (R-6.5): the ring, the bound, the affinity key."""

from __future__ import annotations

import bisect
import math
import random

from llmgw.router.affinity import KEY_BYTES, affinity_key
from llmgw.contracts.feed import EngineLoad
from llmgw.router import balancer
from llmgw.router.balancer import (IDLE_ENGINE_BOUND, LEAST_OUTSTANDING, PREFIX, PREFIX_BOUND, Balancer,
                                    bound_capacity, ring_hash, ring_points)
from llmgw.contracts.endpoints import Endpoint


def endpoints(count: int, model: str = "m") -> list[Endpoint]:
    return [Endpoint(f"r-{i}", model, f"http://10.0.0.{i}:20000", f"key-{i}") for i in range(count)]


def prefix_balancer(count: int, members: list[Endpoint] | None = None) -> Balancer:
    b = Balancer(eject_seconds=5)
    b.replace({"m": members if members is not None else endpoints(count)}, {"m": PREFIX})
    return b


def keys(count: int) -> list[bytes]:
    return [f"conversation {i}".encode() for i in range(count)]


def pick(b: Balancer, key: bytes) -> str:
    up = b.acquire("m", 1.0, key=key)
    b.release(up)
    return up.replica_id


def test_r6_5_same_key_same_replica_while_within_bound():
    b = prefix_balancer(4)
    chosen = {key: pick(b, key) for key in keys(200)}
    for key, replica in chosen.items():
        assert pick(b, key) == replica
    spread = {replica: list(chosen.values()).count(replica) for replica in set(chosen.values())}
    print("keys per replica:", spread)
    assert len(spread) == 4  # the ring spreads keys over every replica


def test_r6_5_overloaded_replica_spills_to_the_next_on_the_ring():
    b = prefix_balancer(4)
    key = b"a long shared system prompt"
    home = b.acquire("m", 1.0, key=key)
    held = [home]
    # Keep sending the same key while holding every request: the home replica takes it while
    # its load stays within the bound over the mean, then the next replica on the ring does.
    while True:
        up = b.acquire("m", 1.0, key=key)
        held.append(up)
        if up is not home:
            break
    total = len(held) - 1  # in flight before the spilled request, all on the home replica
    print("home took", total, "requests before one spilled")
    assert total >= 1
    assert total + 1 > bound_capacity(total, 4)  # the spilled one was over the bound
    assert total <= bound_capacity(total - 1, 4)  # the one before it was within
    spill = up
    assert spill is not home
    # The next one on the ring, deterministically: a second balancer in the same state agrees.
    other = prefix_balancer(4)
    for _ in range(home.outstanding):
        other.acquire("m", 1.0, key=key)
    assert other.acquire("m", 1.0, key=key).replica_id == spill.replica_id
    for up in held:
        b.release(up)
    assert b.acquire("m", 1.0, key=key) is home  # back within the bound: home again


def test_r6_5_bound_holds_max_over_mean_where_the_counts_allow():
    """Requests held as they arrive (none ends): after every placement the busiest replica holds
    at most 1.25x the mean, or the even spread ceil(m / n) when that is more. One key for all,
    then keys drawn from a few tenants: the cases where affinity pulls hardest."""
    for n in (2, 4, 16):
        for draw in ("one key", "tenants"):
            b = prefix_balancer(n)
            rng = random.Random(n)
            worst = 0.0
            for placed in range(1, 6 * n + 1):
                key = b"tenant 0" if draw == "one key" else f"tenant {rng.randrange(3)}".encode()
                b.acquire("m", 1.0, key=key)
                loads = [up.outstanding for up in b.endpoints("m")]
                mean = placed / n
                allowed = max(PREFIX_BOUND, math.ceil(placed / n) / mean)
                assert max(loads) / mean <= allowed + 1e-9, (n, draw, placed, loads)
                if placed >= n:
                    worst = max(worst, max(loads) / mean)
            print(f"{n} replicas, {draw}: worst max/mean {worst:.2f} from {n} to {6 * n} in flight")


def test_r6_5_about_one_request_per_replica_spreads_evenly():
    # 16 replicas, 16 requests of one tenant held: one each, not two or three on the ring's first.
    b = prefix_balancer(16)
    for _ in range(16):
        b.acquire("m", 1.0, key=b"one shared system prompt")
    assert sorted(up.outstanding for up in b.endpoints("m")) == [1] * 16
    # The 17th may double up (ceil(17 / 16) = 2 is the least the busiest can hold), and only that.
    b.acquire("m", 1.0, key=b"one shared system prompt")
    assert sorted(up.outstanding for up in b.endpoints("m")) == [1] * 15 + [2]


def test_r6_5_bound_capacity():
    assert bound_capacity(0, 4) == 1  # the first request anywhere
    assert bound_capacity(15, 16) == 1.25  # one each: no second while the mean is 1 (not ceil(1.25) = 2)
    assert bound_capacity(16, 16) == 2  # ceil(17 / 16)
    assert bound_capacity(63, 16) == 5  # 1.25 * 4, exactly
    assert bound_capacity(99, 16) == 7.8125  # 1.25 * 100 / 16, not rounded up to 8


def test_r6_5_engine_queue_counts_toward_the_bound():
    b = prefix_balancer(3)
    key = b"tenant A"
    home = b.acquire("m", 1.0, key=key)
    b.release(home)
    home.queued = 50  # the engine reports a long queue llmgw did not send
    assert b.acquire("m", 1.0, key=key) is not home


def test_r6_5_an_engine_that_queues_nothing_keeps_its_keys_up_to_the_looser_bound():
    """While the home engine says nothing waits in it, the key stays there up to IDLE_ENGINE_BOUND
    times the mean; once it reports a queue, or when it does not report one, the tight bound.
    One key sent again and again, every request held: the case where affinity pulls hardest."""
    key = b"tenant A"

    def home_takes(replicas: int, waiting, most: int = 40) -> int:
        b = prefix_balancer(replicas)
        home = b.acquire("m", 1.0, key=key)
        b.release(home)
        for up in b.endpoints("m"):
            up.engine = None if waiting is None else EngineLoad("vllm", waiting=waiting, running=0)
            if up is not home:
                up.queued = 4  # the other replicas busy with other clients' requests
        for taken in range(most):
            if b.acquire("m", 1.0, key=key) is not home:
                return taken
        return most
    for replicas in (2, 4):
        idle, queueing, unknown = (home_takes(replicas, w) for w in (0, 1, None))
        print(f"{replicas} replicas: requests the home replica took before one spilled: engine idle {idle}, "
              f"queueing {queueing}, not reporting {unknown}")
        assert queueing == unknown  # unknown is not "nothing waits"
        assert idle > queueing
        others = 4 * (replicas - 1)
        # Where it spilled, the next request was over that bound and the last one within it.
        assert unknown + 1 > bound_capacity(others + unknown, replicas)
        assert unknown <= bound_capacity(others + unknown - 1, replicas)
        if replicas == 2:
            # Twice the mean of two is all of them: what stops an engine that queues nothing from
            # taking every request is its memory (R-6.5g: a full KV cache makes it pressed).
            assert idle == 40
        else:
            assert idle + 1 > bound_capacity(others + idle, replicas, IDLE_ENGINE_BOUND)
            assert idle <= bound_capacity(others + idle - 1, replicas, IDLE_ENGINE_BOUND)


def ring_owner(replica_ids: list[str], key: bytes) -> str:
    """The replica whose ring point follows the key's hash: its home while that one has room."""
    owner = {point: rid for rid in replica_ids for point in ring_points(rid)}
    points = sorted(owner)
    return owner[points[bisect.bisect_left(points, ring_hash(key)) % len(points)]]


def test_r6_5_removed_replica_remaps_only_its_keys():
    members = endpoints(5)
    b = prefix_balancer(5, members)
    before = {key: pick(b, key) for key in keys(500)}
    b.replace({"m": [e for e in members if e.replica_id != "r-2"]}, {"m": PREFIX})
    after = {key: pick(b, key) for key in keys(500)}
    moved = [key for key in before if before[key] != after[key]]
    assert moved and all(before[key] == "r-2" for key in moved)
    assert len(moved) == sum(1 for r in before.values() if r == "r-2")
    # Joining again moves only keys to the joiner: the live ones whose ring point it owns.
    b.replace({"m": members}, {"m": PREFIX})
    again = {key: pick(b, key) for key in keys(500)}
    back = [key for key in after if again[key] != after[key]]
    ids = [e.replica_id for e in members]
    assert back and all(again[key] == "r-2" and ring_owner(ids, key) == "r-2" for key in back)
    print("moved off r-2:", len(moved), "moved back:", len(back))
    # A replica given a new key (or address) keeps the keys homed on it: its engine caches them.
    rotated = [Endpoint(e.replica_id, e.model, e.url, e.api_key + "-new") for e in members]
    b.replace({"m": rotated}, {"m": PREFIX})
    assert {key: pick(b, key) for key in keys(500)} == again


def test_r6_5_a_few_keys_split_evenly_whatever_the_replica_ids():
    # Hashing alone splits 10 keys over 2 replicas 7 / 3 or worse about a third of the time; the
    # key bound places each new key on the first replica clockwise with room for it.
    rng = random.Random(7)
    tenants = [f"tenant {t} system prompt".encode() for t in range(10)]
    lopsided = 0
    for _ in range(100):
        ids = [f"replica-{rng.getrandbits(48):012x}" for _ in range(2)]
        b = prefix_balancer(2, [Endpoint(rid, "m", f"http://{rid}", None) for rid in ids])
        homes = [pick(b, key) for key in tenants]
        assert sorted(homes.count(rid) for rid in ids) == [5, 5]
        assert b.live_keys("m") == {rid: 5 for rid in ids}
        lopsided += max(sum(ring_owner(ids, key) == rid for key in tenants) for rid in ids) >= 7
    print("ring owners alone split 7 / 3 or worse:", lopsided, "of 100")
    assert lopsided  # the case the key bound is for does occur
    b = prefix_balancer(16)
    homes = [pick(b, f"tenant {t}".encode()) for t in range(32)]
    assert max(homes.count(rid) for rid in set(homes)) <= 2


def test_r6_5_a_key_stays_where_it_was_placed_while_it_is_live():
    ids = ["a", "b"]
    b = prefix_balancer(2, [Endpoint(rid, "m", f"http://{rid}", None) for rid in ids])
    candidates = [f"k{i}".encode() for i in range(40)]
    on_a = [key for key in candidates if ring_owner(ids, key) == "a"]
    first, second = on_a[:2]
    assert pick(b, first) == "a"
    assert pick(b, second) == "b"  # a is full (1 of 2 keys), so b, though a owns its ring point
    up = b.acquire("m", 100.0, key=first)
    b.release(up)  # first is live at 100 s; second was last asked for at 1 s
    assert b.acquire("m", 200.0, key=second).replica_id == "b"  # kept: a move would pay its prefill
    assert b.live_keys("m") == {"a": 1, "b": 1}


def test_r6_5_idle_keys_are_forgotten_and_the_table_is_bounded(monkeypatch):
    b = prefix_balancer(2)
    for key in keys(10):
        pick(b, key)
    assert sum(b.live_keys("m").values()) == 10
    up = b.acquire("m", 1.0 + balancer.KEY_IDLE_SECONDS + 0.1, key=b"late")
    b.release(up)
    assert b.live_keys("m") == {up.replica_id: 1}  # the ten went idle
    monkeypatch.setattr(balancer, "KEYS_KEPT", 8)
    b = prefix_balancer(2)
    for key in keys(20):
        pick(b, key)
    assert sum(b.live_keys("m").values()) == 8


def test_r6_5_an_ejected_replica_is_home_to_no_new_key():
    b = prefix_balancer(3)
    dead = b.endpoints("m")[0]
    b.eject(dead, 1.0)
    for key in keys(30):
        pick(b, key)
    assert dead.replica_id not in b.live_keys("m")
    assert sorted(b.live_keys("m").values()) == [15, 15]


def test_r6_5_two_router_instances_pick_the_same_replica():
    """Two routers get the endpoints in different orders (and other models beside). A new key goes
    by each router's own loads, so they may place it apart; once the homes one of them reported
    reach the other (R-6.5d), both send every key to the same replica, and spill it alike."""
    one, two = Balancer(), Balancer()
    members = endpoints(6)
    one.replace({"m": members}, {"m": PREFIX})
    two.replace({"m": list(reversed(members)), "n": endpoints(2, "n")}, {"m": PREFIX})
    for key in keys(300):
        one.release(one.acquire("m", 1.0, key=key))
        two.release(two.acquire("m", 1.0, key=key))
    two.set_homes(one.take_homes(limit=1000), 2.0)
    for key in keys(300):
        a, b = one.acquire("m", 3.0, key=key), two.acquire("m", 3.0, key=key)
        assert a.replica_id == b.replica_id
    for key in keys(300):  # every request held: the spills follow the ring from the same home
        a, b = one.acquire("m", 3.0, key=key), two.acquire("m", 3.0, key=key)
        assert a.replica_id == b.replica_id


def test_r6_5_ejected_and_tried_replicas_are_skipped():
    b = prefix_balancer(3)
    key = b"k"
    home = b.acquire("m", 1.0, key=key)
    b.release(home)
    b.eject(home, 1.0)
    second = b.acquire("m", 2.0, key=key)
    assert second is not home
    b.release(second)
    third = b.acquire("m", 2.0, [second], key=key)
    assert third not in (home, second)
    b.release(third)
    assert b.acquire("m", 2.0, [second, third], key=key) is None
    assert b.acquire("m", 2.0, [second, third], include_ejected=True, key=key) is home


def test_r6_5_least_outstanding_stays_the_default_and_ignores_keys():
    b = Balancer()
    b.replace({"m": endpoints(3)})
    assert b.policy("m") == LEAST_OUTSTANDING
    picked = []
    for _ in range(6):
        up = b.acquire("m", 1.0, key=b"same key")
        picked.append(up.replica_id)
        b.release(up)
    assert picked == ["r-0", "r-1", "r-2", "r-0", "r-1", "r-2"]


def test_r6_5_least_outstanding_counts_the_engine_queue():
    b = Balancer()
    b.replace({"m": endpoints(2)})
    first = b.acquire("m", 1.0)
    b.release(first)
    first.queued = 3
    assert all(b.acquire("m", 1.0) is not first for _ in range(3))


# -- the affinity key --------------------------------------------------------------------------

SYSTEM = {"role": "system", "content": "You are a tax assistant. " * 40}


def test_r6_5_turns_of_a_conversation_share_their_key():
    first = {"messages": [SYSTEM, {"role": "user", "content": "hello"}]}
    later = {"messages": [SYSTEM, {"role": "user", "content": "hello"},
                          {"role": "assistant", "content": "hi"}, {"role": "user", "content": "more"}]}
    other = {"messages": [SYSTEM, {"role": "user", "content": "another question"}]}
    assert affinity_key(first, {}, "key-1") == affinity_key(later, {}, "key-1")
    assert affinity_key(first, {}, "key-1") != affinity_key(other, {}, "key-1")


def test_r6_5_a_long_system_prompt_alone_is_the_key_of_every_conversation_that_shares_it():
    long_system = {"role": "system", "content": "You are a tax assistant. " * 41}  # 1,025 bytes
    one = {"messages": [long_system, {"role": "user", "content": "hello"}]}
    another = {"messages": [long_system, {"role": "user", "content": "another question"}]}
    assert affinity_key(one, {}, "key-1") == affinity_key(another, {}, "key-1")
    other_tenant = {"messages": [{"role": "system", "content": "You are a travel agent. " * 45},
                                 {"role": "user", "content": "hello"}]}
    assert affinity_key(one, {}, "key-1") != affinity_key(other_tenant, {}, "key-1")
    # Below the threshold (SYSTEM is 1,000 bytes) conversations keep keys of their own.
    short = [{"messages": [SYSTEM, {"role": "user", "content": text}]} for text in ("hello", "another question")]
    assert affinity_key(short[0], {}, "key-1") != affinity_key(short[1], {}, "key-1")


def test_r6_5_explicit_keys_win_in_their_order():
    body = {"messages": [{"role": "user", "content": "x"}], "user": "alice", "prompt_cache_key": "c1"}
    session = {"X-Session-ID": "s1"}
    assert affinity_key(body, session, "key-1") == affinity_key({"prompt_cache_key": "c1"}, {}, "key-1")
    without_cache_key = {k: v for k, v in body.items() if k != "prompt_cache_key"}
    assert affinity_key(without_cache_key, session, "key-1") == affinity_key({}, session, "key-1")
    assert affinity_key(without_cache_key, {}, "key-1") == affinity_key({"user": "alice"}, {}, "key-1")
    assert affinity_key({"user": "alice"}, {}, "key-1") != affinity_key({}, {"X-Session-ID": "alice"}, "key-1")


def test_r6_5_key_is_bounded_and_prompts_have_one():
    huge = {"messages": [{"role": "system", "content": "s" * 10**6}, {"role": "user", "content": "u" * 10**6}]}
    assert len(affinity_key(huge, {}, "key-1")) <= 2 * KEY_BYTES + 8
    assert affinity_key({"prompt": "p" * 10**5}, {}, "key-1") == affinity_key({"prompt": "p" * 10**5 + "tail"}, {}, "key-1")
    assert affinity_key({"prompt": ["first", "second"]}, {}, "key-1") == affinity_key({"prompt": "first"}, {}, "key-1")
    assert affinity_key({"prompt": [1, 2, 3]}, {}, "key-1") is not None
    assert affinity_key({"messages": [{"role": "assistant", "content": "x"}]}, {}, "key-1") is None
    assert affinity_key({"prompt_cache_key": 5, "messages": "bad"}, {}, "key-1") is None


def test_r6_5_the_load_bound_is_the_balancers_own():
    # What bench/routing_quality.py's diagnostic rows vary: the bound over the mean, per balancer.
    held = {}
    for bound in (PREFIX_BOUND, math.inf):
        b = Balancer(prefix_bound=bound)
        b.replace({"m": endpoints(2)}, {"m": PREFIX})
        ups = [b.acquire("m", 1.0, key=b"one tenant") for _ in range(8)]
        held[bound] = max(ups.count(up) for up in ups)
    assert held == {PREFIX_BOUND: 5, math.inf: 8}


def test_r6_5c_keys_a_client_chooses_are_taken_within_its_api_key():
    for chosen, headers in (({"prompt_cache_key": "shared"}, {}), ({}, {"X-Session-ID": "shared"}),
                            ({"user": "shared"}, {})):
        assert affinity_key(chosen, headers, "key-1") != affinity_key(chosen, headers, "key-2")
        assert affinity_key(chosen, headers, "key-1") == affinity_key(chosen, headers, "key-1")
    # a key taken from the content is the content's, whoever sends it: the engines cache it alike
    chat = {"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]}
    assert affinity_key(chat, {}, "key-1") == affinity_key(chat, {}, "key-2")


def test_r6_5b_an_api_key_homes_at_most_its_share_of_live_keys(monkeypatch):
    monkeypatch.setattr(balancer, "KEYS_PER_API_KEY", 4)
    b = Balancer()
    b.replace({"m": [Endpoint(r, "m", f"http://{r}", None) for r in ("a", "b", "c")]}, {"m": "prefix"})
    for n in range(10):
        key = b"churn %d" % n
        up = b.acquire("m", 1.0, key=key, owner="greedy")
        assert up is not None  # served all the same
        b.release(up)
        assert sum(b.live_keys("m").values()) == min(n, 4)  # this one not homed before the engine accepts
        b.keep_home("m", key, "greedy", 1.0)
    assert sum(b.live_keys("m").values()) == 4
    b.keep_home("m", b"mine", "polite", 1.0)
    assert sum(b.live_keys("m").values()) == 5


def test_r6_5d_two_routers_that_placed_a_key_apart_agree_once_fed_the_first_home():
    """Router B has seen other keys than router A, so it places a new key elsewhere; the home A
    reported (the control plane's) replaces B's, and B's next report names the adopted home."""
    a, b = prefix_balancer(2), prefix_balancer(2)
    for key in keys(5):  # B's own keys, 3 / 2: a sixth whose ring owner holds 3 goes to the other
        b.keep_home("m", key, "k", 1.0)
    ring = [up for up in b.endpoints("m")]
    crowded = max(ring, key=lambda up: b.live_keys("m").get(up.replica_id, 0))
    key = next(k for k in (f"new {i}".encode() for i in range(1000))
               if a._pools["m"].owner(ring_hash(k)).replica_id == crowded.replica_id)
    a.keep_home("m", key, "k", 1.0)
    b.keep_home("m", key, "k", 1.0)
    point = ring_hash(key)
    assert a.take_homes() == {"m": {point: crowded.replica_id}}  # A homed it on its ring owner
    b_own = b.take_homes()["m"][point]
    assert b_own != crowded.replica_id  # B, with the owner crowded, elsewhere
    b.set_homes({"m": {point: crowded.replica_id}}, 2.0)
    assert pick(b, key) == crowded.replica_id
    assert b.take_homes() == {"m": {point: crowded.replica_id}}  # its use reported with the adopted home
    counts = b.live_keys("m")
    assert sum(counts.values()) == 6 and counts[crowded.replica_id] == 4
    b.set_homes({"m": {point: None, ring_hash(b"unknown"): "not-a-member"}}, 3.0)  # changes nothing
    assert pick(b, key) == crowded.replica_id and sum(b.live_keys("m").values()) == 6


def test_r6_5d_a_report_names_at_most_its_share_of_homes_and_the_rest_next():
    b = prefix_balancer(2)
    for key in keys(10):
        b.keep_home("m", key, "k", 1.0)
    first = b.take_homes(limit=4)
    second = b.take_homes(limit=100)
    assert len(first["m"]) == 4 and len(second["m"]) == 6 and not set(first["m"]) & set(second["m"])
    assert b.take_homes() == {}


def loaded(waiting=0, kv=0.2, preemptions=0, hits=0, queries=0) -> EngineLoad:
    return EngineLoad("vllm", waiting=waiting, running=0, kv_cache=kv, preemptions=preemptions,
                      prefix_hits=hits, prefix_queries=queries)


def test_r6_5g_what_two_readings_say_of_an_engines_memory():
    up = balancer.Upstream(endpoints(1)[0])
    balancer.note_reading(up, loaded(preemptions=3, hits=100, queries=1000), loaded(preemptions=3, hits=2100, queries=5000))
    assert (up.preempting, up.hit_rate) == (False, 0.5)
    balancer.note_reading(up, loaded(preemptions=3, hits=0, queries=0), loaded(preemptions=4, hits=10, queries=100))
    assert (up.preempting, up.hit_rate) == (True, None)  # 100 tokens asked: too few to say
    balancer.note_reading(up, None, loaded(preemptions=9))
    assert (up.preempting, up.hit_rate) == (False, None)  # one reading says nothing of a change
    up.engine = None
    assert not balancer.is_pressed(up, 0.9)  # unknown is not short
    up.engine = loaded(kv=balancer.KV_FULL)
    assert balancer.is_pressed(up, None)
    up.engine, up.hit_rate = loaded(kv=0.1), 0.2
    assert balancer.is_pressed(up, 0.9) and not balancer.is_pressed(up, 0.3)


def test_r6_5g_a_pressed_replica_is_given_no_more_than_its_peers():
    """Its KV cache full, a home engine that queues nothing keeps its key only while it holds less
    than the others: no looser bound, not even the tight one beyond its peers' load."""
    key = b"tenant A"
    b = prefix_balancer(2)
    home = b.acquire("m", 1.0, key=key)
    b.release(home)
    other = next(up for up in b.endpoints("m") if up is not home)
    for up in (home, other):
        up.engine = loaded(kv=0.95 if up is home else 0.3)
    b.weigh_pressure()
    assert home.pressed and not other.pressed
    took = [b.acquire("m", 1.0, key=key) for _ in range(8)]
    assert [up is home for up in took] == [False, True] * 4  # turn about: never ahead of the other
    home.engine = loaded(kv=0.5)
    b.weigh_pressure()
    assert b.acquire("m", 1.0, key=key) is home  # memory back: its key's home again

    lo = Balancer()
    lo.replace({"m": endpoints(2)})
    first, second = lo.endpoints("m")
    first.engine, second.engine = loaded(kv=0.99), loaded(kv=0.1)
    lo.weigh_pressure()
    picks = [lo.acquire("m", 1.0).replica_id for _ in range(4)]
    assert picks == [second.replica_id, first.replica_id] * 2  # least-outstanding: ties to the unpressed


def test_r6_5g_a_new_key_is_homed_where_memory_is_not_short():
    b = prefix_balancer(2)
    first, second = b.endpoints("m")
    first.engine = loaded(preemptions=1)
    balancer.note_reading(first, loaded(preemptions=0), first.engine)
    b.weigh_pressure()
    assert first.pressed and not second.pressed
    key = next(k for k in keys(100) if b._pools["m"].owner(ring_hash(k)) is first)
    b.keep_home("m", key, "k", 1.0)
    assert b.live_keys("m") == {second.replica_id: 1}  # its ring owner is pressed, the other has room
    for key in keys(6):
        b.keep_home("m", key, "k", 1.0)
    counts = sorted(b.live_keys("m").values())
    assert counts[1] - counts[0] <= 1  # the key bound still spreads them


def test_r6_5c_prompts_sharing_a_prefix_shorter_than_two_kib_share_their_key():
    """vLLM's own bench (`prefix_repetition`) on a small vocabulary: 1,024 tokens of a prefix are
    about 1.9 KB of text. A key of the prompt's first 2 KiB took in each prompt's own suffix, so
    nearly every prompt had a key of its own and no prefix stayed on one engine."""
    rng = random.Random(7)
    words = ["".join(rng.choice("abcdefghij<>|") for _ in range(2)) for _ in range(512)]
    prefixes = ["".join(rng.choice(words) for _ in range(950)) for _ in range(4)]  # 1,900 bytes each
    prompts = [(p, p + "".join(rng.choice(words) for _ in range(64))) for p in prefixes for _ in range(5)]
    keys_of = {}
    for prefix, prompt in prompts:
        keys_of.setdefault(prefix, set()).add(affinity_key({"prompt": prompt}, {}, "key-1"))
    assert [len(k) for k in keys_of.values()] == [1, 1, 1, 1]
    assert len(set().union(*keys_of.values())) == 4
    assert affinity_key({"prompt": list(range(1000))}, {}, "k") == affinity_key({"prompt": list(range(300))}, {}, "k")


def test_r6_5b_requests_whose_keys_no_engine_holds_are_balanced_by_load():
    """vLLM's `prefix_repetition` bench through the router, with a key of its own per prompt (the
    2 KiB key) or vLLM's `random` dataset: every request's key is new. Placed on their ring owners,
    with engines that queue nothing taking up to twice the mean (all of it, with two), they piled
    on one engine — in the bench 68 % of the choices left one engine holding 6 or more of the 8
    requests in flight, and 8 / 0 was the commonest split but one — while the other idled. A key
    no engine caches costs its prefill wherever it goes: such requests are spread by load."""
    b = prefix_balancer(2)
    first, second = b.endpoints("m")
    for up in (first, second):
        up.engine = loaded(waiting=0, kv=0.1)  # both engines say nothing waits in them
    pool = b._pools["m"]
    fresh = [k for k in keys(200) if pool.owner(ring_hash(k)) is first][:8]  # all on one ring owner
    held = [b.acquire("m", 1.0, key=key, owner="k") for key in fresh]
    assert (first.outstanding, second.outstanding) == (4, 4), [up.replica_id for up in held]
    assert b.live_keys("m") == {}  # a key is homed only once its engine accepts the request
    for key, up in zip(fresh, held):
        b.keep_home("m", key, "k", 1.0, up)
    # Homed where each ran (its engine caches it now), within the key bound.
    assert b.live_keys("m") == {first.replica_id: 4, second.replica_id: 4}
    for key, up in zip(fresh, held):
        b.release(up)
        assert b.acquire("m", 1.0, key=key, owner="k") is up

