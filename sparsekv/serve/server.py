"""An OpenAI-compatible HTTP server over the serving engine (``sparsekv serve``; ``pip install 'sparsekv[serve]'``).

Endpoints: ``POST /v1/completions`` and ``POST /v1/chat/completions`` (the tokenizer's chat template), streamed as
server-sent events (``data: {...}`` chunks, then ``data: [DONE]``) or answered whole, with ``usage``;
``GET /v1/models``, ``GET /health``, and ``GET /metrics`` (Prometheus text format).

Requests, as data::

    JSON body -> pydantic model (400 naming the field) -> prompt token ids (text, token ids, or the chat template)
              -> engine.submit (429 queue full, 400 over a limit) -> events from the engine's thread
              -> incremental detokenization -> stop strings (cancel the request) -> SSE chunks or one JSON answer

One background thread (``EngineLoop``) owns the engine: it calls ``step()`` while there is work, hands each event
to the asyncio queue of its request, and snapshots ``metrics()``. A client that disconnects cancels its request,
which frees its rows. SIGTERM stops accepting (503), lets the running requests finish, then stops.

FastAPI (on Starlette, served by uvicorn) is the framework: the Python ecosystem's maintained standard for typed JSON
APIs, whose pydantic validation names the offending field, whose streaming responses carry server-sent events, and
whose server (uvicorn) drains open connections on SIGTERM.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import logging
import signal
import threading
import time
import traceback
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from typing import Annotated, Literal

import torch
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, StrictInt, field_validator

from ..engine import IncrementalText, Sampling
from ..errors import ConfigError
from . import QueueFull
from . import Request as EngineRequest

log = logging.getLogger("sparsekv.serve")

# Seconds over which /metrics averages generated tokens per second.
RATE_WINDOW = 10.0
# Seconds the engine thread sleeps between looks when idle (it wakes at once on a submit or cancel).
IDLE_WAIT = 0.5
# Seconds between checks, while a whole (non-streamed) answer is awaited, of whether its client is still there.
DISCONNECT_POLL = 1.0


class APIError(Exception):
    """An error answered as OpenAI's ``{"error": {"message", "type", "param", "code"}}`` with ``status``."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status)


# ---------------------------------------------------------------------------------------------------- requests


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False


# OpenAI fields this server cannot honour, with the values it accepts for them (their defaults): anything else is
# refused with a 400 naming the field rather than answered as if it had not been asked.
UNSUPPORTED = {"n": (None, 1), "best_of": (None, 1), "echo": (None, False), "logprobs": (None, False),
               "top_logprobs": (None, 0), "presence_penalty": (None, 0), "frequency_penalty": (None, 0),
               "logit_bias": (None, {}), "suffix": (None, ""), "tools": (None, []),
               "response_format": (None, {"type": "text"})}


class _Generation(BaseModel):
    """Fields both endpoints share. Other fields are accepted and ignored, except those of ``UNSUPPORTED`` at a
    value other than their default, which ``check_supported`` refuses."""

    model_config = ConfigDict(extra="allow")

    model: str
    max_tokens: Annotated[StrictInt, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(ge=0, le=2)] = 1.0
    top_p: Annotated[float, Field(gt=0, le=1)] = 1.0
    stop: Annotated[list[Annotated[str, Field(min_length=1)]], Field(max_length=4)] = []
    seed: StrictInt | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    # Not OpenAI's: generate through the model's end-of-sequence tokens (exact output lengths for benchmarks).
    ignore_eos: bool = False

    @field_validator("stop", mode="before")
    @classmethod
    def _stops(cls, value):
        """OpenAI's forms: one string, a list of up to 4, or null."""
        return [value] if isinstance(value, str) else [] if value is None else value

    def check_supported(self) -> None:
        """Refuses a field of ``UNSUPPORTED`` (kept among the extra fields) at a value this server cannot honour."""
        for name, value in (self.model_extra or {}).items():
            if name in UNSUPPORTED and value not in UNSUPPORTED[name]:
                shown = " or ".join(json.dumps(a) for a in UNSUPPORTED[name])
                raise APIError(400, f"{name}: this server supports only {shown}, got {value!r}", param=name,
                               code="unsupported_value")


class CompletionRequest(_Generation):
    prompt: str | Annotated[list[Annotated[StrictInt, Field(ge=0)]], Field(min_length=1)]


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]


class ChatRequest(_Generation):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: Annotated[StrictInt, Field(ge=1)] | None = None


