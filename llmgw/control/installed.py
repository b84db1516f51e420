"""The engines llmgw installed on its nodes — environments built for `runtime: venv` and images
run for `runtime: container` — as `ctl engines` lists them and reclaim collects them (R-4.12).

What a profile wants on a node is told by the node's helper itself: the control plane sends it
every profile's runtime (`EnvsRequest.wanted`) and the helper answers the environment or image
record each would provision there (a venv's id depends on the node's interpreter, which only the
node knows), so "wanted by no profile" is exact, never a guess from package names. An entry a
live shard runs from is never offered for removal, and the helper judges every name again.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from llmgw.catalog import Catalog
from llmgw.fleet.ops import Environments, EnvsRequest, NodeOps
from llmgw.runtimes import runtime_spec


def wanted_runtimes(catalog: Catalog) -> dict[str, dict[str, Any]]:
    """{profile name: its runtime spec} of every profile of the catalog whose engine llmgw installs."""
    wanted = {}
    for name, profile in catalog.profiles.items():
        spec = runtime_spec(profile)
        if spec is not None:
            wanted[name] = spec
    return wanted


async def listing(ops: NodeOps, catalog: Catalog) -> Environments:
    return await ops.envs(EnvsRequest(wanted=wanted_runtimes(catalog)))


def wanted_by(found: Environments) -> dict[str, list[str]]:
    """{environment or image record name: [profiles wanting it]} on this node."""
    names: dict[str, list[str]] = {}
    for profile, wanted in sorted(found.wanted.items()):
        if wanted.name is not None:
            names.setdefault(wanted.name, []).append(profile)
    return names


def rows(found: Environments) -> list[dict[str, Any]]:
    """One row per installed engine: what it is, its size and last use, who wants and runs it."""
    wanting = wanted_by(found)
    out = []
    for env in found.envs:
        state = "sealed" if env.sealed else (env.reason or "not sealed")
        out.append({"kind": "venv", "name": env.name, "what": ", ".join(env.packages) if env.packages else None,
                    "version": f"python {env.python}" if env.python else None, "path": env.path,
                    "bytes": env.bytes, "created_at": env.created_at, "last_used": env.last_used, "state": state,
                    "installer": env.installer, "pulled": None, "wanted_by": wanting.get(env.name, []),
                    "used_by": list(env.used_by)})
    for image in found.images:
        if image.present is False:
            state = "gone (removed outside llmgw)"
        elif image.reason is not None:
            state = image.reason
        else:
            state = "present" if image.present else "unknown"
        out.append({"kind": "image", "name": image.name, "what": image.image, "version": image.id, "path": None,
                    "bytes": image.bytes, "created_at": image.first_used, "last_used": image.last_used,
                    "state": state, "installer": image.program, "pulled": image.pulled,
                    "wanted_by": wanting.get(image.name, []), "used_by": list(image.used_by)})
    return out


def unwanted(found: Environments) -> tuple[list[str], list[str]]:
    """(environment names, image record names) no profile wants and no live shard uses: what
    reclaim offers. Half-built environments that no build holds are offered too; an image not
    on the node any more is not."""
    wanting = wanted_by(found)
    envs = [e.name for e in found.envs if e.name not in wanting and not e.used_by and e.reason != "being built"]
    images = [i.name for i in found.images
              if i.name not in wanting and not i.used_by and i.present is not False and i.reason is None]
    return envs, images


def errors(found: Environments) -> Mapping[str, str]:
    """{profile: why the node cannot tell what it would install} (no interpreter, no docker)."""
    return {profile: wanted.error for profile, wanted in sorted(found.wanted.items()) if wanted.error}
