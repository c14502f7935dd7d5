"""The hardened edge (issue 11): every hostile input named in the issue is a 4xx naming the field,
never a 5xx; replica refusals keep a field; limits apply before any work. Real HTTP on loopback,
a fake replica (tests/router/edge_fixtures.py) where a replica is needed at all."""

from __future__ import annotations

import asyncio
import gzip
import json
import zlib
from urllib.parse import urlsplit

import aiohttp
import pytest

from tests.router.edge_fixtures import VLLM_BODY_PARAM, VLLM_NULL_PARAM, edge_router, fake_replica, post

pytestmark = pytest.mark.asyncio(loop_scope="session")


async def raw_http(url: str, request: bytes, read_timeout: float = 10.0) -> bytes:
    """Send ``request`` bytes as they are; return the one answer (head and Content-Length body),
    or ``b""`` when the server closes the connection without answering."""
    parts = urlsplit(url)
    reader, writer = await asyncio.open_connection(parts.hostname, parts.port)
    writer.write(request)
    await writer.drain()
    try:
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), read_timeout)
        length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                       if line.lower().startswith(b"content-length:")), 0)
        return head + await asyncio.wait_for(reader.readexactly(length), read_timeout)
    except asyncio.IncompleteReadError as exc:
        return exc.partial
    finally:
        writer.close()


def status_and_body(answer: bytes) -> tuple[int, dict]:
    head, _, body = answer.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(body or b"{}")


async def test_hostile_inputs_are_400_naming_the_field():
    async with fake_replica() as replica, edge_router(replica) as (url, _):
        cases = [
            ({"prompt": [5, 6]}, {"X-Weight-Version": "²"}, "weight_version"),
            ({"prompt": [5, 6], "session_id": "s" * 300}, {}, "session_id"),
            ({"prompt": [5, 6], "group_id": "g\x00"}, {}, "group_id"),
            ({"prompt": [5, 6]}, {"X-Session-Id": ""}, "session_id"),
            ({"prompt": [5, 6], "end_session": True}, {}, "end_session"),  # no session id to end
            ({"prompt": [5, 6], "n": 65}, {}, "n"),
            ({"prompt": [5, 6], "max_tokens": 10**9}, {}, "max_tokens"),
            ({"prompt": [5] * 16000, "max_tokens": 385}, {}, "max_tokens"),  # 16,000 + 385 > 16,384
            ({"prompt": "x" * (16 * 16384 + 1)}, {}, "prompt"),
            ({"prompt": [5, 6], "truncate_prompt_tokens": 1}, {}, "truncate_prompt_tokens"),
            ({"messages": [{"role": "user", "content": "hi"}], "tools": []}, {}, "tools"),
            ({"messages": [{"role": "user", "content": "hi"}], "continue_final_message": True}, {},
             "continue_final_message"),
            ({"messages": [{"role": "user", "content": "hi"}], "chat_template_kwargs": {"tokenize": True}}, {},
             "chat_template_kwargs"),
            ({"messages": [{"role": "user", "content": "hi"}], "add_special_tokens": "yes"}, {}, "add_special_tokens"),
            ({"context": [5, 6], "responses": [[7]] * 65}, {}, "responses"),
            ({"context": [5] * 16380, "responses": [[7] * 4]}, {}, "responses[0]"),
        ]
        for body, headers, param in cases:
            path = ("/v1/score" if "context" in body else
                    "/v1/chat/completions" if "messages" in body else "/v1/completions")
            status, answer = await post(url, path, json=body, headers=headers)
            assert (status, answer["error"]["param"]) == (400, param), (param, answer)
        assert replica.bodies == []  # nothing reached the replica