def _validation_error(err: RequestValidationError) -> APIError:
    """A 400 naming the first offending field (its top-level name as ``param``, the full location in the text)."""
    first = err.errors()[0]
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    if first.get("type") == "json_invalid":
        return APIError(400, f"the request body is not valid JSON: {first.get('ctx', {}).get('error', '')}".rstrip(),
                        code="invalid_json")
    if not loc:
        return APIError(400, f"the request body must be a JSON object: {first.get('msg')}")
    return APIError(400, f"{'.'.join(loc)}: {first.get('msg')} (got {first.get('input')!r})", param=loc[0],
                    code="invalid_value")


# ------------------------------------------------------------------------------------------------ text pieces


class StopStrings:
    """Cuts a text stream at the first of ``stops``; holds back the last ``longest - 1`` characters, which could be
    the start of one, until the text after them shows they are not."""

    def __init__(self, stops: list[str]):
        self.stops = stops
        self.hold = max((len(s) for s in stops), default=1) - 1
        self.pending = ""

    def feed(self, text: str, final: bool) -> tuple[str, bool]:
        """(the text safe to give out, whether a stop string was reached: then the text ends before it)."""
        buf = self.pending + text
        found = [i for i in (buf.find(s) for s in self.stops) if i >= 0]
        if found:
            self.pending = ""
            return buf[:min(found)], True
        cut = len(buf) if final else max(len(buf) - self.hold, 0)
        self.pending = buf[cut:]
        return buf[:cut], False


@dataclass
class Piece:
    """A part of an answer: new text, and at the end the finish reason and token counts."""

    text: str
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0

    def usage(self) -> dict:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "total_tokens": self.prompt_tokens + self.completion_tokens}


# ------------------------------------------------------------------------------------------- the engine thread


class _Subscriber:
    """A request's asyncio queue, fed from the engine thread."""

    def __init__(self):
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue = asyncio.Queue()

    def push(self, item) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, item)


