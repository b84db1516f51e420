"""Bad input sweep: whatever a client, an operator or a confused control plane sends, the answer
is a clear refusal and nothing is lost (R-6.1, R-8.2, R-5.5).

Three sweeps against one `llmgw serve` on a one-node testbed, each driven by hypothesis:
  1. malformed bodies and headers to the router: never a 500, always OpenAI's error JSON, and
     the replica serving before serves after;
  2. malformed model files to the admin API behind `ctl model add` (and `ctl model add` itself
     for a sample): always 400 naming the field, and the catalog unchanged;
  3. path-traversal and symlink reclaim requests straight to the node helper (a NodeLink, and
     `llmgw helper run` for named cases): always refused, every file intact.
"""

from __future__ import annotations

import asyncio
import collections
import gzip
import hashlib
import http.client
import json
import os
import stat
import subprocess
import sys
import urllib.error
import urllib.request
import zlib
from pathlib import Path

import openai
import pytest
import yaml
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from llmgw.config import load_inventory
from llmgw.fleet.link import SSHLink
from llmgw.fleet.session import NodeError
from tests.integration.gateway import GatewayProcess, wait_for
from tests.scenarios.operating import Ctl, write_inventory
from tests.testbed import NodeSpec

pytestmark = [pytest.mark.slow, pytest.mark.testbed]

# Examples per sweep: enough to cover every kind of input drawn, and the file stays well under a minute.
ROUTER_EXAMPLES = 300
VALID_EXAMPLES = 60
MODEL_FILE_EXAMPLES = 200
CTL_EXAMPLES = 6
RECLAIM_EXAMPLES = 150


def sweep_settings(examples: int) -> settings:
    # No example database: each run draws afresh, and nothing is written into the work tree.
    return settings(max_examples=examples, deadline=None, database=None, suppress_health_check=list(HealthCheck))


@pytest.fixture(scope="module")
def bed(testbed_factory):
    tb = testbed_factory([NodeSpec("cpu1", gpus=None, mem_gb=32, cache_mb=16)])
    yield tb
    tb.close()


@pytest.fixture(scope="module")
def gateway(bed, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("bad-input")
    profiles = {"cpu": {"engine": "llama-server", "start_timeout": "60s"}}
    models = [{"name": "echo", "profile": "cpu", "scaling": {"min": 1}}]
    inventory = write_inventory(bed, tmp / "inventory.yaml", models=models, profiles=profiles)
    process = GatewayProcess(inventory, tmp / "state").start()
    try:
        yield process
    finally:
        process.stop()


@pytest.fixture(scope="module")
def key(gateway):
    key = gateway.create_key("sweep")
    client = openai.OpenAI(base_url=gateway.url + "/v1", api_key=key, max_retries=0)
    wait_for(lambda: client.chat.completions.create(model="echo", messages=[{"role": "user", "content": "hi"}]),
             90, f"echo to serve\n{gateway.log()[-3000:]}")
    return key


# ------------------------------------------------------------------------------------------------
# 1. The router

JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12)
FIELDS = ("model", "messages", "prompt", "input", "stream", "stream_options", "max_tokens", "n", "temperature")
# Printable ASCII and Latin-1 letters: what an HTTP client can put in a header value.
HEADER_TEXT = st.text(st.characters(codec="latin-1", exclude_categories=("Cc", "Cs", "Zl", "Zp"),
                                    exclude_characters="\x85"), max_size=40).map(str.strip)


def _encode(document, encoding: str) -> bytes:
    return json.dumps(document, ensure_ascii=False).encode(encoding, errors="surrogatepass")


