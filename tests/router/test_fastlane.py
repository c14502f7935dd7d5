"""The fast lane (``router.fastlane``): plain non-streamed completions on a bare protocol, every
other request handed to aiohttp with its bytes replayed. Real router, real HTTP on loopback, raw
sockets where the framing matters, a fake replica (tests/router/edge_fixtures.py)."""

from __future__ import annotations

import asyncio
import json
from urllib.parse import urlsplit

import aiohttp
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from router import keys
from router.fastlane import _parse_head, _parse_head_py
from tests.router.edge_fixtures import edge_router, fake_replica

pytestmark = pytest.mark.asyncio(loop_scope="session")

AIOHTTP_SERVER = b"Server: Python/"
"""aiohttp writes ``Server: Python/3.x aiohttp/...`` on every answer; the lane writes no Server header."""


def completion(prompt: list[int], *, extra: dict | None = None, headers: bytes = b"") -> bytes:
    body = json.dumps({"prompt": prompt, "max_tokens": 1, **(extra or {})}).encode()
    return (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n" + headers
            + b"Content-Length: %d\r\n\r\n" % len(body) + body)


class Conn:
    """One raw client connection: write bytes as they are, read answers one by one."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer

    @classmethod
    async def open(cls, url: str) -> Conn:
        parts = urlsplit(url)
        return cls(*await asyncio.open_connection(parts.hostname, parts.port))

    async def send(self, data: bytes) -> None:
        self.writer.write(data)
        await self.writer.drain()

    async def answer(self, timeout: float = 10.0) -> tuple[int, bytes, bytes]:
        """``(status, head, body)`` of the next final answer (Content-Length framed; a 100 Continue skipped)."""
        head = await asyncio.wait_for(self.reader.readuntil(b"\r\n\r\n"), timeout)
        if head.startswith(b"HTTP/1.1 100 "):
            head = await asyncio.wait_for(self.reader.readuntil(b"\r\n\r\n"), timeout)
        length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                       if line.lower().startswith(b"content-length:")), 0)
        body = await asyncio.wait_for(self.reader.readexactly(length), timeout)
        return int(head.split()[1]), head, body

    async def closed_by_server(self, timeout: float = 10.0) -> bool:
        return await asyncio.wait_for(self.reader.read(1), timeout) == b""

    def close(self) -> None:
        self.writer.close()


async def test_a_plain_completion_is_served_by_the_lane_with_the_same_answer_as_aiohttp():
    async with fake_replica() as replica:
        answers = {}
        for lane in (True, False):
            async with edge_router(replica, fast_lane=lane) as (url, _):
                conn = await Conn.open(url)
                await conn.send(completion([5, 6, 7]))
                status, head, body = await conn.answer()
                conn.close()
                answers[lane] = (status, head, json.loads(body))
        (s1, h1, b1), (s0, h0, b0) = answers[True], answers[False]
        assert (s1, s0) == (200, 200)
        assert AIOHTTP_SERVER not in h1 and AIOHTTP_SERVER in h0
        assert b1 == b0  # the same annotated answer, byte for byte once decoded
        for name in (b"X-Rollout-Replica: replica-0", b"X-Rollout-Route-Reason:", b"Content-Type: application/json"):
            assert name in h1 and name in h0
        assert replica.bodies[0] == replica.bodies[1]  # the replica saw the same request both ways


@pytest.mark.parametrize("extra", [{"x_cached": 0}, {"x_cached": 3}, {"x_no_usage": True},
                                   {"x_answer_extra": {"rollout\\u005frouter": 1}}, {"x_answer_extra": {"rollout_router": [1]}}])
async def test_the_lanes_early_answer_is_the_one_aiohttps_path_builds(extra):
    """On the lane a 200 is spliced and written as the replica's last byte is read
    (``router.responses.AnswerAhead``, its notes built while the replica works); aiohttp's path
    builds it in the task (``json_answer``). Both must give the same answer whatever the
    replica's usage says (the versions fields read ``cached_tokens == 0``), and an answer that
    cannot be spliced (its own ``rollout_router`` member, however spelled) is the task's."""
    async with fake_replica() as replica:
        answers = {}
        for lane in (True, False):
            async with edge_router(replica, fast_lane=lane, weight_update_policy="keep") as (url, app):
                app[keys.CORE].version_loaded("replica-0", 1)  # its cache now holds KV of two versions
                conn = await Conn.open(url)
                await conn.send(completion([5, 6, 7], extra=extra))
                status, head, body = await conn.answer()
                conn.close()
                ours = sorted(line for line in head.split(b"\r\n")[1:] if line.startswith((b"X-Rollout-", b"Content-Type")))
                answers[lane] = (status, ours, json.loads(body))
        assert answers[True] == answers[False]
        assert answers[True][0] == 200 and answers[True][2]["rollout_router"]["replica"] == "replica-0"
        assert answers[True][2]["rollout_router"]["reruns"] == 0
        kv = answers[True][2]["rollout_router"]["kv_versions"]
        nothing_reused = extra.get("x_cached", 0) == 0 and not extra.get("x_no_usage")
        assert kv == ([1] if nothing_reused else [0, 1]), kv  # nothing reused: its own version's KV only


