"""HTTPS server for weight files and a fake Hugging Face Hub, reachable from testbed nodes.

It runs in a thread of the test process, bound on the bridge address, with a certificate from
the testbed CA (nodes trust it through SSL_CERT_FILE). Tests register files and read hit counters
to prove, for example, that eight shards starting together caused one download.

    url = tb.weights.add("tiny/model.bin", size=1 << 20)             # Content-Length
    tb.weights.add("tiny/stream.bin", size=4096, framing="chunked")  # no Content-Length
    tb.weights.add("slow.bin", size=1 << 20, throttle=256 << 10)     # 256 KiB/s
    tb.weights.add_hf_repo("org/tiny", {"config.json": b"{}", "model.safetensors": 65536},
                           token="hf_secret")
    assert tb.weights.hits("tiny/model.bin") == 1
"""

from __future__ import annotations

import hashlib
import json
import ssl
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import unquote, urlsplit

from .tls import ServerCert

BLOCK = 64 * 1024
FRAMINGS = ("length", "chunked", "close")


@dataclass
class WeightFile:
    """A served file. `content` is given, or made up from the path (deterministic) for `size`."""

    path: str
    size: int
    content: bytes | None = None
    framing: str = "length"
    throttle: int | None = None  # bytes per second
    cut_after: int | None = None  # drop the connection after this many body bytes
    _block: bytes = field(default=b"", repr=False)
    _sha256: str | None = field(default=None, repr=False)

    def __post_init__(self):
        if self.content is None:
            seed = hashlib.sha256(self.path.encode()).digest()
            self._block = (seed * (BLOCK // len(seed) + 1))[:BLOCK]

    def read(self, start: int, end: int) -> bytes:
        if self.content is not None:
            return self.content[start:end]
        out = bytearray()
        while start < end:
            offset = start % BLOCK
            take = min(end - start, BLOCK - offset)
            out += self._block[offset:offset + take]
            start += take
        return bytes(out)

    def sha256(self) -> str:
        if self._sha256 is None:
            h = hashlib.sha256()
            for start in range(0, self.size, BLOCK):
                h.update(self.read(start, min(self.size, start + BLOCK)))
            self._sha256 = h.hexdigest()
        return self._sha256

    def git_blob_id(self) -> str:
        """What git names this content by: sha1 of `blob <size>\\0` and the bytes."""
        return hashlib.sha1(b"blob %d\0" % self.size + self.read(0, self.size)).hexdigest()


def _sibling(name: str, f: WeightFile) -> dict:
    """A file as the hub lists it with `?blobs=true`: a file given by its size is kept in LFS
    (its SHA-256 published), one given by its bytes in git (its blob id)."""
    if f.content is not None:
        return {"rfilename": name, "size": f.size, "blobId": f.git_blob_id()}
    return {"rfilename": name, "size": f.size, "blobId": hashlib.sha1(name.encode()).hexdigest(),
            "lfs": {"sha256": f.sha256(), "size": f.size, "pointerSize": 134}}


@dataclass
class HFRepo:
    repo: str
    revision: str
    sha: str
    files: dict[str, WeightFile]
    token: str | None


class WeightsServer:
    """Serve registered files and Hugging Face-style repos over HTTPS on `host`."""

    def __init__(self, host: str, cert: ServerCert):
        self.host = host
        self.cert = cert
        self.ca_path = cert.ca_path
        self._files: dict[str, WeightFile] = {}
        self._repos: dict[str, list[HFRepo]] = {}
        self._hits: dict[str, int] = {}
        self._lock = threading.Lock()
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(cert.cert_path, cert.key_path)
        handler = type("WeightsHandler", (_Handler,), {"owner": self})
        self._server = _Server((host, 0), handler)
        self._server.socket = context.wrap_socket(self._server.socket, server_side=True)
        self.port = self._server.server_address[1]
        self.url = f"https://{host}:{self.port}"
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.2},
                                        name="testbed-weights", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    # ------------------------------------------------------------------------ registration

    def add(self, path: str, size: int | None = None, content: bytes | None = None, *,
            framing: str = "length", throttle: int | None = None, cut_after: int | None = None) -> str:
        """Serve a file at /files/PATH and return its URL.

        framing: "length" (Content-Length), "chunked" (chunked transfer encoding) or "close" (no
        length; the body ends when the connection closes) — the last two send no Content-Length.
        """
        if framing not in FRAMINGS:
            raise ValueError(f"framing must be one of {FRAMINGS}")
        if content is None and size is None:
            raise ValueError("give size or content")
        path = path.lstrip("/")
        f = WeightFile(path, len(content) if content is not None else int(size), content, framing, throttle, cut_after)
        with self._lock:
            self._files[path] = f
        return f"{self.url}/files/{path}"

    def add_hf_repo(self, repo: str, files: dict[str, bytes | int], *, revision: str = "main",
                    sha: str | None = None, token: str | None = None, throttle: int | None = None) -> str:
        """Publish `org/name` at `revision`: file name -> content bytes or a size. Returns the sha.

        With `token`, every API and file request needs `Authorization: Bearer TOKEN` (401 otherwise).
        """
        sha = sha or hashlib.sha1(f"{repo}@{revision}".encode()).hexdigest()
        served = {}
        for name, value in files.items():
            data = value if isinstance(value, bytes) else None
            size = len(value) if isinstance(value, bytes) else int(value)
            served[name] = WeightFile(f"{repo}/{name}", size, data, "length", throttle)
        with self._lock:
            self._repos.setdefault(repo, []).append(HFRepo(repo, revision, sha, served, token))
        return sha

    @property
    def hf_endpoint(self) -> str:
        """What HF_ENDPOINT should be set to for a client to use the fake hub."""
        return self.url

    def file(self, path: str) -> WeightFile:
        """A registered file by its path (`tiny/model.bin`) or URL."""
        return self._files[self._key(path).removeprefix("/files/").lstrip("/")]

    def hf_file(self, repo: str, name: str, revision: str = "main") -> WeightFile:
        found = self._lookup_repo(repo, revision)
        if found is None:
            raise KeyError(f"{repo}@{revision}")
        return found.files[name]

    def sha256(self, path: str) -> str:
        return self.file(path).sha256()

    # --------------------------------------------------------------------------- counters

    def hits(self, path_or_url: str) -> int:
        """GET requests served for a file path (`tiny/model.bin`), a URL, or a hub path."""
        key = self._key(path_or_url)
        with self._lock:
            return self._hits.get(key, 0) + self._hits.get("/files" + key, 0)

    def all_hits(self) -> dict[str, int]:
        with self._lock:
            return dict(self._hits)

    def _key(self, path_or_url: str) -> str:
        path = urlsplit(path_or_url).path if "://" in path_or_url else path_or_url
        return "/" + unquote(path).lstrip("/")

    def _count(self, path: str) -> None:
        with self._lock:
            self._hits[path] = self._hits.get(path, 0) + 1

    # ---------------------------------------------------------------------------- lookup

    def _lookup_repo(self, repo: str, revision: str) -> HFRepo | None:
        with self._lock:
            for r in reversed(self._repos.get(repo, [])):
                if revision in (r.revision, r.sha):
                    return r
        return None


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True

    def handle_error(self, request, client_address):
        pass  # clients that hang up mid-download are expected here


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    owner: WeightsServer

    def log_message(self, fmt, *args):
        pass

    def do_HEAD(self):
        self._route(head=True)

    def do_GET(self):
        self._route(head=False)

    def _json(self, status: int, doc: dict) -> None:
        body = json.dumps(doc).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _route(self, head: bool) -> None:
        owner = self.owner
        path = unquote(urlsplit(self.path).path)
        if path.startswith("/files/"):
            with owner._lock:
                f = owner._files.get(path[len("/files/"):])
            if f is None:
                return self._json(404, {"error": "not found"})
            if not head:
                owner._count(path)
            return self._send_file(f, head)
        parts = path.strip("/").split("/")
        if len(parts) >= 4 and parts[0] == "api" and parts[1] == "models":
            repo = "/".join(parts[2:4])
            revision = parts[5] if len(parts) >= 6 and parts[4] == "revision" else "main"
            r = owner._lookup_repo(repo, revision)
            if r is None:
                return self._json(404, {"error": "Repository not found" if repo not in owner._repos else f"Invalid rev id: {revision}"})
            if not self._token_ok(r):
                return self._json(401, {"error": "Invalid credentials in Authorization header"})
            return self._json(200, {"id": repo, "modelId": repo, "sha": r.sha,
                                    "siblings": [_sibling(name, f) for name, f in r.files.items()]})
        if len(parts) >= 5 and parts[2] == "resolve":
            repo, revision, name = "/".join(parts[:2]), parts[3], "/".join(parts[4:])
            r = owner._lookup_repo(repo, revision)
            if r is None or name not in r.files:
                return self._json(404, {"error": "Entry not found"})
            if not self._token_ok(r):
                return self._json(401, {"error": "Invalid credentials in Authorization header"})
            if not head:
                owner._count(path)
            return self._send_file(r.files[name], head, {"X-Repo-Commit": r.sha, "ETag": f'"{r.sha[:20]}"'})
        return self._json(404, {"error": "not found"})

    def _token_ok(self, repo: HFRepo) -> bool:
        return repo.token is None or self.headers.get("Authorization", "") == f"Bearer {repo.token}"

    def _send_file(self, f: WeightFile, head: bool, extra: dict | None = None) -> None:
        start, end, status = 0, f.size, 200
        byte_range = self.headers.get("Range", "")
        if f.framing == "length" and byte_range.startswith("bytes="):
            first, _, last = byte_range[6:].partition("-")
            start = int(first or 0)
            end = min(f.size, int(last) + 1) if last else f.size
            status = 206
        self.send_response(status)
        self.send_header("Content-Type", "application/octet-stream")
        for key, value in (extra or {}).items():
            self.send_header(key, value)
        if f.framing == "length":
            self.send_header("Content-Length", str(end - start))
            self.send_header("Accept-Ranges", "bytes")
            if status == 206:
                self.send_header("Content-Range", f"bytes {start}-{end - 1}/{f.size}")
        elif f.framing == "chunked":
            self.send_header("Transfer-Encoding", "chunked")
        else:
            self.send_header("Connection", "close")
            self.close_connection = True
        self.end_headers()
        if head:
            return
        step = BLOCK if not f.throttle else max(1, min(BLOCK, f.throttle // 10))
        sent = 0
        began = time.monotonic()
        offset = start
        while offset < end:
            data = f.read(offset, min(end, offset + step))
            if f.cut_after is not None and sent + len(data) > f.cut_after:
                data = data[: f.cut_after - sent]
                self._write(f, data)
                self.close_connection = True
                self.connection.shutdown(2)
                return
            self._write(f, data)
            offset += len(data)
            sent += len(data)
            if f.throttle:
                ahead = sent / f.throttle - (time.monotonic() - began)
                if ahead > 0:
                    time.sleep(ahead)
        if f.framing == "chunked":
            self.wfile.write(b"0\r\n\r\n")

    def _write(self, f: WeightFile, data: bytes) -> None:
        if not data:
            return
        if f.framing == "chunked":
            self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
        else:
            self.wfile.write(data)
