"""Continuous traffic from the official `openai` client, counting every request.

    with Traffic(url, key, "chat", plain=2, streams=2) as traffic:
        ...                                   # break something
    print(traffic.account("drain"))
    assert traffic.failed() == []

Worker threads send chat completions in a loop, non-streaming ("plain") and streaming, each with
its own `openai.OpenAI` client (`max_retries=0`: the client library must not hide a failure).
Every request becomes an `Outcome`: when it started, when its first token came, when it ended,
whether it succeeded and, if not, why. A request succeeds only when its answer is whole: the
expected number of tokens and a finish reason. Which engine process answered is read from the
completion id, which the engine double builds from its pid.

Traffic is bounded in count (`max_requests`) and in time (`max_seconds`), whatever the test does.
An answer names the model that made it; with `fallbacks`, an answer from one of them is whole too.
With `retry_for`, a worker retries a request that failed (connection refused, 5xx, a cut stream)
until it succeeds or `retry_for` seconds have passed: each failed try is kept in `attempts`, as
a client that retries through an outage would see it.
"""

from __future__ import annotations

import collections
import threading
import time
from dataclasses import dataclass, field

import openai

ID_COUNTER_DIGITS = 6  # the engine double's ids are "<prefix>-<pid><counter:06d>"


@dataclass
class Outcome:
    kind: str  # "plain" or "stream"
    worker: int
    started: float  # wall clock, comparable with the gateway's timestamps
    ended: float | None = None
    first_token: float | None = None
    ok: bool = False
    reason: str | None = None  # short and stable, for counting: "connection error", "HTTP 502 ...", ...
    detail: str | None = None  # the client's message
    engine_pid: int | None = None
    tokens: int = 0
    attempts: list[tuple[float, str]] = field(default_factory=list)  # failed tries before this outcome


def engine_pid(completion_id: str | None) -> int | None:
    """The pid of the engine double that made a completion, from its id."""
    if not completion_id or "-" not in completion_id:
        return None
    digits = completion_id.rsplit("-", 1)[1]
    if not digits.isdigit() or len(digits) <= ID_COUNTER_DIGITS:
        return None
    return int(digits[:-ID_COUNTER_DIGITS])


def describe(exc: BaseException) -> tuple[str, str]:
    """(reason, detail) of a failed request, the reason short enough to count by."""
    if isinstance(exc, openai.APIStatusError):
        code = None
        body = exc.body if isinstance(exc.body, dict) else {}
        error = body.get("error", body) if isinstance(body, dict) else {}
        if isinstance(error, dict):
            code = error.get("code")
        return f"HTTP {exc.status_code} {code or ''}".strip(), str(exc.message)
    if isinstance(exc, openai.APITimeoutError):
        return "client timeout", str(exc)
    if isinstance(exc, openai.APIConnectionError):
        cause = exc.__cause__ or exc.__context__
        return "connection error", f"{exc.message} ({type(cause).__name__}: {cause})" if cause else exc.message
    if isinstance(exc, openai.APIError):  # an error event inside a stream
        code = exc.body.get("code") if isinstance(exc.body, dict) else None
        return f"stream error {code or ''}".strip(), str(exc.message)
    if isinstance(exc, IncompleteAnswer):
        return "incomplete answer", str(exc)
    return type(exc).__name__, str(exc)


class IncompleteAnswer(Exception):
    """The request "succeeded" but its answer is not whole."""


