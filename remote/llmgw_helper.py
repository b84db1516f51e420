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

# This file is built by scripts/build-helper from the modules in remote/helper/ (each begins where
# a line names it): edit those, then run ./scripts/build-helper. A unit test checks that this
# file is the build's output, byte for byte; it stays one file, the one the loader hashes.

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
# was put there by someone else and is never touched (R-5.5).
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
# once per node (R-2.5).
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


# ---- remote/helper/parsers.py --------------------------------------------------------------
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


# ---- remote/helper/machine.py --------------------------------------------------------------
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


# ---- remote/helper/cache.py ----------------------------------------------------------------
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


# ---- remote/helper/shared.py ---------------------------------------------------------------
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


# ---- remote/helper/inventory.py ------------------------------------------------------------
# Inventory: what the machine is and which GPUs are usable (R-2.1, R-2.2).


class Inventory(object):
    """inventory: a part of Node (below). The container programs are asked through the
    containers part, the venv recipes through the venvs part."""

    def __init__(self, root_dir, venvs, containers):
        self.root_dir = root_dir
        self.venvs = venvs
        self.containers = containers

    def op_inventory(self, args, ctx):
        images = _arg(args, "images", (list,), [])
        if len(images) > INVENTORY_IMAGES_MAX:
            raise bad_args("at most %d images may be asked about, got %d" % (INVENTORY_IMAGES_MAX, len(images)))
        for image in images:
            _check_image(image)
        venvs = _arg(args, "venvs", (dict,), {})
        if len(venvs) > INVENTORY_VENVS_MAX:
            raise bad_args("at most %d venv recipes may be asked about, got %d" % (INVENTORY_VENVS_MAX, len(venvs)))
        specs = {}
        for key, runtime in venvs.items():
            if not isinstance(runtime, dict) or runtime.get("kind") != "venv":
                raise bad_args("venvs[%r] must be a venv runtime" % (key,))
            specs[key] = check_venv_runtime(runtime)
        # The container programs answer on threads while the GPUs and environments are looked at.
        probes = self.containers.start_container_probes(sorted(set(images)))
        meminfo = _read_text("/proc/meminfo")
        memory = parse_meminfo(meminfo).get("MemTotal") if meminfo else None
        result = {
            "hostname": socket.gethostname(),
            "boot_id": read_boot_id(),
            "cpus": count_cpus(),
            "memory_bytes": memory,
        }
        result.update(self._query_gpus())
        result["python"] = {"path": sys.executable, "version": platform.python_version()}
        result["venvs"] = dict((key, self.venvs.venv_facts(spec)) for key, spec in specs.items())
        result["containers"] = self.containers.container_facts(probes)
        return result

    def _query_gpus(self):
        exe = shutil.which("nvidia-smi")
        if exe is None:
            # No nvidia-smi means no GPUs, not an error (R-2.1).
            return {"nvidia_smi": "absent", "nvidia_smi_error": None, "gpus": []}
        out, error = _run_nvidia_smi(
            exe, ["--query-gpu=" + ",".join(GPU_QUERY_FIELDS), "--format=csv,noheader,nounits"]
        )
        parsed = parse_gpu_csv(out or "")
        gpus = parsed["gpus"]
        if error is None and parsed["unparsed"]:
            error = "nvidia-smi printed: " + " | ".join(parsed["unparsed"])[:1000]
        if gpus:
            apps_out, apps_error = _run_nvidia_smi(
                exe, ["--query-compute-apps=" + ",".join(COMPUTE_APPS_FIELDS), "--format=csv,noheader,nounits"]
            )
            if apps_error is None:
                mark_foreign_gpu_memory(
                    gpus, parse_compute_apps_csv(apps_out), self._own_sessions(), _session_of
                )
        return {"nvidia_smi": "ok" if error is None else "error", "nvidia_smi_error": error, "gpus": gpus}

    def _own_sessions(self):
        sessions = set()
        for shard_id, state in self.root_dir.all_states():
            if _identity(state)[0] == "alive":
                info = read_proc_stat(state["pid"])
                if info is not None:
                    sessions.add(info["session"])
        return sessions



def _session_of(pid):
    info = read_proc_stat(pid)
    return info["session"] if info is not None else None


def _run_nvidia_smi(exe, arguments):
    """(stdout, error): error is None on success, else a sentence with nvidia-smi's message."""
    try:
        proc = subprocess.run(
            [exe] + arguments,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            timeout=NVIDIA_SMI_TIMEOUT,
        )
    except subprocess.TimeoutExpired:
        return None, "nvidia-smi did not answer within %g s" % NVIDIA_SMI_TIMEOUT
    except OSError as exc:
        return None, "could not run nvidia-smi: %s" % exc
    out = proc.stdout.decode("utf-8", "replace")
    if proc.returncode != 0:
        message = proc.stderr.decode("utf-8", "replace").strip() or out.strip()
        message = " ".join(message.split())[:1000]
        return out, "nvidia-smi exited with status %d: %s" % (proc.returncode, message or "no message")
    return out, None


# ---- remote/helper/storage.py --------------------------------------------------------------
# Storage: free space per filesystem, and the weights a node already holds (R-2.4 to R-2.6).
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
                # reported as an empty or full disk (R-2.4).
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


# ---- remote/helper/fetch.py ----------------------------------------------------------------
# Downloads


_HF_REPO_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*(/[A-Za-z0-9][A-Za-z0-9._-]*)?")
_HF_REVISION_RE = re.compile(r"[A-Za-z0-9._/-]{1,256}")


def redact_url(url):
    """The URL without any user:password part or query (a signed URL's query is a credential),
    fit for a message: `https://host/path?<redacted>`."""
    try:
        parts = urllib.parse.urlsplit(url)
    except ValueError:
        return "<redacted>"
    netloc = parts.netloc
    if "@" in netloc:
        netloc = "***@" + netloc.rsplit("@", 1)[1]
    query = "<redacted>" if parts.query or "?" in url else ""
    fragment = "<redacted>" if parts.fragment else ""
    return urllib.parse.urlunsplit((parts.scheme, netloc, parts.path, query, fragment))


def _check_https(url, what):
    if not isinstance(url, str):
        raise bad_args("%s must be a string" % what)
    parts = urllib.parse.urlsplit(url)
    if parts.scheme.lower() != "https" or not parts.netloc:
        raise bad_args("%s must be an https:// URL, got %s" % (what, redact_url(url)))
    return url


def _safe_relative_path(name):
    """The parts of a file name from a hub listing, or None when it could escape the entry."""
    if not isinstance(name, str) or not name or "\0" in name or "\\" in name or name.startswith("/"):
        return None
    parts = name.split("/")
    if any(part in ("", ".", "..") for part in parts) or parts[0] == COMPLETE_MARKER:
        return None
    return parts


def load_web_modules():
    """Import what downloads need on first use: urllib.request, http.client and ssl cost about
    35 ms of start-up, paid by every helper start although most never download anything."""
    if ssl is None:
        import importlib

        for name in ("http.client", "ssl", "urllib.error", "urllib.request"):
            importlib.import_module(name)
        globals().update(http=sys.modules["http"], ssl=sys.modules["ssl"])


def redirect_handler():
    """A handler that follows redirects only to https, with the token kept to the same host."""
    load_web_modules()

    class _RedirectHandler(urllib.request.HTTPRedirectHandler):
        """Follows redirects only to https, and carries the bearer token only to the same host
        (a hub redirects file downloads to a CDN that must not see it)."""

        def redirect_request(self, req, fp, code, msg, headers, newurl):
            if urllib.parse.urlsplit(newurl).scheme.lower() != "https":
                fp.close()
                raise HelperError(
                    "http", "refusing a redirect from %s to a non-https URL" % redact_url(req.full_url)
                )
            new = urllib.request.HTTPRedirectHandler.redirect_request(self, req, fp, code, msg, headers, newurl)
            token = getattr(req, "llmgw_token", None)
            if new is not None and token:
                old_host = urllib.parse.urlsplit(req.full_url).netloc.lower()
                if urllib.parse.urlsplit(newurl).netloc.lower() == old_host:
                    new.add_unredirected_header("Authorization", "Bearer " + token)
                    new.llmgw_token = token
            return new

    return _RedirectHandler()


class FetchJob(object):
    """One download in progress, shared by every request that asked for it (R-5.3)."""

    def __init__(self, key, cache_dir, name, source, token, limit=DEFAULT_FETCH_LIMIT,
                 stall_timeout=DEFAULT_STALL_TIMEOUT, limit_origin="the helper's default"):
        self.key = key
        self.cache_dir = cache_dir
        self.name = name
        self.source = source
        self.token = token
        self.limit = limit  # bytes this download may write in all
        self.limit_origin = limit_origin  # what the limit came from, for the refusal
        self.stall_timeout = stall_timeout
        # Weights fetched with a hub token may be gated: readable by this user only.
        self.private = token is not None
        self.lock = threading.Lock()
        self.listeners = {}
        self.done = threading.Event()
        self.abort = threading.Event()
        self.bytes = 0
        self.total = None
        self.result = None
        self.error = None
        self.temp_name = None
        self.thread = None
        self.hashes = {}  # relative path -> SHA-256 of the bytes written, computed as they stream
        self._last_progress = 0.0

    def attach(self, key, emit):
        """Add a waiter, which hears the progress so far at once; False when the download is
        already being abandoned (the caller then starts a fresh one)."""
        with self.lock:
            if self.abort.is_set():
                return False
            self.listeners[key] = emit
            data = {"bytes": self.bytes, "total": self.total}
        emit("progress", data)
        return True

    def detach(self, key):
        """Drop a waiter; the download is abandoned when nobody waits for it any more."""
        with self.lock:
            self.listeners.pop(key, None)
            if not self.listeners and not self.done.is_set():
                self.abort.set()

    def add_bytes(self, count):
        with self.lock:
            self.bytes += count
        self.progress()

    def set_total(self, total):
        with self.lock:
            self.total = total

    def progress(self, force=False):
        now = time.monotonic()
        with self.lock:
            if not force and now - self._last_progress < PROGRESS_INTERVAL:
                return
            self._last_progress = now
            data = {"bytes": self.bytes, "total": self.total}
            listeners = list(self.listeners.values())
        for emit in listeners:
            try:
                emit("progress", dict(data))
            except Exception:
                pass


# --------------------------------------------------------------------------------------------
# Fetch: downloads into a cache directory, single-flight, bounded, sealed (R-5.1 to R-5.3).


