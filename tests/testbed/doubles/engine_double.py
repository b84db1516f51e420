"""Inference engine test double: answers like vLLM, SGLang or llama-server, computes nothing.

This is not an inference engine. Testbed nodes get thin entry points (`vllm`, `llama-server`,
`sglang`, and `python3 -m sglang.launch_server` through a stub package) that call `main()` here, so
llmgw can launch "engines" with the real command lines (see ENGINES.md) and talk to them over
HTTP. Standard library only; runs under the node's /usr/bin/python3.

Command lines accepted (as `--flag value` or `--flag=value`; a flag the real engine's CLI does not
have is refused with exit 2, as the real one would: the flag sets are captured from the real
engines in flags/, see flags/README.md):
  vllm serve MODEL [--served-model-name N] [--host H] [--port P] [--api-key K] [-tp N]
       [-pp N] [--nnodes N] [--node-rank R] [--master-addr A] [--master-port P] [--headless]
       [--config YAML] ...                            key also from env VLLM_API_KEY
  python3 -m sglang.launch_server --model-path M [--served-model-name N] [--host H] [--port P]
       [--tp-size N] [--nnodes N] [--node-rank R] [--dist-init-addr A:P] [--api-key K]
       [--config YAML] ...                            (`sglang serve ...` too)
  llama-server -m PATH [--alias N] [--host H] [--port P] [-c N] [-ngl N] [--embeddings]
       [--api-key K] [--api-key-file F] ...           key also from env LLAMA_API_KEY
llama-server with `--lora` files applies the adapters a request's `lora` scales (every one without
`lora`), and its answer's first word names them: `BASE+STEM+...` (STEM: the adapter file's name up
to its first dot).

HTTP (HTTP/1.1, keep-alive): GET /health, GET /v1/models, GET /metrics, POST
/v1/chat/completions, /v1/completions, /v1/embeddings (SSE when `stream: true`; a usage chunk only
with `stream_options.include_usage`, and on vLLM and SGLang the counts so far in every chunk with
`continuous_usage_stats` too; `min_tokens` on vLLM and SGLang, `n_predict` on llama-server).
The reply is deterministic: "<model> heard <N> words" padded
with "la" to `max_tokens` tokens (default 8). /v1/* needs `Authorization: Bearer KEY` when a key
is set (never `x-api-key`, which vLLM ignores); /health and /metrics stay open, except on
llama-server, which needs the key on every path but /health and serves /metrics (its own
`llamacpp:` names) only when started with `--metrics` (501 otherwise). vLLM started with
llmgw's guard (`--middleware llmgw_vllm_guard.EngineKeyGuard`, the module on PYTHONPATH) needs
the key on every path but GET /health, as the real one then does.
Each engine also serves what it serves for real (`ROUTES` below), and 404s the rest: Responses
(streamed with `event:` lines; GET/cancel of a stored response on vLLM only with
VLLM_ENABLE_RESPONSES_API_STORE=1, always on SGLang, never on llama-server, which stores nothing),
Anthropic Messages and count_tokens (vLLM, llama-server), rerank, score (vLLM, SGLang),
tokenize/detokenize, multipart audio transcriptions (vLLM, llama-server) and translations (vLLM);
the text carries the file's size and SHA-256.

Traces (vLLM mode, R-6.21): started with `--otlp-traces-endpoint URL`, the double exports, as
vLLM does, an `llm_request` span (kind SERVER) for every chat, completion or embeddings request it
answers, in the trace of the request's `traceparent` with its span as parent (a new trace without
one; nothing when its sampled flag is off), `service.name` from OTEL_SERVICE_NAME (else
`unknown_service`, as vLLM's resource has). It posts OTLP's JSON encoding (standard library only)
to URL, and only when OTEL_EXPORTER_OTLP_TRACES_PROTOCOL is `http/protobuf`: vLLM's default is
gRPC, which an OTLP/HTTP collector never receives; the double then logs an export error instead.

Readiness follows each engine: vLLM binds its port only once loaded (or binds early and hangs
with the `bind_early` knob); SGLang binds once loaded, then answers 503 during `warmup_delay`;
llama-server binds at once and answers 503 "Loading model" until loaded. Multi-node: the rank-0
shard listens on the master / dist-init port and is ready only when every other rank has joined;
a shard whose peer goes away exits 1. vLLM `--headless` shards serve no HTTP; SGLang ranks >= 1
serve a /health that always answers 200.

Knobs, read at start from `$HOME/engine-double.json` (top level, then `by_model: {NAME: {...}}`,
then `by_port: {"PORT": {...}}`) and then env `ENGINE_DOUBLE_<KNOB>` (upper case):
  start_delay    seconds before the engine is loaded (default 0)
  token_delay    seconds between streamed tokens (default 0)
  crash_after    exit 1 this many seconds after start
  refuse_start   print an engine-like error and exit 1 at once (true, or the message)
  fail_requests  answer 503 to every /v1/* request
  stderr_lines   lines to log on stderr at start
  bind_early     vLLM: listen during loading but answer nothing (probes hang)
  warmup_delay   SGLang: seconds of 503 from /health after binding
  ignore_sigterm keep running on SIGTERM (only SIGKILL stops it)
  children       worker processes to fork (they outlive a parent killed alone)
  report_gpu_mib show up in the nvidia-smi double as a compute app on the visible GPUs
  dist_timeout   seconds a multi-node shard waits for its peers (default 600)
  prefix_cache_blocks  SIMULATED prefix cache (0: off): this many blocks of `block_words` words
                 (default 16), chained hashes, LRU, as vLLM's automatic prefix caching keeps
                 blocks of tokens; a word stands for a token
  prefill_per_token    with the simulated cache: seconds of prefill per prompt word not found in
                 it, before the first byte of the answer; one prefill at a time (the others wait,
                 counted in vllm:num_requests_waiting), as one engine's compute is shared
  request_bodies a file to append, for every JSON request body, one line `{"path": P, "body": B}`:
                 what a test reads to see what reached the engine
  request_ids    a file to append `METHOD PATH ID` to for every request that comes with an
                 X-Request-Id header (ID as it came), whatever the answer: what a test reads to
                 see which ids reached the engine
The simulated cache reports vllm:prefix_cache_queries_total / vllm:prefix_cache_hits_total (in
words) on /metrics and `prompt_tokens_details.cached_tokens` in usage. It models where time goes,
not what a model computes. /metrics (vLLM and SGLang modes) also carries the double's own
engine_double_requests_total, engine_double_aborted_total and engine_double_streams_peak: the
most chat and completion streams it sent at once since it started, each counted from its head to
before its end is written, so a client that sends the next request once one has ended is never
counted twice.
"""

import collections
import hashlib
import json
import math
import os
import random
import re
import signal
import socket
import sys
import threading
import time
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

VERSION = "0.33.0"
DEFAULT_MAX_TOKENS = 8
EMBEDDING_DIM = 8
KNOBS = {
    "start_delay": float, "token_delay": float, "crash_after": float, "refuse_start": str,
    "fail_requests": bool, "stderr_lines": int, "bind_early": bool, "warmup_delay": float,
    "ignore_sigterm": bool, "children": int, "report_gpu_mib": int, "dist_timeout": float,
    "prefix_cache_blocks": int, "block_words": int, "prefill_per_token": float, "request_ids": str, "request_bodies": str,
}
KNOB_DEFAULTS = {
    "start_delay": 0.0, "token_delay": 0.0, "crash_after": None, "refuse_start": None,
    "fail_requests": False, "stderr_lines": 0, "bind_early": False, "warmup_delay": 0.0,
    "ignore_sigterm": False, "children": 0, "report_gpu_mib": 0, "dist_timeout": 600.0,
    "prefix_cache_blocks": 0, "block_words": 16, "prefill_per_token": 0.0, "request_ids": None, "request_bodies": None,
}
# Flags that take no value, so that `--headless MODEL` does not eat MODEL.
BOOLEAN_FLAGS = {
    "--headless", "--enable-lora", "--lora-init-without-apply", "--embeddings", "--embedding", "--enable-metrics", "--trust-remote-code",
    "--enforce-eager", "--disable-log-requests", "--disable-log-stats", "--no-webui",
    "--enable-prefix-caching", "--no-enable-prefix-caching", "--cont-batching", "--flash-attn",
    "--enable-force-include-usage", "--enable-auto-tool-choice", "--verbose", "--metrics",
    "--no-mmap", "--mlock", "--skip-server-warmup", "--reasoning",
}


class UsageError(Exception):
    pass


