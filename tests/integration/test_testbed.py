"""The testbed itself: real SSH hosts, per-node facts, doubles, weights server, faults, cleanup."""

from __future__ import annotations

import asyncio
import http.client
import json
import os
import shlex
import ssl
import subprocess
import time
import urllib.request
from pathlib import Path

import aiohttp
import asyncssh
import openai
import pytest
import yaml

from tests.testbed import GPU, NodeSpec, Testbed, cleanup_stale, network

pytestmark = pytest.mark.testbed

FLEET = [
    NodeSpec("gpu1", gpus=[GPU.h100(), GPU.h100()], mem_gb=64, models_mb=16, cache_mb=32,
             fabric="ib-a", labels={"zone": "a"}),
    NodeSpec("cpu1", gpus=None, mem_gb=None, cache_mb=48, shared=True),
    NodeSpec("l40s1", gpus=[GPU.l40s()], mem_gb=32),
]


@pytest.fixture(scope="module")
def fleet(testbed_factory):
    tb = testbed_factory(FLEET)
    try:
        yield tb
    finally:
        tb.close()


async def sh(conn: asyncssh.SSHClientConnection, command: str, check: bool = True, **kw) -> asyncssh.SSHCompletedProcess:
    result = await asyncio.wait_for(conn.run(command, check=False, **kw), 20)
    if check and result.exit_status != 0:
        raise AssertionError(f"{command!r} exited {result.exit_status}: {result.stderr}")
    return result


async def poll(check, timeout: float = 15.0, interval: float = 0.02):
    """Await `check()` until it returns something truthy; fail after `timeout`."""
    deadline = time.monotonic() + timeout
    while True:
        value = await check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {timeout}s")
        await asyncio.sleep(interval)


async def loaded(url: str) -> tuple[int, str] | None:
    """The health answer once it is no longer a 503 (an engine still loading its model)."""
    answer = await http_status(url)
    return answer if answer is not None and answer[0] != 503 else None


async def http_status(url: str, headers: dict | None = None) -> tuple[int, str] | None:
    try:
        timeout = aiohttp.ClientTimeout(total=2)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            async with session.get(url, headers=headers or {}) as resp:
                return resp.status, await resp.text()
    except (aiohttp.ClientError, asyncio.TimeoutError):
        return None


# ----------------------------------------------------------------------------------- SSH

async def test_ssh_checks_host_keys(fleet, tmp_path):
    async with await fleet.connect("gpu1") as conn:
        result = await sh(conn, "hostname; id -u; echo $HOME")
        assert result.stdout.split() == ["gpu1", "0", "/root"]

    wrong = tmp_path / "known_hosts"
    other = fleet["cpu1"].host_key_pub
    wrong.write_text(f"{fleet['gpu1'].address} {other}\n")
    with pytest.raises(asyncssh.HostKeyNotVerifiable):
        await asyncssh.connect(**fleet.ssh_options("gpu1", known_hosts=str(wrong)))

    unknown = tmp_path / "empty_known_hosts"
    unknown.write_text("")
    with pytest.raises(asyncssh.HostKeyNotVerifiable):
        await asyncssh.connect(**fleet.ssh_options("gpu1", known_hosts=str(unknown)))


async def test_session_environment_and_uploads(fleet):
    node = fleet["gpu1"]
    async with await fleet.connect(node) as conn:
        env = (await sh(conn, "echo $PATH; echo $PYTHONPATH; echo $SSL_CERT_FILE; command -v python3")).stdout.split()
        assert env[0].startswith(f"{node.bin_dir}:")
        assert env[1] == str(node.pylib_dir)
        assert env[2] == str(fleet.ca_path)
        assert env[3] == "/usr/bin/python3"

        async with conn.start_sftp_client() as sftp:
            await sftp.mkdir("/root/helper")
            async with sftp.open("/root/helper/by-sftp.py", "w") as f:
                await f.write("print('sftp ok')\n")
        await sh(conn, "cat > /root/helper/by-cat.py", input="print('cat ok')\n")
        result = await sh(conn, "python3 /root/helper/by-sftp.py && python3 /root/helper/by-cat.py")
        assert result.stdout.split("\n")[:2] == ["sftp ok", "cat ok"]
    # The uploads landed in the node's own HOME, nowhere else.
    assert (node.home_dir / "helper" / "by-cat.py").exists()
    assert not (fleet["cpu1"].home_dir / "helper").exists()


