"""Each engine's own load, polled about once a second off the request path (R-6.5, R-7.x).

The router polls every endpoint it routes to, over HTTP to the engine's port with the replica's
key as `Authorization: Bearer` (engine ports refuse anything else): the router already holds both
for the request path, it works the same for static endpoints with no control plane, and the
figure is at most a poll old where it is used. The engine kind is recognised from what answers:

- vLLM `/metrics`: `vllm:num_requests_waiting`, `vllm:num_requests_running`,
  `vllm:kv_cache_usage_perc` (`vllm:gpu_cache_usage_perc` before 0.9), prefix-cache counters,
  `vllm:num_preemptions_total`;
- llama-server `/metrics` (with `--metrics`, as llmgw's template starts it):
  `llamacpp:requests_deferred`, `llamacpp:requests_processing`, `llamacpp:kv_cache_usage_ratio`;
  without it, `/slots` gives the busy slots and no queue. Its slot count (`--parallel`, the
  requests it runs at once; the rest it defers) is on no metric: it is the length of `/slots`
  (on unless the engine runs with `--no-slots`, then a 501), else `total_slots` of `/props`
  (always served), read on every poll of a llama-server after its `/metrics`;
- SGLang `/metrics` (with `--enable-metrics`): `sglang:num_queue_reqs`, `sglang:num_running_reqs`,
  `sglang:token_usage`;
- and for a vLLM replica of a base whose LoRA adapters are loaded on demand (R-8.8), the adapters
  its `/v1/models` lists (entries with a `parent`), reported to the control plane with the load.

What the engine does not say stays None (unknown), never 0; an answer that does not parse, or no
answer, makes the whole reading unknown. The slot count is also kept on the endpoint
(`Upstream.slots`) while its engine does not answer, since it is fixed when the engine starts; a
reading that gives another count replaces it. The router makes it the replica's capacity
(llmgw.router.fairqueue.replica_places).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import math
import time
from collections.abc import Callable

import aiohttp

from llmgw.contracts.errors import Category, LlmgwError
from llmgw.contracts.feed import EngineLoad
from llmgw.router.balancer import ENGINE_HEADERS, note_reading
from llmgw.router.engine_figures import clamp

log = logging.getLogger(__name__)

POLL_SECONDS = 1.0
POLL_TIMEOUT = 1.0
MAX_METRICS_BYTES = 4 << 20  # a /metrics page bigger than this is not an engine's

# metric name -> (field, scale); samples of one name are summed over their labels
_METRICS = {
    "vllm:num_requests_waiting": ("waiting", 1),
    "vllm:num_requests_running": ("running", 1),
    "vllm:kv_cache_usage_perc": ("kv_cache", 1),
    "vllm:gpu_cache_usage_perc": ("kv_cache", 1),
    "vllm:prefix_cache_hits_total": ("prefix_hits", 1),
    "vllm:prefix_cache_queries_total": ("prefix_queries", 1),
    "vllm:num_preemptions_total": ("preemptions", 1),
    "llamacpp:requests_deferred": ("waiting", 1),
    "llamacpp:requests_processing": ("running", 1),
    "llamacpp:kv_cache_usage_ratio": ("kv_cache", 1),
    "sglang:num_queue_reqs": ("waiting", 1),
    "sglang:num_running_reqs": ("running", 1),
    "sglang:token_usage": ("kv_cache", 1),
}
_COUNTS = ("waiting", "running", "prefix_hits", "prefix_queries", "preemptions")
_SOURCES = {"vllm": "vllm", "llamacpp": "llama-server", "sglang": "sglang"}
# "\nvllm:" -> ("vllm", [(metric name, field), ...]): a page names one engine's metrics only
_BY_ENGINE = {f"\n{prefix}:": (source, [(name, spec[0]) for name, spec in _METRICS.items()
                                       if name.startswith(prefix + ":")])
              for prefix, source in _SOURCES.items()}
_AFTER_NAME = frozenset("{ \t\r\n")  # what may follow a metric's name on its sample line


class Malformed(LlmgwError, ValueError):
    """An engine's load reading that does not parse: the figure is unknown."""

    category = Category.UPSTREAM


def _sample(line: str) -> tuple[str, float]:
    """name and value of one exposition line: `name{labels} value [timestamp]`."""
    if "{" in line:
        name, _, rest = line.partition("{")
        labels, brace, rest = rest.rpartition("}")
        if not brace:
            raise Malformed(f"unclosed labels: {line[:80]!r}")
    else:
        name, _, rest = line.partition(" ")
    fields = rest.split()
    if not name or not fields:
        raise Malformed(f"no value: {line[:80]!r}")
    try:
        value = float(fields[0])
    except ValueError:
        raise Malformed(f"value is not a number: {line[:80]!r}") from None
    if math.isnan(value) or value < 0:
        raise Malformed(f"value is not a load: {line[:80]!r}")
    return name.strip(), value