# The flags each real engine's command line accepts, captured from the engines (see flags/README.md).
FLAGS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "flags")
FLAG_FILES = {"vllm": "vllm-0.32.0.txt", "sglang": "sglang-0.5.23.txt", "llama-server": "llama-server.txt"}
PROGRAMS = {"vllm": "vllm serve", "sglang": "launch_server.py", "llama-server": "llama-server"}


GUARD_MIDDLEWARE = "llmgw_vllm_guard.EngineKeyGuard"


def _guard_importable(env):
    """The guard module is where vLLM would import it from (PYTHONPATH), else vLLM fails to start."""
    for directory in (env.get("PYTHONPATH") or "").split(":"):
        if directory and os.path.isfile(os.path.join(directory, "llmgw_vllm_guard.py")):
            return True
    raise UsageError("ModuleNotFoundError: No module named 'llmgw_vllm_guard'")


def known_flags(mode):
    with open(os.path.join(FLAGS_DIR, FLAG_FILES[mode])) as f:
        return frozenset(line.strip() for line in f if line.strip() and not line.startswith("#"))


def flag_name(mode, arg):
    """The option an argv element names as its engine's parser sees it (None: not an option)."""
    if not arg.startswith("-") or arg == "-" or _is_number(arg):
        return None
    name = arg.split("=", 1)[0]
    if mode == "vllm":
        # vLLM's parser takes --max_model_len for --max-model-len, and --json-arg.key for a key.
        name = name.split(".", 1)[0]
        if name.startswith("--"):
            name = name.replace("_", "-")
    return name


ARGPARSE_ENGINES = ("vllm", "sglang")  # Python argparse: a unique prefix of a long option counts


def is_known_flag(mode, name, known):
    if name in known:
        return True
    if mode in ARGPARSE_ENGINES and name.startswith("--"):
        return len([flag for flag in known if flag.startswith(name)]) == 1
    return False


def unknown_flags(mode, argv):
    known = known_flags(mode)
    return [arg for arg in argv
            if flag_name(mode, arg) is not None and not is_known_flag(mode, flag_name(mode, arg), known)]


def check_flags(mode, argv):
    """Refuse, as the real engine would, a flag its command line does not have."""
    unknown = unknown_flags(mode, argv)
    if unknown:
        raise UsageError(f"{PROGRAMS[mode]}: error: unrecognized arguments: {' '.join(unknown)}")


# ----------------------------------------------------------------------------------- arguments

def split_options(argv):
    """argv -> (options {"--name": value or True}, positionals). Last occurrence wins."""
    options, positionals = {}, []
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg.startswith("-") and len(arg) > 1 and not _is_number(arg):
            name, eq, value = arg.partition("=")
            if eq:
                options[name] = value
            elif name in BOOLEAN_FLAGS:
                options[name] = True
            elif i + 1 < len(argv) and (not argv[i + 1].startswith("-") or _is_number(argv[i + 1])):
                options[name] = argv[i + 1]
                i += 1
            else:
                options[name] = True
        else:
            positionals.append(arg)
        i += 1
    return options, positionals


VLLM_LORA_RANKS = ("1", "8", "16", "32", "64", "128", "256", "320", "512")


def _values_after(argv, flag):
    """The values of an option that takes one or more (vLLM's nargs='+'), last occurrence."""
    values = []
    for i, arg in enumerate(argv):
        if arg == flag:
            values = []
            for value in argv[i + 1:]:
                if value.startswith("-"):
                    break
                values.append(value)
    return values


def _each_value(argv, flag):
    """The value of every occurrence of a one-value option."""
    return [argv[i + 1] for i, arg in enumerate(argv[:-1]) if arg == flag]


def _is_number(text):
    try:
        float(text)
        return True
    except ValueError:
        return False


def read_simple_yaml(path):
    """`key: value` lines of a flat YAML file (what engines' --config files hold)."""
    values = {}
    with open(path) as f:
        for line in f:
            line = line.split(" #", 1)[0].strip()
            if not line or line.startswith("#") or ":" not in line:
                continue
            key, _, value = line.partition(":")
            value = value.strip()
            if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
                value = value[1:-1]
            values["--" + key.strip().replace("_", "-")] = value
    return values


def pick(options, *names, default=None):
    for name in names:
        if name in options:
            return options[name]
    return default


class Engine:
    """What the command line asked for."""

    def __init__(self, mode, argv, env):
        self.mode = mode
        self.argv = list(argv)
        if mode in FLAG_FILES:
            check_flags(mode, argv[1:] if mode == "vllm" or (argv and argv[0] == "serve") else argv)
        if mode == "vllm":
            self._parse_vllm(argv, env)
        elif mode == "sglang":
            self._parse_sglang(argv)
        elif mode == "llama-server":
            self._parse_llama(argv, env)
        else:
            raise UsageError("unknown engine mode %r" % mode)
        self.port = int(self.port)
        self.nnodes = int(self.nnodes)
        self.node_rank = int(self.node_rank)

    def _parse_vllm(self, argv, env):
        if not argv or argv[0] != "serve":
            raise UsageError("usage: vllm serve MODEL [options]")
        options, positionals = split_options(argv[1:])
        config = pick(options, "--config")
        if config:
            options = dict(read_simple_yaml(config), **options)  # the command line wins
        self.model = positionals[0] if positionals else pick(options, "--model")
        if not self.model:
            raise UsageError("vllm serve: error: the following arguments are required: model_tag")
        served = pick(options, "--served-model-name")
        self.names = [served if isinstance(served, str) else self.model]
        self.host = pick(options, "--host", default="") or ""
        self.port = pick(options, "--port", default=8000)
        key = pick(options, "--api-key") or env.get("VLLM_API_KEY")
        self.keys = [key] if isinstance(key, str) and key else []
        self.tp = int(pick(options, "-tp", "--tensor-parallel-size", default=1))
        self.pp = int(pick(options, "-pp", "--pipeline-parallel-size", default=1))
        self.nnodes = pick(options, "--nnodes", default=1)
        self.node_rank = pick(options, "--node-rank", default=0)
        self.rendezvous = (pick(options, "--master-addr", default="127.0.0.1"),
                           int(pick(options, "--master-port", default=29501)))
        self.headless = bool(pick(options, "--headless", default=False))
        self.embeddings_only = False
        self.max_model_len = int(pick(options, "--max-model-len", default=4096))
        self.served_http = not self.headless
        # llmgw's guard middleware (remote/llmgw_vllm_guard.py) as the real vLLM loads it:
        # then every path but GET /health needs the key, not just vLLM's own prefixes.
        self.guarded = GUARD_MIDDLEWARE in argv and _guard_importable(env)
        # vLLM keeps Responses (for GET and previous_response_id) only with this set, in process memory.
        self.store_responses = env.get("VLLM_ENABLE_RESPONSES_API_STORE", "0") == "1"
        # LoRA (docs/architecture.md, "LoRA adapters: what the engines do"): NAME=PATH after
        # --lora-modules, checked at start as the real one loads them (lora_refusal).
        self.lora_enabled = "--enable-lora" in argv
        self.lora_modules = [tuple(m.split("=", 1)) for m in _values_after(argv, "--lora-modules")]
        rank = pick(options, "--max-lora-rank", default="16")
        if rank not in VLLM_LORA_RANKS:
            raise UsageError("vllm serve: error: argument --max-lora-rank: invalid choice: %s (choose from %s)"
                             % (rank, ", ".join(VLLM_LORA_RANKS)))
        self.max_lora_rank = int(rank)
        self.max_loras = int(pick(options, "--max-loras", default=1))
        self.max_cpu_loras = int(pick(options, "--max-cpu-loras", default=self.max_loras))
        endpoint = pick(options, "--otlp-traces-endpoint")
        self.otlp = endpoint if isinstance(endpoint, str) and endpoint else None
        self.otlp_protocol = env.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "grpc")
        self.service_name = env.get("OTEL_SERVICE_NAME") or "unknown_service"

    def _parse_sglang(self, argv):
        if argv and argv[0] == "serve":
            argv = argv[1:]
        options, _ = split_options(argv)
        config = pick(options, "--config")
        if config:
            options = dict(read_simple_yaml(config), **options)
        self.model = pick(options, "--model-path", "--model")
        if not self.model:
            raise UsageError("launch_server.py: error: the following arguments are required: --model-path")
        served = pick(options, "--served-model-name")
        self.names = [served if isinstance(served, str) else self.model]
        self.host = pick(options, "--host", default="127.0.0.1")
        self.port = pick(options, "--port", default=30000)
        key = pick(options, "--api-key")
        self.keys = [key] if isinstance(key, str) and key else []
        self.tp = int(pick(options, "--tp-size", "--tp", "--tensor-parallel-size", default=1))
        self.pp = 1
        self.nnodes = pick(options, "--nnodes", default=1)
        self.node_rank = pick(options, "--node-rank", default=0)
        addr = pick(options, "--dist-init-addr", default="127.0.0.1:20000")
        host, _, port = addr.rpartition(":")
        self.rendezvous = (host, int(port))
        self.headless = False
        self.embeddings_only = False
        self.max_model_len = int(pick(options, "--context-length", default=4096))
        self.served_http = True
        self.store_responses = True

    def _parse_llama(self, argv, env):
        options, _ = split_options(argv)
        self.model = pick(options, "-m", "--model", default=env.get("LLAMA_ARG_MODEL"))
        if not self.model:
            raise UsageError("error: no model given: use -m PATH")
        alias = pick(options, "-a", "--alias", default=env.get("LLAMA_ARG_ALIAS"))
        self.names = alias.split(",") if isinstance(alias, str) and alias else [self.model]
        self.host = pick(options, "--host", default=env.get("LLAMA_ARG_HOST", "127.0.0.1"))
        self.port = pick(options, "--port", default=env.get("LLAMA_ARG_PORT", 8080))
        keys = pick(options, "--api-key") or env.get("LLAMA_API_KEY") or ""
        self.keys = [k for k in keys.split(",") if k] if isinstance(keys, str) else []
        key_file = pick(options, "--api-key-file", default=env.get("LLAMA_ARG_API_KEY_FILE"))
        if isinstance(key_file, str):
            with open(key_file) as f:
                self.keys += [line.strip() for line in f if line.strip()]
        self.tp = self.pp = 1
        self.nnodes, self.node_rank, self.rendezvous = 1, 0, None
        self.headless = False
        self.embeddings_only = bool(pick(options, "--embeddings", "--embedding", default=False))
        self.metrics = bool(pick(options, "--metrics", default=env.get("LLAMA_ARG_ENDPOINT_METRICS")))
        self.max_model_len = int(pick(options, "-c", "--ctx-size", default=4096))
        self.served_http = True
        self.store_responses = False  # its Responses API keeps nothing
        # Every --lora (given more than once, each is loaded, ids in order) and the comma form.
        self.lora_files = [f for value in _each_value(argv, "--lora") for f in value.split(",")]
        self.lora_modules = []

    guarded = False
    lora_enabled = False
    lora_modules: list = []
    lora_files: list = []

    def lora_refusal(self):
        """Why the real engine would stop at start with these adapters, or None."""
        if self.mode == "vllm" and (self.lora_modules or self.lora_enabled):
            if self.max_cpu_loras < self.max_loras:
                return "ValueError: max_cpu_loras (%d) must be >= max_loras (%d)." % (self.max_cpu_loras, self.max_loras)
            for name, path in self.lora_modules:
                config = os.path.join(path, "adapter_config.json")
                if not os.path.isfile(config):
                    return "ValueError: Loading lora %s failed: No adapter found for %s" % (name, path)
                with open(config) as f:
                    rank = int(json.load(f).get("r", 8))
                if rank > self.max_lora_rank:
                    return ("ValueError: Call to add_lora method failed: Worker failed with error 'LoRA rank %d is "
                            "greater than max_lora_rank %d.', please check the stack trace above for the root cause"
                            % (rank, self.max_lora_rank))
        for path in self.lora_files:
            if not os.path.isfile(path):
                return "failed to load lora adapter '%s'" % path
        return None
    otlp = None  # vLLM's --otlp-traces-endpoint; the other engines' traces are not doubled

    @property
    def name(self):
        return self.names[0]