async def test_home_is_per_node_and_hides_root(fleet):
    (fleet["gpu1"].home_dir / "marker").write_text("gpu1's home\n")
    async with await fleet.connect("gpu1") as conn:
        assert (await sh(conn, "cat ~/marker")).stdout == "gpu1's home\n"
        listing = (await sh(conn, "ls -A /root")).stdout.split()
    assert ".bashrc" in listing and "marker" in listing
    # Nothing of the control host's /root leaks in (its shell startup files included).
    assert set(listing) <= {".bashrc", "marker", "helper", "engine-double.json", ".cache", ".ssh"}


async def test_nodes_have_private_tmp_and_know_each_other(fleet):
    async with await fleet.connect("gpu1") as conn:
        await sh(conn, "echo mine > /tmp/private-file")
        resolved = (await sh(conn, "getent hosts cpu1 control")).stdout.split()
    assert resolved == [fleet["cpu1"].address, "cpu1", fleet.bridge_address, "control"]
    assert not Path("/tmp/private-file").exists()
    assert fleet.run("cpu1", ["test", "-e", "/tmp/private-file"]).returncode == 1
    assert fleet.run("gpu1", ["cat", "/tmp/private-file"]).stdout == "mine\n"
    # The run folder (node dirs, CA, doubles) is still there inside each node's /tmp.
    assert fleet.run("cpu1", ["test", "-x", str(fleet["cpu1"].bin_dir / "vllm")]).returncode == 0


# ----------------------------------------------------------------------------- node facts

async def test_meminfo_is_per_node(fleet):
    async with await fleet.connect("gpu1") as conn:
        assert "MemTotal:       67108864 kB" in (await sh(conn, "cat /proc/meminfo")).stdout
    async with await fleet.connect("cpu1") as conn:
        assert "MemTotal" not in (await sh(conn, "cat /proc/meminfo")).stdout
    assert "MemTotal" in Path("/proc/meminfo").read_text()  # the host's own is untouched

    fleet.set_memory("l40s1", 16)
    assert "MemTotal:       16777216 kB" in fleet.run("l40s1", ["cat", "/proc/meminfo"]).stdout
    fleet.set_memory("l40s1", 32)


async def test_disk_sizes_are_real_tmpfs(fleet):
    node = fleet["gpu1"]
    probe = ("import os, sys\nfor p in sys.argv[1:]:\n    s = os.statvfs(p)\n"
             "    print(s.f_blocks * s.f_frsize // 2**20)\n")
    async with await fleet.connect(node) as conn:
        sizes = (await sh(conn, f"python3 -c '{probe}' {node.models_dir} {node.cache_dir}")).stdout.split()
        assert sizes == ["16", "32"]
        df = (await sh(conn, f"df -m --output=size,target {node.cache_dir}")).stdout.split()
        assert df[-2:] == ["32", str(node.cache_dir)]
        full = await sh(conn, f"head -c 40M /dev/zero > {node.cache_dir}/big", check=False)
        assert full.exit_status != 0 and "No space left on device" in full.stderr
        await sh(conn, f"rm {node.cache_dir}/big")
    # Mounted inside the node only: from the host the directory is a plain, empty folder.
    assert os.statvfs(node.cache_dir).f_blocks * os.statvfs(node.cache_dir).f_frsize != 32 * 2**20
    assert fleet.run("cpu1", ["stat", "-f", "-c", "%T", str(fleet["cpu1"].cache_dir)]).stdout.strip() == "tmpfs"


