"""Every flag a built-in template puts on a command line is one the real engine's CLI has, and
the engine double refuses any other (R-4.6). The flag sets are captured from the real engines:
tests/testbed/doubles/flags/README.md."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from llmgw.engines import BUILTIN_ENGINES, ShardVars

DOUBLE = Path(__file__).resolve().parents[1] / "testbed" / "doubles" / "engine_double.py"


def _double():
    spec = importlib.util.spec_from_file_location("engine_double_under_test", DOUBLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


double = _double()
# What argv[0..] of each template is before its flags (the program, its subcommand).
PROGRAM_WORDS = {"vllm": 2, "sglang": 3, "llama-server": 1}
SHAPES = [
    pytest.param({"gpus_per_node": 0, "nnodes": 1, "node_rank": 0}, id="cpu"),
    pytest.param({"gpus_per_node": 1, "nnodes": 1, "node_rank": 0}, id="one-gpu"),
    pytest.param({"gpus_per_node": 8, "nnodes": 1, "node_rank": 0}, id="eight-gpus"),
    pytest.param({"gpus_per_node": 8, "nnodes": 2, "node_rank": 0}, id="leader"),
    pytest.param({"gpus_per_node": 8, "nnodes": 2, "node_rank": 1}, id="worker"),
]


@pytest.mark.parametrize("engine", sorted(BUILTIN_ENGINES))
@pytest.mark.parametrize("shape", SHAPES)
def test_every_template_flag_is_a_flag_of_the_real_engine(engine, shape):
    if shape["nnodes"] > 1 and not BUILTIN_ENGINES[engine].multi_node:
        pytest.skip(f"{engine} has no multi-node template")
    variables = ShardVars(model="/models/m", name="chat", host="0.0.0.0", port=20000, leader_addr="10.0.0.1",
                          leader_port=29501, **shape)
    spec = BUILTIN_ENGINES[engine].render(variables, [], {}, "k")
    flags = spec.argv[PROGRAM_WORDS[engine]:]
    assert [f for f in flags if double.flag_name(engine, f)], "the template has flags"
    assert double.unknown_flags(engine, flags) == []


@pytest.mark.parametrize("engine, argv", [
    pytest.param("vllm", ["serve", "/m", "--port", "1", "--no-such-flag", "2"], id="vllm"),
    pytest.param("vllm", ["serve", "/m", "--max", "2"], id="vllm-ambiguous-abbreviation"),
    pytest.param("sglang", ["--model-path", "/m", "--gpu-memory-utilization", "0.9"], id="sglang-vllm-flag"),
    pytest.param("llama-server", ["-m", "/m", "--served-model-name", "x"], id="llama-vllm-flag"),
])
def test_the_double_refuses_a_flag_the_real_engine_does_not_have(engine, argv):
    with pytest.raises(double.UsageError, match="unrecognized arguments"):
        double.Engine(engine, argv, {})


@pytest.mark.parametrize("engine, argv", [
    pytest.param("vllm", ["serve", "/m", "--max_model_len", "512", "--compilation-config.mode", "3", "-tp", "1"],
                 id="vllm-spellings"),
    pytest.param("sglang", ["serve", "--model-path", "/m", "--tensor-parallel-size", "1"], id="sglang-alias"),
    pytest.param("sglang", ["--model-path", "/m", "--tp", "1"], id="sglang-abbreviation"),
    pytest.param("llama-server", ["-m", "/m", "-c", "512", "-ngl", "-1", "--alias", "x"], id="llama-short"),
])
def test_the_double_accepts_what_the_real_engine_accepts(engine, argv):
    assert double.Engine(engine, argv, {}).model == "/m"
