"""The node helper's parsers: raw command output or /proc text in, facts out (R-2.1-R-2.5).

Each fixture file sits beside the result it must give (``foo.csv`` + ``foo.expected.json``).
"""

import json
from pathlib import Path

import pytest

from tests.helper.client import load_helper

helper = load_helper()

FIXTURES = Path(__file__).parent / "fixtures"
REFERENCE = Path(__file__).resolve().parents[3] / "shared" / "reference"


def _cases(folder, pattern, exclude=None):
    paths = sorted(p for p in (FIXTURES / folder).glob(pattern) if not p.name.endswith(".expected.json"))
    if exclude:
        paths = [p for p in paths if not p.name.startswith(exclude)]
    return [pytest.param(p, id=p.stem) for p in paths]


def _expected(path):
    return json.loads(path.with_name(path.stem + ".expected.json").read_text())


@pytest.mark.parametrize("path", _cases("nvidia-smi", "*.csv", exclude="compute-apps-"))
def test_gpu_csv(path):
    assert helper.parse_gpu_csv(path.read_text()) == _expected(path)


@pytest.mark.parametrize("path", _cases("nvidia-smi", "compute-apps-*.csv"))
def test_compute_apps_csv(path):
    assert helper.parse_compute_apps_csv(path.read_text()) == _expected(path)


@pytest.mark.parametrize("path", _cases("meminfo", "*.txt"))
def test_meminfo(path):
    assert helper.parse_meminfo(path.read_text()) == _expected(path)


@pytest.mark.parametrize("path", _cases("mountinfo", "*.txt"))
def test_mountinfo(path):
    expected = _expected(path)
    mounts = helper.parse_mountinfo(path.read_text())
    assert mounts == expected["mounts"]
    for lookup in expected["lookups"]:
        mount = helper.find_mount(mounts, lookup["path"], lookup.get("device"))
        found = {"mount_point": mount["mount_point"], "fstype": mount["fstype"], "shared": helper.is_shared_fstype(mount["fstype"])}
        assert found == {k: lookup[k] for k in ("mount_point", "fstype", "shared")}, lookup["path"]


# --------------------------------------------------------------------------------------------
# The distinctions the fixtures encode, spelled out


def _one_gpu(line):
    gpus = helper.parse_gpu_csv(line)["gpus"]
    assert len(gpus) == 1
    return gpus[0]


@pytest.mark.parametrize(
    "cell",
    [
        pytest.param("[N/A]", id="na"),
        pytest.param("N/A", id="bare-na"),
        pytest.param("[Not Supported]", id="not-supported"),
        pytest.param("", id="empty"),
        pytest.param("[Requested functionality has been deprecated]", id="deprecated"),
        pytest.param("[Insufficient Permissions]", id="permissions"),
    ],
)
def test_unavailable_cells_are_unknown_not_unhealthy(cell):
    gpu = _one_gpu("0, GPU-x, NVIDIA L4, 23034, %s, %s, %s" % (cell, cell, cell))
    assert gpu["memory_used_mib"] is None and gpu["utilization_pct"] is None and gpu["ecc_uncorrected"] is None
    assert gpu["healthy"] is True and gpu["reasons"] == []


@pytest.mark.parametrize(
    "line, field, value",
    [
        pytest.param("0, GPU-x, A100, [GPU is lost], 1, 0, 0", "memory.total", "[GPU is lost]", id="gpu-is-lost"),
        pytest.param("0, GPU-x, A100, 81920, 1, ERR!, 0", "utilization.gpu", "ERR!", id="err"),
        pytest.param("0, GPU-x, A100, 81920, [Unknown Error], 0, 0", "memory.used", "[Unknown Error]", id="unknown-error"),
        pytest.param("0, GPU-x, A100, 81920, 1, 0, [GPU requires reset]", "ecc.errors.uncorrected.volatile.total",
                     "[GPU requires reset]", id="requires-reset"),
        pytest.param("0, [GPU is lost], A100, 81920, 1, 0, 0", "uuid", "[GPU is lost]", id="uuid-lost"),
    ],
)
def test_unreadable_fields_make_the_gpu_unhealthy_naming_the_field(line, field, value):
    gpu = _one_gpu(line)
    assert gpu["healthy"] is False
    assert gpu["reasons"] == ["%s reads %s" % (field, value)]


def test_uncorrected_ecc_errors_make_the_gpu_unhealthy():
    gpu = _one_gpu("3, GPU-x, NVIDIA H100 80GB HBM3, 81559, 0, 0, 1")
    assert gpu["ecc_uncorrected"] == 1
    assert gpu["healthy"] is False and gpu["reasons"] == ["1 uncorrected ECC error (volatile)"]


def test_zero_is_a_value_not_unknown():
    gpu = _one_gpu("0, GPU-x, NVIDIA H100 80GB HBM3, 81559, 0, 0, 0")
    assert gpu["memory_used_mib"] == 0 and gpu["utilization_pct"] == 0 and gpu["ecc_uncorrected"] == 0


