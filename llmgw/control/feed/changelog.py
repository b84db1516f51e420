"""The feed's change log (R-10.1): what routing needs now, as one versioned Snapshot, and a Change
per decision, handed to every listener in order.

Its sections are the catalog's models, the endpoint lists (those the reconciler pushes and the
catalog's static ones, R-6.10), the keys in force, the gateway settings, the leases, the affinity
homes and the replicas given up. Each decision that changes one is a `Change` with only what
changed, version + 1; nothing is published before `publish_first` makes version 1, which holds
everything set until then. A listener more than LISTENER_QUEUE changes behind gets a fresh snapshot
instead of the backlog. All of it runs on the feed's event loop (see `loop.FeedLoop`).
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Mapping
from types import MappingProxyType

from llmgw.contracts.endpoints import Endpoint
from llmgw.contracts.feed import Change, GatewaySettings, KeyEntry, Lease, RoutedModel, Snapshot

LISTENER_QUEUE = 1000  # changes a listener may fall behind by before it gets a snapshot instead


class FeedListener:
    """One subscriber: `async for message in listener` yields the current Snapshot, then each Change.

    A listener more than LISTENER_QUEUE changes behind drops them and gets a fresh snapshot next."""

    def __init__(self, changes: ChangeLog, limit: int = LISTENER_QUEUE):
        self._changes = changes
        self._limit = limit
        self._queue: deque[Change] = deque()
        self._resync = True  # the next message is the whole snapshot
        self._wake = asyncio.Event()
        self._closed = False
        self.resyncs = 0  # snapshots sent because the listener fell behind

    def _push(self, change: Change) -> None:
        if self._resync:
            return  # the snapshot it will get holds this change
        if len(self._queue) >= self._limit:
            self._queue.clear()
            self._resync = True
            self.resyncs += 1
        else:
            self._queue.append(change)
        self._wake.set()

    def _notify(self) -> None:
        self._wake.set()

    def next_nowait(self) -> Snapshot | Change | None:
        """The next message if one is ready, else None (callers that cannot await)."""
        if self._closed:
            return None
        if self._resync:
            current = self._changes.current()
            if current is None:
                return None
            self._resync = False
            self._queue.clear()
            return current
        return self._queue.popleft() if self._queue else None

    def __aiter__(self) -> FeedListener:
        return self

    async def __anext__(self) -> Snapshot | Change:
        while True:
            if self._closed:
                raise StopAsyncIteration
            message = self.next_nowait()
            if message is not None:
                return message
            self._wake.clear()
            await self._wake.wait()

    def close(self) -> None:
        self._closed = True
        self._wake.set()
        self._changes.listeners.discard(self)


class ChangeLog:
    """The versioned snapshot, its sections, and the listeners each Change goes to."""

    def __init__(self, epoch: str, *, models: Mapping[str, RoutedModel], static: dict[str, tuple[Endpoint, ...]],
                 keys: tuple[KeyEntry, ...], gateway: GatewaySettings, response_secret: str):
        self.epoch = epoch  # this run of the control plane: a router seeing another takes the snapshot again
        self._response_secret = response_secret
        self._models = models
        self._static = static
        self._pushed: dict[str, tuple[Endpoint, ...]] = {}
        self._keys = keys
        self._gateway = gateway
        self._snapshot: Snapshot | None = None
        self._ready = asyncio.Event()
        self.listeners: set[FeedListener] = set()
        # replica id -> the version whose change took its last endpoint away (RouterTable.outstanding)
        self._removed_at: dict[str, int] = {}
        self._closed = False

    @property
    def keys(self) -> tuple[KeyEntry, ...]:
        return self._keys

    def current(self) -> Snapshot | None:
        return self._snapshot

    async def ready(self) -> None:
        await self._ready.wait()

    def publish_first(self, homes: Mapping[str, Mapping[int, str]]) -> bool:
        """Make version 1 of what was set so far, and the homes reported so far; False when it was made before."""
        if self._snapshot is not None:
            return False
        self._snapshot = Snapshot(epoch=self.epoch, version=1, models=self._models,
                                  endpoints=MappingProxyType(self.endpoints()), keys=self._keys, gateway=self._gateway,
                                  homes=MappingProxyType(dict(homes)), response_secret=self._response_secret)
        self._ready.set()
        for listener in list(self.listeners):
            listener._notify()
        return True

    def listen(self) -> FeedListener:
        listener = FeedListener(self)
        if self._closed:
            listener._closed = True
        else:
            self.listeners.add(listener)
        return listener

    def close(self) -> None:
        """End every listener; one made later is closed from the start."""
        self._closed = True
        for listener in list(self.listeners):
            listener.close()

    # -- the sections --------------------------------------------------------------------------

    def endpoints(self) -> dict[str, tuple[Endpoint, ...]]:
        """model -> its endpoint list: the pushed ones, and the static ones over them."""
        return {**self._pushed, **self._static}

    def set_pushed(self, pushed: dict[str, tuple[Endpoint, ...]]) -> None:
        """Replace every pushed endpoint list (static ones stay, R-6.10): a Change with only the
        models whose lists changed, or nothing when none did."""
        before = self.endpoints()
        self._pushed = pushed
        self.emit(endpoints=_diff(before, self.endpoints()))

    def set_gateway(self, settings: GatewaySettings) -> None:
        if settings != self._gateway:
            self._gateway = settings
            self.emit(gateway=settings)

    def swap_catalog(self, models: Mapping[str, RoutedModel], static: dict[str, tuple[Endpoint, ...]]) -> None:
        """A new catalog: a Change with its models when they differ, and the static lists that changed."""
        before = self.endpoints()
        self._static = static
        changed_models = None
        if dict(models) != dict(self._models):
            self._models = changed_models = models
        self.emit(models=changed_models, endpoints=_diff(before, self.endpoints()))

    def set_keys(self, keys: tuple[KeyEntry, ...]) -> None:
        """These are the keys in force now: a Change with `keys` when they differ from the last."""
        if keys != self._keys:
            self._keys = keys
            self.emit(keys=keys)

    def abandon(self, replica_id: str) -> None:
        """Routers stop waiting on a replica the control plane gave up: a Change with `abandon`."""
        self.emit(abandon=(replica_id,))

    def emit(self, *, models: Mapping[str, RoutedModel] | None = None,
             endpoints: dict[str, tuple[Endpoint, ...] | None] | None = None, keys: tuple[KeyEntry, ...] | None = None,
             gateway: GatewaySettings | None = None, abandon: tuple[str, ...] = (),
             leases: Mapping[str, Mapping[str, Lease]] | None = None,
             homes: Mapping[str, Mapping[int, str | None]] | None = None) -> None:
        """One Change with what is not None (or nothing when all is); before version 1, nothing:
        the sections are remembered and version 1 holds them."""
        if not endpoints:
            endpoints = None
        if models is None and endpoints is None and keys is None and gateway is None and not abandon \
                and leases is None and not homes:
            return
        snapshot = self._snapshot
        if snapshot is None:
            return
        change = Change(epoch=self.epoch, version=snapshot.version + 1, models=models,
                        endpoints=None if endpoints is None else MappingProxyType(endpoints),
                        keys=keys, gateway=gateway, abandon=tuple(abandon), leases=leases,
                        homes=MappingProxyType(homes) if homes else None)
        new = snapshot.apply(change)
        if endpoints is not None:
            self._note_removed(snapshot, new)
        self._snapshot = new
        for listener in list(self.listeners):
            listener._push(change)

    # -- replicas taken away ---------------------------------------------------------------------

    def removed_in(self, replica_id: str) -> int | None:
        """The version whose change took the replica's last endpoint away; None: it has one, or every router saw it go."""
        return self._removed_at.get(replica_id)

    def seen_gone(self, replica_id: str) -> None:
        """Every router has seen the replica go and has nothing left on it: forget when it went."""
        self._removed_at.pop(replica_id, None)

    def _note_removed(self, old: Snapshot, new: Snapshot) -> None:
        had = {e.replica_id for members in old.endpoints.values() for e in members}
        has = {e.replica_id for members in new.endpoints.values() for e in members}
        for replica_id in had - has:
            self._removed_at[replica_id] = new.version
        for replica_id in has:
            self._removed_at.pop(replica_id, None)


def _diff(before: Mapping[str, tuple[Endpoint, ...]],
          after: Mapping[str, tuple[Endpoint, ...]]) -> dict[str, tuple[Endpoint, ...] | None]:
    """The lists that changed: the new list, or None for a model that has none any more."""
    out: dict[str, tuple[Endpoint, ...] | None] = {}
    for model in before.keys() | after.keys():
        old, new = before.get(model), after.get(model)
        if old != new:
            out[model] = new
    return out