def parse_metrics(text: str, at: float | None = None) -> EngineLoad | None:
    """The load in a Prometheus text page of vLLM, llama-server or SGLang; None when it names no
    metric of theirs. Raises Malformed when a line of one of their metrics does not parse.

    Runs on the router's event loop for every endpoint about once a second, on pages of about
    50 KB (vLLM), so it never splits the page into lines: it finds which engine wrote the page,
    then the first sample line of each metric it reads, and takes the lines that follow while
    they are samples of the same metric (the text format keeps a metric's samples together)."""
    page = text if text.startswith("\n") else "\n" + text
    for prefix, (source, names) in _BY_ENGINE.items():
        if page.find(prefix) >= 0:
            break
    else:
        return None
    found: dict[str, float] = {}
    size = len(page)
    for name, field in names:
        needle = "\n" + name
        length = len(name)
        at_line = page.find(needle)
        while at_line >= 0:
            begin = at_line + 1
            if begin + length < size and page[begin + length] not in _AFTER_NAME:
                at_line = page.find(needle, begin + length)  # a metric whose name begins with this one
                continue
            total = 0.0
            while True:
                end = page.find("\n", begin)
                if end < 0:
                    end = size
                total += _sample(page[begin:end].strip())[1]
                begin = end + 1
                if not page.startswith(name, begin) or begin + length >= size \
                        or page[begin + length] not in _AFTER_NAME:
                    break
            found[field] = found.get(field, 0.0) + total
            break
    if not found:
        return None
    # A count past MAX_COUNT (an engine's +Inf or 1e30 included) is clamped and logged.
    values = {field: (clamp(v, f"{source} {field}") if field in _COUNTS else v) for field, v in found.items()}
    if "kv_cache" in values:
        values["kv_cache"] = min(values["kv_cache"], 1.0)
    return EngineLoad(source=source, at=at, **values)


def parse_slots(text: str, at: float | None = None) -> EngineLoad:
    """llama-server's `/slots`: one entry per slot, so its length is the slot count; the busy
    slots are what it runs; its queue is not shown (None)."""
    try:
        slots = json.loads(text)
    except ValueError:
        raise Malformed("/slots is not JSON") from None
    if not isinstance(slots, list) or not all(isinstance(s, dict) for s in slots):
        raise Malformed("/slots is not a list of slots")
    if not slots:
        raise Malformed("/slots lists no slot")
    busy = 0
    for slot in slots:
        processing = slot.get("is_processing")
        if processing is None and "state" in slot:  # older builds: state 0 idle, 1 processing
            processing = slot["state"] != 0
        if not isinstance(processing, bool):
            raise Malformed("a slot does not say whether it is processing")
        busy += processing
    return EngineLoad(source="llama-server", running=busy, at=at, slots=len(slots))


def parse_adapters(text: str) -> tuple[str, ...]:
    """The LoRA adapters on vLLM's /v1/models: the entries with a `parent` (their base), by id."""
    try:
        listing = json.loads(text)
    except ValueError:
        raise Malformed("/v1/models is not JSON") from None
    data = listing.get("data") if isinstance(listing, dict) else None
    if not isinstance(data, list):
        raise Malformed("/v1/models has no data list")
    return tuple(sorted(entry["id"] for entry in data
                        if isinstance(entry, dict) and isinstance(entry.get("id"), str) and entry.get("parent")))


def parse_props(text: str) -> int:
    """llama-server's slot count from `/props` (`total_slots`), served with or without `/slots`."""
    try:
        props = json.loads(text)
    except ValueError:
        raise Malformed("/props is not JSON") from None
    total = props.get("total_slots") if isinstance(props, dict) else None
    if type(total) is not int or total < 1:
        raise Malformed("/props gives no slot count (total_slots)")
    return clamp(total, "llama-server total_slots")


def others(reading: EngineLoad | None, outstanding: int) -> int:
    """Requests the engine holds beyond llmgw's own in flight to it: its running and waiting
    requests as reported, less ours (which it counts too); 0 when it reports no queue."""
    if reading is None or reading.waiting is None:
        return 0
    return max(0, (reading.running or 0) + reading.waiting - outstanding)


