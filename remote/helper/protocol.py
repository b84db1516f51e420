#!/usr/bin/env python3
"""llmgw node helper: the only llmgw code that runs on a node.

One file, standard library only, Python >= 3.8. It never imports llmgw. The control plane
uploads it to ``ROOT/helper/llmgw_helper-<sha256>.py`` (ROOT defaults to ``~/.llmgw``) and
keeps one copy running per node over its SSH connection.

Starting and self-verification (R-1.3)
--------------------------------------
``python3 -I -c LOADER PATH HEX SIZE serve --expect-sha256 HEX [--root DIR]`` (or, by hand,
``python3 PATH serve --expect-sha256 HEX [--root DIR]``)

Every helper process, the engine supervisor included, is started through LOADER (a constant
below): it hashes the file, runs exactly the bytes it hashed, and deploys a missing copy from
stdin; ``-I`` keeps the node's PYTHON* variables and user site-packages out. Before anything
else the helper hashes its own file and compares the digest with HEX. The
expected hash always comes from the command line, never from a constant in this file (a file
checking itself against its own text proves nothing). On a mismatch it prints one JSON line
``{"fatal": "integrity", "expected": HEX, "actual": HEX}`` and exits with EXIT_INTEGRITY (97).
It then checks that the directory holding the file is owned by the current uid and not
accessible to group or others (mode & 0o077 == 0); otherwise it prints
``{"fatal": "permissions", "path", "mode": "0755", "owner": UID, "message"}`` and exits with
EXIT_PERMISSIONS (98). The same line and exit refuse a ROOT or ROOT/shards that is a link, owned
by another user or writable by group or others, and any directory above ROOT or the helper's
directory (as written and as resolved) that is owned by someone other than the user or root, or
writable by group or others without being sticky (/tmp is fine): as OpenSSH's StrictModes judges
a home, since whoever can replace a directory there could run code as this user or read engine
keys. Files under ROOT (state, logs, shard files) are opened through directory fds without
following links. A bad command line exits with 2 (argparse).

Wire protocol (R-1.2)
---------------------
JSON lines over stdin/stdout, UTF-8, one object per line.

- First line written: ``{"hello": {"protocol": 1, "version", "sha256", "python", "hostname",
  "boot_id", "pid", "root", "home"}}`` (root: the absolute state directory; home: ~).
- Request: ``{"id": <int or str>, "op": "<name>", "args": {...}}``.
- Answer: ``{"id", "ok": true, "result": {...}}`` or
  ``{"id", "ok": false, "error": {"kind": "<machine word>", "message": "<sentence>"}}``.
  Kinds (ERROR_KINDS): bad_request (a line that is not a request), unknown_op, bad_args, internal (an
  unexpected exception; the helper keeps running), cancelled, not_found, alive, identity,
  port_in_use, engine_missing, integrity, launch_failed, no_secret, too_large, stalled, permissions (a directory of the helper is a link or open to
  others), disk_full, cache_dir (the cache cannot be written), http, network,
  empty_source, weights_integrity (weights whose bytes are not the published or sealed ones),
  runtime_missing (the interpreter an environment is made from is not on the node),
  provision_failed (a step building an environment failed: the command and its last lines).
- Streamed event, zero or more before the answer: ``{"id", "event": "<name>", "data": {...}}``.

Requests are served concurrently: ping and cancel inline, every other request on a
worker thread (reused; another starts whenever none is idle), so a long fetch or a log follow never blocks status or ping. Output lines are written
under one lock and flushed one by one, so they never interleave. EOF on stdin cancels what is
running (follows, fetches) and exits 0; engines keep running because they are detached.

Unknown is null, never 0 (R-2.3, R-2.7).

Operations (args -> result)
---------------------------
ping {} -> {"time": unix float}

inventory {"images": [IMAGE, ...], "venvs": {KEY: RUNTIME}} -> {"hostname", "boot_id", "cpus",
    "memory_bytes": int|null, "nvidia_smi": "ok"|"absent"|"error", "nvidia_smi_error": str|null,
    "gpus": [{"index", "uuid", "name", "memory_total_mib", "memory_used_mib",
              "utilization_pct", "ecc_uncorrected", "healthy", "reasons": [str]}],
    "python": {"path", "version"},
    "containers": {"docker"|"podman": {"path": str|null, "answers": bool|null, "error": str|null,
                   "runtimes": [str]|null, "gpu": bool|null, "images": {IMAGE: bool}|null}},
    "venvs": {KEY: {"python", "found": bool|null, "interpreter", "version", "id",
              "built": bool|null, "error": str|null}}}
    No nvidia-smi on PATH means no GPUs, not an error (R-2.1). A GPU is unhealthy (R-2.2) with
    uncorrected ECC errors, an unreadable field ([GPU is lost], ERR!, [Unknown Error]), or
    memory held by a process that is not in the session of an engine this node runs.
    [N/A] and [Not Supported] are unknown (null), not unhealthy.
    What the node can run engines from (R-4.12): python is the interpreter running this helper,
    the one a venv without "python" is built with. containers has docker and podman: path null
    when not on PATH; answers whether `PROGRAM info` worked (docker's needs its daemon; false
    with the reason in error, null when it did not answer within CONTAINER_PROBE_WAIT: the probe
    goes on on a thread, and while it runs later inventories do not start another and answer
    null at once); runtimes docker's OCI runtimes; gpu whether it can give a container GPUs as
    launch asks (docker --gpus: the nvidia runtime or NVIDIA_HOOK on PATH, or CDI on with an
    NVIDIA spec in its CDI spec directories; podman --device
    nvidia.com/gpu=N: a CDI spec of kind nvidia.com/gpu in CDI_DIRS; null when not checked);
    images, for the asked IMAGEs (at most INVENTORY_IMAGES_MAX), whether each is present. venvs,
    for each asked venv RUNTIME (as provision's; at most INVENTORY_VENVS_MAX) under the caller's
    KEY: whether its interpreter is on this node (found, null when it did not say its version
    within INVENTORY_PYTHON_TIMEOUT), its resolved path and version, the recipe id, and whether
    its environment is built and sealed by this fleet (built, null without the fleet secret;
    the seal's tree walk is remembered per state of the seal file, launch checks it anyway).

storage {"dirs": [{"path", "shared": bool}], "timeout": 5} -> {"filesystems": [{"device":
    "MAJ:MIN", "fstype", "mount_point", "shared", "total_bytes", "free_bytes", "dirs"}],
    "missing": [path], "stuck": [path]}
    One entry per filesystem (st_dev), not per directory (R-2.4). A directory that does not
    answer within the timeout is stuck and skipped immediately by later calls until its probe
    returns. shared: network filesystem types or a directory the request marked shared (R-2.5).

holdings {"candidates": {KEY: [path, ...]}, "timeout": 10} -> {"held": {KEY: {"path",
    "bytes", "file", "verified"}}, "stuck": [path]}
    The first candidate holding weights: a non-empty regular file, or a directory with at least
    one regular file; a directory named llmgw-* only as a fetched entry llmgw made (R-2.6, see
    "Cache entries" below). file only for such an entry: its only file, as fetch reports it, or
    null when it holds more; verified too: whether its big files are as this node last hashed
    them (false: the control plane fetches it, which checks it by hash, before a launch).

fetch {"source": {"kind": "https", "urls": [...]} | {"kind": "hf", "repo", "revision",
    "endpoint"}, "cache_dir", "name": "llmgw-<hex>", "token": str|null, "max_bytes": int|null,
    "stall_timeout": 60}
    -> events "progress" {"bytes", "total": int|null}; answer {"path", "bytes", "file": str|null}
    An entry already complete there is checked by hash instead (events "checking" {"bytes",
    "total"}: bytes checked so far), big files only when this node has not hashed them as they
    are now; a mismatch fails the fetch (weights_integrity) and removes nothing.
    file: the path of the entry's only file when it holds one (a single URL's, saved under the
    unquoted last segment of its path, or "download" when that is empty or unsafe), else null.
    Written under cache_dir/.tmp-<name>-<random>/, marked complete with a sealed .llmgw-complete
    holding every file's SHA-256, hashed as it streamed in, and renamed to cache_dir/<name> only
    at the end (R-5.2); a hub file whose bytes do not match the hub's published hash fails the
    fetch (weights_integrity) and nothing is kept (R-5.6, see "Cache entries" below). A <name>
    that exists and is another user's is never used or removed: the fetch fails (cache_dir);
    one of this user's that "Cache entries" does not accept (unfinished, or sealed before
    content hashes) is downloaded again and replaced at the end.
    Refused (no_secret) before the control plane has handed over the fleet secret. Single-flight per cache dir and name:
    a second request attaches to the running download (R-5.3). total is known only when every
    file's length is. The token is sent as a bearer header to the source's host only, and is
    never logged or echoed; what it fetched is readable by this user only (directories 0700,
    files 0600; 0755/0644 without a token, whatever the umask). Bounded: no more than max_bytes
    in all (DEFAULT_FETCH_LIMIT without it), no file beyond the length its listing entry or
    Content-Length announced (too_large); a hub listing of at most HUB_LISTING_MAX_BYTES and
    HUB_LISTING_MAX_FILES; no byte for stall_timeout seconds fails the fetch (stalled).

source_size {"source", "token"} -> {"bytes": int|null, "files": int}
    What a fetch of that source would download, from the hub listing's sizes or HEAD requests;
    null when any length is unknown (R-5.1: the size is learned before placement).

provision {"runtime": RUNTIME} -> events "progress" {"phase": "venv"|"pip"|"post_install"|"seal",
    "line": str|null}; answer {"kind": "venv", "id": hex, "path", "bytes", "created": bool,
    "python": version, "installer": "pip"|"uv"}
    RUNTIME is {"kind": "venv", "packages": [requirement, ...] (one at least, none starting
    with "-"), "index_url": str|null, "extra_index_urls": [URL, ...], "find_links": [dir or URL,
    ...], "python": name on PATH |
    absolute path | null (the interpreter running this helper), "post_install": [shell command,
    ...]}; another kind is refused (bad_args). Builds the environment of that recipe once (see
    "Environments" below), single-flight per recipe on the node: a second request attaches to
    the running build and gets the same answer; the build is abandoned, its step killed and what
    it made removed, when its last waiter cancels or the helper's stdin ends. created is false
    when it was there already and sealed (its names, sizes and links as sealed, or its seal file
    unchanged since this helper found them so; the contents are checked by the launch that runs
    it). Steps: ``PY -m venv ENV``; then
    ``ENV/bin/python -m pip install --disable-pip-version-check --progress-bar off`` (or
    ``uv pip install --python ENV/bin/python`` when uv is on PATH) with ``--index-url X``, or
    ``--no-index`` when find_links are given without it or extra_index_urls, each
    ``--extra-index-url Z`` (an index asked beside the main one, e.g. PyTorch's CPU wheels),
    each ``--find-links Y``, and the
    packages; then each post_install command as ``sh -c CMD`` with ENV/bin first on PATH,
    VIRTUAL_ENV=ENV and ENV as working directory. Steps run with the helper's environment (the
    node's pip configuration, proxies and certificates included) without PYTHONPATH,
    PYTHONHOME, PIP_USER, PIP_TARGET, PIP_PREFIX or PIP_ROOT. progress: each step's start
    (line null, or what it is doing), then its output lines, at most one each
    PROGRESS_INTERVAL (the step's last line always). Refused: no_secret before the fleet secret
    is handed over; runtime_missing when the python is not found (naming it and the PATH) or
    does not run; integrity when a directory llmgw did not build or seal is at the
    environment's path, or a sealed one was changed (never removed, never run);
    provision_failed when a step fails (the command, its status and its last ENV_OUTPUT_LINES
    lines); disk_full when the disk fills (naming the directory). After any failure nothing of
    the build is left.
    RUNTIME may instead be {"kind": "container", "image", "container": "docker"|"podman"|null
    (null: the first on PATH), "pull": "if_missing"|"always", "shm_size": bytes|null, "mounts":
    [dir], "labels": {name: value}}; the answer is then {"kind": "container", "image",
    "image_id", "program", "pulled": bool}. An image present is used without a registry (unless
    pull is always); a missing one is pulled (``PROGRAM pull IMAGE``, the helper's environment,
    so the node's DOCKER_HOST and registry credentials), single-flight per program and image,
    progress {"phase": "pull", "line"} being its output lines. Refused: runtime_missing when the
    program is not on PATH or its daemon does not answer (naming DOCKER_HOST);
    provision_failed when the pull fails (the image, the pull's last lines and the ``docker load
    -i FILE`` command for a node without a registry). Each image used is recorded (see envs).

envs {"wanted": {KEY: RUNTIME}|absent} -> {"envs": [{"kind": "venv", "name", "id", "path", "bytes", "created_at", "last_used",
    "sealed": bool, "python", "packages", "installer", "reason", "used_by": [shard_id]}],
    "images": [{"kind": "image", "name": "img-<32 hex>", "image", "program", "id", "bytes",
    "first_used", "last_used", "pulled": bool, "present": bool|null, "used_by", "reason"}]}
    Every directory named venv-<32 hex> under ROOT/envs. reason (null when sealed) says why one
    is not usable: being built, left half-built (the next provision of its recipe replaces it),
    or not llmgw's / changed after its seal (never run or removed). last_used: the seal's mtime,
    set when it was built and at each launch from it; used_by: live shards running from it. id,
    python, packages, created_at and installer are known (not null) only for a sealed one.
    images: every image a container runtime's provision or launch used here, from the record
    ROOT/images/img-<digest of program and image>.json (0600, under an HMAC of the fleet
    secret; reason says why a record is not trusted): its id, when first and last used, whether
    llmgw pulled it (false when it was there already), and now (docker image inspect) whether it
    is present and its size; null where the daemon did not answer. With "wanted" (the control
    plane's profiles' runtimes) the answer adds "wanted": {KEY: {"name": the venv-... or img-...
    name that runtime provisions here, or null, "error": why it cannot be told (no such
    interpreter, no container program)}}, so that what no profile wants is known exactly.

launch {"shard_id", "argv", "env", "port", "host", "health_url", "gpus", "files",
    "file_sha256", "runtime"} -> {"shard_id", "pid", "pgid", "start_time", "argv", "log_path",
    "started_at"}
    The engine runs under a supervisor (this file in supervise mode) in a new session; the
    supervisor records ROOT/shards/<shard_id>/state.json atomically, and the exit code
    (negative signal number when killed) and end time when the engine exits (R-4.4). env
    (secrets included) travels through the supervisor's stdin and reaches only the engine's
    environment, never an argv (R-1.6). gpus sets CUDA_VISIBLE_DEVICES. files {NAME: text} are
    written 0600 into the shard directory first (an engine that takes its key only from a config
    file, a module the engine loads), and file_sha256 {NAME: HEX} is checked against the bytes
    written (integrity when they differ; nothing is started); "{shard_dir}" inside an argv
    element or an env value is replaced by that directory, and the answer's argv is the one
    really started. A port in use is refused (port_in_use), a live shard too
    (alive), and an argv[0] that is not an executable found with the launch env's PATH
    (engine_missing, naming the program and the PATH searched). A cache entry the argv names
    that is not sealed, or whose files do not hash to what it was sealed with, is refused
    (weights_integrity; nothing is started or removed; see "Cache entries"). With runtime (the
    RUNTIME of provision; null: the program on the node's PATH) the engine runs from that
    recipe's environment: ENV/bin first on PATH, VIRTUAL_ENV=ENV, PYTHONDONTWRITEBYTECODE=1
    unless env sets it, and a bare argv[0] found in ENV/bin named by its path; checked first,
    the environment missing or unfinished is engine_missing (provision builds it), one that is
    not sealed by this fleet or whose files are not as sealed is integrity (nothing is started
    or removed). The shard's state records {"kind", "id"} of the runtime (status's "runtime").
    With a container RUNTIME the supervisor runs ``PROGRAM run --rm --name llmgw-SHARD --cidfile
    SHARD_DIR/container.id --network host --workdir SHARD_DIR --entrypoint ARGV0 (--shm-size N
    | --ipc host) --label ... --volume DIR:DIR:ro ... --env NAME ... IMAGE ARGV[1:]``: the
    labels are the runtime's plus llmgw.shard and llmgw.fleet (a digest of the fleet secret),
    the volumes the shard directory and each existing mount, env values travel in the
    supervisor's environment and only their names in the argv (PATH is left to the image);
    GPUs as ``--gpus "device=A,B"`` (the NVIDIA container toolkit), or ``--device
    nvidia.com/gpu=N`` each for podman and for a docker whose CDI spec directories hold an
    nvidia.com/gpu spec. The image must be present (engine_missing: provision pulls it); a
    container of that name llmgw did not label for this shard and fleet is refused (identity)
    and left alone, a stopped one of ours removed first. The shard's state records the
    container's id, start time, main pid and image id (status's "container"); status checks
    the id, labels and start time (a container gone or replaced is not alive); stop runs
    ``PROGRAM stop --time GRACE`` then ``rm -f``; logs read the supervisor's log, which holds
    the container's output.

status {"probe": false, "timeout": 2} -> {"shards": [{"shard_id", "pid", "pgid", "start_time",
    "argv", "gpus", "port", "health_url", "started_at", "alive", "exit_code", "ended_at", "runtime",
    "health": {"status": int|null, "error": str|null}|null, "log_tail": [str]|null}]}
    alive means identity holds: same boot, same pid start time (field 22 of /proc/PID/stat),
    and the command line recorded when the engine started (or the recorded supervisor is still
    its parent); a pid alone is never trusted (R-4.4). health only with probe, for live shards
    with a health URL (R-4.7); an answer counts only when every LISTEN socket on the URL's port
    is held by a process of the engine's group (/proc/net/tcp{,6} inodes against
    /proc/PID/fd), else status is null and error says the port is held by another process.
    log_tail (last 50 lines) only for shards that are not alive.

stop {"shard_id", "grace": 10} -> {"was_alive", "stopped"}
    Identity first: on a mismatch the answer is kind identity and nothing is signalled. TERM to
    the process group, KILL after the grace. stopped: nothing of the engine runs any more.

forget {"shard_id"} -> {}      removes the shard's state directory; refused (alive) while live.

logs {"shard_id", "lines": 100, "follow": false} -> {"lines": [str]}
    Here and in status's log_tail, API key values an engine printed (SGLang logs its server
    arguments, api_key included) are replaced by ***.
    With follow: event "lines" {"lines": [...]} with the last N, then with new lines as they
    are written, until cancelled; then the answer {"lines": []}.

reclaim {"cache_dir", "names": [str]|null, "collect": false} -> {"entries": [{"name", "path",
    "bytes", "action": "listed"|"removed"|"refused", "reason"}]}
    Every name is checked again on the node (R-5.5): the cache-name pattern, no traversal, the
    cache directory is a real directory, realpath + commonpath inside it and never it, the entry
    is not a link and is this user's; removal is fd-relative and never follows a symbolic link.
    A download's temp dir holds a lease (.llmgw-lease: hostname, boot id, pid; its mtime renewed
    every LEASE_RENEW s): on a cache several nodes share, a temp dir whose lease is alive (this
    node: the pid still runs; another node: renewed within LEASE_FRESH), or that is younger than
    LEASE_GRACE without a lease, is neither listed nor removed, nor the entry it is for.
    A listed or removed entry carries "last_used": the mtime of its completion marker (set when
    the fetch completed and again whenever launch starts an engine whose argv names a path in
    the entry), null without a marker.
    With "until_free": BYTES (the automatic clean-up at a low-water mark; needs collect and
    names, in the order to remove them), each name must also be a complete entry sealed with
    this fleet's secret (a leftover temp dir or another fleet's entry is refused), and removal
    stops as soon as the cache's filesystem has BYTES free (statvfs f_bavail): the names left are
    answered "kept". The answer then adds "free_bytes", the filesystem's free bytes after.
    With "envs": [NAME] (environment names, venv-<32 hex>; cache_dir may then be left out) the
    answer adds "envs", entries of the same shape for those environments: one is listed or
    (collect) removed only when llmgw built it (sealed, or left half-built by a build of this
    fleet), no build holds it and no live shard runs from it (refused with that reason);
    removal makes its read-only directories writable on the way, fd-relative as above.
    With "images": [NAME] (image record names, img-<32 hex>) the answer adds "images" of the
    same shape ("path" is the image reference): one is listed or (collect) removed with
    ``docker rmi IMAGE`` (never forced) only when its record is this fleet's, says llmgw pulled
    it, the image is still the one pulled and no live shard's container runs it.

cancel {"target": request id} -> {"cancelled": bool}     ends a log follow, a fetch or provision wait.

fleet_secret {"secret": hex} -> {"stored": true}
    The control plane's fleet secret, sent right after hello on every start (never in an argv,
    never echoed, not even in a refusal); kept in ROOT/fleet.key (0600) for later starts and for
    the one-shot commands.

Trust model
-----------
The helper trusts only what llmgw made, because a node is shared with other users: the code it
runs (LOADER runs the bytes it hashed, with -I), the directories it keeps state and keys in
(ROOT, ROOT/shards and everything above them, judged as StrictModes judges a home; files in
them opened without following links), the cache entries it serves or reports and the
environments it runs engines from (below). A
directory others can write is therefore never a way to run code as this user, read an engine's
key, plant weights, or delete another node's download. Downloads are bounded (fetch) and what
a hub token fetched stays private to this user.

Environments (R-4.11)
---------------------
An environment lives at ROOT/envs/venv-<first 32 hex of its recipe id>/ (ROOT/envs 0700, as
ROOT/shards). The recipe id is the SHA-256 of the canonical JSON (sorted keys, no spaces) of
{"kind": "venv", "python": the version the interpreter reports, "interpreter": its resolved
path, "packages", "index_url", "find_links", "post_install"}. A venv cannot be moved once
built (its scripts name their interpreter by path), so it is built at its final path: first
the directory (0700) and a building mark, .llmgw-building, holding an HMAC of the name and the
id keyed by the fleet secret; last the seal, .llmgw-complete (format ENV_MARKER_FORMAT), after
every write permission below it was taken off (an engine run from it cannot add bytecode or
change a file) and every file hashed: its "seal" is entry_seal with ENV_SEAL_CONTEXT over every
file's relative path, size and SHA-256, every symbolic link's target and the recipe. The mark
then goes and the top directory becomes read-only (0500). A build holds ROOT/envs/.lock-<name>
(flock), so two helper processes of the node never build one environment at once.

So what is at an environment's path is one of: sealed (it is used, once its files are found as
sealed: every file's size against the seal, and its SHA-256 whenever its (device, inode, size,
mtime, ctime) differ from what this node recorded when it last hashed it, in the record
weights use; any write changes ctime, so a changed file is hashed and refused); ours and
unfinished (the building mark, no seal, no build holding its lock: a cut-off build, removed and
rebuilt by the next provision); or anything else (no valid mark, another owner, a link, a file
added, changed or removed after the seal, a forged seal), which is refused with the reason
(integrity) and never run nor removed.

Cache entries (R-2.6, R-5.2, R-5.5, R-5.6)
------------------------------------------
A cache directory may be writable by others (a shared filer, a scratch space), so a directory
named llmgw-* there counts as fetched weights only when it is a real directory (not a link)
owned by the helper's user, holds only regular files and directories of that user that nobody
else can write, and has a completion marker (format MARKER_FORMAT) whose "sha256" gives every
file's SHA-256 ({relative path: hex}) and whose "seal" is HMAC-SHA256, keyed by the fleet
secret, of the cache name and every file's relative path, size and SHA-256. So weights one node
of the fleet fetched onto a shared filer are accepted by the others, and a directory someone
else planted is never served nor reported as held.

Every node holds the secret, so the seal only proves that some node of the fleet wrote the
marker; what an engine loads is checked by content. fetch hashes each file as its bytes stream
to disk, and a hub file whose bytes do not hash to what the hub listing publishes (lfs.sha256,
or lfs.oid, for a file in LFS; the git blob id, sha1 of "blob SIZE\0" + bytes, for one kept in
git) fails the fetch (weights_integrity, naming the file and both hashes; nothing is kept). A
listing that publishes no hash for a file, and an https source, have their hashes recorded only.
launch, before anything is written or started, checks every entry its argv names (a path with
an llmgw-<hex> component): it must be sealed as above, and every file must hash to its sealed
SHA-256, or the launch is refused (weights_integrity, naming the file and both hashes) and
nothing is removed. Files of ALWAYS_VERIFIED_SUFFIXES, tokenizer*, and any file of at most
ALWAYS_VERIFIED_BYTES are hashed at every launch; bigger ones only when their (device, inode,
size, mtime, ctime) differ from the stamp this node recorded when it last hashed them (or
fetched them) with that SHA-256. The record is ROOT/verified-<hostname>.json (0600), never on a
cache's filer. A marker without hashes (from a helper that kept none) does not count: the entry
is not held, a launch naming it is refused, and the next fetch downloads the weights again and
replaces it. Hashing and resealing it instead would trust whatever a node had written into it.

One-shot mode for operators (R-1.4)
-----------------------------------
``python3 llmgw_helper.py inventory|storage|holdings|status|logs|reclaim|envs ... [--json]``
prints the result the control plane sees, readable by default (unknown shown as ``-``), exact
JSON with --json. ``provision PACKAGE... [--find-links DIR]... [--index-url URL] [--extra-index-url URL]... [--python PY]
[--post-install CMD]...`` builds an environment by hand (its progress on stderr; it needs the
fleet secret a serve stored in ROOT). Destructive operations (launch, stop, forget, fetch,
reclaim with collect) are reachable only through ``serve --expect-sha256``.
"""

