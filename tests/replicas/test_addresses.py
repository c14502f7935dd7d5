"""``replicas.addresses``: one server, one spelling, however its address is written."""

from __future__ import annotations

import asyncio
import socket

import pytest

from replicas.addresses import THIS_HOST, host_key, resolve


@pytest.mark.parametrize("ip,key", [
    ("127.0.0.1", THIS_HOST), ("127.0.0.2", THIS_HOST), ("::1", THIS_HOST), ("0.0.0.0", THIS_HOST),
    ("::", THIS_HOST), ("::ffff:127.0.0.1", THIS_HOST), ("::ffff:7f00:1", THIS_HOST),
    ("::ffff:192.0.2.7", "192.0.2.7"), ("192.0.2.7", "192.0.2.7"), ("2001:db8::1", "2001:db8::1"),
    ("fe80::1%lo", "fe80::1"), ("not-an-ip", "not-an-ip"),
])
def test_every_address_of_this_machine_is_one_host_and_mapped_ipv6_is_its_ipv4(ip, key):
    assert host_key(ip) == key  # 192.0.2.0/24 and 2001:db8::/32 are documentation ranges: never local


def test_an_address_of_this_machines_own_interfaces_is_this_host():
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:  # no packet is sent
        probe.connect(("192.0.2.1", 9))
        own = probe.getsockname()[0]
    assert host_key(own) == THIS_HOST


def test_spellings_of_one_local_server_resolve_alike():
    async def both():
        return [await resolve(u) for u in ("http://localhost:8000/v1/", "http://0.0.0.0:8000/v1/",
                                           "http://[::ffff:127.0.0.1]:8000/v1/")]
    got = asyncio.run(both())
    assert all((THIS_HOST, 8000, "/v1") in a for a in got), got  # they meet
    assert ("0.0.0.0", 8000, "/v1") in got[1] and ("127.0.0.1", 8000, "/v1") in got[2]  # and keep the plain address


def test_an_address_of_this_machine_keeps_its_plain_form_for_routers_elsewhere():
    # a router on another machine resolves this machine's address to the plain address only:
    # the two routers' claim keys must still meet there
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect(("192.0.2.1", 9))
        own = probe.getsockname()[0]
    here = asyncio.run(resolve(f"http://{own}:8000"))
    assert {(own, 8000, ""), (THIS_HOST, 8000, "")} <= here
    assert asyncio.run(resolve("http://192.0.2.7:8000")) == {("192.0.2.7", 8000, "")}