@st.composite
def request_bodies(draw) -> bytes:
    kind = draw(st.sampled_from(["bytes", "text", "json", "object", "nested"]))
    if kind == "bytes":
        return draw(st.binary(max_size=200))
    if kind == "text":
        return draw(st.text(max_size=100)).encode("utf-8", errors="surrogatepass")
    if kind == "json":
        return json.dumps(draw(JSON_VALUES)).encode()
    if kind == "nested":
        depth = draw(st.integers(1, 200_000))
        return draw(st.sampled_from([b"[", b'{"a":'])) * depth
    document = draw(st.dictionaries(st.sampled_from(FIELDS), JSON_VALUES, max_size=5))
    document["model"] = draw(st.sampled_from(["echo", "", "nope", "ECHO", "echo "]) | JSON_VALUES)
    if draw(st.booleans()):
        document["messages"] = [{"role": "user", "content": "hi"}]
    encoding = draw(st.sampled_from(["utf-8", "utf-8", "utf-8-sig", "utf-16", "utf-16-le", "utf-32"]))
    return _encode(document, encoding)


@st.composite
def request_headers(draw, key: str) -> dict[str, str]:
    headers = {}
    auth = draw(st.sampled_from(["valid", "valid", "valid", "none", "garbage", "bearer-garbage", "basic"]))
    if auth == "valid":
        headers["Authorization"] = f"Bearer {key}"
    elif auth == "garbage":
        headers["Authorization"] = draw(HEADER_TEXT)
    elif auth == "bearer-garbage":
        headers["Authorization"] = "Bearer " + draw(HEADER_TEXT)
    elif auth == "basic":
        headers["Authorization"] = "Basic " + draw(HEADER_TEXT)
    content_type = draw(st.sampled_from([None, "application/json", "text/plain", "application/json; charset=utf-16",
                                         "multipart/form-data; boundary=x", "application/x-www-form-urlencoded"])
                        | HEADER_TEXT)
    if content_type:
        headers["Content-Type"] = content_type
    encoding = draw(st.sampled_from([None, None, "gzip", "deflate", "identity", "x-unknown"]))
    if encoding:
        headers["Content-Encoding"] = encoding
    for name in draw(st.lists(st.sampled_from(["Accept", "Accept-Charset", "Forwarded", "X-Forwarded-Host",
                                               "X-Forwarded-Proto", "OpenAI-Organization", "X-Request-Id",
                                               "User-Agent", "Cookie", "X-Llmgw-Actor"]), max_size=4, unique=True)):
        headers[name] = draw(HEADER_TEXT)
    return headers


