"""Where a profile's engine program comes from (R-4.9), as the node helper's RUNTIME argument.

`runtime_spec(profile)` is what `provision` builds and `launch` runs from: None for
`runtime: host` (the program on the node's PATH), the venv recipe for `runtime: venv`, the image
and how to run it for `runtime: container`. The helper hashes a venv's spec (with the
interpreter's version and path) into the recipe id its environment is kept under.
"""

from __future__ import annotations

from typing import Any

from llmgw.config import ProfileConfig


def runtime_spec(profile: ProfileConfig) -> dict[str, Any] | None:
    """The helper's RUNTIME for a profile; None when its engine is the node's own program."""
    if profile.runtime == "venv":
        return {"kind": "venv", "packages": list(profile.packages or ()), "index_url": profile.index_url,
                "find_links": list(profile.find_links or ()), "python": profile.python,
                "post_install": list(profile.post_install or ())}
    if profile.runtime == "container":
        return {"kind": "container", "image": profile.image, "container": profile.container, "pull": profile.pull,
                "shm_size": profile.shm_size}
    return None
