"""An OpenAI-compatible HTTP server over the serving engine (``sparsekv serve``; ``pip install 'sparsekv[serve]'``).

Endpoints: ``POST /v1/completions`` and ``POST /v1/chat/completions`` (the tokenizer's chat template), streamed as
server-sent events (``data: {...}`` chunks, then ``data: [DONE]``) or answered whole, with ``usage``;
``GET /v1/models``, ``GET /health``, and ``GET /metrics`` (Prometheus text format).

Requests, as data::

    body -> UTF-8, JSON, nesting and strings checked (``parse_body``: a 400 saying what is wrong and where)
         -> pydantic model (400 naming the field and what it takes) -> prompt token ids (text, token ids, or the
              chat template; a list of prompts) -> one engine request per prompt and choice (``n``): engine.submit
              (429 queue full, 400 over a limit; all or none) -> events from the engine's thread -> incremental
              detokenization -> stop strings (end the request, finish reason "stop") -> SSE chunks (each choice's,
              as they come) or one JSON answer

One background thread (``EngineLoop``) owns the engine: it calls ``step()`` while there is work, hands each event
to the asyncio queue of its request, and snapshots ``metrics()``. A client that disconnects cancels its request,
which frees its rows. A failure inside a step ends the requests it belongs to (finish reason "error": a 500, or an
error event in a stream) and the server serves on; so does an error no handler expected (a 500 in OpenAI's error
body). SIGTERM stops accepting (503), lets the running requests finish, then stops.

FastAPI (on Starlette, served by uvicorn) is the framework: the Python ecosystem's maintained standard for typed JSON
APIs, whose pydantic validation names the offending field, whose streaming responses carry server-sent events, and
whose server (uvicorn) drains open connections on SIGTERM.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import difflib
import hmac
import json
import logging
import re
import signal
import threading
import time
import traceback
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from typing import Annotated, Callable, Literal

import torch
from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from fastapi.routing import APIRoute
from pydantic import (AfterValidator, BaseModel, ConfigDict, Field, StrictBool, StrictInt, ValidationInfo,
                      field_validator, model_validator)
from pydantic_core import PydanticCustomError
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..engine import (INT64_MAX, MAX_BIAS, MAX_PENALTY, MAX_REPETITION_PENALTY, MIN_REPETITION_PENALTY,
                      MIN_TEMPERATURE, SEED_LIMIT, IncrementalText, Sampling)
from ..errors import ConfigError, shown
from . import Event, Logprobs, QueueFull
from .scheduler import ContextTooLong
from . import Request as EngineRequest
from .runner import TOP_LOGPROBS

log = logging.getLogger("sparsekv.serve")

# Seconds over which /metrics averages generated tokens per second.
RATE_WINDOW = 10.0
# Seconds the engine thread sleeps between looks when idle (it wakes at once on a submit or cancel).
IDLE_WAIT = 0.5
# Seconds between checks, while a whole (non-streamed) answer is awaited, of whether its client is still there.
DISCONNECT_POLL = 1.0
# The most choices one request may ask for (``n``, OpenAI's limit); each is an engine request of its own.
MAX_CHOICES = 128
# How many of the likeliest tokens a completion may have listed with each new token (OpenAI's limit there).
MAX_COMPLETION_LOGPROBS = 5
# The log-probability given for a token the model rules out (-inf is not JSON).
LOGPROB_FLOOR = -9999.0
# Upper bounds (seconds) of the /metrics histograms' buckets: time to first token (long prompts take minutes), time
# per output token, and a request's whole time.
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 25.0, 50.0, 100.0, 250.0, 500.0)
TPOT_BUCKETS = (0.005, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075, 0.1, 0.2, 0.5, 1.0)
E2E_BUCKETS = (0.1, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1200.0)
# The deepest nesting of arrays and objects a request body may have (OpenAI's requests nest a few levels).
MAX_JSON_DEPTH = 32
# The most digits of an integer in a request body (an int64 has 19; Python's parser refuses more than 4300 with a
# message about its own settings).
MAX_INT_DIGITS = 100
# The finish reasons /metrics counts.
FINISH_REASONS = ("stop", "length", "cancelled", "error")


class APIError(Exception):
    """An error answered as OpenAI's ``{"error": {"message", "type", "param", "code"}}`` with ``status``."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def internal_error(err: BaseException) -> APIError:
    """The 500 of an error no handler expected (its traceback goes to the server's log)."""
    return APIError(500, printable(f"internal error: {type(err).__name__}: {err}"), "server_error",
                    code="internal_error")