class Fetches(object):
    """fetch, source_size: a part of Node (below). A download runs as a FetchJob on its own
    thread; requests for the same entry attach to it."""

    def __init__(self, root_dir, verified, jobs):
        self.root_dir = root_dir
        self.verified = verified
        self.jobs = jobs
        self.fetches = {}  # (cache_dir, name) -> the job new requests attach to
        self._opener = None

    def op_fetch(self, args, ctx):
        source = _check_source(_arg(args, "source", (dict,)))
        cache_dir = _arg_path(args, "cache_dir")
        name = _arg(args, "name", (str,))
        if not CACHE_NAME_RE.fullmatch(name):
            raise bad_args("name %r must be llmgw-<16 to 64 lowercase hex digits>" % name)
        token = _arg(args, "token", (str,), None)
        limit = _arg(args, "max_bytes", (int,), None)
        if limit is not None and limit <= 0:
            raise bad_args("max_bytes must be a positive number of bytes, got %r" % limit)
        stall_timeout = _arg_timeout(args, "stall_timeout", DEFAULT_STALL_TIMEOUT)
        final = os.path.join(cache_dir, name)
        if self.root_dir.secret is None:
            raise HelperError("no_secret", "no fleet secret on this node: a fetched entry could not be sealed (the control plane sends it)")
        entry, _ = sealed_entry(final, self.root_dir.secret)
        if entry is not None:
            # Here already (another node of the fleet may have fetched it onto a shared filer):
            # checked by hash instead of downloaded again (R-5.6).
            self._check_present_entry(final, entry, ctx)
            return {"path": final, "bytes": entry["bytes"], "file": entry_file(final)}
        key = (cache_dir, name)
        job, start = self.jobs.attach_or_start(self.fetches, key, ctx, lambda: FetchJob(
            key, cache_dir, name, source, token, stall_timeout=stall_timeout, limit=limit or DEFAULT_FETCH_LIMIT,
            limit_origin="the request's max_bytes" if limit else "the helper's default"))
        if start:
            job.thread = threading.Thread(target=self._run_fetch, args=(job,), name="llmgw-fetch", daemon=True)
            job.thread.start()
        try:
            while not job.done.wait(0.05):
                if ctx.cancelled.is_set():
                    raise HelperError("cancelled", "stopped waiting for the download of %s" % name)
        finally:
            job.detach(ctx.key)
        if job.error is not None:
            raise HelperError(job.error.kind, job.error.message)
        return dict(job.result, file=entry_file(job.result["path"]))

    def _check_present_entry(self, final, entry, ctx):
        """Hash a present entry's files against its seal, big ones only when they changed since
        this node last did, with "checking" events (not "progress": no byte is downloaded, and
        the control plane measures download rates from progress); weights_integrity on a
        mismatch (nothing is removed)."""
        state = {"done": 0, "shown": 0.0}

        def on_bytes(count):
            if ctx.cancelled.is_set():
                raise HelperError("cancelled", "stopped checking %s" % final)
            state["done"] += count
            now = time.monotonic()
            if now - state["shown"] >= PROGRESS_INTERVAL:
                state["shown"] = now
                ctx.emit("checking", {"bytes": state["done"], "total": entry["bytes"]})

        problem = self.verified.verify_entry(final, entry, on_bytes)
        if problem is not None:
            raise HelperError("weights_integrity", problem)

    def op_source_size(self, args, ctx):
        """How many bytes a source would download, from the hub listing or HEAD requests; null
        when the server does not say (R-5.1: the size is learned before placement)."""
        source = _check_source(_arg(args, "source", (dict,)))
        token = _arg(args, "token", (str,), None)
        job = FetchJob(None, None, "size", source, token)
        files = self._plan_files(job)
        sizes = [size if size is not None else self._head_length(job, url) for url, _, size, _ in files]
        total = sum(sizes) if all(size is not None for size in sizes) else None
        return {"bytes": total, "files": len(files)}

    def busy_cache_names(self, cache_dir):
        jobs = self.jobs.writing_into(cache_dir)
        busy = set()
        for job in jobs:
            busy.add(job.name)
            if job.temp_name:
                busy.add(job.temp_name)
        return busy

    def _run_fetch(self, job):
        try:
            job.result = self._download(job)
        except HelperError as exc:
            job.error = exc
        except Exception as exc:
            job.error = HelperError("internal", "%s: %s" % (type(exc).__name__, exc))
        finally:
            self.jobs.ended(self.fetches, job)
            job.done.set()

    def _download(self, job):
        cache_dir = job.cache_dir
        final = os.path.join(cache_dir, job.name)
        size = self.verified.entry_bytes(final)
        if size is not None:  # finished by a job that ended between our check and our start
            return {"path": final, "bytes": size}
        _refuse_foreign_entry(final, self.root_dir.secret)
        temp = None
        lease = None
        try:
            try:
                os.makedirs(cache_dir, exist_ok=True)
                temp = tempfile.mkdtemp(prefix=".tmp-%s-" % job.name, dir=cache_dir)
            except OSError as exc:
                raise _disk_error(exc, cache_dir, job) or HelperError(
                    "cache_dir", "cannot write to the cache directory %s: %s" % (cache_dir, exc.strerror or exc)
                )
            job.temp_name = os.path.basename(temp)
            lease = self._hold_lease(job, temp)
            files = self._plan_files(job)
            if job.total is not None and job.total > job.limit:
                raise HelperError("too_large", "%s would be %d bytes, more than the %d allowed (%s)"
                                  % (job.name, job.total, job.limit, job.limit_origin))
            for url, parts, size, published in files:
                self._download_file(job, url, temp, parts, single=len(files) == 1, expected=size, published=published)
            job.progress(force=True)
            manifest, total, problem = entry_manifest(temp, os.getuid())
            if problem is None and sorted(job.hashes) != [relative for relative, _ in manifest]:
                problem = "its files are not the ones downloaded"
            if problem is not None:
                raise HelperError("cache_dir", "the download of %s was changed while written: %s" % (job.name, problem))
            marker = {
                "format": MARKER_FORMAT,
                "name": job.name,
                "source": _shown_source(job.source),
                "bytes": total,
                "files": len(manifest),
                "finished_at": time.time(),
                "sha256": job.hashes,
                "seal": entry_seal(self.root_dir.secret, job.name, manifest, job.hashes),
            }
            try:
                _write_json_atomic(os.path.join(temp, COMPLETE_MARKER), marker, mode=0o600 if job.private else 0o644)
                os.chmod(temp, 0o700 if job.private else 0o755)
                if os.path.lexists(final):
                    size = cache_entry(final, self.root_dir.secret)[0]
                    if size is not None:
                        # Another helper (of this node or another) finished it first.
                        remove_tree_within(cache_dir, os.path.basename(temp))
                        return {"path": final, "bytes": size}
                    _refuse_foreign_entry(final, self.root_dir.secret)
                    # Ours by name and owner, and incomplete: nothing may keep its place.
                    remove_tree_within(cache_dir, job.name)
                lease.set()
                os.rename(temp, final)
            except OSError as exc:
                raise _disk_error(exc, cache_dir, job) or HelperError(
                    "cache_dir", "could not finish %s: %s" % (final, exc.strerror or exc)
                )
            temp = None
            try:
                os.unlink(os.path.join(final, LEASE_FILE))
            except OSError:
                pass  # left out of the seal and of reclaim's judgement of an entry anyway
            # These bytes were hashed as they streamed in: the first launch here need not
            # read the big files again.
            self.verified.note_verified(final, manifest, job.hashes)
            return {"path": final, "bytes": job.bytes}
        finally:
            if lease is not None:
                lease.set()
            if temp is not None:
                try:
                    remove_tree_within(cache_dir, os.path.basename(temp))
                except OSError:
                    shutil.rmtree(temp, ignore_errors=True)

    def _hold_lease(self, job, temp):
        """Write the temp dir's lease (this node, boot and pid) and renew its mtime while the
        download runs, so that reclaim on any node sharing the cache leaves it alone; returns
        the event that ends the renewal."""
        _write_json_atomic(os.path.join(temp, LEASE_FILE), lease_record(), mode=0o644)
        stop = threading.Event()
        path = os.path.join(temp, LEASE_FILE)

        def renew():
            while not stop.wait(LEASE_RENEW):
                try:
                    os.utime(path)
                except OSError:
                    return

        threading.Thread(target=renew, name="llmgw-lease", daemon=True).start()
        return stop

    def _opener_for_downloads(self):
        if self._opener is None:
            # The default context honours SSL_CERT_FILE / SSL_CERT_DIR.
            handler = redirect_handler()  # loads the web modules
            context = ssl.create_default_context()
            self._opener = urllib.request.build_opener(urllib.request.HTTPSHandler(context=context), handler)
        return self._opener

    def _request(self, job, url, method="GET", timeout=HTTP_TIMEOUT):
        load_web_modules()
        request = urllib.request.Request(
            url, method=method, headers={"User-Agent": "llmgw-helper/" + HELPER_VERSION, "Accept-Encoding": "identity"}
        )
        if job.token:
            request.add_unredirected_header("Authorization", "Bearer " + job.token)
            request.llmgw_token = job.token
        try:
            return self._opener_for_downloads().open(request, timeout=timeout)
        except urllib.error.HTTPError as exc:
            exc.close()
            hint = ""
            if exc.code in (401, 403):
                hint = " (private or gated: check the hub token given to llmgw)"
            raise HelperError("http", "HTTP %d %s from %s%s" % (exc.code, exc.reason, redact_url(url), hint))
        except urllib.error.URLError as exc:
            raise HelperError("network", "could not reach %s: %s" % (redact_url(url), exc.reason))
        except socket.timeout:
            raise HelperError("stalled", "%s sent nothing for %g s" % (redact_url(url), timeout))
        except (http.client.HTTPException, OSError) as exc:
            raise HelperError("network", "could not fetch %s: %s" % (redact_url(url), exc))

    def _plan_files(self, job):
        """[(url, path parts inside the entry, size or None, published hash or None)]; also sets
        the job's total when every size is known beforehand. A published hash is ("sha256", hex)
        for a hub file kept in LFS, ("git-blob", hex) for one kept in git (the hub's blob id)."""
        source = job.source
        if source["kind"] == "https":
            files = []
            seen = set()
            for url in source["urls"]:
                base = urllib.parse.unquote(urllib.parse.urlsplit(url).path.rsplit("/", 1)[-1])
                parts = _safe_relative_path(base) or ["download"]
                if parts[0] in seen:
                    raise bad_args("two URLs would both be saved as %r" % parts[0])
                seen.add(parts[0])
                files.append((url, parts, None, None))
        else:
            files = self._hf_files(job)
        if len(files) > 1:
            sizes = [size for _, _, size, _ in files]
            if any(size is None for size in sizes):
                sizes = [self._head_length(job, url) if size is None else size for url, _, size, _ in files]
            if all(size is not None for size in sizes):
                job.set_total(sum(sizes))
                files = [(url, parts, size, published) for (url, parts, _, published), size in zip(files, sizes)]
        return files

    def _hf_files(self, job):
        source = job.source
        endpoint = source["endpoint"].rstrip("/")
        repo = urllib.parse.quote(source["repo"], safe="/")
        revision = urllib.parse.quote(source["revision"], safe="")
        # blobs=true: each sibling then carries its size, its git blob id and, for a file kept
        # in LFS, {"sha256", "size"} (the tree API spells the LFS hash "oid"; both are read).
        api = "%s/api/models/%s/revision/%s?blobs=true" % (endpoint, repo, revision)
        with self._request(job, api) as response:
            try:
                body = response.read(HUB_LISTING_MAX_BYTES + 1)
            except (socket.timeout, OSError, http.client.HTTPException) as exc:
                raise HelperError("network", "reading the hub listing at %s failed: %s" % (api, exc))
            if len(body) > HUB_LISTING_MAX_BYTES:
                raise HelperError("http", "the hub listing at %s is larger than %d bytes; refused" % (api, HUB_LISTING_MAX_BYTES))
            try:
                listing = json.loads(body.decode("utf-8"))
            except ValueError:
                raise HelperError("http", "the hub answered %s with something that is not JSON" % api)
        siblings = listing.get("siblings") if isinstance(listing, dict) else None
        if not isinstance(siblings, list):
            raise HelperError("http", "the hub listing at %s has no siblings" % api)
        if len(siblings) > HUB_LISTING_MAX_FILES:
            raise HelperError("http", "the hub listing at %s names %d files, more than the %d a fetch takes"
                              % (api, len(siblings), HUB_LISTING_MAX_FILES))
        files = []
        for sibling in siblings:
            name = sibling.get("rfilename") if isinstance(sibling, dict) else None
            parts = _safe_relative_path(name)
            if parts is None:
                raise HelperError("http", "the hub listing at %s names an unsafe file %r" % (api, name))
            size = sibling.get("size")
            size = size if isinstance(size, int) and not isinstance(size, bool) and size >= 0 else None
            url = "%s/%s/resolve/%s/%s" % (endpoint, repo, revision, urllib.parse.quote(name, safe="/"))
            files.append((url, parts, size, _published_hash(sibling)))
        if not files:
            raise HelperError("empty_source", "%s at revision %s lists no files" % (source["repo"], source["revision"]))
        return files

    def _head_length(self, job, url):
        try:
            with self._request(job, url, method="HEAD") as response:
                return _content_length(response)
        except HelperError:
            return None

    def _download_file(self, job, url, temp, parts, single, expected=None, published=None):
        """Write one file of the entry, hashing its bytes as they stream to disk (job.hashes).
        It may not outgrow its announced length (the listing's size or Content-Length) nor the
        job's limit; no byte for stall_timeout fails it; bytes that do not hash to the hash the
        hub published for the file fail it (weights_integrity)."""
        relative = "/".join(parts)
        response = self._request(job, url, timeout=job.stall_timeout)
        with response:
            length = _content_length(response)
            if single:
                job.set_total(length)
            bound = expected if expected is not None else length
            if length is not None and job.bytes + length > job.limit:
                raise HelperError("too_large", "%s announces %d bytes: %s would outgrow the %d allowed (%s)"
                                  % (redact_url(url), length, job.name, job.limit, job.limit_origin))
            digest = hashlib.sha256()
            # git names a blob by sha1("blob <size>\0" + content): known up front with its size.
            blob = hashlib.sha1(b"blob %d\0" % bound) if published and published[0] == "git-blob" and bound is not None else None
            written = 0
            try:
                fd = _create_below(temp, parts, job.private)
                with os.fdopen(fd, "wb", buffering=0) as out:
                    while True:
                        if job.abort.is_set():
                            raise HelperError("cancelled", "the download of %s was abandoned" % job.name)
                        try:
                            chunk = response.read(FETCH_CHUNK)
                        except http.client.IncompleteRead as exc:
                            raise HelperError(
                                "network",
                                "%s closed the connection after %d of %s bytes"
                                % (redact_url(url), written + len(exc.partial), length),
                            )
                        except socket.timeout:
                            raise HelperError(
                                "stalled",
                                "%s sent no byte for %g s (after %d bytes of this file, %d in all); the download "
                                "of %s was given up" % (redact_url(url), job.stall_timeout, written, job.bytes, job.name),
                            )
                        except (OSError, http.client.HTTPException) as exc:
                            raise HelperError("network", "reading %s failed: %s" % (redact_url(url), exc))
                        if not chunk:
                            break
                        if bound is not None and written + len(chunk) > bound:
                            raise HelperError(
                                "too_large", "%s sent more than the %d bytes it announced" % (redact_url(url), bound)
                            )
                        if job.bytes + len(chunk) > job.limit:
                            raise HelperError(
                                "too_large",
                                "%s outgrew the %d bytes allowed (%s) while reading %s; stopped"
                                % (job.name, job.limit, job.limit_origin, redact_url(url)),
                            )
                        digest.update(chunk)
                        if blob is not None:
                            blob.update(chunk)
                        view = memoryview(chunk)
                        while view:
                            count = out.write(view)
                            view = view[count:]
                        written += len(chunk)
                        job.add_bytes(len(chunk))
                    os.fsync(out.fileno())
            except OSError as exc:
                raise _disk_error(exc, job.cache_dir, job) or HelperError(
                    "cache_dir", "writing into %s failed: %s" % (job.cache_dir, exc.strerror or exc)
                )
            if length is not None and written != length:
                raise HelperError(
                    "network", "%s sent %d bytes, announced %d" % (redact_url(url), written, length)
                )
        job.hashes[relative] = digest.hexdigest()
        if published is None:
            return
        kind, wanted = published
        if kind == "sha256":
            actual = job.hashes[relative]
        elif blob is not None and written == bound:
            actual = blob.hexdigest()
        else:
            # No size known before the bytes came (or a short file): git's hash needs it first.
            # Only a small file is kept in git rather than LFS, so reading it back is cheap.
            with os.fdopen(open_below(temp, parts), "rb") as handle:
                actual = hashlib.sha1(b"blob %d\0" % written + handle.read()).hexdigest()
        if not hmac.compare_digest(actual, wanted):
            what = "LFS SHA-256" if kind == "sha256" else "git blob id (sha1)"
            raise HelperError(
                "weights_integrity",
                "%s of %s at %s: the hub publishes %s %s, the %d bytes received hash to %s; the download of %s "
                "was given up and nothing was kept" % (relative, job.source.get("repo"), job.source.get("revision"),
                                                      what, wanted, written, actual, job.name))



