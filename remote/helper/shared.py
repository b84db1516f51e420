# What the parts of the node share: ROOT and its files, the record of verified files, the jobs.


class Context(object):
    """What an operation may do besides returning: stream events, notice a cancel."""

    def __init__(self, request_id=None, send=None):
        self.id = request_id
        self.key = (type(request_id).__name__, request_id)
        self.cancelled = threading.Event()
        self._send = send

    def emit(self, event, data):
        if self._send is not None:
            self._send({"id": self.id, "event": event, "data": data})


class RootDir(object):
    """ROOT and what the parts of the node keep in it: the shard files, the fleet secret,
    private directories; and the lock a launch and a reclaim of an engine's runtime share."""

    def __init__(self, root, helper_path, sha256=None):
        self.path = os.path.abspath(os.path.expanduser(root))
        self.helper_path = os.path.abspath(helper_path)
        self.sha256 = sha256
        # Held while a launch records its shard, and while reclaim finds an environment or an
        # image unused and removes it: no launch starts from what is being removed.
        self.launch_lock = threading.Lock()
        self.secret = self._stored_secret()

    def shards_dir(self):
        return os.path.join(self.path, "shards")

    # -- the fleet secret: seals cache entries (see cache_entry) ---------------------------

    def _stored_secret(self):
        """The fleet secret kept in ROOT, or None: only a regular file of this user's that
        nobody else can read counts."""
        try:
            fd = open_below(self.path, [FLEET_SECRET_FILE])
        except OSError:
            return None
        with os.fdopen(fd, "rb") as handle:
            info = os.fstat(handle.fileno())
            if not stat.S_ISREG(info.st_mode) or info.st_uid != os.getuid() or info.st_mode & 0o077:
                return None
            text = handle.read(256).decode("ascii", "replace").strip()
        return text if FLEET_SECRET_RE.fullmatch(text) else None

    def op_fleet_secret(self, args, ctx):
        if self.sha256 is None:
            raise bad_args("fleet_secret is only available through serve --expect-sha256")
        secret = _arg(args, "secret", (str,))
        if not FLEET_SECRET_RE.fullmatch(secret):
            # The value is never echoed, not even in a refusal.
            raise bad_args("secret must be 32 to 128 lowercase hex digits")
        if secret != self.secret:
            try:
                _write_private_file(os.path.join(self.path, FLEET_SECRET_FILE), secret + "\n")
            except OSError as exc:
                raise HelperError("permissions", "cannot keep the fleet secret in %s: %s" % (self.path, exc.strerror or exc))
            self.secret = secret
        return {"stored": True}

    # -- the shards' files -----------------------------------------------------------------

    def shard_dir(self, shard_id):
        return os.path.join(self.shards_dir(), shard_id)

    def read_state(self, shard_id):
        return _read_json(None, lambda: self.open_shard_file(shard_id, STATE_FILE))

    def all_states(self):
        """[(shard id, state)] of every shard with a readable state file, by shard id."""
        try:
            names = sorted(os.listdir(self.shards_dir()))
        except OSError:
            return []
        states = []
        for shard_id in names:
            state = self.read_state(shard_id)
            if state is not None:
                states.append((shard_id, state))
        return states

    def open_shard_file(self, shard_id, name, flags=_NOFOLLOW_READ):
        return open_below(self.path, ["shards", shard_id, name], flags)

    def shard_log_tail(self, shard_id, count):
        return tail_lines(None, count, opener=lambda: self.open_shard_file(shard_id, LOG_FILE))

    def private_dir(self, path):
        """Make path (0700) unless it exists; refuse one that is a link or open to others."""
        try:
            os.mkdir(path, 0o700)
        except FileExistsError:
            pass
        except OSError as exc:
            raise HelperError("permissions", "cannot make %s: %s" % (path, exc.strerror or exc))
        problem = private_dir_problem(path, os.getuid())
        if problem is not None:
            raise HelperError("permissions", problem)