import argparse
import errno
import fcntl
import hashlib
import hmac
import json
import os
import platform
import queue
import re
import secrets
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import urllib.parse

http = ssl = None  # imported on the first download (load_web_modules)

HELPER_VERSION = "0.1.0"
PROTOCOL_VERSION = 1

EXIT_OK = 0
EXIT_USAGE = 2
EXIT_INTEGRITY = 97
EXIT_PERMISSIONS = 98

DEFAULT_ROOT = "~/.llmgw"
STATE_FILE = "state.json"
LOG_FILE = "engine.log"
CONTAINER_ID_FILE = "container.id"  # written by `docker run --cidfile`
COMPLETE_MARKER = ".llmgw-complete"
LEASE_FILE = ".llmgw-lease"  # in a download's temp dir: who is writing it; renewed while it runs
LEASE_RENEW = 15.0
LEASE_FRESH = 300.0  # a lease renewed this recently is a download in progress (generous: clocks of a filer's clients differ)
LEASE_GRACE = 30.0  # a temp dir this young without a lease may be a download just starting
FLEET_SECRET_FILE = "fleet.key"
FLEET_SECRET_RE = re.compile(r"[0-9a-f]{32,128}")
MARKER_FORMAT = 3  # 3: the seal covers every file's SHA-256 (2: names and sizes only)
SEAL_CONTEXT = b"llmgw cache entry v3\n"
SHA256_RE = re.compile(r"[0-9a-f]{64}")
# Files hashed again at every launch, whatever the node-local record says: code and
# configuration an engine reads (a model's *.py runs as this user), and anything small.
ALWAYS_VERIFIED_BYTES = 4 << 20
ALWAYS_VERIFIED_SUFFIXES = (".py", ".json", ".jinja", ".txt", ".model", ".tiktoken")
VERIFIED_RECORD_MAX = 200000  # files the node-local record of verified big files keeps
HASH_CHUNK = 1 << 20