async def test_nvidia_smi_double(fleet):
    query = "--query-gpu=memory.total,index,name,uuid,memory.used,ecc.errors.uncorrected.volatile.total,driver_version"
    async with await fleet.connect("gpu1") as conn:
        out = (await sh(conn, f"nvidia-smi {query} --format=csv,noheader,nounits")).stdout
        rows = [line.split(", ") for line in out.splitlines()]
        assert [r[:3] for r in rows] == [["81559", "0", "NVIDIA H100 80GB HBM3"], ["81559", "1", "NVIDIA H100 80GB HBM3"]]
        assert rows[0][3].startswith("GPU-") and rows[0][3] != rows[1][3]
        assert [r[4:6] for r in rows] == [["0", "0"], ["0", "0"]]
        with_units = (await sh(conn, "nvidia-smi --query-gpu=index,memory.total --format=csv")).stdout
        assert with_units.splitlines() == ["index, memory.total [MiB]", "0, 81559 MiB", "1, 81559 MiB"]
    async with await fleet.connect("cpu1") as conn:
        assert (await sh(conn, "command -v nvidia-smi", check=False)).exit_status != 0
    l40s = fleet.run("l40s1", ["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader,nounits"])
    assert l40s.stdout == "NVIDIA L40S, 46068\n"

    # Change the GPUs while the node runs: a lost GPU, ECC errors, a foreign process.
    fleet.set_gpus("gpu1", [GPU.h100(lost=True), GPU.h100(ecc_errors=3, apps=((4242, 2048),))])
    try:
        out = fleet.run("gpu1", ["nvidia-smi", "--query-gpu=index,name,memory.used,ecc.errors.uncorrected.volatile.total",
                                 "--format=csv,noheader,nounits"]).stdout
        assert out.splitlines() == ["0, [GPU is lost], [GPU is lost], [GPU is lost]",
                                    "1, NVIDIA H100 80GB HBM3, 2048, 3"]
        apps = fleet.run("gpu1", ["nvidia-smi", "--query-compute-apps=gpu_uuid,pid,used_memory",
                                  "--format=csv,noheader,nounits"]).stdout
        uuid1 = rows[1][3]
        assert apps == f"{uuid1}, 4242, 2048\n"
        fleet.set_gpus("gpu1", driver_loaded=False)
        broken = fleet.run("gpu1", ["nvidia-smi", "--query-gpu=index", "--format=csv,noheader"])
        assert broken.returncode == 9 and "couldn't communicate with the NVIDIA driver" in broken.stdout
        fleet.set_gpus("gpu1", [], driver_loaded=True)
        none = fleet.run("gpu1", ["nvidia-smi", "--query-gpu=index", "--format=csv,noheader"])
        assert none.returncode == 6 and none.stdout == "No devices were found\n"
        fleet.set_gpus("gpu1", FLEET[0].gpus)
        bad_field = fleet.run("gpu1", ["nvidia-smi", "--query-gpu=index,compute_capz", "--format=csv"])
        assert bad_field.returncode == 2 and 'Field "compute_capz" is not a valid field to query.' in bad_field.stdout
    finally:
        fleet.set_gpus("gpu1", FLEET[0].gpus, driver_loaded=True)


# ---------------------------------------------------------------------------- engine double

