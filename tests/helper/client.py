"""A small threaded client for the node helper's JSON-lines protocol, used by the tests.

It starts the helper as a real subprocess (``serve --expect-sha256``), reads its stdout on a
thread, and files every line under the request id it names: events in order, then the answer.
"""

import hashlib
import importlib.resources
import importlib.util
import itertools
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

# The file the control plane ships (llmgw.fleet.link.helper_code reads the same one): remote/ in
# the source tree, mapped to the package llmgw.remote.
HELPER_PATH = Path(importlib.resources.files("llmgw.remote").joinpath("llmgw_helper.py"))

_loaded = {}


def load_helper():
    """The helper file imported as a module of its own name, for tests that call its functions
    (llmgw never imports it: it is data the control plane sends)."""
    if "module" not in _loaded:
        spec = importlib.util.spec_from_file_location("llmgw_helper_under_test", HELPER_PATH)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        _loaded["module"] = module
    return _loaded["module"]


def sha256_of(path):
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def install_helper(root, source=HELPER_PATH):
    """Copy the helper where the control plane puts it: ROOT/helper/llmgw_helper-<sha>.py, in a
    0700 directory. Returns (path, sha256)."""
    sha = sha256_of(source)
    directory = Path(root) / "helper"
    directory.mkdir(parents=True, exist_ok=True)
    os.chmod(directory, 0o700)
    path = directory / ("llmgw_helper-%s.py" % sha)
    shutil.copyfile(source, path)
    return path, sha


def wait_until(predicate, timeout=30.0, interval=0.01, message="condition"):
    """Poll predicate until it returns a truthy value; fail after timeout seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError("timed out waiting for %s" % message)
        time.sleep(interval)


def process_running(pid):
    """True while pid exists and is not a zombie."""
    try:
        with open("/proc/%d/stat" % pid) as handle:
            text = handle.read()
    except OSError:
        return False
    return text[text.rfind(")") + 2 :].split()[0] not in ("Z", "X")


class HelperClient:
    """One running helper process and the lines it has written, by request id."""

    def __init__(self, path, sha, root, env=None, extra_args=(), python=None):
        self.argv = [python or sys.executable, str(path), "serve", "--expect-sha256", sha, "--root", str(root)]
        self.argv += list(extra_args)
        self.proc = subprocess.Popen(
            self.argv,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=env,
        )
        self.lines = []
        self.stderr_lines = []
        self.hello = None
        self.answers = {}
        self.events = {}
        self._ids = itertools.count(1)
        self._eof = False
        self.sent = {}
        self._cond = threading.Condition()
        self._write_lock = threading.Lock()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        self._err_reader = threading.Thread(target=self._read_stderr, daemon=True)
        self._err_reader.start()

    def _read(self):
        try:
            self._read_lines()
        finally:
            with self._cond:
                self._eof = True
                self._cond.notify_all()

    def _read_lines(self):
        for raw in self.proc.stdout:
            obj = json.loads(raw.decode("utf-8"))
            with self._cond:
                self.lines.append(obj)
                if "hello" in obj:
                    self.hello = obj["hello"]
                elif "event" in obj:
                    self.events.setdefault(obj["id"], []).append((obj["event"], obj["data"]))
                else:
                    self.answers[obj["id"]] = obj
                self._cond.notify_all()

    def _read_stderr(self):
        for raw in self.proc.stderr:
            self.stderr_lines.append(raw.decode("utf-8", "replace"))

    def wait_hello(self, timeout=30.0):
        with self._cond:
            if not self._cond.wait_for(lambda: self.hello is not None, timeout):
                raise AssertionError("no hello line; stderr: %s" % "".join(self.stderr_lines))
        return self.hello

    def send(self, op, args=None, request_id=None):
        """Send a request without waiting; returns its id."""
        if request_id is None:
            request_id = next(self._ids)
        line = json.dumps({"id": request_id, "op": op, "args": args if args is not None else {}}) + "\n"
        self.sent[request_id] = op
        self.send_raw(line)
        return request_id

    def send_raw(self, line):
        with self._write_lock:
            self.proc.stdin.write(line.encode("utf-8"))
            self.proc.stdin.flush()

    def answer(self, request_id, timeout=60.0):
        with self._cond:
            self._cond.wait_for(lambda: request_id in self.answers or self._eof, timeout)
            if request_id in self.answers:
                return self.answers[request_id]
        raise AssertionError(
            "no answer to request %r (%s) within %s s; helper exit status %r; stderr: %s"
            % (request_id, self.sent.get(request_id), timeout, self.proc.poll(), "".join(self.stderr_lines))
        )

    def request(self, op, args=None, timeout=60.0):
        """Send and wait: the whole answer object."""
        return self.answer(self.send(op, args), timeout)

    def call(self, op, args=None, timeout=60.0):
        """Send, wait, and insist on ok: the result."""
        answer = self.request(op, args, timeout)
        assert answer["ok"], answer
        return answer["result"]

    def events_of(self, request_id):
        with self._cond:
            return list(self.events.get(request_id, []))

    def wait_events(self, request_id, predicate, timeout=30.0):
        """Wait until predicate(events so far) is truthy; returns the events."""
        with self._cond:
            ok = self._cond.wait_for(lambda: predicate(list(self.events.get(request_id, []))), timeout)
            events = list(self.events.get(request_id, []))
        if not ok:
            raise AssertionError("events of %r never matched; got %r" % (request_id, events))
        return events

    def close(self, timeout=15.0):
        """Close stdin (EOF) and wait for the exit code."""
        try:
            self.proc.stdin.close()
        except OSError:
            pass
        try:
            return self.proc.wait(timeout)
        finally:
            self._reader.join(5)

    def kill(self):
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


def kill_recorded_engines(root):
    """SIGKILL every process group recorded under ROOT/shards (test teardown)."""
    shards = Path(root) / "shards"
    if not shards.is_dir():
        return
    for state_path in shards.glob("*/state.json"):
        try:
            state = json.loads(state_path.read_text())
        except (OSError, ValueError):
            continue
        for key in ("pgid", "supervisor_pid"):
            group = state.get(key)
            if isinstance(group, int) and group > 1 and group != os.getpgid(0):
                try:
                    os.killpg(group, signal.SIGKILL)
                except OSError:
                    pass


def write_sealed_marker(entry, secret, hashes=None, **extra):
    """Mark a cache entry complete as the helper does after a fetch: its seal is the HMAC, keyed
    by the fleet secret, of its name and every file's path, size and SHA-256 (the files' own,
    unless `hashes` gives others: {relative path: hex}). Returns the marker."""
    module = load_helper()
    entry = Path(entry)
    files, total, problem = module.entry_manifest(str(entry), os.getuid())
    assert problem is None, problem
    sha256 = {name: hashlib.sha256((entry / name).read_bytes()).hexdigest() for name, _ in files}
    sha256.update(hashes or {})
    marker = {"format": module.MARKER_FORMAT, "name": entry.name, "bytes": total, "files": len(files),
              "sha256": sha256, "seal": module.entry_seal(secret, entry.name, files, sha256)}
    marker.update(extra)
    (entry / ".llmgw-complete").write_text(json.dumps(marker))
    return marker
