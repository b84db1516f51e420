"""Listener addresses as both sides read them: `HOST:PORT` split, and whether a host is loopback.

`llmgw serve` reads its listeners' addresses with these, and the router its `--listen` and the
`http://` control plane it may dial (loopback only): one reading, so that an address one side
takes as loopback the other does not refuse.
"""

from __future__ import annotations

import ipaddress


def split_address(value: str) -> tuple[str, int]:
    """`HOST:PORT` as (host, port): `[::1]:80` gives `::1`, an empty host the IPv4 wildcard.

    Raises ValueError naming the value when it is not HOST:PORT with a port of 0 to 65535."""
    host, sep, port = value.rpartition(":")
    if not sep or not port.isdigit() or not (0 <= int(port) <= 65535):
        raise ValueError(f"{value!r} must be HOST:PORT")
    return (host.strip("[]") or "0.0.0.0"), int(port)


def is_loopback(host: str) -> bool:
    """Whether `host` is reachable from this machine only (a wildcard is not).

    `localhost`, 127.0.0.0/8 and ::1, with or without brackets or a zone (`::1%lo`), and IPv4
    loopback written as IPv4-mapped IPv6 (`::ffff:127.0.0.1`, which the kernel delivers to
    127.0.0.1, and which the standard library's `is_loopback` does not count on every version). A
    name other than localhost is not: it may resolve anywhere."""
    if host == "localhost":
        return True
    try:
        address = ipaddress.ip_address(host.strip("[]").split("%", 1)[0])
    except ValueError:
        return False
    mapped = getattr(address, "ipv4_mapped", None)
    return (mapped or address).is_loopback