async def test_vllm_double_serves_the_openai_api(fleet):
    node = fleet["gpu1"]
    base = f"http://{node.address}:8001"
    async with await fleet.connect(node) as conn:
        engine = await conn.create_process(
            "VLLM_API_KEY=sekrit exec vllm serve m --port 8001 --served-model-name m -tp 2 --gpu-memory-utilization 0.9")
        try:
            assert await poll(lambda: http_status(base + "/health")) == (200, "")
            client = openai.AsyncOpenAI(base_url=base + "/v1", api_key="sekrit", max_retries=0)
            assert [m.id async for m in client.models.list()] == ["m"]

            answer = await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "say two words"}])
            assert answer.choices[0].message.content == "m heard 3 words la la la la"
            assert (answer.usage.prompt_tokens, answer.usage.completion_tokens, answer.usage.total_tokens) == (3, 8, 11)

            stream = await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}],
                                                          max_tokens=5, stream=True)
            chunks = [c async for c in stream]
            assert "".join(c.choices[0].delta.content or "" for c in chunks) == "m heard 1 words la"
            assert all(c.choices and c.usage is None for c in chunks)

            stream = await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}],
                                                          max_tokens=5, stream=True, stream_options={"include_usage": True})
            chunks = [c async for c in stream]
            assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 5
            assert all(c.choices for c in chunks[:-1])

            completion = await client.completions.create(model="m", prompt="one two", max_tokens=3)
            assert completion.choices[0].text == "m heard 2" and completion.usage.prompt_tokens == 2
            embedding = await client.embeddings.create(model="m", input=["a", "b"])
            assert len(embedding.data) == 2 and embedding.data[0].embedding != embedding.data[1].embedding

            with pytest.raises(openai.AuthenticationError):
                await openai.AsyncOpenAI(base_url=base + "/v1", api_key="wrong", max_retries=0).chat.completions.create(
                    model="m", messages=[{"role": "user", "content": "hi"}])
            status, body = await http_status(base + "/v1/models")
            assert status == 401 and json.loads(body)["error"]["message"] == "Unauthorized"
            with pytest.raises(openai.NotFoundError):
                await client.chat.completions.create(model="other", messages=[{"role": "user", "content": "hi"}])
        finally:
            assert fleet.kill_engines(node)
            await asyncio.wait_for(engine.wait(), 10)
    assert fleet.engine_pids(node) == []


async def test_llama_server_and_sglang_command_lines(fleet):
    node = fleet["cpu1"]
    fleet.set_engine_knobs(node, by_port={"8003": {"start_delay": 3600}})
    fleet.run(node, ["sh", "-c", "printf 'model-path: /ignored\\napi-key: sg-key # secret\\n' > /root/sg.yaml"], check=True)
    async with await fleet.connect(node) as conn:
        loading = await conn.create_process("exec llama-server -m /models/tiny.gguf --alias tiny --host 0.0.0.0 --port 8003 -ngl 99")
        llama = await conn.create_process("LLAMA_API_KEY=lk exec llama-server -m /models/tiny.gguf --alias tiny,small "
                                          "--host 0.0.0.0 --port 8002 -c 2048 --metrics")
        sglang = await conn.create_process("exec python3 -m sglang.launch_server --model-path /models/q --served-model-name q "
                                           f"--host {node.address} --port 8004 --tp-size 1 --config /root/sg.yaml")
        try:
            status, body = await poll(lambda: http_status(f"http://{node.address}:8003/health"))
            assert status == 503 and json.loads(body)["error"]["message"] == "Loading model"
            # Loaded: like llama-server, it answers 503 "Loading model" until then (the machine may be busy).
            assert await poll(lambda: loaded(f"http://{node.address}:8002/health")) == (200, '{"status":"ok"}')
            status, body = await http_status(f"http://{node.address}:8002/v1/models", {"Authorization": "Bearer lk"})
            assert [m["id"] for m in json.loads(body)["data"]] == ["tiny", "small"]
            assert (await http_status(f"http://{node.address}:8002/v1/models"))[0] == 401
            # --metrics: llama-server's own page, behind the key as every path but /health.
            assert (await http_status(f"http://{node.address}:8002/metrics"))[0] == 401
            status, body = await http_status(f"http://{node.address}:8002/metrics", {"Authorization": "Bearer lk"})
            assert status == 200 and "llamacpp:requests_deferred 0" in body

            assert (await poll(lambda: loaded(f"http://{node.address}:8004/health")))[0] == 200
            assert (await http_status(f"http://{node.address}:8004/v1/models"))[0] == 401
            status, body = await http_status(f"http://{node.address}:8004/v1/models", {"Authorization": "Bearer sg-key"})
            assert status == 200 and json.loads(body)["data"][0]["id"] == "q"
        finally:
            assert len(fleet.kill_engines(node)) == 3
            for proc in (loading, llama, sglang):
                await asyncio.wait_for(proc.wait(), 10)
    fleet.set_engine_knobs(node)


