# Engines: an engine's runtime made present (provision, envs: through the venvs and containers
# parts), the engine launched under the supervisor, watched, stopped, its logs.


class Engines(object):
    """provision, envs, launch, status, stop, forget, logs: a part of Node (below). An engine's
    runtime is made present by the venvs or the containers part; the engine runs under the
    supervisor, its shard's files in ROOT/shards."""

    def __init__(self, root_dir, verified, venvs, containers):
        self.root_dir = root_dir
        self.verified = verified
        self.venvs = venvs
        self.containers = containers

    def op_provision(self, args, ctx):
        runtime = _arg(args, "runtime", (dict,))
        kind = runtime.get("kind")
        if kind == "venv":
            return self.venvs.provision_venv(runtime, ctx)
        if kind == "container":
            return self.containers.provision_container(runtime, ctx)
        raise bad_args("runtime.kind must be one of %s, got %r" % (", ".join(RUNTIME_KINDS), kind))

    def op_envs(self, args, ctx):
        wanted = _arg(args, "wanted", (dict,), None)
        result = {"envs": self.venvs.list_envs(), "images": self.containers.list_images()}
        if wanted is not None:
            result["wanted"] = dict((key, self.venvs.wanted_name(runtime)) for key, runtime in wanted.items())
        return result

    def op_launch(self, args, ctx):
        if self.root_dir.sha256 is None:
            raise HelperError("bad_args", "launch is only available through serve --expect-sha256")
        shard_id = _arg_shard_id(args)
        argv = _arg(args, "argv", (list,))
        if not argv or not all(isinstance(a, str) and "\0" not in a for a in argv):
            raise bad_args("argv must be a non-empty list of strings")
        env = _arg(args, "env", (dict,), {})
        for key, value in env.items():
            if not key or "=" in key or "\0" in key or not isinstance(value, str) or "\0" in value:
                raise bad_args("env must map names (no '=') to strings; %r does not" % key)
        port = _arg(args, "port", (int,), None)
        if port is not None and not (0 < port < 65536):
            raise bad_args("port must be 1-65535, got %d" % port)
        host = _arg(args, "host", (str,), "0.0.0.0")
        health_url = _arg(args, "health_url", (str,), None)
        gpus = _arg(args, "gpus", (list,), None)
        if gpus is not None and not all(isinstance(g, int) and not isinstance(g, bool) and g >= 0 for g in gpus):
            raise bad_args("gpus must be a list of GPU indices")
        files = _arg(args, "files", (dict,), {})
        for file_name, text in files.items():
            if (not SHARD_FILE_RE.fullmatch(file_name) or file_name in (STATE_FILE, LOG_FILE, CONTAINER_ID_FILE)
                    or not isinstance(text, str)):
                raise bad_args("files must map plain file names (not %s, %s or %s) to text; %r does not"
                               % (STATE_FILE, LOG_FILE, CONTAINER_ID_FILE, file_name))
        file_sha256 = _arg(args, "file_sha256", (dict,), {})
        for file_name, digest in file_sha256.items():
            if file_name not in files or not isinstance(digest, str):
                raise bad_args(f"file_sha256 must map names of files to hex digests; {file_name!r} does not")
        runtime = _arg_runtime(args)
        shard_dir = self.root_dir.shard_dir(shard_id)
        argv = [part.replace(SHARD_DIR_PLACEHOLDER, shard_dir) for part in argv]
        env = {key: value.replace(SHARD_DIR_PLACEHOLDER, shard_dir) for key, value in env.items()}
        container = None
        if runtime is not None and runtime.get("kind") == "container":
            argv, env, container = self.containers.container_launch(runtime, shard_id, argv, env, gpus, shard_dir)
        else:
            argv, env = self.venvs.venv_launch(runtime, argv, env)
        search_path = env.get("PATH", os.environ.get("PATH", os.defpath))
        if container is None and find_program(argv[0], search_path) is None:
            # Found now rather than by the supervisor's exec failing: the operator learns which
            # program is missing and where it was looked for.
            where = "is not an executable file" if "/" in argv[0] else "is not on PATH=" + search_path
            raise HelperError("engine_missing", f"{argv[0]} {where} on this node")
        # Outside the launch lock: hashing a big entry for the first time here must not hold
        # up other launches.
        self.verified.verify_weights(argv)
        state_path = os.path.join(shard_dir, STATE_FILE)
        log_path = os.path.join(shard_dir, LOG_FILE)
        with self.root_dir.launch_lock:
            previous = self.root_dir.read_state(shard_id)
            if previous is not None and _identity(previous)[0] == "alive":
                raise HelperError("alive", "shard %s is already running as pid %s" % (shard_id, previous.get("pid")))
            if port is not None:
                check_port_free(host, port)
            self.root_dir.private_dir(self.root_dir.shards_dir())
            self.root_dir.private_dir(shard_dir)
            if os.path.exists(log_path):
                os.replace(log_path, log_path + ".1")
            if os.path.exists(state_path):
                os.unlink(state_path)
            if os.path.lexists(os.path.join(shard_dir, CONTAINER_ID_FILE)):
                os.unlink(os.path.join(shard_dir, CONTAINER_ID_FILE))
            for file_name, text in files.items():
                _write_private_file(os.path.join(shard_dir, file_name), text)
            for file_name, digest in file_sha256.items():
                # The bytes the engine will load are the bytes the control plane shipped.
                actual = sha256_of_file(lambda name=file_name: open_below(self.root_dir.path, ["shards", shard_id, name]))
                if actual != digest.lower():
                    raise HelperError("integrity", f"{file_name} in the shard directory has SHA-256 {actual}, "
                                                   f"not {digest}; the engine was not started")
            spec = {
                "shard_id": shard_id,
                "argv": argv,
                "env": env,
                "gpus": gpus,
                "port": port,
                "host": host,
                "health_url": health_url,
                "log_path": log_path,
                "container": container,
                "runtime": self.venvs.shard_runtime(runtime),
            }
            log_fd = open_below(self.root_dir.path, ["shards", shard_id, LOG_FILE],
                                os.O_WRONLY | os.O_CREAT | os.O_APPEND | getattr(os, "O_CLOEXEC", 0))
            try:
                # Through the same verifying loader as this helper: the supervisor runs the bytes
                # it hashed, or refuses (exit 97, the fatal line in the log).
                supervisor = subprocess.Popen(
                    loader_argv(sys.executable, self.root_dir.helper_path, self.root_dir.sha256, "-",
                                ["supervise", "--expect-sha256", self.root_dir.sha256, "--root", self.root_dir.path]),
                    stdin=subprocess.PIPE,
                    stdout=log_fd,
                    stderr=log_fd,
                    cwd=shard_dir,
                    close_fds=True,
                    start_new_session=True,
                )
            finally:
                os.close(log_fd)
            try:
                supervisor.stdin.write(json.dumps(spec).encode("utf-8"))
                supervisor.stdin.close()
            except OSError:
                pass
            # Reap it when it ends, so it never lingers as a zombie of this helper.
            threading.Thread(target=supervisor.wait, name="llmgw-reap", daemon=True).start()
            deadline = time.monotonic() + LAUNCH_TIMEOUT
            state = None
            while time.monotonic() < deadline:
                state = self.root_dir.read_state(shard_id)
                if state is not None or supervisor.poll() is not None:
                    break
                time.sleep(0.005)
            if state is None:
                state = self.root_dir.read_state(shard_id)
            if state is None and supervisor.returncode is None:
                # Too late to report a start: end it rather than leave an engine nobody knows of.
                _signal_groups([supervisor.pid], signal.SIGKILL)
        if state is None:
            tail = " | ".join(self.root_dir.shard_log_tail(shard_id, 5))
            raise HelperError("launch_failed", "the supervisor of %s did not record a start: %s" % (shard_id, tail or "no log"))
        if state.get("pid") is None:
            raise HelperError("launch_failed", "could not start %s: %s" % (shard_id, state.get("error")))
        note_entry_use(argv)  # the clean-up's "last used" (Reclaim section)
        return dict((key, state.get(key)) for key in ("shard_id", "pid", "pgid", "start_time", "argv", "log_path",
                                                      "started_at", "container"))

    def op_status(self, args, ctx):
        probe = _arg(args, "probe", (bool,), False)
        timeout = _arg_timeout(args, "timeout", DEFAULT_PROBE_TIMEOUT, upper=60.0)
        shards = []
        probes = []
        states = self.root_dir.all_states()
        containers = self.containers.container_status(states)
        for shard_id, state in states:
            alive = _identity(state)[0] == "alive"
            container = None
            if isinstance(state.get("container"), dict):
                recorded = state["container"]
                verdict, why, doc = containers.get(shard_id, (None, None, None))
                if alive and verdict in ("gone", "mismatch"):
                    alive = False  # the client runs, the container it ran is not the one recorded
                container = {"id": recorded.get("id"), "name": recorded.get("name"), "image": recorded.get("image"),
                             "image_id": recorded.get("image_id"), "program": recorded.get("program"),
                             "state": verdict, "why": why}
            entry = {
                "shard_id": shard_id,
                "pid": state.get("pid"),
                "pgid": state.get("pgid"),
                "start_time": state.get("start_time"),
                "argv": state.get("argv"),
                "gpus": state.get("gpus"),
                "port": state.get("port"),
                "health_url": state.get("health_url"),
                "started_at": state.get("started_at"),
                "alive": alive,
                "exit_code": state.get("exit_code"),
                "ended_at": state.get("ended_at"),
                "runtime": state.get("runtime"),
                "health": None,
                "log_tail": None,
                "container": container,
            }
            if not alive:
                entry["log_tail"] = self.root_dir.shard_log_tail(shard_id, LOG_TAIL_LINES)
            elif probe and isinstance(state.get("health_url"), str):
                thread, box = _start_bounded(lambda st=state: probe_engine(st, timeout))
                probes.append((entry, thread, box))
            shards.append(entry)
        # A port that accepts and never answers must time out, not hang.
        deadline = time.monotonic() + timeout + 0.5
        for entry, thread, box in probes:
            thread.join(max(0.0, deadline - time.monotonic()))
            if thread.is_alive() or "value" not in box:
                entry["health"] = {"status": None, "error": "no answer within %g s" % timeout}
            else:
                entry["health"] = box["value"]
        return {"shards": shards}

    def _shard_state(self, shard_id):
        state = self.root_dir.read_state(shard_id)
        if state is None:
            raise HelperError("not_found", "no shard %s is recorded on this node" % shard_id)
        return state

    def op_stop(self, args, ctx):
        shard_id = _arg_shard_id(args)
        grace = float(_arg(args, "grace", (float,), DEFAULT_STOP_GRACE))
        if not (0 <= grace <= 3600):
            raise bad_args("grace must be between 0 and 3600 seconds")
        state = self._shard_state(shard_id)
        verdict, why = _identity(state)
        if verdict == "mismatch":
            raise HelperError(
                "identity", "shard %s: %s; it is not the engine llmgw started, nothing was signalled" % (shard_id, why)
            )
        container = state.get("container") if isinstance(state.get("container"), dict) else None
        if container is not None and isinstance(container.get("id"), str):
            found = self.containers.container_status([(shard_id, state)]).get(shard_id, ("unknown", None, None))
            if found[0] == "mismatch":
                raise HelperError("identity", "shard %s: %s; nothing was stopped" % (shard_id, found[1]))
            if found[0] == "alive":
                # The engine in the container gets TERM, KILL after the grace; the client it
                # was attached to then exits, and the supervisor records the exit.
                container_cli(container["program_path"], ["stop", "--time", "%d" % max(0, int(grace)), container["id"]],
                              timeout=grace + CONTAINER_CLI_TIMEOUT)
            if found[0] != "unknown":
                container_cli(container["program_path"], ["rm", "-f", container["id"]])
        if verdict == "gone":
            return {"was_alive": False, "stopped": True}
        pid = state["pid"]
        pgid = state.get("pgid")
        targets = [pgid] if isinstance(pgid, int) and pgid > 1 else []
        info = read_proc_stat(pid)
        if info is not None and info["pgid"] not in targets:
            targets.append(info["pgid"])  # the engine left the group it was started in

        def running():
            if _identity(state)[0] == "alive":
                return True
            return any(group_members(group) for group in targets)

        _signal_groups(targets, signal.SIGTERM)
        deadline = time.monotonic() + grace
        while running() and time.monotonic() < deadline:
            time.sleep(0.05)
        if running():
            _signal_groups(targets, signal.SIGKILL)
            deadline = time.monotonic() + KILL_WAIT
            while running() and time.monotonic() < deadline:
                time.sleep(0.02)
        return {"was_alive": True, "stopped": not running()}

    def op_forget(self, args, ctx):
        shard_id = _arg_shard_id(args)
        state = self.root_dir.read_state(shard_id)
        if state is not None and _identity(state)[0] == "alive":
            raise HelperError("alive", "shard %s is still running (pid %s); stop it first" % (shard_id, state.get("pid")))
        if os.path.lexists(self.root_dir.shard_dir(shard_id)):
            remove_tree_within(self.root_dir.shards_dir(), shard_id)
        return {}

    def op_logs(self, args, ctx):
        shard_id = _arg_shard_id(args)
        count = _arg(args, "lines", (int,), DEFAULT_LOG_LINES)
        if not (0 <= count <= MAX_LOG_LINES):
            raise bad_args("lines must be between 0 and %d" % MAX_LOG_LINES)
        follow = _arg(args, "follow", (bool,), False)
        if not os.path.isdir(self.root_dir.shard_dir(shard_id)):
            raise HelperError("not_found", "no shard %s is recorded on this node" % shard_id)
        if not follow:
            return {"lines": self.root_dir.shard_log_tail(shard_id, count)}

        def opened():
            try:
                return os.fdopen(self.root_dir.open_shard_file(shard_id, LOG_FILE), "rb")
            except OSError:
                return None

        handle = opened()
        if handle is not None:
            with handle:
                info = os.fstat(handle.fileno())
            inode, offset = info.st_ino, info.st_size
        else:
            inode, offset = None, 0
        ctx.emit("lines", {"lines": self.root_dir.shard_log_tail(shard_id, count)})
        pending = b""
        while not ctx.cancelled.wait(LOG_FOLLOW_INTERVAL):
            handle = opened()
            if handle is None:
                continue
            with handle:
                info = os.fstat(handle.fileno())
                if info.st_ino != inode or info.st_size < offset:
                    # Rotated by a relaunch, or truncated: start over.
                    inode, offset, pending = info.st_ino, 0, b""
                if info.st_size == offset:
                    continue
                try:
                    handle.seek(offset)
                    chunk = handle.read(min(info.st_size - offset, 4 << 20))
                except OSError:
                    continue
            offset += len(chunk)
            parts = (pending + chunk).split(b"\n")
            pending = parts.pop()
            if parts:
                ctx.emit("lines", {"lines": [_decode_line(part) for part in parts]})
        return {"lines": []}