class EngineLoop:
    """Drives ``engine.step()`` in one background thread while there is work, and waits for a submit or cancel
    otherwise. Hands each request's events to its subscriber; keeps the latest ``engine.metrics()`` and the recent
    (time, generated tokens) samples for the token rate. A failing step fails every open request and stops the
    loop (``error`` holds it; ``/health`` then answers 503)."""

    def __init__(self, engine):
        self.engine = engine
        self.lock = threading.Lock()  # submit + subscribe are one step for the dispatcher
        self.wake = threading.Event()
        self.subscribers: dict[int, _Subscriber] = {}
        self.error: BaseException | None = None
        self.stopping = False
        self.metrics = engine.metrics()
        self.peak_running = 0  # the most requests decoding at once, seen after every step
        self.samples: collections.deque = collections.deque()
        self.thread = threading.Thread(target=self._run, name="sparsekv-engine", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        """Finishes the work the engine holds, then ends the thread."""
        self.stopping = True
        self.wake.set()
        self.thread.join()

    def submit(self, request: EngineRequest) -> tuple[int, _Subscriber]:
        subscriber = _Subscriber()
        with self.lock:  # the engine thread sets ``error`` under it, so no request is left waiting after a failure
            if self.error is not None:
                raise APIError(503, f"the engine failed and serves no more requests: {self.error!r}",
                               "server_error")
            rid = self.engine.submit(request)
            self.subscribers[rid] = subscriber
        self.wake.set()
        return rid, subscriber

    def cancel(self, rid: int) -> None:
        self.engine.cancel(rid)
        self.wake.set()

    def token_rate(self) -> float:
        """Generated tokens per second over the last ``RATE_WINDOW`` seconds."""
        now = time.monotonic()
        recent = [s for s in list(self.samples) if s[0] >= now - RATE_WINDOW]
        if len(recent) < 2:
            return 0.0
        return (recent[-1][1] - recent[0][1]) / max(now - recent[0][0], 1e-9)

    def _sample(self) -> None:
        self.metrics = self.engine.metrics()
        self.peak_running = max(self.peak_running, self.metrics["running"])
        now = time.monotonic()
        self.samples.append((now, self.metrics["generated_tokens"]))
        while self.samples and self.samples[0][0] < now - 2 * RATE_WINDOW:
            self.samples.popleft()

    def _run(self) -> None:
        device = self.engine.runner.device
        if device.type == "cuda":  # the current device is per thread; kernels launch on it
            torch.cuda.set_device(device)
        while True:
            self.wake.clear()
            try:
                if self.engine.has_work():
                    events = self.engine.step()
                    self._sample()
                    with self.lock:
                        for event in events:
                            subscriber = (self.subscribers.pop if event.finished else self.subscribers.get)(
                                event.request_id, None)
                            if subscriber is not None:
                                subscriber.push(event)
                    continue
                self._sample()
            except Exception as err:  # the engine's state is unknown: fail every open request, serve no more
                log.error("engine step failed:\n%s", traceback.format_exc())
                with self.lock:
                    self.error = err
                    for subscriber in self.subscribers.values():
                        subscriber.push(err)
                    self.subscribers.clear()
                return
            if self.stopping:
                return
            self.wake.wait(IDLE_WAIT)


# ---------------------------------------------------------------------------------------------------- the app


class Service:
    """What the endpoints share: the engine loop, the tokenizer, the served model's name, and whether the server
    is draining (SIGTERM: new requests get 503)."""

    def __init__(self, engine, tokenizer, model_name: str, chat_template: str | None = None):
        self.loop = EngineLoop(engine)
        self.engine, self.tokenizer, self.model_name = engine, tokenizer, model_name
        self.chat_template = chat_template or getattr(tokenizer, "chat_template", None)
        self.max_context, self.max_new_tokens = engine.runner.max_context, engine.runner.max_new_tokens
        self.draining = False
        self.created = int(time.time())

    def check_model(self, name: str) -> None:
        if name != self.model_name:
            raise APIError(404, f"model {name!r} is not served here; this server serves {self.model_name!r}",
                           param="model", code="model_not_found")

    def completion_prompt(self, body: CompletionRequest) -> list[int]:
        """The prompt's token ids (ids given are checked against the vocabulary by the engine)."""
        if isinstance(body.prompt, list):
            return body.prompt
        ids = self.tokenizer(body.prompt).input_ids
        if not ids:
            raise APIError(400, "prompt: the prompt has no tokens", param="prompt", code="invalid_value")
        return ids

    def chat_prompt(self, body: ChatRequest) -> list[int]:
        if not self.chat_template:
            raise APIError(400, f"model {self.model_name!r} has no chat template: use /v1/completions, or start the "
                                f"server with --chat-template FILE", param="messages", code="no_chat_template")
        messages = [{"role": m.role, "content": m.content if isinstance(m.content, str)
                     else "".join(p.text for p in m.content)} for m in body.messages]
        from jinja2 import TemplateError

        try:
            text = self.tokenizer.apply_chat_template(messages, chat_template=self.chat_template, tokenize=False,
                                                      add_generation_prompt=True)
        except TemplateError as err:  # e.g. a template that refuses a role or an order of roles
            raise APIError(400, f"messages: the chat template refused them: {err}", param="messages",
                           code="invalid_value") from None
        return self.tokenizer(text, add_special_tokens=False).input_ids

    def submit(self, body: _Generation, prompt: list[int], max_tokens: int | None) -> tuple[int, _Subscriber]:
        if self.draining:
            raise APIError(503, "the server is shutting down", "server_error", code="shutting_down")
        if max_tokens is None:  # a chat answer may take what the limits leave
            max_tokens = max(min(self.max_context - len(prompt), self.max_new_tokens), 1)
        stops = () if body.ignore_eos else tuple(self.engine.stop_tokens_default)
        try:
            sampling = Sampling(temperature=body.temperature, top_p=body.top_p)
            request = EngineRequest(prompt=prompt, max_tokens=max_tokens, sampling=sampling, stop_tokens=stops,
                                    seed=body.seed)
            return self.loop.submit(request)
        except QueueFull as err:
            raise APIError(429, f"the queue is full ({err}); retry later", "rate_limit_error",
                           code="queue_full") from None
        except ConfigError as err:  # RequestError (a limit, a token id) or Sampling's refusal
            raise APIError(400, str(err), param=err.field, code="invalid_value") from None

    async def pieces(self, rid: int, subscriber: _Subscriber, stops: list[str],
                     http: Request | None) -> AsyncIterator[Piece]:
        """The answer's text as it is generated, ending with a piece that has the finish reason and the counts.
        Leaving before the end (a disconnect) cancels the request. ``http``: watched for a disconnect while
        waiting (for answers given whole; a stream notices when a write fails)."""
        text_of, stopper = IncrementalText(self.tokenizer), StopStrings(stops)
        done = False
        watch = _Watch(http)
        try:
            while True:
                event = await watch.next(subscriber.queue)
                if isinstance(event, BaseException):
                    raise APIError(500, f"the engine failed: {event!r}", "server_error")
                text, hit = stopper.feed(text_of.push(event.tokens), event.finished)
                if hit or event.finished:
                    done = True
                    if hit and not event.finished:
                        self.loop.cancel(rid)
                    yield Piece(text, "stop" if hit else event.finish_reason, event.prompt_tokens,
                                event.completion_tokens)
                    return
                if text:
                    yield Piece(text)
        finally:
            if not done:
                self.loop.cancel(rid)


class _Watch:
    """Takes a request's events from its queue; with ``http``, also checks every ``DISCONNECT_POLL`` seconds
    whether the client is still there (raising a 499 when it is not)."""

    def __init__(self, http: Request | None):
        self.http = http
        self.checked = time.monotonic()

    async def next(self, queue: asyncio.Queue):
        if self.http is None:
            return await queue.get()
        getter = asyncio.ensure_future(queue.get())
        try:
            while True:
                wait = max(self.checked + DISCONNECT_POLL - time.monotonic(), 0)
                finished, _ = await asyncio.wait({getter}, timeout=wait)
                if finished:
                    return getter.result()
                self.checked = time.monotonic()
                if await self.http.is_disconnected():
                    raise APIError(499, "the client closed the connection", code="client_closed")
        finally:
            getter.cancel()


def _sse(data) -> str:
    return f"data: {json.dumps(data) if not isinstance(data, str) else data}\n\n"


async def _answer(service: Service, body: _Generation, prompt: list[int], max_tokens: int | None, http: Request,
                  kind: Literal["text_completion", "chat.completion"]):
    """The streamed or whole answer of a completion or chat request."""
    rid, subscriber = service.submit(body, prompt, max_tokens)
    chat = kind == "chat.completion"
    head = {"id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}", "created": int(time.time()),
            "model": service.model_name}

    def choice(text: str, finish: str | None, delta: bool) -> dict:
        if not chat:
            return {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
        content = {"role": "assistant", "content": text}
        return {"index": 0, ("delta" if delta else "message"): content, "logprobs": None, "finish_reason": finish}

    if not body.stream:
        parts, last = [], None
        async for piece in service.pieces(rid, subscriber, body.stop, http):
            parts.append(piece.text)
            last = piece
        return JSONResponse({**head, "object": kind, "choices": [choice("".join(parts), last.finish_reason, False)],
                             "usage": last.usage()})

    include_usage = body.stream_options is not None and body.stream_options.include_usage
    obj = "chat.completion.chunk" if chat else "text_completion"

    async def events() -> AsyncIterator[str]:
        try:
            async for piece in service.pieces(rid, subscriber, body.stop, None):
                yield _sse({**head, "object": obj, "choices": [choice(piece.text, piece.finish_reason, True)],
                            **({"usage": None} if include_usage else {})})
                if piece.finish_reason is not None and include_usage:
                    yield _sse({**head, "object": obj, "choices": [], "usage": piece.usage()})
        except APIError as err:
            yield _sse(err.body())
        yield _sse("[DONE]")

    return StreamingResponse(events(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


def create_app(engine, tokenizer, model_name: str, *, chat_template: str | None = None) -> FastAPI:
    """The FastAPI app serving ``engine`` (a ``ServingEngine``) as ``model_name``. Its lifespan starts the engine
    thread and, at shutdown, lets it finish what the engine holds. ``chat_template``: a Jinja template for
    ``/v1/chat/completions`` where the tokenizer has none. ``app.state.service`` is the ``Service``."""
    service = Service(engine, tokenizer, model_name, chat_template)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        service.loop.start()
        yield
        service.draining = True
        await asyncio.to_thread(service.loop.stop)

    app = FastAPI(title="sparsekv", lifespan=lifespan)
    app.state.service = service

    @app.exception_handler(APIError)
    async def api_error(request: Request, err: APIError):
        return err.response()

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, err: RequestValidationError):
        return _validation_error(err).response()

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, http: Request):
        service.check_model(body.model)
        body.check_supported()
        return await _answer(service, body, service.completion_prompt(body), body.max_tokens or 16, http,
                             "text_completion")

    @app.post("/v1/chat/completions")
    async def chat(body: ChatRequest, http: Request):
        service.check_model(body.model)
        body.check_supported()
        return await _answer(service, body, service.chat_prompt(body), body.max_completion_tokens or body.max_tokens,
                             http, "chat.completion")

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": service.model_name, "object": "model", "created": service.created,
                                            "owned_by": "sparsekv", "max_model_len": service.max_context}]}

    @app.get("/health")
    async def health():
        if service.loop.error is not None:
            return APIError(503, f"the engine failed: {service.loop.error!r}", "server_error").response()
        if service.draining:
            return APIError(503, "the server is shutting down", "server_error", code="shutting_down").response()
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics():
        return Response(prometheus_text(service.loop), media_type="text/plain; version=0.0.4; charset=utf-8")

    return app


