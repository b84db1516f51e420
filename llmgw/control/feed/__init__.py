"""The control plane's side of the router feed (R-10.1..R-10.4): `FeedPublisher`, and its parts.

The publisher holds what routing needs as one versioned `Snapshot`: the catalog's models (engine
kind, served name, routing policy, on-demand, fallback chain), the endpoint lists (those the
reconciler pushes and the static ones of the catalog, R-6.10), the keys in force (read off the
loop every couple of seconds, so `llmgw keys create/revoke` apply without a restart), the gateway
settings routers read and the secret that seals their Responses ids (R-6.14). Each decision after
that is one `Change` with only what changed, handed to every listener in order; a listener that
falls behind gets a fresh snapshot instead. Routers answer with `Report`s: counted once per
(router, seq) (usage, key use, the request log's records), their state read by the reconciler and the admin.

Each part is a module of its own, and `FeedPublisher` (publisher.py) only hands calls to them:

- changelog.py: `ChangeLog`, the sections, the versions and each Change to every `FeedListener`;
- reports.py: `ReportIntake`, reports taken in, counted once (`apply_counted`), refusals counted;
- routers.py: `RouterTable`, each router's latest state and the sums over those heard recently;
- keyrefresh.py: `KeyRefresh`, the keys in force read again every 2 s;
- leases.py: `split_leases`, the pure split of each limited key's budget among the routers (R-6.16),
  and `LeaseBook`, the demand it splits by;
- homes.py: `HomeTable`, the affinity homes every router uses (R-6.5d);
- requestlog.py: `RequestLogPruner`, the request log kept within gateway.request_log.keep (R-6.20);
- routing.py: the catalog and gateway settings as the feed's types (`static_endpoints`, ...);
- loop.py: `FeedLoop`, the event loop all of this runs on and the one crossing into it.
"""

from llmgw.control.feed.changelog import LISTENER_QUEUE, FeedListener
from llmgw.control.feed.leases import LEASE_FLOOR, LEASE_SECONDS, split_leases
from llmgw.control.feed.publisher import FeedPublisher
from llmgw.control.feed.reports import apply_counted
from llmgw.control.feed.routers import FORGET_SECONDS, STALE_SECONDS
from llmgw.control.feed.routing import gateway_settings, routed_models, static_endpoints

__all__ = ["FORGET_SECONDS", "LEASE_FLOOR", "LEASE_SECONDS", "LISTENER_QUEUE", "STALE_SECONDS", "FeedListener",
           "FeedPublisher", "apply_counted", "gateway_settings", "routed_models", "split_leases", "static_endpoints"]