def _published_hash(sibling):
    """("sha256", hex) for a hub listing entry kept in LFS, ("git-blob", hex) for one kept in
    git, None when the listing gives neither (a mirror that publishes no hashes)."""
    lfs = sibling.get("lfs")
    if isinstance(lfs, dict):
        # The blob id of an LFS file names its pointer, not its content: only the LFS hash counts.
        value = lfs.get("sha256", lfs.get("oid"))
        return ("sha256", value.lower()) if isinstance(value, str) and SHA256_RE.fullmatch(value.lower()) else None
    value = sibling.get("blobId", sibling.get("oid"))
    if isinstance(value, str) and re.fullmatch(r"[0-9a-f]{40}", value.lower()):
        return ("git-blob", value.lower())
    return None


def _check_source(source):
    kind = source.get("kind")
    if kind == "https":
        urls = _arg(source, "urls", (list,))
        if not urls:
            raise bad_args("source.urls must list at least one URL")
        for url in urls:
            _check_https(url, "source URL")
        return {"kind": "https", "urls": list(urls)}
    if kind == "hf":
        repo = _arg(source, "repo", (str,))
        if not _HF_REPO_RE.fullmatch(repo) or ".." in repo:
            raise bad_args("source.repo must look like org/name, got %r" % repo)
        revision = _arg(source, "revision", (str,), "main")
        if not _HF_REVISION_RE.fullmatch(revision) or ".." in revision:
            raise bad_args("source.revision %r is not a branch, tag or commit" % revision)
        endpoint = _check_https(_arg(source, "endpoint", (str,), "https://huggingface.co"), "source.endpoint")
        return {"kind": "hf", "repo": repo, "revision": revision, "endpoint": endpoint}
    raise bad_args("source.kind must be 'https' or 'hf', got %r" % (kind,))


def _shown_source(source):
    """The source as kept in a marker others may read: a signed URL's query is a credential."""
    if source.get("kind") == "https":
        return dict(source, urls=[redact_url(url) for url in source["urls"]])
    return dict(source)


def _refuse_foreign_entry(final, secret):
    """A fetch never uses nor removes a directory another user put where its entry goes."""
    try:
        owner = os.lstat(final).st_uid
    except OSError:
        return
    if owner != os.getuid():
        why = cache_entry(final, secret)[1] or ""
        if why.startswith("not llmgw's: "):
            why = why[len("not llmgw's: "):]
        raise HelperError(
            "cache_dir",
            "%s exists and is not llmgw's (%s); it is never used or removed: remove it or choose another "
            "cache directory" % (final, why),
        )


def _create_below(top, parts, private):
    """Create top/parts... for writing (O_EXCL), through directory fds that follow no link, with
    the modes set whatever the umask: 0700/0600 when private, else 0755/0644."""
    dir_mode, file_mode = (0o700, 0o600) if private else (0o755, 0o644)
    fd = os.open(top, _DIR_FLAGS)
    try:
        for part in parts[:-1]:
            try:
                os.mkdir(part, dir_mode, dir_fd=fd)
                made = True
            except FileExistsError:
                made = False
            child = os.open(part, _DIR_FLAGS, dir_fd=fd)
            os.close(fd)
            fd = child
            if made:
                os.fchmod(fd, dir_mode)
        out = os.open(parts[-1], os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0),
                      file_mode, dir_fd=fd)
        os.fchmod(out, file_mode)
        return out
    finally:
        os.close(fd)


def _content_length(response):
    value = response.headers.get("Content-Length")
    if value is None or not value.strip().isdigit():
        return None
    return int(value.strip())


def _disk_error(exc, cache_dir, job):
    if getattr(exc, "errno", None) in (errno.ENOSPC, errno.EDQUOT):
        return HelperError(
            "disk_full",
            "no space left in the cache directory %s after writing %d bytes of %s; free space or reclaim old entries"
            % (cache_dir, job.bytes, job.name),
        )
    return None


# ---- remote/helper/venvs.py ----------------------------------------------------------------
# Environments: Python environments the helper builds for an engine (runtime: venv, R-4.11).
# See "Environments" in the module docstring: built in place, sealed like cache entries.


def check_venv_runtime(runtime):
    """The venv runtime of a request, checked and complete (every field present)."""
    packages = runtime.get("packages")
    if not isinstance(packages, list) or not packages:
        raise bad_args("runtime.packages must list at least one pip requirement")
    for index, package in enumerate(packages):
        _check_line(package, "runtime.packages[%d]" % index)
        if package.lstrip().startswith("-"):
            raise bad_args("runtime.packages[%d] %r is a pip option, not a requirement" % (index, package))
    index_url = runtime.get("index_url")
    if index_url is not None:
        _check_line(index_url, "runtime.index_url")
        if index_url.startswith("-"):
            raise bad_args("runtime.index_url %r is not a URL" % index_url)
    extra_index_urls = runtime.get("extra_index_urls")
    extra_index_urls = [] if extra_index_urls is None else extra_index_urls
    if not isinstance(extra_index_urls, list):
        raise bad_args("runtime.extra_index_urls must be a list of URLs")
    for index, url in enumerate(extra_index_urls):
        _check_line(url, "runtime.extra_index_urls[%d]" % index)
        if url.startswith("-"):
            raise bad_args("runtime.extra_index_urls[%d] %r is not a URL" % (index, url))
    find_links = runtime.get("find_links")
    find_links = [] if find_links is None else find_links
    if not isinstance(find_links, list):
        raise bad_args("runtime.find_links must be a list of directories or URLs")
    for index, link in enumerate(find_links):
        _check_line(link, "runtime.find_links[%d]" % index)
        if link.startswith("-"):
            raise bad_args("runtime.find_links[%d] %r is not a directory or a URL" % (index, link))
    python = runtime.get("python")
    if python is not None:
        _check_line(python, "runtime.python")
        if "/" in python and not os.path.isabs(python):
            raise bad_args("runtime.python %r must be a program name or an absolute path" % python)
    post_install = runtime.get("post_install")
    post_install = [] if post_install is None else post_install
    if not isinstance(post_install, list):
        raise bad_args("runtime.post_install must be a list of shell commands")
    for index, command in enumerate(post_install):
        _check_line(command, "runtime.post_install[%d]" % index)
    return {"kind": "venv", "packages": list(packages), "index_url": index_url,
            "extra_index_urls": list(extra_index_urls), "find_links": list(find_links), "python": python,
            "post_install": list(post_install)}


def _check_line(value, what):
    if not isinstance(value, str) or not value.strip() or "\0" in value or "\n" in value:
        raise bad_args("%s must be a single non-empty line, got %r" % (what, value))


def venv_recipe(spec, interpreter, version):
    """(id, recipe) of a venv runtime built with that interpreter: the id is the SHA-256 of the
    recipe's canonical JSON, so any change of what the environment is made from is another one."""
    recipe = {"kind": "venv", "python": version, "interpreter": interpreter, "packages": spec["packages"],
              "index_url": spec["index_url"], "find_links": spec["find_links"], "post_install": spec["post_install"]}
    if spec["extra_index_urls"]:  # absent otherwise, so that the ids of recipes without any stay as they were
        recipe["extra_index_urls"] = spec["extra_index_urls"]
    return hashlib.sha256(canonical_json(recipe).encode("utf-8")).hexdigest(), recipe


def env_name(recipe_id):
    return "venv-" + recipe_id[:32]


def building_seal(secret, name, recipe_id):
    """The HMAC in a building marker: proves a helper of this fleet made the directory."""
    message = ENV_MARK_CONTEXT + name.encode("ascii") + b"\n" + recipe_id.encode("ascii")
    return hmac.new(secret.encode("ascii"), message, hashlib.sha256).hexdigest()


def sealed_env(path, secret):
    """({"files", "hashes", "links", "bytes", "marker", "stamps"}, None) when the directory at
    path is an environment this fleet's llmgw built and sealed, else (None, why); stamps are the
    walk's file_stamp of each file (verify_entry_content takes them).

    As sealed_entry judges a cache entry, and more: its seal (entry_seal with the environment's
    context) covers every file's size and SHA-256, every link's target and the recipe, and the
    recipe must hash to the id its name carries. Contents are not read here."""
    uid = os.getuid()
    name = os.path.basename(os.path.normpath(path))
    marker, problem = _private_dir_marker(path, uid, "an environment", "the environment")
    if problem is not None:
        return None, problem.replace("completion marker", "seal")
    links = []
    stamps = {}
    files, total, problem = entry_manifest(path, uid, links=links, stamps=stamps)
    if problem is not None:
        return None, "not llmgw's: " + problem
    if secret is None:
        return None, "no fleet secret on this node to check its seal"
    hashes, recipe, recipe_id = marker.get("sha256"), marker.get("recipe"), marker.get("id")
    if (marker.get("format") != ENV_MARKER_FORMAT or not isinstance(hashes, dict) or not isinstance(recipe, dict)
            or not isinstance(recipe_id, str)):
        return None, "its seal is not an environment's"
    unhashed = _unhashed(files, hashes)
    if unhashed is not None:
        return None, "its seal gives no SHA-256 for %s" % unhashed
    seal = marker.get("seal")
    expected = entry_seal(secret, name, files, hashes, links=links, context=ENV_SEAL_CONTEXT, recipe=recipe)
    if not isinstance(seal, str) or not hmac.compare_digest(seal, expected):
        return None, "its seal was not made by this fleet's llmgw, or its files or links changed since"
    if hashlib.sha256(canonical_json(recipe).encode("utf-8")).hexdigest() != recipe_id or env_name(recipe_id) != name:
        return None, "its seal is for another recipe than its name says"
    return {"files": files, "hashes": hashes, "links": links, "bytes": total, "marker": marker, "stamps": stamps}, None


