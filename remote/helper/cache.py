# Cache entries: walking trees (weights, sizes), seals and their verification, what reclaim may
# remove, and removal that never follows a link


def _walk_regular_files(top, follow_file_links, limit=WALK_LIMIT, skip_top=()):
    """Return (bytes, files) of regular files under top, never descending into linked dirs.

    follow_file_links counts a symbolic link to a regular file by its target (a Hugging Face
    cache snapshot is made of such links); otherwise links are not counted at all.
    """
    total = 0
    files = 0
    seen = 0
    stack = [(top, True)]
    while stack and seen < limit:
        directory, is_top = stack.pop()
        try:
            iterator = os.scandir(directory)
        except OSError:
            continue
        with iterator:
            for entry in iterator:
                seen += 1
                if seen >= limit:
                    break
                if is_top and entry.name in skip_top:
                    continue
                try:
                    if entry.is_dir(follow_symlinks=False):
                        stack.append((entry.path, False))
                    elif entry.is_file(follow_symlinks=follow_file_links):
                        total += entry.stat(follow_symlinks=follow_file_links).st_size
                        files += 1
                except OSError:
                    continue
    return total, files


def weights_bytes(path, secret=None):
    """Bytes of weights at path, or None when path holds none (R-2.6).

    Weights are a non-empty regular file, or a directory with at least one regular file. A
    directory named llmgw-* is a fetched cache entry and counts only when cache_entry accepts
    it (made by this user, sealed by this fleet's llmgw): a download without its marker is
    half-finished, and a directory someone else made is not llmgw's.
    """
    if os.path.basename(os.path.normpath(path)).startswith("llmgw-"):
        return cache_entry(path, secret)[0]
    try:
        info = os.stat(path)
    except (OSError, ValueError):
        return None
    if stat.S_ISREG(info.st_mode):
        return info.st_size if info.st_size > 0 else None
    if not stat.S_ISDIR(info.st_mode):
        return None
    total, files = _walk_regular_files(path, follow_file_links=True, skip_top=(COMPLETE_MARKER,))
    return total if files else None


def _private_problem(what, info, uid):
    """Why a file or directory of a cache entry is not this user's alone to change, or None."""
    if info.st_uid != uid:
        return "%s is owned by uid %d, not by uid %d running the helper" % (what, info.st_uid, uid)
    if stat.S_IMODE(info.st_mode) & 0o022:
        return "%s is writable by group or others (mode %04o)" % (what, stat.S_IMODE(info.st_mode))
    return None


def entry_manifest(path, uid, limit=WALK_LIMIT, links=None, stamps=None):
    """(files, bytes, problem) of a cache entry, walked without following links.

    files lists (relative/path, size) of every file, sorted; names at the top that start with
    .llmgw- (the marker, the lease) are llmgw's own and left out. problem says why the entry
    cannot be llmgw's: a link or a special file inside, or a file or directory another user
    owns or can write. With links (a list), symbolic links of this user are not a problem but
    appended to it as (relative/path, target), sorted (an environment holds bin/python -> ...).
    With stamps (a dict), each file's file_stamp, from the walk's own lstat, is put in it."""
    files = []
    total = 0
    stack = [""]
    seen = 0
    while stack:
        relative = stack.pop()
        directory = os.path.join(path, relative) if relative else path
        try:
            iterator = os.scandir(directory)
        except OSError as exc:
            return None, None, "%s cannot be read: %s" % (directory, exc.strerror or exc)
        with iterator:
            for entry in iterator:
                seen += 1
                if seen > limit:
                    return None, None, "holds more than %d files" % limit
                if not relative and entry.name.startswith(".llmgw-"):
                    continue
                name = relative + "/" + entry.name if relative else entry.name
                try:
                    info = entry.stat(follow_symlinks=False)
                except OSError as exc:
                    return None, None, "%s cannot be read: %s" % (name, exc.strerror or exc)
                if stat.S_ISDIR(info.st_mode):
                    stack.append(name)
                elif links is not None and stat.S_ISLNK(info.st_mode):
                    if info.st_uid != uid:
                        return None, None, "%s is a link owned by uid %d, not by uid %d" % (name, info.st_uid, uid)
                    try:
                        links.append((name, os.readlink(entry.path)))
                    except OSError as exc:
                        return None, None, "%s cannot be read: %s" % (name, exc.strerror or exc)
                    continue
                elif not stat.S_ISREG(info.st_mode):
                    return None, None, "%s is a link or a special file, which llmgw never writes" % name
                else:
                    files.append((name, info.st_size))
                    total += info.st_size
                    if stamps is not None:
                        stamps[name] = file_stamp(info)
                problem = _private_problem(name, info, uid)
                if problem is not None:
                    return None, None, problem
    files.sort()
    if links is not None:
        links.sort()
    return files, total, None