def printable(text: str) -> str:
    """``text`` with any lone surrogate written as an escape (a JSON answer is UTF-8, which has no such
    character)."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


# ------------------------------------------------------------------------------------------------ the body


class _BodyError(ValueError):
    """A request body that is not one this server reads (raised from inside ``json.loads``)."""


def _json_int(text: str) -> int:
    if len(text.lstrip("-")) > MAX_INT_DIGITS:
        raise _BodyError(f"the request body has an integer of {len(text.lstrip('-'))} digits; this server reads at "
                         f"most {MAX_INT_DIGITS}")
    return int(text)


def _json_constant(name: str):
    raise _BodyError(f"the request body is not valid JSON: {name} is not a JSON number")


# A JSON escape of a UTF-16 surrogate: a string with one may hold a lone surrogate (in UTF-8 text, only such an
# escape makes one).
SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")


def parse_body(body: bytes):
    """The JSON value of a request body, or an ``APIError`` (400) saying what is wrong with it: bytes that are not
    UTF-8 (at which byte), text that is not JSON (where; NaN and Infinity are not JSON), an integer of more than
    ``MAX_INT_DIGITS`` digits, arrays and objects nested deeper than ``MAX_JSON_DEPTH``, or a string holding a lone
    surrogate (a ``\\ud800`` escape that is not half of a pair: no character, which no tokenizer takes), named by its
    field."""
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as err:
        raise APIError(400, f"the request body is not valid UTF-8: byte 0x{body[err.start]:02x} at offset "
                            f"{err.start} ({err.reason})", code="invalid_encoding") from None
    try:
        value = json.loads(text, parse_int=_json_int, parse_constant=_json_constant)
    except json.JSONDecodeError as err:
        raise APIError(400, f"the request body is not valid JSON: {err.msg} at line {err.lineno}, column "
                            f"{err.colno}", code="invalid_json") from None
    except _BodyError as err:
        raise APIError(400, str(err), code="invalid_json") from None
    except RecursionError:
        raise APIError(400, f"the request body nests arrays and objects deeper than {MAX_JSON_DEPTH} levels",
                       code="invalid_json") from None
    surrogates = SURROGATE_ESCAPE.search(text) is not None
    if surrogates or text.count("[") + text.count("{") > MAX_JSON_DEPTH:  # else neither can be there
        _check_json(value, surrogates)
    return value


def _check_json(value, surrogates: bool) -> None:
    """Refuses nesting deeper than ``MAX_JSON_DEPTH`` in ``value``, and with ``surrogates`` a string or key holding a
    lone surrogate."""
    stack = [(value, 1, ())]
    while stack:
        item, depth, path = stack.pop()
        if isinstance(item, str):
            _check_text(item, path)
            continue
        if depth > MAX_JSON_DEPTH:
            param = printable(str(path[0]))
            raise APIError(400, f"{param}: the request body nests arrays and objects deeper than {MAX_JSON_DEPTH} "
                                f"levels", param=param, code="invalid_json")
        children = item.items() if isinstance(item, dict) else enumerate(item)
        for key, child in children:
            if surrogates and isinstance(key, str):
                _check_text(key, path + (key,))
            if isinstance(child, (dict, list)) or surrogates and isinstance(child, str):
                stack.append((child, depth + 1, path + (key,)))


def _check_text(text: str, path: tuple) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        where = ".".join(printable(str(p)) for p in path) or "the body"
        raise APIError(400, f"{where}: the text holds a lone surrogate (\\u{ord(text[err.start]):04x} at character "
                            f"{err.start}, half of a UTF-16 pair without its other half), which is no character",
                       param=printable(str(path[0])) if path else None, code="invalid_value") from None


def _is_json(content_type: str | None) -> bool:
    """Whether a Content-Type is one FastAPI reads as JSON."""
    kind = (content_type or "").split(";")[0].strip().lower()
    return kind == "application/json" or kind.startswith("application/") and kind.endswith("+json")


class _JSONBody(Request):
    """A request whose JSON body ``parse_body`` reads (FastAPI calls ``json()``)."""

    async def json(self):
        if not hasattr(self, "_parsed"):
            self._parsed = parse_body(await self.body())
        return self._parsed


class JSONBodyRoute(APIRoute):
    """A route whose JSON body ``parse_body`` reads before FastAPI validates it, so that a body that is not UTF-8,
    not JSON, nested too deep or holding a lone surrogate is a 400 saying so (an error inside FastAPI's own reading
    becomes its "There was an error parsing the body", which names none of these)."""

    def get_route_handler(self):
        handler = super().get_route_handler()

        async def route(request: Request) -> Response:
            request = _JSONBody(request.scope, request.receive)
            if self.body_field is not None and _is_json(request.headers.get("content-type")) and \
                    await request.body():
                await request.json()
            return await handler(request)

        return route


# ---------------------------------------------------------------------------------------------------- requests


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: StrictBool = False


# Fields this server cannot honour (OpenAI's, and vLLM's extensions that change the output), with the values it
# accepts for them (their defaults): anything else is refused with a 400 naming the field rather than answered as if
# it had not been asked.
UNSUPPORTED = {"best_of": (None, 1), "echo": (None, False), "suffix": (None, ""), "tools": (None, []),
               "response_format": (None, {"type": "text"}), "min_tokens": (None, 0), "use_beam_search": (None, False),
               "prompt_logprobs": (None,),
               "bad_words": (None, []), "allowed_token_ids": (None,), "include_stop_str_in_output": (None, False),
               "guided_json": (None,), "guided_regex": (None,), "guided_choice": (None,), "guided_grammar": (None,),
               "structured_outputs": (None,), "functions": (None, []), "function_call": (None, "none"),
               "modalities": (None, ["text"]), "audio": (None,), "prediction": (None,)}


# A number field: an int or a float, not a string or a bool.
Number = Annotated[float, Field(strict=True)]


def _written(n) -> str:
    """A bound as an error shows it (2**63 - 1 rather than its 19 digits)."""
    if isinstance(n, int) and n >= 1 << 32 and not (n + 1) & n:
        return f"2**{n.bit_length()} - 1"
    return f"{n:g}" if isinstance(n, float) else str(n)


def Between(kind: type, least, most=None, *, above: bool = False):
    """The type of a field of ``kind`` (int: an int, not a bool; float: an int or a float, not a string) from
    ``least`` (greater than it with ``above``) to ``most`` (None: no end): out of range, the 400 names the range."""
    noun = "an int" if kind is int else "a number"
    low = f"{'>' if above else '>='} {_written(least)}"
    allowed = f"{noun} {low}" if most is None else f"{noun} {low} and <= {_written(most)}" if above else \
        f"{noun} from {_written(least)} to {_written(most)}"

    def check(value):
        if (value > least if above else value >= least) and (most is None or value <= most):
            return value
        raise PydanticCustomError("out_of_range", "must be {allowed}", {"allowed": allowed})

    schema = {"exclusiveMinimum" if above else "minimum": least, **({} if most is None else {"maximum": most})}
    return Annotated[StrictInt if kind is int else Number, AfterValidator(check), Field(json_schema_extra=schema)]


def logit_bias_token(key: str) -> int | None:
    """The token id a ``logit_bias`` key names: ASCII decimal digits of an int64 (None: not one; ``str.isdigit``
    takes '²' and '٣' too)."""
    if key.isascii() and key.isdigit() and len(key) <= MAX_INT_DIGITS and int(key) <= INT64_MAX:
        return int(key)
    return None


class _Generation(BaseModel):
    """Fields both endpoints share. A field given as null takes its default, as OpenAI's do. Other fields are
    accepted and ignored, except those of ``UNSUPPORTED`` at a value other than their default, which
    ``check_supported`` refuses."""

    model_config = ConfigDict(extra="allow")

    model: str
    max_tokens: Between(int, 1) | None = None
    temperature: Between(float, 0, 2) = 1.0
    top_p: Between(float, 0, 1, above=True) = 1.0
    stop: Annotated[list[Annotated[str, Field(min_length=1)]], Field(max_length=4)] = []
    # The engine's seeds (``SEED_LIMIT``): choice 0 draws with the seed itself, as Engine.generate does.
    seed: Between(int, 0, SEED_LIMIT - 1) | None = None
    n: Between(int, 1, MAX_CHOICES) = 1
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    presence_penalty: Between(float, -MAX_PENALTY, MAX_PENALTY) = 0.0
    frequency_penalty: Between(float, -MAX_PENALTY, MAX_PENALTY) = 0.0
    # Token ids (JSON keys, so strings of ASCII digits) to biases added to their logits.
    logit_bias: dict[str, Between(float, -MAX_BIAS, MAX_BIAS)] = {}
    # vLLM's, not OpenAI's: the likeliest tokens a draw keeps (-1 or 0: all); the least probability a kept token
    # has, as a share of the likeliest one's; the repetition penalty of transformers and vLLM (prompt and answer
    # tokens); token ids that end the answer as the model's end-of-sequence does (finish reason "stop", the
    # token's text left out).
    top_k: Between(int, -1, INT64_MAX) = -1
    min_p: Between(float, 0, 1) = 0.0
    repetition_penalty: Between(float, MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY) = 1.0
    stop_token_ids: list[Between(int, 0)] = []
    # Not OpenAI's: generate through the model's end-of-sequence tokens (exact output lengths for benchmarks).
    ignore_eos: StrictBool = False

    @model_validator(mode="before")
    @classmethod
    def _nulls(cls, data):
        """A declared field given as null is left out (it takes its default; a required one is then missing)."""
        if isinstance(data, dict):
            return {k: v for k, v in data.items() if v is not None or k not in cls.model_fields}
        return data

    @field_validator("logit_bias")
    @classmethod
    def _token_ids(cls, value):
        bad = [printable(key) for key in value if logit_bias_token(key) is None]
        if bad:
            raise PydanticCustomError("invalid_key", "keys must be token ids, ASCII decimal digits of an int from 0 "
                                      "to 2**63 - 1 (such as \"50256\"); not {bad}", {"bad": ", ".join(map(repr, bad))})
        return value

    @field_validator("stream_options")
    @classmethod
    def _streamed(cls, value, info: ValidationInfo):
        if value is not None and not info.data.get("stream"):
            raise ValueError("only with stream true")
        return value

    def sampling(self) -> Sampling:
        """The engine's ``Sampling`` of the request's fields. A temperature below the engine's least
        (``MIN_TEMPERATURE``) is greedy, the limit of drawing at ever smaller temperatures (as vLLM takes it)."""
        return Sampling(temperature=self.temperature if self.temperature >= MIN_TEMPERATURE else 0.0,
                        top_p=self.top_p, top_k=max(self.top_k, 0), min_p=self.min_p,
                        presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
                        repetition_penalty=self.repetition_penalty,
                        logit_bias={logit_bias_token(k): v for k, v in self.logit_bias.items()})

    @field_validator("stop", mode="before")
    @classmethod
    def _stops(cls, value):
        """OpenAI's forms: one string, a list of up to 4, or null."""
        if not isinstance(value, (str, list)) and value is not None:
            raise ValueError("must be a string or a list of up to 4 strings")
        return [value] if isinstance(value, str) else [] if value is None else value

    def check_supported(self) -> None:
        """Refuses a field of ``UNSUPPORTED`` (kept among the extra fields) at a value this server cannot honour, and
        an unknown field whose name is a near miss of a known one (a misspelling would otherwise be ignored)."""
        known = [*type(self).model_fields, *UNSUPPORTED]
        for name, value in (self.model_extra or {}).items():
            if name in UNSUPPORTED and value not in UNSUPPORTED[name]:
                supported = " or ".join(json.dumps(a) for a in UNSUPPORTED[name])
                raise APIError(400, f"{name}: this server supports only {supported}, got {shown(value)}", param=name,
                               code="unsupported_value")
            near = difflib.get_close_matches(name, known, n=1, cutoff=0.85)
            if name not in UNSUPPORTED and near:
                raise APIError(400, f"{name}: not a field of this endpoint; did you mean {near[0]}?", param=name,
                               code="unknown_field")

    def listed_logprobs(self) -> int | None:
        """The likeliest tokens to list with each new token's log-probability (None: no log-probabilities)."""
        raise NotImplementedError


