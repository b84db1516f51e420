# The node: every part together.


class Node(object):
    """The protocol's operations: the parts, each holding its own state, made once and joined by
    an explicit table, operations (name -> op_<name>(args, ctx) -> result dict, in the order
    unknown_op lists them); and the requests running, what cancel reaches."""

    def __init__(self, root, helper_path, sha256=None):
        self.root_dir = RootDir(root, helper_path, sha256)
        self.verified = VerifiedRecord(self.root_dir)
        self.jobs = Jobs()
        self.containers = Containers(self.root_dir)
        self.venvs = Venvs(self.root_dir, self.verified, self.jobs)
        self.inventory = Inventory(self.root_dir, self.venvs, self.containers)
        self.storage = Storage(self.verified)
        self.fetch = Fetches(self.root_dir, self.verified, self.jobs)
        self.engines = Engines(self.root_dir, self.verified, self.venvs, self.containers)
        self.reclaim = Reclaim(self.root_dir, self.fetch, self.venvs, self.containers)
        self.requests = {}
        self.requests_lock = threading.Lock()
        self.closing = threading.Event()
        self.operations = {
            "ping": self.op_ping,
            "inventory": self.inventory.op_inventory,
            "storage": self.storage.op_storage,
            "holdings": self.storage.op_holdings,
            "fetch": self.fetch.op_fetch,
            "source_size": self.fetch.op_source_size,
            "provision": self.engines.op_provision,
            "envs": self.engines.op_envs,
            "launch": self.engines.op_launch,
            "status": self.engines.op_status,
            "stop": self.engines.op_stop,
            "forget": self.engines.op_forget,
            "logs": self.engines.op_logs,
            "reclaim": self.reclaim.op_reclaim,
            "cancel": self.op_cancel,
            "fleet_secret": self.root_dir.op_fleet_secret,
        }

    def register(self, ctx):
        with self.requests_lock:
            self.requests[ctx.key] = ctx

    def unregister(self, ctx):
        with self.requests_lock:
            if self.requests.get(ctx.key) is ctx:
                del self.requests[ctx.key]

    def shutdown(self, wait=3.0):
        """Stop follows and downloads (their temp dirs are removed); engines stay up."""
        self.closing.set()
        with self.requests_lock:
            contexts = list(self.requests.values())
        for ctx in contexts:
            ctx.cancelled.set()
        self.jobs.abort_all(wait)

    # -- ping, cancel ----------------------------------------------------------------------

    def op_ping(self, args, ctx):
        return {"time": time.time()}

    def op_cancel(self, args, ctx):
        target = args.get("target")
        if isinstance(target, bool) or not isinstance(target, (int, str)):
            raise bad_args("argument 'target' must be the id (int or str) of a running request")
        with self.requests_lock:
            victim = self.requests.get((type(target).__name__, target))
        if victim is None or victim is ctx:
            return {"cancelled": False}
        victim.cancelled.set()
        return {"cancelled": True}