def _identity(state):
    """("alive" | "gone" | "mismatch", why) for a recorded engine (R-4.4).

    A pid alone is never trusted: the process must have been started in this boot at the
    recorded clock tick and run the recorded command line. Interpreted engines (a console
    script runs as "python3 /path/vllm ...") are recorded as the kernel shows them right after
    exec; an engine that retitles itself still counts while the recorded supervisor, itself
    checked by start time, is its parent.
    """
    pid = state.get("pid")
    start_time = state.get("start_time")
    if not isinstance(pid, int) or isinstance(pid, bool) or pid <= 0 or not isinstance(start_time, int):
        return "gone", "no engine was started"
    info = read_proc_stat(pid)
    if info is None:
        return "gone", "pid %d has exited" % pid
    if info["state"] in ("Z", "X"):
        return "gone", "pid %d has exited" % pid
    boot_id = state.get("boot_id")
    if boot_id and boot_id != read_boot_id():
        return "mismatch", "pid %d was recorded before the node rebooted" % pid
    if info["start_time"] != start_time:
        return "mismatch", "pid %d started at tick %d, not %d: the pid was reused" % (pid, info["start_time"], start_time)
    cmdline = read_cmdline(pid)
    if cmdline is not None and cmdline in (state.get("cmdline"), state.get("argv")):
        return "alive", None
    supervisor_pid = state.get("supervisor_pid")
    if isinstance(supervisor_pid, int) and info["ppid"] == supervisor_pid:
        supervisor = read_proc_stat(supervisor_pid)
        if supervisor is not None and supervisor["start_time"] == state.get("supervisor_start_time"):
            return "alive", None
    return "mismatch", "pid %d runs another command line" % pid