TokenIds = Annotated[list[Annotated[StrictInt, Field(ge=0)]], Field(min_length=1)]


class CompletionRequest(_Generation):
    # One prompt (text or token ids) or a list of them, each answered by its own choices.
    prompt: str | TokenIds | Annotated[list[str], Field(min_length=1)] | Annotated[list[TokenIds], Field(min_length=1)]
    logprobs: Between(int, 0, MAX_COMPLETION_LOGPROBS) | None = None

    def listed_logprobs(self) -> int | None:
        return self.logprobs


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]


class ChatRequest(_Generation):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: Between(int, 1) | None = None
    logprobs: StrictBool = False
    top_logprobs: Between(int, 0, TOP_LOGPROBS) | None = None

    def listed_logprobs(self) -> int | None:
        if self.top_logprobs is not None and not self.logprobs:
            raise APIError(400, "top_logprobs: needs logprobs true", param="top_logprobs", code="invalid_value")
        return (self.top_logprobs or 0) if self.logprobs else None


def _validation_error(err: RequestValidationError, content_type: str) -> APIError:
    """A 400 naming the first offending field (its top-level name as ``param``, the full location in the text);
    ``content_type``: the request's, named where the body was not read as JSON."""
    first = err.errors()[0]
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    if first.get("type") == "json_invalid":
        return APIError(400, f"the request body is not valid JSON: {first.get('ctx', {}).get('error', '')}".rstrip(),
                        code="invalid_json")
    if not loc:
        if content_type.split(";")[0].strip().lower() != "application/json":
            return APIError(400, f"the request body must be a JSON object sent with Content-Type: application/json, "
                                 f"got Content-Type: {content_type or 'none'}", code="invalid_content_type")
        return APIError(400, f"the request body must be a JSON object: {first.get('msg')}")
    if loc[0] == "prompt" and len(loc) > 1:  # pydantic names the first form of the union that failed
        return APIError(400, f"prompt: must be a string, a list of token ids (ints >= 0), or a non-empty list of "
                             f"either (got {shown(first.get('input'))})", param="prompt", code="invalid_value")
    return APIError(400, f"{'.'.join(loc)}: {first.get('msg')} (got {shown(first.get('input'))})", param=loc[0],
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
    """A part of an answer: new text; where the request asked for them, the log-probabilities of the tokens whose
    text starts in it (token id, ``Logprobs``, offset of the token's text in the whole answer); and at the end the
    finish reason and the number of new tokens."""

    text: str
    logprobs: list[tuple[int, Logprobs, int]] = field(default_factory=list)
    finish_reason: str | None = None
    completion_tokens: int = 0
    cached_tokens: int = 0


# ------------------------------------------------------------------------------------------- the engine thread


class _Subscriber:
    """A request's asyncio queue, fed from the engine thread, and its ``stop_tokens``."""

    def __init__(self, stop_tokens: tuple[int, ...]):
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue = asyncio.Queue()
        self.stop_tokens = stop_tokens

    def push(self, item) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, item)