class Traffic:
    """Client threads sending steady traffic to one model; a context manager (start/stop)."""

    def __init__(self, base_url: str, api_key: str, model: str, *, plain: int = 2, streams: int = 2,
                 plain_tokens: int = 4, stream_tokens: int = 25, pause: float = 0.05,
                 max_requests: int = 5000, max_seconds: float = 150.0, client_timeout: float = 60.0,
                 retry_for: float | None = None, fallbacks: tuple[str, ...] = ()):
        self.base_url = base_url
        self.api_key = api_key
        self.model = model
        self.answered_by = (model, *fallbacks)  # a fallback's answer is a whole answer too
        self.plain = plain
        self.streams = streams
        self.plain_tokens = plain_tokens
        self.stream_tokens = stream_tokens
        self.pause = pause
        self.max_requests = max_requests
        self.max_seconds = max_seconds
        self.client_timeout = client_timeout
        self.retry_for = retry_for
        self.outcomes: list[Outcome] = []
        self.in_flight: dict[int, Outcome] = {}  # worker -> its current request
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._sent = 0
        self._deadline = 0.0
        self.started_at: float | None = None
        self.stopped_at: float | None = None

    # -- running -----------------------------------------------------------------------------------

    def __enter__(self) -> Traffic:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self) -> Traffic:
        self.started_at = time.time()
        self._deadline = time.monotonic() + self.max_seconds
        kinds = ["plain"] * self.plain + ["stream"] * self.streams
        for worker, kind in enumerate(kinds):
            thread = threading.Thread(target=self._work, args=(worker, kind), name=f"traffic-{kind}-{worker}",
                                      daemon=True)
            self._threads.append(thread)
            thread.start()
        return self

    def stop(self, timeout: float | None = None) -> None:
        """Stop sending; requests in flight finish (each is bounded by the client timeout)."""
        self._stop.set()
        limit = time.monotonic() + (timeout if timeout is not None else self.client_timeout + 10)
        for thread in self._threads:
            thread.join(max(0.0, limit - time.monotonic()))
        alive = [t.name for t in self._threads if t.is_alive()]
        self.stopped_at = time.time()
        assert not alive, f"traffic threads still running after stop: {alive}"

    def _take_ticket(self) -> bool:
        with self._lock:
            if self._stop.is_set() or self._sent >= self.max_requests or time.monotonic() > self._deadline:
                return False
            self._sent += 1
            return True

    def _work(self, worker: int, kind: str) -> None:
        client = openai.OpenAI(base_url=self.base_url, api_key=self.api_key, max_retries=0,
                               timeout=self.client_timeout)
        try:
            while self._take_ticket():
                outcome = Outcome(kind=kind, worker=worker, started=time.time())
                with self._lock:
                    self.in_flight[worker] = outcome
                while True:
                    try:
                        self._send(client, outcome)
                        outcome.ok, outcome.reason, outcome.detail = True, None, None
                        break
                    except Exception as exc:  # every failure is counted, none is raised
                        outcome.reason, outcome.detail = describe(exc)
                        if self.retry_for is None or time.time() - outcome.started > self.retry_for:
                            break
                        outcome.attempts.append((time.time(), outcome.reason))
                        outcome.first_token, outcome.engine_pid, outcome.tokens = None, None, 0
                        time.sleep(0.1)
                outcome.ended = time.time()
                with self._lock:
                    self.in_flight.pop(worker, None)
                    self.outcomes.append(outcome)
                if self.pause:
                    self._stop.wait(self.pause)
        finally:
            client.close()

    def _send(self, client: openai.OpenAI, outcome: Outcome) -> None:
        messages = [{"role": "user", "content": f"request from worker {outcome.worker}"}]
        if outcome.kind == "plain":
            reply = client.chat.completions.create(model=self.model, messages=messages,
                                                   max_tokens=self.plain_tokens)
            outcome.engine_pid = engine_pid(reply.id)
            outcome.first_token = time.time()
            choice = reply.choices[0]
            outcome.tokens = reply.usage.completion_tokens if reply.usage else 0
            if not (choice.message.content or "").startswith(self.answered_by) or choice.finish_reason != "length" \
                    or outcome.tokens != self.plain_tokens:
                raise IncompleteAnswer(f"unexpected answer {choice.message.content!r} "
                                       f"(finish {choice.finish_reason}, {outcome.tokens} tokens)")
            return
        stream = client.chat.completions.create(model=self.model, messages=messages,
                                                max_tokens=self.stream_tokens, stream=True)
        finish = None
        try:
            for chunk in stream:
                if outcome.engine_pid is None:
                    outcome.engine_pid = engine_pid(chunk.id)
                if not chunk.choices:
                    continue
                choice = chunk.choices[0]
                if choice.delta.content:
                    if outcome.first_token is None:
                        outcome.first_token = time.time()
                    outcome.tokens += 1
                if choice.finish_reason is not None:
                    finish = choice.finish_reason
        finally:
            stream.close()
        if finish != "length" or outcome.tokens != self.stream_tokens:
            raise IncompleteAnswer(f"stream ended after {outcome.tokens} of {self.stream_tokens} tokens "
                                   f"(finish {finish})")

    # -- looking at what happened ----------------------------------------------------------------

    def snapshot(self) -> tuple[list[Outcome], list[Outcome]]:
        """(finished, in flight), consistent with each other."""
        with self._lock:
            return list(self.outcomes), list(self.in_flight.values())

    def succeeded(self, kind: str | None = None) -> list[Outcome]:
        return [o for o in self.snapshot()[0] if o.ok and (kind is None or o.kind == kind)]

    def failed(self, kind: str | None = None) -> list[Outcome]:
        return [o for o in self.snapshot()[0] if not o.ok and (kind is None or o.kind == kind)]

    def wait_for(self, condition, timeout: float, what: str):
        """Poll `condition(traffic)` until it is true (returned) or the deadline passes."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            value = condition(self)
            if value:
                return value
            time.sleep(0.05)
        raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}\n{self.account('so far')}")

    def account(self, title: str) -> str:
        """A few lines: requests sent, succeeded, failed and why, per kind."""
        finished, in_flight = self.snapshot()
        lines = [f"== {title}: {len(finished)} requests sent"
                 + (f" (+{len(in_flight)} still in flight)" if in_flight else "")]
        for kind in ("plain", "stream"):
            mine = [o for o in finished if o.kind == kind]
            if not mine:
                continue
            ok = [o for o in mine if o.ok]
            why = collections.Counter(o.reason for o in mine if not o.ok)
            line = f"   {kind:6}: sent {len(mine)}, succeeded {len(ok)}, failed {len(mine) - len(ok)}"
            if why:
                line += " — " + "; ".join(f"{count}× {reason}" for reason, count in why.most_common())
            retried = [o for o in mine if o.attempts]
            if retried:
                tries = collections.Counter(reason for o in retried for _, reason in o.attempts)
                line += (f"; {len(retried)} retried by the client through {sum(tries.values())} failed tries ("
                         + "; ".join(f"{count}× {reason}" for reason, count in tries.most_common()) + ")")
            lines.append(line)
        examples = {}
        for outcome in finished:
            if not outcome.ok and outcome.reason not in examples:
                examples[outcome.reason] = outcome.detail
        for reason, detail in examples.items():
            lines.append(f"   e.g. {reason}: {detail}")
        return "\n".join(lines)