def env_state(path, secret):
    """("absent" | "sealed" | "unfinished" | "foreign", detail) of the directory at an
    environment's path. sealed: detail is what sealed_env found; unfinished: a build of this
    fleet's llmgw marked it and did not seal it (detail: its building marker); foreign: detail
    says why it is not llmgw's, or was changed after its seal: it is never run nor removed."""
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return "absent", None
    except OSError as exc:
        return "foreign", "it cannot be checked: %s" % (exc.strerror or exc)
    entry, why = sealed_env(path, secret)
    if entry is not None:
        return "sealed", entry
    if not stat.S_ISDIR(info.st_mode) or stat.S_ISLNK(info.st_mode) or why.startswith("not llmgw's: "):
        return "foreign", why
    if os.path.lexists(os.path.join(path, COMPLETE_MARKER)):
        return "foreign", why  # sealed once: changed since, or a seal forged; kept as it is for a look
    marker, problem = _read_marker(path, os.getuid(), ENV_BUILDING_MARKER)
    if problem is not None:
        return "foreign", "llmgw did not make it: it has neither the mark llmgw writes first nor its seal"
    name = os.path.basename(os.path.normpath(path))
    recipe_id = marker.get("id")
    if (secret is None or not isinstance(recipe_id, str) or not isinstance(marker.get("seal"), str)
            or not hmac.compare_digest(marker["seal"], building_seal(secret, name, recipe_id))):
        return "foreign", "its building mark was not made by this fleet's llmgw"
    return "unfinished", marker


def freeze_tree(top):
    """Take every write permission off what is below top (links excepted; llmgw's own .llmgw-*
    names at the top too): an engine run from the environment cannot add a file to it (an
    interpreter would write its bytecode caches there) nor change one in place."""
    stack = [top]
    while stack:
        directory = stack.pop()
        with os.scandir(directory) as iterator:
            entries = list(iterator)
        for entry in entries:
            if directory == top and entry.name.startswith(".llmgw-"):
                continue
            info = entry.stat(follow_symlinks=False)
            if stat.S_ISLNK(info.st_mode):
                continue
            os.chmod(entry.path, stat.S_IMODE(info.st_mode) & ~0o222)
            if stat.S_ISDIR(info.st_mode):
                stack.append(entry.path)


def step_environment(path):
    """The environment a build step runs in: the helper's, inside the venv (its bin first on
    PATH, VIRTUAL_ENV set), without what would send pip's installs or imports elsewhere. The
    node's pip configuration (pip.conf, PIP_* proxies, certificates, mirrors) is kept."""
    env = dict(os.environ)
    for name in ("PYTHONHOME", "PYTHONPATH", "PYTHONSTARTUP", "PYTHONUSERBASE", "PIP_USER", "PIP_TARGET",
                 "PIP_PREFIX", "PIP_ROOT"):
        env.pop(name, None)
    env["VIRTUAL_ENV"] = path
    env["PATH"] = os.path.join(path, "bin") + os.pathsep + env.get("PATH", os.defpath)
    return env


def install_argv(spec, env_python, uv):
    """The install command: pip of the environment, or uv when the node has it."""
    options = []
    if spec["index_url"] is not None:
        options += ["--index-url", spec["index_url"]]
    elif spec["find_links"] and not spec["extra_index_urls"]:
        options.append("--no-index")  # a wheelhouse only: no index is asked
    for url in spec["extra_index_urls"]:
        options += ["--extra-index-url", url]
    for link in spec["find_links"]:
        options += ["--find-links", link]
    if uv is not None:
        return [uv, "pip", "install", "--python", env_python] + options + spec["packages"]
    return ([env_python, "-m", "pip", "install", "--disable-pip-version-check", "--progress-bar", "off"]
            + options + spec["packages"])


def _disk_full(path, what):
    return HelperError("disk_full", "no space left in %s while %s; the half-made environment was removed: free space "
                                    "there, or reclaim environments or weights" % (path, what))


class EnvJob(object):
    """One environment being built, shared by every request that asked for it (single-flight per
    recipe): their progress, the build's abort when the last of them leaves, its answer."""

    cache_dir = None  # not a download: what Jobs.writing_into asks passes over it
    temp_name = None

    def __init__(self, recipe_id, recipe, spec, path, interpreter):
        self.key = recipe_id
        self.recipe = recipe
        self.spec = spec
        self.path = path
        self.name = os.path.basename(path)
        self.interpreter = interpreter
        self.lock = threading.Lock()
        self.listeners = {}
        self.done = threading.Event()
        self.abort = threading.Event()
        self.result = None
        self.error = None
        self.thread = None
        self.phase = None
        self.tail = []  # the running step's last lines, for its error
        self._pending = None  # a line not yet shown (rate-limited)
        self._last_progress = 0.0

    def attach(self, key, emit):
        """As FetchJob.attach: the new waiter hears the phase so far at once."""
        with self.lock:
            if self.abort.is_set():
                return False
            self.listeners[key] = emit
            phase = self.phase
        if phase is not None:
            emit("progress", {"phase": phase, "line": None})
        return True

    def detach(self, key):
        with self.lock:
            self.listeners.pop(key, None)
            if not self.listeners and not self.done.is_set():
                self.abort.set()

    def start_phase(self, phase, line=None):
        with self.lock:
            self.phase = phase
            self.tail = []
            self._pending = None
        self._emit({"phase": phase, "line": line})

    def line(self, text):
        """One line a step printed: kept for its error, shown at most every PROGRESS_INTERVAL."""
        now = time.monotonic()
        with self.lock:
            self.tail.append(text)
            if len(self.tail) > ENV_OUTPUT_LINES:
                del self.tail[0]
            if now - self._last_progress < PROGRESS_INTERVAL:
                self._pending = text
                return
            self._pending = None
            phase = self.phase
        self._emit({"phase": phase, "line": text})

    def flush(self):
        """Show the step's last line when the rate limit held it back."""
        with self.lock:
            text, self._pending = self._pending, None
            phase = self.phase
        if text is not None:
            self._emit({"phase": phase, "line": text})

    def _emit(self, data):
        with self.lock:
            self._last_progress = time.monotonic()
            listeners = list(self.listeners.values())
        for emit in listeners:
            try:
                emit("progress", dict(data))
            except Exception:
                pass


