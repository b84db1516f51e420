"""A router that serve spawned and that has not said ready when serve stops is killed (R-10.4)."""

from __future__ import annotations

import asyncio
import subprocess

from llmgw import router_process


def test_r10_4_a_router_still_starting_when_serve_stops_is_killed(tmp_path, monkeypatch):
    started: list[subprocess.Popen] = []

    class Recorded(subprocess.Popen):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            started.append(self)

    monkeypatch.setattr(router_process.subprocess, "Popen", Recorded)
    (tmp_path / "router").mkdir(mode=0o700)
    (tmp_path / "router" / "credential").write_text("llmgw-router.local." + "t" * 32 + "\n")

    async def stopped_during_start() -> None:
        # No control plane answers on the feed socket, so the router never says ready.
        spawning = asyncio.create_task(router_process.spawn_router(tmp_path, "127.0.0.1:0", 1))
        await asyncio.sleep(1.0)
        assert not spawning.done()
        spawning.cancel()
        try:
            await spawning
        except asyncio.CancelledError:
            pass

    asyncio.run(stopped_during_start())
    assert len(started) == 1
    assert started[0].wait(timeout=30) == -9  # SIGKILL: it had served nothing
