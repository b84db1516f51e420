"""An admin listener with a certificate speaks https (R-10.1): a real `llmgw serve` and `llmgw ctl`."""

from __future__ import annotations

import subprocess

import yaml

from tests.integration.test_admin_support import free_port, kill_processes_mentioning
from tests.integration.test_serve_host import Gateway


def test_an_admin_listener_with_a_certificate_speaks_https_to_ctl(tmp_path):
    cert, key = tmp_path / "admin.pem", tmp_path / "admin.key"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
                    "-keyout", str(key), "-out", str(cert), "-days", "2", "-subj", "/CN=localhost",
                    "-addext", "subjectAltName=IP:127.0.0.1"], check=True, capture_output=True)
    gateway = Gateway(tmp_path)
    gateway.inventory.write_text(yaml.safe_dump({"nodes": [{"name": "local", "connection": "local"}],
                                                 "gateway": {"admin_tls": {"cert": str(cert), "key": str(key)}}}))
    port = free_port()
    gateway.start(admin=f"127.0.0.1:{port}")
    try:
        trusted = gateway.ctl("--admin", f"https://127.0.0.1:{port}", "--ca", str(cert), "status", "--json")
        assert trusted.exit_code == 0, trusted.stderr
        doubted = gateway.ctl("--admin", f"https://127.0.0.1:{port}", "status", "--json")
        assert doubted.exit_code != 0 and "--ca FILE" in doubted.stderr, doubted
        plain = gateway.ctl("--admin", f"http://127.0.0.1:{port}", "status", "--json")
        assert plain.exit_code != 0, plain  # the listener speaks TLS only
        local = gateway.ctl("status", "--json")  # the state directory's socket stays plain
        assert local.exit_code == 0, local.stderr
        dashboard = gateway.ctl("dashboard")
        assert f"https://127.0.0.1:{port}/?token=" in dashboard.stdout, dashboard
    finally:
        gateway.stop()
        kill_processes_mentioning(str(tmp_path))