class Venvs(object):
    """The environments of venv runtimes, a part of Node (below): built for provision, listed
    for envs, venv_launch for launch, venv_facts for inventory, envs_reclaim for reclaim."""

    def __init__(self, root_dir, verified, jobs):
        self.root_dir = root_dir
        self.verified = verified
        self.jobs = jobs
        self.provisions = {}  # recipe id -> the environment build new requests attach to (under jobs.lock)
        self.python_versions = {}  # (interpreter, inode, mtime) -> the version it reports
        self.env_seals = {}  # (path, the seal file's inode, mtime, ctime, size) -> sealed or not
        self.probe_lock = threading.Lock()  # guards env_seals

    def envs_dir(self):
        return os.path.join(self.root_dir.path, ENVS_DIR)

    def provision_venv(self, runtime, ctx):
        """Build the environment of a venv runtime once (single-flight per recipe), or find it
        built; events "progress" {"phase", "line"}."""
        spec = check_venv_runtime(runtime)
        if self.root_dir.secret is None:
            raise HelperError("no_secret", "no fleet secret on this node: an environment could not be sealed "
                                           "(the control plane sends it)")
        recipe_id, recipe, interpreter = self.venv_recipe(spec)
        path = os.path.join(self.envs_dir(), env_name(recipe_id))
        state, detail = self.env_found(path)
        if state == "sealed":
            return self._present_env(path, detail, ctx.emit)
        if state == "foreign":
            raise HelperError("integrity", "%s is not an environment llmgw built and sealed (%s); it is never run "
                                           "nor removed: look at it, then remove it" % (path, detail))
        job, start = self.jobs.attach_or_start(self.provisions, recipe_id, ctx,
                                               lambda: EnvJob(recipe_id, recipe, spec, path, interpreter))
        if start:
            job.thread = threading.Thread(target=self._run_provision, args=(job,), name="llmgw-provision", daemon=True)
            job.thread.start()
        try:
            while not job.done.wait(0.05):
                if ctx.cancelled.is_set():
                    raise HelperError("cancelled", "stopped waiting for the build of %s" % path)
        finally:
            job.detach(ctx.key)
        if job.error is not None:
            raise HelperError(job.error.kind, job.error.message)
        return dict(job.result)

    def venv_recipe(self, spec, timeout=PYTHON_QUERY_TIMEOUT):
        """(recipe id, recipe, interpreter path) for a venv runtime on this node: the interpreter
        named (on PATH) or the helper's own, resolved, and the version it reports (asked within
        timeout: Unanswered when it does not answer)."""
        python = spec["python"]
        if python is None:
            found = sys.executable
        elif "/" in python:
            found = python if os.path.isfile(python) and os.access(python, os.X_OK) else None
        else:
            found = shutil.which(python)
        if not found:
            where = "is not an executable file" if python and "/" in python else "is not on PATH=%s" % os.environ.get(
                "PATH", os.defpath)
            raise HelperError("runtime_missing", "the Python interpreter %s %s on this node; install it, or name "
                                                 "another in the profile's python" % (python, where))
        interpreter = os.path.realpath(found)
        version = platform.python_version() if python is None else self._python_version(interpreter, timeout)
        recipe_id, recipe = venv_recipe(spec, interpreter, version)
        return recipe_id, recipe, interpreter

    def _python_version(self, interpreter, timeout=PYTHON_QUERY_TIMEOUT):
        """The version an interpreter reports, asked once per file (by inode and mtime)."""
        try:
            info = os.stat(interpreter)
        except OSError as exc:
            raise HelperError("runtime_missing", "the Python interpreter %s cannot be run: %s"
                              % (interpreter, exc.strerror or exc))
        key = (interpreter, info.st_ino, info.st_mtime_ns)
        version = self.python_versions.get(key)
        if version is not None:
            return version
        try:
            probe = subprocess.run([interpreter, "-I", "-c", "import platform; print(platform.python_version())"],
                                   stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                   timeout=timeout)
        except subprocess.TimeoutExpired:
            raise Unanswered("runtime_missing", "the Python interpreter %s did not say its version within %g s"
                             % (interpreter, timeout))
        except OSError as exc:
            raise HelperError("runtime_missing", "the Python interpreter %s cannot be run: %s" % (interpreter, exc))
        version = probe.stdout.decode("ascii", "replace").strip()
        if probe.returncode != 0 or not re.fullmatch(r"\d+\.\d+\.\d+\S*", version):
            said = " ".join(probe.stderr.decode("utf-8", "replace").split())[:300]
            raise HelperError("runtime_missing", "%s is not a Python interpreter llmgw can use (it exited with %d: %s)"
                              % (interpreter, probe.returncode, said or "no message"))
        self.python_versions[key] = version
        return version

    def _present_env(self, path, entry, emit):
        """The answer for an environment found sealed (env_found). Its files' contents are
        checked by the launch that runs it, the gate right before an engine starts: checking
        them here too walked every file twice per launch."""
        emit("progress", {"phase": "seal", "line": "found the sealed environment %s" % path})
        return self._env_answer(path, entry, created=False)

    def _env_answer(self, path, entry, created):
        marker = entry["marker"]
        return {"kind": "venv", "id": marker["id"], "path": path, "bytes": entry["bytes"], "created": created,
                "python": marker["recipe"].get("python"), "installer": marker.get("installer")}

    # -- the build (a thread per recipe; requests wait for it) -----------------------------

    def _run_provision(self, job):
        try:
            job.result = self._provision(job)
        except HelperError as exc:
            job.error = exc
        except Exception as exc:
            traceback.print_exc(file=sys.stderr)
            job.error = HelperError("internal", "%s: %s" % (type(exc).__name__, exc))
        finally:
            self.jobs.ended(self.provisions, job)
            job.done.set()

    def _provision(self, job):
        self.root_dir.private_dir(self.envs_dir())
        lock_fd = self._lock_env(job)
        try:
            # Judged again under the lock: another helper process may have built it meanwhile.
            state, detail = env_state(job.path, self.root_dir.secret)
            if state == "sealed":
                return self._present_env(job.path, detail, job._emit)
            if state == "foreign":
                raise HelperError("integrity", "%s is not an environment llmgw built and sealed (%s); it is never run "
                                               "nor removed: look at it, then remove it" % (job.path, detail))
            if state == "unfinished":
                # Ours, unsealed, and nobody builds it (we hold its lock): a build that was cut off.
                job.start_phase("venv", "removing the half-built %s an interrupted build left" % job.path)
                try:
                    remove_tree_within(self.envs_dir(), job.name, unlock=True)
                except OSError as exc:
                    raise HelperError("provision_failed", "could not remove the half-built %s: %s"
                                      % (job.path, exc.strerror or exc))
            return self._build_env(job)
        finally:
            os.close(lock_fd)

    def _lock_env(self, job):
        """Hold the recipe's lock file (ROOT/envs/.lock-<name>), so that two helper processes of
        this node never build one environment at once: a second one waits for the first."""
        try:
            fd = os.open(os.path.join(self.envs_dir(), ".lock-" + job.name),
                         os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0), 0o600)
        except OSError as exc:
            if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                raise _disk_full(self.envs_dir(), "starting the build")
            raise HelperError("permissions", "cannot lock %s: %s" % (job.path, exc.strerror or exc))
        said = False
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return fd
            except OSError as exc:
                if exc.errno not in (errno.EAGAIN, errno.EACCES):
                    os.close(fd)
                    raise HelperError("permissions", "cannot lock %s: %s" % (job.path, exc.strerror or exc))
            if not said:
                job.start_phase("venv", "another helper process of this node is building %s; waiting" % job.path)
                said = True
            if job.abort.wait(0.2):
                os.close(fd)
                raise HelperError("cancelled", "stopped waiting for the build of %s" % job.path)

    def _build_env(self, job):
        path, spec = job.path, job.spec
        try:
            os.mkdir(path, 0o700)
        except OSError as exc:
            if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                raise _disk_full(self.envs_dir(), "starting the build")
            raise HelperError("permissions", "cannot make %s: %s" % (path, exc.strerror or exc))
        try:
            self._mark_building(job)
            env = step_environment(path)
            job.start_phase("venv")
            self._run_step(job, [job.interpreter, "-m", "venv", path], env, self.envs_dir(),
                           "%s -m venv %s" % (job.interpreter, path))
            uv = shutil.which("uv", path=os.environ.get("PATH", os.defpath))
            installer = "uv" if uv is not None else "pip"
            job.start_phase("pip", "installing with %s%s" % (installer, " (%s)" % uv if uv else ""))
            argv = install_argv(spec, os.path.join(path, "bin", "python"), uv)
            self._run_step(job, argv, env, path, " ".join(redact_url(a) if "://" in a else a for a in argv))
            for command in spec["post_install"]:
                job.start_phase("post_install", command)
                self._run_step(job, ["sh", "-c", command], env, path, "sh -c %r" % command)
            job.start_phase("seal")
            entry = self._seal_env(job, installer)
            job.start_phase("seal", "sealed %s" % path)
            return self._env_answer(path, entry, created=True)
        except BaseException as exc:
            # Nothing half-made is ever counted as installed: what the build made goes.
            try:
                remove_tree_within(self.envs_dir(), job.name, unlock=True)
            except OSError:
                pass
            if isinstance(exc, OSError):
                if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                    raise _disk_full(self.envs_dir(), "building %s" % path)
                raise HelperError("provision_failed", "could not build %s: %s" % (path, exc.strerror or exc))
            raise

    def _mark_building(self, job):
        marker = {"format": ENV_MARKER_FORMAT, "name": job.name, "id": job.key, "started_at": time.time(),
                  "hostname": socket.gethostname(), "boot_id": read_boot_id(), "pid": os.getpid(),
                  "seal": building_seal(self.root_dir.secret, job.name, job.key)}
        _write_json_atomic(os.path.join(job.path, ENV_BUILDING_MARKER), marker)

    def _run_step(self, job, argv, env, cwd, shown):
        """Run one step of a build in its own session, its output lines as progress; the abort
        of the build kills its whole group. provision_failed (the command and its last lines)
        when it fails, disk_full when those lines say the disk filled."""
        try:
            proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                    cwd=cwd, env=env, close_fds=True, start_new_session=True)
        except OSError as exc:
            raise HelperError("provision_failed", "could not run %s: %s" % (shown, exc.strerror or exc))

        def stop_on_abort():
            while proc.poll() is None:
                if job.abort.wait(0.1):
                    _signal_groups([proc.pid], signal.SIGKILL)
                    return

        threading.Thread(target=stop_on_abort, name="llmgw-provision-step", daemon=True).start()
        with proc.stdout:
            for raw in proc.stdout:
                job.line(_decode_line(raw.rstrip(b"\n")))
        code = proc.wait()
        job.flush()
        if job.abort.is_set():
            raise HelperError("cancelled", "the build of %s was stopped; nothing of it was kept" % job.path)
        if code != 0:
            tail = list(job.tail)
            if any(_DISK_FULL_OUTPUT.search(text) for text in tail):
                raise _disk_full(self.envs_dir(), "running %s" % shown)
            raise HelperError("provision_failed", "%s exited with status %d; the environment was not kept. Its last "
                                                  "lines:\n%s" % (shown, code, "\n".join(tail) or "(no output)"))

    def _seal_env(self, job, installer):
        """Freeze the environment, hash every file, record the stamps this node verified, and
        write the seal; the building mark goes last, and the top directory becomes read-only."""
        path = job.path
        freeze_tree(path)
        links = []
        files, total, problem = entry_manifest(path, os.getuid(), links=links)
        if problem is not None:
            raise HelperError("provision_failed", "%s holds what llmgw cannot seal: %s" % (path, problem))
        hashes = {}
        for relative, _ in files:
            if job.abort.is_set():
                raise HelperError("cancelled", "the build of %s was stopped; nothing of it was kept" % path)
            with os.fdopen(open_below(path, relative.split("/")), "rb") as handle:
                hashes[relative] = hash_stream(handle)
        marker = {"format": ENV_MARKER_FORMAT, "kind": "venv", "name": job.name, "id": job.key, "recipe": job.recipe,
                  "installer": installer, "bytes": total, "files": len(files), "finished_at": time.time(),
                  "sha256": hashes, "links": dict(links),
                  "seal": entry_seal(self.root_dir.secret, job.name, files, hashes, links=links, context=ENV_SEAL_CONTEXT,
                                     recipe=job.recipe)}
        _write_json_atomic(os.path.join(path, COMPLETE_MARKER), marker)
        os.unlink(os.path.join(path, ENV_BUILDING_MARKER))
        os.chmod(path, 0o500)
        # Hashed just now: a launch need not read them again while their stamps hold.
        self.verified.note_verified(path, files, hashes, always=never_rehashed)
        return {"files": files, "hashes": hashes, "links": links, "bytes": total, "marker": marker}

    # -- launch, envs, reclaim ----------------------------------------------------------------

    def venv_launch(self, runtime, argv, env):
        """(argv, env) of an engine that runs from the sealed environment of its venv runtime:
        PATH starts with ENV/bin, VIRTUAL_ENV is set, a bare argv[0] found in ENV/bin is named by
        its path. Refused when it is not built here (engine_missing) or is not as sealed
        (integrity); anything else than a venv runtime is returned as it is."""
        if runtime is None or runtime.get("kind") != "venv":
            return argv, env
        spec = check_venv_runtime(runtime)
        if self.root_dir.secret is None:
            raise HelperError("no_secret", "no fleet secret on this node: no environment's seal can be checked")
        recipe_id, _, _ = self.venv_recipe(spec)
        path = os.path.join(self.envs_dir(), env_name(recipe_id))
        state, detail = env_state(path, self.root_dir.secret)
        if state in ("absent", "unfinished"):
            how = "" if state == "absent" else " (a build of it is running or was cut off)"
            raise HelperError("engine_missing", "the environment for recipe %s is not built on this node%s: provision "
                                                "builds it in %s" % (recipe_id[:12], how, path))
        if state == "foreign":
            raise HelperError("integrity", "%s is not an environment llmgw built and sealed (%s); the engine was not "
                                           "started, nothing was removed" % (path, detail))
        problem = self.verified.verify_entry(path, detail, always=never_rehashed)
        if problem is not None:
            raise HelperError("integrity", problem.replace("its entry was sealed with", "the environment was sealed with")
                              .replace("after the fetch", "after it was built") + "; the engine was not started")
        bin_dir = os.path.join(path, "bin")
        env = dict(env)
        env["PATH"] = bin_dir + os.pathsep + env.get("PATH", os.environ.get("PATH", os.defpath))
        env["VIRTUAL_ENV"] = path
        # A root engine could still write bytecode into the read-only tree; the seal must hold.
        env.setdefault("PYTHONDONTWRITEBYTECODE", "1")
        if "/" not in argv[0] and find_program(os.path.join(bin_dir, argv[0]), "") is not None:
            argv = [os.path.join(bin_dir, argv[0])] + list(argv[1:])
        _touch_marker(path)  # the environment's "last used"
        return argv, env

    def shard_runtime(self, runtime):
        """What a shard's state records of its runtime (status shows it): kind, and a venv's
        recipe id; None for the host's."""
        if runtime is None:
            return None
        if runtime.get("kind") == "venv":
            return {"kind": "venv", "id": self.venv_recipe(check_venv_runtime(runtime))[0]}
        return {"kind": runtime.get("kind")}

    def wanted_name(self, runtime):
        """{"name", "error"}: the environment (venv-...) or image record (img-...) a runtime
        would use on this node, as its provision names it; error says why it cannot be told."""
        try:
            if not isinstance(runtime, dict):
                raise bad_args("a wanted runtime must be an object")
            if runtime.get("kind") == "venv":
                recipe_id, _, _ = self.venv_recipe(check_venv_runtime(runtime))
                return {"name": env_name(recipe_id), "error": None}
            if runtime.get("kind") == "container":
                _check_container_runtime(runtime)
                program, _ = container_program(runtime)
                return {"name": image_record_name(program, runtime["image"]), "error": None}
            raise bad_args("runtime.kind must be one of %s" % ", ".join(RUNTIME_KINDS))
        except HelperError as exc:
            return {"name": None, "error": exc.message}

    def venv_facts(self, spec):
        """What inventory reports of a venv recipe here (R-4.12): whether the interpreter it is
        made from is on this node (found; null when it did not say its version in time), that
        interpreter and its version, the recipe's id, and whether its environment is built and
        sealed (built; null without the fleet secret to check a seal)."""
        fact = {"python": spec["python"], "found": None, "interpreter": None, "version": None, "id": None,
                "built": None, "error": None}
        try:
            recipe_id, recipe, interpreter = self.venv_recipe(spec, timeout=INVENTORY_PYTHON_TIMEOUT)
        except Unanswered as exc:
            fact["error"] = exc.message
            return fact
        except HelperError as exc:
            fact.update(found=False, error=exc.message)
            return fact
        fact.update(found=True, interpreter=interpreter, version=recipe["python"], id=recipe_id,
                    built=self.env_built(os.path.join(self.envs_dir(), env_name(recipe_id))))
        return fact

    def env_found(self, path):
        """env_state for provision: an environment this helper found sealed with its seal file in
        the state it has now (env_built's memory) is answered from that seal file alone, without
        walking its tree again; the launch that follows walks it and checks every file."""
        if self.env_built(path, walk=False) is True:
            marker, problem = _read_marker(path, os.getuid())
            if problem is None and marker.get("format") == ENV_MARKER_FORMAT and isinstance(marker.get("recipe"), dict):
                return "sealed", {"marker": marker, "bytes": marker.get("bytes")}
        return env_state(path, self.root_dir.secret)

    def env_built(self, path, walk=True):
        """Whether an environment this fleet's llmgw built and sealed is at path; None without the
        fleet secret. Its tree is walked (never read) once per state of its seal file, which every
        launch from it touches; launch checks its files again whatever this said. With walk
        false, only what is remembered for the seal file's state now (None when nothing is)."""
        if self.root_dir.secret is None:
            return None
        try:
            info = os.lstat(os.path.join(path, COMPLETE_MARKER))
        except (FileNotFoundError, NotADirectoryError):
            return False
        except OSError:
            return None
        key = (path, info.st_ino, info.st_mtime_ns, info.st_ctime_ns, info.st_size)
        with self.probe_lock:
            known = self.env_seals.get(key)
        if known is not None or not walk:
            return known
        built = env_state(path, self.root_dir.secret)[0] == "sealed"
        with self.probe_lock:
            for old in [k for k in self.env_seals if k[0] == path]:
                del self.env_seals[old]
            self.env_seals[key] = built
        return built

    def list_envs(self):
        """Every environment under ROOT/envs, sealed or not (reason says why not)."""
        try:
            names = sorted(os.listdir(self.envs_dir()))
        except OSError:
            return []
        used = self.envs_in_use()
        found = []
        for name in names:
            if not ENV_NAME_RE.fullmatch(name):
                continue
            path = os.path.join(self.envs_dir(), name)
            state, detail = env_state(path, self.root_dir.secret)
            entry = {"kind": "venv", "name": name, "id": None, "path": path, "bytes": None, "created_at": None,
                     "last_used": None, "sealed": state == "sealed", "python": None, "packages": None,
                     "installer": None, "reason": None, "used_by": used.get(name, [])}
            if state == "sealed":
                marker = detail["marker"]
                entry.update({"id": marker["id"], "bytes": detail["bytes"], "created_at": marker.get("finished_at"),
                              "last_used": entry_last_used(path), "python": marker["recipe"].get("python"),
                              "packages": marker["recipe"].get("packages"), "installer": marker.get("installer")})
            else:
                entry["bytes"] = _entry_bytes(path)
                if state == "unfinished":
                    entry["id"] = detail.get("id")
                    entry["reason"] = self._unfinished_reason(name)
                else:
                    entry["reason"] = detail
            found.append(entry)
        return found

    def _unfinished_reason(self, name):
        if self._env_building(name):
            return "being built"
        return "left half-built by an interrupted build; the next provision of its recipe replaces it"

    def _env_building(self, name):
        """Whether a helper process of this node is building it now (it holds its lock)."""
        with self.jobs.lock:
            if any(env_name(key) == name for key in self.provisions):
                return True
        try:
            fd = os.open(os.path.join(self.envs_dir(), ".lock-" + name), os.O_RDWR | os.O_NOFOLLOW)
        except OSError:
            return False
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            return True
        finally:
            os.close(fd)
        return False

    def envs_in_use(self):
        """{environment name: [shard ids]} of the engines that run from one now."""
        used = {}
        prefix = self.envs_dir() + os.sep
        for shard_id, state in self.root_dir.all_states():
            if _identity(state)[0] != "alive":
                continue
            runtime = state.get("runtime") if isinstance(state.get("runtime"), dict) else {}
            names = set()
            if runtime.get("kind") == "venv" and isinstance(runtime.get("id"), str):
                names.add(env_name(runtime["id"]))
            argv = state.get("argv") or []
            if argv and isinstance(argv[0], str) and argv[0].startswith(prefix):
                names.add(argv[0][len(prefix):].split(os.sep, 1)[0])
            for name in names:
                used.setdefault(name, []).append(shard_id)
        return used

    def envs_reclaim(self, names, collect):
        """List or remove the named environments (reclaim's "envs"), each judged again here: only
        one llmgw built (sealed, or left half-built by a build of this fleet), that no build holds
        and no live engine runs from, is removed."""
        used = self.envs_in_use()
        entries = []
        for name in names:
            path = os.path.join(self.envs_dir(), name) if isinstance(name, str) and ENV_NAME_RE.fullmatch(name) else None
            entry = {"name": name, "path": path, "bytes": None, "action": "refused", "reason": None, "last_used": None}
            entries.append(entry)
            if path is None:
                entry["reason"] = ("is not an environment's name (venv-<32 hex digits>); llmgw removes only the "
                                   "environments it built")
                continue
            state, detail = env_state(path, self.root_dir.secret)
            if state == "absent":
                entry["reason"] = "not present"
                continue
            if state == "foreign":
                entry["reason"] = "not an environment llmgw built and sealed (%s); never removed" % detail
                continue
            if state == "unfinished" and self._env_building(name):
                entry["reason"] = "being built"
                continue
            if name in used:
                entry["reason"] = "in use by the running shard%s %s" % ("s" if len(used[name]) > 1 else "",
                                                                       ", ".join(used[name]))
                continue
            entry["bytes"] = detail["bytes"] if state == "sealed" else _entry_bytes(path)
            entry["last_used"] = entry_last_used(path)
            if not collect:
                entry["action"] = "listed"
                continue
            with self.root_dir.launch_lock:  # no launch starts from it while it goes
                if name in self.envs_in_use():
                    entry["reason"] = "in use by a shard started meanwhile"
                    continue
                try:
                    remove_tree_within(self.envs_dir(), name, unlock=True)
                except OSError as exc:
                    entry["reason"] = "could not remove: %s" % (exc.strerror or exc)
                    continue
            entry["action"] = "removed"
        return entries