async def test_deep_nesting_and_lone_surrogates_are_400_not_500():
    async with fake_replica() as replica, edge_router(replica) as (url, _):
        deep = b'{"prompt": [1], "x": ' + b"[" * 100 + b"]" * 100 + b"}"
        status, answer = await post(url, "/v1/completions", data=deep)
        assert status == 400 and answer["error"]["param"] == "x" + "[0]" * 31, answer  # the 32nd level
        for depth in (1000, 100_000):  # past json's own recursion limit
            status, answer = await post(url, "/v1/completions", data=b"[" * depth + b"]" * depth)
            assert (status, answer["error"]["param"]) == (400, "body")
        for raw, param in ((b'{"prompt": "a\\ud800b"}', "prompt"),
                           (b'{"messages": [{"role": "user", "content": "\\udfff"}]}', "messages[0].content"),
                           (b'{"prompt": [1], "max_tokens": NaN}', "body"),
                           (b'{"prompt": [1], "n": ' + b"9" * 5000 + b"}", "n"),
                           (b'{"prompt": [1, -' + b"9" * 5000 + b"]}", "prompt[1]")):
            path = "/v1/chat/completions" if b"messages" in raw else "/v1/completions"
            status, answer = await post(url, path, data=raw)
            assert (status, answer["error"]["param"]) == (400, param), answer
            assert "sys." not in answer["error"]["message"], answer  # no advice meant for a server
        status, answer = await post(url, "/v1/completions", data=b'{"prompt": [1], "n": ' + b"9" * 5000 + b"}")
        assert answer["error"]["message"] == "'n' is an integer too large (5000 digits)"


async def test_a_bad_chat_content_part_is_a_short_400_naming_it():
    async with fake_replica() as replica, edge_router(replica) as (url, _):
        for part, param, says in (({"type": "text"}, "messages[0].content[0].text", "is required"),
                                  ({"type": "image_url", "image_url": {"url": "x"}}, "messages[0].content[0].type",
                                   "only text content parts"),
                                  ({"text": "hi"}, "messages[0].content[0].type", "is required"),
                                  ("hi", "messages[0].content[0]", "must be an object")):
            for path, extra in (("/v1/chat/completions", {}), ("/v1/score", {"responses": [[7]]})):
                messages = [{"role": "user", "content": [part]}]
                status, answer = await post(url, path, json={"messages": messages, **extra})
                assert (status, answer["error"]["param"]) == (400, param), answer
                assert says in answer["error"]["message"] and len(answer["error"]["message"]) < 100, answer
        assert replica.bodies == []


async def test_a_4000_digit_number_is_not_echoed_whole():
    async with fake_replica() as replica, edge_router(replica) as (url, _):
        huge = b"9" * 4000
        for raw, param in ((b'{"prompt": [1], "max_tokens": ' + huge + b"}", "max_tokens"),
                           (b'{"prompt": [1, ' + huge + b"]}", "prompt")):  # the vocabulary check
            status, answer = await post(url, "/v1/completions", data=raw)
            assert (status, answer["error"]["param"]) == (400, param), answer
            assert len(answer["error"]["message"]) < 300 and "9" * 100 + "..." in answer["error"]["message"]


async def test_non_ascii_bearer_tokens_are_401_on_admin_and_api():
    async with fake_replica() as replica, edge_router(replica, admin_token="secret", tenant_header=True,
                                                      api_keys={"k-a": "team-a", "k-b": None}) as (url, _):
        host = urlsplit(url).netloc.encode()
        for path, token in ((b"/admin/weights", "sécret".encode()), (b"/admin/weights", b"\xff\xfe"),
                            (b"/v1/models", b"\xe2\x82\xac"), (b"/v1/models", b"k-a\x80")):
            answer = await raw_http(url, b"GET " + path + b" HTTP/1.1\r\nHost: " + host +
                                    b"\r\nAuthorization: Bearer " + token + b"\r\nConnection: close\r\n\r\n")
            assert status_and_body(answer)[0] == 401, (path, token, answer[:200])
        ok, _ = await post(url, "/v1/completions", json={"prompt": [5, 6]}, headers={"Authorization": "Bearer k-b"})
        assert ok == 200
        status, answer = await post(url, "/v1/completions", json={"prompt": [5, 6]},
                                    headers={"Authorization": "Bearer k-a", "X-Tenant-Id": "team-b"})
        assert (status, answer["error"]["param"]) == (403, "tenant")
        status, _ = await post(url, "/v1/completions", json={"prompt": [5, 6]},
                               headers={"Authorization": "Bearer k-a", "X-Tenant-Id": "team-a"})
        assert status == 200 and "t=team-a" in replica.bodies[-1]["cache_salt"]


