"""A small synchronous client of the management API, for `llmgw ctl`.

It finds the admin listener and its token the way an operator expects (R-9.3). Without
`--admin` / `LLMGW_ADMIN` it talks to the Unix socket `llmgw serve` keeps in its state directory
(`admin.sock`), never to the TCP port: only the directory's owner can reach that socket, while a
TCP port can be taken by any local process while the gateway is down, and would then be handed
the token. The token comes from `--token` / `LLMGW_ADMIN_TOKEN`, `--token-file`, else the
`admin-token` file of the state directory. Every failure is an `AdminError` whose message is
one line saying what to do.
"""

from __future__ import annotations

import getpass
import http.client
import json
import os
import socket
import ssl
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from llmgw.contracts.errors import Category, LlmgwError
from llmgw.contracts.statedir import default_state_dir

TOKEN_FILE = "admin-token"
SOCKET_FILE = "admin.sock"
TIMEOUT = 60.0
UNIX_BASE = "unix://localhost"


class AdminError(LlmgwError):
    """A refusal or failure, with the API's error document when there was one."""

    def __init__(self, message: str, status: int | None = None, document: dict | None = None):
        super().__init__(message)
        self.message = message
        self.status = status
        self.document = document or {}

    @property
    def category(self) -> Category:  # type: ignore[override]
        """What the admin's answer says of the refusal (its status); no answer at all is internal."""
        status = self.status or 500
        return {400: Category.INPUT, 401: Category.SECURITY, 403: Category.SECURITY, 404: Category.NOT_FOUND,
                409: Category.CONFLICT, 413: Category.INPUT, 422: Category.INPUT}.get(
                    status, Category.INTERNAL if status >= 500 else Category.INPUT)

    @property
    def problems(self) -> list[str]:
        return list(self.document.get("error", {}).get("problems") or [])


def _state_dir(state_dir: str | os.PathLike | None) -> Path:
    value = state_dir or os.environ.get("LLMGW_STATE_DIR")
    return Path(os.path.expanduser(str(value))) if value else default_state_dir()


def _base_url(address: str) -> str:
    """`http://HOST:PORT` from `HOST:PORT` or a URL; a wildcard bind is reached on loopback."""
    address = address.strip().rstrip("/")
    if "://" in address:
        return address
    host, _, port = address.rpartition(":")
    host = host.strip("[]")
    if host in ("", "0.0.0.0"):
        host = "127.0.0.1"
    elif host == "::":
        host = "::1"
    if ":" in host:
        host = f"[{host}]"
    return f"http://{host}:{port}"


class _UnixConnection(http.client.HTTPConnection):
    """HTTP over a Unix socket; the Host header stays `localhost`."""

    def __init__(self, path: str, timeout: float | None = None):
        super().__init__("localhost", timeout=timeout)
        self.socket_path = path

    def connect(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout)
        try:
            sock.connect(self.socket_path)
        except OSError:
            sock.close()
            raise
        self.sock = sock


class _UnixHandler(urllib.request.AbstractHTTPHandler):
    """urllib's handler for `unix://localhost/PATH` URLs, all sent to one socket."""

    def __init__(self, path: str):
        super().__init__()
        self.socket_path = path

    def unix_open(self, request: urllib.request.Request):
        return self.do_open(lambda _host, timeout=None: _UnixConnection(self.socket_path, timeout), request)

    unix_request = urllib.request.AbstractHTTPHandler.do_request_
    unix_response = urllib.request.HTTPErrorProcessor.http_response  # 4xx/5xx raise HTTPError, as for http


def _read_token(path: Path, how: str, missing: str | None = None) -> str:
    try:
        token = path.read_text().strip()
    except FileNotFoundError:
        raise AdminError(missing or f"no admin token file {path}; {how}") from None
    except PermissionError:
        raise AdminError(f"cannot read the admin token {path}: permission denied; run as the user that runs "
                         f"`llmgw serve`, or {how}") from None
    except OSError as exc:
        raise AdminError(f"cannot read the admin token {path} ({exc.strerror}); {how}") from None
    if not token:
        raise AdminError(f"the admin token file {path} is empty; {how}")
    return token


