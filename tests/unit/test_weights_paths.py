"""Where weights are on a node: candidate paths and node path resolution (R-2.6, R-5.2)."""

from llmgw.config import NodeConfig
from llmgw.fleet.fleet import node_paths, storage_dirs
from llmgw.fleet.ops import Hello
from llmgw.weights import parse_weights


def test_node_paths_resolve_home_and_default_cache():
    node = NodeConfig(name="n", host="h", model_dirs=["~/models", "/srv/models"], shared_dirs=["/mnt/filer"])
    unknown = node_paths(node, None)
    assert unknown.cache_dir is None and unknown.model_dirs == ("/srv/models",)  # ~ unknown before hello
    paths = node_paths(node, Hello(home="/home/ops", root="/home/ops/.llmgw"))
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


def test_a_single_fetched_file_is_handed_to_the_engine_as_the_file_the_helper_saved():
    from llmgw.control.actions import _engine_path

    one = parse_weights("https://x.example/q%20models/..%2F..%2Fescape.gguf?download=1")
    entry = "/c/llmgw-0123456789abcdef"
    # The helper names the file it saved; its naming rule is not re-derived from the URL here.
    assert _engine_path(one, entry, entry + "/download") == entry + "/download"
    assert _engine_path(one, entry, None) == entry  # a one-URL entry whose file was not reported
    repo = parse_weights("hf:org/model")
    assert _engine_path(repo, entry, entry + "/config.json") == entry  # a repository is its directory
    assert _engine_path(parse_weights("llama/7b"), "/models/llama/7b", None) == "/models/llama/7b"
