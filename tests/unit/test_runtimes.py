"""A profile's runtime as the helper's RUNTIME argument (R-4.9, R-4.11)."""

from llmgw.config import ProfileConfig
from llmgw.runtimes import runtime_key, runtime_spec


def test_the_hosts_program_needs_no_runtime():
    assert runtime_spec(ProfileConfig(engine="vllm")) is None


def test_a_venv_profile_gives_its_whole_recipe():
    profile = ProfileConfig(engine="vllm", runtime="venv", packages=["vllm==0.32.0"], find_links=["/wheels"],
                            post_install=["python -m pip uninstall -y torchvision"])
    assert runtime_spec(profile) == {"kind": "venv", "packages": ["vllm==0.32.0"], "index_url": None,
                                     "extra_index_urls": [],
                                     "find_links": ["/wheels"], "python": None,
                                     "post_install": ["python -m pip uninstall -y torchvision"]}


def test_a_container_profile_gives_its_image():
    profile = ProfileConfig(engine="vllm", runtime="container", image="vllm/vllm-openai:v0.33.0", shm_size="2GB")
    assert runtime_spec(profile) == {"kind": "container", "image": "vllm/vllm-openai:v0.33.0", "container": None,
                                     "pull": "if_missing", "shm_size": 2 * 1000**3, "mounts": [], "labels": {}}


def test_a_container_mounts_each_weights_directory_once_and_carries_its_labels():
    profile = ProfileConfig(engine="vllm", runtime="container", image="img:1", pull="always")
    spec = runtime_spec(profile, mounts=["/models", "/cache", "/models"], labels={"llmgw.replica": "r1"})
    assert spec is not None
    assert (spec["pull"], spec["mounts"], spec["labels"]) == ("always", ["/cache", "/models"], {"llmgw.replica": "r1"})


def test_shards_waiting_for_one_image_or_recipe_share_a_provision_and_others_do_not():
    venv = runtime_spec(ProfileConfig(engine="vllm", runtime="venv", packages=["vllm==0.32.0"]))
    other = runtime_spec(ProfileConfig(engine="vllm", runtime="venv", packages=["vllm==0.33.0"]))
    image = runtime_spec(ProfileConfig(engine="vllm", runtime="container", image="img:1"))
    relabelled = runtime_spec(ProfileConfig(engine="vllm", runtime="container", image="img:1"), labels={"a": "b"})
    assert venv is not None and other is not None and image is not None and relabelled is not None
    assert runtime_key(venv) != runtime_key(other)
    assert runtime_key(image) == runtime_key(relabelled) != runtime_key(venv)
