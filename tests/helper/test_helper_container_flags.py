"""The GPU flags of a container launch (R-4.10), checked on the command built: no GPU, no NVIDIA
toolkit and no podman here, so the container programs are stand-ins on the helper's PATH that
answer what the helper asks before `run` (image inspect, info, inspect) and refuse `run` itself.

- docker without CDI: the NVIDIA container toolkit's `--gpus "device=A,B"`;
- docker whose CDI spec directories hold an nvidia.com/gpu spec: `--device nvidia.com/gpu=N`;
- podman: CDI devices, whatever its setup.
In every case CUDA_VISIBLE_DEVICES is not set: inside the container the devices given are all
it sees.
"""

import json
import os
import textwrap

import pytest

from tests.helper.client import wait_until

STAND_IN = textwrap.dedent("""\
    #!/bin/sh
    # A stand-in for {name} (not {name}): enough answers for the helper to build its command.
    case "$1" in
      image) echo "sha256:0000000000000000000000000000000000000000000000000000000000000001" ;;
      info) if [ -n "$FAKE_CDI_DIRS" ]; then echo "$FAKE_CDI_DIRS"; else echo 'template: no CDISpecDirs' >&2; exit 1; fi ;;
      inspect) echo "[]" ;;
      run) echo "{name} stand-in: refusing to run" >&2; exit 125 ;;
      *) exit 0 ;;
    esac
    """)


@pytest.fixture
def stand_ins(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name in ("docker", "podman"):
        path = bin_dir / name
        path.write_text(STAND_IN.format(name=name))
        os.chmod(path, 0o755)
    return bin_dir


def _argv(start_helper, base_env, bin_dir, installed, program, shard_id, extra_env=None):
    env = dict(base_env, PATH=f"{bin_dir}:{base_env.get('PATH', '/usr/bin:/bin')}", **(extra_env or {}))
    helper = start_helper(env)
    runtime = {"kind": "container", "image": "vllm/vllm-openai:v0.32.0", "container": program, "pull": "if_missing"}
    launched = helper.call("launch", {"shard_id": shard_id, "argv": ["vllm", "serve", "/m"], "env": {"K": "v"},
                                      "port": None, "gpus": [2, 3], "runtime": runtime}, timeout=60)
    wait_until(lambda: next(s for s in helper.call("status", {})["shards"] if s["shard_id"] == shard_id)["exit_code"]
               is not None, 60, message="the stand-in's refusal of run")
    state = json.loads((installed.root / "shards" / shard_id / "state.json").read_text())
    assert "CUDA_VISIBLE_DEVICES" not in " ".join(state["argv"])
    return launched["argv"]


def _devices(argv):
    return [argv[i + 1] for i, part in enumerate(argv) if part == "--device"]


def test_docker_without_cdi_gives_the_toolkits_gpus_flag(start_helper, base_env, stand_ins, installed):
    argv = _argv(start_helper, base_env, stand_ins, installed, "docker", "d1")
    assert argv[argv.index("--gpus") + 1] == '"device=2,3"' and _devices(argv) == []


def test_docker_with_an_nvidia_cdi_spec_gives_cdi_devices(start_helper, base_env, stand_ins, installed, tmp_path):
    specs = tmp_path / "cdi"
    specs.mkdir()
    (specs / "nvidia.yaml").write_text("cdiVersion: 0.5.0\nkind: nvidia.com/gpu\ndevices: []\n")
    argv = _argv(start_helper, base_env, stand_ins, installed, "docker", "d2",
                 {"FAKE_CDI_DIRS": json.dumps([str(specs), "/nonexistent"])})
    assert _devices(argv) == ["nvidia.com/gpu=2", "nvidia.com/gpu=3"] and "--gpus" not in argv


def test_docker_with_cdi_dirs_but_no_nvidia_spec_keeps_the_toolkit(start_helper, base_env, stand_ins, installed,
                                                                   tmp_path):
    specs = tmp_path / "cdi"
    specs.mkdir()
    (specs / "other.yaml").write_text("cdiVersion: 0.5.0\nkind: vendor.example/fpga\n")
    argv = _argv(start_helper, base_env, stand_ins, installed, "docker", "d3", {"FAKE_CDI_DIRS": json.dumps([str(specs)])})
    assert "--gpus" in argv and _devices(argv) == []


def test_podman_gives_cdi_devices(start_helper, base_env, stand_ins, installed):
    argv = _argv(start_helper, base_env, stand_ins, installed, "podman", "p1")
    assert _devices(argv) == ["nvidia.com/gpu=2", "nvidia.com/gpu=3"] and "--gpus" not in argv
    assert argv[argv.index("--env") + 1] == "K" and "v" not in argv[argv.index("--env") + 1:argv.index("vllm/vllm-openai:v0.32.0")]