# ---- remote/helper/containers.py -----------------------------------------------------------
# Containers: engines run from an image through the node's docker or podman (R-4.10).

CONTAINER_PROGRAMS = ("docker", "podman")
CONTAINER_CLI_TIMEOUT = 60.0  # a docker command that does not answer in this long has failed
CONTAINER_WAIT = 120.0  # how long the supervisor waits for `run` to create the container
IMAGE_RE = re.compile(r"[a-z0-9]([a-z0-9._/:@+-]{0,254})")  # as the profile field's pattern
PULL_TAIL_LINES = 15
# What inventory reports of the container programs (R-4.12), bounded so a hanging daemon never
# makes it slow: it waits CONTAINER_PROBE_WAIT for their answers, the rest stays unknown.
CONTAINER_PROBE_WAIT = 3.0
CONTAINER_PROBE_LIMIT = 60.0  # a probe's command still running after this long is killed
NVIDIA_HOOK = "nvidia-container-runtime-hook"  # what dockerd runs for --gpus (NVIDIA Container Toolkit)
CDI_DIRS = ("/etc/cdi", "/var/run/cdi")  # where podman finds CDI device specs
CDI_SPEC_MAX_BYTES = 1 << 20
_CDI_NVIDIA_GPU = re.compile(r"""["']?kind["']?\s*:\s*["']?nvidia\.com/gpu\b""")
INVENTORY_IMAGES_MAX = 64
INVENTORY_VENVS_MAX = 64
INVENTORY_PYTHON_TIMEOUT = 5.0  # inventory's wait for an interpreter's version (provision waits longer)
IMAGES_DIR = "images"  # ROOT/images/img-<32 hex>.json: an image a profile ran, as this helper saw it
IMAGE_RECORD_RE = re.compile(r"img-[0-9a-f]{32}")
IMAGE_RECORD_CONTEXT = b"llmgw image record v1\0"


def image_record_name(program, image):
    return "img-" + hashlib.sha256(("%s\0%s" % (program, image)).encode("utf-8")).hexdigest()[:32]


def image_record_mac(secret, record):
    """The HMAC, keyed by the fleet secret, of an image record without its mac: a record this
    fleet's helper wrote, so that `pulled` (the one thing that lets reclaim remove an image) is
    never taken from a planted file."""
    body = dict((key, value) for key, value in record.items() if key != "mac")
    return hmac.new(secret.encode("ascii"), IMAGE_RECORD_CONTEXT + canonical_json(body).encode("utf-8"),
                    hashlib.sha256).hexdigest()


def container_program(runtime):
    """(name, path) of the container program a runtime names, or the first of docker, podman on
    PATH; runtime_missing saying what was looked for."""
    wanted = runtime.get("container")
    names = [wanted] if wanted else list(CONTAINER_PROGRAMS)
    search_path = os.environ.get("PATH", os.defpath)
    for name in names:
        path = find_program(name, search_path)
        if path is not None:
            return name, path
    raise HelperError("runtime_missing", "%s is not on PATH=%s on this node: the profile runs its engine in a "
                                         "container" % (" or ".join(names), search_path))


def container_cli(path, args, timeout=CONTAINER_CLI_TIMEOUT):
    """(exit code, stdout, stderr) of one docker/podman command; runtime_missing when it does not
    answer (the daemon is not reachable: DOCKER_HOST in this node's environment says where)."""
    try:
        done = subprocess.run([path] + list(args), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, timeout=timeout, close_fds=True)
    except subprocess.TimeoutExpired:
        raise HelperError("runtime_missing", "%s %s did not answer within %g s (is its daemon running? DOCKER_HOST=%s)"
                          % (os.path.basename(path), args[0], timeout, os.environ.get("DOCKER_HOST", "unset")))
    except OSError as exc:
        raise HelperError("runtime_missing", "could not run %s: %s" % (path, exc))
    return done.returncode, done.stdout.decode("utf-8", "replace"), done.stderr.decode("utf-8", "replace")


def _daemon_problem(name, stderr):
    """The daemon-not-reachable sentence of a failed command, or None for any other failure."""
    text = stderr.strip()
    if "Cannot connect to the" in text or "Is the docker daemon running" in text or "connection refused" in text:
        return "%s cannot reach its daemon (DOCKER_HOST=%s): %s" % (name, os.environ.get("DOCKER_HOST", "unset"),
                                                                     text.splitlines()[-1] if text else "")
    return None


def cdi_gpus(path):
    """Whether this docker has CDI devices for NVIDIA GPUs (docker 25+ with CDI on, and a spec
    naming nvidia.com/gpu in one of its CDI spec directories, as `nvidia-ctk cdi generate`
    writes): then GPUs are given as CDI devices rather than through the toolkit's --gpus."""
    try:
        code, out, _ = container_cli(path, ["info", "--format", "{{json .CDISpecDirs}}"], timeout=20)
        dirs = json.loads(out) if code == 0 and out.strip() else None
    except (HelperError, ValueError):
        return False
    if not isinstance(dirs, list):
        return False
    return cdi_nvidia_gpu([d for d in dirs if isinstance(d, str)]) is True
    for directory in dirs if isinstance(dirs, list) else []:
        try:
            names = os.listdir(directory) if isinstance(directory, str) else []
        except OSError:
            continue
        for spec in names:
            if spec.endswith((".yaml", ".yml", ".json")):
                try:
                    with open(os.path.join(directory, spec), "rb") as handle:
                        if b"nvidia.com/gpu" in handle.read(1 << 20):
                            return True
                except OSError:
                    continue
    return False


def image_id(path, name, image):
    """The id of an image present on this node, or None when it is not here."""
    code, out, err = container_cli(path, ["image", "inspect", "--format", "{{.Id}}", image])
    if code == 0 and out.strip():
        return out.strip().splitlines()[0]
    problem = _daemon_problem(name, err)
    if problem is not None:
        raise HelperError("runtime_missing", problem)
    return None


def inspect_containers(path, ids):
    """{container id: inspect document} of those that exist (one command for them all)."""
    if not ids:
        return {}
    code, out, err = container_cli(path, ["inspect", "--type", "container"] + list(ids))
    try:
        docs = json.loads(out) if out.strip() else []
    except ValueError:
        docs = []
    found = {}
    for doc in docs if isinstance(docs, list) else []:
        if isinstance(doc, dict) and isinstance(doc.get("Id"), str):
            found[doc["Id"]] = doc
    return found


def fleet_id(secret):
    """The id of the control plane whose secret this node holds, as containers are labelled
    with it: a digest, never the secret."""
    if secret is None:
        return None
    if not isinstance(secret, bytes):
        secret = str(secret).encode("utf-8")
    return hashlib.sha256(b"llmgw fleet id\0" + secret).hexdigest()[:16]


def _check_image(image):
    if not isinstance(image, str) or not IMAGE_RE.fullmatch(image):
        raise bad_args("image %r is not an image reference" % (image,))
    return image


def _check_container_runtime(runtime):
    if runtime.get("kind") != "container":
        raise bad_args("runtime kind must be container here")
    _check_image(runtime.get("image"))
    if runtime.get("container") not in (None,) + CONTAINER_PROGRAMS:
        raise bad_args("container must be one of %s" % ", ".join(CONTAINER_PROGRAMS))
    if runtime.get("pull") not in (None, "if_missing", "always"):
        raise bad_args("pull must be if_missing or always")
    shm = runtime.get("shm_size")
    if shm is not None and (not isinstance(shm, int) or isinstance(shm, bool) or shm <= 0):
        raise bad_args("shm_size must be a positive number of bytes")
    mounts = runtime.get("mounts") or []
    if not isinstance(mounts, list) or not all(isinstance(m, str) and m.startswith("/") and "\0" not in m
                                                 and ":" not in m and "," not in m for m in mounts):
        raise bad_args("mounts must be absolute paths without ':' or ','")
    labels = runtime.get("labels") or {}
    if not isinstance(labels, dict) or not all(isinstance(k, str) and isinstance(v, str) and "=" not in k
                                                 and "\n" not in v for k, v in labels.items()):
        raise bad_args("labels must map names to strings")
    return runtime


def cdi_nvidia_gpu(dirs=CDI_DIRS):
    """Whether a CDI spec for nvidia.com/gpu devices is in one of dirs (what podman's --device
    nvidia.com/gpu=N needs); None when one of them, or a spec in it, could not be read."""
    unreadable = False
    for directory in dirs:
        try:
            names = sorted(os.listdir(directory))
        except (FileNotFoundError, NotADirectoryError):
            continue
        except OSError:
            unreadable = True
            continue
        for name in names:
            if not name.endswith((".json", ".yaml", ".yml")):
                continue
            try:
                with open(os.path.join(directory, name), "rb") as handle:
                    text = handle.read(CDI_SPEC_MAX_BYTES).decode("utf-8", "replace")
            except OSError:
                unreadable = True
                continue
            if _CDI_NVIDIA_GPU.search(text):
                return True
    return None if unreadable else False


def _no_container_facts(path, error=None):
    return {"path": path, "answers": None, "error": error, "runtimes": None, "gpu": None, "images": None}


