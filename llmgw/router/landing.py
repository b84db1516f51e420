"""The page at `/` (R-6.4): how to connect, and nothing else — no model names, no data.

The address in the examples is rebuilt from `Forwarded`, `X-Forwarded-Host`/`-Proto` and `Host`,
because behind a proxy the client's URL is not ours. Those headers are the client's to choose, so
each value must look like a host (or a scheme) to be used at all, and is HTML-escaped when shown.
"""

from __future__ import annotations

import html
import re

from aiohttp import web

_HOST = re.compile(r"^(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9._-]+)(:[0-9]{1,5})?$")
_PROTOS = ("http", "https")


def _first(value: str | None) -> str | None:
    if not value:
        return None
    return value.split(",", 1)[0].strip() or None


def _forwarded(value: str | None) -> dict[str, str]:
    """The first element of an RFC 7239 Forwarded header, as lower-cased parameter names."""
    element = _first(value)
    out: dict[str, str] = {}
    if element is None:
        return out
    for pair in element.split(";"):
        name, sep, val = pair.partition("=")
        if sep:
            out[name.strip().lower()] = val.strip().strip('"')
    return out


def base_url(request: web.BaseRequest) -> str:
    """The URL clients use to reach this router, as far as the request's headers tell."""
    forwarded = _forwarded(request.headers.get("Forwarded"))
    host = forwarded.get("host") or _first(request.headers.get("X-Forwarded-Host")) \
        or request.headers.get("Host")
    proto = forwarded.get("proto") or _first(request.headers.get("X-Forwarded-Proto")) or request.scheme
    if not host or not _HOST.match(host):
        host = request.host if _HOST.match(request.host or "") else "localhost"
    proto = proto.lower() if proto and proto.lower() in _PROTOS else "http"
    return f"{proto}://{host}"


PAGE = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>llmgw</title>
<meta name="viewport" content="width=device-width, initial-scale=1"></head>
<body style="font-family: system-ui, sans-serif; max-width: 46rem; margin: 2rem auto; padding: 0 1rem; color: #222; line-height: 1.5">
<h1 style="font-size: 1.4rem">An OpenAI- and Anthropic-compatible endpoint</h1>
<p>Use any OpenAI client with this base URL and an API key from your operator
(who creates one with <code>llmgw keys create NAME</code>).</p>
<p style="font-size: 1.1rem"><code style="background: #f2f2f2; padding: .2rem .4rem">{base}/v1</code></p>
<h2 style="font-size: 1.1rem">curl</h2>
<pre style="background: #f6f6f6; padding: 1rem; overflow-x: auto">export OPENAI_API_KEY=sk-llmgw-...
curl {base}/v1/models -H "Authorization: Bearer $OPENAI_API_KEY"
curl {base}/v1/chat/completions \\
  -H "Authorization: Bearer $OPENAI_API_KEY" -H "Content-Type: application/json" \\
  -d '{{"model": "MODEL", "messages": [{{"role": "user", "content": "Hello"}}]}}'</pre>
<h2 style="font-size: 1.1rem">Python</h2>
<pre style="background: #f6f6f6; padding: 1rem; overflow-x: auto">from openai import OpenAI

client = OpenAI(base_url="{base}/v1", api_key="sk-llmgw-...")
print([m.id for m in client.models.list()])  # the models your key may use
reply = client.chat.completions.create(
    model="MODEL", messages=[{{"role": "user", "content": "Hello"}}])
print(reply.choices[0].message.content)</pre>
<p>Streaming (<code>"stream": true</code>) works the same way, and so do, where the model's
engine serves them: <code>/v1/completions</code>, <code>/v1/embeddings</code>,
<code>/v1/responses</code> (with <code>GET /v1/responses/ID</code> and <code>previous_response_id</code>),
<code>/v1/rerank</code>, <code>/v1/score</code>, <code>/tokenize</code>, <code>/detokenize</code> and
<code>/v1/audio/transcriptions</code> and <code>/translations</code> (multipart, the
<code>model</code> field before the file).</p>
<h2 style="font-size: 1.1rem">Anthropic clients</h2>
<pre style="background: #f6f6f6; padding: 1rem; overflow-x: auto">from anthropic import Anthropic

client = Anthropic(base_url="{base}", api_key="sk-llmgw-...")  # POST /v1/messages
reply = client.messages.create(model="MODEL", max_tokens=256,
                               messages=[{{"role": "user", "content": "Hello"}}])</pre>
</body></html>
"""

HEADERS = {
    "Content-Security-Policy": "default-src 'none'; style-src 'unsafe-inline'",
    "X-Content-Type-Options": "nosniff",
    "Cache-Control": "no-store",
}


def landing_page(request: web.BaseRequest) -> web.Response:
    body = PAGE.format(base=html.escape(base_url(request), quote=True))
    return web.Response(text=body, content_type="text/html", headers=HEADERS)