async def test_tenants_get_their_own_cache_salt():
    async with fake_replica() as replica, edge_router(replica, api_keys={"k-a": "team-a", "k-b": "team-b"}) as (url, _):
        for key in ("k-a", "k-b", "k-a"):
            status, _ = await post(url, "/v1/completions", json={"prompt": list(range(8, 80))},
                                   headers={"Authorization": f"Bearer {key}"})
            assert status == 200
        salts = [b.get("cache_salt") for b in replica.bodies]
        assert salts[0] == salts[2] != salts[1] and "team-a" in salts[0] and "team-b" in salts[1]


async def test_a_client_cache_salt_is_400_not_replaced_by_the_routers():
    async with fake_replica() as replica, edge_router(replica) as (url, _):
        for path, body in (("/v1/completions", {"prompt": [5, 6]}),
                           ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
                           ("/v1/score", {"context": [5, 6], "responses": [[7]]})):
            status, answer = await post(url, path, json={**body, "cache_salt": "mine"})
            assert (status, answer["error"]["param"]) == (400, "cache_salt"), answer
            assert "per weight version" in answer["error"]["message"] and "tenant" in answer["error"]["message"]
        assert replica.bodies == []


async def test_tenant_header_only_when_enabled():
    async with fake_replica() as replica, edge_router(replica) as (url, _):
        status, answer = await post(url, "/v1/completions", json={"prompt": [5]}, headers={"X-Tenant-Id": "t"})
        assert (status, answer["error"]["param"]) == (400, "tenant")
    async with fake_replica() as replica, edge_router(replica, tenant_header=True) as (url, _):
        assert (await post(url, "/v1/completions", json={"prompt": [5]}, headers={"X-Tenant-Id": "t"}))[0] == 200
        assert "t=t" in replica.bodies[0]["cache_salt"]


async def test_a_replica_refusal_without_param_names_the_field():
    async with fake_replica() as replica, edge_router(replica) as (url, _):
        status, answer = await post(url, "/v1/completions", json={"prompt": [5, 6], "temperature": -1})
        assert status == 400 and answer["error"]["param"] == "temperature"
        assert answer["error"]["message"] == VLLM_NULL_PARAM["message"]


async def test_a_replica_param_with_a_location_prefix_names_our_field():
    async with fake_replica() as replica, edge_router(replica) as (url, _):
        status, answer = await post(url, "/v1/completions", json={"prompt": [5, 6], "seed": "x"})
        assert (status, answer["error"]["param"]) == (400, "seed"), answer  # vLLM said "body.seed"
        # vLLM's pydantic dump, made one readable clause naming our field
        assert answer["error"]["message"] == ("seed: Input should be a valid integer, unable to parse string as an "
                                              "integer (got 'x')"), answer


async def test_body_size_is_checked_before_reading_and_while_streaming_it():
    async with fake_replica() as replica, edge_router(replica, max_body_bytes=1000) as (url, _):
        status, answer = await post(url, "/v1/completions", json={"prompt": "x" * 2000})
        assert (status, answer["error"]["param"]) == (413, "body")

        async def chunks():
            for _ in range(4):
                yield b" " * 400
        status, answer = await post(url, "/v1/completions", data=chunks())  # chunked: no Content-Length
        assert (status, answer["error"]["param"]) == (413, "body")


async def post_encoded(url: str, data: bytes, encoding: str) -> tuple[int, dict, str | None]:
    """POST ``data`` to /v1/completions as sent, under ``Content-Encoding: encoding``:
    ``(status, JSON body, Accept-Encoding header)``."""
    async with aiohttp.ClientSession() as http, http.post(url + "/v1/completions", data=data, headers={
            "Content-Encoding": encoding, "Content-Type": "application/json"}) as r:
        return r.status, await r.json(content_type=None), r.headers.get("Accept-Encoding")


