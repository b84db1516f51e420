"""Operator actions on the running control plane: catalog changes, node admin, reclaim, logs.

Every refusal is a `ServiceError` of a kind (`ErrorKind`: the caller's mistake, an unknown name,
a conflict with what runs now, a node that failed to answer) with a code and the problems found;
the admin API maps each kind to its HTTP status and the error to a response in one place
(llmgw/admin/app.py, R-8.2).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time
from collections.abc import AsyncIterator

from llmgw.catalog import Alias, Catalog, CatalogHolder, StoredModel
from llmgw.config import ConfigError, Document, Inventory, ModelConfig, load_inventory, parse_model_text
from llmgw.contracts.refusals import ErrorKind, ServiceError
from llmgw.contracts.states import AdminState
from llmgw.contracts.views import ControlView
from llmgw.control import installed, placement, rollouts
from llmgw.control.reconciler import Reconciler
from llmgw.control.reload import REMOVAL_GRACE, Diff, inventory_diff, kept_restart_settings
from llmgw.fleet.fleet import Fleet
from llmgw.fleet.link import READY
from llmgw.fleet.errors import NodeError
from llmgw.fleet.ops import LogsRequest, ReclaimRequest
from llmgw.store import Store, audit
from llmgw.weights import redact_weights

log = logging.getLogger(__name__)


def load_stored_aliases(store: Store) -> list[Alias]:
    rows = store.read_sync(lambda db: list(db["aliases"].rows_where(order_by="name")))
    return [Alias(r["name"], r["target"], "store", r["actor"]) for r in rows]


def _created_at(db, name: str) -> float | None:
    """When a stored model was first added (a replaced definition keeps its place in the order)."""
    row = next(db["models"].rows_where("name = ?", [name]), None)
    return row["created_at"] if row is not None else None


def load_stored_models(store: Store) -> list[StoredModel]:
    rows = store.read_sync(lambda db: list(db["models"].rows_where(order_by="created_at")))
    return [StoredModel(ModelConfig.model_validate(json.loads(r["definition"])), r["actor"]) for r in rows]


class ControlPlane:
    """The operator's handle on catalog, reconciler and fleet."""

    def __init__(self, inventory: Inventory, document: Document | None, holder: CatalogHolder, store: Store,
                 reconciler: Reconciler, fleet: Fleet, inventory_source: str = "the inventory file"):
        self.inventory = inventory
        self.document = document
        self.holder = holder
        self.store = store
        self.reconciler = reconciler
        self.fleet = fleet
        self.inventory_source = inventory_source
        self._lock = asyncio.Lock()
        self._reloading: tuple[str, float] | None = None  # (actor, since) while a reload runs
        # Called with the new inventory after each applied reload: whoever holds settings of their own.
        self.on_reload: list = []
        self._engines_answer: tuple[float, dict] | None = None  # (monotonic time, answer) of the last engines()

    # -- what the operator reads ---------------------------------------------------------------

    def view(self) -> ControlView:
        """The latest published view of the control plane (llmgw.control.publish)."""
        return self.reconciler.view.get()

    def publish_view(self) -> None:
        """Publish the view now, so that what an operator just changed shows at once in the admin,
        not at the next pass."""
        self.reconciler.publish_view()

    def explain(self, name: str) -> placement.Explanation:
        """Why the model goes where it goes, or nowhere, on the fleet as it is now (R-3.5)."""
        adapter = self.holder.current.adapters.get(name)
        if adapter is not None:  # nothing of its own is placed
            raise ServiceError(ErrorKind.INVALID, f"{name} is an adapter: it runs on the replicas of its base "
                                                  f"{adapter.base!r}; explain the placement of {adapter.base}",
                               code="adapter")
        if name not in self.holder.current.models:
            raise ServiceError(ErrorKind.NOT_FOUND, f"no model named {name!r}", code="model_not_found")
        return self.reconciler.placing.explain(name)

    # -- catalog changes (R-8.1–) ---------------------------------------------------------

    def _stored(self) -> list[StoredModel]:
        catalog = self.holder.current
        entries = [*catalog.models.values(), *catalog.adapters.values()]
        return [StoredModel(m.config, m.actor) for m in entries if m.declared_in == "store"]

    def _stored_aliases(self) -> list[Alias]:
        return [a for a in self.holder.current.aliases.values() if a.declared_in == "store"]

    def _build(self, stored: list[StoredModel], new: tuple[str, Document] | None = None,
               aliases: list[Alias] | None = None) -> Catalog:
        try:
            return Catalog.from_inventory(self.inventory, self.document, stored=stored,
                                          version=self.holder.current.version + 1,
                                          stored_aliases=self._stored_aliases() if aliases is None else aliases)
        except ConfigError as exc:
            problems = exc.problems
            if new is not None:
                # Problems of the model being added point into the file the caller sent.
                name, document = new
                problems = [document.problem(p.loc[1:], p.message) if p.loc[:1] == (name,) else p
                            for p in problems]
                exc = ConfigError(document.source, problems)
            raise ServiceError(ErrorKind.INVALID, exc.lines()[0], problems=exc.lines()) from None

    def _check_placeable(self, catalog: Catalog, name: str) -> None:
        """Refuse a model whose profile fits no node of the inventory, even an empty one (R-8.2)."""
        model = catalog.models.get(name)
        if model is None or model.static or model.profile is None:
            return
        # An idle fleet: every node ready and uncordoned, nothing allocated, and holdings unknown
        # (they were gathered for the previous catalog, so they say nothing about this model), as
        # are container programs and interpreters (a daemon started or a program installed mends
        # them, R-4.12). A node that has not reported its GPUs yet could hold any number: it is
        # not excluded.
        unknown_gpus = tuple(placement.GPUView(i, True) for i in range(model.profile.gpus))
        idle = dict(state=READY, state_reason=None, admin=AdminState.ACTIVE, holds=None, containers=None, venvs=None)
        views = [dataclasses.replace(v, **idle) if v.gpus is not None else
                 dataclasses.replace(v, **idle, gpus=unknown_gpus, gpu_class=v.gpu_class or model.profile.gpu_class)
                 for v in self.reconciler.nodes.views()]
        explanation = placement.explain_placement(model, views, {})
        if explanation.plan is None:
            raise ServiceError(ErrorKind.INVALID, f"model {name!r} cannot be placed on any node of the inventory, even an "
                                    f"idle one: {explanation.summary}", code="unplaceable")

    async def add_model(self, text: str, actor: str, source: str = "model file", replace: bool = False) -> dict:
        """Add a model from its YAML (R-8.2); with `replace`, a model added at runtime takes the new
        definition: what applies in place does at once, a new revision rolls (R-4.13)."""
        try:
            config, document = parse_model_text(text, source)
        except ConfigError as exc:
            raise ServiceError(ErrorKind.INVALID, exc.lines()[0] if exc.problems else str(exc), problems=exc.lines()) from None
        async with self._lock:
            current = self.holder.current
            existing = current.models.get(config.name) or current.adapters.get(config.name)
            if existing is not None and not (replace and existing.declared_in == "store"):
                where = (f"declared in {self.inventory_source}; edit it there" if existing.declared_in == "file"
                         else "already added at runtime; replace its definition with --replace, or remove it first")
                raise ServiceError(ErrorKind.INVALID, f"model {config.name!r} is {where}", code="name_collision")
            if existing is None and replace:
                raise ServiceError(ErrorKind.NOT_FOUND, f"no model named {config.name!r} to replace; add it without "
                                                        "--replace", code="model_not_found")
            others = [s for s in self._stored() if s.config.name != config.name]
            catalog = self._build([*others, StoredModel(config, actor)], new=(config.name, document))
            self._check_placeable(catalog, config.name)
            now = time.time()
            created = await self.store.read(lambda db: _created_at(db, config.name)) if replace else None
            row = {"name": config.name, "definition": config.model_dump_json(exclude_unset=True), "actor": actor,
                   "created_at": created or now, "updated_at": now}
            # The audit trail is a log: a signed URL's query stays in the definition only.
            detail = json.loads(row["definition"])
            for key in ("weights", "adapter"):
                if detail.get(key) is not None:
                    detail[key] = redact_weights(detail[key])
            await self.store.write(lambda db: (db["models"].upsert(row, pk="name"),
                                               audit(db, actor, "model.replace" if replace else "model.add",
                                                     config.name, detail)))
            self.holder.swap(catalog)
        self.publish_view()
        self.reconciler.wake()
        return self.model_summary(config.name)

    def _stored_model(self, name: str, action: str):
        model = self.holder.current.models.get(name) or self.holder.current.adapters.get(name)
        if model is None:
            raise ServiceError(ErrorKind.NOT_FOUND, f"no model named {name!r}", code="model_not_found")
        if model.declared_in == "file":
            raise ServiceError(ErrorKind.INVALID, f"{name} is declared in {self.inventory_source}; edit it there to {action} it "
                                    f"(the file is read on every start and would undo a runtime change)",
                               code="declared_in_file")
        return model

    async def remove_model(self, name: str, actor: str) -> dict:
        async with self._lock:
            current = self.holder.current
            if name not in current.models and name not in current.adapters and \
                    await self.store.read(lambda db: _created_at(db, name)) is not None:
                # Stored but not in force: an adapter whose base the inventory dropped (server.py).
                await self.store.write(lambda db: (db["models"].delete_where("name = ?", [name]),
                                                   audit(db, actor, "model.remove", name)))
                return {"removed": name}
            self._stored_model(name, "remove")
            held = sorted(a.name for a in self.holder.current.adapters.values() if a.base == name)
            if held:
                raise ServiceError(ErrorKind.INVALID, f"model {name!r} is the base of the adapters {', '.join(held)}; "
                                                      "remove them first", code="has_adapters")
            stored = [s for s in self._stored() if s.config.name != name]
            catalog = self._build(stored)
            await self.store.write(lambda db: (db["models"].delete_where("name = ?", [name]),
                                               audit(db, actor, "model.remove", name)))
            self.holder.swap(catalog)
        self.publish_view()
        self.reconciler.wake()
        return {"removed": name}

    async def scale(self, name: str, minimum: int, maximum: int | None, actor: str) -> dict:
        """Change only the scaling block; validate the whole new catalog before storing (R-8.4)."""
        if minimum < 0 or (maximum is not None and maximum < 0):
            raise ServiceError(ErrorKind.INVALID, "min and max must be 0 or more")
        async with self._lock:
            model = self._stored_model(name, "scale")
            if name in self.holder.current.adapters:
                raise ServiceError(ErrorKind.INVALID, f"{name} is an adapter: it runs on the replicas of its base "
                                                      f"{model.base!r}; scale that instead", code="adapter")
            if maximum is not None and maximum < minimum:
                raise ServiceError(ErrorKind.INVALID, f"max ({maximum}) must be >= min ({minimum}); "
                                        f"{name} keeps min {model.min_replicas}, max {model.max_replicas}")
            scaling = model.config.scaling.model_copy(update={"min": minimum, "max": maximum})
            try:
                config = ModelConfig.model_validate({**model.config.model_dump(exclude_unset=True),
                                                     "scaling": scaling.model_dump(exclude_unset=True) | {
                                                         "min": minimum, "max": maximum}})
            except Exception as exc:
                raise ServiceError(ErrorKind.INVALID, str(exc)) from None
            stored = [StoredModel(config, s.actor) if s.config.name == name else s for s in self._stored()]
            catalog = self._build(stored)
            definition = config.model_dump_json(exclude_unset=True)
            await self.store.write(lambda db: (
                db["models"].update(name, {"definition": definition, "updated_at": time.time()}),
                audit(db, actor, "model.scale", name, {"min": minimum, "max": maximum})))
            self.holder.swap(catalog)
        self.publish_view()
        self.reconciler.wake()
        return self.model_summary(name)

    def model_summary(self, name: str) -> dict:
        adapter = self.holder.current.adapters.get(name)
        if adapter is not None:
            return {"name": adapter.name, "declared_in": adapter.declared_in, "actor": adapter.actor,
                    "base": adapter.base, "adapter": str(adapter.source)}
        model = self.holder.current.models[name]
        return {"name": model.name, "declared_in": model.declared_in, "actor": model.actor,
                "profile": model.profile_name, "weights": str(model.source) if model.source else None,
                "scaling": {"min": model.min_replicas, "max": model.max_replicas,
                            "idle_timeout": model.idle_timeout, "on_demand": model.on_demand,
                            "scales": model.scales, "target": model.config.scaling.target},
                "fallback": model.fallback}

    # -- aliases (R-8.7) ------------------------------------------------------------------------

    def aliases(self) -> dict:
        catalog = self.holder.current
        return {"aliases": [{"name": a.name, "target": a.target, "declared_in": a.declared_in, "actor": a.actor}
                            for a in sorted(catalog.aliases.values(), key=lambda a: a.name)]}

    async def set_alias(self, name: str, target: str, actor: str) -> dict:
        """Point `name` at the model `target`, made or moved at runtime; checked as the catalog is."""
        async with self._lock:
            existing = self.holder.current.aliases.get(name)
            if existing is not None and existing.declared_in == "file":
                raise ServiceError(ErrorKind.INVALID, f"alias {name!r} is declared in {self.inventory_source}; "
                                                      "edit it there", code="declared_in_file")
            aliases = [a for a in self._stored_aliases() if a.name != name] + [Alias(name, target, "store", actor)]
            catalog = self._build(self._stored(), aliases=aliases)
            now = time.time()
            row = {"name": name, "target": target, "actor": actor, "created_at": now, "updated_at": now}
            await self.store.write(lambda db: (db["aliases"].upsert(row, pk="name"),
                                               audit(db, actor, "alias.set", name, {"target": target})))
            self.holder.swap(catalog)
        self.publish_view()
        return {"name": name, "target": target, "declared_in": "store", "actor": actor}

    async def remove_alias(self, name: str, actor: str) -> dict:
        async with self._lock:
            existing = self.holder.current.aliases.get(name)
            if existing is None:
                raise ServiceError(ErrorKind.NOT_FOUND, f"no alias named {name!r}", code="alias_not_found")
            if existing.declared_in == "file":
                raise ServiceError(ErrorKind.INVALID, f"alias {name!r} is declared in {self.inventory_source}; "
                                                      "edit it there", code="declared_in_file")
            catalog = self._build(self._stored(), aliases=[a for a in self._stored_aliases() if a.name != name])
            await self.store.write(lambda db: (db["aliases"].delete_where("name = ?", [name]),
                                               audit(db, actor, "alias.remove", name, {"target": existing.target})))
            self.holder.swap(catalog)
        self.publish_view()
        return {"removed": name}

    # -- rollouts (R-4.13) ----------------------------------------------------------------------

    def _llmgw_runs(self, name: str):
        model = self.holder.current.models.get(name)
        if model is None:
            raise ServiceError(ErrorKind.NOT_FOUND, f"no model named {name!r}", code="model_not_found")
        if model.static:
            raise ServiceError(ErrorKind.CONFLICT, f"{name} is served from fixed URLs: llmgw runs no replica "
                                                   "of it, so it has no revisions to roll")
        return model

    def rollout_status(self, name: str) -> dict:
        """The model's rollout: target, state, why it waits, replicas per revision."""
        model = self._llmgw_runs(name)
        memory = self.reconciler.memory
        status = rollouts.status(memory.rollouts, model, self.holder.current, memory.records.replicas.values())
        unplaceable = memory.placing.unplaceable.get(name)
        if unplaceable is not None and status["state"] in ("rolling", "canary"):  # waiting is never a refusal
            status["waiting"] = f"waiting for room for a replica of the new revision: {unplaceable.summary}"
        counters = self.reconciler.routers.counters
        if counters is not None:  # the answers of each revision's replicas, side by side
            records = memory.records
            replicas = [*records.replicas.values(), *(r for _, r in records.retired)]
            status["answers"] = rollouts.answers_by_revision(memory.rollouts, name, replicas, counters())
        return status

    async def rollout(self, name: str, action: str, actor: str, canary: int | None = None) -> dict:
        """Pause, resume, promote or undo the model's rollout; answers with its status."""
        async with self._lock:
            model = self._llmgw_runs(name)
            memory = self.reconciler.memory
            record = rollouts.act(memory.rollouts, model, self.holder.current, memory.records.replicas.values(),
                                  action, actor=actor, canary=canary)
            if action == "resume":  # the operator fixed what failed: the next launch need not wait
                health = memory.records.health.get(name)
                if health is not None:
                    health.next_attempt = 0.0
            detail = {"target": record.target, "previous": record.previous, "canary": canary}
            await self.store.write(lambda db: (rollouts.save_rollout(db, record),
                                               audit(db, actor, f"model.rollout.{action}", name, detail)))
        log.info("%s: rollout %s by %s (target revision %s)", name, action, actor, record.target)
        self.reconciler.wake()
        self.publish_view()
        return self.rollout_status(name)

    # -- reload (R-10.5) -----------------------------------------------------------------------

    async def reload(self, actor: str, *, dry_run: bool = False, grace: float = REMOVAL_GRACE,
                     force: bool = False) -> dict:
        """Re-read the inventory file `llmgw serve` was started with and apply what changed: the
        diff first (`llmgw.control.reload`), then nodes, settings and the catalog. A file that
        does not build (YAML, schema, catalog) is refused with its problems and changes nothing.
        A file that leaves a model's min with no node that could ever run it (one the running
        inventory could place, or a model it adds) is refused too, unless `force` (R-10.5).
        One reload at a time; `dry_run` says what would change and changes nothing."""
        path = self.document.source if self.document is not None else None
        if path is None:
            raise ServiceError(ErrorKind.CONFLICT, f"llmgw serve runs with {self.inventory_source} (started without -i): there is "
                                    "no inventory file to re-read; restart it with -i FILE to change its nodes or "
                                    "settings (models can be added with `llmgw ctl model add`)",
                               code="no_inventory_file")
        if self._reloading is not None:
            by, since = self._reloading
            raise ServiceError(ErrorKind.CONFLICT, f"a reload by {by} (started {time.strftime('%H:%M:%S', time.localtime(since))}) "
                                    "is being applied; try again when it has finished", code="reload_in_progress")
        self._reloading = (actor, time.time())
        try:
            try:
                new, document = await asyncio.to_thread(load_inventory, path)
            except ConfigError as exc:
                raise ServiceError(ErrorKind.INVALID, exc.lines()[0] if exc.problems else str(exc), problems=exc.lines(),
                                   code="bad_inventory") from None
            diff = inventory_diff(self.inventory, new, removal_grace=grace)
            new = kept_restart_settings(self.inventory, new)  # reported in the diff, applied by a restart
            # A file whose catalog does not build is refused, dry run or not.
            unplaceable = self._unplaceable_mins(self._reload_catalog(new, document), new)
            answer = {"source": path, "dry_run": dry_run, "applied": False, **diff.to_json(),
                      "unplaceable": unplaceable, "forced": force}
            lost = [entry for entry in unplaceable if entry["made_by_reload"]]
            if lost and not force:
                message = (f"{path}: {_unplaceable_words(lost)}; nothing changed. Fix the file, or apply it anyway "
                           "with `llmgw ctl reload --force`")
                if dry_run:
                    answer["refused"] = message
                    return answer
                raise ServiceError(ErrorKind.CONFLICT, message, code="min_unplaceable",
                                   problems=[f"{e['model']} (min {e['min']}): {e['reason']}" for e in lost])
            if dry_run:
                return answer
            async with self._lock:
                catalog = self._reload_catalog(new, document)  # the stored models as they are now
                await self._apply(new, document, diff, catalog, actor, grace)
            answer["applied"] = True
            detail = {"source": path, "changes": len(diff.lines), "nodes_added": list(diff.nodes_added),
                      "nodes_removed": list(diff.nodes_removed), "nodes_changed": list(diff.nodes_changed),
                      "gateway": list(diff.gateway_changed), "restart_needed": list(diff.restart_needed)}
            if unplaceable:
                detail["unplaceable"] = [e["model"] for e in unplaceable]
                detail["forced"] = force
                log.warning("reload: %s", _unplaceable_words(unplaceable))
            await self.store.write(lambda db: audit(db, actor, "reload", "inventory", detail))
        finally:
            self._reloading = None
        self.publish_view()
        self.reconciler.wake()
        return answer

    def _unplaceable_mins(self, catalog: Catalog, new: Inventory) -> list[dict]:
        """The models with a min that no node of `new` could ever run (`placement.never_fits`: room
        taken by replicas now, node state and cache space aside), each with why and whether the
        reload makes it so: the running inventory could place it, or the model is new (R-10.5)."""
        now_nodes = [self._ideal_view(node) for node in self.inventory.nodes]
        new_nodes = [self._ideal_view(node) for node in new.nodes]
        running = self.holder.current.models
        out = []
        for model in catalog.models.values():
            if model.min_replicas < 1 or model.static:
                continue
            reason = placement.never_fits(model, new_nodes)
            if reason is None:
                continue
            before = running.get(model.name)
            made = before is None or before.static or placement.never_fits(before, now_nodes) is None
            out.append({"model": model.name, "min": model.min_replicas, "reason": reason, "made_by_reload": made})
        return out

    def _ideal_view(self, node) -> placement.NodeView:
        """The node as `node` (its config) describes it, with the facts it last reported, if any."""
        if node.name in self.fleet.nodes:
            view = self.reconciler.nodes.view(node.name)
            facts = self.fleet.facts[node.name].inventory
            return dataclasses.replace(view, fabric=node.fabric, labels=node.labels,
                                       gpu_class=node.gpu_class or (facts.gpu_class if facts is not None else None))
        return placement.NodeView(name=node.name, fabric=node.fabric, labels=node.labels, gpu_class=node.gpu_class)

    def _reload_catalog(self, inventory: Inventory, document: Document) -> Catalog:
        """The catalog exactly as a start would build it: the file's models and the stored ones."""
        try:
            return Catalog.from_inventory(inventory, document, stored=self._stored(),
                                          version=self.holder.current.version + 1,
                                          stored_aliases=self._stored_aliases())
        except ConfigError as exc:
            raise ServiceError(ErrorKind.INVALID, exc.lines()[0], problems=exc.lines(), code="bad_inventory") from None

    async def _apply(self, new: Inventory, document: Document, diff: Diff, catalog: Catalog, actor: str,
                     grace: float) -> None:
        for line in diff.lines:  # what is about to change, before it does
            log.info("reload: %s %s %s: %s", line.section, line.name, line.change, line.effect)
        self.inventory, self.document = new, document
        self.fleet.set_inventory(new)
        for name in diff.nodes_removed:
            self.reconciler.remove_node(name, grace, actor)
        nodes = {n.name: n for n in new.nodes}
        for name in diff.nodes_added:
            node = nodes[name]
            if name in self.fleet.nodes:  # still being drained after an earlier reload removed it
                await self.fleet.update_node(node, reconnect=node != self.fleet.nodes[name])
            else:
                self.fleet.add_node(node)
            self.reconciler.add_node(name)
        for name in diff.nodes_changed:
            await self.fleet.update_node(nodes[name], reconnect=name in diff.nodes_reconnected)
        for name in diff.nodes_reconnected:
            if name not in diff.nodes_changed:
                await self.fleet.update_node(nodes[name], reconnect=True)
        self.reconciler.configure(new.gateway)
        if diff.catalog_changed:
            self.holder.swap(catalog)
        for callback in self.on_reload:
            callback(new)

    # -- nodes ---------------------------------------------------------------------------------

    def set_node(self, node: str, action: str, grace: float | None, actor: str) -> dict:
        states = {"cordon": AdminState.CORDONED, "uncordon": AdminState.ACTIVE, "drain": AdminState.DRAINING}
        if action not in states:
            raise ServiceError(ErrorKind.INVALID, f"unknown action {action!r}; use cordon, uncordon or drain")
        if node not in self.fleet.nodes:
            raise ServiceError(ErrorKind.NOT_FOUND, f"no node named {node!r}", code="node_not_found")
        if node in self.reconciler.memory.nodes.removing:
            raise ServiceError(ErrorKind.CONFLICT, f"{node} left {self.inventory_source} and is being drained before it is "
                                    "forgotten; put it back in the file and reload to keep it", code="node_removing")
        admin = self.reconciler.set_admin(node, states[action], grace if action == "drain" else None, actor)
        self.publish_view()
        return {"node": node, "admin": admin.state, "grace_until": admin.grace_until}

    # -- storage and reclaim (R-5.5) -----------------------------------------------------------

    async def reclaim(self, collect: bool, actor: str) -> dict:
        """List (or ask nodes to remove) cache entries the catalog no longer wants, and the
        engines llmgw installed that no profile wants (R-5.5, R-4.12)."""
        catalog = self.holder.current
        wanted = catalog.wanted_cache_names()
        nodes = []

        async def one(name: str) -> None:
            cache = self.fleet.paths(name).cache_dir
            entry = {"node": name, "cache_dir": cache, "entries": [], "error": None}
            nodes.append(entry)
            ops = self.fleet.ops(name)
            if cache is None:
                entry["error"] = "the node's cache directory is not known yet"
            else:
                try:
                    listing = await ops.reclaim(ReclaimRequest(cache))
                    memory = self.reconciler.memory  # what is in use, as the clean-up counts it
                    in_use = memory.records.cache_in_use(self.holder.current.models, name, memory.rollouts.cache_names)
                    unwanted = [e for e in listing.entries if e.name not in wanted and e.name not in in_use]
                    if collect and unwanted:
                        unwanted = list((await ops.reclaim(ReclaimRequest(cache, [e.name for e in unwanted],
                                                                          collect=True))).entries)
                    entry["entries"] = [{**dataclasses.asdict(e), "kind": "weights"} for e in unwanted]
                except NodeError as exc:
                    entry["error"] = str(exc)
            try:
                envs, images = installed.unwanted(await installed.listing(ops, catalog))
                if envs or images:
                    answer = await ops.reclaim(ReclaimRequest(None, envs=envs, images=images, collect=collect))
                    entry["entries"] += [{**dataclasses.asdict(e), "kind": "venv"} for e in answer.envs]
                    entry["entries"] += [{**dataclasses.asdict(e), "kind": "image"} for e in answer.images]
            except NodeError as exc:
                entry["error"] = "; ".join(filter(None, [entry["error"], f"engines: {exc}"]))

        await asyncio.gather(*(one(n) for n in self.fleet.ready_nodes()))
        asked = sum(1 for n in nodes for e in n["entries"] if collect)
        if collect:
            await self.store.write(lambda db: audit(db, actor, "reclaim", "fleet", {"asked": asked}))
        nodes.sort(key=lambda n: n["node"])
        return {"collect": collect, "nodes": nodes, "asked_to_remove": asked if collect else 0}

    # -- installed engines (R-4.12) ------------------------------------------------------------

    async def engines(self, max_age: float = 0.0) -> dict:
        """Per node, the environments and images llmgw installed, who wants and runs each. With
        max_age (the dashboard, which refreshes often), an answer that recent is given again
        rather than having every node walk its environments once more."""
        cached = self._engines_answer
        if max_age > 0 and cached is not None and time.monotonic() - cached[0] < max_age:
            return cached[1]
        catalog = self.holder.current
        nodes = []

        async def one(name: str) -> None:
            entry: dict = {"node": name, "engines": None, "error": None, "unknown": {}}
            nodes.append(entry)
            try:
                found = await installed.listing(self.fleet.ops(name), catalog)
            except NodeError as exc:
                entry["error"] = str(exc)
                return
            entry["engines"] = installed.rows(found)
            entry["unknown"] = dict(installed.errors(found))

        await asyncio.gather(*(one(n) for n in self.fleet.ready_nodes()))
        nodes.sort(key=lambda n: n["node"])
        answer = {"nodes": nodes, "as_of": time.time()}
        self._engines_answer = (time.monotonic(), answer)
        return answer

    # -- logs (R-4.8) --------------------------------------------------------------------------

    def _shard(self, replica_id: str, rank: int):
        records = self.reconciler.memory.records
        replica = records.replicas.get(replica_id)
        if replica is None:
            replica = next((r for _, r in reversed(records.retired) if r.id == replica_id), None)
        if replica is None:
            raise ServiceError(ErrorKind.NOT_FOUND, f"no replica named {replica_id!r}", code="replica_not_found")
        if not 0 <= rank < len(replica.shards):
            raise ServiceError(ErrorKind.INVALID, f"{replica_id} has shards 0-{len(replica.shards) - 1}")
        return replica, replica.shards[rank]

    async def logs(self, replica_id: str, rank: int = 0, lines: int = 100) -> list[str]:
        replica, shard = self._shard(replica_id, rank)
        try:
            result = await self.fleet.ops(shard.node).logs(LogsRequest(shard.id, lines))
        except NodeError as exc:
            if shard.log_tail:
                return list(shard.log_tail)
            raise ServiceError(ErrorKind.NODE_FAILED, f"could not read the log: {exc}", code="node_error") from None
        return replica.without_key(result.lines)

    async def follow_logs(self, replica_id: str, rank: int = 0, lines: int = 100) -> AsyncIterator[list[str]]:
        replica, shard = self._shard(replica_id, rank)
        try:
            stream = self.fleet.ops(shard.node).follow_logs(LogsRequest(shard.id, lines))
        except NodeError as exc:
            raise ServiceError(ErrorKind.NODE_FAILED, f"could not read the log: {exc}", code="node_error") from None
        async with stream:
            async for event in stream:
                yield replica.without_key(event.lines)