def probe_container_program(name, path, images, cdi=cdi_nvidia_gpu):
    """What inventory reports of a container program on PATH (R-4.12), asked on a thread that the
    inventory waits for only CONTAINER_PROBE_WAIT: whether it answers (docker: its daemon; podman
    has none, its `info` must work), docker's OCI runtimes, whether it can give a container
    GPUs (gpu: docker's --gpus needs the nvidia runtime or NVIDIA_HOOK, or docker's CDI on with an
    NVIDIA spec; podman's --device nvidia.com/gpu=N a CDI spec), and which of images it holds ({image: bool})."""
    found = _no_container_facts(path)
    query = "{{json .Runtimes}}" if name == "docker" else "{{json .Host.OCIRuntime.Name}}"
    try:
        done = subprocess.run([path, "info", "--format", query], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, timeout=CONTAINER_PROBE_LIMIT, close_fds=True)
    except subprocess.TimeoutExpired:
        found["error"] = "%s info did not answer within %g s" % (name, CONTAINER_PROBE_LIMIT)
        return found
    except OSError as exc:
        found.update(answers=False, error="could not run %s: %s" % (path, exc))
        return found
    err = done.stderr.decode("utf-8", "replace")
    if done.returncode != 0:
        last = err.strip().splitlines()[-1].strip() if err.strip() else "no message"
        found.update(answers=False, error=_daemon_problem(name, err)
                     or "%s info exited with status %d: %s" % (name, done.returncode, last[:300]))
        return found
    found["answers"] = True
    if name == "docker":
        try:
            runtimes = json.loads(done.stdout.decode("utf-8", "replace"))
        except ValueError:
            runtimes = None
        if isinstance(runtimes, dict):
            found["runtimes"] = sorted(str(key) for key in runtimes)
        if found["runtimes"] is not None and "nvidia" in found["runtimes"]:
            found["gpu"] = True
        elif find_program(NVIDIA_HOOK, os.environ.get("PATH", os.defpath)) is not None:
            found["gpu"] = True
        elif cdi_gpus(path):  # launch then gives CDI devices
            found["gpu"] = True
        elif found["runtimes"] is not None:
            found["gpu"] = False
    else:
        found["gpu"] = cdi()
    held = {}
    try:
        for image in images:
            held[image] = image_id(path, name, image) is not None
    except HelperError as exc:
        found["error"] = exc.message  # images stay unknown
        return found
    found["images"] = held
    return found


class PullJob(object):
    """One `docker pull` in progress, shared by every provision that asked for the image."""

    def __init__(self, key):
        self.key = key
        self.lock = threading.Lock()
        self.listeners = {}
        self.lines = []
        self.done = threading.Event()
        self.abort = threading.Event()
        self.result = None
        self.error = None

    def attach(self, key, emit):
        with self.lock:
            if self.abort.is_set():
                return False
            self.listeners[key] = emit
            last = self.lines[-1] if self.lines else None
        emit("progress", {"phase": "pull", "line": last})
        return True

    def detach(self, key):
        with self.lock:
            self.listeners.pop(key, None)
            if not self.listeners and not self.done.is_set():
                self.abort.set()

    def line(self, text):
        with self.lock:
            self.lines.append(text)
            del self.lines[:-PULL_TAIL_LINES]
            listeners = list(self.listeners.values())
        for emit in listeners:
            try:
                emit("progress", {"phase": "pull", "line": text})
            except Exception:
                pass


class Containers(object):
    """provision of a container runtime (the image, pulled single-flight) and the container a
    launch runs, and what inventory reports of the container programs: a part of Node (below)."""

    def __init__(self, root_dir):
        self.root_dir = root_dir
        self.pulls = {}  # (container program, image) -> the PullJob new provisions attach to
        self.pull_lock = threading.Lock()
        self.container_probes = {}  # container program -> its latest inventory probe (a thread)
        self.probe_lock = threading.Lock()  # guards container_probes

    def start_container_probes(self, images):
        """{program: (path or None, probe or None, started now)}: a probe started for each
        container program on PATH, unless the last one started is still running (a program that
        hangs is asked again only once it answered)."""
        search_path = os.environ.get("PATH", os.defpath)
        started = {}
        for name in CONTAINER_PROGRAMS:
            path = find_program(name, search_path)
            if path is None:
                started[name] = (None, None, False)
                continue
            with self.probe_lock:
                probe = self.container_probes.get(name)
                fresh = probe is None or not probe["thread"].is_alive()
                if fresh:
                    thread, box = _start_bounded(lambda name=name, path=path: probe_container_program(name, path, images))
                    probe = self.container_probes[name] = {"thread": thread, "box": box, "since": time.time()}
            started[name] = (path, probe, fresh)
        return started

    def container_facts(self, started, wait=CONTAINER_PROBE_WAIT):
        """inventory's "containers": each program's probe, waited for until wait has passed in
        all; one that has not answered by then is unknown (null), never absent."""
        deadline = time.monotonic() + wait
        facts = {}
        for name, (path, probe, fresh) in sorted(started.items()):
            if path is None:
                facts[name] = _no_container_facts(None)
                continue
            if fresh:
                probe["thread"].join(max(0.0, deadline - time.monotonic()))
            if probe["thread"].is_alive():
                facts[name] = _no_container_facts(path, "%s info has not answered for %.0f s (DOCKER_HOST=%s)" % (
                    name, time.time() - probe["since"], os.environ.get("DOCKER_HOST", "unset")))
            elif "error" in probe["box"]:
                facts[name] = _no_container_facts(path, "asking %s failed: %s" % (name, probe["box"]["error"]))
            else:
                facts[name] = probe["box"]["value"]
        return facts

    def provision_container(self, runtime, ctx):
        _check_container_runtime(runtime)
        name, path = container_program(runtime)
        image = runtime["image"]
        present = image_id(path, name, image)
        if present is not None and runtime.get("pull") != "always":
            self.note_image(name, image, present, pulled=False)
            return {"kind": "container", "image": image, "image_id": present, "program": name, "pulled": False}
        key = (path, image)
        with self.pull_lock:
            job = self.pulls.get(key)
            start = job is None or not job.attach(ctx.key, ctx.emit)
            if start:
                job = self.pulls[key] = PullJob(key)
                job.attach(ctx.key, ctx.emit)
        if start:
            threading.Thread(target=self._run_pull, args=(job, name, path, image), name="llmgw-pull",
                             daemon=True).start()
        try:
            while not job.done.wait(0.05):
                if ctx.cancelled.is_set():
                    raise HelperError("cancelled", "stopped waiting for the pull of %s" % image)
        finally:
            job.detach(ctx.key)
        if job.error is not None:
            raise HelperError(job.error.kind, job.error.message)
        self.note_image(name, image, job.result["image_id"], pulled=present != job.result["image_id"])
        return dict(job.result)

    def _run_pull(self, job, name, path, image):
        try:
            try:
                process = subprocess.Popen([path, "pull", image], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                           stderr=subprocess.STDOUT, close_fds=True)
            except OSError as exc:
                raise HelperError("runtime_missing", "could not run %s: %s" % (path, exc))
            stopper = threading.Thread(target=_stop_when, args=(job.abort, job.done, process), daemon=True)
            stopper.start()
            for raw in process.stdout:
                text = raw.decode("utf-8", "replace").rstrip()
                if text:
                    job.line(text)
            code = process.wait()
            if job.abort.is_set():
                raise HelperError("cancelled", "the pull of %s was abandoned" % image)
            present = image_id(path, name, image) if code == 0 else None
            if present is None:
                tail = " | ".join(job.lines[-5:]) or "no output"
                raise HelperError("provision_failed", "%s pull %s failed (exit %d): %s. Make the image available on "
                                  "this node with `%s load -i FILE` (a file written by `%s save %s`), or let the node "
                                  "reach its registry" % (name, image, code, tail, name, name, image))
            job.result = {"kind": "container", "image": image, "image_id": present, "program": name, "pulled": True}
        except HelperError as exc:
            job.error = exc
        except Exception as exc:  # the waiters must hear of it rather than wait forever
            job.error = HelperError("internal", "pulling %s: %s" % (image, exc))
        finally:
            with self.pull_lock:
                if self.pulls.get(job.key) is job:
                    del self.pulls[job.key]
            job.done.set()

    def container_launch(self, runtime, shard_id, argv, env, gpus, shard_dir):
        """(the command the supervisor runs, its environment, what state.json records) for an
        engine in a container: the template's argv in place of the image's entrypoint, host
        networking, the shard directory and the node's model directories read-only at their own
        paths, the launch env by name only (values stay out of every argv), the GPUs, labels."""
        _check_container_runtime(runtime)
        name, path = container_program(runtime)
        image = runtime["image"]
        present = image_id(path, name, image)
        if present is None:
            raise HelperError("engine_missing", "image %s is not on this node; provision pulls it (pull: %s)"
                              % (image, runtime.get("pull") or "if_missing"))
        if self.root_dir.secret is None:
            raise HelperError("no_secret", "no fleet secret on this node: its containers could not be labelled")
        container_name = "llmgw-" + shard_id
        self._remove_stale_container(name, path, container_name, shard_id)
        cid_file = os.path.join(shard_dir, CONTAINER_ID_FILE)
        command = [path, "run", "--rm", "--name", container_name, "--cidfile", cid_file,
                   "--network", "host", "--workdir", shard_dir, "--entrypoint", argv[0]]
        if runtime.get("shm_size"):
            command += ["--shm-size", "%db" % runtime["shm_size"]]
        else:
            command += ["--ipc", "host"]
        labels = dict(runtime.get("labels") or {})
        labels.update({"llmgw.shard": shard_id, "llmgw.fleet": fleet_id(self.root_dir.secret)})
        for label, value in sorted(labels.items()):
            command += ["--label", "%s=%s" % (label, value)]
        mounts = [shard_dir] + [m for m in runtime.get("mounts") or [] if os.path.isdir(m)]
        seen = set()
        for mount in mounts:
            if mount not in seen:
                seen.add(mount)
                command += ["--volume", "%s:%s:ro" % (mount, mount)]
        for var in sorted(env):
            if var != "PATH":  # the image's own PATH finds its engine
                command += ["--env", var]  # the value comes from the client's environment
        if gpus:
            devices = ",".join(str(index) for index in gpus)
            if name == "podman" or cdi_gpus(path):
                for index in gpus:
                    command += ["--device", "nvidia.com/gpu=%d" % index]
            else:
                command += ["--gpus", '"device=%s"' % devices]
        command += [image] + list(argv[1:])
        client_env = dict(env)
        client_env.pop("PATH", None)
        record = {"program": name, "program_path": path, "image": image, "image_id": present,
                  "name": container_name, "id": None, "started": None, "pid": None}
        self.note_image(name, image, present, pulled=False)  # its last use
        return command, client_env, record

    # -- the images profiles ran: listed by envs, removed by reclaim (R-4.12) -------------------

    def images_dir(self):
        return os.path.join(self.root_dir.path, IMAGES_DIR)

    def _read_image_record(self, record_name):
        """(record, None) or (None, why): a record this fleet's helper wrote, by its file name."""
        path = os.path.join(self.images_dir(), record_name + ".json")
        try:
            with open(path, "rb") as handle:
                record = json.loads(handle.read().decode("utf-8"))
        except (OSError, ValueError) as exc:
            return None, "unreadable (%s)" % exc
        if not isinstance(record, dict) or not isinstance(record.get("image"), str):
            return None, "not an image record"
        if self.root_dir.secret is None or not hmac.compare_digest(str(record.get("mac")), image_record_mac(self.root_dir.secret, record)):
            return None, "not written by this fleet's llmgw"
        return record, None

    def note_image(self, program, image, present_id, pulled):
        """Record that a profile uses `image` here: its id, when first and last used, and
        whether llmgw pulled it (only such an image is ever removed by reclaim). An image found
        present keeps what an earlier record said of its pull while its id is unchanged."""
        if self.root_dir.secret is None:
            return
        record_name = image_record_name(program, image)
        with self.pull_lock:
            old, _ = self._read_image_record(record_name)
            now = time.time()
            record = {"image": image, "program": program, "image_id": present_id, "pulled": bool(pulled),
                      "first_used": now, "last_used": now}
            if old is not None and old.get("image_id") == present_id:
                record["pulled"] = bool(pulled or old.get("pulled"))
                record["first_used"] = old.get("first_used", now)
            record["mac"] = image_record_mac(self.root_dir.secret, record)
            try:
                self.root_dir.private_dir(self.images_dir())
                _write_private_file(os.path.join(self.images_dir(), record_name + ".json"), canonical_json(record))
            except OSError:
                pass  # a record is for listing and collection; the launch goes on without it

    def images_in_use(self):
        """{image id: [shard ids]} of the live shards' containers."""
        used = {}
        for shard_id, state in self.root_dir.all_states():
            container = state.get("container")
            if _identity(state)[0] == "alive" and isinstance(container, dict) and container.get("image_id"):
                used.setdefault(container["image_id"], []).append(shard_id)
        return used

    def list_images(self):
        """Every image a profile ran here, as envs lists it: present or not now, its size, last
        use, whether llmgw pulled it, the live shards running it."""
        try:
            names = sorted(n[:-5] for n in os.listdir(self.images_dir()) if n.endswith(".json"))
        except OSError:
            return []
        used = self.images_in_use()
        found = []
        for record_name in names:
            if not IMAGE_RECORD_RE.fullmatch(record_name):
                continue
            record, why = self._read_image_record(record_name)
            entry = {"kind": "image", "name": record_name, "image": None, "program": None, "id": None,
                     "bytes": None, "first_used": None, "last_used": None, "pulled": None, "present": None,
                     "used_by": [], "reason": why}
            found.append(entry)
            if record is None:
                continue
            entry.update({"image": record["image"], "program": record.get("program"), "id": record.get("image_id"),
                          "first_used": record.get("first_used"), "last_used": record.get("last_used"),
                          "pulled": bool(record.get("pulled"))})
            try:
                program, path = container_program({"container": record.get("program")})
                code, out, err = container_cli(path, ["image", "inspect", "--format", "{{.Id}} {{.Size}}",
                                                      record["image"]], timeout=20)
            except HelperError as exc:
                entry["reason"] = exc.message
                continue
            parts = out.split()
            if code == 0 and len(parts) >= 2:
                entry["present"] = True
                entry["id"] = parts[0]
                entry["bytes"] = int(parts[1]) if parts[1].isdigit() else None
            elif _daemon_problem(program, err) is None:
                entry["present"] = False
            else:
                entry["reason"] = _daemon_problem(program, err)
            entry["used_by"] = used.get(entry["id"], [])
        return found

    def images_reclaim(self, names, collect):
        """List or remove the named images (reclaim's "images"), each judged again here: only an
        image llmgw pulled (by its record, written by this fleet's helper), still the one it
        pulled, that no live shard runs, is removed, by `rmi` without force (docker keeps an
        image any other container uses)."""
        used = self.images_in_use()
        entries = []
        for record_name in names:
            entry = {"name": record_name, "path": None, "bytes": None, "action": "refused", "reason": None,
                     "last_used": None}
            entries.append(entry)
            if not isinstance(record_name, str) or not IMAGE_RECORD_RE.fullmatch(record_name):
                entry["reason"] = "is not the name of an image record (img-<32 hex digits>)"
                continue
            record, why = self._read_image_record(record_name)
            if record is None:
                entry["reason"] = "its record is %s; never removed" % why
                continue
            entry["path"] = record["image"]
            entry["last_used"] = record.get("last_used")
            if not record.get("pulled"):
                entry["reason"] = ("was on the node before llmgw used it (loaded or pulled by someone else); "
                                   "llmgw removes only images it pulled: `%s rmi %s` removes it"
                                   % (record.get("program") or "docker", record["image"]))
                continue
            try:
                program, path = container_program({"container": record.get("program")})
                present = image_id(path, program, record["image"])
            except HelperError as exc:
                entry["reason"] = exc.message
                continue
            if present is None:
                entry["reason"] = "not present"
                continue
            if present != record.get("image_id"):
                entry["reason"] = ("%s is now another image (%s) than the one llmgw pulled (%s); never removed"
                                   % (record["image"], present, record.get("image_id")))
                continue
            if present in used:
                entry["reason"] = "in use by the running shard%s %s" % ("s" if len(used[present]) > 1 else "",
                                                                       ", ".join(used[present]))
                continue
            if not collect:
                entry["action"] = "listed"
                continue
            with self.root_dir.launch_lock:
                if present in self.images_in_use():
                    entry["reason"] = "in use by a shard started meanwhile"
                    continue
                code, out, err = container_cli(path, ["rmi", record["image"]], timeout=120)
            if code != 0:
                entry["reason"] = "%s rmi %s refused: %s" % (program, record["image"], err.strip()[-300:])
                continue
            try:
                os.unlink(os.path.join(self.images_dir(), record_name + ".json"))
            except OSError:
                pass
            entry["action"] = "removed"
        return entries

    def _remove_stale_container(self, name, path, container_name, shard_id):
        """A container of this name left by an earlier start of the shard (its client was
        killed) is removed, only when llmgw labelled it for this shard and fleet; any other is
        refused, never touched."""
        docs = inspect_containers(path, [container_name])
        for doc in docs.values():
            labels = (doc.get("Config") or {}).get("Labels") or {}
            if labels.get("llmgw.shard") != shard_id or labels.get("llmgw.fleet") != fleet_id(self.root_dir.secret):
                raise HelperError("identity", "a container named %s that llmgw did not start for this shard exists on "
                                              "this node; nothing was started or removed" % container_name)
            if (doc.get("State") or {}).get("Running"):
                raise HelperError("alive", "container %s of shard %s is still running" % (doc["Id"][:12], shard_id))
            container_cli(path, ["rm", "-f", doc["Id"]])

    def container_status(self, states):
        """{shard id: ("alive"|"gone"|"mismatch", why, inspect document|None)} for the shards that
        run in containers, one inspect for them all."""
        by_program = {}
        for shard_id, state in states:
            container = state.get("container")
            if isinstance(container, dict) and isinstance(container.get("id"), str):
                by_program.setdefault(container.get("program_path"), []).append((shard_id, container))
        verdicts = {}
        for path, shards in by_program.items():
            try:
                docs = inspect_containers(path, [c["id"] for _, c in shards])
            except HelperError as exc:
                for shard_id, _ in shards:
                    verdicts[shard_id] = ("unknown", exc.message, None)
                continue
            for shard_id, container in shards:
                verdicts[shard_id] = _container_identity(shard_id, container, docs.get(container["id"]),
                                                         fleet_id(self.root_dir.secret))
        return verdicts