def test_values_with_units_are_read_too():
    gpu = _one_gpu("0, GPU-x, NVIDIA H100 80GB HBM3, 81559 MiB, 12 MiB, 7 %, 0")
    assert (gpu["memory_total_mib"], gpu["memory_used_mib"], gpu["utilization_pct"]) == (81559, 12, 7)


def test_meminfo_without_memtotal_is_unknown():
    assert helper.parse_meminfo("MemFree: 10 kB\n").get("MemTotal") is None
    assert helper.parse_meminfo("") == {}


# --------------------------------------------------------------------------------------------
# GPU memory held by processes llmgw did not start


def _gpus():
    return helper.parse_gpu_csv(
        "0, GPU-a, NVIDIA H100 80GB HBM3, 81559, 70000, 90, 0\n1, GPU-b, NVIDIA H100 80GB HBM3, 81559, 4096, 0, 0\n"
        "2, GPU-c, NVIDIA H100 80GB HBM3, 81559, 0, 0, 0\n"
    )["gpus"]


def test_foreign_gpu_memory_makes_only_that_gpu_unhealthy():
    apps = helper.parse_compute_apps_csv("GPU-a, 100, 69000\nGPU-a, 101, 1000\nGPU-b, 200, 4096\n")
    sessions = {100: 50, 101: 50, 200: 77}
    gpus = helper.mark_foreign_gpu_memory(_gpus(), apps, {50}, sessions.get)
    assert [g["healthy"] for g in gpus] == [True, False, True]
    assert gpus[1]["reasons"] == ["4096 MiB held by pid 200 (not started by llmgw)"]


def test_a_process_that_cannot_be_seen_is_not_ours():
    apps = helper.parse_compute_apps_csv("GPU-c, 4242, [N/A]\n")
    gpus = helper.mark_foreign_gpu_memory(_gpus(), apps, {50}, lambda pid: None)
    assert gpus[2]["healthy"] is False
    assert gpus[2]["reasons"] == ["memory held by pid 4242 (not started by llmgw)"]


def test_apps_on_an_unknown_gpu_are_ignored():
    apps = helper.parse_compute_apps_csv("GPU-zzz, 1, 10\n")
    gpus = helper.mark_foreign_gpu_memory(_gpus(), apps, set(), lambda pid: None)
    assert all(g["healthy"] for g in gpus)


# --------------------------------------------------------------------------------------------
# /proc/PID/stat


@pytest.mark.parametrize(
    "text, expected",
    [
        pytest.param(
            "4242 (python3) S 1 4242 4242 0 -1 4194560 1200 0 0 0 10 2 0 0 20 0 3 0 987654 1000000 500 18446744073709551615",
            {"state": "S", "ppid": 1, "pgid": 4242, "session": 4242, "start_time": 987654},
            id="plain",
        ),
        pytest.param(
            "77 (a) (b) c) R 5 6 7 0 -1 0 0 0 0 0 0 0 0 0 20 0 1 0 31337 0 0 0",
            {"state": "R", "ppid": 5, "pgid": 6, "session": 7, "start_time": 31337},
            id="parens-and-spaces-in-name",
        ),
        pytest.param("12 (short) S 1 2", None, id="truncated"),
        pytest.param("garbage", None, id="garbage"),
    ],
)
def test_parse_proc_stat(text, expected):
    assert helper.parse_proc_stat(text) == expected


def test_parse_proc_stat_reads_this_process():
    import os

    with open("/proc/self/stat") as handle:
        info = helper.parse_proc_stat(handle.read())
    assert info["pgid"] == os.getpgid(0) and info["session"] == os.getsid(0)


# --------------------------------------------------------------------------------------------
# Real outputs collected from public sources: every parser survives them


def _reference(folder):
    directory = REFERENCE / folder
    if not directory.is_dir():
        return [pytest.param(None, marks=pytest.mark.skip(reason="shared/reference is not beside the project"))]
    return [pytest.param(p, id=p.name) for p in sorted(directory.iterdir()) if p.is_file()]


@pytest.mark.parametrize("path", _reference("nvidia-smi"))
def test_reference_nvidia_smi_outputs_parse(path):
    text = path.read_text(errors="replace")
    result = helper.parse_gpu_csv(text)
    assert isinstance(result["gpus"], list)
    for gpu in result["gpus"]:
        assert isinstance(gpu["index"], int) and isinstance(gpu["healthy"], bool)
    assert isinstance(helper.parse_compute_apps_csv(text), list)


def test_reference_error_message_is_not_a_gpu():
    path = REFERENCE / "nvidia-smi" / "error-gpu-is-lost.txt"
    if not path.exists():
        pytest.skip("shared/reference is not beside the project")
    result = helper.parse_gpu_csv(path.read_text())
    assert result["gpus"] == [] and result["unparsed"] == [path.read_text().strip()]