def _signal_groups(groups, signum):
    for group in groups:
        try:
            os.killpg(group, signum)
        except (ProcessLookupError, PermissionError):
            pass


def find_program(program, search_path):
    """The file exec would run for argv[0] with this PATH (as subprocess looks it up), or None."""
    if "/" in program:
        return program if os.path.isfile(program) and os.access(program, os.X_OK) else None
    return shutil.which(program, path=search_path)


def check_port_free(host, port):
    """Refuse (port_in_use) when something listens on host:port: try to bind it."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        # SO_REUSEADDR: a port left in TIME_WAIT is free; a listener still refuses the bind.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except OSError as exc:
        if exc.errno == errno.EADDRINUSE:
            raise HelperError("port_in_use", "port %d on %s is already in use on this node" % (port, host))
        if exc.errno == errno.EADDRNOTAVAIL:
            raise bad_args("host %s is not an address of this node" % host)
        raise HelperError("port_in_use", "cannot bind port %d on %s: %s" % (port, host, exc.strerror or exc))
    finally:
        sock.close()


def probe_engine(state, timeout):
    """probe_health of a recorded engine, counted only when the engine itself listens."""
    url = state["health_url"]
    try:
        port = urllib.parse.urlsplit(url).port
    except ValueError:
        port = None
    if port is not None:
        groups = [state["pgid"]] if isinstance(state.get("pgid"), int) and state["pgid"] > 1 else []
        info = read_proc_stat(state["pid"]) if isinstance(state.get("pid"), int) else None
        if info is not None and info["pgid"] not in groups:
            groups.append(info["pgid"])  # the engine left the group it was started in
        container = state.get("container") if isinstance(state.get("container"), dict) else {}
        inner = read_proc_stat(container["pid"]) if isinstance(container.get("pid"), int) else None
        if inner is not None and inner["pgid"] not in groups:
            groups.append(inner["pgid"])  # the engine inside the container, in the host's view
        why = foreign_listener(port, groups)
        if why is not None:
            return {"status": None, "error": why}
    return probe_health(url, timeout)


def probe_health(url, timeout):
    """{"status": int|null, "error": str|null} of one GET on the engine's health URL.

    A plain socket rather than urllib: the probe runs for every engine on every tick, the engine
    is on this node (no proxy, no TLS), and only the status line matters. The whole exchange is
    bounded by `timeout`: vLLM binds its port before it serves, so a probe can hang (R-4.7).
    """
    parts = urllib.parse.urlsplit(url)
    if parts.scheme != "http" or not parts.hostname:
        return {"status": None, "error": "only http:// health URLs are probed: %s" % url}
    path = parts.path or "/"
    if parts.query:
        path += "?" + parts.query
    deadline = time.monotonic() + timeout
    try:
        with socket.create_connection((parts.hostname, parts.port or 80), timeout=timeout) as sock:
            host = parts.netloc.encode("ascii", "replace")
            sock.sendall(b"GET " + path.encode("ascii", "replace") + b" HTTP/1.0\r\nHost: " + host
                         + b"\r\nConnection: close\r\n\r\n")
            data = b""
            while b"\r\n" not in data and len(data) < 4096:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise socket.timeout()
                sock.settimeout(remaining)
                chunk = sock.recv(4096)
                if not chunk:
                    break
                data += chunk
    except socket.timeout:
        return {"status": None, "error": "no answer within %g s" % timeout}
    except OSError as exc:
        return {"status": None, "error": exc.strerror or str(exc)}
    fields = data.split(b"\r\n", 1)[0].split(None, 2)
    if len(fields) < 2 or not fields[0].startswith(b"HTTP/") or not fields[1].isdigit():
        return {"status": None, "error": "not an HTTP answer: %r" % data[:80]}
    return {"status": int(fields[1]), "error": None}
