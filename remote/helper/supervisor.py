# Supervisor: runs detached, starts the engine, records its start and its end.


def supervise(root, helper_sha256):
    """Run one engine from the JSON spec on stdin (env included, so secrets stay out of every
    argv) and record its state; returns the supervisor's exit status."""
    spec = json.loads(sys.stdin.buffer.read().decode("utf-8"))
    shard_dir = os.path.join(root, "shards", spec["shard_id"])
    state_path = os.path.join(shard_dir, STATE_FILE)
    env = dict(os.environ)
    env.update(spec.get("env") or {})
    container = spec.get("container")
    if spec.get("gpus") is not None and container is None:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(str(index) for index in spec["gpus"])
    # A stop signals the whole group; the supervisor outlives TERM to record the exit. Python
    # handlers (unlike SIG_IGN) are reset by exec, so the engine gets the default behaviour.
    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(signum, lambda *_: None)
    me = read_proc_stat(os.getpid())
    state = {
        "shard_id": spec["shard_id"],
        "argv": spec["argv"],
        "gpus": spec.get("gpus"),
        "port": spec.get("port"),
        "host": spec.get("host"),
        "health_url": spec.get("health_url"),
        "log_path": spec.get("log_path"),
        "runtime": spec.get("runtime"),
        "boot_id": read_boot_id(),
        "supervisor_pid": os.getpid(),
        "supervisor_start_time": me["start_time"] if me else None,
        "helper_sha256": helper_sha256,
        "exit_code": None,
        "ended_at": None,
        "container": container,
    }
    try:
        engine = subprocess.Popen(
            spec["argv"], env=env, cwd=shard_dir, stdin=subprocess.DEVNULL, close_fds=True
        )
    except OSError as exc:
        state.update(
            {"pid": None, "pgid": os.getpgid(0), "start_time": None, "cmdline": None,
             "started_at": time.time(), "exit_code": 127, "ended_at": time.time(), "error": str(exc)}
        )
        _write_json_atomic(state_path, state)
        print("llmgw supervisor: could not start the engine: %s" % exc, flush=True)
        return 127
    info = read_proc_stat(engine.pid)
    state.update(
        {
            "pid": engine.pid,
            "pgid": os.getpgid(0),
            "start_time": info["start_time"] if info else None,
            "cmdline": read_cmdline(engine.pid),
            "started_at": time.time(),
        }
    )
    _write_json_atomic(state_path, state)
    if container is not None:
        _record_container(engine, container, shard_dir, state, state_path)
    code = engine.wait()
    if container is not None and container.get("id"):
        # A client killed before its container ended would leave the engine running unseen.
        container_cli(container["program_path"], ["rm", "-f", container["id"]])
    state["exit_code"] = code
    state["ended_at"] = time.time()
    _write_json_atomic(state_path, state)
    print("llmgw supervisor: engine pid %d exited with %d" % (engine.pid, code), flush=True)
    _end_leftovers(os.getpgid(0))
    return 0


def _record_container(client, container, shard_dir, state, state_path):
    """Once `run` has created the container: its id, start time, image and main pid in the
    shard's state (what status and stop check the container against)."""
    cid_path = os.path.join(shard_dir, CONTAINER_ID_FILE)
    deadline = time.monotonic() + CONTAINER_WAIT
    cid = None
    while time.monotonic() < deadline and client.poll() is None:
        try:
            with open(cid_path) as handle:
                cid = handle.read().strip() or None
        except OSError:
            cid = None
        if cid:
            doc = inspect_containers(container["program_path"], [cid]).get(cid)
            started = ((doc or {}).get("State") or {}).get("StartedAt")
            if doc is not None and started and not started.startswith("0001-"):
                container.update({"id": cid, "started": started, "pid": doc["State"].get("Pid") or None,
                                  "image_id": doc.get("Image") or container.get("image_id")})
                _write_json_atomic(state_path, state)
                print("llmgw supervisor: container %s (%s) started" % (cid[:12], container["image"]), flush=True)
                return
        time.sleep(0.1)
    if cid:
        container["id"] = cid
        _write_json_atomic(state_path, state)


def _end_leftovers(pgid):
    """Workers the engine left behind would hold GPU memory: TERM, then KILL, the rest of the
    group (not this supervisor)."""
    me = os.getpid()
    for signum, wait in ((signal.SIGTERM, KILL_WAIT), (signal.SIGKILL, 1.0)):
        others = [pid for pid in group_members(pgid) if pid != me]
        if not others:
            return
        for pid in others:
            try:
                os.kill(pid, signum)
            except OSError:
                pass
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline and [pid for pid in group_members(pgid) if pid != me]:
            time.sleep(0.05)