class Latencies:
    """Per request, from its submit (``started``) to its first token (time to first token), then per output token
    and to its end (for requests that end with "stop" or "length"); and the prompt tokens of the requests that got
    a first token. Fed from the engine thread's events, read by ``/metrics`` (``prometheus_client``'s histograms,
    in no registry: each server's own); the caller holds a lock."""

    def __init__(self):
        from prometheus_client import Histogram

        self.ttft = Histogram("sparsekv_time_to_first_token_seconds",
                              "Seconds from a request's arrival to its first token", buckets=TTFT_BUCKETS,
                              registry=None)
        self.tpot = Histogram("sparsekv_time_per_output_token_seconds",
                              "Seconds per output token after the first, per request", buckets=TPOT_BUCKETS,
                              registry=None)
        self.e2e = Histogram("sparsekv_request_latency_seconds", "Seconds from a request's arrival to its last token",
                             buckets=E2E_BUCKETS, registry=None)
        self.prompt_tokens = 0
        self.open: dict[int, list[float]] = {}  # request id -> [submitted, first token] (times)

    def started(self, rid: int, now: float) -> None:
        self.open[rid] = [now]

    def event(self, event: Event, now: float) -> None:
        times = self.open.get(event.request_id)
        if times is None:
            return
        if len(times) == 1 and event.completion_tokens:
            times.append(now)
            self.ttft.observe(now - times[0])
            self.prompt_tokens += event.prompt_tokens
        if event.finished:
            del self.open[event.request_id]
            if event.finish_reason in ("stop", "length"):
                self.e2e.observe(now - times[0])
                if event.completion_tokens > 1:
                    self.tpot.observe((now - times[1]) / (event.completion_tokens - 1))