class EnginePoller:
    """Reads every listed endpoint's engine load once a second and stores it on its Upstream;
    `on_slots` is called (on the loop) after a poll in which an endpoint's slot count changed."""

    def __init__(self, balancer, session: aiohttp.ClientSession, interval: float = POLL_SECONDS,
                 on_slots: Callable[[], None] | None = None):
        self.balancer = balancer
        self.session = session
        self.interval = interval
        self.on_slots = on_slots
        self._path: dict[str, str] = {}  # url -> the path that answered last time
        # url -> where a llama-server's slot count was read last ("/slots" or "/props"); None:
        # it refused both, so neither is asked again until the engine stops answering /metrics
        self._slots_from: dict[str, str | None] = {}

    async def run(self) -> None:
        while True:
            await self.poll_once()
            await asyncio.sleep(self.interval)

    async def poll_once(self) -> bool:
        """One reading of every endpoint; True when an endpoint's slot count changed."""
        ups = self.balancer.upstreams()
        asked = [up.outstanding for up in ups]
        readings = await asyncio.gather(*(self._read(up) for up in ups), return_exceptions=True)
        changed = False
        for up, reading, before in zip(ups, readings, asked, strict=True):
            if isinstance(reading, BaseException):
                reading = None
            note_reading(up, up.engine, reading)
            up.engine = reading
            # The engine counted ours at some moment during the poll: those in flight when it was
            # asked that have ended since, and those sent since; the larger count takes both out.
            up.queued = others(reading, max(before, up.outstanding))
            if reading is not None and reading.slots is not None and reading.slots != up.slots:
                up.slots = reading.slots
                changed = True
        self.balancer.weigh_pressure()
        if changed and self.on_slots is not None:
            self.on_slots()
        return changed

    async def _read(self, up) -> EngineLoad | None:
        url = up.endpoint.url
        headers = {**ENGINE_HEADERS, "Authorization": "Bearer " + up.endpoint.api_key} if up.endpoint.api_key \
            else ENGINE_HEADERS
        if self._path.get(url) != "/slots":
            reading = await self._parsed(up, "/metrics", headers, parse_metrics)
            if reading is not None:
                self._path[url] = "/metrics"
                if reading.source == "vllm" and up.model in self.balancer.loading_bases:
                    return await self._with_adapters(up, headers, reading)
                if reading.source != "llama-server":
                    return reading
                slots = await self._slot_count(up, headers)
                return reading if slots is None else dataclasses.replace(reading, slots=slots)
        self._slots_from.pop(url, None)
        reading = await self._parsed(up, "/slots", headers, parse_slots)
        if reading is None:  # neither page: a llama-server with --no-slots and no --metrics still has /props
            slots = await self._parsed(up, "/props", headers, lambda text, at: parse_props(text))
            if slots is not None:
                reading = EngineLoad(source="llama-server", at=time.time(), slots=slots)
        if reading is None:
            self._path.pop(url, None)
        else:
            self._path[url] = "/slots"
        return reading

    async def _with_adapters(self, up, headers: dict, reading: EngineLoad) -> EngineLoad:
        """The reading with the LoRA adapters the engine lists on /v1/models (R-8.8), for the
        control plane to check what it loaded against; as it was when the list is not read."""
        text = await self._page(up, "/v1/models", headers)
        if not isinstance(text, str):
            return reading
        try:
            adapters = parse_adapters(text)
        except Malformed as exc:
            log.debug("replica %s: adapters from /v1/models: %s", up.replica_id, exc)
            return reading
        return dataclasses.replace(reading, adapters=adapters)

    async def _slot_count(self, up, headers: dict) -> int | None:
        """A llama-server's slot count beside its /metrics: the length of /slots, else /props."""
        url = up.endpoint.url
        first = self._slots_from.get(url, "/slots")
        if first is None:
            return None
        refused = 0
        for path in (first, "/props" if first == "/slots" else "/slots"):
            text = await self._page(up, path, headers)
            if isinstance(text, int):
                refused += 1
                continue
            if text is None:
                continue
            try:
                slots = parse_slots(text).slots if path == "/slots" else parse_props(text)
            except Malformed as exc:
                log.debug("replica %s: slot count from %s: %s", up.replica_id, path, exc)
                continue
            self._slots_from[url] = path
            return slots
        if refused == 2:
            self._slots_from[url] = None
        return None

    async def _parsed(self, up, path: str, headers: dict, parse):
        """parse(text, at) of the page; None when it was refused, not answered or does not parse."""
        text = await self._page(up, path, headers)
        if not isinstance(text, str):
            return None
        try:
            return parse(text, time.time())
        except Malformed as exc:
            log.debug("replica %s: engine load from %s: %s", up.replica_id, path, exc)
            return None

    async def _page(self, up, path: str, headers: dict) -> str | int | None:
        """The page's text; its status when the engine refused it; None when it did not answer."""
        try:
            async with asyncio.timeout(POLL_TIMEOUT):
                async with self.session.get(up.endpoint.url + path, headers=headers) as resp:
                    if resp.status != 200:
                        return resp.status
                    body = await resp.content.read(MAX_METRICS_BYTES)
        except (aiohttp.ClientError, TimeoutError, OSError) as exc:
            log.debug("replica %s: engine load from %s: %s", up.replica_id, path, exc)
            return None
        return body.decode("utf-8", "replace")
