# Small facts about this machine and its processes


def _read_text(path):
    try:
        with open(path, "rb") as handle:
            return handle.read().decode("utf-8", "replace")
    except OSError:
        return None


def read_boot_id():
    text = _read_text("/proc/sys/kernel/random/boot_id")
    return text.strip() if text else None


def read_proc_stat(pid):
    text = _read_text("/proc/%d/stat" % pid)
    return parse_proc_stat(text) if text else None


def read_cmdline(pid):
    try:
        with open("/proc/%d/cmdline" % pid, "rb") as handle:
            data = handle.read()
    except OSError:
        return None
    parts = data.split(b"\0")
    if parts and parts[-1] == b"":
        parts.pop()
    return [part.decode("utf-8", "surrogateescape") for part in parts]


def count_cpus():
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count()


def group_members(pgid):
    """Pids of the living (non-zombie) processes of a process group, read from /proc."""
    members = []
    try:
        names = os.listdir("/proc")
    except OSError:
        return members
    for name in names:
        if not name.isdigit():
            continue
        info = read_proc_stat(int(name))
        if info is not None and info["pgid"] == pgid and info["state"] not in ("Z", "X"):
            members.append(int(name))
    return members


def parse_listen_inodes(text, port):
    """Socket inodes of the LISTEN entries on a port in /proc/net/tcp or /proc/net/tcp6 text.

    Columns: sl, local_address (hex ADDR:PORT), rem_address, st (0A is LISTEN), tx:rx,
    tr:when, retrnsmt, uid, timeout, inode.
    """
    inodes = set()
    for line in text.splitlines()[1:]:
        fields = line.split()
        if len(fields) < 10 or fields[3] != "0A":
            continue
        try:
            if int(fields[1].rsplit(":", 1)[1], 16) == port:
                inodes.add(int(fields[9]))
        except (IndexError, ValueError):
            continue
    return inodes


def listen_inodes(port):
    inodes = set()
    for name in ("/proc/net/tcp", "/proc/net/tcp6"):
        text = _read_text(name)
        if text:
            inodes |= parse_listen_inodes(text, port)
    return inodes


def socket_inodes(pids):
    """Inodes of the sockets the processes hold open (fds this user may read)."""
    inodes = set()
    for pid in pids:
        fd_dir = f"/proc/{pid}/fd"
        try:
            names = os.listdir(fd_dir)
        except OSError:
            continue
        for name in names:
            try:
                target = os.readlink(os.path.join(fd_dir, name))
            except OSError:
                continue
            if target.startswith("socket:[") and target.endswith("]"):
                try:
                    inodes.add(int(target[8:-1]))
                except ValueError:
                    pass
    return inodes


def foreign_listener(port, groups):
    """Why the listener on port is not the engine's (its process groups), or None when it is.

    Another user's process may have bound the port first; its 200 must not count as the
    engine's health (R-4.7), so every LISTEN socket on the port must be held open by a process
    of the engine's groups.
    """
    listening = listen_inodes(port)
    if not listening:
        return None  # nothing listens: the probe itself reports the refused connection
    members = []
    for group in groups:
        members.extend(group_members(group))
    if listening - socket_inodes(members):
        return f"port {port} is held by a process that is not this engine; its answers do not count"
    return None


def _write_json_atomic(path, obj, mode=0o600):
    """Write JSON to path through a temp file and rename, so readers never see half a file."""
    temp = "%s.tmp-%d-%s" % (path, os.getpid(), secrets.token_hex(4))
    fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, mode)
    try:
        os.fchmod(fd, mode)
        with os.fdopen(fd, "w") as handle:
            json.dump(obj, handle, indent=1, sort_keys=True)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temp, path)
    except BaseException:
        try:
            os.unlink(temp)
        except OSError:
            pass
        raise


def _write_private_file(path, text):
    """Write text readable by this user only (0600), replacing the file atomically."""
    temp = "%s.tmp-%d-%s" % (path, os.getpid(), secrets.token_hex(4))
    fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as handle:
        handle.write(text)
    os.replace(temp, path)