class EngineLoop:
    """Drives ``engine.step()`` in one background thread while there is work, and waits for a submit or cancel
    otherwise. Hands each request's events to its subscriber; keeps the latest ``engine.metrics()``, the recent
    (time, generated tokens) samples for the token rate and the requests' ``Latencies``. The engine ends the requests
    a failure inside a step belongs to itself (finish reason "error"); a step that raises all the same fails every
    open request (their engine requests are cancelled), and the loop goes on after ``IDLE_WAIT``."""

    def __init__(self, engine):
        self.engine = engine
        self.lock = threading.Lock()  # submit + subscribe are one step for the dispatcher
        self.wake = threading.Event()
        self.subscribers: dict[int, _Subscriber] = {}
        self.stopping = False
        self.metrics = engine.metrics()
        self.peak_running = 0  # the most requests decoding at once, seen after every step
        self.samples: collections.deque = collections.deque()
        self.latencies = Latencies()  # under ``lock``
        self.thread = threading.Thread(target=self._run, name="sparsekv-engine", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        """Finishes the work the engine holds, then ends the thread."""
        self.stopping = True
        self.wake.set()
        self.thread.join()

    def submit(self, request: EngineRequest) -> tuple[int, _Subscriber]:
        subscriber = _Subscriber(request.stop_tokens)
        with self.lock:  # a failed step fails the subscribers under it: none is added meanwhile and left waiting
            rid = self.engine.submit(request)
            self.subscribers[rid] = subscriber
            self.latencies.started(rid, time.monotonic())
        self.wake.set()
        return rid, subscriber

    def cancel(self, rid: int, reason: str = "cancelled") -> None:
        self.engine.cancel(rid, reason)
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
        try:  # in this thread: PyTorch keeps cuDNN's plans per thread
            start = time.monotonic()
            if built := self.engine.runner.prepare():
                log.info("built %d prompt attention plans in %.1f s", built, time.monotonic() - start)
        except Exception:  # the passes build the plans they meet instead
            log.exception("building the prompt attention plans failed")
        while True:
            self.wake.clear()
            try:
                if self.engine.has_work():
                    events = self.engine.step(raise_errors=False)
                    self._sample()
                    now = time.monotonic()
                    with self.lock:
                        for event in events:
                            self.latencies.event(event, now)
                            subscriber = (self.subscribers.pop if event.finished else self.subscribers.get)(
                                event.request_id, None)
                            if subscriber is not None:
                                subscriber.push(event)
                    continue
                self._sample()
            except Exception as err:  # past the engine's own handling: every open request fails
                log.error("engine step failed:\n%s", traceback.format_exc())
                with self.lock:
                    failed, self.subscribers = self.subscribers, {}
                for rid, subscriber in failed.items():
                    subscriber.push(err)
                    self.engine.cancel(rid)
                if self.stopping:
                    return
                self.wake.wait(IDLE_WAIT)  # a step that fails again does not spin
                continue
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
            raise APIError(404, f"model {shown(name)} is not served here; this server serves {self.model_name!r}",
                           param="model", code="model_not_found")

    def completion_prompts(self, body: CompletionRequest) -> list[list[int]]:
        """The token ids of each prompt (ids given are checked against the vocabulary by the engine)."""
        given = body.prompt
        prompts = [given] if isinstance(given, str) or isinstance(given[0], int) else given
        out = []
        for prompt in prompts:
            ids = prompt if isinstance(prompt, list) else self.tokenizer(prompt).input_ids
            if not ids:
                raise APIError(400, "prompt: a prompt has no tokens", param="prompt", code="invalid_value")
            out.append(ids)
        return out

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

    def submit(self, body: _Generation, prompts: list[list[int]], max_tokens: int | None, max_tokens_field: str,
               listed: int | None) -> list[tuple[int, _Subscriber]]:
        """One engine request per prompt and choice (``n`` choices per prompt, prompt by prompt), all or none: a
        refusal cancels those already queued. Choice j of a prompt draws with the seed ``choice_seed(seed, j)``;
        ``max_tokens_field``: the field the client gave ``max_tokens`` in (a refusal names it); ``listed``: the
        likeliest tokens whose log-probabilities come with each new token's (None: none)."""
        if self.draining:
            raise APIError(503, "the server is shutting down", "server_error", code="shutting_down")
        vocab = self.engine.runner.vocab_size
        if any(t >= vocab for t in body.stop_token_ids):
            raise APIError(400, f"stop_token_ids: must be token ids below the vocabulary size ({vocab}), got "
                                f"{body.stop_token_ids}", param="stop_token_ids", code="invalid_value")
        stops = (() if body.ignore_eos else tuple(self.engine.stop_tokens_default)) + tuple(body.stop_token_ids)
        if len(prompts) * body.n > self.engine.max_queue:  # could never be queued at once
            name = "n" if len(prompts) == 1 else "prompt"
            raise APIError(400, f"{name}: {len(prompts)} prompt(s) of {body.n} choice(s) each are more requests than "
                                f"this server queues at once (max_queue, {self.engine.max_queue})", param=name,
                           code="invalid_value")
        submitted: list[tuple[int, _Subscriber]] = []
        try:
            sampling = body.sampling()
            for prompt in prompts:
                # A chat answer may take what the limits leave.
                most = max_tokens or max(min(self.max_context - len(prompt), self.max_new_tokens), 1)
                for j in range(body.n):
                    request = EngineRequest(prompt=prompt, max_tokens=most, sampling=sampling, stop_tokens=stops,
                                            seed=choice_seed(body.seed, j), logprobs=listed)
                    submitted.append(self.loop.submit(request))
            return submitted
        except (QueueFull, ConfigError) as err:
            for rid, _ in submitted:
                self.loop.cancel(rid)
            if isinstance(err, QueueFull):
                raise APIError(429, f"the queue is full ({err}); retry later", "rate_limit_error",
                               code="queue_full", headers={"Retry-After": "1"}) from None
            # RequestError (a limit, a token id) or Sampling's refusal, named as the client named the field
            code = "context_length_exceeded" if isinstance(err, ContextTooLong) else "invalid_value"
            name = err.field.replace("max_tokens", max_tokens_field)
            raise APIError(400, str(ConfigError(name, err.allowed, err.value, err.where)), param=name,
                           code=code) from None

    async def pieces(self, rid: int, subscriber: _Subscriber, stops: list[str]) -> AsyncIterator[Piece]:
        """The answer's text as it is generated, ending with a piece that has the finish reason and the count of
        new tokens. Leaving before the end (a disconnect, a sibling choice's failure) cancels the request."""
        text_of, stopper = IncrementalText(self.tokenizer), StopStrings(stops)
        made = given = 0  # characters of the answer detokenized, and given out (stop strings hold some back)
        held: list[tuple[int, Logprobs, int]] = []  # log-probabilities of tokens whose text is not given out yet
        done = False
        try:
            while True:
                event = await subscriber.queue.get()
                if isinstance(event, BaseException):
                    raise APIError(500, printable(f"the engine failed: {event!r}"), "server_error", code="engine_error")
                if event.finish_reason == "error":  # it has ended: nothing to cancel
                    done = True
                    raise APIError(500, printable(f"the engine failed on this request (finish reason \"error\"): "
                                                  f"{event.error}"), "server_error", code="engine_error")
                # A stop token ends the answer without text or log-probabilities (the model's end-of-sequence has
                # no text either).
                tokens = event.tokens
                cut = event.finish_reason == "stop" and bool(tokens) and tokens[-1] in subscriber.stop_tokens
                if event.logprobs is None:
                    text = text_of.push(tokens[:-1] if cut else tokens, event.finished)
                else:  # token by token, for the offset of each one's text
                    parts = []
                    for token, logprobs in zip(tokens[:-1] if cut else tokens, event.logprobs):
                        parts.append(text_of.push([token]))
                        held.append((token, logprobs, made))
                        made += len(parts[-1])
                    if event.finished:  # a character the last tokens left unfinished
                        parts.append(text_of.push([], True))
                        made += len(parts[-1])
                    text = "".join(parts)
                text, hit = stopper.feed(text, event.finished)
                given += len(text)
                # A stop string drops the tokens after it; a natural end gives every token out.
                out = [h for h in held if h[2] < given or (event.finished and not hit)]
                held = held[len(out):]
                if hit or event.finished:
                    done = True
                    if hit and not event.finished:
                        self.loop.cancel(rid, "stop")
                    yield Piece(text, out, "stop" if hit else event.finish_reason, event.completion_tokens,
                                event.cached_tokens)
                    return
                if text or out:
                    yield Piece(text, out)
        finally:
            if not done:
                self.loop.cancel(rid)


def choice_seed(seed: int | None, choice: int) -> int | None:
    """The seed of a request's choice ``choice``: ``seed`` itself for the first, a hash of both for the others (so
    that choices differ and a request's seed gives the same choices every time)."""
    if seed is None or choice == 0:
        return seed
    return (seed + choice * 0x9E3779B97F4A7C15) % SEED_LIMIT


async def _gathered(coroutines: list, http: Request) -> list:
    """The results of ``coroutines`` run side by side, checking every ``DISCONNECT_POLL`` seconds that the client
    is still there (a 499 when it is not). The first failure, or leaving early, cancels the rest."""
    tasks = [asyncio.ensure_future(c) for c in coroutines]
    try:
        while True:
            done, pending = await asyncio.wait(tasks, timeout=DISCONNECT_POLL, return_when=asyncio.FIRST_EXCEPTION)
            for task in done:
                if task.exception() is not None:
                    raise task.exception()
            if not pending:
                return [task.result() for task in tasks]
            if await http.is_disconnected():
                raise APIError(499, "the client closed the connection", code="client_closed")
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)  # their requests are cancelled as they end


