"""The landing page's address: rebuilt from proxy headers, validated, escaped (R-6.4)."""

from __future__ import annotations

import pytest
from aiohttp.test_utils import make_mocked_request

from llmgw.router.landing import base_url, landing_page


@pytest.mark.parametrize("headers,expected", [
    pytest.param({"Host": "gw:8080"}, "http://gw:8080", id="host"),
    pytest.param({"Host": "gw", "Forwarded": "for=1.2.3.4;proto=https;host=api.example.com"},
                 "https://api.example.com", id="forwarded"),
    pytest.param({"Host": "gw", "Forwarded": 'host="a.example:8443";proto=HTTPS, host=b.example'},
                 "https://a.example:8443", id="forwarded-first-element-quoted"),
    pytest.param({"Host": "gw", "X-Forwarded-Host": "x.example", "X-Forwarded-Proto": "https"},
                 "https://x.example", id="x-forwarded"),
    pytest.param({"Host": "gw", "X-Forwarded-Host": "[::1]:8080"}, "http://[::1]:8080", id="ipv6"),
    pytest.param({"Host": "gw", "X-Forwarded-Host": "a b<c>"}, "http://gw", id="not-a-host"),
    pytest.param({"Host": "gw", "X-Forwarded-Proto": "ftp"}, "http://gw", id="not-a-scheme"),
])
def test_r6_4_base_url(headers, expected):
    assert base_url(make_mocked_request("GET", "/", headers=headers)) == expected


def test_r6_4_page_is_static_html_without_script():
    page = landing_page(make_mocked_request("GET", "/", headers={"Host": "gw:1"}))
    text = page.text
    assert "http://gw:1/v1" in text and "<script" not in text
    assert "default-src 'none'" in page.headers["Content-Security-Policy"]