MULTI_NODE = {
    "sglang": ("python3 -m sglang.launch_server --model-path big --served-model-name big --tp-size 2 --nnodes 2 "
               "--dist-init-addr {leader}:25000 --port 8005 --host 0.0.0.0 --node-rank {rank}", ""),
    "vllm": ("vllm serve big -tp 1 -pp 2 --nnodes 2 --node-rank {rank} --master-addr {leader} --master-port 29501 "
             "--port 8005", " --headless"),
}


@pytest.mark.parametrize("engine", sorted(MULTI_NODE))
async def test_multi_node_engines_wait_for_their_peers(fleet, engine):
    leader, worker = fleet["gpu1"], fleet["l40s1"]
    command, worker_flags = MULTI_NODE[engine]
    async with await fleet.connect(leader) as c0, await fleet.connect(worker) as c1:
        rank0 = await c0.create_process("exec " + command.format(leader=leader.address, rank=0))
        try:
            # Rank 0 alone does not serve; once rank 1 joins, the leader answers /health.
            assert await http_status(f"http://{leader.address}:8005/health") is None
            rank1 = await c1.create_process("exec " + command.format(leader=leader.address, rank=1) + worker_flags)
            assert (await poll(lambda: http_status(f"http://{leader.address}:8005/health")))[0] == 200
            if engine == "sglang":  # SGLang ranks >= 1 serve a dummy /health; vLLM --headless serves nothing
                assert (await poll(lambda: http_status(f"http://{worker.address}:8005/health")))[0] == 200
            else:
                assert await http_status(f"http://{worker.address}:8005/health") is None
            # Losing a peer kills the leader, as a broken NCCL group would.
            fleet.kill_engines(worker)
            await asyncio.wait_for(rank1.wait(), 10)
            result = await asyncio.wait_for(rank0.wait(), 10)
            assert result.exit_status == 1
        finally:
            fleet.kill_engines(leader)
            fleet.kill_engines(worker)


def test_engine_knobs(fleet):
    node = fleet["l40s1"]
    try:
        fleet.set_engine_knobs(node, refuse_start=True, stderr_lines=2)
        refused = fleet.run(node, ["vllm", "serve", "m", "--port", "8010"], timeout=20)
        assert refused.returncode == 1
        assert "less than desired GPU memory utilization" in refused.stderr
        assert refused.stderr.count("start-up line") == 2

        fleet.set_engine_knobs(node, crash_after=0.1)
        crashed = fleet.run(node, ["vllm", "serve", "m", "--port", "8010"], timeout=20)
        assert crashed.returncode == 1 and "CUDA error" in crashed.stderr

        fleet.set_engine_knobs(node)
        usage = fleet.run(node, ["vllm", "serve"], timeout=20)
        assert usage.returncode == 2 and "model_tag" in usage.stderr
        # A flag the real vLLM does not have is refused as vLLM refuses it (flags/README.md).
        unknown = fleet.run(node, ["vllm", "serve", "m", "--port", "8010", "--some-new-flag", "x"], timeout=20)
        assert unknown.returncode == 2
        assert "vllm serve: error: unrecognized arguments: --some-new-flag" in unknown.stderr
    finally:
        fleet.set_engine_knobs(node)