def entry_seal(secret, name, files, hashes, links=(), context=SEAL_CONTEXT, recipe=None):
    """HMAC-SHA256, keyed by the fleet secret, of the cache name and every file's relative path,
    size and SHA-256 (hashes: {relative path: hex}), so the seal covers content. An environment's
    seal (its own context) covers its links' targets and its recipe too."""
    lines = "\n".join("%s\t%d\t%s" % (path, size, hashes[path]) for path, size in files)
    for path, target in links:
        lines += "\nlink\t%s\t%s" % (path, target)
    if recipe is not None:
        lines += "\nrecipe\t" + canonical_json(recipe)
    message = context + name.encode("utf-8") + b"\n" + lines.encode("utf-8", "surrogateescape")
    return hmac.new(secret.encode("ascii"), message, hashlib.sha256).hexdigest()


def canonical_json(value):
    return json.dumps(value, sort_keys=True, separators=(",", ":"))


def _read_marker(path, uid, marker_name=COMPLETE_MARKER):
    """(marker dict, None) or (None, why) for the completion marker of the entry at path (or
    its other marker of that name)."""
    try:
        fd = open_below(path, [marker_name])
    except OSError as exc:
        if exc.errno == errno.ENOENT:
            return None, "incomplete: no completion marker"
        return None, "its completion marker cannot be read (%s)" % (exc.strerror or exc)
    with os.fdopen(fd, "rb") as handle:
        info = os.fstat(handle.fileno())
        if not stat.S_ISREG(info.st_mode):
            return None, "its completion marker is not a regular file"
        problem = _private_problem("its completion marker", info, uid)
        if problem is not None:
            return None, problem
        try:
            marker = json.loads(handle.read(64 << 20).decode("utf-8"))
        except ValueError:
            marker = None
    if not isinstance(marker, dict):
        return None, "its completion marker is not a JSON object"
    return marker, None


def _private_dir_marker(path, uid, what, noun):
    """(completion marker, None) when path is a real directory (not a link) owned by uid and
    private to it, holding a readable marker; else (None, why). what and noun name the thing
    in the words: "a cache entry" and "the entry", "an environment" and "the environment"."""
    try:
        info = os.lstat(path)
    except (OSError, ValueError):
        return None, "not present"
    if stat.S_ISLNK(info.st_mode):
        return None, "a symbolic link, not %s; never followed" % what
    if not stat.S_ISDIR(info.st_mode):
        return None, "not a directory"
    problem = _private_problem(noun, info, uid)
    if problem is not None:
        return None, "not llmgw's: " + problem
    return _read_marker(path, uid)


def _unhashed(files, hashes):
    """The first of files' relative paths hashes gives no well-formed SHA-256 for, else None."""
    for relative, _ in files:
        if not isinstance(hashes.get(relative), str) or not SHA256_RE.fullmatch(hashes[relative]):
            return relative
    return None


def sealed_entry(path, secret):
    """({"files": [(relative path, size)], "hashes": {relative path: sha256}, "bytes"}, None)
    when the directory at path is a fetched entry this fleet's llmgw made, else (None, why).

    It must be a real directory (not a link) owned by this user, with only this user's files in
    it, and a completion marker whose seal (entry_seal) matches its name, its files' sizes and
    the SHA-256 the marker gives for each. The contents are not read here (see
    verify_entry_content). A marker from before content hashes is refused: its seal covers no
    content, and any node holding the secret could have written it, so the entry is fetched
    again (the fetch replaces it) rather than hashed and trusted as it is now."""
    uid = os.getuid()
    name = os.path.basename(os.path.normpath(path))
    marker, problem = _private_dir_marker(path, uid, "a cache entry", "the entry")
    if problem is not None:
        return None, problem
    files, total, problem = entry_manifest(path, uid)
    if problem is not None:
        return None, "not llmgw's: " + problem
    if not files:
        return None, "holds no files"
    if secret is None:
        return None, "no fleet secret on this node to check its completion marker"
    hashes = marker.get("sha256")
    if marker.get("format") != MARKER_FORMAT or not isinstance(hashes, dict):
        return None, ("its completion marker predates content hashes (format %s), so what it holds cannot be "
                      "checked; it is fetched again" % (marker.get("format", 1),))
    unhashed = _unhashed(files, hashes)
    if unhashed is not None:
        return None, "its completion marker gives no SHA-256 for %s" % unhashed
    seal = marker.get("seal")
    if isinstance(seal, str) and hmac.compare_digest(seal, entry_seal(secret, name, files, hashes)):
        return {"files": files, "hashes": hashes, "bytes": total}, None
    return None, "its completion marker was not sealed by this fleet's llmgw, or its files changed since"


