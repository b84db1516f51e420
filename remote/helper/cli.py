# Command line


OPERATIONS_HELP = """\
operations of the protocol (serve):
  ping      {}
  inventory {images, venvs}                         GPUs, memory, CPUs, host, boot id, container
                                                     programs and images, venv interpreters
  storage   {dirs: [{path, shared}], timeout}        free/total per filesystem
  holdings  {candidates: {KEY: [path, ...]}}         which weights are present and complete
  fetch     {source, cache_dir, name, token}         download into the cache (progress events)
  provision {runtime}                                install an engine: build its environment, or the
                                                     image a container needs (progress events)
  envs      {}                                       the environments built on this node
  launch    {shard_id, argv, env, port, host, health_url, gpus, files, runtime}
  status    {probe, timeout}                         engines this node runs or ran
  stop      {shard_id, grace}                        TERM the group, KILL after the grace
  forget    {shard_id}                               drop a stopped shard's records
  logs      {shard_id, lines, follow}                engine log, followed until cancelled
  reclaim   {cache_dir, names, collect, envs}        list or remove cache entries, environments
  cancel    {target}                                 end a follow, a fetch or provision wait
  fleet_secret {secret}                              the key cache entries are sealed with

launch, stop, forget, fetch, provision and reclaim with collect are reachable only through
'serve --expect-sha256 HEX'. The one-shot commands below print what the control plane sees.

exit codes: 0 ok, 1 failed, 2 bad command line, %d integrity mismatch, %d unsafe helper directory
""" % (EXIT_INTEGRITY, EXIT_PERMISSIONS)