async def test_failing_and_slow_engine(fleet):
    node = fleet["l40s1"]
    fleet.set_engine_knobs(node, by_model={"flaky": {"fail_requests": True}}, report_gpu_mib=1234)
    flaky = fleet.popen(node, ["vllm", "serve", "flaky", "--port", "8011"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        url = f"http://{node.address}:8011"
        assert await poll(lambda: http_status(url + "/health")) == (200, "")
        async with aiohttp.ClientSession() as session:
            async with session.post(url + "/v1/chat/completions", json={"model": "flaky", "messages": [{"role": "user", "content": "x"}]}) as resp:
                assert resp.status == 503
                assert (await resp.json())["error"]["code"] == 503
        apps = fleet.run(node, ["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"]).stdout
        assert apps.strip().endswith(", 1234")
    finally:
        fleet.kill_engines(node)
        flaky.wait(10)
        fleet.set_engine_knobs(node)


async def test_engine_streams_slowly_and_notices_hang_ups(fleet):
    node = fleet["l40s1"]
    fleet.set_engine_knobs(node, token_delay=0.02)
    engine = fleet.popen(node, ["vllm", "serve", "slow", "--port", "8012"], stdout=subprocess.DEVNULL)
    url = f"http://{node.address}:8012"
    try:
        await poll(lambda: http_status(url + "/health"))

        async def body():  # a streamed (chunked) request body, as a proxy may send it
            yield b'{"model": "slow", "stream": true, "max_tokens": 200, '
            yield b'"messages": [{"role": "user", "content": "go on"}]}'

        async with aiohttp.ClientSession() as session:
            async with session.post(url + "/v1/chat/completions", data=body(),
                                    headers={"Content-Type": "application/json"}) as resp:
                assert resp.status == 200 and resp.headers["Content-Type"].startswith("text/event-stream")
                first = await resp.content.readuntil(b"\n\n")
                assert first.startswith(b"data: {")
                resp.close()  # hang up mid-stream

        async def aborted():
            status, text = await http_status(url + "/metrics")
            return "engine_double_aborted_total 1" in text
        await poll(aborted)
    finally:
        fleet.kill_engines(node)
        engine.wait(10)
        fleet.set_engine_knobs(node)


# ---------------------------------------------------------------------------- weights server

async def test_weights_server_reachable_from_nodes(fleet):
    weights = fleet.weights
    url = weights.add("tiny/model.bin", size=300_000)
    chunked = weights.add("tiny/streamed.bin", content=b"x" * 5000, framing="chunked")
    sha = weights.add_hf_repo("org/tiny", {"config.json": b'{"a": 1}', "model.safetensors": 70_000}, token="hf_tok")
    fetch = ("import hashlib, json, sys, urllib.request, urllib.error\n"
             "def get(url, token=None):\n"
             "    req = urllib.request.Request(url, headers={'Authorization': 'Bearer ' + token} if token else {})\n"
             "    try:\n"
             "        with urllib.request.urlopen(req, timeout=10) as r:\n"
             "            data = r.read(); return r.status, r.headers.get('Content-Length'), data\n"
             "    except urllib.error.HTTPError as e:\n"
             "        return e.code, None, b''\n"
             "out = []\n"
             "for url, token in json.loads(sys.argv[1]):\n"
             "    status, length, data = get(url, token)\n"
             "    out.append([status, length, len(data), hashlib.sha256(data).hexdigest()])\n"
             "print(json.dumps(out))\n")
    hub = weights.hf_endpoint
    requests = [
        [url, None], [chunked, None],
        [f"{hub}/api/models/org/tiny/revision/main", None],
        [f"{hub}/api/models/org/tiny/revision/main", "hf_tok"],
        [f"{hub}/org/tiny/resolve/{sha}/model.safetensors", "hf_tok"],
    ]
    async with await fleet.connect("cpu1") as conn:
        result = await sh(conn, f"python3 -c {shlex.quote(fetch)} {shlex.quote(json.dumps(requests))}")
    answers = json.loads(result.stdout)
    assert answers[0] == [200, "300000", 300_000, weights.sha256("tiny/model.bin")]
    assert answers[1][:3] == [200, None, 5000]
    assert answers[2][0] == 401
    assert answers[3][0] == 200
    assert answers[4] == [200, "70000", 70_000, weights.hf_file("org/tiny", "model.safetensors").sha256()]
    assert weights.hits("tiny/model.bin") == 1 and weights.hits(url) == 1
    assert weights.hits(f"/org/tiny/resolve/{sha}/model.safetensors") == 1

    # The control host trusts the same CA.
    context = ssl.create_default_context(cafile=str(fleet.ca_path))
    siblings = json.loads(await asyncio.to_thread(lambda: urllib.request.urlopen(
        urllib.request.Request(f"{hub}/api/models/org/tiny/revision/main", headers={"Authorization": "Bearer hf_tok"}),
        context=context, timeout=10).read()))
    assert siblings["sha"] == sha and [s["rfilename"] for s in siblings["siblings"]] == ["config.json", "model.safetensors"]


def test_weights_server_framing_and_faults(fleet):
    weights = fleet.weights
    context = ssl.create_default_context(cafile=str(fleet.ca_path))
    closed = weights.add("framing/close.bin", size=20_000, framing="close")
    cut = weights.add("framing/cut.bin", size=50_000, cut_after=10_000)
    ranged = weights.add("framing/range.bin", content=bytes(range(256)) * 4)

    with urllib.request.urlopen(closed, context=context, timeout=10) as resp:
        assert resp.headers.get("Content-Length") is None and len(resp.read()) == 20_000
    with pytest.raises(http.client.IncompleteRead) as failure:
        with urllib.request.urlopen(cut, context=context, timeout=10) as resp:
            resp.read()
    assert len(failure.value.partial) == 10_000
    request = urllib.request.Request(ranged, headers={"Range": "bytes=1000-"})
    with urllib.request.urlopen(request, context=context, timeout=10) as resp:
        assert resp.status == 206 and resp.read() == (bytes(range(256)) * 4)[1000:]
    assert weights.hits(cut) == 1 and weights.hits(ranged) == 1


# ------------------------------------------------------------------------------------ faults

@pytest.mark.testbed(nodes=[NodeSpec("n1", cache_mb=8)])
async def test_cut_and_restore(testbed):
    async with await testbed.connect("n1") as conn:
        await sh(conn, "true")
        testbed.cut("n1")
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(conn.run("true"), 1)
        with pytest.raises((OSError, asyncio.TimeoutError, asyncssh.Error)):
            await asyncssh.connect(**testbed.ssh_options("n1", connect_timeout=1))
        testbed.restore("n1")

    async def reachable():
        try:
            async with await testbed.connect("n1", connect_timeout=2) as c:
                return (await sh(c, "hostname")).stdout.strip()
        except (OSError, asyncio.TimeoutError, asyncssh.Error):
            return None

    assert await poll(reachable) == "n1"


@pytest.mark.testbed(nodes=[NodeSpec("n1", cache_mb=8)])
async def test_crash_kills_everything_and_restart_keeps_disks(testbed):
    node = testbed["n1"]
    async with await testbed.connect(node) as conn:
        await sh(conn, f"echo kept > {node.cache_dir}/weights; touch /tmp/scratch")
        boot_before = (await sh(conn, "cat /proc/sys/kernel/random/boot_id")).stdout
        engine = await conn.create_process("exec vllm serve m --port 8001 --headless")
        await poll(lambda: asyncio.to_thread(testbed.engine_pids, node))
        testbed.crash(node)
        await asyncio.wait_for(engine.wait(), 10)
    assert node.sshd_pid is None
    assert network.netns_pids(node.netns) == []
    with pytest.raises((OSError, asyncio.TimeoutError, asyncssh.Error)):
        await asyncssh.connect(**testbed.ssh_options(node, connect_timeout=1))

    testbed.restart_node(node)
    async with await testbed.connect(node) as conn:  # same host key: known_hosts still matches
        assert (await sh(conn, "ls /tmp")).stdout.split() == [testbed.dir.name]  # a reboot empties /tmp
        assert (await sh(conn, f"cat {node.cache_dir}/weights")).stdout == "kept\n"
        assert (await sh(conn, "cat /proc/sys/kernel/random/boot_id")).stdout != boot_before
        assert (await sh(conn, "hostname")).stdout == "n1\n"


@pytest.mark.testbed(nodes=[NodeSpec("n1")])
async def test_silent_crash_leaves_peers_hanging(testbed):
    async with await testbed.connect("n1") as conn:
        testbed.crash("n1", silent=True)
        # No FIN or RST reaches us: the command neither fails nor finishes.
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(conn.run("true"), 1)
        testbed.restart_node("n1")
    async with await testbed.connect("n1") as conn:
        await sh(conn, "true")


# ----------------------------------------------------------------------- inventory, cleanup

def test_inventory_file(fleet, tmp_path):
    path = fleet.write_inventory(tmp_path / "inventory.yaml", models=[{"name": "m", "profile": "p"}],
                                 profiles={"p": {"engine": "vllm"}})
    doc = yaml.safe_load(path.read_text())
    assert doc["ssh"] == {"user": "root", "identity_file": str(fleet.client_key), "known_hosts": str(fleet.known_hosts),
                          "python": "/usr/bin/python3", "connect_timeout": "5s", "keepalive_interval": "1s",
                          "keepalive_count": 3}
    gpu1, cpu1, _ = doc["nodes"]
    assert gpu1 == {"name": "gpu1", "host": fleet["gpu1"].address, "fabric": "ib-a", "labels": {"zone": "a"},
                    "model_dirs": [str(fleet["gpu1"].models_dir)], "cache_dir": str(fleet["gpu1"].cache_dir),
                    "ports": "20000-20099"}
    assert cpu1["shared_dirs"] == [str(fleet.shared_dir)] and "fabric" not in cpu1 and "labels" not in cpu1
    assert doc["profiles"] == {"p": {"engine": "vllm"}} and doc["models"] == [{"name": "m", "profile": "p"}]


def _traces(run_id: str) -> list[str]:
    """Anything of a run still on the host: netns, links, mounts, files."""
    found = [n for n in network.netns_names() if n.startswith(f"llgw-{run_id}-")]
    found += [link for link in network.link_names() if link.startswith(f"llgw{run_id}")]
    found += network.mounts_under(Path(f"/tmp/llgw-{run_id}"))
    if Path(f"/tmp/llgw-{run_id}").exists():
        found.append(f"/tmp/llgw-{run_id}")
    return found


def test_close_leaves_nothing_behind(testbed_factory):
    tb = testbed_factory([NodeSpec("a"), NodeSpec("b", gpus=[GPU.h100()])])
    tb.weights.add("x", size=10)
    sshd_pids = [n.sshd_pid for n in tb.nodes.values()]
    engine = tb.popen("a", ["vllm", "serve", "m", "--port", "8001"], stdout=subprocess.DEVNULL)
    assert _traces(tb.run_id)
    tb.close()
    engine.wait(10)
    assert _traces(tb.run_id) == []
    assert all(not Path(f"/proc/{pid}").exists() for pid in sshd_pids)
    tb.close()  # twice is fine


def test_cleanup_stale_removes_only_dead_runs(fleet):
    dead = Testbed([NodeSpec("x")])  # never started: borrow its fresh run id for fake leftovers
    run_id = dead.run_id
    run_dir = Path(f"/tmp/llgw-{run_id}")
    try:
        run_dir.mkdir()
        (run_dir / "owner.json").write_text(json.dumps({"pid": 1, "start": "not-a-start-time"}))
        network.ip_batch([f"netns add llgw-{run_id}-x", f"link add llgw{run_id}b type bridge",
                          f"link add llgw{run_id}v0 type veth peer name eth0 netns llgw-{run_id}-x"])
        sleeper = subprocess.Popen(["ip", "netns", "exec", f"llgw-{run_id}-x", "sleep", "600"])
        assert len(_traces(run_id)) >= 4
        removed = cleanup_stale()
        assert run_id in removed and fleet.run_id not in removed
        assert _traces(run_id) == []
        assert sleeper.wait(10) != 0
        assert fleet.run("gpu1", ["true"]).returncode == 0  # a live run is left alone
    finally:
        network.remove_run(run_id)
