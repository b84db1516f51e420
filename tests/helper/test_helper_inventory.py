"""inventory through a real helper, with a stand-in nvidia-smi on PATH (R-2.1-R-2.3)."""

import os
import sys

import pytest

from tests.helper.client import wait_until

FAKE_NVIDIA_SMI = """\
#!{python}
import os, sys
directory = os.environ["FAKE_SMI_DIR"]
kind = "gpus" if any(a.startswith("--query-gpu=") for a in sys.argv) else "apps"
with open(os.path.join(directory, kind + ".argv"), "w") as handle:
    handle.write("\\n".join(sys.argv[1:]))
with open(os.path.join(directory, kind + ".out")) as handle:
    text = handle.read()
code = int(open(os.path.join(directory, kind + ".code")).read()) if os.path.exists(os.path.join(directory, kind + ".code")) else 0
(sys.stderr if code else sys.stdout).write(text)
sys.exit(code)
"""


@pytest.fixture
def fake_smi(tmp_path, base_env):
    """A directory whose files say what the stand-in nvidia-smi prints; returns (dir, env)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    script = bin_dir / "nvidia-smi"
    script.write_text(FAKE_NVIDIA_SMI.format(python=sys.executable))
    script.chmod(0o755)
    data = tmp_path / "smi"
    data.mkdir()
    (data / "gpus.out").write_text("")
    (data / "apps.out").write_text("")
    env = dict(base_env)
    env["PATH"] = "%s:%s" % (bin_dir, base_env.get("PATH", "/usr/bin:/bin"))
    env["FAKE_SMI_DIR"] = str(data)
    return data, env


def _meminfo_total():
    with open("/proc/meminfo") as handle:
        for line in handle:
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    return None


def test_no_nvidia_smi_means_no_gpus_not_an_error(start_helper, base_env, tmp_path):
    env = dict(base_env)
    env["PATH"] = str(tmp_path / "empty-bin")
    result = start_helper(env=env).call("inventory")
    assert result["nvidia_smi"] == "absent"
    assert result["nvidia_smi_error"] is None
    assert result["gpus"] == []
    assert result["memory_bytes"] == _meminfo_total()
    assert result["cpus"] == len(os.sched_getaffinity(0))
    with open("/proc/sys/kernel/random/boot_id") as handle:
        assert result["boot_id"] == handle.read().strip()


def test_gpus_are_read_with_the_documented_query(start_helper, fake_smi):
    data, env = fake_smi
    (data / "gpus.out").write_text(
        "0, GPU-aaaa, NVIDIA H100 80GB HBM3, 81559, 0, 0, 0\n1, GPU-bbbb, NVIDIA H100 80GB HBM3, 81559, 10, 3, 4\n"
    )
    result = start_helper(env=env).call("inventory")
    assert result["nvidia_smi"] == "ok" and result["nvidia_smi_error"] is None
    assert [g["index"] for g in result["gpus"]] == [0, 1]
    assert result["gpus"][0]["healthy"] is True
    assert result["gpus"][1]["healthy"] is False
    assert result["gpus"][1]["reasons"] == ["4 uncorrected ECC errors (volatile)"]
    assert (data / "gpus.argv").read_text().splitlines() == [
        "--query-gpu=index,uuid,name,memory.total,memory.used,utilization.gpu,ecc.errors.uncorrected.volatile.total",
        "--format=csv,noheader,nounits",
    ]
    assert (data / "apps.argv").read_text().splitlines() == [
        "--query-compute-apps=gpu_uuid,pid,used_memory",
        "--format=csv,noheader,nounits",
    ]


def test_a_failing_nvidia_smi_is_an_error_with_its_message(start_helper, fake_smi):
    data, env = fake_smi
    (data / "gpus.out").write_text(
        "NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver. "
        "Make sure that the latest NVIDIA driver is installed and running.\n\n"
    )
    (data / "gpus.code").write_text("9")
    result = start_helper(env=env).call("inventory")
    assert result["nvidia_smi"] == "error"
    assert "status 9" in result["nvidia_smi_error"]
    assert "couldn't communicate with the NVIDIA driver" in result["nvidia_smi_error"]
    assert result["gpus"] == []


def test_a_lost_gpu_message_among_rows_is_reported(start_helper, fake_smi):
    data, env = fake_smi
    (data / "gpus.out").write_text(
        "0, GPU-aaaa, NVIDIA A100-SXM4-80GB, 81920, 0, 0, 0\n"
        "Unable to determine the device handle for GPU 0000:2A:00.0: GPU is lost. Reboot the system to recover this GPU\n"
    )
    result = start_helper(env=env).call("inventory")
    assert result["nvidia_smi"] == "error"
    assert "GPU is lost" in result["nvidia_smi_error"]
    assert len(result["gpus"]) == 1


def test_memory_held_by_a_process_llmgw_did_not_start(start_helper, fake_smi, engines):
    data, env = fake_smi
    (data / "gpus.out").write_text(
        "0, GPU-ours, NVIDIA L40S, 46068, 30000, 50, 0\n"
        "1, GPU-theirs, NVIDIA L40S, 46068, 512, 0, 0\n"
        "2, GPU-free, NVIDIA L40S, 46068, 0, 0, 0\n"
    )
    helper = start_helper(env=env)
    engine = helper.call("launch", {"shard_id": "mine", "argv": engines.argv("sleep_engine.py"), "gpus": [0]})
    wait_until(lambda: helper.call("status")["shards"][0]["alive"], message="engine alive")
    (data / "apps.out").write_text(
        "GPU-ours, %d, 30000\nGPU-theirs, %d, 512\n" % (engine["pid"], os.getpid())
    )
    gpus = helper.call("inventory")["gpus"]
    assert gpus[0]["healthy"] is True, gpus[0]["reasons"]
    assert gpus[1]["healthy"] is False
    assert gpus[1]["reasons"] == ["512 MiB held by pid %d (not started by llmgw)" % os.getpid()]
    assert gpus[2]["healthy"] is True


def test_inventory_does_not_block_ping(start_helper, fake_smi):
    data, env = fake_smi
    helper = start_helper(env=env)
    pending = helper.send("inventory")
    assert helper.request("ping")["ok"]
    assert helper.answer(pending)["ok"]


def test_one_shot_inventory_shows_unknown_as_dash(fake_smi, tmp_path):
    import subprocess

    from tests.helper.client import HELPER_PATH

    data, env = fake_smi
    (data / "gpus.out").write_text("0, GPU-x, NVIDIA H100 80GB HBM3, 81559, 59, [N/A], [N/A]\n")
    result = subprocess.run(
        [sys.executable, str(HELPER_PATH), "inventory", "--root", str(tmp_path)], env=env, capture_output=True, timeout=60
    )
    text = result.stdout.decode()
    row = next(line for line in text.splitlines() if "H100" in line)
    assert "59 / 81559 MiB" in row
    assert row.split()[-3:] == ["-", "-", "ok"]
