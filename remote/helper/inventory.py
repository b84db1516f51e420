# Inventory: what the machine is and which GPUs are usable.


class Inventory(object):
    """inventory: a part of Node (below). The container programs are asked through the
    containers part, the venv recipes through the venvs part."""

    def __init__(self, root_dir, venvs, containers):
        self.root_dir = root_dir
        self.venvs = venvs
        self.containers = containers

    def op_inventory(self, args, ctx):
        images = _arg(args, "images", (list,), [])
        if len(images) > INVENTORY_IMAGES_MAX:
            raise bad_args("at most %d images may be asked about, got %d" % (INVENTORY_IMAGES_MAX, len(images)))
        for image in images:
            _check_image(image)
        venvs = _arg(args, "venvs", (dict,), {})
        if len(venvs) > INVENTORY_VENVS_MAX:
            raise bad_args("at most %d venv recipes may be asked about, got %d" % (INVENTORY_VENVS_MAX, len(venvs)))
        specs = {}
        for key, runtime in venvs.items():
            if not isinstance(runtime, dict) or runtime.get("kind") != "venv":
                raise bad_args("venvs[%r] must be a venv runtime" % (key,))
            specs[key] = check_venv_runtime(runtime)
        # The container programs answer on threads while the GPUs and environments are looked at.
        probes = self.containers.start_container_probes(sorted(set(images)))
        meminfo = _read_text("/proc/meminfo")
        memory = parse_meminfo(meminfo).get("MemTotal") if meminfo else None
        result = {
            "hostname": socket.gethostname(),
            "boot_id": read_boot_id(),
            "cpus": count_cpus(),
            "memory_bytes": memory,
        }
        result.update(self._query_gpus())
        result["python"] = {"path": sys.executable, "version": platform.python_version()}
        result["venvs"] = dict((key, self.venvs.venv_facts(spec)) for key, spec in specs.items())
        result["containers"] = self.containers.container_facts(probes)
        return result

    def _query_gpus(self):
        exe = shutil.which("nvidia-smi")
        if exe is None:
            # No nvidia-smi means no GPUs, not an error.
            return {"nvidia_smi": "absent", "nvidia_smi_error": None, "gpus": []}
        out, error = _run_nvidia_smi(
            exe, ["--query-gpu=" + ",".join(GPU_QUERY_FIELDS), "--format=csv,noheader,nounits"]
        )
        parsed = parse_gpu_csv(out or "")
        gpus = parsed["gpus"]
        if error is None and parsed["unparsed"]:
            error = "nvidia-smi printed: " + " | ".join(parsed["unparsed"])[:1000]
        if gpus:
            apps_out, apps_error = _run_nvidia_smi(
                exe, ["--query-compute-apps=" + ",".join(COMPUTE_APPS_FIELDS), "--format=csv,noheader,nounits"]
            )
            if apps_error is None:
                mark_foreign_gpu_memory(
                    gpus, parse_compute_apps_csv(apps_out), self._own_sessions(), _session_of
                )
        return {"nvidia_smi": "ok" if error is None else "error", "nvidia_smi_error": error, "gpus": gpus}

    def _own_sessions(self):
        sessions = set()
        for shard_id, state in self.root_dir.all_states():
            if _identity(state)[0] == "alive":
                info = read_proc_stat(state["pid"])
                if info is not None:
                    sessions.add(info["session"])
        return sessions



def _session_of(pid):
    info = read_proc_stat(pid)
    return info["session"] if info is not None else None


def _run_nvidia_smi(exe, arguments):
    """(stdout, error): error is None on success, else a sentence with nvidia-smi's message."""
    try:
        proc = subprocess.run(
            [exe] + arguments,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            timeout=NVIDIA_SMI_TIMEOUT,
        )
    except subprocess.TimeoutExpired:
        return None, "nvidia-smi did not answer within %g s" % NVIDIA_SMI_TIMEOUT
    except OSError as exc:
        return None, "could not run nvidia-smi: %s" % exc
    out = proc.stdout.decode("utf-8", "replace")
    if proc.returncode != 0:
        message = proc.stderr.decode("utf-8", "replace").strip() or out.strip()
        message = " ".join(message.split())[:1000]
        return out, "nvidia-smi exited with status %d: %s" % (proc.returncode, message or "no message")
    return out, None