def cache_entry(path, secret):
    """(bytes, None) when the directory at path is a fetched entry this fleet's llmgw made (see
    sealed_entry), else (None, why)."""
    entry, problem = sealed_entry(path, secret)
    return (entry["bytes"], None) if entry is not None else (None, problem)


def always_verified(relative, size):
    """Whether a file of an entry is hashed at every launch: code, configuration, tokenizers
    and anything small; big files only when they changed since this node last hashed them."""
    base = relative.rsplit("/", 1)[-1]
    return size <= ALWAYS_VERIFIED_BYTES or base.endswith(ALWAYS_VERIFIED_SUFFIXES) or base.startswith("tokenizer")


def file_stamp(info):
    """What the node-local record compares to skip hashing a big file again: any write, utime,
    chmod or replacement changes the inode, size, mtime or (not settable by anyone) ctime."""
    return [info.st_dev, info.st_ino, info.st_size, info.st_mtime_ns, info.st_ctime_ns]


def hash_stream(handle, on_bytes=None, chunk=HASH_CHUNK):
    """Hex SHA-256 of what is left to read of an open binary file; on_bytes(count) hears each
    block read (it may raise to stop)."""
    digest = hashlib.sha256()
    while True:
        block = handle.read(chunk)
        if not block:
            return digest.hexdigest()
        digest.update(block)
        if on_bytes is not None:
            on_bytes(len(block))


def never_rehashed(relative, size):
    """An environment's policy: every file is hashed again only when its stamp changed (it holds
    tens of thousands of small files, and its directories are read-only once sealed)."""
    return False


def verified_here(path, entry, verified, always=always_verified):
    """Whether every big file of the sealed entry at path has, now, the stamp this node recorded
    when it last found it as sealed: a launch then reads only the small files again."""
    for relative, size in entry["files"]:
        if always(relative, size):
            continue
        full = os.path.join(path, relative)
        try:
            info = os.lstat(full)
        except OSError:
            return False
        if verified.get(full) != file_stamp(info) + [entry["hashes"][relative]]:
            return False
    return True


def verify_entry_content(path, entry, verified, on_bytes=None, always=always_verified):
    """(problem, hashed) for the sealed entry at path (entry: what sealed_entry found).

    Every file is opened without following a link and its SHA-256 compared with the sealed one;
    a file always(relative, size) does not insist on (a big one, by default) whose stamp
    (file_stamp) is the one verified[its path] holds with that hash is not read again. verified
    is updated in place with what was hashed and matched. problem names the first file that
    differs (and both hashes), or None; hashed lists the files read.
    on_bytes(count) hears the bytes checked, read or skipped. When the entry carries "stamps"
    (an environment's, taken by its manifest walk's lstat of each regular file, a moment ago),
    a file whose walked stamp is the recorded one is not opened at all: the same inode, size,
    mtime and ctime as when it was hashed (an environment's tens of thousands of files were
    otherwise opened one path component at a time on every launch)."""
    hashed = []
    stamps = entry.get("stamps") or {}
    top = path.rstrip("/") + "/"
    for relative, size in entry["files"]:
        full = top + relative  # as os.path.join(path, relative): relative paths from a walk
        expected = entry["hashes"][relative]
        walked = stamps.get(relative)
        if walked is not None and not always(relative, size) and verified.get(full) == walked + [expected]:
            if on_bytes is not None:
                on_bytes(size)
            continue
        try:
            fd = open_below(path, relative.split("/"))
        except OSError as exc:
            return "%s cannot be opened: %s" % (full, exc.strerror or exc), hashed
        with os.fdopen(fd, "rb") as handle:
            info = os.fstat(handle.fileno())
            if not stat.S_ISREG(info.st_mode) or info.st_size != size:
                return "%s changed while it was being checked" % full, hashed
            stamp = file_stamp(info)
            if not always(relative, size) and verified.get(full) == stamp + [expected]:
                if on_bytes is not None:
                    on_bytes(size)
                continue
            actual = hash_stream(handle, on_bytes)
        hashed.append(relative)
        if not hmac.compare_digest(actual, expected):
            verified.pop(full, None)
            return ("%s has SHA-256 %s, not the %s its entry was sealed with: it was changed after the fetch "
                    "(nothing was removed: find the node that wrote it, then remove the entry so that it is fetched again)"
                    % (full, actual, expected)), hashed
        if not always(relative, size):
            verified[full] = stamp + [expected]
    return None, hashed