async def test_content_encoding_is_undone_or_refused_as_json_never_500():
    body = json.dumps({"prompt": [5, 6]}).encode()
    async with fake_replica() as replica, edge_router(replica, max_body_bytes=1000) as (url, _):
        for data, encoding in ((gzip.compress(body), "gzip"), (gzip.compress(body[:4]) + gzip.compress(body[4:]), "x-gzip"),
                               (zlib.compress(body), "deflate"), (zlib.compress(body)[2:-4], "deflate"),  # raw deflate
                               (body, "identity")):
            assert (await post_encoded(url, data, encoding))[0] == 200, encoding
        assert [b["prompt"] for b in replica.bodies] == [[5, 6]] * 5
        for data, encoding in ((body, "gzip"), (body, "deflate"), (gzip.compress(body)[:-4], "gzip"),
                               (zlib.compress(body) + b"x", "deflate")):
            status, answer, _ = await post_encoded(url, data, encoding)
            assert (status, answer["error"]["param"]) == (400, "Content-Encoding"), answer
        for encoding in ("br", "zstd", "compress", "gzip, gzip"):
            status, answer, accepted = await post_encoded(url, gzip.compress(body), encoding)
            assert (status, answer["error"]["param"], accepted) == (415, "Content-Encoding", "gzip, deflate"), answer
            assert "gzip, deflate" in answer["error"]["message"]
        status, answer, _ = await post_encoded(url, gzip.compress(b" " * 2000 + body), "gzip")  # 1000 bytes past
        assert (status, answer["error"]["param"]) == (413, "body"), answer
        async with aiohttp.ClientSession() as http, http.get(url + "/metrics") as r:
            counted = {line.split('status="')[1].split('"')[0] for line in (await r.text()).splitlines()
                       if line.startswith('rollout_router_requests_total{endpoint="completions"')}
        assert counted == {"200", "400", "413", "415"}, counted
        assert len(replica.bodies) == 5


async def test_a_body_the_server_failed_to_inflate_is_a_400():
    """Under a server that inflates bodies itself (aiohttp's default, as test servers run the app)."""
    from aiohttp.test_utils import TestClient, TestServer

    from replicas.replica_set import ReplicaEndpoint
    from router.app import create_app
    from router.config import AppConfig
    from tests.router.edge_fixtures import tiny_tokenizer

    async with fake_replica() as replica:
        endpoint = ReplicaEndpoint("replica-0", replica.url, 32, 1000, "tiny-llama")
        app = create_app(AppConfig().replace(router={"scrape_interval_s": 0}), [endpoint], tiny_tokenizer())
        async with TestClient(TestServer(app)) as client:
            for data, status, param in ((gzip.compress(b'{"prompt": [5]}'), 200, None),  # aiohttp then
                                        (b'{"prompt": [5]}', 400, "Content-Encoding")):  # closes the connection
                r = await client.post("/v1/completions", data=data, headers={"Content-Encoding": "gzip"})
                answer = await r.json()
                assert (r.status, answer.get("error", {}).get("param")) == (status, param), answer


async def test_slow_body_gets_408_and_slow_headers_are_cut_off():
    async with fake_replica() as replica, edge_router(replica, body_timeout_s=0.3, header_timeout_s=0.5) as (url, _):
        host = urlsplit(url).netloc.encode()
        started = asyncio.get_running_loop().time()
        answer = await raw_http(url, b"POST /v1/completions HTTP/1.1\r\nHost: " + host +
                                b"\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{\"pro")
        status, body = status_and_body(answer)
        assert (status, body["error"]["param"]) == (408, "body")
        answer = await raw_http(url, b"POST /v1/completions HTTP/1.1\r\nHost: " + host + b"\r\nX-Slow")
        assert answer == b""  # closed without a request ever being handled
        assert asyncio.get_running_loop().time() - started < 5


async def test_oversized_header_is_a_4xx():
    async with fake_replica() as replica, edge_router(replica, max_header_bytes=1024) as (url, _):
        host = urlsplit(url).netloc.encode()
        answer = await raw_http(url, b"GET /v1/models HTTP/1.1\r\nHost: " + host + b"\r\nX-Big: " + b"a" * 4096
                                + b"\r\nConnection: close\r\n\r\n")
        assert 400 <= int(answer.split()[1]) < 500


async def test_openapi_document_lists_every_endpoint_with_its_schema():
    async with fake_replica() as replica, edge_router(replica) as (url, app):
        import aiohttp

        async with aiohttp.ClientSession() as http, http.get(url + "/openapi.json") as r:
            doc = await r.json()
        served = {(route.resource.canonical, route.method.lower()) for route in app.router.routes()
                  if not route.resource.canonical.startswith("/admin/") and route.method != "HEAD"}
        assert {(path, method) for path, ops in doc["paths"].items() for method in ops} == served
        assert {"/v1/completions", "/v1/chat/completions", "/v1/score", "/v1/models", "/health"} <= set(doc["paths"])
        schemas = doc["components"]["schemas"]
        assert "prompt" in schemas["CompletionRequest"]["required"]
        assert schemas["ScoreBody"]["properties"]["top_logprobs"]["maximum"] == 20
        ref = doc["paths"]["/v1/chat/completions"]["post"]["requestBody"]["content"]["application/json"]["schema"]
        assert ref == {"$ref": "#/components/schemas/ChatRequest"}


