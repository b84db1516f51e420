"""Where weights are on a node: candidate paths and node path resolution (R-2.6, R-5.2)."""

from llmgw.config import NodeConfig
from llmgw.fleet.fleet import node_paths, storage_dirs
from llmgw.weights import parse_weights


def test_node_paths_resolve_home_and_default_cache():
    node = NodeConfig(name="n", host="h", model_dirs=["~/models", "/srv/models"], shared_dirs=["/mnt/filer"])
    unknown = node_paths(node, None)
    assert unknown.cache_dir is None and unknown.model_dirs == ("/srv/models",)  # ~ unknown before hello
    paths = node_paths(node, {"home": "/home/ops", "root": "/home/ops/.llmgw"})
    assert paths.model_dirs == ("/home/ops/models", "/srv/models")
    assert paths.cache_dir == "/home/ops/.llmgw/cache"
    assert storage_dirs(paths) == [{"path": "/home/ops/models", "shared": False},
                                   {"path": "/srv/models", "shared": False},
                                   {"path": "/mnt/filer", "shared": True},
                                   {"path": "/home/ops/.llmgw/cache", "shared": False}]


def test_candidates_and_cache_names():
    fetched = parse_weights("hf:org/model@v1")
    assert fetched.candidates(["/m"], "/c") == [f"/c/{fetched.cache_name}"]
    assert fetched.cache_name == parse_weights("hf:org/model@v1").cache_name != parse_weights("hf:org/model").cache_name
    assert parse_weights("llama/7b").candidates(["/a", "/b"], "/c") == ["/a/llama/7b", "/b/llama/7b"]
    assert parse_weights("https://x.example/a.gguf").cache_name.startswith("llmgw-")


def test_a_single_fetched_file_is_handed_to_the_engine_as_the_file():
    from llmgw.control.actions import _engine_path

    one = parse_weights("https://x.example/q%20models/tiny%2Bq4.gguf?download=1")
    assert _engine_path(one, "/c/llmgw-0123456789abcdef") == "/c/llmgw-0123456789abcdef/tiny+q4.gguf"
    repo = parse_weights("hf:org/model")
    assert _engine_path(repo, "/c/llmgw-0123456789abcdef") == "/c/llmgw-0123456789abcdef"
    assert _engine_path(parse_weights("llama/7b"), "/models/llama/7b") == "/models/llama/7b"
