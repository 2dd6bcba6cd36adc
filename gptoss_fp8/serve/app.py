"""The FastAPI app: OpenAI routes over an ``EngineThread`` (runtime/engine.py).

Each request: body parsed (schema.py; one-line 400s), its prompt rendered to ids (Harmony for
chat, the tokenizer or the ids themselves for completions), ``engine.add`` (400 when it cannot
fit, 429 when the queue is full), then the engine's events for it: the engine's thread files
each step's new ids with the request's ``Listener`` and wakes the event loop once per step for
all requests (``Outbox``); the handler takes every id it got since it last looked (one SSE
write per wake-up, however many tokens), ids in, text / reasoning / tool-call deltas out
(``_CompletionReply``, ``_ChatReply``; one SSE generator for both; the Responses API's items and events:
serve/responses.py, with its stored responses). A client that goes away (a
failed send, or ``is_disconnected`` polled while waiting) cancels its request, which frees its
KV slot at the next step boundary. A request the engine
failed is a 500 for it alone (or an error event mid-stream).
"""

from __future__ import annotations

import asyncio
import copy
import hmac
import json
import threading
import time
import uuid
from array import array
from collections.abc import Callable
from dataclasses import dataclass, field

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from gptoss_fp8.errors import GptOssFp8Error, OutputFormatError
from gptoss_fp8.runtime.engine import Engine, EngineThread
from gptoss_fp8.runtime.sampling import SamplingParams
from gptoss_fp8.runtime.scheduler import QueueFull
from gptoss_fp8.runtime.sequence import Sequence
from gptoss_fp8.serve import grammar, harmony
from gptoss_fp8.serve.responses import (
    ResponseReply,
    ResponseStore,
    Stored,
    chat_tools,
    header_key,
    input_items,
    input_messages,
    new_response,
    page,
)
from gptoss_fp8.serve.schema import ChatRequest, CompletionRequest, ResponsesRequest, parse
from gptoss_fp8.serve.vocab import Vocab, harmony_vocab

POLL_S = 0.25  # how often a waiting handler checks that its client is still there


@dataclass
class Served:
    """What an app serves: the engine and its thread, the model's name, the key (None: open)."""

    engine: Engine
    thread: EngineThread
    model_name: str
    api_key: str | None = None
    created: int = field(default_factory=lambda: int(time.time()))
    vocab: Vocab = field(default_factory=harmony_vocab)  # the model's text (serve/vocab.py)


class HttpError(Exception):
    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.kind, self.headers = status, message, kind, headers


def _failed(seq: Sequence, ev: Event) -> HttpError:
    """A request the engine failed: 400 where its output format did (the request's fault), else 500."""
    if isinstance(seq.exception, OutputFormatError):
        return HttpError(400, ev.error or str(seq.exception))
    return HttpError(500, ev.error or "the request failed", "server_error")


def tokenizer_panic(e: BaseException) -> HttpError:
    """openai-harmony's tokenizer panicking (a BaseException from Rust) on a text check_text let through: a 400,
    not a dropped connection; anything else goes on up."""
    if type(e).__name__ != "PanicException":
        raise e
    return HttpError(400, "the tokenizer could not take this text (openai-harmony: "
                          f"{str(e).splitlines()[0][:200]}); break up its long runs of characters")


def _first_line(e: BaseException) -> str:
    """An exception's message, its first line (pydantic's add a link, llguidance's a grammar dump)."""
    return (str(e).strip().splitlines() or [type(e).__name__])[0][:300]


def _error(status: int, message: str, kind: str, headers: dict | None = None) -> JSONResponse:
    line = message.replace("\n", " ")
    return JSONResponse({"error": {"message": line, "type": kind, "param": None, "code": status}}, status, headers=headers)


@dataclass
class Event:
    """What a request got since its handler last looked: the new token ids (several when the
    handler was behind: they go out together), their log-probabilities and each one's most likely
    alternatives (when asked), and whether it finished (and how)."""

    new: list[int]
    finished: bool
    finish: str | None
    stop: str | None
    error: str | None
    logprobs: list[float]
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)


