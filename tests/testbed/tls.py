"""A throwaway certificate authority for the testbed, made with the `openssl` command.

Nodes trust it through SSL_CERT_FILE; tests running the control plane in this process pass
`ca_path` to their HTTP client. Certificates carry the extensions strict verifiers want (key
usage on the CA, SAN on the server) so they also pass Python 3.13's VERIFY_X509_STRICT.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from .network import run


@dataclass(frozen=True)
class ServerCert:
    ca_path: Path
    cert_path: Path
    key_path: Path


def make_ca_and_server_cert(folder: Path, server_ip: str) -> ServerCert:
    folder.mkdir(parents=True, exist_ok=True)
    ca_key, ca_crt = folder / "ca.key", folder / "ca.crt"
    key, csr, crt = folder / "server.key", folder / "server.csr", folder / "server.crt"
    ext = folder / "server.ext"
    curve = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    run(["openssl", "req", "-x509", *curve, "-days", "3", "-subj", "/CN=llgw testbed CA",
         "-keyout", str(ca_key), "-out", str(ca_crt),
         "-addext", "basicConstraints=critical,CA:TRUE",
         "-addext", "keyUsage=critical,keyCertSign,cRLSign",
         "-addext", "subjectKeyIdentifier=hash"])
    run(["openssl", "req", "-new", *curve, "-subj", f"/CN={server_ip}", "-keyout", str(key), "-out", str(csr)])
    ext.write_text(
        f"subjectAltName=IP:{server_ip}\n"
        "basicConstraints=critical,CA:FALSE\n"
        "keyUsage=critical,digitalSignature\n"
        "extendedKeyUsage=serverAuth\n"
        "subjectKeyIdentifier=hash\n"
        "authorityKeyIdentifier=keyid,issuer\n"
    )
    run(["openssl", "x509", "-req", "-in", str(csr), "-CA", str(ca_crt), "-CAkey", str(ca_key),
         "-CAcreateserial", "-days", "3", "-extfile", str(ext), "-out", str(crt)])
    return ServerCert(ca_path=ca_crt, cert_path=crt, key_path=key)
