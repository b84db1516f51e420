"""The client-facing OpenAI-compatible gateway (SPEC §6): auth, balancing, proxying, usage."""

from llmgw.router.app import Router
from llmgw.contracts.endpoints import Endpoint
from llmgw.router.errors import RouterError
from llmgw.router.keys import KeyRing

__all__ = ["Endpoint", "KeyRing", "Router", "RouterError"]