def entry_file(path):
    """The path of the only file in the cache entry at path (a fetched URL's file, saved under
    whatever name the fetch gave it), or None when the entry holds more than one file, or none.
    llmgw's own names at its top (.llmgw-*) are not counted; links are never followed."""
    found = None
    stack = [path]
    while stack:
        directory = stack.pop()
        try:
            with os.scandir(directory) as iterator:
                entries = list(iterator)
        except OSError:
            return None
        for entry in entries:
            if directory == path and entry.name.startswith(".llmgw-"):
                continue
            if entry.is_dir(follow_symlinks=False):
                stack.append(entry.path)
            elif found is not None:
                return None
            else:
                found = entry.path
    return found


def _same_inode(a, b):
    return a.st_dev == b.st_dev and a.st_ino == b.st_ino


def _remove_at(parent_fd, name, top_dev, unlock=False):
    """Remove parent_fd/name without following links: links and files are unlinked, dirs are
    opened O_NOFOLLOW relative to their parent and emptied the same way (with unlock, made
    writable first: a sealed environment's directories are read-only)."""
    info = os.stat(name, dir_fd=parent_fd, follow_symlinks=False)
    if not stat.S_ISDIR(info.st_mode):
        os.unlink(name, dir_fd=parent_fd)
        return
    if info.st_dev != top_dev:
        raise OSError(errno.EXDEV, "refusing to cross into another filesystem", name)
    fd = os.open(name, _DIR_FLAGS, dir_fd=parent_fd)
    try:
        if not _same_inode(os.fstat(fd), info):
            raise OSError(errno.ESTALE, "directory changed while being removed", name)
        if unlock:
            os.fchmod(fd, 0o700)
        with os.scandir(fd) as iterator:
            children = [entry.name for entry in iterator]
        for child in children:
            _remove_at(fd, child, top_dev, unlock)
    finally:
        os.close(fd)
    os.rmdir(name, dir_fd=parent_fd)


def remove_tree_within(directory, name, expected=None, unlock=False):
    """Remove directory/name fd-relative; directory itself is opened O_NOFOLLOW and, when
    expected (an lstat result) is given, must still be that directory."""
    root_fd = os.open(directory, _DIR_FLAGS)
    try:
        root_info = os.fstat(root_fd)
        if expected is not None and not _same_inode(root_info, expected):
            raise OSError(errno.ESTALE, "directory changed while being checked", directory)
        _remove_at(root_fd, name, root_info.st_dev, unlock)
    finally:
        os.close(root_fd)


def reclaim_refusal(cache_dir, name):
    """Why cache_dir/name must not be removed, or None when it may be (R-5.5)."""
    return _check_reclaim(cache_dir, name)[0]


def _check_reclaim(cache_dir, name):
    """(refusal or None, lstat of cache_dir as checked)."""
    if not isinstance(name, str):
        return "is not a name", None
    if "/" in name or "\0" in name or name in (".", "..") or ".." in name:
        return "contains a path separator or traversal; only plain cache names are accepted", None
    if not (CACHE_NAME_RE.fullmatch(name) or TEMP_NAME_RE.fullmatch(name)):
        return (
            "does not carry the llmgw cache name (llmgw-<16 to 64 hex digits>); llmgw removes only what it fetched",
            None,
        )
    if not os.path.isabs(cache_dir):
        return "the cache directory %r is not an absolute path" % cache_dir, None
    try:
        root_info = os.lstat(cache_dir)
    except OSError:
        return "the cache directory %s does not exist" % cache_dir, None
    if stat.S_ISLNK(root_info.st_mode):
        return "the cache directory %s is a symbolic link; nothing is deleted through a link" % cache_dir, None
    if not stat.S_ISDIR(root_info.st_mode):
        return "the cache directory %s is not a directory" % cache_dir, None
    root = os.path.realpath(cache_dir)
    real = os.path.realpath(os.path.join(cache_dir, name))
    if real == root:
        return "is the cache directory itself", None
    if os.path.commonpath([root, real]) != root or os.path.dirname(real) != root:
        return "resolves outside the cache directory (to %s)" % real, None
    try:
        info = os.lstat(os.path.join(cache_dir, name))
    except OSError:
        return "not present", None
    if stat.S_ISLNK(info.st_mode):
        return "is a symbolic link; links are never followed when deleting", None
    if info.st_uid != os.getuid():
        return (
            "is owned by uid %d, not by uid %d running the helper; llmgw removes only what it fetched"
            % (info.st_uid, os.getuid()),
            None,
        )
    return None, root_info


