# Parsers: pure functions of the text a command or a /proc file printed.

# Cells nvidia-smi prints when it has no value: unknown, not a fault.
_UNKNOWN_CELLS = frozenset(
    [
        "",
        "n/a",
        "[n/a]",
        "[not supported]",
        "not supported",
        "[requested functionality has been deprecated]",
        "[insufficient permissions]",
    ]
)
_NUMBER_CELL = re.compile(r"(-?\d+)(?:\.\d+)?(?:\s*(?:MiB|%))?")


def _read_cell(raw):
    """Return (value, fault): value is None when unknown; fault is the text of an error cell."""
    text = raw.strip()
    if text.lower() in _UNKNOWN_CELLS:
        return None, None
    if (text.startswith("[") and text.endswith("]")) or "ERR!" in text.upper():
        return None, text
    return text, None


def _read_int_cell(raw):
    value, fault = _read_cell(raw)
    if value is None:
        return None, fault
    match = _NUMBER_CELL.fullmatch(value)
    if match is None:
        return None, value
    return int(match.group(1)), None


def parse_gpu_csv(text):
    """Parse ``nvidia-smi --query-gpu=<GPU_QUERY_FIELDS> --format=csv,noheader,nounits``.

    Returns {"gpus": [...], "unparsed": [lines]}: lines with another shape (the message
    nvidia-smi prints in place of a lost GPU's row, for instance) are kept, not dropped.
    """
    gpus = []
    unparsed = []
    for line in text.splitlines():
        if not line.strip():
            continue
        cells = [cell.strip() for cell in line.split(",")]
        if len(cells) != len(GPU_QUERY_FIELDS):
            unparsed.append(line.strip())
            continue
        if cells[0] == "index":  # a header line, when asked without noheader
            continue
        faults = []  # (field, fault) in column order; one reason per distinct fault
        index, fault = _read_int_cell(cells[0])
        if fault is not None:
            faults.append(("index", fault))
        if index is None:
            # nvidia-smi lists GPUs in index order, so the position is the best stand-in.
            index = len(gpus)
        values = {}
        for field, key, numeric in (
            ("uuid", "uuid", False),
            ("name", "name", False),
            ("memory.total", "memory_total_mib", True),
            ("memory.used", "memory_used_mib", True),
            ("utilization.gpu", "utilization_pct", True),
            ("ecc.errors.uncorrected.volatile.total", "ecc_uncorrected", True),
        ):
            raw = cells[GPU_QUERY_FIELDS.index(field)]
            value, fault = _read_int_cell(raw) if numeric else _read_cell(raw)
            values[key] = value
            if fault is not None:
                faults.append((field, fault))
        reasons = []
        for fault in sorted(set(f for _, f in faults), key=[f for _, f in faults].index):
            fields = [name for name, f in faults if f == fault]
            if len(fields) >= 6:  # a lost GPU reads the same in every field: say it once
                reasons.append("every field reads %s" % fault)
            else:
                reasons.append("%s %s %s" % (", ".join(fields), "reads" if len(fields) == 1 else "read", fault))
        ecc = values["ecc_uncorrected"]
        if ecc is not None and ecc > 0:
            reasons.append("%d uncorrected ECC error%s (volatile)" % (ecc, "" if ecc == 1 else "s"))
        gpu = {"index": index}
        gpu.update(values)
        gpu["healthy"] = not reasons
        gpu["reasons"] = reasons
        gpus.append(gpu)
    return {"gpus": gpus, "unparsed": unparsed}


def parse_compute_apps_csv(text):
    """Parse ``nvidia-smi --query-compute-apps=gpu_uuid,pid,used_memory --format=csv,noheader,nounits``.

    Returns [{"gpu_uuid", "pid", "used_memory_mib": int|null}]; other lines (a header, "No
    running processes found") are skipped.
    """
    apps = []
    for line in text.splitlines():
        cells = [cell.strip() for cell in line.split(",")]
        if len(cells) != len(COMPUTE_APPS_FIELDS):
            continue
        uuid, _ = _read_cell(cells[0])
        pid, _ = _read_int_cell(cells[1])
        if uuid is None or pid is None:
            continue
        used, _ = _read_int_cell(cells[2])
        apps.append({"gpu_uuid": uuid, "pid": pid, "used_memory_mib": used})
    return apps


_MEMINFO_UNITS = {"kb": 1024, "mb": 1024 * 1024, "gb": 1024 * 1024 * 1024}