def _unplaceable_words(entries: list[dict]) -> str:
    """`no node of the new inventory could ever run qwen (min 1): no node fits: ...`."""
    return "no node of the new inventory could ever run " + "; ".join(
        f"{e['model']} (min {e['min']}): {e['reason']}" for e in entries)


_SIGNALLED: set[asyncio.Task] = set()


def reload_on_signal(control: ControlPlane | None) -> None:
    """SIGHUP: reload as `llmgw ctl reload` does, the diff logged, a refusal logged at error.
    `control` None: serve's start is not complete, and nothing is reloaded."""
    if control is None:
        log.error("SIGHUP: not reloading: llmgw serve is still starting; send it again once it serves")
        return

    async def run() -> None:
        try:
            answer = await control.reload("SIGHUP")
        except ServiceError as exc:
            for problem in exc.problems or [exc.message]:
                log.error("SIGHUP: reload refused, nothing changed: %s", problem)
            return
        except Exception:
            log.exception("SIGHUP: reload failed")
            return
        if not answer["changes"]:
            log.info("SIGHUP: reloaded %s: nothing changed", answer["source"])
        else:
            log.info("SIGHUP: reloaded %s: %d changes applied", answer["source"], len(answer["changes"]))

    task = asyncio.ensure_future(run())
    _SIGNALLED.add(task)
    task.add_done_callback(_SIGNALLED.discard)