async def test_a_replica_event_is_logged_and_moves_its_health_gauge(caplog):
    # a supervisor restart was visible only in /health (a user's report): the router logs each event
    from replicas.events import ReplicaEvent
    from router import keys
    from router.fleet import on_replica_event

    async with fake_replica() as replica, edge_router(replica) as (_, app):
        rid = next(iter(app[keys.CORE].replicas))
        endpoint = app[keys.POOL].get(rid).endpoint
        gauge = app[keys.METRICS].healthy.labels(rid)
        with caplog.at_level("INFO", logger="router.fleet"):
            on_replica_event(app, ReplicaEvent("unhealthy", rid, endpoint, reason="3 failed health checks"))
            assert gauge._value.get() == 0 and not app[keys.CORE].replicas[rid].healthy
            on_replica_event(app, ReplicaEvent("restarted", rid, endpoint))
            assert gauge._value.get() == 1 and app[keys.CORE].replicas[rid].healthy
        lines = [(r.levelname, r.getMessage()) for r in caplog.records if r.name == "router.fleet"]
        assert lines == [("WARNING", f"replica {rid} unhealthy: 3 failed health checks"),
                         ("INFO", f"replica {rid} restarted at {endpoint.base_url}")]


@pytest.mark.parametrize("lane", [True, False])
async def test_a_header_sent_twice_with_different_values_is_refused_naming_it(lane):
    """Two ``X-Session-Id`` (or ``X-Group-Id``, ``X-Weight-Version``, ``X-Session-End``,
    ``X-Tenant-Id``, ``Authorization``) with different values: which one to route or bill by would
    be a guess (the first was used silently). The same value twice is one value. Lane and
    aiohttp alike."""
    async with fake_replica() as replica, edge_router(replica, fast_lane=lane, tenant_header=True,
                                                      api_keys={"k-a": "team-a", "k-b": None}) as (url, _):
        host = urlsplit(url).netloc.encode()
        body = b'{"prompt": [5, 6, 7], "max_tokens": 1}'

        def request(*headers: bytes) -> bytes:
            return (b"POST /v1/completions HTTP/1.1\r\nHost: " + host + b"\r\nContent-Type: application/json\r\n"
                    + b"".join(h + b"\r\n" for h in headers) + b"Content-Length: %d\r\nConnection: close\r\n\r\n" % len(body)
                    + body)

        key = b"Authorization: Bearer k-b"
        for name, param in ((b"X-Session-Id", "session_id"), (b"X-Group-Id", "group_id"),
                            (b"X-Weight-Version", "weight_version"), (b"X-Session-End", "end_session"),
                            (b"X-Tenant-Id", "tenant")):
            status, answer = status_and_body(await raw_http(url, request(key, name + b": 1", name.lower() + b": 2")))
            assert (status, answer["error"]["param"]) == (400, param), (name, answer)
            assert b"once" in json.dumps(answer).encode()
        sent = len(replica.bodies)
        status, _ = status_and_body(await raw_http(url, request(key, b"X-Session-Id: s", b"x-session-id: s")))
        assert status == 200 and len(replica.bodies) == sent + 1  # the same value twice
        status, answer = status_and_body(await raw_http(url, request(key, b"Authorization: Bearer k-a")))
        assert (status, answer["error"]["param"]) == (401, "authorization")
        assert b"k-a" not in json.dumps(answer).encode()  # no key echoed back
        assert len(replica.bodies) == sent + 1


async def test_a_score_past_the_model_length_says_how_many_response_tokens_fit():
    # context + response == max_model_len is refused for the one token scoring generates; the
    # message said the two "pass" max_model_len, which they do not (a fresh user's note)
    async with fake_replica() as replica, edge_router(replica) as (url, _):
        status, answer = await post(url, "/v1/score", json={"context": [5] * 16380, "responses": [[7] * 4]})
    assert (status, answer["error"]["param"]) == (400, "responses[0]"), answer
    message = answer["error"]["message"]
    assert "16380" in message and "16384" in message and "at most 3 response tokens fit" in message, message