def _send(port: int, method: str, path: str, body: bytes, headers: dict) -> tuple[int, dict, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    try:
        conn.request(method, path, body=body, headers={**headers, "Content-Length": str(len(body))})
        response = conn.getresponse()
        return response.status, dict(response.getheaders()), response.read()
    finally:
        conn.close()


def _openai_error(status: int, headers: dict, payload: bytes) -> str | None:
    """Why this answer is not OpenAI's error JSON, or None when it is."""
    content_type = {k.lower(): v for k, v in headers.items()}.get("content-type", "")
    if not content_type.startswith("application/json"):
        return f"{status} with content type {content_type!r}: {payload[:200]!r}"
    try:
        error = json.loads(payload)["error"]
    except (ValueError, KeyError, TypeError):
        return f"{status} without an error object: {payload[:200]!r}"
    if not (isinstance(error.get("message"), str) and error["message"]) or "type" not in error or "code" not in error:
        return f"{status} with an incomplete error object: {error}"
    return None


def test_router_refuses_malformed_requests_clearly(gateway, key):
    client = openai.OpenAI(base_url=gateway.url + "/v1", api_key=key, max_retries=0)
    ctl = Ctl(gateway)
    serving_before = [r["id"] for r in ctl.json("replicas")["replicas"] if r["serving"]]
    statuses: collections.Counter = collections.Counter()
    problems: list[str] = []

    @sweep_settings(ROUTER_EXAMPLES)
    @given(path=st.sampled_from(["/v1/chat/completions", "/v1/completions", "/v1/embeddings"]),
           body=request_bodies(), headers=request_headers(key), compressed=st.booleans())
    def sweep(path, body, headers, compressed):
        encoding = headers.get("Content-Encoding")
        if compressed and encoding in ("gzip", "deflate"):
            body = gzip.compress(body) if encoding == "gzip" else zlib.compress(body)
        status, response_headers, payload = _send(gateway.port, "POST", path, body, headers)
        statuses[status] += 1
        if status == 200:
            return  # a request that happened to be valid
        why = _openai_error(status, response_headers, payload)
        if status == 500:
            why = why or f"{status}: {payload[:200]!r}"
        if why:
            problems.append(f"POST {path} {headers} {body[:80]!r} -> {why}")

    try:
        sweep()
    finally:
        print(f"\nrouter: {sum(statuses.values())} malformed requests sent; answers by status: "
              f"{dict(sorted(statuses.items()))}; {len(problems)} not a clear OpenAI error")
    # Nothing was lost: the same replica serves a well-formed request afterwards.
    reply = client.chat.completions.create(model="echo", messages=[{"role": "user", "content": "still there?"}])
    serving_after = [r["id"] for r in ctl.json("replicas")["replicas"] if r["serving"]]
    print(f"router: afterwards echo answers {reply.choices[0].message.content[:24]!r}...; serving replica "
          f"{serving_before} -> {serving_after}")
    assert statuses[500] == 0 and problems == [], "\n".join([p for p in problems if "-> 500" not in p][:10])
    assert serving_after == serving_before and reply.choices[0].message.content.startswith("echo")


def test_router_takes_unusual_but_valid_requests(gateway, key):
    """The other side of the sweep: JSON in any encoding JSON allows, streamed or not, compressed
    or not, is answered, and a stream still ends with the usage the client asked for (R-6.9)."""
    outcomes: collections.Counter = collections.Counter()
    failures: list[str] = []

    @sweep_settings(VALID_EXAMPLES)
    @given(path=st.sampled_from(["/v1/chat/completions", "/v1/completions"]), stream=st.booleans(),
           usage=st.sampled_from([None, True, False]), padding=st.sampled_from(["", " ", "\n\t "]),
           encoding=st.sampled_from(["utf-8", "utf-8-sig", "utf-16", "utf-16-le", "utf-16-be", "utf-32",
                                     "utf-32-le", "utf-32-be"]),
           compression=st.sampled_from([None, "gzip", "deflate"]))
    # JSON needs no byte-order mark: these start with a plain '{' byte followed by NULs.
    @example(path="/v1/chat/completions", stream=True, usage=None, padding="", encoding="utf-16-le", compression=None)
    @example(path="/v1/completions", stream=True, usage=None, padding="", encoding="utf-32-le", compression="gzip")
    def sweep(path, stream, usage, padding, encoding, compression):
        document = {"model": "echo", "max_tokens": 3}
        document.update({"messages": [{"role": "user", "content": "héllo wörld"}]} if "chat" in path
                        else {"prompt": "héllo wörld"})
        if stream:
            document["stream"] = True
            if usage is not None:
                document["stream_options"] = {"include_usage": usage}
        body = (padding + json.dumps(document, ensure_ascii=False)).encode(encoding)
        headers = {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}
        if compression:
            headers["Content-Encoding"] = compression
            body = gzip.compress(body) if compression == "gzip" else zlib.compress(body)
        status, _, payload = _send(gateway.port, "POST", path, body, headers)
        outcomes[(status, "stream" if stream else "json")] += 1
        text = payload.decode(errors="replace")
        why = None
        if status != 200:
            why = f"answered {status}: {text[:200]}"
        elif stream and (('"usage"' in text) != bool(usage) or "data: [DONE]" not in text):
            why = f"stream with include_usage={usage} came back as {text[-300:]!r}"
        if why:
            failures.append(f"{path} {encoding} {compression} stream={stream} usage={usage}: {why}")

    sweep()
    print(f"router: {sum(outcomes.values())} valid requests in unusual encodings: "
          f"{dict(sorted(outcomes.items()))}; {len(failures)} mishandled")
    assert failures == [], "\n".join(failures[:10])


# ------------------------------------------------------------------------------------------------
# 2. Model files

VALID_MODEL = {"name": "fuzzed", "profile": "cpu", "scaling": {"min": 0, "max": 1, "idle_timeout": "10m"}}
NOT_A_STRING = st.integers() | st.booleans() | st.lists(st.integers(), max_size=2) | \
    st.dictionaries(st.text(max_size=3), st.integers(), max_size=2)
NOT_A_NUMBER = st.text(max_size=6).filter(lambda s: not _number(s)) | st.lists(st.integers(), max_size=2)
# Each: the field path, and values that are wrong there.
BAD_FIELDS = [
    (("name",), NOT_A_STRING | st.none() | st.sampled_from(["", " fuzzed", "-x", "a/b", "x" * 129, "é", "a b"])),
    (("profile",), NOT_A_STRING | st.sampled_from(["gpu", "CPU", "cpu ", "nope"])),
    (("weights",), st.integers() | st.booleans() | st.dictionaries(st.text(max_size=3), st.integers(), max_size=2)
     | st.sampled_from(["hf:", "hf:org", "hf:org/repo@..", "http://host/model.gguf", "ftp://host/x",
                        "../escape.gguf", "a/../../b", "   ", [], [1], ["http://host/x"], ["https://"]])),
    (("disk_gb",), NOT_A_NUMBER | st.floats(max_value=-0.001) | st.sampled_from([float("inf"), float("nan")])),
    (("scaling",), st.integers() | st.text(max_size=5) | st.lists(st.integers(), max_size=2)),
    (("scaling", "min"), st.integers(max_value=-1) | st.sampled_from([1.5, "many", float("inf")])),
    (("scaling", "max"), st.integers(max_value=-1) | st.sampled_from(["lots", 0.5])),
    (("scaling", "idle_timeout"), st.floats(max_value=-0.001) | st.sampled_from(
        ["soon", "-5s", "5 parsecs", "1" * 400 + "s", float("inf"), float("nan"), [], {}])),
    (("scaling", "target"), st.floats(max_value=0) | st.sampled_from(["lots", float("inf"), float("nan"), [], {}])),
    (("scaling", "up_delay"), st.floats(max_value=-0.001) | st.sampled_from(["soon", "-5s", float("inf"), []])),
    (("scaling", "down_delay"), st.floats(max_value=-0.001) | st.sampled_from(["later", "-1m", float("nan"), {}])),
    (("fallback",), NOT_A_STRING | st.sampled_from(["fuzzed", "nope"])),
    (("served_name",), NOT_A_STRING),
]
UNKNOWN_KEYS = st.text("abcdefghijklmnopqrstuvwxyz_", min_size=1, max_size=10).filter(
    lambda k: k not in {"name", "profile", "weights", "disk_gb", "scaling", "fallback", "served_name", "endpoints",
                        "min", "max", "idle_timeout", "target", "up_delay", "down_delay"})
BROKEN_DOCUMENTS = st.sampled_from([
    b"name: [fuzzed\nprofile: cpu\n", b"name: fuzzed\n\tprofile: cpu\n", b"name: fuzzed\nname: other\nprofile: cpu\n",
    b"- name: fuzzed\n  profile: cpu\n", b"just a sentence\n", b"42\n", b"? [a, b]\n: c\n",
    b"name: fuzzed\nprofile: cpu\nscaling: {? [1]: 2}\n", b"\xff\xfename: fuzzed\n", b"name: fuzz\xe9d\nprofile: cpu\n",
    b"name: fuzzed\x00\nprofile: cpu\n", b"!!python/object/apply:os.system ['true']\n",
    b"a: &a [x, x, x, x, x, x, x, x, x]\nb: &b [*a, *a, *a, *a, *a, *a, *a, *a, *a]\nc: [*b, *b, *b, *b, *b, *b]\n",
    b"name: fuzzed\nprofile: cpu\nendpoints: [{url: 'http://x'}]\n", b"   \n",
]) | st.binary(max_size=60)


def _number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def _set(document: dict, path: tuple, value) -> dict:
    document = json.loads(json.dumps(document))
    target = document
    for part in path[:-1]:
        target = target.setdefault(part, {})
    target[path[-1]] = value
    return document


@st.composite
def bad_model_files(draw) -> tuple[bytes, str | None]:
    """(file content, the field the refusal must name, or None for a document that is not a model at all)."""
    kind = draw(st.sampled_from(["field", "field", "field", "unknown", "document"]))
    if kind == "document":
        return draw(BROKEN_DOCUMENTS), None
    if kind == "unknown":
        where = draw(st.sampled_from([(), ("scaling",)]))
        path = where + (draw(UNKNOWN_KEYS),)
        document = _set(VALID_MODEL, path, draw(JSON_VALUES))
    else:
        path, values = draw(st.sampled_from(BAD_FIELDS))
        document = _set(VALID_MODEL, path, draw(values))
        if path == ("scaling", "max"):
            document["scaling"]["min"] = 3
    return yaml.safe_dump(document, allow_unicode=True).encode(), ".".join(path)


def _catalog(ctl: Ctl) -> list[tuple]:
    return [(m["name"], m["declared_in"], m["profile"], m["weights"], json.dumps(m["scaling"], sort_keys=True))
            for m in ctl.json("models")["models"]]


def _add_model(gateway: GatewayProcess, body: bytes) -> tuple[int, dict]:
    token = (gateway.state_dir / "admin-token").read_text().strip()
    request = urllib.request.Request(f"http://127.0.0.1:{gateway.admin_port}/api/models", data=body, method="POST",
                                     headers={"Authorization": f"Bearer {token}", "Content-Type": "application/yaml",
                                              "X-Llmgw-Source": "fuzzed.yaml"})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        payload = exc.read()
        try:
            return exc.code, json.loads(payload)
        except ValueError:
            return exc.code, {"raw": payload.decode(errors="replace")}


def test_malformed_model_files_are_refused_and_change_nothing(gateway, key, tmp_path):
    ctl = Ctl(gateway)
    before = _catalog(ctl)
    statuses: collections.Counter = collections.Counter()
    problems: list[str] = []

    @sweep_settings(MODEL_FILE_EXAMPLES)
    @given(bad_model_files())
    def sweep(case):
        body, field = case
        status, answer = _add_model(gateway, body)
        statuses[status] += 1
        error = answer.get("error") or {}
        said = " ".join([str(error.get("message", ""))] + [str(p) for p in error.get("problems") or []])
        why = None
        if status != 400:
            why = f"answered {status}: {answer}"
        elif not error.get("message"):
            why = f"400 without a message: {answer}"
        elif field is not None and field not in said:
            why = f"the refusal does not name {field}: {said}"
        if why:
            problems.append(f"{body[:120]!r}: {why}")

    try:
        sweep()
    finally:
        print(f"\nmodel files: {sum(statuses.values())} malformed files sent to the admin API; answers by status: "
              f"{dict(sorted(statuses.items()))}; {len(problems)} unclear")

    # The operator's command on a sample, plus files that are not text or have an unusual name.
    outcomes: list[tuple[int, str]] = []

    @sweep_settings(CTL_EXAMPLES)
    @given(bad_model_files())
    def through_ctl(case):
        body, field = case
        path = tmp_path / "model.yaml"
        path.write_bytes(body)
        result = ctl.run("model", "add", "-f", str(path))
        outcomes.append((result.code, result.stderr))
        assert result.code == 1 and result.stderr.startswith("error: ") and "Traceback" not in result.stderr, result
        assert field is None or field in result.stderr, (field, result.stderr)

    through_ctl()
    for name, body, field in [("binary.yaml", b"\xff\xfe\x00name: fuzzed\n", None),
                              ("modèle-模型.yaml", b"name: fuzzed\nprofile: nope\n", "profile"),
                              ("scaling.yaml", b"name: fuzzed\nprofile: cpu\nscaling: {min: 2, max: 1}\n", "scaling")]:
        path = tmp_path / name
        path.write_bytes(body)
        result = ctl.run("model", "add", "-f", str(path))
        outcomes.append((result.code, result.stderr))
        print(f"ctl model add -f {name}: exit {result.code}: {result.stderr.strip().splitlines()[0]}")
        assert result.code == 1 and result.stderr.startswith("error: ") and "Traceback" not in result.stderr, result
        assert field is None or field in result.stderr, (field, result.stderr)
    after = _catalog(ctl)
    print(f"ctl model add: {len(outcomes)} refused with exit code 1; catalog before and after: "
          f"{[m[0] for m in before]} -> {[m[0] for m in after]}")
    assert statuses == {400: sum(statuses.values())} and problems == [], "\n".join(problems[:10])
    assert after == before


# ------------------------------------------------------------------------------------------------
# 3. Reclaim straight to the node helper

HEX = {letter: hashlib.sha256(letter.encode()).hexdigest()[:32] for letter in "ABCDEFG"}
WANTED = f"llmgw-{HEX['A']}"  # a real, complete download
OUTSIDE_ENTRY = f"llmgw-{HEX['B']}"  # carries the cache name, but lives outside the cache
DIR_LINK = f"llmgw-{HEX['C']}"  # in the cache: a link to OUTSIDE_ENTRY
FILE_LINK = f"llmgw-{HEX['D']}"  # in the cache: a link to a file outside
INNER_LINK = f"llmgw-{HEX['E']}"  # in the cache: a real entry holding a link to a file outside
SIBLING_LINK = f"llmgw-{HEX['F']}"  # in the cache: a link to WANTED


def _plant(bed, node: str) -> dict[str, Path]:
    """The cache and the files around it that no reclaim may touch (paths inside the node)."""
    n = bed[node]
    cache = n.cache_dir
    home = Path("/root")
    script = f"""
set -e
mkdir -p {cache}/{WANTED} {home}/outside/{OUTSIDE_ENTRY} {cache}/{INNER_LINK}
echo weights > {cache}/{WANTED}/model.gguf
echo '{{}}' > {cache}/{WANTED}/.llmgw-complete
echo secret > {home}/outside/{OUTSIDE_ENTRY}/secret.bin
echo secret > {home}/outside/secret.txt
ln -sfn {home}/outside/{OUTSIDE_ENTRY} {cache}/{DIR_LINK}
ln -sfn {home}/outside/secret.txt {cache}/{FILE_LINK}
ln -sfn {home}/outside/secret.txt {cache}/{INNER_LINK}/model.gguf
ln -sfn {cache}/{WANTED} {cache}/{SIBLING_LINK}
ln -sfn {cache} {home}/cache-link
"""
    bed.run(node, ["sh", "-c", script], check=True)
    return {"cache": Path(cache), "outside": home / "outside", "link": home / "cache-link"}


def _manifest(bed, node: str, roots) -> dict[str, str]:
    """Every path under the roots with what it is: a file's hash, a link's target, a directory."""
    found = {}
    for root in roots:
        base = bed[node].host_path(root)
        for directory, dirs, files in os.walk(base):
            for name in dirs + files:
                path = os.path.join(directory, name)
                info = os.lstat(path)
                inside = str(root) + path[len(str(base)):]
                if stat.S_ISLNK(info.st_mode):
                    found[inside] = "-> " + os.readlink(path)
                elif stat.S_ISDIR(info.st_mode):
                    found[inside] = "dir"
                else:
                    found[inside] = hashlib.sha256(Path(path).read_bytes()).hexdigest()[:12]
    return found


def _hostile_names(cache: str):
    targets = ["etc/passwd", "root/outside/secret.txt", f"root/outside/{OUTSIDE_ENTRY}", OUTSIDE_ENTRY, WANTED]
    return st.one_of(
        st.sampled_from(["", ".", "..", "/", "//", "./", "../", cache, cache + "/", f"{cache}/{WANTED}",
                         DIR_LINK, FILE_LINK, SIBLING_LINK, f"{DIR_LINK}/secret.bin", f"{WANTED}/", f"{WANTED}/..",
                         f"{WANTED}/../{WANTED}", f"./{WANTED}", f"{WANTED}\x00", f"{WANTED}\n", WANTED.upper(),
                         "llmgw-..", "llmgw-" + "0" * 15, "llmgw-" + "0" * 65, f".tmp-{WANTED}-../../x",
                         "/etc/passwd", "~/outside", "~root/outside/secret.txt", "%2e%2e", "..\\..\\etc"]),
        st.builds(lambda prefix, target: prefix + target,
                  st.sampled_from(["../", "../../", "../../../", "/", "./", f"{WANTED}/../", "llmgw-x/../", "//"]),
                  st.sampled_from(targets)),
        st.text(max_size=30))


def _reclaim_requests(cache: str, link: str):
    cache_dirs = st.sampled_from([cache, cache, cache, cache + "/", f"{cache}/{WANTED}/..", link,
                                  f"{cache}/{DIR_LINK}", "cache", "", "~", f"{cache}\x00", 7, None])
    names = st.lists(_hostile_names(cache), min_size=1, max_size=4) | st.lists(JSON_VALUES, max_size=3) | \
        JSON_VALUES
    return st.fixed_dictionaries({"cache_dir": cache_dirs, "names": names, "collect": st.just(True)})


def test_reclaim_refuses_traversal_and_links_and_touches_nothing(bed, gateway, key, tmp_path):
    places = _plant(bed, "cpu1")
    cache, outside, link = str(places["cache"]), str(places["outside"]), str(places["link"])
    roots = [cache, outside]
    before = _manifest(bed, "cpu1", roots)
    inventory, _ = load_inventory(gateway.inventory)
    loop = asyncio.new_event_loop()
    node_link = SSHLink(inventory.node("cpu1"), inventory.ssh)

    async def start():
        node_link.start()
        assert await node_link.wait_ready(30), node_link.reason

    loop.run_until_complete(start())
    answers: collections.Counter = collections.Counter()
    removed: list[dict] = []
    try:
        @sweep_settings(RECLAIM_EXAMPLES)
        @given(_reclaim_requests(cache, link))
        def sweep(args):
            try:
                result = loop.run_until_complete(node_link.call("reclaim", args, timeout=30))
            except NodeError as exc:
                answers[f"error {exc.kind}"] += 1
                assert exc.kind == "bad_args", exc
                return
            for entry in result["entries"]:
                answers[entry["action"]] += 1
                if entry["action"] != "refused":
                    removed.append(entry)
                assert entry["action"] == "refused" and entry["reason"], entry

        try:
            sweep()
        finally:
            print(f"\nreclaim through a NodeLink: {sum(answers.values())} answers: {dict(sorted(answers.items()))}")
        assert removed == []
        assert _manifest(bed, "cpu1", roots) == before

        # The operator's debugging tool goes through the same path.
        env = {**gateway.env, "LLMGW_STATE_DIR": str(tmp_path / "helper-run")}
        for names, cache_dir in [([f"../../root/outside/{OUTSIDE_ENTRY}"], cache), ([DIR_LINK, FILE_LINK], cache),
                                 ([WANTED], link), ([f"{WANTED}/../../../root/outside/secret.txt"], cache)]:
            argv = [sys.executable, "-m", "llmgw.cli.main", "helper", "run", "cpu1", "reclaim", "-i",
                    str(gateway.inventory), "--arg", f"cache_dir={cache_dir}", "--arg", f"names={json.dumps(names)}",
                    "--arg", "collect=true"]
            run = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=120)
            assert run.returncode == 0, run.stderr
            entries = json.loads(run.stdout)["entries"]
            print(f"llmgw helper run cpu1 reclaim {names} in {cache_dir}: "
                  + "; ".join(f"{e['action']} ({e['reason']})" for e in entries))
            assert [e["action"] for e in entries] == ["refused"] * len(names)
        assert _manifest(bed, "cpu1", roots) == before

        # A real entry holding a link is removed as an entry; what the link points to stays.
        result = loop.run_until_complete(node_link.call("reclaim", {"cache_dir": cache, "names": [INNER_LINK],
                                                                    "collect": True}, timeout=30))
        after = _manifest(bed, "cpu1", roots)
        gone = sorted(set(before) - set(after))
        print(f"reclaim of {INNER_LINK[:14]}... (a real entry with a link inside): "
              f"{result['entries'][0]['action']}; gone: {[p.rsplit('/', 2)[-2:] for p in gone]}")
        assert result["entries"][0]["action"] == "removed"
        assert gone == [f"{cache}/{INNER_LINK}", f"{cache}/{INNER_LINK}/model.gguf"]
        assert {p: v for p, v in before.items() if p not in gone} == after
    finally:
        loop.run_until_complete(node_link.close())
        loop.close()
