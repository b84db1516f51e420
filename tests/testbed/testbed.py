"""Real SSH hosts on this machine: one network namespace + mount namespace + sshd per node.

    with Testbed([NodeSpec("node1", gpus=[GPU.h100()] * 2, mem_gb=64), NodeSpec("node2")]) as tb:
        conn = await asyncssh.connect(**tb.ssh_options("node1"))
        tb.cut("node1"); tb.restore("node1")

Each node is a network namespace with a veth into a bridge in this namespace, and a persistent
mount + UTS namespace (kept in files under the run directory, so a node "crash" that kills every
process leaves its disks — the tmpfs model and cache directories — in place, as a reboot would).
sshd runs inside both with a per-node host key written to a known_hosts file; host-key checking
stays on for clients. Inside the mount namespace: /proc/meminfo, /etc/hosts (every node by name)
and the boot id are per node, /tmp is private, /root is the node's own HOME, and nvidia-smi and
the engine entry points come first on PATH.

Everything a run creates is named with its run id and removed by `close()`, by an atexit hook,
or — when the process died — by `cleanup_stale()` at the start of the next run.
"""

from __future__ import annotations

import atexit
import dataclasses
import json
import math
import os
import re
import secrets
import shutil
import signal
import socket
import string
import sys
import subprocess
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Sequence

from . import engines as real_engines
from . import network
from .network import PREFIX, RUNS_ROOT, TestbedError, run
from .specs import GPU, NodeSpec, gpu_state, meminfo_text

DOUBLES = Path(__file__).resolve().parent / "doubles"
SSHD = "/usr/sbin/sshd"
NODE_PYTHON = "/usr/bin/python3"
ENGINE_ENTRIES = ("vllm", "llama-server", "sglang")
UV_ENV = ("UV_CACHE_DIR", "UV_LINK_MODE", "UV_PYTHON_DOWNLOADS", "UV_NO_PROGRESS")
SYSTEM_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
DEFAULT_PORTS = "20000-20099"
NODE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9.-]{0,39}")  # a hostname, a netns name and a path part
SSH_READY_TIMEOUT = 15.0
SILENT_MAC = "02:00:00:6c:6c:00"  # locally administered; no port of a testbed bridge has it
REQUIRED_TOOLS = ("ip", "unshare", "nsenter", "ssh-keygen", "mount", "umount")

_open_testbeds: "set[Testbed]" = set()


def requirements_missing() -> str | None:
    """Why a testbed cannot be built here, or None when it can."""
    if os.geteuid() != 0:
        return "the testbed needs root (network and mount namespaces)"
    if not os.access(SSHD, os.X_OK):
        return f"{SSHD} is missing (install openssh-server)"
    for tool in REQUIRED_TOOLS:
        if shutil.which(tool) is None:
            return f"`{tool}` is missing"
    if not os.access(NODE_PYTHON, os.X_OK):
        return f"{NODE_PYTHON} is missing (node-side programs run under it)"
    return None


def default_specs(count: int, gpus: int = 8) -> list[NodeSpec]:
    """`count` nodes: `gpus` H100s each (CPU nodes when 0), the first half on fabric ib-a."""
    half = math.ceil(count / 2)
    specs = []
    for i in range(1, count + 1):
        fabric = "ib-a" if i <= half else "ib-b"
        specs.append(NodeSpec(
            name=f"node{i}", gpus=[GPU.h100()] * gpus if gpus else None, mem_gb=256,
            fabric=fabric, labels={"zone": fabric[-1]},
        ))
    return specs


def _new_run_id() -> str:
    alphabet = string.ascii_lowercase + string.digits
    return "".join(secrets.choice(alphabet) for _ in range(5))


def _write_atomic(path: Path, text: str, mode: int = 0o644) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.chmod(tmp, mode)
    os.replace(tmp, path)


def _write_in_place(path: Path, text: str) -> None:
    # Bind-mounted files must keep their inode: a rename would leave the mount on the old file.
    with open(path, "r+" if path.exists() else "w") as f:
        f.seek(0)
        f.write(text)
        f.truncate()


