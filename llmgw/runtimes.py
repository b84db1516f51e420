"""What the node helper is told about the runtime a profile runs its engine in (R-4.9).

A profile's `runtime` decides where the engine's program comes from: `host` (the node's PATH,
nothing to tell the helper), `container` (an image run by the node's docker or podman, R-4.10).
`runtime_spec` turns the profile into the plain dict the helper's `provision` and `launch`
take; `runtime_key` names what one provision makes present on a node, so that the shards
waiting for the same image on a node share one pull.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from llmgw.config import ProfileConfig


def runtime_spec(profile: ProfileConfig, *, mounts: Sequence[str] = (),
                 labels: Mapping[str, str] | None = None) -> dict[str, Any] | None:
    """The helper's runtime for a profile, or None for the host's PATH. `mounts` are the node's
    directories an engine may read weights from (mounted read-only at their own paths), `labels`
    what the container is labelled with besides the shard and the fleet."""
    if profile.runtime == "container":
        return {"kind": "container", "image": profile.image, "container": profile.container,
                "pull": profile.pull or "if_missing",
                "shm_size": int(profile.shm_size) if profile.shm_size is not None else None,
                "mounts": sorted(set(mounts)), "labels": dict(labels or {})}
    if profile.runtime == "venv":
        raise ValueError("runtime: venv is not available in this version of the control plane")
    return None


def runtime_key(spec: Mapping[str, Any]) -> tuple[str, ...]:
    """What a provision of `spec` makes present on a node (the image, per container program)."""
    return (str(spec.get("kind")), str(spec.get("container") or ""), str(spec.get("image")))


def runtime_words(spec: Mapping[str, Any] | None) -> str:
    """The runtime as an operator reads it in a status line."""
    if spec is None:
        return "the host's PATH"
    return f"image {spec.get('image')} ({spec.get('container') or 'docker or podman'})"
