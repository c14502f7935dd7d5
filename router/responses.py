"""What every answer says about how it was routed: headers and the ``rollout_router`` annotation.

The version contract (DESIGN rule 6, README "Version contract"): ``weight_version`` is the
version of the weights that computed the answer's last tokens, ``weight_versions`` every version
that computed some, ``kv_versions`` the versions whose KV it reused (``cache_salt`` names it when
salted), ``spans`` where a stream changed version (``router.weights.report``).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from typing import Any

from aiohttp import web

from cache_policy.core import DecisionCore, Job
from router.errors import with_router_param
from router.fastlane import FastRequest, encode_head
from router.lifecycle import Rerun
from router.proxy import UpstreamResult, encode_body
from router.weights.report import version_note

log = logging.getLogger(__name__)


def route_headers(job: Job, *, expose_cached: bool = True) -> dict[str, str]:
    """``X-Rollout-*`` headers: replica, route reason, attempt, weight version, expected cached tokens.

    ``X-Rollout-Attempt``: which placement answered, from 1; each earlier one is a replica the
    request left before anything reached the client (it failed there, or left rotation while the
    request waited in admission)."""
    headers = {"X-Rollout-Replica": str(job.replica_id), "X-Rollout-Route-Reason": job.decision.reason.value,
               "X-Rollout-Attempt": str(len(job.tried) + 1)}
    if expose_cached:
        headers["X-Rollout-Expected-Cached-Tokens"] = str(job.expected_cached_tokens)
    if job.weight_version is not None:
        headers["X-Rollout-Weight-Version"] = str(job.weight_version)
    return headers


def annotation(job: Job, core: DecisionCore, *, expose_cached: bool = True, cached: int | None = None,
               spans: list[dict[str, Any]] | None = None, reruns: int = 0,
               tokens: dict[int, int] | None = None) -> dict[str, Any]:
    """The ``rollout_router`` object of an answer; its version fields (``weight_version``,
    ``weight_versions``, ``kv_versions``, ``hybrid``, ``spans``, ``reruns``) are
    ``router.weights.report.version_note``'s. ``cached``: prompt tokens the replica reused."""
    requested = job.spec.weight_version
    out = {
        "replica": job.replica_id, "route_reason": job.decision.reason.value, "cache_salt": job.salt,
        **version_note(core, job, spans, cached, reruns, tokens), "requested_weight_version": requested,
    }
    if expose_cached:
        out["expected_cached_tokens"] = job.expected_cached_tokens
    return out


class JsonAnswer:
    """A whole JSON answer, framed by whoever serves its request: the fast lane writes it as
    bytes (``router.fastlane.encode_response``, which reads ``status``, ``reason``, ``headers``
    and ``body`` as it reads a ``web.Response``'s), aiohttp as the ``web.Response`` of
    :meth:`response`. No aiohttp response object is built for a request the lane serves.
    ``headers``: the answer's own, ``Content-Type`` included (the framing adds the length)."""

    __slots__ = ("status", "headers", "body", "head")
    reason = None

    def __init__(self, status: int, headers: dict[str, str], body: bytes, *, charset: bool = False,
                 head: bytes | None = None) -> None:
        headers["Content-Type"] = "application/json; charset=utf-8" if charset else "application/json"
        self.status, self.headers, self.body = status, headers, body
        self.head = head
        """Its status line and headers framed ahead (``router.fastlane.encode_head``), or None."""

    def response(self) -> web.Response:
        """As aiohttp's response (``web.Response(text=..., content_type=...)`` adds the charset)."""
        return web.Response(body=self.body, status=self.status, headers=self.headers)


def json_answer(result: UpstreamResult, job: Job, core: DecisionCore, endpoint: str, *,
                expose_cached: bool = True, spans: list[dict[str, Any]] | None = None,
                reruns: int = 0) -> JsonAnswer:
    """A replica's whole answer for the client: annotated on 200, its 4xx with our field names.

    A 200 answer's bytes are kept as the replica wrote them, with the ``rollout_router`` object
    spliced in as their last member (:func:`splice_annotation`): no decode and re-encode of a body
    that prompt logprobs make tens of KB. An answer that is not a strict JSON object, or already
    has a ``rollout_router`` member, is decoded and re-encoded with ours in its place."""
    headers = route_headers(job, expose_cached=expose_cached)
    if result.status == 200:
        note = annotation(job, core, expose_cached=expose_cached, spans=spans, reruns=reruns,
                          cached=result.cached_tokens())
        body = splice_annotation(result, note)
        if body is not None:
            return JsonAnswer(200, headers, body)
    payload = result.payload
    if result.status == 200 and isinstance(payload, dict):
        payload["rollout_router"] = note
        body = encode_body(payload) if result.strict else json.dumps(payload).encode()  # msgspec: NaN -> null
        return JsonAnswer(200, headers, body)
    if 400 <= result.status < 500 and isinstance(payload, dict):
        return JsonAnswer(result.status, headers, json.dumps(with_router_param(payload, endpoint, result.status)).encode(),
                          charset=True)
    return JsonAnswer(result.status, headers, result.raw)