@dataclass
class Node:
    """A running testbed host. Paths are as seen from inside the node (and, unless mounted only
    inside it, from the host too: see `host_path`)."""

    name: str
    spec: NodeSpec
    index: int
    address: str
    netns: str
    veth: str
    dir: Path
    mnt_ns_file: Path
    uts_ns_file: Path
    host_key_pub: str = ""
    sshd: subprocess.Popen | None = field(default=None, repr=False)
    boot_id: str = ""

    @property
    def home_dir(self) -> Path:
        """The directory bind-mounted over /root inside the node."""
        return self.dir / "home"

    @property
    def bin_dir(self) -> Path:
        return self.dir / "bin"

    @property
    def pylib_dir(self) -> Path:
        return self.dir / "pylib"

    @property
    def models_dir(self) -> Path:
        return self.dir / "models"

    @property
    def cache_dir(self) -> Path:
        return self.dir / "cache"

    @property
    def sshd_config(self) -> Path:
        return self.dir / "sshd_config"

    @property
    def sshd_log(self) -> Path:
        return self.dir / "sshd.log"

    @property
    def gpus_file(self) -> Path:
        return self.dir / "gpus.json"

    @property
    def sshd_pid(self) -> int | None:
        return self.sshd.pid if self.sshd is not None and self.sshd.poll() is None else None

    def host_path(self, path: str | os.PathLike) -> Path:
        """`path` inside the node's mount namespace, reached from the host through sshd's
        /proc/PID/root (needs sshd alive). Use it to look into or fill the tmpfs directories."""
        pid = self.sshd_pid
        if pid is None:
            raise TestbedError(f"{self.name}: sshd is not running; restart_node() first")
        return Path(f"/proc/{pid}/root") / str(path).lstrip("/")