@dataclass
class AdminClient:
    base_url: str
    token: str
    actor: str | None = None
    timeout: float = TIMEOUT
    state_dir: Path | None = field(default=None, repr=False)
    socket_path: Path | None = None  # set: every request goes to this Unix socket
    ca: str | None = None  # PEM file that signed an https listener's certificate; None: the system's

    def __repr__(self) -> str:  # the token never reaches a traceback or a log through repr()
        return f"AdminClient({self.where})"

    @property
    def where(self) -> str:
        return f"unix:{self.socket_path}" if self.socket_path is not None else self.base_url

    @classmethod
    def discover(cls, *, admin: str | None = None, token: str | None = None, token_file: str | None = None,
                 state_dir: str | os.PathLike | None = None, actor: str | None = None,
                 ca: str | None = None) -> AdminClient:
        directory = _state_dir(state_dir)
        address = admin or os.environ.get("LLMGW_ADMIN")
        token = token or os.environ.get("LLMGW_ADMIN_TOKEN")
        token_file = token_file or os.environ.get("LLMGW_ADMIN_TOKEN_FILE")
        if not token and token_file:
            token = _read_token(Path(os.path.expanduser(token_file)), "pass another --token-file")
        if not token:
            path = directory / TOKEN_FILE
            token = _read_token(path, "pass --token-file / LLMGW_ADMIN_TOKEN",
                                missing=f"no admin token at {path}: is `llmgw serve` running with this state "
                                        "directory? Pass --state-dir, or --token-file / LLMGW_ADMIN_TOKEN")
        if address:
            return cls(_base_url(address), token, actor, state_dir=directory, ca=ca)
        return cls(UNIX_BASE, token, actor, state_dir=directory, socket_path=directory / SOCKET_FILE)

    # -- requests ------------------------------------------------------------------------------

    def _request(self, method: str, path: str, *, query: dict | None = None, body: Any = None,
                 content_type: str = "application/json", headers: dict | None = None,
                 timeout: float | None = None):
        url = self.base_url + path
        if query:
            url += "?" + urllib.parse.urlencode({k: v for k, v in query.items() if v is not None})
        data = None
        if body is not None:
            data = body.encode() if isinstance(body, str) else json.dumps(body).encode()
        request = urllib.request.Request(url, data=data, method=method)
        request.add_header("Authorization", f"Bearer {self.token}")
        request.add_header("Accept", "application/json")
        if data is not None:
            request.add_header("Content-Type", content_type)
        if self.actor:
            request.add_header("X-Llmgw-Actor", self.actor)
        for key, value in (headers or {}).items():
            request.add_header(key, value)
        try:
            if self.socket_path is not None:
                opener = urllib.request.build_opener(_UnixHandler(str(self.socket_path)))
                return opener.open(request, timeout=timeout or self.timeout)
            return urllib.request.urlopen(request, timeout=timeout or self.timeout, context=self._tls())
        except urllib.error.HTTPError as exc:
            raise _api_error(exc) from None
        except urllib.error.URLError as exc:
            if self.socket_path is not None:
                raise AdminError(self._socket_unreachable(exc.reason)) from None
            if isinstance(exc.reason, ssl.SSLCertVerificationError):
                raise AdminError(f"the admin listener at {self.base_url} failed the certificate check "
                                 f"({exc.reason.verify_message}); pass --ca FILE with the certificate that "
                                 "signed it") from None
            if isinstance(exc.reason, ssl.SSLError):
                raise AdminError(f"no TLS from the admin listener at {self.base_url} ({exc.reason}); it speaks "
                                 "https only when the gateway sets gateway.admin_tls, else use http://") from None
            raise AdminError(f"cannot reach the admin listener at {self.base_url} ({exc.reason}); is `llmgw "
                             "serve` running? Pass --admin HOST:PORT or --state-dir otherwise") from None
        except (TimeoutError, OSError) as exc:
            raise AdminError(f"the admin listener at {self.where} did not answer: {exc}") from None

    def _tls(self) -> ssl.SSLContext | None:
        if not self.base_url.startswith("https://"):
            return None
        try:
            return ssl.create_default_context(cafile=os.path.expanduser(self.ca) if self.ca else None)
        except (OSError, ssl.SSLError) as exc:
            raise AdminError(f"cannot use --ca {self.ca}: {getattr(exc, 'strerror', None) or exc}") from None

    def _socket_unreachable(self, reason: object) -> str:
        path = self.socket_path
        if isinstance(reason, FileNotFoundError):
            why = f"no admin socket at {path}"
        elif isinstance(reason, ConnectionRefusedError):
            why = f"nothing answers on the admin socket {path}"
        else:
            why = f"cannot reach the admin socket {path} ({getattr(reason, 'strerror', None) or reason})"
        return (f"{why}: is `llmgw serve` running with this state directory? Pass --state-dir, or --admin "
                "HOST:PORT to use a TCP admin listener")

    def call(self, method: str, path: str, **kwargs) -> Any:
        with self._request(method, path, **kwargs) as response:
            return json.loads(response.read() or b"null")

    def get(self, path: str, **query) -> Any:
        return self.call("GET", path, query=query or None)

    def post(self, path: str, body: Any = None, **kwargs) -> Any:
        return self.call("POST", path, body=body if body is not None else {}, **kwargs)

    def text(self, method: str, path: str) -> str:
        with self._request(method, path) as response:
            return response.read().decode()

    def stream(self, path: str, **query) -> Iterator[dict]:
        """JSON documents of a streamed (newline-delimited JSON) answer, as they arrive."""
        with self._request("GET", path, query=query, timeout=24 * 3600.0) as response:
            for line in response:
                line = line.strip()
                if line:
                    yield json.loads(line)

    def dashboard_url(self, path: str = "/") -> str:
        """The tokenised dashboard address. Through the socket, the running gateway says which TCP
        address it listens on: an address file could be stale, and its port someone else's."""
        base = self.base_url
        if self.socket_path is not None:
            listener = self.get("/api/listener")
            base = _base_url(listener["address"])
            if listener.get("scheme") == "https":
                base = "https://" + base.removeprefix("http://")
        return f"{base}{path}?token={urllib.parse.quote(self.token)}"


def default_actor() -> str:
    """The OS user, which `llmgw ctl` sends as the actor of its changes (R-8.2)."""
    try:
        return getpass.getuser()
    except Exception:  # no passwd entry for the uid in some containers
        return "unknown"


def _api_error(exc: urllib.error.HTTPError) -> AdminError:
    try:
        document = json.loads(exc.read() or b"{}")
        message = document["error"]["message"]
    except (ValueError, KeyError, TypeError):
        document, message = {}, f"the admin listener answered {exc.code} {exc.reason}"
    return AdminError(message, exc.code, document)