class Outbox:
    """The bridge from the engine's thread to the app's event loop. Each request's ``Listener``
    (its ``on_event``) files its new tokens here during a step; after the step the engine calls
    ``flush`` (its ``after_step`` hook), which wakes every listener that got something with one
    ``call_soon_threadsafe`` for the whole step: one wake-up of the loop per step, not one per
    token per stream, and the engine never waits for the loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop, poll_s: float = POLL_S):
        self.loop, self.poll_s = loop, poll_s
        self.lock = threading.Lock()
        self.ready: list[Listener] = []
        self.waiting: set[Listener] = set()  # handlers waiting (loop thread only)
        self._ticking = False

    def _tick(self) -> None:
        """Every ``poll_s`` while handlers wait: each wakes with False (time to check its client is
        still there); one timer for all of them, not one per wait."""
        for listener in list(self.waiting):
            _set(listener.waiter, False)
        self._ticking = bool(self.waiting)
        if self._ticking:
            self.loop.call_later(self.poll_s, self._tick)

    def flush(self) -> None:
        with self.lock:
            if not self.ready:
                return
            ready, self.ready = self.ready, []
        if not self.loop.is_closed():
            self.loop.call_soon_threadsafe(_wake_all, ready)


def _wake_all(listeners: list[Listener]) -> None:
    for listener in listeners:
        _set(listener.waiter, True)


def _set(fut: asyncio.Future | None, value: bool) -> None:
    if fut is not None and not fut.done():
        fut.set_result(value)


class Listener:
    """One request's side of the Outbox: the engine's thread adds to it (``__call__``: the
    request's ``on_event``); the handler takes everything it holds at once (``take``), or waits
    for the next step that gives it something (``wait``)."""

    def __init__(self, outbox: Outbox):
        self.outbox = outbox
        self.new: list[int] = []
        self.logprobs: list[float] = []
        self.tops: list[list[tuple[int, float]]] = []
        self.end: tuple[str | None, str | None, str | None] | None = None  # (finish, stop, error) once finished
        self.waiter: asyncio.Future | None = None

    def __call__(self, seq: Sequence, new: list[int]) -> None:
        ob = self.outbox
        with ob.lock:
            self.new.extend(new)
            if seq.params.logprobs and new:
                self.logprobs.extend(seq.logprobs[len(seq.logprobs) - len(new):])
            if seq.params.top_logprobs and new:
                self.tops.extend(seq.top_logprobs[len(seq.top_logprobs) - len(new):])
            if seq.finished:
                self.end = (seq.finish, seq.stop, seq.error)
            ob.ready.append(self)

    def take(self) -> Event | None:
        """Everything since the last take (None: nothing yet)."""
        with self.outbox.lock:
            if not self.new and self.end is None:
                return None
            ev = Event(self.new, self.end is not None, *(self.end or (None, None, None)), self.logprobs, self.tops)
            self.new, self.logprobs, self.tops = [], [], []
            return ev

    async def wait(self) -> bool:
        """Until the engine gives this request something (True) or the Outbox's next tick (False)."""
        ob = self.outbox
        self.waiter = fut = ob.loop.create_future()
        ob.waiting.add(self)
        if not ob._ticking:
            ob._ticking = True
            ob.loop.call_later(ob.poll_s, ob._tick)
        try:
            return await fut
        finally:
            ob.waiting.discard(self)
            self.waiter = None


class _Auth:
    """Every route but /health needs ``Authorization: Bearer KEY`` (a plain ASGI middleware:
    starlette's ``BaseHTTPMiddleware`` would put each SSE chunk through a memory stream)."""

    def __init__(self, app, key: str):
        self.app, self.want = app, key.encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"] != "/health":
            got = next((v for k, v in scope["headers"] if k == b"authorization"), b"")
            scheme, _, token = got.partition(b" ")
            if scheme.lower() != b"bearer" or not hmac.compare_digest(token.strip(), self.want):  # (RFC 9110: any case)
                response = _error(401, "missing or wrong API key: send Authorization: Bearer KEY",
                                  "authentication_error")
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


def create_app(served: Served) -> FastAPI:
    app = FastAPI(title="gptoss-fp8", docs_url=None, redoc_url=None, openapi_url=None,
                  redirect_slashes=False)  # (a 307 to the route without its slash: clients drop POST bodies on it)
    engine = served.engine
    if served.api_key is not None:
        app.add_middleware(_Auth, key=served.api_key)
    boxes: list[Outbox] = []  # the one of the loop serving (a new loop, e.g. a restarted server: a new one)

    def outbox() -> Outbox:
        loop = asyncio.get_running_loop()
        if not boxes or boxes[-1].loop is not loop:
            if boxes and boxes[-1].flush in engine.after_step:
                engine.after_step.remove(boxes[-1].flush)
            boxes.append(Outbox(loop))
            engine.after_step.append(boxes[-1].flush)
        return boxes[-1]

    @app.exception_handler(HttpError)
    async def _http_error(request: Request, e: HttpError):
        return _error(e.status, e.message, e.kind, e.headers)

    @app.exception_handler(StarletteHTTPException)
    async def _routing_error(request: Request, e: StarletteHTTPException):  # no such route / method: OpenAI's form
        what = {404: f"no route {request.method} {request.url.path} here (docs/serve.md lists the endpoints)",
                405: f"{request.method} is not allowed on {request.url.path}"}.get(e.status_code, str(e.detail))
        return _error(e.status_code, what, "not_found_error" if e.status_code == 404 else "invalid_request_error",
                      getattr(e, "headers", None))

    @app.exception_handler(RequestValidationError)
    async def _bad_parameter(request: Request, e: RequestValidationError):  # (a query parameter: bodies go by parse())
        err = e.errors()[0]
        where = ".".join(str(x) for x in err["loc"][1:]) or "request"
        return _error(400, f"{where}: {err['msg']}", "invalid_request_error")

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, e: Exception):
        return _error(500, f"internal error: {type(e).__name__}: {e}", "server_error")

    @app.get("/health")
    async def health():
        if served.thread.error is not None or not served.thread.thread.is_alive():
            return _error(503, f"the engine stopped: {served.thread.error}", "server_error")
        return {"status": "ok"}

    def chat_only(route: str) -> None:
        if not served.vocab.chat:
            raise HttpError(400, f"{route}: this model's vocabulary is {served.vocab.name}, which has no chat format "
                                 "(Harmony); use /v1/completions, which continues text")

    def model_card() -> dict:
        return {"id": served.model_name, "object": "model", "created": served.created, "owned_by": "gptoss-fp8",
                "max_model_len": engine.max_context, "vocab_size": engine.vocab}  # (bench serve's random ids)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model:path}")  # (a model id may hold slashes: openai/gpt-oss-20b)
    async def model(model: str):
        if model != served.model_name:
            raise HttpError(404, f"model {model!r} is not served here; this server serves {served.model_name!r}",
                            "not_found_error")
        return model_card()

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(prometheus(engine), media_type="text/plain; version=0.0.4")

    async def format_rule(fmt: grammar.Format):
        """``grammar.constraint`` of fmt, compiled in a worker thread (the first builds llguidance's tokenizer, ~1 s;
        a large schema's grammar can take a while): the event loop serves the other streams meanwhile."""
        return await asyncio.to_thread(grammar.constraint, fmt, engine.vocab, served.vocab.name) if fmt.needed else None

    def sampling(req, prompt: list[int], stop_ids: tuple[int, ...], logprobs: bool,
                 top_logprobs: int, constraint=None) -> Callable[[int], SamplingParams]:
        """A chat or completions request's ``SamplingParams`` of choice i (its seed: ``seed + i``); ``constraint``: its
        output format's (serve/grammar.py)."""
        max_tokens = getattr(req, "max_completion_tokens", None) or req.max_tokens
        if max_tokens is None:
            max_tokens = max(1, engine.max_context - len(prompt))
        return lambda i: SamplingParams(max_tokens=max_tokens, temperature=req.temperature, top_p=req.top_p,
                                        seed=None if req.seed is None else req.seed + i,
                                        stop_token_ids=() if req.ignore_eos else stop_ids, logprobs=logprobs,
                                        top_logprobs=top_logprobs, presence_penalty=req.presence_penalty,
                                        frequency_penalty=req.frequency_penalty,
                                        logit_bias=tuple(sorted((req.logit_bias or {}).items())),
                                        repetition_penalty=req.repetition_penalty, constraint=constraint)

    def submit(prompt: list[int], model: str, n: int, params: Callable[[int], SamplingParams],
               keep: int = 0, limit: str = "max_tokens") -> list[tuple[Sequence, Listener]]:
        """A request's ``n`` choices, each a sequence of its own with ``params(i)``; ``keep``: the prompt's head the
        prefix cache keeps for other requests (a chat's system and developer messages); ``limit``: the request's name
        for its token limit (the engine's errors say max_tokens)."""
        if model != served.model_name:
            raise HttpError(404, f"model {model!r} is not served here; this server serves {served.model_name!r}",
                            "not_found_error")
        if n > engine.slots.total:
            raise HttpError(400, f"n {n}: this server runs at most {engine.slots.total} sequences at once "
                                 "(--max-batch); ask for fewer choices")
        added: list[tuple[Sequence, Listener]] = []
        try:
            for i in range(n):
                listener = Listener(outbox())
                added.append((engine.add(prompt, params(i), listener, keep=keep), listener))
        except (QueueFull, GptOssFp8Error) as e:
            for seq, _ in added:  # (all of the request's choices or none)
                engine.cancel(seq)
            if isinstance(e, QueueFull):
                raise HttpError(429, str(e), "rate_limit_error", {"Retry-After": "1"}) from None
            msg = str(e)
            raise HttpError(400, limit + msg.removeprefix("max_tokens") if msg.startswith("max_tokens ") else msg) from None
        return added

    async def events(seq: Sequence, listener: Listener, request: Request):
        """The request's events until it finishes, each carrying every token since the last (so a
        handler that fell behind catches up in one event, and one that keeps up gets each step's
        token at once); cancels the request if the client goes away."""
        done = False
        try:
            while True:
                ev = listener.take()
                if ev is None:
                    if not await listener.wait() and await request.is_disconnected():
                        return
                    continue
                yield ev
                if ev.finished:
                    done = True
                    return
        finally:
            if not done:
                engine.cancel(seq)

    async def choices(choice: list[tuple[Sequence, Listener]], request: Request, stopped: set[int]):
        """(i, event) of the choices' events as they come (one choice: its own stream as it is). A choice i
        put in ``stopped`` (a stop sequence ended it) is cancelled and gives no more events."""
        gens = [events(seq, listener, request) for seq, listener in choice]
        if len(gens) == 1:
            try:
                async for ev in gens[0]:
                    yield 0, ev
                    if stopped:
                        return
            finally:
                await gens[0].aclose()
            return
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(i: int) -> None:
            try:
                async for ev in gens[i]:
                    await queue.put((i, ev))
            finally:
                await queue.put((i, None))

        tasks = [asyncio.create_task(pump(i)) for i in range(len(gens))]
        left = len(gens)
        try:
            while left:
                i, ev = await queue.get()
                if ev is None:
                    left -= 1
                elif i not in stopped:
                    yield i, ev
                    for j in stopped:
                        tasks[j].cancel()
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            for g in gens:
                await g.aclose()

    async def reply(request: Request, req, prompt: list[int], choice: list[tuple[Sequence, Listener]],
                    outs: list[_Reply], head: dict):
        """The reply of a request (chat or completion, ``outs`` render its choices): streamed as SSE, one
        write per engine event (every token it carries, one chunk per kind of delta), or whole."""
        for i, out in enumerate(outs):
            out.index = i
        stopped: set[int] = set()
        gen = choices(choice, request, stopped)
        if not req.stream:
            last: list[Event | None] = [None] * len(outs)
            try:
                async for i, ev in gen:
                    last[i] = ev
                    outs[i].feed(ev)
                    if outs[i].hit:
                        stopped.add(i)
            finally:
                await gen.aclose()
            if any(ev is None or (not ev.finished and not out.hit) for ev, out in zip(last, outs, strict=True)):
                return _error(499, "client closed the request", "cancelled")
            failed = next((i for i, ev in enumerate(last) if ev.finish == "error"), None)
            if failed is not None:
                raise _failed(choice[failed][0], last[failed])
            return {**head, "object": outs[0].OBJECT, "choices": [out.whole(ev) for out, ev in zip(outs, last, strict=True)],
                    "usage": _usage(len(prompt), sum(out.n_out for out in outs), choice[0][0].cached)}

        try:
            i0, first = await anext(gen)  # an engine failure before any output is a plain 500
        except StopAsyncIteration:  # the client left before the first token (its choices cancelled)
            return _error(499, "client closed the request", "cancelled")
        if first.finish == "error" and not first.new:
            await gen.aclose()
            raise _failed(choice[i0][0], first)
        chunk = _Chunk({**head, "object": outs[0].CHUNK})
        usage = req.stream_options is not None and req.stream_options.include_usage

        async def sse():
            i, ev = i0, first
            ended: set[int] = set()
            try:
                parts = [chunk(c) for out in outs for c in out.opening()]
                while True:
                    out = outs[i]
                    out.feed(ev)
                    parts.extend(chunk(c) for c in out.choices())
                    if ev.finish == "error":
                        e = _failed(choice[i][0], ev)
                        parts.append(_sse({"error": {"message": e.message, "type": e.kind, "code": e.status}}))
                        yield "".join(parts)
                        return
                    if out.hit or ev.finished:
                        parts.extend(chunk(c) for c in out.closing(ev))
                        ended.add(i)
                        if out.hit:
                            stopped.add(i)
                    if len(ended) == len(outs):
                        if usage:
                            parts.append(_sse({**head, "object": out.CHUNK, "choices": [],
                                               "usage": _usage(len(prompt), sum(o.n_out for o in outs), choice[0][0].cached)}))
                        parts.append("data: [DONE]\n\n")
                        yield "".join(parts)
                        return
                    if parts:
                        yield "".join(parts)
                    parts = []
                    try:
                        i, ev = await anext(gen)
                    except StopAsyncIteration:  # the client left mid-stream: nothing more to write
                        return
            finally:
                await gen.aclose()
                for seq, _ in choice:
                    if not seq.finished:
                        engine.cancel(seq)

        return StreamingResponse(sse(), media_type="text/event-stream")

    async def body(request: Request, cls):
        """The request's body as ``cls`` (schema.py), or a one-line 400."""
        try:
            return parse(cls, await request.body(), (engine.max_context, served.vocab.max_token_bytes))
        except GptOssFp8Error as e:
            raise HttpError(400, str(e)) from None

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        req = await body(request, ChatRequest)
        chat_only("/v1/chat/completions")
        try:
            prompt, head = harmony.render_chat_head(req.messages, None if req.tool_choice == "none" else req.tools,
                                                    req.reasoning_effort)
            fmt = grammar.request_format(grammar.schema_of(req.response_format, "response_format"), req.tools,
                                         req.tool_choice)
            rule = await format_rule(fmt)
        except GptOssFp8Error as e:
            raise HttpError(400, str(e)) from None
        except (KeyError, TypeError, ValueError, AttributeError) as e:  # (a malformed part)
            raise HttpError(400, "messages, tools or tool_choice: cannot be rendered as a Harmony conversation "
                                 f"({_first_line(e)})") from None
        except BaseException as e:
            raise tokenizer_panic(e) from None
        choice = submit(prompt, req.model, req.n, sampling(req, prompt, harmony.STOP_IDS, req.logprobs,
                                                           req.top_logprobs or 0, rule), keep=head)
        head = {"id": f"chatcmpl-{uuid.uuid4().hex}", "created": int(time.time()), "model": served.model_name}
        return await reply(request, req, prompt, choice, [_ChatReply(req.stop or [], req.logprobs) for _ in choice], head)

    @app.post("/v1/completions")
    async def completions(request: Request):
        req = await body(request, CompletionRequest)
        try:
            prompt = list(req.prompt) if isinstance(req.prompt, list) else served.vocab.encode(req.prompt)
        except BaseException as e:
            raise tokenizer_panic(e) from None
        try:
            schema = grammar.schema_of(req.response_format, "response_format")
            rule = await format_rule(grammar.Format(schema, raw=True)) if schema is not None else None
        except GptOssFp8Error as e:
            raise HttpError(400, str(e)) from None
        choice = submit(prompt, req.model, req.n, sampling(req, prompt, tuple(sorted(served.vocab.stops)),
                                                           req.logprobs is not None, req.logprobs or 0, rule))
        head = {"id": f"cmpl-{uuid.uuid4().hex}", "created": int(time.time()), "model": served.model_name}
        return await reply(request, req, prompt, choice,
                           [_CompletionReply(served.vocab, req.stop or [], req.logprobs is not None, req.logprobs or 0)
                            for _ in choice], head)

    stored = ResponseStore()

    @app.post("/v1/responses")
    async def responses(request: Request):
        req = await body(request, ResponsesRequest)
        chat_only("/v1/responses")
        got = None
        if req.previous_response_id is not None:
            got = stored.get(req.previous_response_id)
            if got is None:
                raise HttpError(404, f"previous_response_id {req.previous_response_id!r}: no such response is stored "
                                     f"here (this server keeps the latest {stored.limit} responses made with store "
                                     "true, in memory); send the whole conversation as input instead",
                                "not_found_error")
        try:
            new = input_messages(req.input)
            conversation = [*(got.conversation if got else []), *new]
            head = [{"role": "developer", "content": req.instructions}] if req.instructions else []
            tools = chat_tools(req.tools)
            effort = req.reasoning.effort if req.reasoning else None
            header = header_key(req.instructions, None if req.tool_choice == "none" else tools, effort)
            if (got is not None and got.tokens is not None and got.header == header  # on from the model's own ids
                    and not any(m["role"] in ("system", "developer") for m in new)):  # (else: all rendered again)
                prompt = [*got.tokens, *harmony.render_after_call(new, harmony.call_names(got.conversation))]
                keep = got.keep
            else:
                prompt, keep = harmony.render_chat_head(head + conversation, None if req.tool_choice == "none" else tools,
                                                        effort)
            rule = await format_rule(grammar.request_format(
                grammar.schema_of(req.text.format.as_dict() if req.text else None, "text.format"), tools,
                req.tool_choice))
        except GptOssFp8Error as e:
            raise HttpError(400, str(e)) from None
        except (KeyError, TypeError, ValueError, AttributeError) as e:  # (a malformed part)
            raise HttpError(400, f"input, tools or tool_choice: cannot be rendered as a Harmony conversation "
                                 f"({_first_line(e)})") from None
        except BaseException as e:
            raise tokenizer_panic(e) from None
        include = set(req.include or ())
        logprobs = "message.output_text.logprobs" in include
        max_tokens = req.max_output_tokens or max(1, engine.max_context - len(prompt))
        params = SamplingParams(max_tokens=max_tokens, temperature=req.temperature, top_p=req.top_p,
                                stop_token_ids=harmony.STOP_IDS, logprobs=logprobs,
                                top_logprobs=(req.top_logprobs or 0) if logprobs else 0, constraint=rule)
        ((seq, listener),) = submit(prompt, req.model, 1, lambda i: params, keep=keep, limit="max_output_tokens")
        out = ResponseReply(new_response(req, served.model_name), logprobs, req.top_logprobs or 0,
                            "reasoning.encrypted_content" in include)

        def done(ev: Event) -> dict:
            response = out.finish(ev, len(prompt), seq.cached)
            if req.store and ev.finish != "error":
                called = ev.finish == "stop" and out.ids[-1:] == [harmony.CALL]
                stored.put(Stored(response, conversation + out.conversation(),
                                  array("i", prompt + out.ids) if called else None, header, keep, input_items(req.input)))
            return response

        gen = events(seq, listener, request)
        if not req.stream:
            last = None
            try:
                async for ev in gen:
                    out.feed(ev)
                    last = ev
            finally:
                await gen.aclose()
            if last is None or not last.finished:
                return _error(499, "client closed the request", "cancelled")
            if last.finish == "error":
                raise _failed(seq, last)
            return done(last)

        async def sse():  # (created at once: a failure after it is a response.failed event)
            out.emit("response.created", response=copy.deepcopy(out.response))
            out.emit("response.in_progress", response=copy.deepcopy(out.response))
            try:
                yield "".join(f"event: {e['type']}\ndata: {_JSON.encode(e)}\n\n" for e in out.take())
                async for ev in gen:
                    out.feed(ev)
                    if ev.finished:
                        done(ev)
                    yield "".join(f"event: {e['type']}\ndata: {_JSON.encode(e)}\n\n" for e in out.take())
            finally:
                await gen.aclose()
                if not seq.finished:  # (the client left, maybe before the events began)
                    engine.cancel(seq)

        return StreamingResponse(sse(), media_type="text/event-stream")

    @app.get("/v1/responses/{rid}")
    async def get_response(rid: str):
        got = stored.get(rid)
        if got is None:
            raise HttpError(404, f"response {rid!r} is not stored here (kept in memory: the latest {stored.limit} "
                                 "made with store true)", "not_found_error")
        return got.response

    @app.get("/v1/responses/{rid}/input_items")
    async def list_input_items(rid: str, after: str | None = None, limit: int = 20, order: str = "desc"):
        got = stored.get(rid)
        if got is None:
            raise HttpError(404, f"response {rid!r} is not stored here", "not_found_error")
        if not 1 <= limit <= 100 or order not in ("asc", "desc"):
            raise HttpError(400, f"limit {limit} / order {order!r}: give limit 1 to 100 and order asc or desc")
        try:
            return page(got.items, after, limit, order)
        except GptOssFp8Error as e:
            raise HttpError(400, str(e)) from None

    @app.delete("/v1/responses/{rid}")
    async def delete_response(rid: str):
        if not stored.pop(rid):
            raise HttpError(404, f"response {rid!r} is not stored here", "not_found_error")
        return {"id": rid, "object": "response.deleted", "deleted": True}

    return app