def prometheus_text(loop: EngineLoop) -> str:
    """The engine's state in Prometheus' text format (``prometheus_client`` writes it)."""
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    m = loop.metrics

    class Collector:
        def collect(self):
            yield GaugeMetricFamily("sparsekv_requests_running", "Requests decoding now", value=m["running"])
            yield GaugeMetricFamily("sparsekv_requests_queued", "Requests waiting for admission", value=m["queued"])
            yield GaugeMetricFamily("sparsekv_requests_prefilling", "Requests admitted and prefilling",
                                    value=m["prefilling"])
            yield GaugeMetricFamily("sparsekv_free_rows", "Batch rows free for new requests", value=m["free_rows"])
            yield GaugeMetricFamily("sparsekv_generation_tokens_per_second",
                                    f"Tokens generated per second over the last {RATE_WINDOW:.0f} s",
                                    value=loop.token_rate())
            yield GaugeMetricFamily("sparsekv_kv_bytes_in_use", "KV-cache bytes held by requests on the device",
                                    value=m["kv_bytes_in_use"])
            yield GaugeMetricFamily("sparsekv_kv_bytes_capacity", "KV-cache bytes the device pool holds",
                                    value=m["kv_bytes_capacity"])
            yield GaugeMetricFamily("sparsekv_host_kv_bytes", "KV-cache bytes offloaded to host memory",
                                    value=m["host_kv_bytes"])
            yield CounterMetricFamily("sparsekv_generated_tokens", "Tokens generated since start",
                                      value=m["generated_tokens"])
            yield CounterMetricFamily("sparsekv_finished_requests", "Requests finished since start",
                                      value=m["finished_requests"])

    registry = CollectorRegistry(auto_describe=False)
    registry.register(Collector())
    return generate_latest(registry).decode()