def sha256_of_file(opener):
    """Hex SHA-256 of the file opener() opens (without following a link), or None."""
    try:
        fd = opener()
    except OSError:
        return None
    with os.fdopen(fd, "rb") as handle:
        return hashlib.sha256(handle.read()).hexdigest()


_NOFOLLOW_READ = os.O_RDONLY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)


def open_below(top, parts, flags=_NOFOLLOW_READ, mode=0o600):
    """Open top/parts[0]/.../parts[-1] through directory fds, following no symbolic link below
    top (which was checked when the helper started): a link planted as a state or log file, or
    as a shard directory, is refused (ELOOP/ENOTDIR), never read or written through."""
    fd = os.open(top, os.O_RDONLY | os.O_DIRECTORY | getattr(os, "O_CLOEXEC", 0))
    try:
        for part in parts[:-1]:
            child = os.open(part, _DIR_FLAGS, dir_fd=fd)
            os.close(fd)
            fd = child
        return os.open(parts[-1], flags | os.O_NOFOLLOW, mode, dir_fd=fd)
    finally:
        os.close(fd)


def _read_json(path, opener=None):
    try:
        fd = opener() if opener is not None else os.open(path, _NOFOLLOW_READ)
        with os.fdopen(fd, "rb") as handle:
            value = json.loads(handle.read().decode("utf-8"))
    except (OSError, ValueError):
        return None
    return value if isinstance(value, dict) else None


def tail_lines(path, count, max_bytes=16 << 20, opener=None):
    """Last count lines of a file, read backwards in blocks; missing file gives []. The file is
    opened without following a link (opener, when given, opens it)."""
    if count <= 0:
        return []
    try:
        handle = os.fdopen(opener() if opener is not None else os.open(path, _NOFOLLOW_READ), "rb")
    except OSError:
        return []
    with handle:
        handle.seek(0, os.SEEK_END)
        size = handle.tell()
        position = size
        data = b""
        while position > 0 and data.count(b"\n") <= count and size - position < max_bytes:
            step = min(65536, position)
            position -= step
            handle.seek(position)
            data = handle.read(step) + data
    lines = data.split(b"\n")
    if lines and lines[-1] == b"":
        lines.pop()
    if position > 0 and lines:
        lines = lines[1:]  # the first one is cut
    return [_decode_line(line) for line in lines[-count:]]


# An engine that prints its arguments prints its key: SGLang logs `ServerArgs(..., api_key='...')`.
# Names ending in api_key / api-key / apikey (admin_api_key too), then = or : and a value, a
# quoted one or a list; and a --api-key VALUE command line.
_KEY_ASSIGNMENT = re.compile(
    r"""(?i)(\b[\w-]*api[_-]?keys?['"]?\s*[:=]\s*)(\[[^\]]*\]|'[^']*'|"[^"]*"|[^\s,;)}\]]+)""")
_KEY_OPTION = re.compile(r"(?i)(--(?:admin-)?api-key\s+)(\S+)")
_NO_KEY = frozenset(["none", "null", "''", '""', "[]", "[none]"])
REDACTED = "***"


def _redact_key_value(match):
    value = match.group(2)
    if value.lower() in _NO_KEY:
        return match.group(0)
    quote = value[0] if value[0] in "'\"" else ""
    if value.startswith("["):
        return match.group(1) + "['" + REDACTED + "']"
    return match.group(1) + quote + REDACTED + quote


def scrub_secrets(line):
    """The line with API key values replaced by ***, before any log text leaves the node."""
    if "key" not in line.lower():
        return line
    line = _KEY_ASSIGNMENT.sub(_redact_key_value, line)
    return _KEY_OPTION.sub(lambda m: m.group(1) + REDACTED, line)


def _decode_line(raw):
    return scrub_secrets(raw.decode("utf-8", "replace").rstrip("\r"))


# --------------------------------------------------------------------------------------------
# Calls that may hang (a dead NFS server): run on a daemon thread, wait with a deadline.


def _start_bounded(fn):
    box = {}

    def run():
        try:
            box["value"] = fn()
        except BaseException as exc:  # reported to the waiter, never raised on this thread
            box["error"] = exc

    thread = threading.Thread(target=run, name="llmgw-bounded", daemon=True)
    thread.start()
    return thread, box
