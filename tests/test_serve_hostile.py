"""Hostile bodies (found by fuzzing the server): each is a one-line 400 in OpenAI's error form, answered at once,
and the server (and the client's keep-alive connection) goes on serving: JSON nested past Python's reader, lone
UTF-16 surrogates, runs of characters the tokenizer would take seconds on (it holds the GIL: every stream waits),
bodies over 16 MiB, a trailing slash, a bad query parameter, a tokenizer panic, an output format that fails while
the reply is drawn."""

import time

import httpx
import pytest
from serve_util import MODEL, running_server

pytest.importorskip("openai_harmony")


@pytest.fixture(scope="module")
def server(harmony_ckpt):
    with running_server(harmony_ckpt, max_batch=2, max_context=128, chunk=16) as s:
        yield s


def _refused(r: httpx.Response, status: int, *needles: str) -> str:
    assert r.status_code == status, r.text
    msg = r.json()["error"]["message"]
    assert "\n" not in msg and all(n in msg for n in needles), msg
    return msg


def _served(c: httpx.Client) -> None:
    r = c.post("/v1/completions", json={"model": MODEL, "prompt": [11, 12], "max_tokens": 2})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2, r.text


@pytest.mark.parametrize("name, path, raw, status, needles", [
    ("nested", "/v1/completions", b"[" * 100000 + b"]" * 100000, 400, ("nests deeper",)),
    ("nested-content", "/v1/chat/completions",
     b'{"model": "m", "messages": [{"role": "user", "content": ' + b"[" * 5000 + b"]" * 5000 + b"}]}", 400,
     ("nests deeper",)),
    ("surrogate", "/v1/completions", b'{"model": "m", "prompt": "ab\\ud800", "max_tokens": 2}', 400,
     ("prompt: character 2 is a lone UTF-16 surrogate",)),
    ("surrogate-chat", "/v1/chat/completions", b'{"model": "m", "messages": [{"role": "user", "content": "\\udfff"}]}',
     400, ("messages[0].content: character 0 is a lone UTF-16 surrogate",)),
    ("run", "/v1/completions", b'{"model": "m", "prompt": "' + b"a" * 60000 + b'"}', 400,
     ("prompt: runs of characters without a break", "here 60000 from character 0")),
    ("run-chat", "/v1/responses", b'{"model": "m", "input": "x ' + "中".encode() * 40000 + b'"}', 400,
     ("input: runs of characters", "here 40000 from character 2")),
    ("runs", "/v1/completions", b'{"model": "m", "prompt": "' + (b"!" * 20000 + b" 1") * 9 + b'"}', 400,
     ("prompt: runs of characters",)),
    ("context", "/v1/chat/completions",
     b'{"model": "m", "messages": [{"role": "user", "content": "' + b"a b " * 100000 + b'"}]}', 400,
     ("the request holds 400", "more than a context of 128 tokens (--max-context) can")),
    ("huge", "/v1/completions", b'{"model": "m", "prompt": "' + b"ab " * (6 << 20) + b'"}', 400,
     ("at most 16777216",)),
    ("slash", "/v1/chat/completions/", b'{"model": "m", "messages": []}', 404, ("no route POST /v1/chat/completions/",)),
])
def test_hostile_bodies_are_400s_at_once(server, name, path, raw, status, needles):
    with httpx.Client(base_url=server.url, timeout=60) as c:  # (one keep-alive connection: it must survive)
        t = time.perf_counter()
        _refused(c.post(path, content=raw, headers={"content-type": "application/json"}), status, *needles)
        assert time.perf_counter() - t < 5  # (the tokenizer on "a" * 300000 was ~33 s, every stream waiting)
        _served(c)


def test_a_run_the_tokenizer_takes_quickly_is_served(server):
    with httpx.Client(base_url=server.url, timeout=60) as c:
        r = c.post("/v1/completions", json={"model": MODEL, "prompt": "a" * 300 + " b" * 20, "max_tokens": 2})
        assert r.status_code == 200, r.text