class VerifiedRecord(object):
    """The node-local record of the big files of cache entries this node hashed and found as
    sealed (ROOT/verified-<hostname>.json): what a launch and a fetch need not read again."""

    def __init__(self, root_dir):
        self.root_dir = root_dir
        self.lock = threading.Lock()
        self.last_read = (None, {})  # (the record file's stamp, its files) as last read
        self.files_hashed = 0  # files of cache entries read to check them at launch

    def entry_bytes(self, path):
        """weights_bytes with this node's fleet secret."""
        return weights_bytes(path, self.root_dir.secret)

    def _verified_file(self):
        # In ROOT, never on the cache's filer; named by host in case ROOT is a shared home.
        return "verified-%s.json" % re.sub(r"[^A-Za-z0-9._-]", "_", socket.gethostname())

    def _load_verified(self):
        """{file path: file_stamp + [sha256]} this node hashed and found as sealed; {} when none.
        Read again only when the record file's stamp changed (an environment's record holds tens
        of thousands of files); never change what this returns."""
        try:
            fd = open_below(self.root_dir.path, [self._verified_file()])
        except OSError:
            return {}
        with os.fdopen(fd, "rb") as handle:
            stamp = file_stamp(os.fstat(handle.fileno()))
            known, files = self.last_read
            if known == stamp:
                return files
            try:
                record = json.loads(handle.read().decode("utf-8"))
            except ValueError:
                record = None
        files = record.get("files") if isinstance(record, dict) else None
        files = files if isinstance(files, dict) else {}
        self.last_read = (stamp, files)
        return files

    def _merge_verified(self, changes, dropped=()):
        if not changes and not dropped:
            return
        with self.lock:
            files = dict(self._load_verified())
            for path in dropped:
                files.pop(path, None)
            files.update(changes)
            if len(files) > VERIFIED_RECORD_MAX:  # the first recorded go first: dicts keep their order
                files = dict(list(files.items())[-VERIFIED_RECORD_MAX:])
            try:
                _write_json_atomic(os.path.join(self.root_dir.path, self._verified_file()), {"files": files})
            except OSError:
                pass  # only a cache of work done: the next launch hashes again

    def note_verified(self, path, files, hashes, always=always_verified):
        """Record the big files of the entry at path as verified with hashes (a fetch hashed
        them while writing them)."""
        changes = {}
        for relative, size in files:
            if always(relative, size):
                continue
            full = os.path.join(path, relative)
            try:
                info = os.lstat(full)
            except OSError:
                continue
            if stat.S_ISREG(info.st_mode):
                changes[full] = file_stamp(info) + [hashes[relative]]
        self._merge_verified(changes)

    def verify_weights(self, argv):
        """Refuse (weights_integrity) a launch whose argv names a cache entry that is not sealed
        by this fleet, or whose files do not have the SHA-256 the seal covers (R-5.6). Small files
        and code are hashed every time, big ones when they changed since this node last did.
        Nothing is removed: a rewritten or planted entry is refused, never trusted."""
        for path in entries_named(argv):
            entry, problem = sealed_entry(path, self.root_dir.secret)
            if problem is not None:
                raise HelperError("weights_integrity", "%s is not a sealed cache entry of this fleet (%s); the engine "
                                                       "was not started" % (path, problem))
            problem = self.verify_entry(path, entry)
            if problem is not None:
                raise HelperError("weights_integrity", problem + "; the engine was not started")

    def verify_entry(self, path, entry, on_bytes=None, always=always_verified):
        """verify_entry_content against this node's record, which it then updates; the problem
        or None."""
        before = self._load_verified()
        verified = dict(before)
        problem, hashed = verify_entry_content(path, entry, verified, on_bytes, always)
        self.files_hashed += len(hashed)
        changes = dict((key, value) for key, value in verified.items() if before.get(key) != value)
        self._merge_verified(changes, dropped=[key for key in before if key not in verified])
        return problem

    def holding(self, path):
        """{"bytes"} of the weights at path, and for a cache entry "file" and "verified" (its big
        files are as this node last hashed them: a launch need not read them); None when none."""
        if not os.path.basename(os.path.normpath(path)).startswith("llmgw-"):
            size = self.entry_bytes(path)
            return None if size is None else {"bytes": size}
        entry, _ = sealed_entry(path, self.root_dir.secret)
        if entry is None:
            return None
        return {"bytes": entry["bytes"], "file": entry_file(path),
                "verified": verified_here(path, entry, self._load_verified())}


class Jobs(object):
    """The downloads and environment builds not yet ended, abandoned ones included (what
    shutdown aborts). Each is single-flight: a request for what a job is making attaches to it;
    the tables of the jobs to attach to are the parts' own (the fetches, the provisions)."""

    def __init__(self):
        self.lock = threading.Lock()  # guards running and the parts' tables
        self.running = set()

    def attach_or_start(self, table, key, ctx, make):
        """(job, started): the job of table[key] with ctx attached, a new one from make() when
        there is none or it has ended; the caller starts a new one's thread."""
        with self.lock:
            job = table.get(key)
            start = job is None or not job.attach(ctx.key, ctx.emit)
            if start:
                job = make()
                table[key] = job
                self.running.add(job)
                job.attach(ctx.key, ctx.emit)
        return job, start

    def ended(self, table, job):
        with self.lock:
            if table.get(job.key) is job:
                del table[job.key]
            self.running.discard(job)

    def writing_into(self, cache_dir):
        """The downloads running into cache_dir."""
        with self.lock:
            return [job for job in self.running if job.cache_dir == cache_dir]

    def abort_all(self, wait):
        """Abort every job, then wait for their threads until wait has passed in all."""
        with self.lock:
            jobs = list(self.running)
        for job in jobs:
            job.abort.set()
        deadline = time.monotonic() + wait
        for job in jobs:
            if job.thread is not None:
                job.thread.join(max(0.0, deadline - time.monotonic()))