def load_knobs(engine, env):
    knobs = dict(KNOB_DEFAULTS)
    home = env.get("HOME") or os.path.expanduser("~")
    path = os.path.join(home, "engine-double.json")
    try:
        with open(path) as f:
            doc = json.load(f)
    except FileNotFoundError:
        doc = {}
    for layer in (doc, doc.get("by_model", {}).get(engine.name, {}),
                  doc.get("by_port", {}).get(str(engine.port), {})):
        for key, value in layer.items():
            if key in KNOBS:
                knobs[key] = value
    for key, kind in KNOBS.items():
        raw = env.get("ENGINE_DOUBLE_" + key.upper())
        if raw is None:
            continue
        if kind is bool:
            knobs[key] = raw.lower() in ("1", "true", "yes", "on")
        elif kind is str:
            knobs[key] = raw
        else:
            knobs[key] = kind(raw)
    return knobs


# ------------------------------------------------------------------------------------ logging

class Log:
    """Engine-like log lines on stdout (INFO) and stderr (warnings, errors), flushed at once."""

    def __init__(self, mode):
        self.mode = mode
        self.lock = threading.Lock()

    def _line(self, stream, text):
        with self.lock:
            stream.write(text + "\n")
            stream.flush()

    def info(self, text, where="api_server.py:1"):
        if self.mode == "vllm":
            text = "INFO %s [%s] %s" % (time.strftime("%m-%d %H:%M:%S"), where, text)
        elif self.mode == "sglang":
            text = "[%s] %s" % (time.strftime("%Y-%m-%d %H:%M:%S"), text)
        self._line(sys.stdout, text)

    def raw(self, text):
        self._line(sys.stdout, text)

    def error(self, text):
        if self.mode == "vllm":
            text = "ERROR %s [core.py:1] %s" % (time.strftime("%m-%d %H:%M:%S"), text)
        elif self.mode == "sglang":
            text = "[%s] %s" % (time.strftime("%Y-%m-%d %H:%M:%S"), text)
        self._line(sys.stderr, text)

    def access(self, client, method, path, status):
        if self.mode == "llama-server":
            self._line(sys.stdout, "srv  log_server_r: request: %s %s %s %d" % (method, path, client, status))
        else:
            reason = {200: "OK", 400: "Bad Request", 401: "Unauthorized", 404: "Not Found",
                      501: "Not Implemented", 503: "Service Unavailable"}.get(status, "")
            self._line(sys.stdout, 'INFO:     %s - "%s %s HTTP/1.1" %d %s' % (client, method, path, status, reason))


# --------------------------------------------------------------------------------- the engine

class PrefixCache:
    """SIMULATED prefix cache: blocks of words keyed by chained hashes, least recently used out first."""

    def __init__(self, blocks, block_words, prefill_per_token):
        self.blocks = blocks
        self.block_words = max(1, block_words)
        self.prefill_per_token = prefill_per_token
        self.cache = collections.OrderedDict()
        self.lock = threading.Lock()  # the cache's bookkeeping
        self.compute = threading.Lock()  # one prefill at a time
        self.queries = 0
        self.hits = 0
        self.waiting = 0

    def admit(self, words):
        """Cached words of this prompt (its leading blocks found in the cache); caches all its blocks."""
        size = self.block_words
        hashes, parent = [], b""
        for start in range(0, len(words) - len(words) % size, size):
            parent = hashlib.blake2b(parent + " ".join(words[start:start + size]).encode(), digest_size=12).digest()
            hashes.append(parent)
        with self.lock:
            cached = 0
            for digest in hashes:
                if digest not in self.cache:
                    break
                cached += 1
            for digest in hashes:
                self.cache[digest] = True
                self.cache.move_to_end(digest)
            while len(self.cache) > self.blocks:
                self.cache.popitem(last=False)
            self.queries += len(words)
            self.hits += cached * size
        return cached * size

    def prefill(self, uncached):
        """Spend the prefill time of `uncached` words, one prompt at a time."""
        with self.lock:
            self.waiting += 1
        with self.compute:
            with self.lock:
                self.waiting -= 1
            time.sleep(uncached * self.prefill_per_token)


def words_in_order(value):
    """The words of a prompt in order (messages: role, then content), as the simulated cache sees them."""
    if isinstance(value, str):
        return value.split()
    if isinstance(value, list):
        out = []
        for item in value:
            out.extend(words_in_order(item))
        return out
    if isinstance(value, dict):
        role = value.get("role")
        return ([role] if isinstance(role, str) else []) + words_in_order(value.get("content", value.get("text", "")))
    return []