class Testbed:
    """N real SSH hosts built from NodeSpecs; a context manager. See the module docstring."""

    __test__ = False  # not a test class, despite the name

    def __init__(self, specs: Sequence[NodeSpec] | int = 4, *, shared_mb: int = 256,
                 ports: str = DEFAULT_PORTS, state_dir: str | os.PathLike | None = None):
        self.specs = default_specs(specs) if isinstance(specs, int) else list(specs)
        names = [s.name for s in self.specs]
        if len(set(names)) != len(names):
            raise ValueError(f"node names must be unique: {names}")
        for name in names:
            if not NODE_NAME.fullmatch(name):
                raise ValueError(f"node name {name!r}: use letters, digits, '-' and '.', at most 40")
        if not 1 <= len(self.specs) <= 200:
            raise ValueError("a testbed has 1 to 200 nodes")
        self.shared_mb = shared_mb
        self.ports = ports
        self.run_id = _new_run_id()
        self.dir = RUNS_ROOT / f"{PREFIX}-{self.run_id}"
        self.state_dir = Path(state_dir).resolve() if state_dir else self.dir
        self.ns_dir = self.dir / "ns"
        self.shared_dir = self.dir / "shared"
        self.lib_dir = self.dir / "lib"
        self.client_key = self.dir / "client_key"
        self.known_hosts = self.dir / "known_hosts"
        self.authorized_keys = self.dir / "authorized_keys"
        self.ca_path = self.dir / "tls" / "ca.crt"  # exists once `weights` (or `tls()`) was used
        self.bridge = f"{PREFIX}{self.run_id}b"
        self.subnet: int | None = None
        self.nodes: dict[str, Node] = {}
        self.startup_seconds: float | None = None
        self._weights = None
        self._tls = None
        self._lock = threading.Lock()
        self._closed = False

    # ------------------------------------------------------------------------- lifecycle

    def __enter__(self) -> "Testbed":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()

    def start(self) -> "Testbed":
        reason = requirements_missing()
        if reason:
            raise TestbedError(reason)
        network.cleanup_stale()
        began = time.monotonic()
        _open_testbeds.add(self)
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        self.startup_seconds = time.monotonic() - began
        return self

    def close(self) -> None:
        """Remove everything this run made. Safe to call twice and after a failed start."""
        if self._closed:
            return
        self._closed = True
        _open_testbeds.discard(self)
        if self._weights is not None:
            self._weights.close()
        network.remove_run(self.run_id)
        for node in self.nodes.values():
            if node.sshd is not None:
                node.sshd.wait()

    # --------------------------------------------------------------------------- building

    def _build(self) -> None:
        with network.host_lock():  # a concurrent stale cleanup must not see the folder ownerless
            self.dir.mkdir(mode=0o755)
            network.write_owner(self.dir)
        self.state_dir.mkdir(parents=True, exist_ok=True)
        self.ns_dir.mkdir()
        self.lib_dir.mkdir()
        self.shared_dir.mkdir()
        shutil.copy(DOUBLES / "engine_double.py", self.lib_dir / "engine_double.py")
        shutil.copytree(DOUBLES / "flags", self.lib_dir / "flags")  # the real engines' flags

        with network.host_lock():
            self.subnet = network.choose_subnet(os.getpid())
            network.ip_batch([
                f"link add {self.bridge} type bridge",
                f"addr add {self.bridge_address}/24 dev {self.bridge}",
                f"link set {self.bridge} up",
            ])
        for index, spec in enumerate(self.specs):
            self.nodes[spec.name] = Node(
                name=spec.name, spec=spec, index=index, address=f"{self.subnet_prefix}.{10 + index}",
                netns=f"{PREFIX}-{self.run_id}-{spec.name}", veth=f"{PREFIX}{self.run_id}v{index}",
                dir=self.dir / spec.name, mnt_ns_file=self.ns_dir / f"{spec.name}.mnt",
                uts_ns_file=self.ns_dir / f"{spec.name}.uts",
            )

        keygens = [self._keygen(self.client_key, "llgw testbed client")]
        for node in self.nodes.values():
            node.dir.mkdir()
            keygens.append(self._keygen(node.dir / "ssh_host_ed25519_key", f"{node.name} host key"))
        self._make_network()
        # Private bind of the namespace folder: mount namespaces can only be bound onto a
        # mount that does not propagate (the way `ip netns` treats /run/netns).
        run(["mount", "--bind", str(self.ns_dir), str(self.ns_dir)])
        run(["mount", "--make-private", str(self.ns_dir)])
        run(["mount", "-t", "tmpfs", "-o", f"size={self.shared_mb}m,mode=0755", "llgw-shared", str(self.shared_dir)])
        os.makedirs("/run/sshd", mode=0o755, exist_ok=True)  # sshd's privilege separation dir
        for proc in keygens:
            if proc.wait() != 0:
                raise TestbedError(f"ssh-keygen failed: {proc.stderr.read().decode()}")
        self.authorized_keys.write_text(Path(f"{self.client_key}.pub").read_text())
        for node in self.nodes.values():
            key_type, key = (node.dir / "ssh_host_ed25519_key.pub").read_text().split()[:2]
            node.host_key_pub = f"{key_type} {key}"
            self._write_node_files(node)
        self.known_hosts.write_text("".join(f"{n.address} {n.host_key_pub}\n" for n in self.nodes.values()))
        # Nodes resolve each other (and this host, as `control`) by name, like a real cluster.
        (self.dir / "hosts").write_text(
            "127.0.0.1\tlocalhost\n::1\tlocalhost ip6-localhost ip6-loopback\n"
            f"{self.bridge_address}\tcontrol\n" + "".join(f"{n.address}\t{n.name}\n" for n in self.nodes.values()))
        for node in self.nodes.values():
            self._start_sshd(node, first=True)
        self._wait_ssh(self.nodes.values())

    @staticmethod
    def _keygen(path: Path, comment: str) -> subprocess.Popen:
        return subprocess.Popen(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", comment, "-f", str(path)],
                                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)

    def _make_network(self) -> None:
        commands = []
        for node in self.nodes.values():
            commands += [
                f"netns add {node.netns}",
                f"link add {node.veth} type veth peer name eth0 netns {node.netns}",
                f"link set {node.veth} master {self.bridge}",
                f"link set {node.veth} up",
            ]
        network.ip_batch(commands)
        procs = []
        for node in self.nodes.values():
            batch = f"link set lo up\naddr add {node.address}/24 dev eth0\nlink set eth0 up\n"
            procs.append(subprocess.Popen(["ip", "-n", node.netns, "-batch", "-"], stdin=subprocess.PIPE,
                                          stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True))
            procs[-1].stdin.write(batch)
            procs[-1].stdin.close()
        for proc in procs:
            if proc.wait() != 0:
                raise TestbedError(f"configuring a node namespace failed: {proc.stderr.read()}")

    def _write_node_files(self, node: Node) -> None:
        spec = node.spec
        for sub in ("home", "bin", "models", "cache", "gpu-apps", "pylib/sglang"):
            (node.dir / sub).mkdir(parents=True, exist_ok=True)
        (node.home_dir / ".bashrc").write_text("# testbed node: nothing to set up\n")
        node.boot_id = str(uuid.uuid4())
        (node.dir / "boot_id").write_text(node.boot_id + "\n")
        (node.dir / "meminfo").write_text(meminfo_text(spec.mem_gb))
        self._write_gpus(node, spec.gpus, spec.driver_loaded)
        if spec.gpus is not None:
            shutil.copy(DOUBLES / "nvidia-smi", node.bin_dir / "nvidia-smi")
            os.chmod(node.bin_dir / "nvidia-smi", 0o755)
        entry = ('#!/usr/bin/python3\n"""{mode} entry point of the engine test double (not {real}); see engine_double.py."""\n'
                 "import sys\nsys.path.insert(0, {lib!r})\nimport engine_double\n"
                 "engine_double.entry_point({mode!r}, {node!r})\n")
        for name, mode, real in (("vllm", "vllm", "vLLM"), ("llama-server", "llama-server", "llama.cpp"),
                                 ("sglang", "sglang", "SGLang")):
            path = node.bin_dir / name
            if spec.engines == "none":
                continue
            if spec.engines == "real" and name in real_engines.REAL:
                path.write_text(real_engines.wrapper(name))
            else:
                path.write_text(entry.format(mode=mode, real=real, lib=str(self.lib_dir), node=str(node.dir)))
            os.chmod(path, 0o755)
        (node.pylib_dir / "sglang" / "__init__.py").write_text('"""SGLang stub package of the engine test double (not SGLang)."""\n')
        (node.pylib_dir / "sglang" / "launch_server.py").write_text(
            '"""`python3 -m sglang.launch_server`: the engine test double in SGLang mode (not SGLang)."""\n'
            f"import sys\nsys.path.insert(0, {str(self.lib_dir)!r})\nimport engine_double\n\n"
            f"if __name__ == '__main__':\n    engine_double.entry_point('sglang', {str(node.dir)!r})\n")

        if spec.uv:
            uv = Path(sys.executable).parent / "uv"
            if not uv.is_file():
                raise RuntimeError(f"NodeSpec(uv=True) needs uv beside the test interpreter ({uv}): pip install uv")
            # A copy, not a wrapper: the node's /tmp is its own, and the test environment may be under it.
            shutil.copy(uv, node.bin_dir / "uv")
            os.chmod(node.bin_dir / "uv", 0o755)
        env = self.node_env(node)
        setenv = " ".join(f"{k}={env[k]}" for k in ("PATH", "PYTHONPATH", "SSL_CERT_FILE", *UV_ENV) if k in env)
        config = [
            f"ListenAddress {node.address}:22",
            f"HostKey {node.dir / 'ssh_host_ed25519_key'}",
            f"PidFile {node.dir / 'sshd.pid'}",
            f"AuthorizedKeysFile {self.authorized_keys}",
            "PermitRootLogin prohibit-password",
            "PubkeyAuthentication yes",
            "PasswordAuthentication no",
            "KbdInteractiveAuthentication no",
            "UsePAM no",
            "StrictModes no",
            "MaxStartups 100",
            "PrintMotd no",
            "PrintLastLog no",
            "UseDNS no",
            f"SetEnv {setenv}",
            "Subsystem sftp internal-sftp",
        ]
        if _sshd_has_penalties():
            config.append("PerSourcePenalties no")  # probes and refused clients must not lock us out
        (node.dir / "sshd_config").write_text("\n".join(config) + "\n")
        q = lambda p: "'" + str(p) + "'"  # noqa: E731 - paths are ours: no quotes inside
        setup = [
            "#!/bin/sh",
            "# Runs inside the node's fresh mount + UTS namespaces, then becomes sshd.",
            "set -e",
            # Drop the other nodes' namespace files and netns handles this copy inherited.
            f"umount -l {q(self.ns_dir)} 2>/dev/null || true",
            "umount -l /run/netns 2>/dev/null || true",
            f"hostname {q(node.name)}",
            # A private /tmp, with the run folder (node dirs, CA, doubles) bound back into it;
            # fd 3 keeps the run folder reachable once the tmpfs hides it.
            f"exec 3<{q(self.dir)}",
            f"mount -t tmpfs -o size={spec.tmp_mb}m,mode=1777 llgw-tmp /tmp",
            f"mkdir -p {q(self.dir)}",
            f"mount --no-canonicalize --rbind /proc/self/fd/3 {q(self.dir)}",
            "exec 3<&-",
            f"mount --bind {q(self.dir / 'hosts')} /etc/hosts",
            f"mount --bind {q(node.dir / 'meminfo')} /proc/meminfo",
            f"mount --bind {q(node.dir / 'boot_id')} /proc/sys/kernel/random/boot_id",
            f"mount --bind {q(node.home_dir)} /root",
            f"mount -t tmpfs -o size={spec.models_mb}m,mode=0755 llgw-models {q(node.models_dir)}",
            f"mount -t tmpfs -o size={spec.cache_mb}m,mode=0755 llgw-cache {q(node.cache_dir)}",
            f"exec {SSHD} -D -e -f {q(node.sshd_config)}",
        ]
        (node.dir / "setup.sh").write_text("\n".join(setup) + "\n")

    def _start_sshd(self, node: Node, first: bool) -> None:
        if first:
            # unshare binds the new namespaces onto the files: they outlive every process.
            argv = ["nsenter", f"--net=/run/netns/{node.netns}", "--",
                    "unshare", f"--mount={node.mnt_ns_file}", f"--uts={node.uts_ns_file}",
                    "--propagation", "private", "--", "/bin/sh", str(node.dir / "setup.sh")]
            node.mnt_ns_file.touch()
            node.uts_ns_file.touch()
        else:
            argv = self._nsenter(node) + [SSHD, "-D", "-e", "-f", str(node.sshd_config)]
        with open(node.sshd_log, "ab") as log:
            node.sshd = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                                         cwd="/", start_new_session=True)

    def _nsenter(self, node: Node) -> list[str]:
        return ["nsenter", f"--net=/run/netns/{node.netns}", f"--mount={node.mnt_ns_file}",
                f"--uts={node.uts_ns_file}", "--"]

    def _wait_ssh(self, nodes: Iterable[Node], timeout: float = SSH_READY_TIMEOUT) -> None:
        """Poll until each node's sshd sends its banner."""
        pending = list(nodes)
        deadline = time.monotonic() + timeout
        while pending:
            for node in list(pending):
                if node.sshd is not None and node.sshd.poll() is not None:
                    raise TestbedError(f"{node.name}: sshd exited with {node.sshd.returncode}: "
                                       f"{node.sshd_log.read_text()[-2000:]}")
                if _ssh_banner(node.address):
                    pending.remove(node)
            if not pending:
                return
            if time.monotonic() > deadline:
                raise TestbedError(f"sshd did not come up on {[n.name for n in pending]} within {timeout}s")
            time.sleep(0.01)

    # --------------------------------------------------------------------------- access

    @property
    def subnet_prefix(self) -> str:
        return f"{network.SUPERNET}.{self.subnet}"

    @property
    def bridge_address(self) -> str:
        """This (the control host's) address on the testbed network."""
        return f"{self.subnet_prefix}.1"

    def node(self, node: str | Node) -> Node:
        return node if isinstance(node, Node) else self.nodes[node]

    __getitem__ = node

    def node_env(self, node: str | Node) -> dict[str, str]:
        """The environment an SSH session on the node gets (sshd's SetEnv plus the basics)."""
        node = self.node(node)
        return {
            "PATH": f"{node.bin_dir}:{SYSTEM_PATH}",
            "PYTHONPATH": str(node.pylib_dir),
            "SSL_CERT_FILE": str(self.ca_path),
            "HOME": "/root",
            "USER": "root",
            "LOGNAME": "root",
            "LANG": "C.UTF-8",
            **({"UV_CACHE_DIR": str(real_engines.ENGINES_DIR / "cache" / "uv"), "UV_LINK_MODE": "copy",
                "UV_PYTHON_DOWNLOADS": "never", "UV_NO_PROGRESS": "1"} if node.spec.uv else {}),
        }

    def ssh_options(self, node: str | Node, **overrides) -> dict:
        """Keyword arguments for `asyncssh.connect` (host-key checking on)."""
        node = self.node(node)
        options = {"host": node.address, "port": 22, "username": "root",
                   "client_keys": [str(self.client_key)], "known_hosts": str(self.known_hosts),
                   "config": [], "agent_path": None, "connect_timeout": 5}
        options.update(overrides)
        return options

    async def connect(self, node: str | Node, **overrides):
        """An asyncssh connection to the node as root, verifying its host key."""
        import asyncssh

        return await asyncssh.connect(**self.ssh_options(node, **overrides))

    def ssh_argv(self, node: str | Node, command: str) -> list[str]:
        """An OpenSSH `ssh` command line running `command` on the node."""
        node = self.node(node)
        return ["ssh", "-F", "/dev/null", "-i", str(self.client_key), "-o", "BatchMode=yes",
                "-o", "StrictHostKeyChecking=yes", "-o", f"UserKnownHostsFile={self.known_hosts}",
                f"root@{node.address}", command]

    def run(self, node: str | Node, argv: Sequence[str], *, input: str | bytes | None = None,
            timeout: float = 30, check: bool = False, env: dict | None = None) -> subprocess.CompletedProcess:
        """Run a command inside the node's namespaces (no SSH involved), text in and out.

        Works while sshd is down too: the namespaces live on in their files."""
        node = self.node(node)
        full_env = dict(self.node_env(node), **(env or {}))
        argv = self._nsenter(node) + ["env", "-i"] + [f"{k}={v}" for k, v in full_env.items()] + list(argv)
        return subprocess.run(argv, input=input, capture_output=True, text=not isinstance(input, bytes),
                              timeout=timeout, check=check, cwd="/")

    def popen(self, node: str | Node, argv: Sequence[str], **kwargs) -> subprocess.Popen:
        """Start a long-running command inside the node (e.g. an engine double), not over SSH."""
        node = self.node(node)
        env = dict(self.node_env(node), **kwargs.pop("env", {}))
        argv = self._nsenter(node) + ["env", "-i"] + [f"{k}={v}" for k, v in env.items()] + list(argv)
        kwargs.setdefault("cwd", "/")
        kwargs.setdefault("start_new_session", True)
        return subprocess.Popen(argv, **kwargs)

    # ----------------------------------------------------------------------------- faults

    def cut(self, node: str | Node) -> None:
        """Take the node's link down: packets to and from it are dropped (no RST, no FIN)."""
        run(["ip", "link", "set", self.node(node).veth, "down"])

    def restore(self, node: str | Node) -> None:
        run(["ip", "link", "set", self.node(node).veth, "up"])

    def silent_addresses(self, count: int) -> list[str]:
        """`count` addresses of the testbed network at which nothing answers.

        Packets to them do leave (each has a permanent neighbour entry with a MAC no port has),
        so a TCP connect hangs until its own timeout, as with a powered-off host behind a switch
        or a firewall that drops SYNs; no "host unreachable" comes back. Gone with the bridge."""
        first = 10 + len(self.nodes)
        if count < 0 or first + count > 255:
            raise ValueError(f"{count} silent addresses do not fit beside {len(self.nodes)} nodes in a /24")
        addresses = [f"{self.subnet_prefix}.{first + i}" for i in range(count)]
        network.ip_batch([f"neigh replace {address} lladdr {SILENT_MAC} dev {self.bridge} nud permanent"
                          for address in addresses])
        return addresses

    def crash(self, node: str | Node, *, silent: bool = False) -> None:
        """SIGKILL every process of the node, sshd included. Its disks (tmpfs dirs) survive.

        The kernel still closes the node's TCP connections (peers see FIN/RST). With `silent`,
        the link is cut first, so peers see nothing at all, as with a power loss;
        `restart_node` brings the link back."""
        node = self.node(node)
        if silent:
            self.cut(node)
        network.kill_netns_processes(node.netns)
        if node.sshd is not None:
            node.sshd.wait()

    def restart_node(self, node: str | Node) -> None:
        """Boot the node again after a crash: same host key and disks, a new boot id."""
        node = self.node(node)
        if node.sshd_pid is not None:
            raise TestbedError(f"{node.name} is running; crash() it first")
        node.boot_id = str(uuid.uuid4())
        _write_in_place(node.dir / "boot_id", node.boot_id + "\n")
        # A reboot empties /tmp (the run folder bound into it stays).
        self.run(node, ["find", "/tmp", "-mindepth", "1", "-maxdepth", "1", "!", "-path", str(self.dir),
                        "-exec", "rm", "-rf", "{}", "+"], check=True)
        self.restore(node)
        self._start_sshd(node, first=False)
        self._wait_ssh([node])

    def engine_pids(self, node: str | Node) -> list[int]:
        """Engine processes of the node: the double's (entry points or sglang stub) and the main
        process of each real engine (not the workers a real vLLM starts)."""
        node = self.node(node)
        entries = {str(node.bin_dir / name) for name in ENGINE_ENTRIES}
        pids = []
        for pid in network.netns_pids(node.netns):
            try:
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            args = [a.decode(errors="replace") for a in cmdline[:4]]
            if any(a in entries for a in args) or "sglang.launch_server" in args \
                    or real_engines.is_engine_process(args):
                pids.append(pid)
        return pids

    def kill_engines(self, node: str | Node, sig: int = signal.SIGKILL) -> list[int]:
        """Signal every engine double process of the node (an engine crash); returns the pids."""
        pids = self.engine_pids(node)
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        return pids

    def kill_matching(self, node: str | Node, pattern: str, sig: int = signal.SIGTERM) -> list[int]:
        """Signal the node's processes whose command line matches `pattern` (a regex), as
        `pkill -f` would, but only inside the node's network namespace: the nodes share the
        host's pid space, so a `pkill` run on a node would reach every process of the host."""
        node = self.node(node)
        regex = re.compile(pattern)
        pids = []
        for pid in network.netns_pids(node.netns):
            try:
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if regex.search(cmdline):
                try:
                    os.kill(pid, sig)
                    pids.append(pid)
                except ProcessLookupError:
                    pass
        return pids

    def set_gpus(self, node: str | Node, gpus: Sequence[GPU] | None = None, *, driver_loaded: bool | None = None) -> None:
        """Change what the node's nvidia-smi reports, while it runs. `gpus=None` keeps the list."""
        node = self.node(node)
        if node.spec.gpus is None:
            raise TestbedError(f"{node.name} is a CPU node: it has no nvidia-smi")
        if gpus is not None:
            node.spec = _replace(node.spec, gpus=tuple(gpus))
        if driver_loaded is not None:
            node.spec = _replace(node.spec, driver_loaded=driver_loaded)
        self._write_gpus(node, node.spec.gpus, node.spec.driver_loaded)

    def set_memory(self, node: str | Node, mem_gb: float | None) -> None:
        """Change the node's /proc/meminfo while it runs (None: no MemTotal line)."""
        node = self.node(node)
        node.spec = _replace(node.spec, mem_gb=mem_gb)
        _write_in_place(node.dir / "meminfo", meminfo_text(mem_gb))

    def set_engine_knobs(self, node: str | Node, **knobs) -> None:
        """Knobs for engine doubles started on the node from now on (see engine_double.py);
        `by_model={"name": {...}}` and `by_port={"8001": {...}}` narrow them. Replaces earlier knobs."""
        node = self.node(node)
        _write_atomic(node.home_dir / "engine-double.json", json.dumps(knobs))

    def _write_gpus(self, node: Node, gpus, driver_loaded: bool) -> None:
        state = gpu_state(node.name, gpus, driver_loaded, node.spec.driver_version)
        _write_atomic(node.gpus_file, json.dumps(state, indent=1))

    # -------------------------------------------------------------------- weights and TLS

    def tls(self):
        """The testbed CA and the weights server's certificate (made on first use)."""
        from .tls import make_ca_and_server_cert

        with self._lock:
            if self._tls is None:
                self._tls = make_ca_and_server_cert(self.ca_path.parent, self.bridge_address)
            return self._tls

    @property
    def weights(self):
        """The HTTPS weights server on the bridge address (started on first use)."""
        from .weights import WeightsServer

        cert = self.tls()
        with self._lock:
            if self._weights is None:
                self._weights = WeightsServer(self.bridge_address, cert)
            return self._weights

    # ------------------------------------------------------------------------- inventory

    def inventory(self, models: list | None = None, profiles: dict | None = None) -> dict:
        """The llmgw inventory for these nodes, as a dict."""
        nodes = []
        for node in self.nodes.values():
            spec = node.spec
            entry: dict = {"name": node.name, "host": node.address}
            if spec.fabric is not None:
                entry["fabric"] = spec.fabric
            if spec.labels:
                entry["labels"] = dict(spec.labels)
            entry["model_dirs"] = [str(node.models_dir)]
            entry["cache_dir"] = str(node.cache_dir)
            if spec.shared:
                entry["shared_dirs"] = [str(self.shared_dir)]
            entry["ports"] = self.ports
            nodes.append(entry)
        return {
            "ssh": {
                "user": "root",
                "identity_file": str(self.client_key),
                "known_hosts": str(self.known_hosts),
                "python": NODE_PYTHON,
                "connect_timeout": "5s",
                "keepalive_interval": "1s",
                "keepalive_count": 3,
            },
            "nodes": nodes,
            "profiles": dict(profiles or {}),
            "models": list(models or []),
        }

    def write_inventory(self, path: str | os.PathLike | None = None, *, models: list | None = None,
                        profiles: dict | None = None) -> Path:
        """Write the inventory YAML (default: STATE_DIR/inventory.yaml) and return its path."""
        path = Path(path) if path else self.state_dir / "inventory.yaml"
        path.write_text(_inventory_yaml(self.inventory(models, profiles)))
        return path


