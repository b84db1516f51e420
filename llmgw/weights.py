"""Weights sources: parsing, the canonical form, and the cache name derived from it (R-5.1, R-5.2)."""

from __future__ import annotations

import hashlib
import posixpath
import re
from dataclasses import dataclass
from urllib.parse import urlsplit, urlunsplit

CACHE_PREFIX = "llmgw-"
REDACTED = "<redacted>"
CACHE_NAME = re.compile(r"^llmgw-[0-9a-f]{16,64}$")
_HF_REPO = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$")
_HF_REVISION = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._/-]{0,127}$")


@dataclass(frozen=True)
class WeightsSource:
    """Where a model's weights come from.

    `path` sources are operator-managed and never fetched: a name relative to a node's
    model_dirs, or an absolute path that must lie inside one of them. `https` and `hf`
    sources are fetched into the node's cache under `cache_name`.
    """

    kind: str  # "path" | "https" | "hf"
    path: str | None = None
    urls: tuple[str, ...] = ()
    repo: str | None = None
    revision: str = "main"

    @property
    def fetched(self) -> bool:
        return self.kind != "path"

    @property
    def canonical(self) -> str:
        if self.kind == "path":
            return f"path:{self.path}"
        if self.kind == "https":
            return "https:" + " ".join(self.urls)
        return f"hf:{self.repo}@{self.revision}"

    @property
    def cache_name(self) -> str | None:
        """`llmgw-<hash of the canonical source>`; None for operator-managed paths."""
        if not self.fetched:
            return None
        return CACHE_PREFIX + hashlib.sha256(self.canonical.encode()).hexdigest()[:32]

    def helper_source(self) -> dict:
        """The `source` argument of the helper's `fetch` operation."""
        if self.kind == "https":
            return {"kind": "https", "urls": list(self.urls)}
        if self.kind == "hf":
            return {"kind": "hf", "repo": self.repo, "revision": self.revision}
        raise ValueError("an operator-managed path is never fetched")

    def candidates(self, model_dirs: list[str] | tuple[str, ...], cache_dir: str | None) -> list[str]:
        """Paths on a node where these weights would be, in the order they are preferred."""
        if self.kind == "path":
            assert self.path is not None
            if self.path.startswith("/"):
                return [self.path]
            return [posixpath.join(d, self.path) for d in model_dirs]
        return [posixpath.join(cache_dir, self.cache_name)] if cache_dir else []

    def __str__(self) -> str:
        """How the source is displayed and logged: a signed URL's query is left out."""
        if self.kind == "path":
            return self.path or ""
        if self.kind == "https":
            first = redact_query(self.urls[0])
            return first if len(self.urls) == 1 else f"{first} (+{len(self.urls) - 1} files)"
        return f"hf:{self.repo}" + ("" if self.revision == "main" else f"@{self.revision}")

    def __repr__(self) -> str:
        if self.kind == "https":
            return f"WeightsSource(kind='https', urls={tuple(redact_query(u) for u in self.urls)!r})"
        return f"WeightsSource({str(self)!r})"


def redact_weights(value: str | list[str]) -> str | list[str]:
    """A `weights:` value as written, with every URL's query redacted (`redact_query`)."""
    if isinstance(value, list):
        return [redact_weights(v) for v in value]
    return redact_query(value) if isinstance(value, str) and "://" in value else value


def redact_query(url: str) -> str:
    """`https://host/path?<redacted>`: the query of a signed URL is a credential, and so is a
    user:password part; what is fetched keeps both, what is shown or logged has neither."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return REDACTED
    netloc = parts.netloc
    if "@" in netloc:
        netloc = "***@" + netloc.rsplit("@", 1)[1]
    query = REDACTED if parts.query or "?" in url else ""
    fragment = REDACTED if parts.fragment else ""
    return urlunsplit((parts.scheme, netloc, parts.path, query, fragment))


def parse_weights(value: object) -> WeightsSource:
    """Parse `hf:org/repo[@rev]`, an https URL (or a list of them), or a path/name."""
    if isinstance(value, (list, tuple)):
        if not value:
            raise ValueError("an empty list of weight URLs")
        urls = [_https_url(v) for v in value]
        return WeightsSource(kind="https", urls=tuple(urls))
    if not isinstance(value, str) or not value.strip():
        raise ValueError("weights must be a path, an https:// URL or hf:org/repo[@revision]")
    value = value.strip()
    if value.startswith("hf:"):
        spec = value[3:]
        repo, _, revision = spec.partition("@")
        if not _HF_REPO.match(repo):
            raise ValueError(f"{value!r}: expected hf:org/repo[@revision]")
        revision = revision or "main"
        if not _HF_REVISION.match(revision) or ".." in revision:
            raise ValueError(f"{value!r}: {revision!r} is not a valid revision")
        return WeightsSource(kind="hf", repo=repo, revision=revision)
    if "://" in value:
        return WeightsSource(kind="https", urls=(_https_url(value),))
    normalised = posixpath.normpath(value)
    if ".." in normalised.split("/"):
        raise ValueError(f"{value!r}: a weights path may not climb out of the model directories with '..'")
    return WeightsSource(kind="path", path=normalised)


def _https_url(value: object) -> str:
    if not isinstance(value, str):
        raise ValueError("a weights URL must be a string")
    parts = urlsplit(value)
    if parts.scheme != "https" or not parts.netloc:
        raise ValueError(f"{redact_query(value)!r}: weights are fetched over https:// only")
    return value