class State:
    """Shared by the HTTP threads: readiness, counters, death."""

    def __init__(self, engine, knobs, log):
        self.engine = engine
        self.knobs = knobs
        self.log = log
        self.started = time.monotonic()
        self.started_wall = time.time()
        self.loaded = threading.Event()
        self.peers_joined = threading.Event()
        self.serving_since = None
        self.dead = False
        self.lock = threading.Lock()
        self.counter = 0
        self.stored = {}  # response id -> the response, when the engine stores them
        self.store_responses = engine.store_responses
        self.requests = 0
        self.aborted = 0
        self.running = 0
        self.streaming = 0  # streams between their head and their last token
        self.streams_peak = 0  # the most of them at once: a stream counts until before its end is sent
        blocks = knobs["prefix_cache_blocks"]
        self.prefix_cache = (PrefixCache(blocks, knobs["block_words"], knobs["prefill_per_token"])
                             if blocks else None)

    def next_id(self):
        with self.lock:
            self.counter += 1
            return self.counter

    def health(self):
        """(status, body) for /health."""
        if self.dead:
            return 503, b""
        e = self.engine
        if e.mode == "llama-server":
            if not self.loaded.is_set():
                return 503, b'{"error":{"code":503,"message":"Loading model","type":"unavailable_error"}}'
            return 200, b'{"status":"ok"}'
        if e.mode == "sglang" and e.node_rank == 0:
            warm = self.serving_since is not None and time.monotonic() - self.serving_since >= self.knobs["warmup_delay"]
            return (200, b"") if warm else (503, b"")
        return 200, b""


def dumps(doc):
    return json.dumps(doc, separators=(",", ":"))


TRACEPARENT = re.compile(r"00-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})")


def export_span(state, traceparent, arrived_ns, model):
    """vLLM's `llm_request` span of one request, posted to its collector on a thread of its own."""
    engine = state.engine
    found = TRACEPARENT.fullmatch(traceparent or "")
    if found and not int(found.group(3), 16) & 1:
        return  # the caller did not sample it: vLLM's parent-based sampler records nothing
    trace_id = found.group(1) if found else "%032x" % random.getrandbits(128)
    span = {"traceId": trace_id, "spanId": "%016x" % random.getrandbits(64), "name": "llm_request", "kind": 2,
            "startTimeUnixNano": str(arrived_ns), "endTimeUnixNano": str(time.time_ns()),
            "attributes": [{"key": "gen_ai.response.model", "value": {"stringValue": str(model)}}]}
    if found:
        span["parentSpanId"] = found.group(2)
    document = {"resourceSpans": [{
        "resource": {"attributes": [{"key": "service.name", "value": {"stringValue": engine.service_name}}]},
        "scopeSpans": [{"scope": {"name": "vllm.llm_engine"}, "spans": [span]}]}]}
    if engine.otlp_protocol != "http/protobuf":
        state.log.error("Failed to export traces to %s, error code: StatusCode.UNAVAILABLE (gRPC; the engine double "
                        "exports over OTLP/HTTP only)" % engine.otlp)
        return

    def post():
        request = urllib.request.Request(engine.otlp, data=dumps(document).encode(), method="POST",
                                         headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=10) as answer:
                answer.read()
        except OSError as exc:
            state.log.error("Failed to export span batch to %s: %s" % (engine.otlp, exc))

    threading.Thread(target=post, daemon=True).start()


def words_of(value):
    if isinstance(value, str):
        return len(value.split())
    if isinstance(value, list):
        return sum(words_of(v) for v in value)
    if isinstance(value, dict):
        return words_of(value.get("content", value.get("text", "")))
    return 0


def reply_tokens(model, prompt_words, max_tokens):
    base = [model, "heard", str(prompt_words), "words"]
    tokens = (base + ["la"] * max(0, max_tokens - len(base)))[:max_tokens]
    return [tok if i == 0 else " " + tok for i, tok in enumerate(tokens)]


def embedding_of(item):
    digest = hashlib.sha256(dumps(item).encode()).digest()
    vec = [(b - 127.5) / 127.5 for b in digest[:EMBEDDING_DIM]]
    norm = math.sqrt(sum(v * v for v in vec)) or 1.0
    return [round(v / norm, 6) for v in vec]


def anthropic_error(message, kind="invalid_request_error"):
    return dumps({"type": "error", "error": {"type": kind, "message": message}}).encode()


def parse_form(content_type, body):
    """name -> bytes of a multipart/form-data body, or None when it is not one."""
    if not content_type.lower().startswith("multipart/form-data") or "boundary=" not in content_type:
        return None
    boundary = content_type.split("boundary=", 1)[1].split(";", 1)[0].strip().strip('"').encode()
    fields = {}
    for part in body.split(b"--" + boundary)[1:]:
        if part.startswith(b"--"):
            break
        headers, _, value = part.partition(b"\r\n\r\n")
        marker = headers.find(b' name="')
        if marker < 0:
            continue
        name = headers[marker + 7:headers.index(b'"', marker + 7)].decode()
        fields[name] = value[:-2] if value.endswith(b"\r\n") else value
    return fields


def error_body(status, message, kind):
    return dumps({"error": {"message": message, "type": kind, "param": None, "code": status}}).encode()


