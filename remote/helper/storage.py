# Storage: free space per filesystem, and the weights a node already holds.
# A directory that hangs (a dead filer) is probed on a thread and skipped until it answers.


class Storage(object):
    """storage, holdings: a part of Node (below)."""

    def __init__(self, verified):
        self.verified = verified
        self.stuck = {}  # path -> the probe thread still hanging on it
        self.stuck_lock = threading.Lock()

    def _stuck_paths(self, paths):
        """Which of paths still have a probe hanging from an earlier call; finished probes
        are forgotten, so a mount that recovered is looked at again."""
        stuck = set()
        with self.stuck_lock:
            for path in paths:
                thread = self.stuck.get(path)
                if thread is None:
                    continue
                if thread.is_alive():
                    stuck.add(path)
                else:
                    del self.stuck[path]
        return stuck

    def _mark_stuck(self, path, thread):
        with self.stuck_lock:
            self.stuck[path] = thread

    def op_storage(self, args, ctx):
        requested = _arg(args, "dirs", (list,))
        timeout = _arg_timeout(args, "timeout", DEFAULT_STORAGE_TIMEOUT, upper=300.0)
        dirs = []
        for item in requested:
            if isinstance(item, str):
                item = {"path": item}
            if not isinstance(item, dict):
                raise bad_args("each of 'dirs' must be {\"path\": str, \"shared\": bool}")
            given = _arg(item, "path", (str,))
            path = _arg_path(item, "path")
            shared = _arg(item, "shared", (bool,), False)
            dirs.append((given, path, shared))
        mounts = parse_mountinfo(_read_text("/proc/self/mountinfo") or "")
        already = self._stuck_paths([path for _, path, _ in dirs])
        probes = []
        for given, path, shared in dirs:
            if path in already:
                probes.append((given, path, shared, None, None))
                continue
            thread, box = _start_bounded(lambda path=path: _probe_directory(path))
            probes.append((given, path, shared, thread, box))
        deadline = time.monotonic() + timeout
        filesystems = []
        by_device = {}
        missing = []
        stuck = []
        for given, path, shared, thread, box in probes:
            if thread is not None:
                thread.join(max(0.0, deadline - time.monotonic()))
            if thread is None or thread.is_alive():
                if thread is not None:
                    self._mark_stuck(path, thread)
                stuck.append(given)
                continue
            if "error" in box:
                # Missing or unreadable: an unmounted filer looks like this. Skipped, never
                # reported as an empty or full disk.
                missing.append(given)
                continue
            real, device, total, free = box["value"]
            entry = by_device.get(device)
            if entry is None:
                mount = find_mount(mounts, real, device)
                fstype = mount["fstype"] if mount else None
                entry = {
                    "device": device,
                    "fstype": fstype,
                    "mount_point": mount["mount_point"] if mount else None,
                    "shared": is_shared_fstype(fstype),
                    "total_bytes": total,
                    "free_bytes": free,
                    "dirs": [],
                }
                by_device[device] = entry
                filesystems.append(entry)
            entry["dirs"].append(given)
            entry["shared"] = entry["shared"] or shared
        return {"filesystems": filesystems, "missing": missing, "stuck": stuck}

    # -- holdings --------------------------------------------------------------------------

    def op_holdings(self, args, ctx):
        candidates = _arg(args, "candidates", (dict,))
        timeout = _arg_timeout(args, "timeout", DEFAULT_HOLDINGS_TIMEOUT, upper=600.0)
        for key, paths in candidates.items():
            if not isinstance(paths, list) or not all(isinstance(p, str) and p for p in paths):
                raise bad_args("candidates[%r] must be a list of paths" % key)
        deadline = time.monotonic() + timeout
        held = {}
        stuck = []
        for key, paths in candidates.items():
            for given in paths:
                path = os.path.expanduser(given)
                if given in stuck or self._stuck_paths([path]):
                    if given not in stuck:
                        stuck.append(given)
                    continue
                thread, box = _start_bounded(lambda path=path: self.verified.holding(path))
                thread.join(max(0.0, deadline - time.monotonic()))
                if thread.is_alive():
                    self._mark_stuck(path, thread)
                    stuck.append(given)
                    continue
                found = box.get("value")
                if found is not None:
                    held[key] = dict(found, path=given)
                    if found.get("file"):
                        held[key]["file"] = os.path.join(given, os.path.relpath(found["file"], path))
                    break
        return {"held": held, "stuck": stuck}



def _probe_directory(path):
    """(realpath, "MAJ:MIN", total bytes, free bytes) of a directory; raises when missing."""
    real = os.path.realpath(path)
    info = os.stat(real)
    if not stat.S_ISDIR(info.st_mode):
        raise NotADirectoryError(errno.ENOTDIR, "not a directory", path)
    vfs = os.statvfs(real)
    device = "%d:%d" % (os.major(info.st_dev), os.minor(info.st_dev))
    # f_bavail: what an unprivileged writer (the engine, the fetch) can really use.
    return real, device, vfs.f_blocks * vfs.f_frsize, vfs.f_bavail * vfs.f_frsize
