"""Routers in tests: credentials (R-10.7), a feed server's accepted set and the exchange done by
hand; and aiohttp's test server around a router's own listener (`RouterTestServer`)."""

from __future__ import annotations

import secrets

import aiohttp
from aiohttp.test_utils import BaseTestServer

from llmgw.contracts import routerauth
from llmgw.routers import RouterCredential, Verifiers


def accepting(*credentials: str, clock=None) -> Verifiers:
    """What a feed server accepts: these credentials, each under the name it carries."""
    rows = [RouterCredential(name=routerauth.credential_name(c), prefix=c[:24], created_at=0.0,
                             verifier=routerauth.verifier(c).hex()) for c in credentials]
    return Verifiers(rows) if clock is None else Verifiers(rows, clock=clock)


async def authorized(session: aiohttp.ClientSession, base: str, credential: str, method: str,
                     path: str) -> tuple[dict[str, str], str]:
    """The exchange a router makes before a request: its headers, and the answer proof to expect."""
    name, key = routerauth.credential_name(credential), routerauth.verifier(credential)
    nonce = secrets.token_urlsafe(24)
    async with session.post(base + routerauth.CHALLENGE_PATH, json={"router": name, "nonce": nonce}) as answer:
        assert answer.status == 200, await answer.text()
        document = await answer.json()
    challenge = document["challenge"]
    assert routerauth.server_proof(key, name, nonce, challenge) in document["proofs"]
    proof = routerauth.router_proof(key, name, nonce, challenge, method, path)
    return ({"Authorization": routerauth.authorization(name, challenge, proof)},
            routerauth.answer_proof(key, name, nonce, challenge))


class RouterTestServer(BaseTestServer):
    """aiohttp's test server (for its TestClient) serving a Router with the runner it serves with."""

    def __init__(self, router, **kwargs):
        self.router = router
        super().__init__(**kwargs)

    async def _make_runner(self, **kwargs):
        return self.router.runner()