def _container_identity(shard_id, container, doc, fleet):
    """("alive" | "gone" | "mismatch", why, doc) of a recorded container: the same id, started
    at the recorded time, labelled for this shard and fleet (R-4.4)."""
    short = container["id"][:12]
    if doc is None:
        return "gone", "container %s no longer exists" % short, None
    state = doc.get("State") or {}
    labels = (doc.get("Config") or {}).get("Labels") or {}
    if labels.get("llmgw.shard") != shard_id or (fleet is not None and labels.get("llmgw.fleet") != fleet):
        return "mismatch", "container %s is not labelled as this shard's" % short, doc
    if container.get("started") and state.get("StartedAt") != container["started"]:
        return "mismatch", "container %s started at %s, not %s: it was restarted" % (
            short, state.get("StartedAt"), container["started"]), doc
    if not state.get("Running"):
        return "gone", "container %s has exited (%s)" % (short, state.get("ExitCode")), doc
    return "alive", None, doc


def _stop_when(abort, done, process):
    while not done.is_set():
        if abort.wait(0.2):
            try:
                process.terminate()
            except OSError:
                pass
            return
        if process.poll() is not None:
            return


# ---- remote/helper/engines.py --------------------------------------------------------------
# Engines: an engine's runtime made present (provision, envs: through the venvs and containers
# parts), the engine launched under the supervisor, watched, stopped, its logs (R-4.4, R-4.7).


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
        # A port that accepts and never answers must time out, not hang (R-4.7).
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


# ---- remote/helper/reclaim.py --------------------------------------------------------------
# Reclaim: list and remove cache entries, every name checked again here (R-5.5).


class Reclaim(object):
    """reclaim: a part of Node (below); environments and images are judged by their parts."""

    def __init__(self, root_dir, fetch, venvs, containers):
        self.root_dir = root_dir
        self.fetch = fetch
        self.venvs = venvs
        self.containers = containers

    def op_reclaim(self, args, ctx):
        env_names = _arg(args, "envs", (list,), None)
        if env_names is not None and not all(isinstance(name, str) for name in env_names):
            raise bad_args("envs must be a list of environment names")
        image_names = _arg(args, "images", (list,), None)
        if image_names is not None and not all(isinstance(name, str) for name in image_names):
            raise bad_args("images must be a list of image record names")
        # With envs or images, the cache directory is optional: a reclaim of engines only.
        engines_only = env_names is not None or image_names is not None
        cache_dir = _arg_path(args, "cache_dir", None if engines_only else _REQUIRED)
        names = _arg(args, "names", (list,), None)
        collect = _arg(args, "collect", (bool,), False)
        if collect and names is None and cache_dir is not None:
            raise bad_args("collect needs the exact list of names to remove")
        if collect and self.root_dir.sha256 is None:
            raise bad_args("reclaim with collect is only available through serve --expect-sha256")
        if names is not None and not all(isinstance(name, str) for name in names):
            raise bad_args("names must be a list of strings")
        until_free = _arg(args, "until_free", (int,), None)
        if until_free is not None and (not collect or until_free < 0 or cache_dir is None):
            raise bad_args("until_free needs collect and a cache_dir, and is a number of bytes (0 or more)")
        result = {}
        if cache_dir is not None:
            result["entries"] = reclaim_entries(cache_dir, names, collect, busy=self.fetch.busy_cache_names(cache_dir),
                                                secret=self.root_dir.secret, until_free=until_free)
            if until_free is not None:
                result["free_bytes"] = cache_free_bytes(cache_dir)
        if env_names is not None:
            result["envs"] = self.venvs.envs_reclaim(env_names, collect)
        if image_names is not None:
            result["images"] = self.containers.images_reclaim(image_names, collect)
        return result


# ---- remote/helper/node.py -----------------------------------------------------------------
# The node: every part together.


class Node(object):
    """The protocol's operations: the parts, each holding its own state, made once and joined by
    an explicit table, operations (name -> op_<name>(args, ctx) -> result dict, in the order
    unknown_op lists them); and the requests running, what cancel reaches."""

    def __init__(self, root, helper_path, sha256=None):
        self.root_dir = RootDir(root, helper_path, sha256)
        self.verified = VerifiedRecord(self.root_dir)
        self.jobs = Jobs()
        self.containers = Containers(self.root_dir)
        self.venvs = Venvs(self.root_dir, self.verified, self.jobs)
        self.inventory = Inventory(self.root_dir, self.venvs, self.containers)
        self.storage = Storage(self.verified)
        self.fetch = Fetches(self.root_dir, self.verified, self.jobs)
        self.engines = Engines(self.root_dir, self.verified, self.venvs, self.containers)
        self.reclaim = Reclaim(self.root_dir, self.fetch, self.venvs, self.containers)
        self.requests = {}
        self.requests_lock = threading.Lock()
        self.closing = threading.Event()
        self.operations = {
            "ping": self.op_ping,
            "inventory": self.inventory.op_inventory,
            "storage": self.storage.op_storage,
            "holdings": self.storage.op_holdings,
            "fetch": self.fetch.op_fetch,
            "source_size": self.fetch.op_source_size,
            "provision": self.engines.op_provision,
            "envs": self.engines.op_envs,
            "launch": self.engines.op_launch,
            "status": self.engines.op_status,
            "stop": self.engines.op_stop,
            "forget": self.engines.op_forget,
            "logs": self.engines.op_logs,
            "reclaim": self.reclaim.op_reclaim,
            "cancel": self.op_cancel,
            "fleet_secret": self.root_dir.op_fleet_secret,
        }

    def register(self, ctx):
        with self.requests_lock:
            self.requests[ctx.key] = ctx

    def unregister(self, ctx):
        with self.requests_lock:
            if self.requests.get(ctx.key) is ctx:
                del self.requests[ctx.key]

    def shutdown(self, wait=3.0):
        """Stop follows and downloads (their temp dirs are removed); engines stay up."""
        self.closing.set()
        with self.requests_lock:
            contexts = list(self.requests.values())
        for ctx in contexts:
            ctx.cancelled.set()
        self.jobs.abort_all(wait)

    # -- ping, cancel ----------------------------------------------------------------------

    def op_ping(self, args, ctx):
        return {"time": time.time()}

    def op_cancel(self, args, ctx):
        target = args.get("target")
        if isinstance(target, bool) or not isinstance(target, (int, str)):
            raise bad_args("argument 'target' must be the id (int or str) of a running request")
        with self.requests_lock:
            victim = self.requests.get((type(target).__name__, target))
        if victim is None or victim is ctx:
            return {"cancelled": False}
        victim.cancelled.set()
        return {"cancelled": True}


# ---- remote/helper/supervisor.py -----------------------------------------------------------
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


# ---- remote/helper/server.py ---------------------------------------------------------------
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


# ---- remote/helper/cli.py ------------------------------------------------------------------
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
