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
# Fetch: downloads into a cache directory, single-flight, bounded, sealed.


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
            # checked by hash instead of downloaded again.
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
