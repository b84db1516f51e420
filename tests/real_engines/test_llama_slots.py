"""A llama-server's slots are its replica's places in the router (R-6.17), on the real engine
launched by llmgw's built-in template (with `--metrics`) and `--parallel 3`: the router reads the
slot count beside the engine's /metrics and makes it the replica's places, while a profile's
`concurrency` still wins where it is set.
"""

from __future__ import annotations

import asyncio
import time

import pytest

from llmgw.catalog import Catalog
from llmgw.config import ProfileConfig
from llmgw.router import Endpoint
from llmgw.router.engineload import parse_metrics, parse_slots
from tests.integration.test_router_support import ENGINES, PROFILES, apoll, model, start_router  # noqa: F401
from tests.real_engines.engines import bin_dir, launch_engine, stop_engine
from tests.testbed import engines as real

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

SLOTS = 3


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    directory = bin_dir("llama-server")
    root = tmp_path_factory.mktemp("node") / "llmgw"
    root.mkdir()
    began = time.monotonic()
    engine = launch_engine(root, "llama-server", directory, str(real.models()["gguf"]),
                           args=["-c", "4096", "--parallel", str(SLOTS)])
    print(f"\nllama-server --parallel {SLOTS}: healthy in {time.monotonic() - began:.1f} s")
    yield engine
    stop_engine(engine, root)


async def _engine_page(llama, path: str) -> str:
    status, body = await asyncio.to_thread(llama.request, "GET", path, None, llama.key)
    assert status == 200, body[:200]
    return body.decode()


async def test_the_router_makes_a_llama_servers_slots_its_places(llama, start_router):  # noqa: F811
    profiles = {**PROFILES, "capped": ProfileConfig(engine="llama-server", concurrency=2)}
    catalog = Catalog.build(file_models=[model("tiny", profile="llama"), model("capped", profile="capped")],
                            profiles=profiles, engines=ENGINES)
    url = f"http://127.0.0.1:{llama.port}"
    running = await start_router(catalog, {"tiny": [Endpoint("r-tiny", "tiny", url, llama.key)],
                                           "capped": [Endpoint("r-capped", "capped", url, llama.key)]})
    fq = running.router.fairqueue
    await apoll(lambda: fq.models["tiny"].capacity == SLOTS, what="the engine's slot count read by the router")
    places = {name: (queue.capacity, queue.headroom) for name, queue in fq.models.items()}
    print("places (capacity, headroom) per model:", places)
    assert places == {"tiny": (SLOTS, 0), "capped": (2, 1)}  # the profile's concurrency wins over the slots
    assert running.router.engine_load("r-tiny").slots == SLOTS

    # What the router then does with its places (queues beyond them, gives them back) is the fair
    # queue's, tested with engine doubles (tests/integration/test_router_fairqueue.py): the tiny
    # model answers about 10,000 tokens a second, so no stream of it holds a slot long enough for
    # a test to see the engine full without a race.
    slots = parse_slots(await _engine_page(llama, "/slots"))
    load = parse_metrics(await _engine_page(llama, "/metrics"))
    assert (slots.slots, load.source) == (SLOTS, "llama-server")  # what the router read is the engine's own
