"""A profile's runtime as the helper's RUNTIME argument (R-4.9, R-4.11)."""

from llmgw.config import ProfileConfig
from llmgw.runtimes import runtime_spec


def test_the_hosts_program_needs_no_runtime():
    assert runtime_spec(ProfileConfig(engine="vllm")) is None


def test_a_venv_profile_gives_its_whole_recipe():
    profile = ProfileConfig(engine="vllm", runtime="venv", packages=["vllm==0.32.0"], find_links=["/wheels"],
                            post_install=["python -m pip uninstall -y torchvision"])
    assert runtime_spec(profile) == {"kind": "venv", "packages": ["vllm==0.32.0"], "index_url": None,
                                     "find_links": ["/wheels"], "python": None,
                                     "post_install": ["python -m pip uninstall -y torchvision"]}


def test_a_container_profile_gives_its_image():
    profile = ProfileConfig(engine="vllm", runtime="container", image="vllm/vllm-openai:v0.33.0", shm_size="2GB")
    assert runtime_spec(profile) == {"kind": "container", "image": "vllm/vllm-openai:v0.33.0", "container": None,
                                     "pull": None, "shm_size": 2 * 1000**3}
