"""The FastAPI app: OpenAI routes over an ``EngineThread`` (runtime/engine.py).

Each request: body parsed (schema.py; one-line 400s), its prompt rendered to ids (Harmony for
chat, the tokenizer or the ids themselves for completions), ``engine.add`` (400 when it cannot
fit, 429 when the queue is full), then the engine's events for it read from an asyncio queue
that the engine's thread feeds (``call_soon_threadsafe``): ids in, text / reasoning / tool-call
deltas out. A client that goes away (a failed send, or ``is_disconnected`` polled while waiting)
cancels its request, which frees its KV slot at the next step boundary. A request the engine
failed is a 500 for it alone (or an error event mid-stream).
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from dataclasses import dataclass, field

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

from gptoss_fp8.errors import GptOssFp8Error
from gptoss_fp8.runtime.engine import Engine, EngineThread
from gptoss_fp8.runtime.sampling import SamplingParams
from gptoss_fp8.runtime.scheduler import QueueFull
from gptoss_fp8.runtime.sequence import Sequence
from gptoss_fp8.serve import harmony
from gptoss_fp8.serve.schema import ChatRequest, CompletionRequest, parse

POLL_S = 0.25  # how often a waiting handler checks that its client is still there


@dataclass
class Served:
    """What an app serves: the engine and its thread, the model's name, the key (None: open)."""

    engine: Engine
    thread: EngineThread
    model_name: str
    api_key: str | None = None
    created: int = field(default_factory=lambda: int(time.time()))


class HttpError(Exception):
    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.kind, self.headers = status, message, kind, headers


def _error(status: int, message: str, kind: str, headers: dict | None = None) -> JSONResponse:
    line = message.replace("\n", " ")
    return JSONResponse({"error": {"message": line, "type": kind, "param": None, "code": status}}, status, headers=headers)


@dataclass
class Event:
    new: list[int]
    finished: bool
    finish: str | None
    stop: str | None
    error: str | None
    logprobs: list[float]