class _Reply:
    """A reply under construction: ``feed`` each engine Event (sets ``hit`` when a stop sequence
    ended it, counts ``n_out``), then either ``choices`` (the stream's chunks since the last call),
    or at the end ``closing`` (the stream's last chunks) / ``whole`` (the one choice of a reply
    that is not streamed)."""

    OBJECT = CHUNK = ""
    hit = False
    n_out = 0
    index = 0  # the choice's

    def opening(self) -> list[dict]:
        return []


class _CompletionReply(_Reply):
    """/v1/completions: ids -> text (stop ids are not text), stop sequences applied; a chunk per
    event with all its text and, when asked, each token's piece and log-probability, and its ``top``
    most likely tokens ({token text: log-probability}, the legacy API's ``top_logprobs``)."""

    OBJECT = CHUNK = "text_completion"

    def __init__(self, vocab: Vocab, stops: list[str], logprobs: bool, top: int = 0):
        self.vocab = vocab
        self.text, self.stop, self.logprobs, self.top = vocab.stream(), harmony.StopText(stops), logprobs, top
        self.pieces: list[str] = []
        self.lps: list[float] = []
        self.tops: list[dict[str, float]] = []
        self.sent = 0  # pieces already in a chunk

    def feed(self, ev: Event) -> None:
        for i, tok in enumerate(ev.new):
            piece, self.hit = self.stop.push("" if tok in self.vocab.stops else self.text.push(tok))
            self.pieces.append(piece)
            if ev.logprobs:
                self.lps.append(ev.logprobs[i])
            if self.top:
                self.tops.append(_top_dict(self.vocab, ev.top_logprobs[i] if ev.top_logprobs else []))
            self.n_out += 1
            if self.hit:
                break

    def choices(self) -> list[dict]:
        if self.sent == len(self.pieces):
            return []
        pieces, lps, tops = self.pieces[self.sent:], self.lps[self.sent:], self.tops[self.sent:]
        self.sent = len(self.pieces)
        logprobs = {"tokens": pieces, "token_logprobs": lps} if lps else None
        if logprobs is not None and self.top:
            logprobs["top_logprobs"] = tops
        return [{"index": self.index, "text": "".join(pieces), "finish_reason": None, "logprobs": logprobs}]

    def _tail(self) -> str:
        return "" if self.hit else self.text.flush() + self.stop.flush()

    def _reason(self, ev: Event) -> str:
        return "stop" if self.hit or ev.finish == "stop" else "length"

    def closing(self, ev: Event) -> list[dict]:
        return [{"index": self.index, "text": self._tail(), "finish_reason": self._reason(ev), "logprobs": None}]

    def whole(self, ev: Event) -> dict:
        text = "".join(self.pieces) + self._tail()
        logprobs = {"tokens": None, "token_logprobs": self.lps} if self.logprobs else None
        if logprobs is not None and self.top:
            logprobs["top_logprobs"] = self.tops
        return {"index": self.index, "text": text, "finish_reason": self._reason(ev), "logprobs": logprobs}