# ------------------------------------------------------------------------------------------------- running it


def _uvicorn(app: FastAPI, host: str, port: int, log_level: str):
    """uvicorn's server, which on SIGTERM/SIGINT first marks the service draining (new requests: 503), then stops
    listening and waits for the open requests to finish (uvicorn's graceful shutdown)."""
    import uvicorn

    service = app.state.service

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame):
            service.draining = True
            super().handle_exit(sig, frame)

    return Server(uvicorn.Config(app, host=host, port=port, log_level=log_level, timeout_keep_alive=5))


def serve(engine, tokenizer, model_name: str, *, host: str = "127.0.0.1", port: int = 8000,
          chat_template: str | None = None, log_level: str = "info") -> None:
    """Serves ``engine`` until SIGTERM or SIGINT, which drain it: no new requests, the running ones finish. After
    the drain, SIGTERM returns (uvicorn raises the signal again once its own handlers are gone: the no-op handler
    here takes it, so that a drained server exits with status 0); SIGINT raises KeyboardInterrupt."""
    app = create_app(engine, tokenizer, model_name, chat_template=chat_template)
    previous = signal.signal(signal.SIGTERM, lambda sig, frame: None)
    try:
        _uvicorn(app, host, port, log_level).run()
    finally:
        signal.signal(signal.SIGTERM, previous)


@contextlib.contextmanager
def running(app: FastAPI, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning") -> Iterator[str]:
    """Serves ``app`` from a background thread (tests, benchmarks): yields the base URL (``http://host:port``;
    port 0 picks a free one); leaving stops the server as SIGTERM would and waits for it."""
    server = _uvicorn(app, host, port, log_level)
    thread = threading.Thread(target=server.run, name="sparsekv-http", daemon=True)
    thread.start()
    while not server.started:
        if not thread.is_alive():
            raise RuntimeError(f"the HTTP server did not start on {host}:{port}")
        time.sleep(0.02)
    bound = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://{host}:{bound}"
    finally:
        server.handle_exit(None, None)
        thread.join()