def lease_record():
    return {"hostname": socket.gethostname(), "boot_id": read_boot_id(), "pid": os.getpid(), "started_at": time.time()}


def download_in_progress(cache_dir, temp_name, now=None):
    """Who is writing the temp dir cache_dir/temp_name (a sentence), or None when nobody is.

    Its lease names a node, a boot and a pid: on this node and boot the pid must still run; a
    lease from another node sharing the cache counts while renewed within LEASE_FRESH. A temp
    dir without a lease counts while younger than LEASE_GRACE (a download just starting)."""
    now = time.time() if now is None else now
    try:
        fd = open_below(cache_dir, [temp_name, LEASE_FILE])
    except OSError:
        try:
            age = now - os.lstat(os.path.join(cache_dir, temp_name)).st_mtime
        except OSError:
            return None
        return "a download just starting (no lease yet)" if age < LEASE_GRACE else None
    with os.fdopen(fd, "rb") as handle:
        age = now - os.fstat(handle.fileno()).st_mtime
        try:
            lease = json.loads(handle.read(4096).decode("utf-8"))
        except ValueError:
            lease = None
    if not isinstance(lease, dict):
        lease = {}
    host, pid = lease.get("hostname"), lease.get("pid")
    if host == socket.gethostname() and lease.get("boot_id") == read_boot_id() and isinstance(pid, int):
        info = read_proc_stat(pid) if pid > 0 else None
        if info is None or info["state"] in ("Z", "X"):
            return None
    if age >= LEASE_FRESH:
        return None
    return "in use by a download on %s (pid %s, lease renewed %d s ago)" % (host or "an unknown node", pid, max(0, age))


def reclaim_entries(cache_dir, names, collect, busy=frozenset(), secret=None, until_free=None):
    """List or remove cache entries (R-5.5); busy holds names a running fetch uses.

    names None lists every llmgw-* entry and every leftover temp dir no running fetch owns;
    an entry cache_entry does not accept (with secret) is listed with the reason. On a cache
    shared by several nodes, a temp dir another node is writing (download_in_progress) is
    neither listed nor removed, nor is the entry it is for. With until_free (bytes), only
    sealed entries of this fleet are removed, in the order named, until the filesystem has
    that much free; the rest are kept.
    """
    foreign = _foreign_downloads(cache_dir)
    local, busy = busy, set(busy) | set(foreign)
    if names is None:
        return _list_cache(cache_dir, busy, secret)
    entries = []
    for name in names:
        path = os.path.join(cache_dir, name) if isinstance(name, str) and "\0" not in name else None
        entry = {"name": name, "path": path, "bytes": None, "action": "refused", "reason": None}
        entries.append(entry)
        reason, root_info = _check_reclaim(cache_dir, name)
        if _is_busy(name, local):
            reason = "in use by a running download"
        elif _is_busy(name, busy):
            reason = foreign.get(name) or "in use by a running download"
        if reason is None and until_free is not None:
            reason = _cleanup_refusal(path, name, secret)
        if reason is not None:
            entry["reason"] = reason
            continue
        entry["bytes"] = _entry_bytes(path)
        entry["last_used"] = entry_last_used(path)
        if not collect:
            entry["action"] = "listed"
            continue
        if until_free is not None:
            free = cache_free_bytes(cache_dir)
            if free is not None and free >= until_free:
                entry["action"] = "kept"
                entry["reason"] = "the filesystem has %d bytes free, at or above the mark (%d)" % (free, until_free)
                continue
        try:
            remove_tree_within(cache_dir, name, expected=root_info)
        except OSError as exc:
            entry["reason"] = "could not remove: %s" % (exc.strerror or exc)
            continue
        entry["action"] = "removed"
    return entries


