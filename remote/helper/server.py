# serve: the JSON-lines loop


class Workers(object):
    """Threads reused from one request to the next: starting a thread per request was most of a
    quick request's cost. A request never waits for another: with no idle worker, one starts."""

    IDLE_EXIT = 60.0  # an idle worker ends after this long

    def __init__(self):
        self.queue = queue.Queue()
        self.lock = threading.Condition()
        self.idle = 0  # workers waiting for work and not yet promised to a submitted item
        self.busy = 0  # items submitted and not finished

    def submit(self, fn, *args):
        with self.lock:
            self.busy += 1
            spawn = self.idle == 0
            if not spawn:
                self.idle -= 1  # this item is promised to one of the waiting workers
        self.queue.put((fn, args))
        if spawn:
            threading.Thread(target=self._work, name="llmgw-worker", daemon=True).start()

    def _work(self):
        while True:
            try:
                fn, args = self.queue.get(timeout=self.IDLE_EXIT)
            except queue.Empty:
                with self.lock:
                    if self.idle > 0:  # not promised to anything: leave
                        self.idle -= 1
                        return
                continue
            try:
                fn(*args)
            finally:
                with self.lock:
                    self.busy -= 1
                    self.idle += 1
                    self.lock.notify_all()

    def drain(self, timeout):
        """Wait up to `timeout` seconds for every submitted item to finish."""
        deadline = time.monotonic() + timeout
        with self.lock:
            while self.busy:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                self.lock.wait(remaining)
        return True


class Server(object):
    """Reads requests from infile, answers on outfile; see the module docstring."""

    INLINE_OPS = ("ping", "cancel")

    def __init__(self, node, infile, outfile, drain_timeout=5.0):
        self.node = node
        self.infile = infile
        self.outfile = outfile
        self.drain_timeout = drain_timeout
        self.write_lock = threading.Lock()
        self.broken = False
        self.workers = Workers()

    def send(self, obj):
        line = (json.dumps(obj, separators=(",", ":")) + "\n").encode("utf-8")
        with self.write_lock:
            if self.broken:
                return
            try:
                self.outfile.write(line)
                self.outfile.flush()
            except (OSError, ValueError):
                self.broken = True

    def hello(self):
        return {
            "hello": {
                "protocol": PROTOCOL_VERSION,
                "version": HELPER_VERSION,
                "sha256": self.node.root_dir.sha256,
                "python": platform.python_version(),
                "hostname": socket.gethostname(),
                "boot_id": read_boot_id(),
                "pid": os.getpid(),
                "root": self.node.root_dir.path,
                "home": os.path.expanduser("~"),
            }
        }

    def run(self):
        self.send(self.hello())
        while not self.broken:
            line = self.infile.readline()
            if not line:
                break
            if line.strip():
                self.handle_line(line)
        # EOF: follows and downloads are cancelled, the rest may still answer, briefly.
        self.node.shutdown()
        self.workers.drain(self.drain_timeout)
        return EXIT_OK

    def handle_line(self, line):
        try:
            request = json.loads(line.decode("utf-8") if isinstance(line, bytes) else line)
        except ValueError as exc:
            self._fail(None, "bad_request", "not a JSON line: %s" % exc)
            return
        if not isinstance(request, dict):
            self._fail(None, "bad_request", "a request is a JSON object with id, op and args")
            return
        request_id = request.get("id")
        if isinstance(request_id, bool) or not isinstance(request_id, (int, str)):
            self._fail(None, "bad_request", "a request needs an id (int or str)")
            return
        op = request.get("op")
        args = request.get("args", {})
        if args is None:
            args = {}
        if not isinstance(op, str) or op not in self.node.operations:
            self._fail(request_id, "unknown_op", "unknown operation %r; known: %s" % (op, ", ".join(self.node.operations)))
            return
        if not isinstance(args, dict):
            self._fail(request_id, "bad_args", "args must be a JSON object")
            return
        ctx = Context(request_id, self.send)
        if op in self.INLINE_OPS:
            self.execute(op, args, ctx)
            return
        self.node.register(ctx)
        self.workers.submit(self._execute_registered, op, args, ctx)

    def _execute_registered(self, op, args, ctx):
        try:
            self.execute(op, args, ctx)
        finally:
            self.node.unregister(ctx)

    def execute(self, op, args, ctx):
        try:
            result = self.node.operations[op](args, ctx)
        except HelperError as exc:
            self._fail(ctx.id, exc.kind, exc.message)
        except Exception as exc:
            # One bad request never takes the helper down.
            traceback.print_exc(file=sys.stderr)
            self._fail(ctx.id, "internal", "%s: %s" % (type(exc).__name__, exc))
        else:
            self.send({"id": ctx.id, "ok": True, "result": result})

    def _fail(self, request_id, kind, message):
        self.send({"id": request_id, "ok": False, "error": {"kind": kind, "message": message}})