@pytest.mark.parametrize("path", _reference("meminfo"))
def test_reference_meminfo_parses(path):
    fields = helper.parse_meminfo(path.read_text())
    assert fields["MemTotal"] > 0 and fields["MemTotal"] % 1024 == 0
    if "no-memavailable" in path.name:
        assert "MemAvailable" not in fields


@pytest.mark.parametrize("path", _reference("mountinfo"))
def test_reference_mountinfo_parses(path):
    mounts = helper.parse_mountinfo(path.read_text(errors="replace"))
    assert mounts, "at least one mount line is understood"
    for mount in mounts:
        assert mount["mount_point"].startswith("/") and mount["fstype"]
        assert "\\040" not in mount["mount_point"]


PROC_NET_TCP = """\
  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode
   0: 00000000:1F90 00000000:0000 0A 00000000:00000000 00:00000000 00000000  1000        0 4711 1 0 100 0 0 10 0
   1: 0100007F:1F90 0100007F:E032 01 00000000:00000000 00:00000000 00000000  1000        0 4712 1 0 20 4 30 10 -1
   2: 0100007F:1F91 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 4713 1 0 100 0 0 10 0
"""
PROC_NET_TCP6 = """\
  sl  local_address                         remote_address                        st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode
   0: 00000000000000000000000000000000:1F90 00000000000000000000000000000000:0000 0A 00000000:00000000 00:00000000 00000000  1001        0 5120 1 0 100 0 0 10 0
"""  # noqa: E501 (a /proc/net/tcp6 line as the kernel writes it)


def test_listen_inodes_are_the_listening_sockets_on_the_port():
    assert helper.parse_listen_inodes(PROC_NET_TCP, 8080) == {4711}  # not the established one
    assert helper.parse_listen_inodes(PROC_NET_TCP, 8081) == {4713}
    assert helper.parse_listen_inodes(PROC_NET_TCP6, 8080) == {5120}
    assert helper.parse_listen_inodes(PROC_NET_TCP, 9000) == set()


@pytest.mark.parametrize("line, expected", [
    pytest.param("server_args=ServerArgs(model_path='/m', api_key='sk-1', admin_api_key=None, port=3)",
                 "server_args=ServerArgs(model_path='/m', api_key='***', admin_api_key=None, port=3)", id="sglang"),
    pytest.param("non-default args: {'api_key': ['k1', 'k2'], 'port': 8000}",
                 "non-default args: {'api_key': ['***'], 'port': 8000}", id="list"),
    pytest.param('{"api_key": "abc", "x": 1}', '{"api_key": "***", "x": 1}', id="json"),
    pytest.param("argv: sglang --api-key hunter2 --port 1", "argv: sglang --api-key *** --port 1", id="option"),
    pytest.param("--admin-api-key=hunter3", "--admin-api-key=***", id="option="),
    pytest.param("api-key: from-yaml", "api-key: ***", id="yaml"),
    pytest.param("LLAMA_API_KEY=llk started", "LLAMA_API_KEY=*** started", id="env"),
    pytest.param("api_key=None, keys: 3, max_tokens=16", "api_key=None, keys: 3, max_tokens=16", id="nothing-to-hide"),
])
def test_api_keys_in_log_lines_are_scrubbed(line, expected):
    assert helper.scrub_secrets(line) == expected


# -- CDI specs: what podman's --device nvidia.com/gpu=N needs (R-4.12) ---------------------------

NVIDIA_CTK_YAML = """---
cdiVersion: 0.5.0
containerEdits:
  deviceNodes:
  - path: /dev/nvidiactl
devices:
- containerEdits:
    deviceNodes:
    - path: /dev/nvidia0
  name: "0"
kind: nvidia.com/gpu
"""


@pytest.mark.parametrize("files,expected", [
    pytest.param({}, False, id="no-cdi-directories"),
    pytest.param({"etc/vendor.yaml": "cdiVersion: 0.5.0\nkind: vendor.com/device\n"}, False, id="another-vendor"),
    pytest.param({"etc/nvidia.yaml": NVIDIA_CTK_YAML}, True, id="nvidia-ctk-yaml"),
    pytest.param({"run/nvidia.json": '{"cdiVersion": "0.6.0", "kind": "nvidia.com/gpu", "devices": []}'}, True,
                 id="json-under-var-run-cdi"),
    pytest.param({"etc/nvidia.yaml.bak": NVIDIA_CTK_YAML}, False, id="not-a-spec-file-name"),
    pytest.param({"etc/mig.yaml": "kind: nvidia.com/gpumig\n"}, False, id="another-kind-with-that-prefix"),
])
def test_a_cdi_spec_for_nvidia_gpus_is_found(tmp_path, files, expected):
    dirs = (str(tmp_path / "etc"), str(tmp_path / "run"))
    for relative, text in files.items():
        path = tmp_path / relative
        path.parent.mkdir(exist_ok=True)
        path.write_text(text)
    assert helper.cdi_nvidia_gpu(dirs) is expected
