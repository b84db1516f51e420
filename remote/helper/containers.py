# Containers: engines run from an image through the node's docker or podman.

CONTAINER_PROGRAMS = ("docker", "podman")
CONTAINER_CLI_TIMEOUT = 60.0  # a docker command that does not answer in this long has failed
CONTAINER_WAIT = 120.0  # how long the supervisor waits for `run` to create the container
IMAGE_RE = re.compile(r"[a-z0-9]([a-z0-9._/:@+-]{0,254})")  # as the profile field's pattern
PULL_TAIL_LINES = 15
# What inventory reports of the container programs, bounded so a hanging daemon never
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