def parse_meminfo(text):
    """Parse /proc/meminfo into {field: value}; values with a unit are in bytes, counts as is."""
    fields = {}
    for line in text.splitlines():
        key, sep, rest = line.partition(":")
        parts = rest.split()
        if not sep or not parts or not parts[0].isdigit():
            continue
        value = int(parts[0])
        if len(parts) > 1:
            scale = _MEMINFO_UNITS.get(parts[1].lower())
            if scale is None:
                continue
            value *= scale
        fields[key.strip()] = value
    return fields


_OCTAL_ESCAPE = re.compile(r"\\([0-7]{3})")


def _unescape_mount_field(text):
    return _OCTAL_ESCAPE.sub(lambda match: chr(int(match.group(1), 8)), text)


def parse_mountinfo(text):
    """Parse /proc/self/mountinfo into a list of mounts, in file order.

    Each: {"mount_id", "parent_id", "device": "MAJ:MIN", "root", "mount_point", "fstype",
    "source"}, with octal escapes (\\040 ...) decoded. Super options may hold unescaped spaces
    (cifs unc=, 9p path=), so only the text before them is split. Lines in /proc/mounts format
    are accepted too, with mount_id, parent_id, device and root null.
    """
    mounts = []
    for line in text.splitlines():
        if not line.strip():
            continue
        head, sep, tail = line.partition(" - ")
        if sep:
            fields = head.split(" ")
            post = tail.split(" ", 2)
            if len(fields) < 6 or len(post) < 2:
                continue
            if not (fields[0].isdigit() and fields[1].isdigit()):
                continue
            mounts.append(
                {
                    "mount_id": int(fields[0]),
                    "parent_id": int(fields[1]),
                    "device": fields[2],
                    "root": _unescape_mount_field(fields[3]),
                    "mount_point": _unescape_mount_field(fields[4]),
                    "fstype": post[0],
                    "source": _unescape_mount_field(post[1]),
                }
            )
            continue
        fields = line.split()
        if len(fields) < 6 or not (fields[-1].isdigit() and fields[-2].isdigit()):
            continue
        mounts.append(
            {
                "mount_id": None,
                "parent_id": None,
                "device": None,
                "root": None,
                "mount_point": _unescape_mount_field(fields[1]),
                "fstype": fields[2],
                "source": _unescape_mount_field(fields[0]),
            }
        )
    return mounts


def _path_is_under(path, top):
    if top == "/":
        return path.startswith("/")
    return path == top or path.startswith(top.rstrip("/") + "/")


def find_mount(mounts, path, device=None):
    """Return the mount that holds path (already a realpath), or None.

    The longest mount point that prefixes the path wins; among equals the later line (it is
    mounted over the earlier). A mount whose device matches the path's st_dev is preferred,
    which settles stacked mounts such as an autofs placeholder under its real filesystem.
    """
    best = None
    best_key = None
    for order, mount in enumerate(mounts):
        if not _path_is_under(path, mount["mount_point"]):
            continue
        key = (device is not None and mount["device"] == device, len(mount["mount_point"]), order)
        if best_key is None or key > best_key:
            best, best_key = mount, key
    return best


def is_shared_fstype(fstype):
    return fstype is not None and fstype.lower() in SHARED_FSTYPES


def parse_proc_stat(text):
    """Parse /proc/PID/stat: {"state", "ppid", "pgid", "session", "start_time"} or None.

    The command name sits in parentheses and may itself hold spaces and parentheses, so the
    fields are counted from the last ")".
    """
    rparen = text.rfind(")")
    if rparen < 0:
        return None
    rest = text[rparen + 1 :].split()
    if len(rest) < 20:
        return None
    try:
        return {
            "state": rest[0],
            "ppid": int(rest[1]),
            "pgid": int(rest[2]),
            "session": int(rest[3]),
            "start_time": int(rest[19]),  # field 22: clock ticks since boot
        }
    except ValueError:
        return None


def mark_foreign_gpu_memory(gpus, apps, own_sessions, session_of):
    """Mark GPUs holding memory of a process llmgw did not start as unhealthy (R-2.2).

    session_of(pid) gives the session id of a process or None when it cannot be seen; such a
    process is not one of ours either.
    """
    by_uuid = dict((gpu["uuid"], gpu) for gpu in gpus if gpu.get("uuid"))
    for app in apps:
        gpu = by_uuid.get(app["gpu_uuid"])
        if gpu is None:
            continue
        session = session_of(app["pid"])
        if session is not None and session in own_sessions:
            continue
        held = "memory" if app["used_memory_mib"] is None else "%d MiB" % app["used_memory_mib"]
        gpu["reasons"].append("%s held by pid %d (not started by llmgw)" % (held, app["pid"]))
        gpu["healthy"] = False
    return gpus