class Listener:
    """The engine thread's ``on_event`` -> an asyncio queue on the app's loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop, self.queue = loop, asyncio.Queue()

    def __call__(self, seq: Sequence, new: list[int]) -> None:
        lp = seq.logprobs[len(seq.logprobs) - len(new):] if seq.params.logprobs and new else []
        ev = Event(list(new), seq.finished, seq.finish, seq.stop, seq.error, list(lp))
        self.loop.call_soon_threadsafe(self.queue.put_nowait, ev)


def create_app(served: Served) -> FastAPI:
    app = FastAPI(title="gptoss-fp8", docs_url=None, redoc_url=None, openapi_url=None)
    engine = served.engine

    @app.middleware("http")
    async def _auth(request: Request, call_next):
        if served.api_key is not None and request.url.path != "/health":
            if request.headers.get("authorization", "") != f"Bearer {served.api_key}":
                return _error(401, "missing or wrong API key: send Authorization: Bearer KEY", "authentication_error")
        return await call_next(request)

    @app.exception_handler(HttpError)
    async def _http_error(request: Request, e: HttpError):
        return _error(e.status, e.message, e.kind, e.headers)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, e: Exception):
        return _error(500, f"internal error: {type(e).__name__}: {e}", "server_error")

    @app.get("/health")
    async def health():
        if served.thread.error is not None or not served.thread.thread.is_alive():
            return _error(503, f"the engine stopped: {served.thread.error}", "server_error")
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": served.model_name, "object": "model", "created": served.created,
                                            "owned_by": "gptoss-fp8", "max_model_len": engine.max_context}]}

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(prometheus(engine), media_type="text/plain; version=0.0.4")

    def submit(prompt: list[int], req, stop_ids: tuple[int, ...], logprobs: bool) -> tuple[Sequence, Listener]:
        if req.model != served.model_name:
            raise HttpError(404, f"model {req.model!r} is not served here; this server serves {served.model_name!r}",
                            "not_found_error")
        max_tokens = getattr(req, "max_completion_tokens", None) or req.max_tokens
        if max_tokens is None:
            max_tokens = max(1, engine.max_context - len(prompt))
        params = SamplingParams(max_tokens=max_tokens, temperature=req.temperature, top_p=req.top_p, seed=req.seed,
                                stop_token_ids=() if req.ignore_eos else stop_ids, logprobs=logprobs)
        listener = Listener(asyncio.get_running_loop())
        try:
            seq = engine.add(prompt, params, listener)
        except QueueFull as e:
            raise HttpError(429, str(e), "rate_limit_error", {"Retry-After": "1"}) from None
        except GptOssFp8Error as e:
            raise HttpError(400, str(e)) from None
        return seq, listener

    async def events(seq: Sequence, listener: Listener, request: Request):
        """The request's events until it finishes; cancels it if the client goes away."""
        done = False
        try:
            while True:
                try:
                    ev = await asyncio.wait_for(listener.queue.get(), POLL_S)
                except asyncio.TimeoutError:
                    if await request.is_disconnected():
                        return
                    continue
                yield ev
                if ev.finished:
                    done = True
                    return
        finally:
            if not done:
                engine.cancel(seq)

    async def body(request: Request) -> bytes:
        return await request.body()

    # --- chat ------------------------------------------------------------------------------------
    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        try:
            req = parse(ChatRequest, await body(request))
            prompt = harmony.render_chat(req.messages, None if req.tool_choice == "none" else req.tools,
                                         req.reasoning_effort)
        except GptOssFp8Error as e:
            raise HttpError(400, str(e)) from None
        except (KeyError, TypeError, ValueError) as e:
            raise HttpError(400, f"messages: cannot be rendered as a Harmony conversation ({e})") from None
        seq, listener = submit(prompt, req, harmony.STOP_IDS, req.logprobs)
        rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        reply, stop = harmony.ReplyStream(), harmony.StopText(req.stop or [])
        head = {"id": rid, "created": created, "model": served.model_name}

        def finish_reason(ev: Event, stopped: bool) -> str:
            if stopped:
                return "stop"
            if ev.finish == "length":
                return "length"
            return "tool_calls" if reply.tool_calls and ev.stop == str(harmony.CALL) else "stop"

        def token_deltas(tok: int, lp: float | None) -> tuple[list[dict], bool]:
            out, hit = [], False
            for d in reply.push(tok):
                if d.kind == "content":
                    text, hit = stop.push(d.text)
                    if text:
                        out.append({"content": text})
                    if hit:
                        break
                elif d.kind == "reasoning":
                    out.append({"reasoning_content": d.text})
                elif d.kind == "tool_call":
                    out.append({"tool_calls": [{"index": d.index, "id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                                                "function": {"name": d.name, "arguments": ""}}]})
                else:
                    out.append({"tool_calls": [{"index": d.index, "function": {"arguments": d.text}}]})
            if lp is not None and out and "content" in out[-1]:
                out[-1] = {**out[-1], "_logprob": {"token": harmony.encoding().decode([tok]), "logprob": lp,
                                                   "bytes": list(harmony.encoding().decode([tok]).encode()),
                                                   "top_logprobs": []}}
            return out, hit

        if req.stream:
            gen = events(seq, listener, request)
            first = await anext(gen)  # an engine failure before any output is a plain 500
            if first.finish == "error" and not first.new:
                raise HttpError(500, first.error or "the request failed", "server_error")

            async def sse():
                n_out, stopped = 0, False
                yield _sse({**head, "object": "chat.completion.chunk",
                            "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                         "finish_reason": None}]})
                ev = first
                try:
                    while True:
                        for i, tok in enumerate(ev.new):
                            n_out += 1
                            deltas, stopped = token_deltas(tok, ev.logprobs[i] if ev.logprobs else None)
                            for d in deltas:
                                lp = d.pop("_logprob", None)
                                choice = {"index": 0, "delta": d, "finish_reason": None}
                                if lp is not None:
                                    choice["logprobs"] = {"content": [lp]}
                                yield _sse({**head, "object": "chat.completion.chunk", "choices": [choice]})
                            if stopped:
                                break
                        if ev.finish == "error":
                            yield _sse({"error": {"message": ev.error, "type": "server_error", "code": 500}})
                            break
                        if stopped or ev.finished:
                            tail = "" if stopped else stop.flush()
                            if tail:
                                yield _sse({**head, "object": "chat.completion.chunk",
                                            "choices": [{"index": 0, "delta": {"content": tail}, "finish_reason": None}]})
                            yield _sse({**head, "object": "chat.completion.chunk",
                                        "choices": [{"index": 0, "delta": {}, "finish_reason": finish_reason(ev, stopped)}]})
                            if req.stream_options and req.stream_options.include_usage:
                                yield _sse({**head, "object": "chat.completion.chunk", "choices": [],
                                            "usage": _usage(len(prompt), n_out)})
                            yield "data: [DONE]\n\n"
                            break
                        ev = await anext(gen)
                finally:
                    await gen.aclose()
                    if not seq.finished:
                        engine.cancel(seq)

            return StreamingResponse(sse(), media_type="text/event-stream")

        content, reasoning, lps = [], [], []
        stopped, n_out, last = False, 0, None
        async for ev in events(seq, listener, request):
            last = ev
            for i, tok in enumerate(ev.new):
                n_out += 1
                deltas, stopped = token_deltas(tok, ev.logprobs[i] if ev.logprobs else None)
                for d in deltas:
                    if "_logprob" in d:
                        lps.append(d["_logprob"])
                    content.append(d.get("content", ""))
                    reasoning.append(d.get("reasoning_content", ""))
                if stopped:
                    break
            if stopped:
                engine.cancel(seq)
                break
        if last is None or (not last.finished and not stopped):
            return _error(499, "client closed the request", "cancelled")
        if last.finish == "error":
            raise HttpError(500, last.error or "the request failed", "server_error")
        if not stopped:
            content.append(stop.flush())
        message = {"role": "assistant", "content": "".join(content) or None, "reasoning_content": "".join(reasoning) or None}
        if reply.tool_calls:
            message["tool_calls"] = [{"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                                      "function": {"name": c["name"], "arguments": c["arguments"]}}
                                     for c in reply.tool_calls]
        choice = {"index": 0, "message": message, "finish_reason": finish_reason(last, stopped),
                  "logprobs": {"content": lps} if req.logprobs else None}
        return {**head, "object": "chat.completion", "choices": [choice], "usage": _usage(len(prompt), n_out)}

    # --- completions -------------------------------------------------------------------------------
    @app.post("/v1/completions")
    async def completions(request: Request):
        try:
            req = parse(CompletionRequest, await body(request))
        except GptOssFp8Error as e:
            raise HttpError(400, str(e)) from None
        prompt = req.prompt if isinstance(req.prompt, list) else harmony.encoding().encode(req.prompt, allowed_special="all")
        seq, listener = submit(list(prompt), req, (*harmony.STOP_IDS, harmony.ENDOFTEXT), req.logprobs is not None)
        rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        head = {"id": rid, "object": "text_completion", "created": created, "model": served.model_name}
        text = _Detok()
        stop = harmony.StopText(req.stop or [])
        stop_ids = {harmony.RETURN, harmony.CALL, harmony.ENDOFTEXT}

        def pieces(ev: Event) -> tuple[list[tuple[str, float | None]], bool]:
            out, hit = [], False
            for i, tok in enumerate(ev.new):
                piece = "" if tok in stop_ids else text.push(tok)
                piece, hit = stop.push(piece)
                out.append((piece, ev.logprobs[i] if ev.logprobs else None))
                if hit:
                    break
            return out, hit

        def reason(ev: Event, stopped: bool) -> str:
            return "stop" if stopped or ev.finish == "stop" else "length"

        if req.stream:
            gen = events(seq, listener, request)
            first = await anext(gen)
            if first.finish == "error" and not first.new:
                raise HttpError(500, first.error or "the request failed", "server_error")

            async def sse():
                n_out, ev = 0, first
                try:
                    while True:
                        out, hit = pieces(ev)
                        for piece, lp in out:  # one chunk per token (an incomplete character: empty text)
                            n_out += 1
                            yield _sse({**head, "choices": [{"index": 0, "text": piece, "finish_reason": None,
                                                             "logprobs": None if lp is None else
                                                             {"tokens": [piece], "token_logprobs": [lp]}}]})
                        if ev.finish == "error":
                            yield _sse({"error": {"message": ev.error, "type": "server_error", "code": 500}})
                            break
                        if hit or ev.finished:
                            tail = "" if hit else text.flush() + stop.flush()
                            yield _sse({**head, "choices": [{"index": 0, "text": tail, "finish_reason": reason(ev, hit),
                                                             "logprobs": None}]})
                            if req.stream_options and req.stream_options.include_usage:
                                yield _sse({**head, "choices": [], "usage": _usage(len(prompt), n_out)})
                            yield "data: [DONE]\n\n"
                            break
                        ev = await anext(gen)
                finally:
                    await gen.aclose()
                    if not seq.finished:
                        engine.cancel(seq)

            return StreamingResponse(sse(), media_type="text/event-stream")

        parts, lps, hit, n_out, last = [], [], False, 0, None
        async for ev in events(seq, listener, request):
            last = ev
            out, hit = pieces(ev)
            n_out += len(out)
            parts.extend(p for p, _ in out)
            lps.extend(lp for _, lp in out)
            if hit:
                engine.cancel(seq)
                break
        if last is None or (not last.finished and not hit):
            return _error(499, "client closed the request", "cancelled")
        if last.finish == "error":
            raise HttpError(500, last.error or "the request failed", "server_error")
        if not hit:
            parts.append(text.flush() + stop.flush())
        logprobs = {"tokens": None, "token_logprobs": lps} if req.logprobs is not None else None
        return {**head, "choices": [{"index": 0, "text": "".join(parts), "finish_reason": reason(last, hit),
                                     "logprobs": logprobs}], "usage": _usage(len(prompt), n_out)}

    return app


class _Detok:
    """Generated ids -> text pieces, holding back an incomplete UTF-8 character."""

    def __init__(self):
        self.ids: list[int] = []
        self.shown = 0

    def push(self, tok: int) -> str:
        self.ids.append(tok)
        text = harmony.encoding().decode(self.ids)
        if text.endswith("\ufffd"):
            return ""
        piece, self.shown = text[self.shown:], len(text)
        return piece

    def flush(self) -> str:
        text = harmony.encoding().decode(self.ids) if self.ids else ""
        piece, self.shown = text[self.shown:], len(text)
        return piece


def _sse(obj: dict) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


def _usage(prompt: int, out: int) -> dict:
    return {"prompt_tokens": prompt, "completion_tokens": out, "total_tokens": prompt + out}


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
    gauge("gptoss_generation_tokens_total", m.generated_tokens, "Tokens generated.", "counter")
    gauge("gptoss_engine_steps_total", m.steps, "Engine steps run.", "counter")
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