def splice_annotation(result: UpstreamResult, note: dict[str, Any]) -> bytes | None:
    """``result``'s JSON object bytes with ``"rollout_router": note`` added as their last member,
    or None when that cannot be done on the bytes (``UpstreamResult.spliceable``): the body is
    not a strict JSON object in UTF-8, or already has a ``rollout_router`` member (its decoded
    form must then have ours in its place)."""
    if not result.spliceable():
        return None
    return _splice(result.raw, encode_body(note))


def _splice(raw: bytes, note: bytes) -> bytes:
    """A spliceable JSON object's bytes ``raw`` with the member ``"rollout_router": <note>`` last."""
    inner = raw.rstrip()[:-1].rstrip()  # a JSON object ends with its "}"
    sep = b"" if inner.endswith(b"{") else b","
    return b"".join((inner, sep, b'"rollout_router":', note, b"}"))


class AnswerAhead:
    """A fast-lane completion's 200 answer, written to the client as the replica's last byte is
    read, before the request's task wakes (``bench.h2h.ab``: the task's wake-up, its unwinding
    and the annotation cost the answer about 0.2 ms in a served router).

    What the answer says about its routing is fixed once the request is sent (its replica,
    reason, salt, version marks and first span), so :meth:`prepare` builds the headers and the
    ``rollout_router`` object while the replica works, once for each reading of the replica's
    cached tokens that changes it (none reused, or some). :meth:`deliver` (the replica
    connection's ``on_answer``, ``router.upstream``) reads the answer's ``usage``, splices the
    prepared object into its bytes as :func:`json_answer` would, and writes it. It declines
    (False: the task's own path answers, :func:`json_answer`) a status other than 200, a body
    that cannot be spliced, and one ``starts`` refuses (``Lifecycle.answer_starts``: its replica's
    version moved since dispatch; the task then runs the request again).
    After it answered, ``sent`` is the answer and ``result`` the replica's."""

    __slots__ = ("client", "job", "core", "flight", "expose_cached", "reruns", "starts", "sent", "result",
                 "_headers", "_head", "_notes")

    def __init__(self, client: FastRequest, job: Job, core: DecisionCore, flight: Any, *, expose_cached: bool,
                 reruns: int, starts: Callable[[bool], None]) -> None:
        self.client, self.job, self.core, self.flight = client, job, core, flight
        self.expose_cached, self.reruns, self.starts = expose_cached, reruns, starts
        self.sent: JsonAnswer | None = None
        self.result: UpstreamResult | None = None
        self._headers: dict[str, str] | None = None
        self._head: bytes | None = None
        self._notes: tuple[bytes, bytes] | None = None

    def prepare(self) -> None:
        """Build the headers (framed as the lane writes them) and both ``rollout_router`` objects
        (idempotent)."""
        if self._notes is not None:
            return
        job, spans = self.job, self.flight.spans
        self._headers = route_headers(job, expose_cached=self.expose_cached)
        self._head = encode_head(JsonAnswer(200, dict(self._headers), b""))
        self._notes = tuple(encode_body(annotation(job, self.core, expose_cached=self.expose_cached, spans=spans,
                                                   reruns=self.reruns, cached=cached)) for cached in (None, 0))

    def deliver(self, status: int, raw: bytes) -> bool:
        """Answer the client with the replica's whole answer (``status``, ``raw``) now; False when
        this answer is left to the task (class docstring)."""
        if status != 200 or self.client.answered or b'"abort"' in raw:
            return False  # the task judges it (an aborted answer runs again: Lifecycle.aborted)
        result = UpstreamResult(status, raw)
        if not result.spliceable():
            return False
        try:
            self.starts(False)  # never mixed; from here on the client has it: an update leaves it alone
        except Rerun:
            return False  # the task's own check runs it again
        self.prepare()
        body = _splice(raw, self._notes[result.cached_tokens() == 0])
        self.sent, self.result = JsonAnswer(200, dict(self._headers), body, head=self._head), result
        try:
            self.client.answer(self.sent)
        except ConnectionResetError:
            log.info("client left %s before its answer was written", self.client.path)
        return True


async def send_now(client: web.Request, resp: web.Response | JsonAnswer) -> web.StreamResponse | JsonAnswer:
    """Write the whole of ``resp`` to ``client`` now, so the client has its answer while the
    router still releases the job, counts and pumps the queue (aiohttp's own send after the
    handler returns is then a no-op). Returns what the handler returns: ``resp`` on the fast
    lane, the ``web.Response`` aiohttp sent otherwise. A client already gone is no error of the
    replica's: logged, and the handler returns as if it had been sent."""
    if isinstance(client, FastRequest):  # served by router.fastlane: it frames the answer
        try:
            client.answer(resp)
        except ConnectionResetError:
            log.info("client left %s before its answer was written", client.path)
        return resp
    if isinstance(resp, JsonAnswer):
        resp = resp.response()
    try:
        await resp.prepare(client)
        await resp.write_eof()
    except ConnectionResetError:
        log.info("client left %s before its answer was written", client.path)
    return resp