def _inventory_yaml(doc: dict) -> str:
    """Block style, except a node's labels and directory lists, which read better inline."""
    import yaml

    class Flow(list):
        pass

    class FlowMap(dict):
        pass

    class Dumper(yaml.SafeDumper):
        pass

    Dumper.add_representer(Flow, lambda d, v: d.represent_sequence("tag:yaml.org,2002:seq", v, flow_style=True))
    Dumper.add_representer(FlowMap, lambda d, v: d.represent_mapping("tag:yaml.org,2002:map", v, flow_style=True))
    nodes = []
    for entry in doc["nodes"]:
        entry = dict(entry)
        for key in ("model_dirs", "shared_dirs"):
            if key in entry:
                entry[key] = Flow(entry[key])
        if "labels" in entry:
            entry["labels"] = FlowMap(entry["labels"])
        nodes.append(entry)
    doc = dict(doc, nodes=nodes)
    return yaml.dump(doc, Dumper=Dumper, sort_keys=False, default_flow_style=False, width=120)


def _replace(spec: NodeSpec, **changes) -> NodeSpec:
    return dataclasses.replace(spec, **changes)


def _ssh_banner(address: str) -> bool:
    try:
        with socket.create_connection((address, 22), timeout=0.5) as sock:
            sock.settimeout(1.0)
            return sock.recv(64).startswith(b"SSH-")
    except OSError:
        return False


_penalties: bool | None = None


def _sshd_has_penalties() -> bool:
    """OpenSSH >= 9.8 penalises clients that fail or hang up; the testbed wants none of that."""
    global _penalties
    if _penalties is None:
        out = subprocess.run([SSHD, "-V"], capture_output=True, text=True).stderr
        try:
            version = out.split("OpenSSH_", 1)[1].split(",")[0].split("p")[0].split()[0]
            major, minor = (int(x) for x in version.split(".")[:2])
            _penalties = (major, minor) >= (9, 8)
        except (IndexError, ValueError):
            _penalties = False
    return _penalties


@atexit.register
def _close_all() -> None:
    for tb in list(_open_testbeds):
        try:
            tb.close()
        except Exception:  # noqa: BLE001 - best effort at interpreter exit
            pass