# Cache entries carry the hash of their canonical source; anything else in a cache directory
# was put there by someone else and is never touched.
CACHE_NAME_RE = re.compile(r"llmgw-[0-9a-f]{16,64}")
TEMP_NAME_RE = re.compile(r"\.tmp-(llmgw-[0-9a-f]{16,64})-[A-Za-z0-9_]{1,64}")
SHARD_ID_RE = re.compile(r"[A-Za-z0-9._-]{1,128}")
SHARD_FILE_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
SHARD_DIR_PLACEHOLDER = "{shard_dir}"

# Environments the helper builds for an engine (runtime: venv), one per recipe under ROOT/envs.
RUNTIME_KINDS = ("venv", "container")  # what a launch's and a provision's runtime may name
ENVS_DIR = "envs"
ENV_NAME_RE = re.compile(r"venv-[0-9a-f]{32}")
ENV_BUILDING_MARKER = ".llmgw-building"  # written first: llmgw is building this directory
ENV_MARKER_FORMAT = 1
ENV_SEAL_CONTEXT = b"llmgw environment v1\n"
ENV_MARK_CONTEXT = b"llmgw environment being built v1\n"
ENV_OUTPUT_LINES = 15  # lines of a failed step's output its error quotes
PYTHON_QUERY_TIMEOUT = 30.0
# What a failed step's output says when the disk filled (errno 28 ENOSPC, 122 EDQUOT).
_DISK_FULL_OUTPUT = re.compile(r"\[Errno (?:28|122)\]|No space left on device|Disk quota exceeded")

