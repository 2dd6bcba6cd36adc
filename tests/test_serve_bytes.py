"""gptoss-fp8 serve on a byte-level model, the trained fixture (golden/trained, ByT5's ids): /v1/completions
continues text as generate does, through the official openai client on a real server; the chat APIs, which need
Harmony's vocabulary, are one-line 400s."""

import httpx
import openai
import pytest
from serve_util import running_server

from gptoss_fp8.model.backends import get_ops
from gptoss_fp8.tokenizer import ByteTokenizer
from gptoss_fp8.verify import generate as gen

pytest.importorskip("fastapi")

MODEL = "trained"
PROMPT = "import sys\n\n\ndef main():\n"


@pytest.fixture(scope="module")
def server(trained):
    with running_server(trained[0], model_name=MODEL, max_batch=2, max_context=256, chunk=64) as s:
        yield s


@pytest.fixture
def client(server):
    with openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0) as c:
        yield c


def test_completions_continue_text_as_generate_does(server, client):
    tok = ByteTokenizer()
    alone = gen.generate(server.served.engine.runner.model, tok.encode(PROMPT), get_ops("weights"), max_new_tokens=24)
    assert len(alone.tokens) == 24 and tok.eos not in alone.tokens  # (the trained model writes on here)
    want = tok.decode(alone.tokens)
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0, logprobs=2)
    assert r.choices[0].text == want and r.choices[0].finish_reason == "length"
    assert r.usage.prompt_tokens == len(PROMPT.encode()) and r.usage.completion_tokens == 24
    tops = r.choices[0].logprobs.top_logprobs  # each token's alternatives, keyed by their one-byte text
    assert len(tops) == 24 and all(len(t) == 2 and max(t, key=t.get) == c for t, c in zip(tops, want, strict=True))
    streamed = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0, stream=True))
    assert "".join(c.choices[0].text for c in streamed) == want
    ids = client.completions.create(model=MODEL, prompt=tok.encode(PROMPT), max_tokens=24, temperature=0)
    assert ids.choices[0].text == want  # the same prompt as token ids
    cut = want[12:15]  # a stop sequence from within the reply: the text ends before its first match
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0, stop=[cut])
    assert r.choices[0].text == want[:want.index(cut)] and r.choices[0].finish_reason == "stop"
    r = client.completions.create(model=MODEL, prompt=PROMPT, temperature=0)  # no max_tokens: OpenAI's default, 16
    assert r.choices[0].text == want[:16] and r.usage.completion_tokens == 16 and r.choices[0].finish_reason == "length"
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0, logit_bias={str(tok.eos): 100})
    assert (r.choices[0].text, r.choices[0].finish_reason, r.usage.completion_tokens) == ("", "stop", 1)  # eos ends it


def test_a_completion_held_to_a_json_schema(client):
    """Structured output over the byte-level vocabulary (the completions API's raw JSON): the reply is JSON that fits
    the schema, ended by the vocabulary's </s> once whole; greedy, sampled, streamed alike."""
    pytest.importorskip("llguidance")
    import json

    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                               "n": {"type": "integer", "minimum": 0, "maximum": 99}},
              "required": ["name", "n"], "additionalProperties": False}
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    texts = []
    for kw in ({"temperature": 0}, {"temperature": 1.0, "seed": 3}):
        r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=64, extra_body={"response_format": fmt},
                                      **kw)
        texts.append(r.choices[0].text)
        body = json.loads(r.choices[0].text)
        assert r.choices[0].finish_reason == "stop" and set(body) == {"name", "n"}, r.choices[0].text
        assert len(body["name"]) <= 12 and 0 <= body["n"] <= 99
    streamed = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=64, temperature=0, stream=True,
                                         extra_body={"response_format": fmt})
    assert "".join(c.choices[0].text for c in streamed) == texts[0]


def test_the_docs_structured_example_closes(server):
    """docs/serve.md's curl request held to a schema, as written there (its model name aside): the trained model's
    reply is whole JSON that fits the schema, ended before max_tokens."""
    pytest.importorskip("llguidance")
    import json
    import pathlib
    import re

    doc = (pathlib.Path(__file__).parents[1] / "docs" / "serve.md").read_text()
    (body,) = [json.loads(b) for b in re.findall(r"-d '(\{.*?\})'", doc, re.S) if "response_format" in b]
    body["model"] = MODEL
    r = httpx.post(server.url + "/v1/completions", json=body, timeout=60).json()
    (choice,) = r["choices"]
    reply = json.loads(choice["text"])
    assert choice["finish_reason"] == "stop" and set(reply) == {"name"} and len(reply["name"]) <= 20, choice


@pytest.mark.parametrize("path, body, where", [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}, "no chat format"),
    ("/v1/responses", {"input": "hi"}, "no chat format"),
    ("/v1/completions", {"prompt": [300]}, "token id 300 is outside the vocabulary (vocab_size 259)"),
])
def test_what_a_byte_level_model_refuses(server, path, body, where):
    r = httpx.post(server.url + path, json={"model": MODEL, **body})
    msg = r.json()["error"]["message"]
    assert r.status_code == 400 and where in msg and "\n" not in msg, msg


def test_bench_serve_sends_ids_of_the_served_vocabulary(server, client):
    from gptoss_fp8.bench import serve as bs

    assert client.models.list().data[0].model_extra["vocab_size"] == 259
    assert all(3 <= t < 259 for p in bs.token_prompts(4, 64, 259, seed=1) for t in p)  # bytes, not the specials
    (row,) = bs.bench(server.url, model=None, concurrency=[2], prompt_lens=[16], output_len=3, requests=2, procs=1,
                      echo=lambda *_: None)  # (the default vocab is o200k's: its ids would all be refused)
    assert row["failed"] == 0 and row["requests"] == 2