def _sse(data) -> str:
    return f"data: {json.dumps(data) if not isinstance(data, str) else data}\n\n"


async def _answer(service: Service, body: _Generation, prompts: list[list[int]], max_tokens: int | None,
                  max_tokens_field: str, http: Request, kind: Literal["text_completion", "chat.completion"]):
    """The streamed or whole answer of a completion or chat request: ``n`` choices for each of ``prompts``
    (``max_tokens``: given in the field ``max_tokens_field``)."""
    listed = body.listed_logprobs()
    choices = service.submit(body, prompts, max_tokens, max_tokens_field, listed)
    chat = kind == "chat.completion"
    head = {"id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}", "created": int(time.time()),
            "model": service.model_name}
    logprobs = _ChatLogprobs(service.tokenizer) if chat else _CompletionLogprobs(service.tokenizer)

    def choice(index: int, text: str, scores: list, finish: str | None, delta: bool) -> dict:
        scored = None if listed is None else logprobs(scores)
        if not chat:
            return {"index": index, "text": text, "logprobs": scored, "finish_reason": finish}
        if not delta:
            return {"index": index, "message": {"role": "assistant", "content": text}, "logprobs": scored,
                    "finish_reason": finish}
        return {"index": index, "delta": {"content": text} if text else {}, "logprobs": scored,
                "finish_reason": finish}

    def usage(lasts: list[Piece]) -> dict:
        """Counts of the choices' last pieces, in choice order (prompt by prompt): a prompt's n choices count it
        once, its tokens from the prefix cache (``cached_tokens``) as the most any of its choices took."""
        completion = sum(p.completion_tokens for p in lasts)
        prompt = sum(len(p) for p in prompts)
        cached = sum(max(p.cached_tokens for p in lasts[i:i + body.n]) for i in range(0, len(lasts), body.n))
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
                "prompt_tokens_details": {"cached_tokens": cached}}

    if not body.stream:
        async def whole(rid: int, subscriber: _Subscriber) -> tuple[str, list, Piece]:
            parts, scores, last = [], [], None
            async for piece in service.pieces(rid, subscriber, body.stop):
                parts.append(piece.text)
                scores += piece.logprobs
                last = piece
            return "".join(parts), scores, last

        done = await _gathered([whole(rid, subscriber) for rid, subscriber in choices], http)
        return JSONResponse({**head, "object": kind,
                             "choices": [choice(i, text, scores, last.finish_reason, False)
                                         for i, (text, scores, last) in enumerate(done)],
                             "usage": usage([last for *_, last in done])})

    include_usage = body.stream_options is not None and body.stream_options.include_usage
    obj = "chat.completion.chunk" if chat else "text_completion"

    async def events() -> AsyncIterator[str]:
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(index: int, rid: int, subscriber: _Subscriber) -> None:
            try:
                async for piece in service.pieces(rid, subscriber, body.stop):
                    queue.put_nowait((index, piece))
            except APIError as err:
                queue.put_nowait((index, err))
            except Exception as err:
                log.error("a streamed choice failed:\n%s", traceback.format_exc())
                queue.put_nowait((index, internal_error(err)))

        tasks = [asyncio.ensure_future(pump(i, rid, subscriber)) for i, (rid, subscriber) in enumerate(choices)]
        try:
            if chat:  # OpenAI's first chunk of each choice gives the role alone
                for index in range(len(choices)):
                    yield _sse({**head, "object": obj, "choices": [{
                        "index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                        "finish_reason": None}], **({"usage": None} if include_usage else {})})
            lasts: dict[int, Piece] = {}
            while len(lasts) < len(tasks):  # each choice's pieces as they come
                index, piece = await queue.get()
                if isinstance(piece, APIError):
                    raise piece
                yield _sse({**head, "object": obj,
                            "choices": [choice(index, piece.text, piece.logprobs, piece.finish_reason, True)],
                            **({"usage": None} if include_usage else {})})
                if piece.finish_reason is not None:
                    lasts[index] = piece
            if include_usage:
                yield _sse({**head, "object": obj, "choices": [], "usage": usage([lasts[i] for i in sorted(lasts)])})
        except APIError as err:
            yield _sse(err.body())
        except Exception as err:  # the answer has begun: the error goes in the stream
            log.error("a stream failed:\n%s", traceback.format_exc())
            yield _sse(internal_error(err).body())
        finally:  # a client that left, or a failed choice: the others are cancelled
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        yield _sse("[DONE]")

    return StreamingResponse(events(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


class _CompletionLogprobs:
    """A completion's ``logprobs``: OpenAI's lists of the tokens, their log-probabilities, the likeliest tokens
    (text to log-probability) and the offset of each token's text in the answer."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def text(self, token: int) -> str:
        return self.tokenizer.decode([token])

    def top(self, logprobs: Logprobs) -> dict[str, float]:
        """The likeliest tokens by their text (of tokens with one text, such as the bytes of a character that
        decode alone to U+FFFD, the likeliest)."""
        out: dict[str, float] = {}
        for token, logprob in logprobs.top:
            out.setdefault(self.text(token), _finite(logprob))
        return out

    def __call__(self, scores: list[tuple[int, Logprobs, int]]) -> dict:
        return {"tokens": [self.text(t) for t, _, _ in scores],
                "token_logprobs": [_finite(lp.logprob) for _, lp, _ in scores],
                "top_logprobs": [self.top(lp) for _, lp, _ in scores],
                "text_offset": [offset for *_, offset in scores]}


class _ChatLogprobs(_CompletionLogprobs):
    """A chat answer's ``logprobs``: ``content``, per token its text, log-probability, bytes and likeliest
    tokens. A token's bytes are those it stands for (``token_bytes``), so that the bytes of a character split over
    tokens join into it, where each token's text alone is U+FFFD."""

    def __init__(self, tokenizer):
        super().__init__(tokenizer)
        self.bytes = token_bytes(tokenizer)

    def entry(self, token: int, logprob: float) -> dict:
        return {"token": self.text(token), "logprob": _finite(logprob), "bytes": list(self.bytes(token))}

    def __call__(self, scores: list[tuple[int, Logprobs, int]]) -> dict:
        return {"content": [{**self.entry(t, lp.logprob), "top_logprobs": [self.entry(*top) for top in lp.top]}
                            for t, lp, _ in scores], "refusal": None}


def _byte_level_alphabet() -> dict[str, int]:
    """The characters that byte-level BPE vocabularies (GPT-2's, Llama-3's, Qwen's) write each byte as, read
    backwards: printable Latin-1 bytes stand for themselves, the others for 256, 257, ... in byte order."""
    printable = {*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1),
                 *range(ord("\xae"), ord("\xff") + 1)}
    shifted = iter(range(256, 512))
    return {chr(b if b in printable else next(shifted)): b for b in range(256)}


BYTE_LEVEL = _byte_level_alphabet()


def token_bytes(tokenizer) -> Callable[[int], bytes]:
    """A function giving the bytes a token id stands for: a byte-fallback token's (``<0xNN>``, SentencePiece), a
    byte-level BPE token's (its characters read through ``BYTE_LEVEL``, where the tokenizer decodes byte-level),
    else the UTF-8 of its text."""
    decoder = getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None)
    byte_level = type(decoder).__name__ == "ByteLevel"

    def of(token: int) -> bytes:
        piece = tokenizer.convert_ids_to_tokens(token)
        if isinstance(piece, str):
            if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
                with contextlib.suppress(ValueError):
                    return bytes([int(piece[3:5], 16)])
            if byte_level and piece and all(c in BYTE_LEVEL for c in piece):
                return bytes(BYTE_LEVEL[c] for c in piece)
        return tokenizer.decode([token]).encode()

    return of


def _finite(logprob: float) -> float:
    return max(logprob, LOGPROB_FLOOR)


def create_app(engine, tokenizer, model_name: str, *, chat_template: str | None = None,
               api_key: str | None = None) -> FastAPI:
    """The FastAPI app serving ``engine`` (a ``ServingEngine``) as ``model_name``. Its lifespan starts the engine
    thread and, at shutdown, lets it finish what the engine holds. ``chat_template``: a Jinja template for
    ``/v1/chat/completions`` where the tokenizer has none. ``api_key``: the key every ``/v1/`` request must give
    (``Authorization: Bearer KEY``, as OpenAI's clients send it; else 401); ``/health`` and ``/metrics`` stay open.
    ``app.state.service`` is the ``Service``."""
    if api_key is not None and not api_key:
        raise ConfigError("api_key", "None (no key) or a non-empty string", api_key)
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

    @app.exception_handler(Exception)
    async def unexpected(request: Request, err: Exception):
        """An error no handler expected: a 500 in OpenAI's error body (Starlette then raises it again, for the
        server's log), and the server serves on."""
        return internal_error(err).response()

    if api_key is not None:
        expected = f"Bearer {api_key}".encode()

        @app.middleware("http")
        async def authorize(request: Request, call_next):
            given = request.headers.get("authorization", "").encode()
            if request.url.path.startswith("/v1/") and not hmac.compare_digest(given, expected):
                return APIError(401, "a valid API key is needed (Authorization: Bearer KEY)",
                                code="invalid_api_key").response()
            return await call_next(request)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, err: RequestValidationError):
        return _validation_error(err, request.headers.get("content-type", "")).response()

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, err: StarletteHTTPException):
        """An unknown path (404) or method (405) in OpenAI's error body."""
        what = {404: f"no such path: {request.url.path}",
                405: f"{request.method} is not allowed on {request.url.path}"}.get(err.status_code, str(err.detail))
        return APIError(err.status_code, what, code="not_found" if err.status_code == 404 else None,
                        headers=err.headers).response()

    generation = APIRouter(route_class=JSONBodyRoute)

    # Prompts are tokenized in a worker thread (the fast tokenizers release the GIL), so that a long one does not
    # hold up the event loop, which streams every running request's tokens.
    @generation.post("/v1/completions")
    async def completions(body: CompletionRequest, http: Request):
        service.check_model(body.model)
        body.check_supported()
        return await _answer(service, body, await asyncio.to_thread(service.completion_prompts, body),
                             body.max_tokens or 16, "max_tokens", http, "text_completion")

    @generation.post("/v1/chat/completions")
    async def chat(body: ChatRequest, http: Request):
        service.check_model(body.model)
        body.check_supported()
        given = "max_tokens" if body.max_completion_tokens is None else "max_completion_tokens"
        return await _answer(service, body, [await asyncio.to_thread(service.chat_prompt, body)],
                             body.max_completion_tokens or body.max_tokens, given, http, "chat.completion")

    app.include_router(generation)

    def model_card() -> dict:
        return {"id": service.model_name, "object": "model", "created": service.created, "owned_by": "sparsekv",
                "max_model_len": service.max_context}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{name:path}")
    async def model(name: str):
        service.check_model(name)
        return model_card()

    @app.get("/health")
    async def health():
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
    with loop.lock:
        latencies = loop.latencies
        histograms = [metric for h in (latencies.ttft, latencies.tpot, latencies.e2e) for metric in h.collect()]
        prompt_tokens = latencies.prompt_tokens

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
            finished = CounterMetricFamily("sparsekv_finished_requests", "Requests finished since start, by finish "
                                           f"reason ({', '.join(FINISH_REASONS)})", labels=["reason"])
            for reason in FINISH_REASONS:
                finished.add_metric([reason], m["finished_requests"].get(reason, 0))
            yield finished
            yield CounterMetricFamily("sparsekv_preemptions", "Requests preempted since start (admission grow: "
                                      "their pages given back, recomputed or brought back from host memory later)",
                                      value=m["preempted"])
            yield CounterMetricFamily("sparsekv_yielded", "Rows yielded to a waiting request by time slicing since "
                                      "start (--time-slice)", value=m["yielded"])
            yield CounterMetricFamily("sparsekv_swap_seconds", "Host seconds in moving rows to host memory and back "
                                      "since start (preemption swap, --time-slice)", value=m["swap_seconds"])
            yield GaugeMetricFamily("sparsekv_prefix_cache_bytes", "Device bytes of finished prompts' KV kept for "
                                    "prompts that begin like them", value=m["prefix_cache_bytes"])
            yield CounterMetricFamily("sparsekv_prefix_cache_hits", "Prompts started from a kept prompt's KV",
                                      value=m["prefix_hits"])
            yield CounterMetricFamily("sparsekv_prefix_cache_tokens", "Prompt tokens a kept prompt's KV gave, not "
                                      "prefilled", value=m["prefix_tokens_reused"])
            yield CounterMetricFamily("sparsekv_prompt_tokens", "Prompt tokens of the requests that reached their "
                                      "first token since start (a prefill shared by n choices counts n times)",
                                      value=prompt_tokens)
            yield from histograms

    registry = CollectorRegistry(auto_describe=False)
    registry.register(Collector())
    return generate_latest(registry).decode()


# ------------------------------------------------------------------------------------------------- running it


def _uvicorn(app: FastAPI, host: str, port: int, log_level: str, ready: Callable[[int], None] | None = None):
    """uvicorn's server, which on SIGTERM/SIGINT first marks the service draining (new requests: 503), then stops
    listening and waits for the open requests to finish (uvicorn's graceful shutdown); ``ready`` is called with the
    port once it listens (port 0: the one the system chose)."""
    import uvicorn

    service = app.state.service

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame):
            service.draining = True
            super().handle_exit(sig, frame)

        async def startup(self, sockets=None):
            await super().startup(sockets)
            if ready is not None and self.started:
                ready(self.servers[0].sockets[0].getsockname()[1])

    return Server(uvicorn.Config(app, host=host, port=port, log_level=log_level, timeout_keep_alive=5))


def serve(engine, tokenizer, model_name: str, *, host: str = "127.0.0.1", port: int = 8000,
          chat_template: str | None = None, api_key: str | None = None, log_level: str = "info",
          ready: Callable[[int], None] | None = None) -> None:
    """Serves ``engine`` until SIGTERM or SIGINT, which drain it: no new requests, the running ones finish. After
    the drain, SIGTERM returns (uvicorn raises the signal again once its own handlers are gone: the no-op handler
    here takes it, so that a drained server exits with status 0); SIGINT raises KeyboardInterrupt. ``ready``: called
    with the port once the server listens (port 0: the one chosen)."""
    app = create_app(engine, tokenizer, model_name, chat_template=chat_template, api_key=api_key)
    previous = signal.signal(signal.SIGTERM, lambda sig, frame: None)
    try:
        _uvicorn(app, host, port, log_level, ready).run()
    finally:
        signal.signal(signal.SIGTERM, previous)


@contextlib.contextmanager
def running(app: FastAPI, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning") -> Iterator[str]:
    """Serves ``app`` from a background thread (tests, benchmarks): yields the base URL (``http://host:port``;
    port 0 picks a free one); leaving stops the server as SIGTERM would and waits for it."""
    bound: list[int] = []
    server = _uvicorn(app, host, port, log_level, ready=bound.append)
    thread = threading.Thread(target=server.run, name="sparsekv-http", daemon=True)
    thread.start()
    while not bound:
        if not thread.is_alive():
            raise RuntimeError(f"the HTTP server did not start on {host}:{port}")
        time.sleep(0.02)
    try:
        yield f"http://{host}:{bound[0]}"
    finally:
        server.handle_exit(None, None)
        thread.join()