NVIDIA_SMI_TIMEOUT = 10.0
GPU_QUERY_FIELDS = (
    "index",
    "uuid",
    "name",
    "memory.total",
    "memory.used",
    "utilization.gpu",
    "ecc.errors.uncorrected.volatile.total",
)
COMPUTE_APPS_FIELDS = ("gpu_uuid", "pid", "used_memory")

# Filesystems that many nodes mount at once. Anything else is local: a local disk mistaken for
# shared would vanish from the node's free space, a filer mistaken for local would be counted
# once per node.
SHARED_FSTYPES = frozenset(
    [
        "nfs",
        "nfs4",
        "lustre",
        "cifs",
        "smb3",
        "smbfs",
        "gpfs",
        "beegfs",
        "ceph",
        "cephfs",
        "glusterfs",
        "fuse.glusterfs",
        "fuse.cephfs",
        "fuse.ceph",
        "fuse.ceph-fuse",
        "wekafs",
    ]
)

DEFAULT_STORAGE_TIMEOUT = 5.0
DEFAULT_HOLDINGS_TIMEOUT = 10.0
DEFAULT_PROBE_TIMEOUT = 2.0
DEFAULT_STOP_GRACE = 10.0
DEFAULT_LOG_LINES = 100
MAX_LOG_LINES = 100000
LOG_TAIL_LINES = 50
LOG_FOLLOW_INTERVAL = 0.1
LAUNCH_TIMEOUT = 30.0
KILL_WAIT = 5.0
WALK_LIMIT = 200000
HTTP_TIMEOUT = 60.0
DEFAULT_STALL_TIMEOUT = 60.0  # a download that sends no byte for this long has failed
DEFAULT_FETCH_LIMIT = 2 * 1000**4  # bytes one fetch may write when the request gives no cap
HUB_LISTING_MAX_BYTES = 32 << 20
HUB_LISTING_MAX_FILES = 50000
FETCH_CHUNK = 1 << 20
PROGRESS_INTERVAL = 0.25

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)

