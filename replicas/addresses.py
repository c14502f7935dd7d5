"""One server, one spelling: replica URLs in a canonical form, and what they resolve to.

A replica registered twice (``http://localhost:8000`` and ``http://127.0.0.1:8000/``) would be
two replicas to the router on one engine: its load counted twice, its cache predicted twice.
``canonical_url`` refuses what a replica URL must not carry and spells the rest one way;
``resolve`` gives the socket addresses a URL reaches, which ``/admin/replicas`` compares.
"""

from __future__ import annotations

import asyncio
import functools
import ipaddress
import socket

import yarl

RESOLVE_TIMEOUT_S = 5.0

Address = frozenset[tuple[str, int, str]]
"""Where a URL leads: ``{(host, port, path)}``: per address its host resolves to, the address
itself (an IPv4-mapped IPv6 one as its IPv4) and, where it differs, its :func:`host_key`. Two
URLs reach one server when their sets meet; the sets are also the claim keys routers on other
machines compare (``router.state``), where the plain address is the one they share."""

THIS_HOST = "this-host"
""":func:`host_key` of every address that reaches this machine itself."""


def host_key(ip: str) -> str:
    """One spelling per host for the address ``ip``: an IPv4-mapped IPv6 address as its IPv4
    (``::ffff:127.0.0.1`` reaches the IPv4 listener), and :data:`THIS_HOST` for every address
    that leads to this machine: loopback (``127.0.0.0/8``, ``::1``), unspecified (``0.0.0.0``,
    ``::``: Linux connects them to the local host) and this machine's own interface addresses
    (one it can bind): a server listening on all of them is one server however it is reached.
    Two servers on one port of one machine, each bound to another local address, would read as
    one (refused: the safe side)."""
    address = _address(ip)
    if address is None:
        return ip
    if address.is_loopback or address.is_unspecified or _local(address):
        return THIS_HOST
    return str(address)


def _address(ip: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    """``ip`` without an IPv6 scope, an IPv4-mapped IPv6 address as its IPv4; None if no address."""
    try:
        address = ipaddress.ip_address(ip.split("%", 1)[0])
    except ValueError:
        return None
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped
    return address


@functools.lru_cache(maxsize=256)
def _local(address: ipaddress.IPv4Address | ipaddress.IPv6Address) -> bool:
    """Whether ``address`` is one of this machine's own (a socket can bind it)."""
    family = socket.AF_INET if address.version == 4 else socket.AF_INET6
    try:
        with socket.socket(family, socket.SOCK_STREAM) as sock:
            sock.bind((str(address), 0))
    except OSError:
        return False
    return True


def canonical_url(text: str) -> str:
    """``text`` as the router spells a replica's base URL: surrounding blanks and trailing
    slashes gone, scheme and host in lower case, the port only when it is not the scheme's
    default. ``ValueError`` naming the problem when it is not an ``http(s)://host[:port][/path]``
    URL: no host, a bad port, a host name that IDNA cannot encode (a label over 63 characters),
    credentials (``user:password@``: they would be stored and shown in every listing), a query or
    a fragment."""
    try:
        url = yarl.URL(text.strip())
    except (ValueError, TypeError) as exc:
        raise ValueError(f"is not a URL ({exc})") from None
    if url.scheme not in ("http", "https") or not url.host:
        raise ValueError("must be an http(s)://host[:port] URL of a running vLLM server")
    if url.user is not None or url.password is not None:
        raise ValueError("must not carry credentials (user:password@): replica URLs are stored and listed")
    if url.query_string or url.fragment:
        raise ValueError("must have no query string or fragment")
    host = url.host.lower()
    try:
        host.encode("idna")
    except UnicodeError as exc:
        raise ValueError(f"has a host name that is not valid ({exc})") from None
    return str(yarl.URL.build(scheme=url.scheme, host=host, port=url.explicit_port,
                              path=url.path.rstrip("/"), encoded=False)).rstrip("/")


async def resolve(url: str, timeout_s: float = RESOLVE_TIMEOUT_S) -> Address:
    """Where ``url`` (canonical) leads (:data:`Address`: ``localhost``, ``0.0.0.0``,
    ``[::ffff:127.0.0.1]`` and this machine's own addresses all meet in :data:`THIS_HOST`);
    ``OSError`` when its host does not resolve within ``timeout_s``."""
    u = yarl.URL(url)
    port = u.port or (443 if u.scheme == "https" else 80)
    try:
        infos = await asyncio.wait_for(
            asyncio.get_running_loop().getaddrinfo(u.host, port, type=socket.SOCK_STREAM), timeout_s)
    except asyncio.TimeoutError:
        raise OSError(f"{u.host} did not resolve within {timeout_s:g} s") from None
    except UnicodeError as exc:
        raise OSError(f"{u.host}: {exc}") from None
    path = u.path.rstrip("/")
    out = set()
    for info in infos:
        ip, port = info[4][0], int(info[4][1])
        address = _address(ip)
        out.add((ip if address is None else str(address), port, path))
        out.add((host_key(ip), port, path))
    return frozenset(out)
