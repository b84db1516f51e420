"""The automatic clean-up of weights at a low-water mark per cache filesystem (R-5.5).

A node's cache filesystem is below its mark when its free bytes fall under the mark
(`gateway.cache_low_water`, or the node's own `cache_low_water`: a share of the filesystem's size
such as `10%`, or a size such as `50GB`). Then the control plane asks the node to remove the
least recently used cache entries that nothing keeps, until the filesystem is back at the mark:

- kept are the entries the catalog wants (`Catalog.wanted_cache_names`, the set reclaim uses),
  the pinned sources' (`gateway.pinned_weights`) and those a live replica on the node runs from;
- an entry's last use is its completion marker's mtime, which the helper sets when the fetch
  completes and again whenever it launches an engine on the entry: it lives with the entry, so
  it holds on a filer several nodes share and across restarts of the control plane (atime is
  not used: most filesystems are mounted noatime or relatime);
- the node removes them through `reclaim` with `until_free`: the same checks as `reclaim
  --collect` (cache name, no traversal, inside the cache after resolving links, never the cache
  itself, no link followed, the helper user's own entries, never a download in progress, a
  lease of another node included) plus a seal of this fleet, in the order given, and it stops
  as soon as its filesystem has the mark's bytes free;
- before any weights, the engines llmgw installed on the node that no profile of the catalog
  wants and no live shard runs (environments, images llmgw pulled: `llmgw.control.installed`,
  the set `reclaim` offers) are removed, wherever they lie on the node: nothing can use them
  again without a change of the inventory, as for weights no model wants (R-4.12).

`order` and `choose` are the pure choice; `Cleanup` is the trigger the reconciler calls once per
pass (looking at up to `CHECKS_PER_PASS` nodes in turn): at most one clean-up per node per
`CLEANUP_EVERY`, and none while a download writes into the node's cache unless that download is
what needs the room (its remaining bytes, known, leave the filesystem below the mark; a download
of unknown size is waited for). Every removal is logged and audited (actor `cleanup`), and the
recent ones are published for `ctl storage`.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from llmgw.config import GatewayConfig, LowWater, NodeConfig
from llmgw.control import installed
from llmgw.contracts.views import OFF, CacheCleanup, CacheRemoval
from llmgw.fleet.errors import NodeError
from llmgw.fleet.link import READY
from llmgw.fleet.ops import ReclaimRequest
from llmgw.store import audit
from llmgw.units import format_bytes
from llmgw.weights import CACHE_NAME, parse_weights

if TYPE_CHECKING:
    from llmgw.catalog import CatalogHolder
    from llmgw.control.actions import FetchJob
    from llmgw.control.state import Records
    from llmgw.fleet.fleet import Fleet
    from llmgw.store import Store

log = logging.getLogger(__name__)

ACTOR = "cleanup"
CLEANUP_EVERY = 60.0  # seconds: at most one clean-up per node in this time
CHECKS_PER_PASS = 100  # nodes looked at per pass, in turn: 2,000 nodes once a minute at a 3 s tick, about 1 ms a pass
RECENT_KEPT = 20  # removals kept per node for ctl storage


# -- configuration --------------------------------------------------------------------------------


def mark_of(gateway: GatewayConfig, node: NodeConfig) -> LowWater | None:
    """The node's low-water mark: its own, else the gateway's; None when the clean-up is off."""
    mark = node.cache_low_water if node.cache_low_water is not None else gateway.cache_low_water
    return None if mark is None or mark.off else mark


def pinned_names(gateway: GatewayConfig) -> frozenset[str]:
    """Cache names of the pinned sources: their entries are never removed automatically."""
    return frozenset(parse_weights(value).cache_name for value in gateway.pinned_weights)


# -- the choice (pure) ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Entry:
    """A cache entry as the node listed it."""

    name: str
    bytes: int | None
    last_used: float | None  # None: the node could not say
    problem: str | None = None  # why the node does not take it for a sealed entry (then never chosen)


def order(entries: Iterable[Entry], keep: frozenset[str] | set[str]) -> list[Entry]:
    """The entries the clean-up may remove, least recently used first: sound cache entries
    (a cache name, nothing wrong found by the node) that are not kept. An entry whose last use
    is unknown comes after every known one (unknown is not old), ties by name."""
    candidates = [e for e in entries if e.problem is None and CACHE_NAME.match(e.name) and e.name not in keep]
    return sorted(candidates, key=lambda e: (e.last_used is None, e.last_used or 0.0, e.name))


def choose(ordered: Iterable[Entry], free_bytes: int, threshold: int) -> list[Entry]:
    """The prefix of `ordered` whose removal brings the free bytes back to the threshold: what
    the node is expected to remove (it checks the free bytes itself after each removal). An
    entry of unknown size is taken but counts for nothing."""
    need = threshold - free_bytes
    chosen: list[Entry] = []
    for entry in ordered:
        if need <= 0:
            break
        chosen.append(entry)
        need -= entry.bytes or 0
    return chosen


def need_now(free_bytes: int, threshold: int, downloads: Iterable[tuple[int, int | None] | None]) -> bool | None:
    """Whether the filesystem needs a clean-up now: its free bytes, less what the downloads
    writing into it still have to write, are below the threshold. None when a download's
    remaining size is unknown (a download of unknown size is waited for)."""
    remaining = 0
    for progress in downloads:
        if progress is None or progress[1] is None:
            return None
        remaining += max(0, progress[1] - progress[0])
    return free_bytes - remaining < threshold


# -- the trigger ----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class CacheUse:
    """What the control plane uses of the nodes' caches, read each time the clean-up looks: the
    downloads writing into them, and the replica records (a live replica's entry is kept)."""

    fetches: Mapping[tuple[str, str], FetchJob]  # (node, cache name) -> the running download
    records: Records
    # (model, revision) -> the cache names that revision's weights and adapters are in: a replica
    # still running an earlier revision during a rollout keeps its entries. None:
    # the catalog's alone.
    revision_cache: Callable[[str, str | None], Iterable[str]] | None = None


class Cleanup:
    """Checks the ready nodes' cache filesystems against their marks, up to CHECKS_PER_PASS of them
    in turn on each pass (cheaply: the latest storage facts), and runs a clean-up as a task for one
    below its mark."""

    def __init__(self, fleet: Fleet, holder: CatalogHolder, gateway: GatewayConfig, store: Store | None,
                 use: CacheUse, wake: Callable[[], None]):
        self.fleet = fleet
        self.holder = holder
        self.store = store
        self.use = use
        self.wake = wake
        self._cursor = 0
        self.configure(gateway)
        self.tasks: dict[str, asyncio.Task] = {}
        self.last_run: dict[str, float] = {}
        self.last_result: dict[str, str] = {}
        self.waiting: dict[str, str] = {}  # node -> why a clean-up that is due waits
        self.removed: dict[str, deque[CacheRemoval]] = {}

    def configure(self, gateway: GatewayConfig) -> None:
        """The marks and pinned sources from the gateway's settings and the fleet's nodes as they are now."""
        self.marks = {name: mark_of(gateway, node) for name, node in self.fleet.nodes.items()}
        self.pinned = pinned_names(gateway)
        self._marked = [name for name, mark in self.marks.items() if mark is not None]
        self._cursor = self._cursor % len(self._marked) if self._marked else 0
        self.enabled = bool(self._marked)

    def check(self, now: float) -> None:
        """One call per reconcile pass; nothing at all when no node has a mark. Each pass looks
        at the next CHECKS_PER_PASS nodes with a mark, so a large fleet is gone through in turn
        (2,000 nodes every 20 passes) and a small one on every pass."""
        if not self.enabled:
            return
        count = min(CHECKS_PER_PASS, len(self._marked))
        start, self._cursor = self._cursor, (self._cursor + count) % len(self._marked)
        names = self._marked[start:start + count]
        if len(names) < count:
            names += self._marked[:count - len(names)]
        downloads: dict[str, list[FetchJob]] = {}
        for (node, _), job in self.use.fetches.items():
            downloads.setdefault(node, []).append(job)
        for name in names:
            mark = self.marks[name]
            link = self.fleet.links.get(name)
            if link is None or link.state != READY or name in self.tasks \
                    or now - self.last_run.get(name, -math.inf) < CLEANUP_EVERY:
                continue
            storage = self.fleet.facts[name].storage
            cache = self.fleet.paths(name).cache_dir
            fs = storage.filesystem_of(cache) if storage is not None else None
            if fs is None or fs.free_bytes is None:
                continue
            threshold = mark.threshold(fs.total_bytes)
            jobs = downloads.get(name, ())
            if threshold is None or (fs.free_bytes >= threshold and not jobs):
                self.waiting.pop(name, None)
                continue
            due = need_now(fs.free_bytes, threshold, [self._progress(job) for job in jobs])
            if due is None:
                self.waiting[name] = "waits for a download of unknown size to end"
                continue
            self.waiting.pop(name, None)
            if not due:
                continue
            self.last_run[name] = now
            self.tasks[name] = asyncio.create_task(self._run(name, cache, mark, threshold, fs.free_bytes),
                                                   name=f"cleanup-{name}")

    @staticmethod
    def _progress(job: FetchJob) -> tuple[int, int | None] | None:
        return next((s.progress for s in job.watchers if s.progress is not None), None)

    async def _run(self, node: str, cache: str, mark: LowWater, threshold: int, free_before: int) -> None:
        try:
            ops = self.fleet.ops(node)
            try:
                engines = await self._engines(node, ops, mark, threshold)
            except NodeError as exc:  # the weights' clean-up goes on without it
                log.warning("cleanup on %s: the installed engines could not be collected: %s", node, exc)
                engines = 0
            listing = await ops.reclaim(ReclaimRequest(cache))
            catalog = self.holder.current
            keep = catalog.wanted_cache_names() | self.pinned | self.use.records.cache_in_use(catalog.models, node, self.use.revision_cache)
            ordered = order((Entry(e.name, e.bytes, e.last_used, e.reason) for e in listing.entries), keep)
            if not ordered:
                first = f"removed {engines} unwanted engine{'s' if engines != 1 else ''}; " if engines else ""
                self._result(node, f"{first}below its mark ({_mark_words(mark, threshold)}), but every entry "
                                   "is wanted, pinned or in use")
                return
            answer = await ops.reclaim(ReclaimRequest(cache, [e.name for e in ordered], collect=True,
                                                      until_free=threshold))
            removed = [e for e in answer.entries if e.action == "removed"]
            at = time.time()
            freed = sum(e.bytes or 0 for e in removed)
            for entry in removed:
                log.info("cleanup on %s: removed %s (%s, last used %s) to bring %s back to its low-water mark %s",
                         node, entry.path or entry.name, format_bytes(entry.bytes),
                         time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(entry.last_used))
                         if entry.last_used is not None else "-", cache, mark)
                self.removed.setdefault(node, deque(maxlen=RECENT_KEPT)).appendleft(
                    CacheRemoval(name=entry.name, path=entry.path, bytes=entry.bytes, last_used=entry.last_used,
                                 removed_at=at, mark=str(mark), threshold_bytes=threshold))
            refused = [e for e in answer.entries if e.action == "refused"]
            for entry in refused:
                log.info("cleanup on %s: %s not removed: %s", node, entry.name, entry.reason)
            if self.store is not None and removed:
                rows = [{"name": e.name, "path": e.path, "bytes": e.bytes, "mark": str(mark),
                         "threshold_bytes": threshold, "free_before": free_before, "free_after": answer.free_bytes}
                        for e in removed]
                self.store.submit(lambda db: [audit(db, ACTOR, "cache.remove", node, row) for row in rows])
            after = f"{format_bytes(answer.free_bytes)} free, mark {_mark_words(mark, threshold)}"
            if removed:
                self._result(node, f"removed {_entries(len(removed))} ({format_bytes(freed)}); {after}")
            else:
                self._result(node, f"nothing could be removed ({len(refused)} refused); {after}")
        except NodeError as exc:
            log.warning("cleanup on %s failed: %s", node, exc)
            self._result(node, f"failed: {exc}")
        except Exception as exc:  # a bug must show, not stop the clean-up for good
            log.exception("cleanup on %s failed", node)
            self._result(node, f"failed: {exc}")
        finally:
            self.tasks.pop(node, None)
            self.wake()

    async def _engines(self, node: str, ops, mark: LowWater, threshold: int) -> int:
        """Remove the node's installed engines no profile wants and no shard runs; how many went."""
        envs, images = installed.unwanted(await installed.listing(ops, self.holder.current))
        if not envs and not images:
            return 0
        answer = await ops.reclaim(ReclaimRequest(None, envs=envs, images=images, collect=True))
        removed = [e for e in (*answer.envs, *answer.images) if e.action == "removed"]
        at = time.time()
        for entry in removed:
            log.info("cleanup on %s: removed the engine %s (%s), wanted by no profile, at its low-water mark %s",
                     node, entry.path or entry.name, format_bytes(entry.bytes), mark)
            self.removed.setdefault(node, deque(maxlen=RECENT_KEPT)).appendleft(
                CacheRemoval(name=entry.name, path=entry.path, bytes=entry.bytes, last_used=entry.last_used,
                             removed_at=at, mark=str(mark), threshold_bytes=threshold))
        if self.store is not None and removed:
            rows = [{"name": e.name, "path": e.path, "bytes": e.bytes, "mark": str(mark)} for e in removed]
            self.store.submit(lambda db: [audit(db, ACTOR, "engine.remove", node, row) for row in rows])
        return len(removed)

    def _result(self, node: str, text: str) -> None:
        self.last_result[node] = text

    def state(self, node: str, total_bytes: int | None) -> CacheCleanup:
        """What ctl storage shows of the node's clean-up."""
        mark = self.marks.get(node)
        if mark is None and node not in self.removed and node not in self.last_result:
            return OFF  # the common case without a mark: one shared value, nothing built
        return CacheCleanup(
            mark=str(mark) if mark is not None else None,
            threshold_bytes=mark.threshold(total_bytes) if mark is not None else None,
            last_run=self.last_run.get(node), last_result=self.last_result.get(node),
            waiting=self.waiting.get(node), removed=tuple(self.removed.get(node, ())))


def _mark_words(mark: LowWater, threshold: int) -> str:
    """`20.0 MB`, or `10% (4.2 GB)` for a share."""
    return str(mark) if mark.share is None else f"{mark} ({format_bytes(threshold)})"


def _entries(count: int) -> str:
    return f"{count} entry" if count == 1 else f"{count} entries"