# The verifying loader every helper process starts through, as ``python3 -I -c LOADER PATH HEX
# SIZE ARGS...`` (the control plane reads this constant from this file): it reads the file once,
# hashes those bytes and runs exactly them, so a copy swapped between the check and the run is
# never what runs; -I keeps PYTHON* variables, the user's site-packages and the working
# directory out of the interpreter. With SIZE a number, a missing or different copy is replaced:
# it says {"upload": HEX, "found"}, reads SIZE bytes from stdin, checks them (exit 97 on a
# mismatch, 96 when stdin ends early), writes them atomically (directories it creates are 0700)
# and runs them. With SIZE "-" (the engine supervisor, whose stdin is its spec) nothing is
# uploaded: a different copy is the fatal integrity line and exit 97.
LOADER = (
    "import hashlib,json,os,sys\n"
    "p,h,n=sys.argv[1],sys.argv[2],sys.argv[3]\n"
    "def say(m):\n"
    " sys.stdout.write(json.dumps(m)+'\\n');sys.stdout.flush()\n"
    "try:\n"
    " d=open(p,'rb').read()\n"
    "except OSError:\n"
    " d=None\n"
    "a=d and hashlib.sha256(d).hexdigest()\n"
    "if a!=h and n=='-':\n"
    " say({'fatal':'integrity','expected':h,'actual':a});sys.exit(97)\n"
    "if a!=h:\n"
    " say({'upload':h,'found':'missing' if d is None else 'mismatch'})\n"
    " r=sys.stdin.buffer;d=b'';n=int(n)\n"
    " while len(d)<n:\n"
    "  c=r.read(n-len(d))\n"
    "  if not c:sys.exit(96)\n"
    "  d+=c\n"
    " a=hashlib.sha256(d).hexdigest()\n"
    " if a!=h:\n"
    "  say({'fatal':'integrity','expected':h,'actual':a});sys.exit(97)\n"
    " q=os.path.dirname(p)\n"
    " for x in (os.path.dirname(q),q):\n"
    "  if x and not os.path.isdir(x):os.mkdir(x,0o700)\n"
    " t='%s.%d.tmp'%(p,os.getpid())\n"
    " with os.fdopen(os.open(t,os.O_WRONLY|os.O_CREAT|os.O_EXCL,0o600),'wb') as o:o.write(d)\n"
    " os.replace(t,p)\n"
    "sys.argv=[p]+sys.argv[4:]\n"
    "exec(compile(d,p,'exec'),{'__name__':'__main__','__file__':p,'__builtins__':__builtins__,"
    "'__llmgw_loaded__':a})\n"
)