# Routes each engine serves (from their sources; see llmgw/router/routes.py): path -> handler.
_COMMON = {"/v1/chat/completions": "_chat", "/v1/completions": "_completion", "/v1/embeddings": "_embeddings"}
ROUTES = {
    "vllm": dict(_COMMON, **{"/v1/responses": "_responses", "responses/{id}": "", "/v1/messages": "_messages",
                             "/v1/messages/count_tokens": "_count_tokens", "/v1/rerank": "_rerank", "/rerank": "_rerank",
                             "/v2/rerank": "_rerank", "/v1/score": "_score", "/score": "_score",
                             "/tokenize": "_tokenize", "/detokenize": "_detokenize",
                             "/v1/audio/transcriptions": "_audio", "/v1/audio/translations": "_audio"}),
    "sglang": dict(_COMMON, **{"/v1/responses": "_responses", "responses/{id}": "", "/v1/rerank": "_rerank",
                               "/v1/score": "_score", "/tokenize": "_tokenize", "/v1/tokenize": "_tokenize",
                               "/detokenize": "_detokenize", "/v1/detokenize": "_detokenize"}),
    "llama-server": dict(_COMMON, **{"/v1/responses": "_responses", "/v1/messages": "_messages",
                                     "/v1/messages/count_tokens": "_count_tokens", "/rerank": "_rerank",
                                     "/reranking": "_rerank", "/v1/rerank": "_rerank", "/v1/reranking": "_rerank",
                                     "/tokenize": "_tokenize", "/detokenize": "_detokenize",
                                     "/v1/audio/transcriptions": "_audio"}),
}
FORM_ROUTES = ("/v1/audio/transcriptions", "/v1/audio/translations")


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True
    server_version = "uvicorn"
    sys_version = ""
    state = None  # set on the subclass made per server

    # -- plumbing

    def log_message(self, fmt, *args):
        pass

    def _client(self):
        return "%s:%d" % self.client_address[:2]

    def _send(self, status, body, content_type="application/json", headers=()):
        lines = ["HTTP/1.1 %d %s" % (status, self.responses.get(status, ("",))[0]),
                 "content-type: " + content_type, "content-length: %d" % len(body)]
        lines += ["%s: %s" % h for h in headers]
        if self.close_connection:
            lines.append("connection: close")
        self.wfile.write(("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body)
        self.state.log.access(self._client(), self.command, self.path, status)

    def _read_body(self):
        if self.headers.get("transfer-encoding", "").lower() == "chunked":
            parts = []
            while True:
                size = int(self.rfile.readline().split(b";")[0].strip() or b"0", 16)
                if size == 0:
                    while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                        pass
                    break
                parts.append(self.rfile.read(size))
                self.rfile.readline()
            return b"".join(parts)
        length = int(self.headers.get("content-length") or 0)
        return self.rfile.read(length) if length else b""

    def _authorized(self):
        keys = self.state.engine.keys
        if not keys:
            return not self.state.engine.guarded  # llmgw's guard refuses all when it has no key
        auth = self.headers.get("authorization", "")
        return auth.startswith("Bearer ") and auth[7:] in keys

    def _needs_auth(self, path):
        if self.state.engine.guarded:
            return True  # only GET /health, answered before this check, is open
        if self.state.engine.mode == "vllm":
            return path.startswith(("/v1", "/v2", "/inference", "/cohere"))
        if self.state.engine.mode == "llama-server":
            return not path.startswith("/health")  # its /metrics too
        return not (path.startswith("/health") or path in ("/ready", "/metrics", "/ping"))

    # -- dispatch

    def do_GET(self):
        self._dispatch(None)

    def do_POST(self):
        self._dispatch(self._read_body())

    def _dispatch(self, body):
        state = self.state
        engine = state.engine
        path = self.path.split("?", 1)[0]
        request_id = self.headers.get("x-request-id")
        if request_id is not None and state.knobs["request_ids"]:
            with state.lock, open(state.knobs["request_ids"], "a") as noted:
                noted.write("%s %s %s\n" % (self.command, path, request_id))
        if engine.guarded and (self.command, path) == ("GET", "/health"):
            status, payload = state.health()
            return self._send(status, payload)
        if engine.guarded:
            pass  # every other path needs the key, below
        elif path in ("/health", "/v1/health", "/health_generate", "/ping") or (path == "/ready" and engine.mode == "sglang"):
            status, payload = state.health()
            return self._send(status, payload)
        if self._needs_auth(path) and not self._authorized():
            if engine.mode == "llama-server":
                return self._send(401, error_body(401, "Invalid API Key", "authentication_error"))
            return self._send(401, error_body(401, "Unauthorized", "authentication_error"))
        if path == "/metrics" and engine.mode == "llama-server":
            if not engine.metrics:
                return self._send(501, error_body(501, "This server does not support metrics endpoint. "
                                                       "Start it with `--metrics`", "not_supported_error"))
            return self._send(200, self._llama_metrics(), "text/plain; version=0.0.4")
        if path == "/metrics":
            return self._send(200, self._metrics(), "text/plain; version=0.0.4")
        if engine.node_rank > 0:
            return self._send(404, error_body(404, "Not Found", "NotFoundError"))
        if engine.mode == "llama-server" and not state.loaded.is_set():
            return self._send(503, b'{"error":{"code":503,"message":"Loading model","type":"unavailable_error"}}')
        if (path.startswith("/v1/") or path in ROUTES[engine.mode]) and (state.knobs["fail_requests"] or state.dead):
            return self._send(503, error_body(503, "The engine is unavailable", "ServiceUnavailableError"))
        if path == "/v1/models" and body is None:
            return self._send(200, self._models())
        stored = path.startswith("/v1/responses/") and "responses/{id}" in ROUTES[engine.mode]
        if stored:
            return self._stored_response(path, body)
        routes = {route: getattr(self, handler) for route, handler in ROUTES[engine.mode].items() if handler}
        if path not in routes or body is None:
            return self._send(404, error_body(404, "Not Found", "NotFoundError"))
        if path in FORM_ROUTES:
            return self._counted(self._audio, path, body)
        try:
            request = json.loads(body or b"null")
            if not isinstance(request, dict):
                raise ValueError("the body must be a JSON object")
        except ValueError as exc:
            return self._send(400, error_body(400, "invalid JSON body: %s" % exc, "BadRequestError"))
        if state.knobs["request_bodies"]:
            with state.lock, open(state.knobs["request_bodies"], "a") as noted:
                noted.write(dumps({"path": path, "body": request}) + "\n")
        if path in ("/tokenize", "/detokenize", "/v1/tokenize", "/v1/detokenize") and "model" not in request:
            request["model"] = engine.name  # the tokenizer routes take the model as optional
        model = request.get("model")
        if engine.mode == "vllm" and model not in engine.names and model not in dict(engine.lora_modules):
            return self._send(404, error_body(404, "The model `%s` does not exist." % model, "NotFoundError"))
        arrived = time.time_ns()
        self._counted(routes[path], request)
        if engine.otlp is not None and path in _COMMON:
            export_span(state, self.headers.get("traceparent"), arrived, request.get("model"))

    def _counted(self, handler, *args):
        state = self.state
        with state.lock:
            state.requests += 1
            state.running += 1
        try:
            handler(*args)
        finally:
            with state.lock:
                state.running -= 1

    # -- endpoints

    def _models(self):
        e = self.state.engine
        owner = {"vllm": "vllm", "sglang": "sglang", "llama-server": "llamacpp"}[e.mode]
        created = int(self.state.started_wall)
        data = [{"id": name, "object": "model", "created": created, "owned_by": owner, "root": e.model,
                 "parent": None, "max_model_len": e.max_model_len} for name in e.names]
        data += [{"id": name, "object": "model", "created": created, "owned_by": owner, "root": path,
                  "parent": e.name, "max_model_len": e.max_model_len} for name, path in e.lora_modules]
        return dumps({"object": "list", "data": data}).encode()

    def _metrics(self):
        s = self.state
        name = s.engine.name
        cache = s.prefix_cache
        simulated = "" if cache is None else (
            "# TYPE vllm:num_requests_waiting gauge\n"
            'vllm:num_requests_waiting{model_name="%s"} %d\n'
            "# TYPE vllm:prefix_cache_queries_total counter\n"
            'vllm:prefix_cache_queries_total{model_name="%s"} %d\n'
            "# TYPE vllm:prefix_cache_hits_total counter\n"
            'vllm:prefix_cache_hits_total{model_name="%s"} %d\n'
            % (name, cache.waiting, name, cache.queries, name, cache.hits))
        return (simulated + "# TYPE vllm:num_requests_running gauge\n"
                'vllm:num_requests_running{model_name="%s"} %d\n'
                "# TYPE engine_double_requests_total counter\n"
                "engine_double_requests_total %d\n"
                "# TYPE engine_double_aborted_total counter\n"
                "engine_double_aborted_total %d\n"
                "# TYPE engine_double_streams_peak gauge\n"
                "engine_double_streams_peak %d\n" % (name, s.running, s.requests, s.aborted, s.streams_peak)).encode()

    def _llama_metrics(self):
        """llama-server's page (with --metrics): its queue and busy slots, by its own names, and
        the double's own counters."""
        s = self.state
        return ("# HELP llamacpp:requests_processing Number of requests processing\n"
                "# TYPE llamacpp:requests_processing gauge\n"
                "llamacpp:requests_processing %d\n"
                "# HELP llamacpp:requests_deferred Number of requests deferred\n"
                "# TYPE llamacpp:requests_deferred gauge\n"
                "llamacpp:requests_deferred 0\n"
                "# TYPE engine_double_requests_total counter\n"
                "engine_double_requests_total %d\n"
                "# TYPE engine_double_aborted_total counter\n"
                "engine_double_aborted_total %d\n" % (s.running, s.requests, s.aborted)).encode()

    def _generation(self, request, prompt_words, prompt=None):
        max_tokens = request.get("max_completion_tokens") or request.get("max_tokens")
        if max_tokens is None and self.state.engine.mode == "llama-server":
            max_tokens = request.get("n_predict")  # llama-server's own name for the cap
        limited = max_tokens is not None
        max_tokens = int(max_tokens) if limited else DEFAULT_MAX_TOKENS
        if self.state.engine.mode in ("vllm", "sglang") and type(request.get("min_tokens")) is int:
            max_tokens = max(max_tokens, request["min_tokens"])  # as their sampling params: at least this many
        tokens = reply_tokens(self._answering(request), prompt_words, max_tokens)
        usage = {"prompt_tokens": max(1, prompt_words), "completion_tokens": len(tokens),
                 "total_tokens": max(1, prompt_words) + len(tokens)}
        cache = self.state.prefix_cache
        if cache is not None and prompt is not None:  # the simulated prefill, before any byte of the answer
            words = words_in_order(prompt)
            cached = cache.admit(words)
            cache.prefill(len(words) - cached)
            usage["prompt_tokens_details"] = {"cached_tokens": cached}
        return tokens, usage, ("length" if limited else "stop")

    def _answering(self, request):
        """Who answers, as the reply's first word: the model, or on llama-server with adapters the
        base name and each adapter applied (`BASE+FILE-STEM...`): the ids the request's `lora` gives
        a scale other than 0 (an id naming no adapter dropped), or every adapter without `lora`."""
        name = self._model_name(request)
        files = self.state.engine.lora_files
        if not files:
            return name
        lora = request.get("lora")
        if not lora:
            applied = range(len(files))
        else:
            scales = {}
            for entry in lora:
                if isinstance(entry.get("id"), int) and 0 <= entry["id"] < len(files):
                    scales[entry["id"]] = entry.get("scale", 0)
            applied = [i for i in range(len(files)) if scales.get(i)]
        stems = [os.path.basename(files[i]).split(".")[0] for i in applied]
        return "+".join([name, *stems])

    def _model_name(self, request):
        model = request.get("model")
        engine = self.state.engine
        known = model in engine.names or model in dict(engine.lora_modules)
        return model if isinstance(model, str) and known else engine.name

    def _chat(self, request):
        messages = request.get("messages")
        if not isinstance(messages, list) or not messages:
            return self._send(400, error_body(400, "messages must be a non-empty list", "BadRequestError"))
        tokens, usage, finish = self._generation(request, words_of(messages), messages)
        rid, created, model = "chatcmpl-%d%06d" % (os.getpid(), self.state.next_id()), int(time.time()), self._model_name(request)
        if request.get("stream"):
            def chunk(delta, finish_reason=None):
                return {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
                        "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}]}
            events = [chunk({"role": "assistant", "content": ""})]
            events += [chunk({"content": tok}) for tok in tokens]
            events.append(chunk({}, finish))
            return self._stream(request, events, rid, created, model, usage, "chat.completion.chunk")
        answer = {"id": rid, "object": "chat.completion", "created": created, "model": model,
                  "choices": [{"index": 0, "message": {"role": "assistant", "content": "".join(tokens)},
                               "logprobs": None, "finish_reason": finish}],
                  "usage": usage}
        self._send(200, dumps(answer).encode())

    def _completion(self, request):
        prompt = request.get("prompt")
        if prompt is None:
            return self._send(400, error_body(400, "prompt is required", "BadRequestError"))
        tokens, usage, finish = self._generation(request, words_of(prompt), prompt)
        rid, created, model = "cmpl-%d%06d" % (os.getpid(), self.state.next_id()), int(time.time()), self._model_name(request)
        if request.get("stream"):
            def chunk(text, finish_reason=None):
                return {"id": rid, "object": "text_completion", "created": created, "model": model,
                        "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}]}
            events = [chunk(tok) for tok in tokens] + [chunk("", finish)]
            return self._stream(request, events, rid, created, model, usage, "text_completion")
        answer = {"id": rid, "object": "text_completion", "created": created, "model": model,
                  "choices": [{"index": 0, "text": "".join(tokens), "logprobs": None, "finish_reason": finish}],
                  "usage": usage}
        self._send(200, dumps(answer).encode())

    def _embeddings(self, request):
        e = self.state.engine
        if e.mode == "llama-server" and not e.embeddings_only:
            return self._send(501, error_body(501, "This server does not support embeddings. Start it with `--embeddings`", "not_supported_error"))
        items = request.get("input")
        if items is None:
            return self._send(400, error_body(400, "input is required", "BadRequestError"))
        if isinstance(items, str) or (isinstance(items, list) and items and isinstance(items[0], int)):
            items = [items]
        words = sum(words_of(i) if isinstance(i, str) else len(i) for i in items)
        answer = {"object": "list", "model": self._model_name(request),
                  "data": [{"object": "embedding", "index": i, "embedding": embedding_of(item)} for i, item in enumerate(items)],
                  "usage": {"prompt_tokens": max(1, words), "total_tokens": max(1, words)}}
        self._send(200, dumps(answer).encode())

    # -- the other API surfaces: Responses, Anthropic Messages, rerank, score, tokenize, audio

    def _responses(self, request):
        state = self.state
        previous = request.get("previous_response_id")
        history = 0
        if previous is not None:
            with state.lock:
                earlier = state.stored.get(previous)
            if earlier is None:
                return self._send(404, error_body(404, "Response with id '%s' not found." % previous, "invalid_request_error"))
            history = earlier["usage"]["input_tokens"] + earlier["usage"]["output_tokens"]
        request = dict(request, max_tokens=request.get("max_output_tokens"))
        tokens, usage, finish = self._generation(request, words_of(request.get("input")) + history)
        rid = "resp_%d%06d" % (os.getpid(), state.next_id())
        created, model = int(time.time()), self._model_name(request)
        usage = {"input_tokens": usage["prompt_tokens"], "input_tokens_details": {"cached_tokens": 0},
                 "output_tokens": usage["completion_tokens"], "output_tokens_details": {"reasoning_tokens": 0},
                 "total_tokens": usage["total_tokens"]}
        message = {"type": "message", "id": "msg_%s" % rid[5:], "status": "completed", "role": "assistant",
                   "content": [{"type": "output_text", "text": "".join(tokens), "annotations": []}]}

        def response(status, output, usage_now):
            return {"id": rid, "object": "response", "created_at": created, "model": model, "status": status,
                    "output": output, "previous_response_id": previous, "parallel_tool_calls": True,
                    "tool_choice": "auto", "tools": [], "usage": usage_now}
        done = response("completed" if finish == "stop" else "incomplete", [message], usage)
        if state.store_responses and request.get("store", True):
            with state.lock:
                state.stored[rid] = done
        if not request.get("stream"):
            return self._send(200, dumps(done).encode())
        events = [("response.created", {"response": response("in_progress", [], None)})]
        events += [("response.output_text.delta", {"item_id": message["id"], "output_index": 0, "content_index": 0,
                                                   "delta": tok}) for tok in tokens]
        events.append(("response.completed", {"response": done}))
        self._named_stream([(name, dict(data, type=name, sequence_number=i)) for i, (name, data) in enumerate(events)], rid)

    def _stored_response(self, path, body):
        """GET /v1/responses/ID and POST /v1/responses/ID/cancel: only with the store enabled, as vLLM."""
        rid, _, action = path[len("/v1/responses/"):].partition("/")
        if (body is None) != (action == "") or action not in ("", "cancel"):
            return self._send(404, error_body(404, "Not Found", "NotFoundError"))
        with self.state.lock:
            found = self.state.stored.get(rid)
        if found is None:
            return self._send(404, error_body(404, "Response with id '%s' not found." % rid, "invalid_request_error"))
        if action == "cancel":
            return self._send(400, error_body(400, "Cannot cancel a synchronous response.", "invalid_request_error"))
        self._send(200, dumps(found).encode())

    def _messages(self, request):
        messages = request.get("messages")
        if not isinstance(messages, list) or not messages:
            return self._send(400, anthropic_error("messages: Field required"))
        if not isinstance(request.get("max_tokens"), int):
            return self._send(400, anthropic_error("max_tokens: Field required"))
        prompt_words = words_of(messages) + words_of(request.get("system") or "")
        tokens, usage, finish = self._generation(request, prompt_words)
        mid, model = "msg_%d%06d" % (os.getpid(), self.state.next_id()), self._model_name(request)
        stop = "max_tokens" if finish == "length" else "end_turn"
        start_usage = {"input_tokens": usage["prompt_tokens"], "output_tokens": 0}
        end_usage = {"input_tokens": usage["prompt_tokens"], "output_tokens": usage["completion_tokens"]}
        if not request.get("stream"):
            return self._send(200, dumps({"id": mid, "type": "message", "role": "assistant", "model": model,
                                          "content": [{"type": "text", "text": "".join(tokens)}],
                                          "stop_reason": stop, "stop_sequence": None, "usage": end_usage}).encode())
        if self.state.engine.mode == "llama-server":
            end_usage = {"output_tokens": usage["completion_tokens"]}  # as Anthropic: input counts only at the start
        events = [("message_start", {"message": {"id": mid, "type": "message", "role": "assistant", "model": model,
                                                 "content": [], "stop_reason": None, "stop_sequence": None,
                                                 "usage": start_usage}}),
                  ("content_block_start", {"index": 0, "content_block": {"type": "text", "text": ""}}),
                  ("ping", {})]
        events += [("content_block_delta", {"index": 0, "delta": {"type": "text_delta", "text": tok}}) for tok in tokens]
        events += [("content_block_stop", {"index": 0}),
                   ("message_delta", {"delta": {"stop_reason": stop, "stop_sequence": None}, "usage": end_usage}),
                   ("message_stop", {})]
        self._named_stream([(name, dict(data, type=name)) for name, data in events], mid)

    def _count_tokens(self, request):
        messages = request.get("messages")
        if not isinstance(messages, list):
            return self._send(400, anthropic_error("messages: Field required"))
        self._send(200, dumps({"input_tokens": max(1, words_of(messages) + words_of(request.get("system") or ""))}).encode())

    def _rerank(self, request):
        query, documents = request.get("query"), request.get("documents")
        if not isinstance(query, str) or not isinstance(documents, list):
            return self._send(400, error_body(400, "query and documents are required", "BadRequestError"))
        words = words_of(query) * len(documents) + words_of(documents)
        results = sorted(({"index": i, "document": {"text": d}, "relevance_score": self._similarity(query, d)}
                          for i, d in enumerate(documents)), key=lambda r: -r["relevance_score"])
        top_n = request.get("top_n")
        self._send(200, dumps({"id": "rerank-%d" % self.state.next_id(), "model": self._model_name(request),
                               "usage": {"prompt_tokens": max(1, words), "total_tokens": max(1, words)},
                               "results": results[:top_n] if isinstance(top_n, int) else results}).encode())

    def _score(self, request):
        first = request.get("text_1", request.get("queries"))
        second = request.get("text_2", request.get("documents", request.get("items")))
        if first is None or second is None:
            return self._send(400, error_body(400, "text_1 and text_2 are required", "BadRequestError"))
        seconds = second if isinstance(second, list) else [second]
        firsts = first if isinstance(first, list) else [first] * len(seconds)
        words = words_of(firsts) + words_of(seconds)
        self._send(200, dumps({"id": "score-%d" % self.state.next_id(), "object": "list", "created": int(time.time()),
                               "model": self._model_name(request),
                               "data": [{"index": i, "object": "score", "score": self._similarity(a, b)}
                                        for i, (a, b) in enumerate(zip(firsts, seconds))],
                               "usage": {"prompt_tokens": max(1, words), "total_tokens": max(1, words)}}).encode())

    @staticmethod
    def _similarity(a, b):
        left, right = set(str(a).lower().split()), set(str(b).lower().split())
        return round(len(left & right) / (len(left | right) or 1), 6)

    def _tokenize(self, request):
        text = request.get("prompt", request.get("content"))
        if text is None and isinstance(request.get("messages"), list):
            text = " ".join(str(m.get("content", "")) for m in request["messages"] if isinstance(m, dict))
        if not isinstance(text, str):
            return self._send(400, error_body(400, "prompt is required", "BadRequestError"))
        ids = [int.from_bytes(hashlib.sha256(w.encode()).digest()[:2], "big") for w in text.split()]
        self._send(200, dumps({"count": len(ids), "max_model_len": self.state.engine.max_model_len, "tokens": ids}).encode())

    def _detokenize(self, request):
        ids = request.get("tokens")
        if not isinstance(ids, list):
            return self._send(400, error_body(400, "tokens is required", "BadRequestError"))
        self._send(200, dumps({"prompt": " ".join("t%d" % i for i in ids)}).encode())

    def _audio(self, path, body):
        """Multipart audio: the file's size and SHA-256 in the text, so a test can check the bytes that came."""
        fields = parse_form(self.headers.get("content-type", ""), body)
        if fields is None or "file" not in fields or "model" not in fields:
            return self._send(400, error_body(400, "file and model are required form fields", "BadRequestError"))
        if fields["model"].decode() not in self.state.engine.names:
            return self._send(404, error_body(404, "The model `%s` does not exist." % fields["model"].decode(), "NotFoundError"))
        audio = fields["file"]
        verb = "heard" if path.endswith("transcriptions") else "translated"
        if self.state.engine.mode == "vllm" and path.endswith("transcriptions") \
                and fields.get("stream", b"").lower() == b"true":
            # vLLM streams a transcription as chat-like SSE; its usage event only with the
            # `stream_include_usage` form field (the last of a field given twice wins, as Starlette's form).
            words = ("%s %s %d bytes" % (self.state.engine.name, verb, len(audio))).split()
            rid, created, model = "trsc-%d" % self.state.next_id(), int(time.time()), fields["model"].decode()
            events = [{"id": rid, "object": "transcription.chunk", "created": created, "model": model,
                       "choices": [{"delta": {"content": " " + w}, "finish_reason": None}]} for w in words]
            usage = {"prompt_tokens": 10, "completion_tokens": len(words), "total_tokens": 10 + len(words)}
            include = fields.get("stream_include_usage", b"").lower() == b"true"
            return self._stream({"stream_options": {"include_usage": include}}, events, rid, created, model, usage,
                                "transcription.chunk")
        self._send(200, dumps({"text": "%s %s %d bytes sha256 %s" % (self.state.engine.name, verb, len(audio),
                                                                        hashlib.sha256(audio).hexdigest()),
                               "usage": {"type": "duration", "seconds": 1}}).encode())

    def _named_stream(self, events, rid):
        """SSE with `event:` lines, as vLLM sends Responses and Anthropic streams; no [DONE]."""
        head = ("HTTP/1.1 200 OK\r\ncontent-type: text/event-stream; charset=utf-8\r\n"
                "cache-control: no-cache\r\ntransfer-encoding: chunked\r\n\r\n")
        delay = self.state.knobs["token_delay"]
        try:
            self.wfile.write(head.encode())
            for i, (name, event) in enumerate(events):
                if delay and 0 < i < len(events) - 1:
                    time.sleep(delay)
                data = b"event: " + name.encode() + b"\ndata: " + dumps(event).encode() + b"\n\n"
                self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
            self.wfile.write(b"0\r\n\r\n")
        except (BrokenPipeError, ConnectionResetError):
            with self.state.lock:
                self.state.aborted += 1
            self.close_connection = True
            self.state.log.info("Aborted request %s." % rid, "async_llm.py:1")
            return
        self.state.log.access(self._client(), self.command, self.path, 200)

    def _stream(self, request, events, rid, created, model, usage, kind):
        """SSE over chunked transfer encoding, one write per event, `token_delay` between tokens."""
        options = request.get("stream_options") or {}
        include_usage = bool(options.get("include_usage"))
        # vLLM and SGLang put the counts so far in every chunk with `continuous_usage_stats` (vLLM
        # only together with include_usage); llama-server has no such option and ignores the field.
        if include_usage and options.get("continuous_usage_stats") and self.state.engine.mode in ("vllm", "sglang"):
            done = 0
            for event in events:
                choice = event["choices"][0]
                if choice.get("text") or (choice.get("delta") or {}).get("content"):
                    done += 1
                event["usage"] = {"prompt_tokens": usage["prompt_tokens"], "total_tokens": usage["prompt_tokens"] + done,
                                  "completion_tokens": done}
        if include_usage:
            events.append({"id": rid, "object": kind, "created": created, "model": model, "choices": [], "usage": usage})
        head = ("HTTP/1.1 200 OK\r\ncontent-type: text/event-stream; charset=utf-8\r\n"
                "cache-control: no-cache\r\ntransfer-encoding: chunked\r\n\r\n")
        delay = self.state.knobs["token_delay"]
        state = self.state
        try:
            self.wfile.write(head.encode())
            with state.lock:
                state.streaming += 1
                state.streams_peak = max(state.streams_peak, state.streaming)
            try:
                for i, event in enumerate(events):
                    if delay and 0 < i < len(events) - 1:
                        time.sleep(delay)
                    data = b"data: " + dumps(event).encode() + b"\n\n"
                    self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
            finally:
                with state.lock:
                    state.streaming -= 1
            done = b"data: [DONE]\n\n"
            self.wfile.write(b"%x\r\n%s\r\n0\r\n\r\n" % (len(done), done))
        except (BrokenPipeError, ConnectionResetError):
            with self.state.lock:
                self.state.aborted += 1
            self.close_connection = True
            self.state.log.info("Aborted request %s." % rid, "async_llm.py:1")
            return
        self.state.log.access(self._client(), self.command, self.path, 200)


class Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = 256

    def handle_error(self, request, client_address):
        # A client that hangs up is not an engine error worth a traceback in the log.
        exc = sys.exc_info()[1]
        if isinstance(exc, (ConnectionError, TimeoutError)):
            return
        super().handle_error(request, client_address)


def make_server(state):
    handler = type("BoundHandler", (Handler,), {"state": state})
    host = state.engine.host
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    server_class = type("BoundServer", (Server,), {"address_family": family})
    return server_class((host, state.engine.port), handler)


# ----------------------------------------------------------------------------- multi-node peers

def lead_peers(state):
    """Rank 0: accept the other ranks on the rendezvous port; a rank that leaves kills the engine."""
    engine = state.engine
    want = set(range(1, engine.nnodes))
    joined = set()
    lock = threading.Lock()
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("", engine.rendezvous[1]))
    listener.listen(64)
    state.log.info("rendezvous listening on port %d for %d peer(s)" % (engine.rendezvous[1], len(want)), "parallel_state.py:1")

    def serve_peer(conn):
        f = conn.makefile("rb")
        line = f.readline().strip()
        try:
            rank = int(line)
        except ValueError:
            conn.close()
            return
        with lock:
            joined.add(rank)
            if want <= joined:
                state.peers_joined.set()
        conn.sendall(b"ok\n")
        state.log.info("node rank %d joined" % rank, "parallel_state.py:1")
        f.read()  # returns at EOF: the peer is gone
        state.log.error("RuntimeError: connection to node rank %d lost; the engine is dead" % rank)
        die(state)

    def accept():
        while True:
            conn, _ = listener.accept()
            threading.Thread(target=serve_peer, args=(conn,), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()


def join_leader(state):
    """Rank >= 1: connect to rank 0 (retrying until dist_timeout); exit when it goes away."""
    engine = state.engine
    deadline = time.monotonic() + state.knobs["dist_timeout"]
    while True:
        try:
            conn = socket.create_connection(engine.rendezvous, timeout=2)
            conn.sendall(b"%d\n" % engine.node_rank)
            f = conn.makefile("rb")
            if f.readline().strip() != b"ok":
                raise OSError("bad answer")
            conn.settimeout(None)
            break
        except OSError:
            if time.monotonic() > deadline:
                state.log.error("RuntimeError: timed out joining %s:%d as node rank %d" % (engine.rendezvous + (engine.node_rank,)))
                os._exit(1)
            time.sleep(0.2)
    state.log.info("joined %s:%d as node rank %d" % (engine.rendezvous + (engine.node_rank,)), "parallel_state.py:1")
    state.peers_joined.set()

    def watch():
        f.read()
        state.log.error("RuntimeError: connection to node rank 0 lost")
        os._exit(1)

    threading.Thread(target=watch, daemon=True).start()


def die(state):
    state.dead = True
    threading.Timer(0.2, os._exit, args=(1,)).start()


# ----------------------------------------------------------------------------------- start-up

REFUSALS = {
    "vllm": ("ValueError: Free memory on device (1.2/79.1 GiB) on startup is less than desired GPU memory utilization "
             "(0.92, 72.8 GiB). Decrease GPU memory utilization or reduce GPU memory used by other processes."),
    "sglang": "RuntimeError: Not enough memory. Please try to increase --mem-fraction-static.",
    "llama-server": "llama_model_load: error loading model: tensor data is not within the file bounds\nmain: exiting due to model loading error",
}


def register_gpu_use(node_dir, mib, env):
    """Leave a record the nvidia-smi double lists as this process's compute app."""
    try:
        with open(os.path.join(node_dir, "gpus.json")) as f:
            gpus = json.load(f)["gpus"]
    except (OSError, ValueError, KeyError):
        return
    visible = env.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        wanted = [v.strip() for v in visible.split(",") if v.strip()]
        gpus = [g for g in gpus if str(g["index"]) in wanted or g["uuid"] in wanted]
    folder = os.path.join(node_dir, "gpu-apps")
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, "%d.json" % os.getpid())
    with open(path + ".tmp", "w") as f:
        json.dump({"uuids": [g["uuid"] for g in gpus], "mib": mib, "name": sys.argv[0]}, f)
    os.rename(path + ".tmp", path)


def on_signal(state):
    def handler(signum, frame):
        if state.knobs["ignore_sigterm"] and signum == signal.SIGTERM:
            state.log.info("received SIGTERM; ignoring it", "launcher.py:1")
            return
        state.log.info("Shutting down (signal %d)" % signum, "launcher.py:1")
        os._exit(0)
    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)


def main(mode, argv, node_dir=None, env=None):
    env = dict(os.environ if env is None else env)
    sys.stdout = open(sys.stdout.fileno(), "w", buffering=1, closefd=False)
    if mode == "vllm" and argv and argv[0] in ("--version", "-v"):
        print(VERSION)
        return 0
    if mode == "llama-server" and argv and argv[0] == "--version":
        print("version: 9999 (engine test double)")
        return 0
    try:
        engine = Engine(mode, argv, env)
    except (UsageError, ValueError, OSError) as exc:
        sys.stderr.write("%s\n" % exc)
        return 2
    knobs = load_knobs(engine, env)
    log = Log(mode)
    state = State(engine, knobs, log)

    if mode == "vllm":
        log.info("vLLM API server version %s (engine test double)" % VERSION, "utils.py:1")
        log.info("args: model=%s served_model_name=%s host=%s port=%d tp=%d pp=%d nnodes=%d node_rank=%d headless=%s api_key=%s"
                 % (engine.model, engine.name, engine.host or "0.0.0.0", engine.port, engine.tp, engine.pp,
                    engine.nnodes, engine.node_rank, engine.headless, "<redacted>" if engine.keys else None), "utils.py:1")
    elif mode == "sglang":
        # Like the real one, it prints its key among its server arguments (ENGINES.md, SGLang).
        log.info("server_args=ServerArgs(model_path='%s', served_model_name='%s', host='%s', port=%d, tp_size=%d, "
                 "nnodes=%d, node_rank=%d, api_key=%s, admin_api_key=None) (engine test double)"
                 % (engine.model, engine.name, engine.host, engine.port, engine.tp, engine.nnodes, engine.node_rank,
                    repr(engine.keys[0]) if engine.keys else None))
    else:
        log.raw("build: 9999 (engine test double)")
        log.raw("main: loading model")
        log.raw("srv    load_model: loading model '%s'" % engine.model)
    for i in range(int(knobs["stderr_lines"])):
        log.error("WARNING engine double start-up line %d of %d" % (i + 1, knobs["stderr_lines"]))
    refused = engine.lora_refusal()
    if refused:
        log.error(refused)
        return 1
    if knobs["refuse_start"]:
        refusal = knobs["refuse_start"]
        given = isinstance(refusal, str) and refusal.lower() not in ("1", "true", "yes")
        message = refusal if given else REFUSALS[mode]
        log.error(message)
        return 1

    for _ in range(int(knobs["children"])):
        if os.fork() == 0:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            while True:
                time.sleep(3600)
    on_signal(state)
    if knobs["crash_after"] is not None:
        def crash():
            log.error("RuntimeError: CUDA error: an illegal memory access was encountered")
            os._exit(1)
        threading.Timer(float(knobs["crash_after"]), crash).start()
    if knobs["report_gpu_mib"] and node_dir:
        register_gpu_use(node_dir, int(knobs["report_gpu_mib"]), env)

    if engine.nnodes > 1:
        if engine.node_rank == 0:
            try:
                lead_peers(state)
            except OSError as exc:
                log.error("OSError: rendezvous port %d: %s" % (engine.rendezvous[1], exc))
                return 1
        else:
            threading.Thread(target=join_leader, args=(state,), daemon=True).start()
    else:
        state.peers_joined.set()

    def load():
        time.sleep(float(knobs["start_delay"]))
        if not state.peers_joined.wait(float(knobs["dist_timeout"])):
            log.error("RuntimeError: timed out waiting for %d node(s) to join" % (engine.nnodes - 1))
            os._exit(1)
        state.loaded.set()

    server = None
    early = mode == "llama-server" or (mode == "vllm" and knobs["bind_early"])
    if engine.served_http and early:
        try:
            server = make_server(state)
        except OSError as exc:
            log.error("OSError: [Errno %d] error while attempting to bind on address ('%s', %d): %s"
                      % (exc.errno or 0, engine.host, engine.port, exc.strerror))
            return 1
        if mode == "llama-server":
            log.raw("main: HTTP server is listening, hostname: %s, port: %d, http threads: 4" % (engine.host, engine.port))
            threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.5}, daemon=True).start()
    load()
    if not engine.served_http:
        log.info("headless node rank %d: no API server on this node" % engine.node_rank, "serve.py:1")
        while True:
            time.sleep(3600)
    if server is None:
        try:
            server = make_server(state)
        except OSError as exc:
            log.error("OSError: [Errno %d] error while attempting to bind on address ('%s', %d): %s"
                      % (exc.errno or 0, engine.host, engine.port, exc.strerror))
            return 1
    state.serving_since = time.monotonic()
    shown = engine.host or "0.0.0.0"
    if mode == "vllm":
        log.info("Starting vLLM API server 0 on http://%s:%d" % (shown, engine.port), "launcher.py:1")
        log.raw("INFO:     Started server process [%d]" % os.getpid())
        log.raw("INFO:     Waiting for application startup.")
        log.raw("INFO:     Application startup complete.")
    elif mode == "sglang":
        log.info("INFO:     Uvicorn running on http://%s:%d (Press CTRL+C to quit)" % (shown, engine.port))
        if engine.node_rank == 0:
            log.info("The server is fired up and ready to roll!")
        else:
            log.info("dummy health check server for node rank %d" % engine.node_rank)
    else:
        log.raw("main: model loaded")
        log.raw("main: server is listening on http://%s:%d - starting the main loop" % (shown, engine.port))
        log.raw("srv  update_slots: all slots are idle")
        while True:
            time.sleep(3600)
    server.serve_forever(poll_interval=0.5)
    return 0


def entry_point(mode, node_dir):
    """What the generated `vllm` / `llama-server` / sglang entry scripts call."""
    try:
        code = main(mode, sys.argv[1:], node_dir)
    except KeyboardInterrupt:
        code = 0
    sys.stdout.flush()
    os._exit(code)