def build_parser():
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--root", default=DEFAULT_ROOT, help="llmgw state directory on this node (default %(default)s)")
    as_json = argparse.ArgumentParser(add_help=False)
    as_json.add_argument("--json", action="store_true", help="print the exact JSON result")
    parser = argparse.ArgumentParser(
        prog="llmgw_helper.py",
        description="llmgw node helper: looks at this node and runs engines on it for the llmgw control plane.",
        epilog=OPERATIONS_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    commands = parser.add_subparsers(
        dest="command", metavar="{serve,inventory,storage,holdings,status,logs,reclaim,envs,provision}"
    )
    commands.required = True
    serve_parser = commands.add_parser("serve", parents=[common], help="speak the JSON-lines protocol on stdin/stdout")
    serve_parser.add_argument("--expect-sha256", required=True, metavar="HEX", help="SHA-256 this file must have")
    supervise_parser = commands.add_parser("supervise", parents=[common])
    supervise_parser.add_argument("--expect-sha256", required=True, metavar="HEX")
    commands.add_parser("inventory", parents=[common, as_json], help="GPUs, memory, CPUs of this node")
    storage = commands.add_parser("storage", parents=[common, as_json], help="free and total bytes per filesystem")
    storage.add_argument("dirs", nargs="+", metavar="DIR")
    storage.add_argument("--shared", action="append", default=[], metavar="DIR", help="treat DIR as shared storage")
    storage.add_argument("--timeout", type=float, default=DEFAULT_STORAGE_TIMEOUT)
    holdings = commands.add_parser("holdings", parents=[common, as_json], help="which weights are present")
    holdings.add_argument("pairs", nargs="+", metavar="KEY=PATH")
    status = commands.add_parser("status", parents=[common, as_json], help="engines this node runs or ran")
    status.add_argument("--probe", action="store_true", help="check each engine's health URL")
    status.add_argument("--timeout", type=float, default=DEFAULT_PROBE_TIMEOUT)
    logs = commands.add_parser("logs", parents=[common], help="the last lines of an engine's log")
    logs.add_argument("shard_id", metavar="SHARD")
    logs.add_argument("-n", "--lines", type=int, default=DEFAULT_LOG_LINES)
    reclaim = commands.add_parser("reclaim", parents=[common, as_json], help="list the entries of a cache directory")
    reclaim.add_argument("cache_dir", metavar="CACHE_DIR")
    commands.add_parser("envs", parents=[common, as_json], help="the environments built on this node")
    provision = commands.add_parser("provision", parents=[common, as_json],
                                    help="build an engine's environment (runtime: venv) by hand")
    provision.add_argument("packages", nargs="+", metavar="PACKAGE", help="pip requirements")
    provision.add_argument("--find-links", action="append", default=[], metavar="DIR_OR_URL")
    provision.add_argument("--index-url", default=None, metavar="URL")
    provision.add_argument("--extra-index-url", action="append", default=[], metavar="URL")
    provision.add_argument("--python", default=None, metavar="PY", help="interpreter (default: this one)")
    provision.add_argument("--post-install", action="append", default=[], metavar="CMD",
                           help="a shell command run in the environment after pip")
    return parser


def check_integrity(path, expected, loaded=None):
    """None when the helper hashes to expected, else the fatal line to print. loaded is the hash
    of the bytes LOADER ran (they are what runs); without the loader the file is hashed."""
    actual = loaded
    if actual is None:
        with open(path, "rb") as handle:
            actual = hashlib.sha256(handle.read()).hexdigest()
    if actual != expected.strip().lower():
        return {"fatal": "integrity", "expected": expected, "actual": actual}
    return None


def check_directory(path):
    """None when the helper's directory is ours and closed to others, else the fatal line."""
    directory = os.path.dirname(os.path.abspath(path))
    info = os.stat(directory)
    mode = stat.S_IMODE(info.st_mode)
    uid = os.getuid()
    problems = []
    if info.st_uid != uid:
        problems.append("is owned by uid %d, not by uid %d running the helper (chown %d %s)" % (info.st_uid, uid, uid, directory))
    if mode & 0o077:
        problems.append("is mode %04o, open to group or others (chmod 700 %s)" % (mode, directory))
    if not problems:
        return None
    return _permissions_fatal(directory, info, "the helper directory %s %s" % (directory, " and ".join(problems)))


def _permissions_fatal(path, info, message):
    return {
        "fatal": "permissions",
        "path": path,
        "mode": "%04o" % stat.S_IMODE(info.st_mode) if info is not None else None,
        "owner": info.st_uid if info is not None else None,
        "message": message,
    }


def _ancestors(path):
    """path's parent, its parent, ... up to /."""
    found = []
    while True:
        parent = os.path.dirname(path)
        if parent == path:
            return found
        found.append(parent)
        path = parent


def unsafe_ancestor(path, uid):
    """Why a directory above path lets someone else replace what is below it, or None.

    As OpenSSH's StrictModes judges a home directory: each directory above, as written and as
    resolved, must be owned by this user or root and not writable by group or others, unless it
    is sticky (like /tmp, where nobody can rename or remove what another user made)."""
    checked = set()
    for start in (os.path.abspath(path), os.path.realpath(path)):
        for directory in _ancestors(start):
            if directory in checked:
                continue
            checked.add(directory)
            try:
                info = os.stat(directory)
            except OSError as exc:
                return directory, None, "%s cannot be checked: %s" % (directory, exc.strerror or exc)
            mode = stat.S_IMODE(info.st_mode)
            if info.st_uid not in (uid, 0):
                return directory, info, "%s is owned by uid %d, neither uid %d running the helper nor root" % (
                    directory, info.st_uid, uid)
            if mode & 0o022 and not mode & stat.S_ISVTX:
                return directory, info, "%s is mode %04o: others can write into it and not sticky (chmod go-w %s)" % (
                    directory, mode, directory)
    return None


def private_dir_problem(path, uid, info=None):
    """Why a directory of the helper's own (ROOT, ROOT/shards) is not safe, or None: it must be a
    real directory (not a link), owned by this user and not writable by group or others."""
    if info is None:
        try:
            info = os.lstat(path)
        except OSError as exc:
            return "%s cannot be checked: %s" % (path, exc.strerror or exc)
    if stat.S_ISLNK(info.st_mode):
        return "%s is a symbolic link, not a directory of its own" % path
    if not stat.S_ISDIR(info.st_mode):
        return "%s is not a directory" % path
    if info.st_uid != uid:
        return "%s is owned by uid %d, not by uid %d running the helper (chown %d %s)" % (
            path, info.st_uid, uid, uid, path)
    mode = stat.S_IMODE(info.st_mode)
    if mode & 0o022:
        return "%s is mode %04o, writable by group or others (chmod 700 %s)" % (path, mode, path)
    return None


def check_root(root, helper_path):
    """None when ROOT, ROOT/shards, the helper's directory and every directory above them are
    safe from other users, else the fatal line: someone who can replace a directory there could
    run code as this user or read engine keys."""
    uid = os.getuid()
    for path in (root, os.path.join(root, "shards")):
        if path != root and not os.path.lexists(path):
            continue
        problem = private_dir_problem(path, uid)
        if problem is not None:
            try:
                info = os.lstat(path)
            except OSError:
                info = None
            return _permissions_fatal(path, info, "the helper root: " + problem)
    for start in (root, os.path.dirname(os.path.abspath(helper_path))):
        found = unsafe_ancestor(start, uid)
        if found is not None:
            directory, info, problem = found
            return _permissions_fatal(directory, info, "a directory above the helper root: " + problem)
    return None


def _print_fatal(obj):
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def main(argv=None):
    options = build_parser().parse_args(argv)
    helper_path = os.path.abspath(__file__)
    if options.command in ("serve", "supervise"):
        fatal = check_integrity(helper_path, options.expect_sha256, globals().get("__llmgw_loaded__"))
        if fatal is not None:
            _print_fatal(fatal)
            return EXIT_INTEGRITY
        fatal = check_directory(helper_path)
        if fatal is not None:
            _print_fatal(fatal)
            return EXIT_PERMISSIONS
        root = os.path.abspath(os.path.expanduser(options.root))
        try:
            os.makedirs(root, mode=0o700, exist_ok=True)
        except OSError:
            pass  # reported by the check below
        fatal = check_root(root, helper_path)
        if fatal is not None:
            _print_fatal(fatal)
            return EXIT_PERMISSIONS
        if options.command == "supervise":
            return supervise(root, options.expect_sha256.strip().lower())
        node = Node(root, helper_path, options.expect_sha256.strip().lower())
        return Server(node, sys.stdin.buffer, sys.stdout.buffer).run()
    node = Node(options.root, helper_path)
    return run_one_shot(node, options)


def run_one_shot(node, options):
    """Run one read-only operation and print it, as JSON or as a readable table."""
    command = options.command
    if command == "inventory":
        args = {}
    elif command == "storage":
        shared = set(os.path.abspath(os.path.expanduser(d)) for d in options.shared)
        paths = [os.path.abspath(os.path.expanduser(d)) for d in options.dirs]
        paths += [d for d in sorted(shared) if d not in paths]
        args = {"dirs": [{"path": p, "shared": p in shared} for p in paths], "timeout": options.timeout}
    elif command == "holdings":
        candidates = {}
        for pair in options.pairs:
            key, sep, path = pair.partition("=")
            if not sep or not key or not path:
                sys.stderr.write("holdings: expected KEY=PATH, got %r\n" % pair)
                return EXIT_USAGE
            candidates.setdefault(key, []).append(os.path.abspath(os.path.expanduser(path)))
        args = {"candidates": candidates}
    elif command == "status":
        args = {"probe": options.probe, "timeout": options.timeout}
    elif command == "logs":
        args = {"shard_id": options.shard_id, "lines": options.lines}
    elif command == "envs":
        args = {}
    elif command == "provision":
        args = {"runtime": {"kind": "venv", "packages": options.packages, "index_url": options.index_url,
                            "extra_index_urls": options.extra_index_url, "find_links": options.find_links,
                            "python": options.python,
                            "post_install": options.post_install}}
    else:
        args = {"cache_dir": os.path.abspath(os.path.expanduser(options.cache_dir))}
    try:
        result = node.operations[command](args, Context(send=_print_progress))
    except HelperError as exc:
        sys.stderr.write("%s: %s (%s)\n" % (command, exc.message, exc.kind))
        return 1
    if command == "logs":
        for line in result["lines"]:
            print(line)
        return EXIT_OK
    if getattr(options, "json", False):
        print(json.dumps(result, indent=2, sort_keys=True))
        return EXIT_OK
    if command == "holdings":
        result = dict(result, requested=list(args["candidates"]))
    print(globals()["_render_" + command](result))
    return EXIT_OK


def _print_progress(message):
    """A one-shot command's events, on stderr (provision's phases and pip's lines)."""
    data = message.get("data") or {}
    if "phase" in data:
        sys.stderr.write("%s: %s\n" % (data["phase"], data["line"] if data.get("line") is not None else "..."))
        sys.stderr.flush()


def _dash(value):
    return "-" if value is None else str(value)


def _size(value):
    if value is None:
        return "-"
    for unit, scale in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if value >= scale:
            return "%.1f %s" % (value / float(scale), unit)
    return "%d B" % value


def _table(header, rows):
    widths = [max(len(str(row[i])) for row in [header] + rows) for i in range(len(header))]
    lines = []
    for row in [header] + rows:
        lines.append("  ".join(str(cell).ljust(width) for cell, width in zip(row, widths)).rstrip())
    return "\n".join(lines)


def _render_inventory(result):
    lines = [
        "host %s  boot %s  cpus %s  memory %s"
        % (result["hostname"], _dash(result["boot_id"]), _dash(result["cpus"]), _size(result["memory_bytes"])),
        "nvidia-smi: %s%s" % (result["nvidia_smi"], ": " + result["nvidia_smi_error"] if result["nvidia_smi_error"] else ""),
    ]
    rows = []
    for gpu in result["gpus"]:
        memory = "%s / %s MiB" % (_dash(gpu["memory_used_mib"]), _dash(gpu["memory_total_mib"]))
        util = "-" if gpu["utilization_pct"] is None else "%d%%" % gpu["utilization_pct"]
        health = "ok" if gpu["healthy"] else "unhealthy: " + "; ".join(gpu["reasons"])
        rows.append([gpu["index"], _dash(gpu["name"]), memory, util, _dash(gpu["ecc_uncorrected"]), health])
    if rows:
        lines.append(_table(["GPU", "NAME", "MEMORY USED/TOTAL", "UTIL", "ECC", "HEALTH"], rows))
    else:
        lines.append("no GPUs")
    python = result.get("python") or {}
    lines.append("python: %s (%s)" % (_dash(python.get("version")), _dash(python.get("path"))))
    for name, found in sorted((result.get("containers") or {}).items()):
        if found["path"] is None:
            lines.append("%s: not on PATH" % name)
            continue
        answers = {True: "answers", False: "does not answer", None: "not checked"}[found["answers"]]
        gpu = {True: "yes", False: "no", None: "-"}[found["gpu"]]
        lines.append("%s: %s, %s, GPUs: %s%s" % (name, found["path"], answers, gpu,
                                                  ": " + found["error"] if found["error"] else ""))
    return "\n".join(lines)


def _render_storage(result):
    rows = [
        [fs["device"], _dash(fs["fstype"]), _dash(fs["mount_point"]), "shared" if fs["shared"] else "local",
         _size(fs["free_bytes"]), _size(fs["total_bytes"]), " ".join(fs["dirs"])]
        for fs in result["filesystems"]
    ]
    lines = [_table(["DEVICE", "FSTYPE", "MOUNT", "KIND", "FREE", "TOTAL", "DIRS"], rows)] if rows else []
    for path in result["missing"]:
        lines.append("missing: %s" % path)
    for path in result["stuck"]:
        lines.append("stuck (did not answer in time): %s" % path)
    return "\n".join(lines) or "nothing to report"


def _render_holdings(result):
    rows = []
    for key in result["requested"]:
        held = result["held"].get(key)
        rows.append([key, held["path"] if held else "-", _size(held["bytes"]) if held else "-"])
    lines = [_table(["KEY", "PATH", "SIZE"], rows)]
    for path in result["stuck"]:
        lines.append("stuck (did not answer in time): %s" % path)
    return "\n".join(lines)


def _render_status(result):
    if not result["shards"]:
        return "no shards recorded"
    rows = []
    for shard in result["shards"]:
        if shard["health"] is None:
            health = "-"
        else:
            health = _dash(shard["health"]["status"]) if shard["health"]["error"] is None else shard["health"]["error"]
        rows.append([shard["shard_id"], _dash(shard["pid"]), "alive" if shard["alive"] else "exited",
                     _dash(shard["exit_code"]), _dash(shard["port"]), health])
    lines = [_table(["SHARD", "PID", "STATE", "EXIT", "PORT", "HEALTH"], rows)]
    for shard in result["shards"]:
        if shard["log_tail"]:
            lines.append("--- %s: last lines of its log" % shard["shard_id"])
            lines.extend(shard["log_tail"][-10:])
    return "\n".join(lines)


def _render_envs(result):
    if not result["envs"]:
        return "no environments"
    rows = [[e["name"], "sealed" if e["sealed"] else "-", _dash(e["python"]), _size(e["bytes"]),
             " ".join(e["packages"] or []) or "-", _dash(e["reason"])] for e in result["envs"]]
    return _table(["NAME", "SEALED", "PYTHON", "SIZE", "PACKAGES", "NOTE"], rows)


def _render_provision(result):
    return "%s %s (%s, python %s, %s, with %s)" % (
        "built" if result["created"] else "already built:", result["path"], _size(result["bytes"]),
        result["python"], result["id"][:12], result["installer"])


def _render_reclaim(result):
    if not result["entries"]:
        return "no llmgw cache entries"
    rows = [[e["name"], _size(e["bytes"]), e["action"], _dash(e["reason"])] for e in result["entries"]]
    return _table(["NAME", "SIZE", "ACTION", "NOTE"], rows)


if __name__ == "__main__":
    sys.exit(main())