def loader_argv(python, path, sha256, size, args):
    """The command line that starts this helper's file through LOADER (see above)."""
    return [python, "-I", "-c", LOADER, path, sha256, str(size)] + list(args)


# Every kind of error an answer can carry (the docstring says what each means); the control
# plane maps each to its own exception class.
ERROR_KINDS = (
    "bad_request", "unknown_op", "bad_args", "internal", "cancelled", "not_found", "alive", "identity",
    "port_in_use", "engine_missing", "integrity", "launch_failed", "no_secret", "too_large", "stalled",
    "permissions", "disk_full", "cache_dir", "http", "network", "empty_source", "weights_integrity",
    "runtime_missing", "provision_failed",
)


class HelperError(Exception):
    """A failure the caller is told about: kind is a machine word (one of ERROR_KINDS), message
    a sentence."""

    def __init__(self, kind, message):
        Exception.__init__(self, message)
        self.kind = kind
        self.message = message


class Unanswered(HelperError):
    """A check that could not be made in time: what it asked stays unknown (null in inventory),
    which is not an answer that it is missing."""


def bad_args(message):
    return HelperError("bad_args", message)


# --------------------------------------------------------------------------------------------
# Argument checking


_REQUIRED = object()
_MISSING = object()


def _type_ok(value, kinds):
    if isinstance(value, bool):
        return bool in kinds
    if float in kinds and isinstance(value, int):
        return True
    return isinstance(value, kinds)