class _ChatReply(_Reply):
    """/v1/chat/completions: ids through Harmony (harmony.ReplyStream) into content, reasoning and
    tool-call deltas, stop sequences on the content; consecutive deltas of one kind in one event
    go out as one chunk (with each content token's log-probability when asked)."""

    OBJECT, CHUNK = "chat.completion", "chat.completion.chunk"

    def __init__(self, stops: list[str], logprobs: bool):
        self.reply, self.stop, self.logprobs = harmony.ReplyStream(), harmony.StopText(stops), logprobs
        self.deltas: list[dict] = []  # since the last choices(): {"content"|"reasoning_content": str, "lps": [...]}
        self.content: list[str] = []  # the whole reply (not streamed)
        self.reasoning: list[str] = []
        self.lps: list[dict] = []

    def _text(self, key: str, text: str, lp: dict | None) -> None:
        last = self.deltas[-1] if self.deltas else None
        if last is None or key not in last:
            last = {key: "", "lps": []}
            self.deltas.append(last)
        last[key] += text
        if lp is not None:
            last["lps"].append(lp)
            self.lps.append(lp)
        (self.content if key == "content" else self.reasoning).append(text)

    def feed(self, ev: Event) -> None:
        for i, tok in enumerate(ev.new):
            self.n_out += 1
            lp = ev.logprobs[i] if ev.logprobs else None
            top = ev.top_logprobs[i] if ev.top_logprobs else []
            for d in self.reply.push(tok):
                if d.kind == "content":
                    text, self.hit = self.stop.push(d.text)
                    if text:
                        self._text("content", text, None if lp is None else harmony.token_logprob(tok, lp, top))
                    if self.hit:
                        break
                elif d.kind == "reasoning":
                    self._text("reasoning_content", d.text, None)
                elif d.kind == "tool_call":
                    self.deltas.append({"tool_calls": [{"index": d.index, "id": f"call_{uuid.uuid4().hex[:24]}",
                                                        "type": "function", "function": {"name": d.name, "arguments": ""}}]})
                elif d.kind == "tool_args":
                    last = self.deltas[-1]["tool_calls"][0] if self.deltas and "tool_calls" in self.deltas[-1] else None
                    if last is not None and last["index"] == d.index and "id" not in last:
                        last["function"]["arguments"] += d.text
                    else:
                        self.deltas.append({"tool_calls": [{"index": d.index, "function": {"arguments": d.text}}]})
            if self.hit:
                break

    def opening(self) -> list[dict]:
        return [{"index": self.index, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]

    def choices(self) -> list[dict]:
        out = []
        for d in self.deltas:
            lps = d.pop("lps", None)
            choice = {"index": self.index, "delta": d, "finish_reason": None}
            if lps:
                choice["logprobs"] = {"content": lps}
            out.append(choice)
        self.deltas = []
        return out

    def _reason(self, ev: Event) -> str:
        if self.hit:
            return "stop"
        if ev.finish == "length":
            return "length"
        return "tool_calls" if self.reply.tool_calls and ev.stop == str(harmony.CALL) else "stop"

    def closing(self, ev: Event) -> list[dict]:
        tail = "" if self.hit else self.stop.flush()
        out = [{"index": self.index, "delta": {"content": tail}, "finish_reason": None}] if tail else []
        return out + [{"index": self.index, "delta": {}, "finish_reason": self._reason(ev)}]

    def whole(self, ev: Event) -> dict:
        if not self.hit:
            self.content.append(self.stop.flush())
        message = {"role": "assistant", "content": "".join(self.content) or None,
                   "reasoning_content": "".join(self.reasoning) or None}
        if self.reply.tool_calls:
            message["tool_calls"] = [{"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                                      "function": {"name": c["name"], "arguments": c["arguments"]}}
                                     for c in self.reply.tool_calls]
        return {"index": self.index, "message": message, "finish_reason": self._reason(ev),
                "logprobs": {"content": self.lps} if self.logprobs else None}


def _top_dict(vocab: Vocab, top: list[tuple[int, float]]) -> dict[str, float]:
    """The legacy completions' alternatives: {token text: log-probability}, most likely first (two ids of
    one text, e.g. bytes of a character: the likelier)."""
    out: dict[str, float] = {}
    for t, v in top:
        out.setdefault(vocab.token_text(t), v)
    return out


_JSON = json.JSONEncoder(separators=(",", ":"))


def _sse(obj: dict) -> str:
    return f"data: {_JSON.encode(obj)}\n\n"


class _Chunk:
    """SSE events of one stream: its head (id, object, created, model) encoded once, then each
    choice's JSON after it."""

    def __init__(self, head: dict):
        self.prefix = "data: " + _JSON.encode(head)[:-1] + ',"choices":['

    def __call__(self, choice: dict) -> str:
        return f"{self.prefix}{_JSON.encode(choice)}]}}\n\n"


def _usage(prompt: int, out: int, cached: int) -> dict:
    """OpenAI's usage; ``cached``: the prompt's tokens the prefix cache gave (its first choice's)."""
    return {"prompt_tokens": prompt, "completion_tokens": out, "total_tokens": prompt + out,
            "prompt_tokens_details": {"cached_tokens": cached}}


def prometheus(engine: Engine) -> str:
    """The engine's state and counters in Prometheus' text format."""
    s, m = engine.stats(), engine.metrics
    lines = []

    def gauge(name: str, value, help_: str, kind: str = "gauge") -> None:
        lines.extend([f"# HELP {name} {help_}", f"# TYPE {name} {kind}", f"{name} {value}"])

    gauge("gptoss_requests_running", s["running"], "Requests holding a KV slot (prefilling or decoding).")
    gauge("gptoss_requests_waiting", s["waiting"], "Requests queued for a KV slot.")
    gauge("gptoss_kv_slots_used", s["slots_used"], "KV cache slots in use.")
    gauge("gptoss_kv_slots_total", s["slots_total"], "KV cache slots (sized at start).")
    gauge("gptoss_prompt_tokens_total", m.prompt_tokens, "Prompt tokens prefilled.", "counter")
    gauge("gptoss_prompt_cached_tokens_total", m.cached_tokens,
          "Prompt tokens taken from the prefix cache instead of prefilled.", "counter")
    gauge("gptoss_prefix_cache_prompts", s["cached_prompts"], "Prompts held in the KV cache for reuse.")
    gauge("gptoss_generation_tokens_total", m.generated_tokens, "Tokens generated.", "counter")
    gauge("gptoss_engine_steps_total", m.steps, "Engine steps run.", "counter")
    gauge("gptoss_engine_model_seconds_total", round(m.model_seconds, 6),
          "Seconds of engine steps in the model's calls and the sampler (the rest of a step's time is the host's).",
          "counter")
    gauge("gptoss_structured_checked_tokens_total", m.structured_checked,
          "Structured output's tokens drawn freely and checked against their grammar.", "counter")
    gauge("gptoss_structured_refused_tokens_total", m.structured_refused,
          "Of the checked tokens, those the grammar refused (drawn again through its mask).", "counter")
    gauge("gptoss_structured_masked_tokens_total", m.structured_masked,
          "Structured output's tokens drawn through their grammar's mask made first (top_p < 1, or after a refusal).",
          "counter")
    lines.extend(["# HELP gptoss_requests_finished_total Requests finished, by reason.",
                  "# TYPE gptoss_requests_finished_total counter"])
    for reason, n in sorted(m.requests_finished.items()):
        lines.append(f'gptoss_requests_finished_total{{reason="{reason}"}} {n}')
    for name, h, help_ in (("gptoss_time_to_first_token_seconds", m.ttft, "Arrival to first token."),
                           ("gptoss_inter_token_latency_seconds", m.itl, "Between a request's successive tokens.")):
        lines.extend([f"# HELP {name} {help_}", f"# TYPE {name} histogram"])
        for b, c in zip(h.bounds, h.cumulative(), strict=True):
            lines.append(f'{name}_bucket{{le="{b}"}} {c}')
        lines.extend([f'{name}_bucket{{le="+Inf"}} {h.total}', f"{name}_sum {h.sum}", f"{name}_count {h.total}"])
    return "\n".join(lines) + "\n"