def _cleanup_refusal(path, name, secret):
    """Why the automatic clean-up must not remove path, beyond what reclaim checks: it takes
    only complete entries sealed with this fleet's secret."""
    if not CACHE_NAME_RE.fullmatch(name):
        return "not a complete cache entry; the clean-up removes only sealed entries"
    if secret is None:
        return "no fleet secret yet, so no entry can be proved to be this fleet's"
    problem = cache_entry(path, secret)[1]
    if problem is not None:
        return "not a sealed entry of this fleet (%s)" % problem
    return None


def cache_free_bytes(cache_dir):
    """Bytes an unprivileged writer can still use on cache_dir's filesystem; None if unknown."""
    try:
        vfs = os.statvfs(cache_dir)
    except OSError:
        return None
    return vfs.f_bavail * vfs.f_frsize


def entry_last_used(path):
    """When the entry was last used: its completion marker's mtime (see note_entry_use)."""
    try:
        info = os.lstat(os.path.join(path, COMPLETE_MARKER))
    except OSError:
        return None
    return info.st_mtime if stat.S_ISREG(info.st_mode) else None


def entries_named(argv):
    """The cache entries (absolute paths ending in an llmgw-<hex> directory) an engine's argv
    names, in order, each once: a path argument, or the value of an --option=VALUE."""
    found = []
    for part in argv:
        for value in part.split("=")[-1:] if part.startswith("-") else [part]:
            if not value.startswith("/"):
                continue
            parts = value.split("/")
            for index, component in enumerate(parts):
                if CACHE_NAME_RE.fullmatch(component):
                    entry = "/".join(parts[: index + 1])
                    if entry not in found:
                        found.append(entry)
                    break
    return found


def note_entry_use(argv):
    """Mark the cache entries an engine's argv names as used now: the completion marker's mtime
    is set, through fds that follow no link, on entries and markers of this user only. Nothing
    fails a launch: a path that is not such an entry is left alone."""
    for entry in entries_named(argv):
        _touch_marker(entry)


def _touch_marker(entry):
    try:
        fd = open_below(os.path.dirname(entry), [os.path.basename(entry), COMPLETE_MARKER])
    except OSError:
        return
    try:
        info = os.fstat(fd)
        if stat.S_ISREG(info.st_mode) and info.st_uid == os.getuid():
            os.utime(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _foreign_downloads(cache_dir):
    """{temp dir or the name it is for: who writes it} for the downloads, of this node or
    another, still writing into cache_dir."""
    try:
        names = os.listdir(cache_dir)
    except OSError:
        return {}
    found = {}
    for name in names:
        match = TEMP_NAME_RE.fullmatch(name)
        writer = download_in_progress(cache_dir, name) if match is not None else None
        if writer is not None:
            found[name] = found[match.group(1)] = writer
    return found


def _is_busy(name, busy):
    """A running fetch holds its cache name and every temp dir made for that name."""
    if not isinstance(name, str):
        return False
    temp = TEMP_NAME_RE.fullmatch(name)
    return name in busy or (temp is not None and temp.group(1) in busy)


def _entry_bytes(path):
    try:
        info = os.lstat(path)
    except OSError:
        return None
    if stat.S_ISREG(info.st_mode):
        return info.st_size
    if not stat.S_ISDIR(info.st_mode):
        return None
    total, _ = _walk_regular_files(path, follow_file_links=False)
    return total


def _list_cache(cache_dir, busy, secret=None):
    try:
        names = sorted(os.listdir(cache_dir))
    except OSError:
        return []
    entries = []
    for name in names:
        path = os.path.join(cache_dir, name)
        if CACHE_NAME_RE.fullmatch(name):
            reason = None
            if os.path.islink(path):
                reason = "a symbolic link, not a cache entry; never followed"
            elif name in busy:
                reason = "download in progress"
            else:
                reason = cache_entry(path, secret)[1]
        elif TEMP_NAME_RE.fullmatch(name) and not _is_busy(name, busy):
            reason = "leftover of an interrupted download"
        else:
            continue
        entries.append(
            {"name": name, "path": path, "bytes": _entry_bytes(path), "action": "listed", "reason": reason,
             "last_used": entry_last_used(path)}
        )
    return entries