def _arg(args, name, kinds, default=_REQUIRED):
    """Return args[name] checked against kinds; a missing or null optional gives default."""
    value = args.get(name, _MISSING)
    if value is _MISSING or (value is None and default is not _REQUIRED):
        if default is _REQUIRED:
            raise bad_args("missing argument %r" % name)
        return default
    if not _type_ok(value, kinds):
        wanted = " or ".join(k.__name__ for k in kinds)
        raise bad_args("argument %r must be %s, got %s" % (name, wanted, type(value).__name__))
    return value


def _arg_timeout(args, name, default, upper=3600.0):
    value = float(_arg(args, name, (float,), default))
    if not (0 < value <= upper):
        raise bad_args("argument %r must be between 0 and %g seconds, got %r" % (name, upper, value))
    return value


def _arg_shard_id(args):
    shard_id = _arg(args, "shard_id", (str,))
    # "." and ".." match the character class but would name the shards directory or its parent.
    if not SHARD_ID_RE.fullmatch(shard_id) or shard_id in (".", ".."):
        raise bad_args("shard_id %r must be 1-128 of A-Z a-z 0-9 . _ - (and not . or ..)" % shard_id)
    return shard_id


def _arg_runtime(args):
    """A request's runtime (None: the engine program on the node's PATH); its kind is checked
    here, its fields by the part of Node that handles that kind."""
    runtime = _arg(args, "runtime", (dict,), None)
    if runtime is not None and runtime.get("kind") not in RUNTIME_KINDS:
        raise bad_args("runtime.kind must be one of %s, got %r" % (", ".join(RUNTIME_KINDS), runtime.get("kind")))
    return runtime


def _arg_path(args, name, default=_REQUIRED):
    path = _arg(args, name, (str,), default)
    if path is None:
        return None
    path = os.path.expanduser(path)
    if not path or "\0" in path or not os.path.isabs(path):
        raise bad_args("argument %r must be an absolute path, got %r" % (name, path))
    return os.path.normpath(path)
