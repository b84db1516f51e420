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