def test_a_bad_query_parameter_is_openais_400(server):
    with httpx.Client(base_url=server.url, timeout=60) as c:
        _refused(c.get("/v1/responses/resp_x/input_items", params={"limit": "abc"}), 400, "limit: ")
        r = c.get("/v1/responses/resp_x/input_items", params={"limit": "5"})
        assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"


def test_a_tokenizer_panic_is_a_400(server, monkeypatch):
    from gptoss_fp8.serve import harmony

    class PanicException(BaseException):  # (what pyo3 raises for a Rust panic: not an Exception)
        pass

    def panics(*a, **kw):
        raise PanicException("called `Result::unwrap()` on an `Err` value: RuntimeError(StackOverflow)\nbacktrace")

    monkeypatch.setattr(harmony, "render_chat_head", panics)
    with httpx.Client(base_url=server.url, timeout=60) as c:
        _refused(c.post("/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}),
                 400, "the tokenizer could not take this text", "StackOverflow")
        _served(c)


def test_an_output_format_failing_mid_reply_is_a_400(server):
    """A schema llguidance compiles but no finite JSON fits (an object that must hold itself): its matcher fails as
    the reply is drawn; the request's fault, so 400 (streamed: an error event of that type), one line."""
    pytest.importorskip("llguidance")
    schema = {"$defs": {"n": {"type": "object", "properties": {"c": {"$ref": "#/$defs/n"}}, "required": ["c"]}},
              "$ref": "#/$defs/n"}
    body = {"model": MODEL, "prompt": "x", "max_tokens": 100, "temperature": 0,
            "response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": schema}}}
    with httpx.Client(base_url=server.url, timeout=120) as c:
        r = c.post("/v1/completions", json=body)
        if r.status_code == 200:  # (the reply ended before the matcher's limit: nothing to test on this draw)
            pytest.fail(f"the self-holding schema gave a reply: {r.text[:200]}")
        msg = _refused(r, 400, "the output format failed at token")
        assert len(msg) < 500
        _served(c)


def test_the_responses_token_limit_is_named_as_sent(server):
    with httpx.Client(base_url=server.url, timeout=60) as c:
        _refused(c.post("/v1/responses", json={"model": MODEL, "input": "hi", "max_output_tokens": 10**9}), 400,
                 "max_output_tokens 1000000000: the ", "ask for at most")
        _refused(c.post("/v1/completions", json={"model": MODEL, "prompt": [1, 2], "max_tokens": 10**9}), 400,
                 "max_tokens 1000000000: the ")


def test_max_token_bytes_holds_for_each_vocabulary():
    """check_text's context rule rests on it: no id's text holds more bytes than its vocabulary says."""
    from gptoss_fp8.serve.vocab import byte_vocab, harmony_vocab

    for v in (harmony_vocab(), byte_vocab()):
        ids = range(199998) if v.name == "o200k_harmony" else range(3, 259)  # (the text ids: specials aside)
        assert max(len(v.token_bytes(i)) for i in ids) == v.max_token_bytes, v.name
    assert len(harmony_vocab().encode(" " * 10000)) >= 10000 / 128


@pytest.mark.parametrize("path, body, needles", [
    ("/v1/responses", {"input": [{"type": "message", "role": "tool", "content": "x"}]},
     ("input item 0: role 'tool'; use user, assistant, system or developer", "function_call_output")),
    ("/v1/responses", {"input": [{"type": "function_call_output", "call_id": "zz", "output": "1"}]},
     ("a tool result for call id 'zz'", "function_call_output's call_id", "answers no tool call before it")),
    ("/v1/chat/completions", {"messages": [{"role": "tool", "tool_call_id": "zz", "content": "1"}]},
     ("a tool result for call id 'zz'", "a tool message's tool_call_id")),
    ("/v1/completions", {"prompt": "x", "temperature": float("nan")}, ("temperature: Input should be a finite number",)),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"5": float("inf")}}, ("logit_bias.5: Input should be a finite",)),
])
def test_messages_name_the_api_they_came_in(server, path, body, needles):
    import json

    with httpx.Client(base_url=server.url, timeout=60) as c:  # (json.dumps writes NaN / Infinity, as some clients do)
        _refused(c.post(path, content=json.dumps({"model": MODEL, **body}), headers={"content-type": "application/json"}),
                 400, *needles)
