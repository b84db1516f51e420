"""The rollout decision as a table (R-4.13): surge, unavailable, paused, canary."""

from __future__ import annotations

import pytest

from llmgw.control.rollout import Member, Shape, Step, step

T = "new"


def members(spec: str) -> list[Member]:
    """`spec`: one letter per replica in age order — O/o an old one serving/starting, N/n a new one."""
    return [Member(f"{c}{i}", T if c in "Nn" else "old", c.isupper(), float(i)) for i, c in enumerate(spec)]


CASES = [
    # spec, count, shape, paused, promoted, expected (launch, retire, done)
    ("OOO", 3, Shape(), None, False, (1, (), False)),  # surge 1: one more first
    ("OOOn", 3, Shape(), None, False, (0, (), False)),  # waits for it to serve
    ("OOON", 3, Shape(), None, False, (1, ("O0",), False)),  # it serves: one old leaves, next one starts
    ("OONn", 3, Shape(), None, False, (0, (), False)),
    ("OONN", 3, Shape(), None, False, (1, ("O0",), False)),
    ("ONN", 3, Shape(), None, False, (1, (), False)),
    ("ONNN", 3, Shape(), None, False, (0, ("O0",), False)),
    ("NNN", 3, Shape(), None, False, (0, (), True)),
    ("OOO", 3, Shape(surge=2), None, False, (2, (), False)),
    ("OOO", 3, Shape(surge=0, unavailable=1), None, False, (1, ("O0",), False)),  # one missing at a time
    ("OOn", 3, Shape(surge=0, unavailable=1), None, False, (0, (), False)),
    ("OON", 3, Shape(surge=0, unavailable=1), None, False, (1, ("O0",), False)),
    ("OOO", 3, Shape(surge=1, unavailable=1), None, False, (2, ("O0",), False)),
    ("oOO", 3, Shape(), None, False, (2, ("o0",), False)),  # an old one not serving leaves at once
    ("OOO", 3, Shape(), "replica r9 of revision new failed: crash loop", False, (0, (), False)),
    ("OONn", 3, Shape(), "x", False, (0, (), False)),  # paused: nothing moves, the old ones serve
    ("OOO", 3, Shape(canary=25), None, False, (1, (), False)),  # canary: one new beside all the old
    ("OOON", 3, Shape(canary=25), None, False, (0, (), False)),  # ... and there it stops
    ("OOON", 3, Shape(canary=25), None, True, (1, ("O0",), False)),  # promoted: rolls on
    ("OOOON", 3, Shape(canary=25), None, False, (0, ("O0",), False)),  # scaled down: a surplus old one leaves
    ("OO", 0, Shape(), None, False, (0, ("O0", "O1"), False)),  # wants none (idle on demand)
    ("", 1, Shape(), None, False, (0, (), True)),
]


@pytest.mark.parametrize("spec,count,shape,paused,promoted,expected", CASES)
def test_r4_13_rollout_step(spec, count, shape, paused, promoted, expected):
    got = step(T, members(spec), count, shape, paused=paused, promoted=promoted)
    assert (got.launch, got.retire, got.done) == expected


def test_r4_13_serving_never_drops_below_count_minus_unavailable():
    # Run the decision as a loop in which every launched replica serves by the next pass.
    for shape in (Shape(), Shape(surge=2), Shape(surge=0, unavailable=1), Shape(surge=1, unavailable=2)):
        fleet = members("OOOO")
        count, passes = 4, 0
        while True:
            got = step(T, fleet, count, shape)
            if got.done:
                break
            fleet = [m for m in fleet if m.id not in got.retire]
            assert sum(m.serving for m in fleet) >= count - shape.unavailable
            fleet = [Member(m.id, m.revision, True, m.created_at) for m in fleet]
            fleet += [Member(f"N{passes}-{i}", T, False, 100.0 + passes) for i in range(got.launch)]
            assert len(fleet) <= count + shape.surge
            passes += 1
            assert passes < 20, "the rollout does not end"
        assert [m.revision for m in fleet] == [T] * count


def test_r4_13_why_a_rollout_waits():
    assert step(T, members("OOOn"), 3, Shape()).waiting == "waiting for 1 replica(s) of revision new to serve"
    assert step(T, members("OOO"), 3, Shape(), paused="health timeout").waiting == "paused: health timeout"
    assert "promote or undo" in step(T, members("OOON"), 3, Shape(canary=25)).waiting
    assert step(T, members("NN"), 2, Shape()) == Step(done=True)
