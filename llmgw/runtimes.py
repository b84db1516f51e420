"""Where a profile's engine program comes from (R-4.9), as the node helper's RUNTIME argument.

`runtime_spec(profile)` is what the helper's `provision` makes present and `launch` runs from:
None for `runtime: host` (the program on the node's PATH), the recipe for `runtime: venv` (the
helper hashes it, with the interpreter's version and path, into the id its environment is kept
under; R-4.11), the image and how to run it for `runtime: container` (R-4.10). `runtime_key`
names what one provision makes present on a node, so that the shards waiting for the same
image or environment on a node share one provision.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from typing import Any

from llmgw.config import ProfileConfig


def runtime_spec(profile: ProfileConfig, *, mounts: Sequence[str] = (),
                 labels: Mapping[str, str] | None = None) -> dict[str, Any] | None:
    """The helper's RUNTIME for a profile; None when its engine is the node's own program. For a
    container, `mounts` are the node's directories an engine may read weights from (mounted
    read-only at their own paths) and `labels` what it is labelled with besides the shard and
    the fleet; a venv takes neither (they are not part of its recipe)."""
    if profile.runtime == "venv":
        return {"kind": "venv", "packages": list(profile.packages or ()), "index_url": profile.index_url,
                "extra_index_urls": list(profile.extra_index_urls or ()), "find_links": list(profile.find_links or ()), "python": profile.python,
                "post_install": list(profile.post_install or ())}
    if profile.runtime == "container":
        return {"kind": "container", "image": profile.image, "container": profile.container,
                "pull": profile.pull or "if_missing",
                "shm_size": int(profile.shm_size) if profile.shm_size is not None else None,
                "mounts": sorted(set(mounts)), "labels": dict(labels or {})}
    return None


def runtime_key(spec: Mapping[str, Any]) -> tuple[str, ...]:
    """What a provision of `spec` makes present on a node: the image per container program, or
    the venv recipe (its fields as given; the helper's id adds the interpreter's version)."""
    if spec.get("kind") == "venv":
        return ("venv", str(spec.get("python") or ""), str(spec.get("index_url") or ""),
                "\0".join(spec.get("extra_index_urls") or ()), "\0".join(spec.get("find_links") or ()), "\0".join(spec.get("packages") or ()),
                "\0".join(spec.get("post_install") or ()))
    return (str(spec.get("kind")), str(spec.get("container") or ""), str(spec.get("image")))


def runtime_digest(spec: Mapping[str, Any]) -> str:
    """A short digest of `runtime_key`: the name a venv recipe is asked about under in the
    helper's inventory, so the control plane finds the answer for a profile again, and what
    the last provision's duration of an image or environment is remembered under (R-4.12)."""
    return hashlib.sha256("\0\1".join(runtime_key(spec)).encode("utf-8")).hexdigest()[:16]


def runtime_words(spec: Mapping[str, Any] | None) -> str:
    """The runtime as an operator reads it in a status line."""
    if spec is None:
        return "the host's PATH"
    if spec.get("kind") == "venv":
        return f"an environment of {', '.join(spec.get('packages') or ())}"
    return f"image {spec.get('image')} ({spec.get('container') or 'docker or podman'})"
