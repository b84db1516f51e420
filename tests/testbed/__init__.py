"""Test infrastructure that gives integration tests real SSH hosts on this machine.

`Testbed` builds nodes from `NodeSpec`s (network namespace + mount namespace + sshd each), with
an nvidia-smi double, an engine double that accepts vLLM / SGLang / llama-server command lines,
an HTTPS weights server with a fake Hugging Face Hub, and faults (cut, crash, engine kill).
See testbed.py for the model and `python -m tests.testbed --help` for by-hand use.
"""

from .network import TestbedError, cleanup_stale
from .specs import GPU, NodeSpec
from .testbed import Node, Testbed, default_specs, requirements_missing

__all__ = ["GPU", "Node", "NodeSpec", "Testbed", "TestbedError", "cleanup_stale", "default_specs",
           "requirements_missing"]