@pytest.mark.parametrize("lane", [True, False])
async def test_a_cached_count_out_of_range_is_no_error_after_the_answer(lane):
    """A replica reporting ``cached_tokens: -1`` made the counters raise after the client had its
    200: a 500 counted, the job finished as failed and, three in a row, the replica taken out of
    rotation (a fresh attacker). Below zero it is no count; past the prompt, the prompt."""
    async with fake_replica() as replica, edge_router(replica, fast_lane=lane) as (url, app):
        for cached in (-1, -1, -1, -1, 2**62):
            conn = await Conn.open(url)
            await conn.send(completion([5, 6, 7], extra={"x_cached": cached}))
            status, _, body = await conn.answer()
            conn.close()
            assert status == 200 and json.loads(body)["rollout_router"]["replica"] == "replica-0"
        async with aiohttp.ClientSession() as http:
            async with http.get(url + "/metrics") as r:
                text = await r.text()
        assert 'status="500"' not in text and 'status="200"' in text
        reported = [line for line in text.splitlines() if line.startswith("rollout_router_reported_cached_tokens_total{")]
        assert reported and all(float(line.split()[-1]) <= 3 for line in reported), reported
        assert app[keys.CORE].replicas["replica-0"].healthy


async def test_an_early_answer_that_fails_is_logged_and_the_task_answers(monkeypatch, caplog):
    from router.responses import AnswerAhead

    def broken(self, status, raw):
        raise RuntimeError("boom")

    monkeypatch.setattr(AnswerAhead, "deliver", broken)
    async with fake_replica() as replica, edge_router(replica) as (url, _):
        conn = await Conn.open(url)
        await conn.send(completion([5, 6, 7]))
        status, head, body = await conn.answer()
        conn.close()
    assert status == 200 and AIOHTTP_SERVER not in head
    assert json.loads(body)["rollout_router"]["replica"] == "replica-0"
    assert "the answer callback failed" in caplog.text


async def test_a_replica_whose_version_moves_mid_request_is_not_answered_early_but_run_again():
    """The early answer declines when the replica's version changed since dispatch; the task
    then runs the request again (a non-streamed answer is never mixed) and says so."""
    async with fake_replica() as replica, edge_router(replica) as (url, app):
        core = app[keys.CORE]
        conn = await Conn.open(url)
        await conn.send(completion([5, 6, 7], extra={"x_sleep_s": 0.3}))
        while not replica.bodies:
            await asyncio.sleep(0.01)
        core.version_loaded("replica-0", 7)  # an update lands while the replica works
        core.version_loaded("replica-0", 8)
        status, _, body = await conn.answer()
        conn.close()
    assert status == 200 and len(replica.bodies) == 2
    assert json.loads(body)["rollout_router"]["reruns"] == 1


async def test_pipelined_completions_are_answered_in_order_on_one_connection():
    async with fake_replica() as replica, edge_router(replica) as (url, _):
        conn = await Conn.open(url)
        await conn.send(b"".join(completion([5, 6, 7 + k]) for k in range(3)))
        for k in range(3):
            status, head, body = await conn.answer()
            assert status == 200 and AIOHTTP_SERVER not in head
            assert json.loads(body)["usage"]["prompt_tokens"] == 3
        conn.close()
        assert [b["prompt"] for b in replica.bodies] == [[5, 6, 7], [5, 6, 8], [5, 6, 9]]


async def test_any_other_request_hands_the_connection_to_aiohttp_with_its_bytes():
    """A completion (lane), then GET /health and a completion pipelined in one write: aiohttp
    answers both from the replayed bytes, in order, and keeps the connection."""
    async with fake_replica() as replica, edge_router(replica) as (url, _):
        conn = await Conn.open(url)
        await conn.send(completion([5, 6]))
        status, head, _ = await conn.answer()
        assert status == 200 and AIOHTTP_SERVER not in head
        await conn.send(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n" + completion([8, 9]))
        status, head, body = await conn.answer()
        assert status == 200 and AIOHTTP_SERVER in head and b"replicas" in body
        status, head, body = await conn.answer()
        assert status == 200 and AIOHTTP_SERVER in head and json.loads(body)["usage"]["prompt_tokens"] == 2
        conn.close()


BODY = b'{"prompt": [5, 6], "max_tokens": 1}'


@pytest.mark.parametrize("request_bytes", [
    completion([5, 6], extra={"stream": False}),  # the word "stream": relayed by aiohttp
    completion([5, 6], headers=b"").replace(b'"max_tokens"', b'"str\\u0065am": false, "max_tokens"').replace(
        b"Content-Length: 35", b"Content-Length: %d" % (35 + len(b'"str\\u0065am": false, '))),
    completion([5, 6], headers=b"Expect: 100-continue\r\n"),
    b"POST /v1/completions?x=1 HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%s" % (len(BODY), BODY),
    b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n%x\r\n%s\r\n0\r\n\r\n"
    % (len(BODY), BODY),
    b"POST /v1/completions HTTP/1.0\r\nHost: x\r\nContent-Length: %d\r\n\r\n%s" % (len(BODY), BODY),
], ids=["stream-false", "escaped-stream-key", "expect", "query", "chunked", "http-1.0"])
async def test_requests_the_lane_does_not_take_are_answered_by_aiohttp(request_bytes):
    async with fake_replica() as replica, edge_router(replica) as (url, _):
        conn = await Conn.open(url)
        await conn.send(request_bytes)
        status, head, body = await conn.answer()
        conn.close()
        assert AIOHTTP_SERVER in head
        assert status == 200, body
        assert json.loads(body)["usage"]["prompt_tokens"] == 2


async def test_a_head_in_pieces_goes_to_aiohttp_which_waits_for_the_rest():
    async with fake_replica() as replica, edge_router(replica) as (url, _):
        conn = await Conn.open(url)
        data = completion([5, 6, 7])
        await conn.send(data[:20])
        await asyncio.sleep(0.2)
        await conn.send(data[20:])
        status, head, _ = await conn.answer()
        conn.close()
        assert status == 200 and AIOHTTP_SERVER in head


async def test_a_body_in_pieces_is_waited_for_and_a_late_one_is_the_edges_408():
    async with fake_replica() as replica, edge_router(replica, body_timeout_s=1.0) as (url, _):
        conn = await Conn.open(url)
        data = completion([5, 6, 7])
        cut = data.index(b"\r\n\r\n") + 10
        await conn.send(data[:cut])
        await asyncio.sleep(0.1)
        await conn.send(data[cut:])
        status, head, _ = await conn.answer()
        assert status == 200 and AIOHTTP_SERVER not in head  # still the lane's
        started = asyncio.get_running_loop().time()
        await conn.send(completion([5, 6, 7])[:cut])  # the rest of the body trickles, then never comes
        for _ in range(3):
            await asyncio.sleep(0.25)
            await conn.send(b" ")
        status, head, body = await conn.answer(timeout=5)
        assert asyncio.get_running_loop().time() - started < 1.6  # one deadline from the head (1 s), not per byte (1.75 s)
        assert status == 408 and json.loads(body)["error"]["param"] == "body"
        assert b"router.body_timeout_s" in body and b"Connection: close" in head
        assert await conn.closed_by_server()
        conn.close()
        assert len(replica.bodies) == 1


async def test_aiohttps_408_closes_the_connection_as_the_lanes_does():
    """A chat body (aiohttp's) that never completes: 408 with ``Connection: close``, then closed,
    so the rest of a late body cannot read as a next request (a fresh attacker saw aiohttp keep it)."""
    async with fake_replica() as replica, edge_router(replica, body_timeout_s=0.5) as (url, _):
        conn = await Conn.open(url)
        host = urlsplit(url).netloc.encode()
        await conn.send(b"POST /v1/chat/completions HTTP/1.1\r\nHost: " + host +
                        b"\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{\"mess")
        status, head, body = await conn.answer(timeout=5)
        assert status == 408 and AIOHTTP_SERVER in head and b"Connection: close" in head
        await conn.send(b"a" * 94 + completion([5, 6, 7]))  # the late rest, then what would read as a request
        assert await conn.closed_by_server()  # aiohttp lingers over the rest of the body, then closes
        conn.close()
        assert replica.bodies == []


async def test_an_idle_lane_connection_is_closed_after_the_header_timeout():
    async with fake_replica() as replica, edge_router(replica, header_timeout_s=0.5) as (url, _):
        conn = await Conn.open(url)
        await conn.send(completion([5, 6]))
        assert (await conn.answer())[0] == 200
        started = asyncio.get_running_loop().time()
        assert await conn.closed_by_server(timeout=5)
        assert 0.3 < asyncio.get_running_loop().time() - started < 3
        conn.close()


async def test_the_idle_deadline_counts_from_the_last_answer_not_from_the_connection():
    """The lane keeps one timer handle per connection and moves its deadline: a request served
    late in the first idle period gets a whole idle period after its answer."""
    async with fake_replica() as replica, edge_router(replica, header_timeout_s=0.8) as (url, _):
        conn = await Conn.open(url)
        await asyncio.sleep(0.5)
        await conn.send(completion([5, 6]))
        assert (await conn.answer())[0] == 200
        answered = asyncio.get_running_loop().time()
        assert await conn.closed_by_server(timeout=5)
        assert asyncio.get_running_loop().time() - answered > 0.6  # the first deadline was 0.3 s after it
        conn.close()


async def test_connection_close_is_honoured():
    async with fake_replica() as replica, edge_router(replica) as (url, _):
        conn = await Conn.open(url)
        await conn.send(completion([5, 6], headers=b"Connection: close\r\n"))
        status, head, _ = await conn.answer()
        assert status == 200 and b"Connection: close" in head
        assert await conn.closed_by_server()
        conn.close()


async def test_a_client_leaving_mid_request_cancels_it_and_leaves_nothing_behind():
    async with fake_replica() as replica, edge_router(replica) as (url, app):
        conn = await Conn.open(url)
        await conn.send(completion([5, 6], extra={"x_sleep_s": 5}))
        for _ in range(100):
            if replica.bodies:
                break
            await asyncio.sleep(0.02)
        assert replica.bodies, "the request never reached the replica"
        conn.close()
        life = app[keys.LIFECYCLE]
        for _ in range(100):
            if not any(life.flights.values()):
                break
            await asyncio.sleep(0.02)
        assert not any(life.flights.values())
        async with aiohttp.ClientSession() as http, http.get(url + "/metrics") as r:
            text = await r.text()
        assert 'rollout_router_requests_total{endpoint="completions",status="499"} 1.0' in text


async def test_the_routers_own_refusals_come_back_through_the_lane():
    async with fake_replica() as replica, edge_router(replica, api_keys={"k1": None}) as (url, _):
        conn = await Conn.open(url)
        await conn.send(completion([5, 6]))
        status, head, body = await conn.answer()
        assert status == 401 and AIOHTTP_SERVER not in head and json.loads(body)["error"]["code"] == 401
        await conn.send(completion([5, 6], headers=b"Authorization: Bearer k1\r\n", extra={"n": 10**6}))
        status, _, body = await conn.answer()
        assert status == 400 and json.loads(body)["error"]["param"] == "n"
        await conn.send(completion([], headers=b"Authorization: Bearer k1\r\n"))
        status, _, body = await conn.answer()
        assert status == 400 and json.loads(body)["error"]["param"] == "prompt"
        conn.close()
        assert replica.bodies == []


async def test_a_stopping_router_closes_its_lane_connections():
    async with fake_replica() as replica:
        async with edge_router(replica) as (url, _):
            conn = await Conn.open(url)
            await conn.send(completion([5, 6]))
            assert (await conn.answer())[0] == 200
        assert await conn.closed_by_server(timeout=10)
        conn.close()


async def test_a_max_body_past_64_bits_is_judged_as_in_python():
    """``router.max_body_bytes`` has no upper bound; the C pass takes a 64-bit bound (a value past
    it raised inside ``data_received`` and dropped every lane connection, a fresh attacker found)."""
    head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 5"
    for max_body in (2**63 - 1, 2**63, 2**64, 10**30):
        ours = _parse_head(head, len(head), max_body)
        assert ours is not None and (list(ours[0].items()), ours[1], ours[2]) == (
            list(_parse_head_py(head, max_body)[0].items()), 5, False)


@pytest.mark.parametrize("head, taken", [
    (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 5", True),
    (b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-length: 5\r\nX-Session-Id: s", True),
    (b"POST /v1/completions HTTP/1.1\r\nContent-Length: 5", False),  # no Host: aiohttp's 400
    (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nHost: y\r\nContent-Length: 5", False),
    (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\nConnection: keep-alive\r\n"
     b"Content-Length: 5", False),
    (b"POST /v1/completions HTTP/1.1\r\nHost: x", False),  # no length
    (b"POST /v1/completions HTTP/1.1\r\nContent-Length: 5\r\nContent-Length: 5", False),
    (b"POST /v1/completions HTTP/1.1\r\nContent-Length: +5", False),
    (b"POST /v1/completions HTTP/1.1\r\nContent-Length: 5\r\n folded", False),
    (b"POST /v1/completions HTTP/1.1\r\nContent-Length : 5", False),
    (b"POST /v1/completions HTTP/1.1\r\nContent-Length: 5\r\nX(y): 1", False),
    (b"POST /v1/completions HTTP/1.1\r\nContent-Length: 5\r\nX: \xc3\xa9", False),
    (b"POST /v1/completions HTTP/1.1\r\nContent-Length: 5\r\nContent-Encoding: gzip", False),
    (b"POST /v1/completions HTTP/1.1\r\nContent-Length: 5\r\nConnection: Upgrade", False),
    (b"POST /v1/completions HTTP/1.1\r\nContent-Length: 99999999999", False),  # past max_body
    (b"post /v1/completions HTTP/1.1\r\nContent-Length: 5", False),
    (b"POST /v1/chat/completions HTTP/1.1\r\nContent-Length: 5", False),
])
async def test_the_lane_takes_only_plain_heads(head, taken):
    assert (_parse_head(head, len(head), max_body=1 << 20) is not None) is taken
    assert (_parse_head_py(head, max_body=1 << 20) is not None) is taken  # the reference, without the extension
    assert (_parse_head(bytearray(head + b"\r\n\r\n{}"), len(head), 1 << 20) is not None) is taken  # the lane's buffer


@pytest.mark.parametrize("prompt_text", [b"[4294967296]", b"[99999999999]", b"[9223372036854775807]", b"[1, 4294967295]"])
async def test_a_token_id_past_uint32_is_a_400_naming_the_prompt_either_way(prompt_text):
    """Without a tokenizer no vocabulary bounds an ID; one from 2**32 to 2**63 was a 500 from the
    block hashing (a fresh attacker found it, lane on and off). 4294967295 is still an ID."""
    body = b'{"prompt": ' + prompt_text + b', "max_tokens": 1}'
    request = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)
    async with fake_replica() as replica:
        for lane in (True, False):
            async with edge_router(replica, fast_lane=lane) as (url, _):
                conn = await Conn.open(url)
                await conn.send(request)
                status, _, answer = await conn.answer()
                conn.close()
                if prompt_text == b"[1, 4294967295]":
                    assert status != 500  # the tokenizer's vocabulary (tiny model) refuses it: a 400
                    continue
                assert status == 400 and json.loads(answer)["error"]["param"] == "prompt", answer


@pytest.mark.parametrize("encoding", ["utf-16-le", "utf-16", "utf-32-be", "utf-8-sig"])
async def test_a_body_json_reads_in_another_encoding_goes_to_aiohttp(encoding):
    """``json.loads`` reads UTF-16/32 and BOM bodies: the lane's byte screens would miss a
    ``"stream"`` key in them (a fresh attacker saw a 500 from relay_stream on the lane's request)."""
    body = '{"prompt": [5, 6], "max_tokens": 1}'.encode(encoding)
    request = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)
    async with fake_replica() as replica, edge_router(replica) as (url, _):
        conn = await Conn.open(url)
        await conn.send(request)
        status, head, _ = await conn.answer()
        conn.close()
        assert AIOHTTP_SERVER in head and status != 500


async def test_a_key_the_edge_refuses_is_answered_before_the_body_and_the_lanes_own_endings_are_counted():
    async with fake_replica() as replica, edge_router(replica, api_keys={"k1": None}, body_timeout_s=0.5) as (url, _):
        conn = await Conn.open(url)
        data = completion([5, 6])
        cut = data.index(b"\r\n\r\n") + 6
        await conn.send(data[:cut])  # no key, body still coming: the 401 now, from the edge
        status, head, _ = await conn.answer(timeout=3)
        assert status == 401
        conn.close()
        keyed = completion([5, 6], headers=b"Authorization: Bearer k1\r\n")
        cut = keyed.index(b"\r\n\r\n") + 6
        late = await Conn.open(url)
        await late.send(keyed[:cut])  # a body that never comes: the lane's 408
        assert (await late.answer(timeout=3))[0] == 408
        late.close()
        gone = await Conn.open(url)
        await gone.send(keyed[:cut])
        await asyncio.sleep(0.1)
        gone.close()  # left mid-body: 499
        await asyncio.sleep(0.2)
        async with aiohttp.ClientSession() as http, http.get(url + "/metrics") as r:
            text = await r.text()
        for status in ("401", "408", "499"):
            assert f'rollout_router_requests_total{{endpoint="completions",status="{status}"}} 1.0' in text, status


def _non_reading_client(url: str):
    """A non-blocking socket to ``url`` with a 4 KB receive buffer, for a client that reads nothing."""
    import socket

    parts = urlsplit(url)
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect((parts.hostname, parts.port))
    sock.setblocking(False)
    return sock


async def test_a_client_that_does_not_read_stops_the_lane_taking_its_requests():
    """Pipelined requests from a client that never reads: the lane stops at the transport's
    write buffer (pause_writing) instead of answering, and buffering, without end."""
    async with fake_replica() as replica, edge_router(replica) as (url, _):
        sock, loop = _non_reading_client(url), asyncio.get_running_loop()
        one = completion([5, 6])
        for _ in range(200):
            try:
                await asyncio.wait_for(loop.sock_sendall(sock, one * 50), 0.5)
            except (TimeoutError, OSError):
                break
        served, settled = -1, False
        for _ in range(40):  # the kernel's send buffer takes answers first; then the lane must stop
            await asyncio.sleep(0.5)
            settled, served = len(replica.bodies) == served, len(replica.bodies)
            if settled:
                break
        assert settled, f"still answering a client that reads nothing: {served} answered"
        await asyncio.sleep(1.0)
        assert len(replica.bodies) == served and served < 200 * 50
        sock.close()


async def test_a_client_that_does_not_read_stops_the_lane_reading_its_requests(monkeypatch):
    """The lane stops reading, not only serving, a client that reads none of its answers: what
    it buffers stays within one request (``max_head + max_body``) and a read. It used to read on
    after each answer (``resume_reading`` while the write side was paused) and buffer all a
    client sent: an attacker grew a router by 300 MB on one connection."""
    from router.fastlane import FastLane

    buffered: list[int] = []
    received = FastLane.data_received

    def counting(lane, data):
        received(lane, data)
        buffered.append(len(lane.buffer))

    monkeypatch.setattr(FastLane, "data_received", counting)
    max_body = 65536
    async with fake_replica() as replica, edge_router(replica, max_body_bytes=max_body) as (url, app):
        sock, loop = _non_reading_client(url), asyncio.get_running_loop()
        chunk, sent = completion(list(range(5, 1000)), extra={"prompt_logprobs": 1}) * 64, 0  # ~40 KB answers
        while sent < 96 * 2**20:  # past the kernel's buffers (tcp_rmem can autotune to 32 MB)
            try:
                await asyncio.wait_for(loop.sock_sendall(sock, chunk), 2.0)
            except (TimeoutError, OSError):
                break
            sent += len(chunk)
        sock.close()
    limit = app[keys.CONFIG].router.max_header_bytes + max_body + 2**20  # one request and one read
    assert buffered and max(buffered) < limit, f"the lane buffered {max(buffered) / 2**20:.1f} MB of {sent / 2**20:.0f} sent"


def _line_by_line(head: bytes, max_body: int):
    """The lane's head parser as it was before its regular expressions (the reference)."""
    import re
    try:
        text = head.decode("ascii")
    except UnicodeDecodeError:
        return None
    lines = text.split("\r\n")
    if lines[0] != "POST /v1/completions HTTP/1.1":
        return None
    pairs, length, close, seen = [], None, False, set()
    for line in lines[1:]:
        name, colon, value = line.partition(":")
        if not colon or re.fullmatch(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+", name) is None:
            return None
        value = value.strip(" \t")
        if not value.isprintable():
            return None
        lower = name.lower()
        if lower in ("transfer-encoding", "content-encoding", "expect", "upgrade"):
            return None
        if lower == "content-length":
            if length is not None or not value.isdigit() or len(value) > 12:
                return None
            length = int(value)
        elif lower in ("host", "connection") and lower in seen:
            return None
        if lower == "connection":
            tokens = {t.strip().lower() for t in value.split(",")}
            if "upgrade" in tokens:
                return None
            close = "close" in tokens
        seen.add(lower)
        pairs.append((name, value))
    if length is None or length > max_body or "host" not in seen:
        return None
    return pairs, length, close


_NAMES = st.sampled_from(["Host", "host", "Content-Length", "content-length", "Connection", "X-Session-Id",
                          "Transfer-Encoding", "Expect", "Upgrade", "Content-Type", "A b", "", "X:Y", "Ä", "x\ty"])
_VALUES = st.sampled_from(["x", "12", " 12 ", "\t7\t", "0012", "1e3", "-1", "close", "keep-alive, Close", "Upgrade",
                           "a\tb", "a\x00b", "a\rb", "a\nb", "é", "", "  ", "9" * 13, "100000000"])
_LINES = st.lists(st.tuples(_NAMES, st.sampled_from([":", ": ", ":\t", ":", " :", ""]), _VALUES), max_size=5).flatmap(
    lambda lines: st.permutations(lines + [("Host", ": ", "x"), ("Content-Length", ": ", "12")]))
"""Header lines, a Host and a Content-Length among them (else no head is taken)."""


@settings(max_examples=500, deadline=None)
@given(st.sampled_from(["POST /v1/completions HTTP/1.1", "POST /v1/completions HTTP/1.0", "GET /v1/completions HTTP/1.1",
                        "POST /v1/completions?x=1 HTTP/1.1"]), _LINES, st.sampled_from([b"", b"\r\n", b" ", b"\n"]))
async def test_the_head_parser_judges_as_the_line_by_line_one(request_line, lines, tail):
    head = ("\r\n".join([request_line] + [n + c + v for n, c, v in lines])).encode("utf-8") + tail
    reference = _line_by_line(head, 1 << 20)
    for ours in (_parse_head(head, len(head), 1 << 20), _parse_head_py(head, 1 << 20)):  # the C pass and Python's
        assert (ours is None) == (reference is None), head
        if ours is not None:
            assert (list(ours[0].items()), ours[1], ours[2]) == tuple(reference)


async def test_a_hostile_head_is_judged_without_backtracking():
    """Spaces, tabs and name characters by the ten thousand before a byte that fails the line:
    a pattern that backtracked over them would not return within the suite's time."""
    for bad in (b" " * 20000 + b"\x01", b"\t " * 10000 + b"\x7f", b"a" * 20000 + b" :", b"Host:" + b" " * 20000 + b"\r"):
        head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nX: " + bad
        assert _parse_head(head, len(head), 1 << 20) is None
        assert _parse_head_py(head, 1 << 20) is None


@pytest.mark.parametrize(("status", "line", "length"), [(200, b"HTTP/1.1 200 OK", True), (299, b"HTTP/1.1 299 ", True),
                                                       (430, b"HTTP/1.1 430 ", True), (204, b"HTTP/1.1 204 No Content", False),
                                                       (304, b"HTTP/1.1 304 Not Modified", False)])
async def test_the_lane_frames_any_status_a_replica_answers(status, line, length):
    """A fresh attacker's replica answered 299: the lane's framing raised on the reason phrase and
    the client got an empty reply; a 204 carried ``Content-Length: 0``, which it must not."""
    from router.fastlane import encode_response
    from router.responses import JsonAnswer
    head, _, body = encode_response(JsonAnswer(status, {"X-Rollout-Replica": "r0"}, b"{}"), close=False).partition(b"\r\n\r\n")
    assert head.split(b"\r\n")[0] == line and (b"Content-Length: 2" in head) is length and body == (b"{}" if length else b"")
