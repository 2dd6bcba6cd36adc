"""gptoss-fp8 serve through the official openai client against a real uvicorn server on loopback:
chat (plain and streamed), reasoning content, a tool-call round trip, stop sequences, seeds,
completions from token ids equal to generate, logprobs, and what bad requests get.

The synthetic weights give noise, so the Harmony tests script the model's choices (the engine's
sampler replaced by a list of ids): the mechanics (rendering, parsing, streaming, stops) are real."""

import asyncio
import json

import httpx
import openai
import pytest
from serve_util import MODEL, metric, running_server, wait_idle

from gptoss_fp8.model.backends import get_ops
from gptoss_fp8.runtime.prefix import MIN_SHARED
from gptoss_fp8.verify import generate as gen

pytest.importorskip("openai_harmony")

CTX = 384


@pytest.fixture(scope="module")
def server(harmony_ckpt):
    with running_server(harmony_ckpt, max_batch=4, max_context=CTX, chunk=16) as s:
        yield s


def _user(text):
    return [{"role": "user", "content": text}]


REASONED = ("<|channel|>analysis<|message|>User asks 2+2. Answer 4.<|end|><|start|>assistant<|channel|>final"
            "<|message|>2 + 2 = 4.<|return|>")


def test_models_and_health(server, client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}


def test_chat_reasoning_content_plain_and_streamed(client, script):
    script(REASONED)
    r = client.chat.completions.create(model=MODEL, messages=_user("What is 2+2?"), max_tokens=64, temperature=0)
    msg = r.choices[0].message
    assert msg.content == "2 + 2 = 4." and msg.reasoning_content == "User asks 2+2. Answer 4."
    assert r.choices[0].finish_reason == "stop" and r.usage.completion_tokens == len(gen._encoding().encode(
        REASONED, allowed_special="all"))
    chunks = list(client.chat.completions.create(model=MODEL, messages=_user("What is 2+2?"), max_tokens=64,
                                                 stream=True, stream_options={"include_usage": True}))
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    reasoning = "".join(getattr(c.choices[0].delta, "reasoning_content", None) or "" for c in chunks if c.choices)
    assert content == "2 + 2 = 4." and reasoning == "User asks 2+2. Answer 4."
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    assert chunks[-1].usage.completion_tokens == r.usage.completion_tokens
    r = client.chat.completions.create(model=MODEL, messages=_user("What is 2+2?"), logprobs=True)
    lps = r.choices[0].logprobs.content  # one per token of the final answer
    assert "".join(lp.token for lp in lps) == "2 + 2 = 4." and {lp.logprob for lp in lps} == {-0.5}
    chunks = list(client.chat.completions.create(model=MODEL, messages=_user("What is 2+2?"), logprobs=True,
                                                 stream=True))
    lps = [lp for c in chunks if c.choices and c.choices[0].logprobs for lp in c.choices[0].logprobs.content]
    assert "".join(lp.token for lp in lps) == "2 + 2 = 4." == "".join(c.choices[0].delta.content or "" for c in chunks)


def test_chat_top_logprobs_and_penalties_reach_the_engine(server, client, script, monkeypatch):
    script(REASONED)
    seen = []
    add = server.served.engine.add
    monkeypatch.setattr(server.served.engine, "add",
                        lambda prompt, params, *a, **kw: seen.append(params) or add(prompt, params, *a, **kw))
    r = client.chat.completions.create(model=MODEL, messages=_user("What is 2+2?"), logprobs=True, top_logprobs=2,
                                       presence_penalty=0.5, frequency_penalty=-1.0,
                                       extra_body={"repetition_penalty": 1.2})
    lps = r.choices[0].logprobs.content
    assert "".join(lp.token for lp in lps) == "2 + 2 = 4." and all(len(lp.top_logprobs) == 2 for lp in lps)
    enc = gen._encoding()
    for lp in lps:  # the request's first 2 of the sampler's 3, with their texts and bytes
        tok = enc.encode(lp.token, allowed_special="all")[0]
        assert [(t.token, t.logprob) for t in lp.top_logprobs] == [(lp.token, -0.5), (enc.decode([tok + 1]), -1.5)]
        assert all(bytes(t.bytes).decode("utf-8", "replace") == t.token for t in lp.top_logprobs)
    chunks = list(client.chat.completions.create(model=MODEL, messages=_user("What is 2+2?"), logprobs=True,
                                                 top_logprobs=1, stream=True))
    lps = [lp for c in chunks if c.choices and c.choices[0].logprobs for lp in c.choices[0].logprobs.content]
    assert [[t.token for t in lp.top_logprobs] for lp in lps] == [[lp.token] for lp in lps] and lps
    assert [(p.top_logprobs, p.presence_penalty, p.frequency_penalty, p.repetition_penalty) for p in seen] == [
        (2, 0.5, -1.0, 1.2), (1, 0, 0, 1)]


def test_completions_top_logprobs_are_the_models(client):
    r = client.completions.create(model=MODEL, prompt=[5, 6, 7, 8], max_tokens=8, temperature=0, logprobs=3,
                                  extra_body={"ignore_eos": True})
    lp = r.choices[0].logprobs
    assert len(lp.token_logprobs) == len(lp.top_logprobs) == 8
    for chosen, top in zip(lp.token_logprobs, lp.top_logprobs, strict=True):  # greedy: the chosen token is the likeliest
        values = list(top.values())
        assert 1 <= len(top) <= 3 and values == sorted(values, reverse=True) and values[0] == pytest.approx(chosen)
    chunks = list(client.completions.create(model=MODEL, prompt=[5, 6, 7, 8], max_tokens=8, temperature=0, logprobs=3,
                                            stream=True, extra_body={"ignore_eos": True}))
    assert [t for c in chunks if c.choices[0].logprobs for t in c.choices[0].logprobs.top_logprobs] == lp.top_logprobs


def test_logit_bias_moves_the_greedy_choice(client):
    kw = dict(model=MODEL, prompt=[5, 6, 7, 8], max_tokens=6, temperature=0, extra_body={"ignore_eos": True})
    greedy = client.completions.create(logprobs=1, **kw).choices[0]
    first = gen._encoding().encode(greedy.text, allowed_special="all")[0]
    forced = client.completions.create(logit_bias={"42": 100}, **kw).choices[0].text
    assert forced == gen._encoding().decode([42] * 6)
    banned = client.completions.create(logit_bias={str(first): -100}, logprobs=1, **kw).choices[0]
    assert not banned.text.startswith(gen._encoding().decode([first]))
    # the reported log-probabilities stay the model's: its first choice there is the banned token
    assert list(banned.logprobs.top_logprobs[0]) == [gen._encoding().decode([first])]


def test_chat_length_limit(client, script):
    script(REASONED)
    r = client.chat.completions.create(model=MODEL, messages=_user("What is 2+2?"), max_tokens=3)
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 3


TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]


def test_tool_call_round_trip(client, script):
    seen = script('<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant<|channel|>commentary'
                  '<|message|>Checking.<|end|><|start|>assistant<|channel|>commentary to=functions.get_weather '
                  '<|constrain|>json<|message|>{"city": "Paris"}<|call|>')
    messages = [{"role": "system", "content": "Answer in Celsius."}, *_user("Weather in Paris?")]
    r = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, reasoning_effort="low", max_tokens=64)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.reasoning_content == "Need the weather."
    assert choice.message.content == "Checking."  # (the preamble before the call)
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}
    prompt = gen._encoding().decode(seen[0])  # tools in the developer message, effort in the system one
    assert "type get_weather = (_: {" in prompt and "Reasoning: low" in prompt and "Answer in Celsius." in prompt

    seen = script("<|channel|>final<|message|>It is 21 C in Paris.<|return|>")
    messages += [{"role": "assistant", "content": "Checking.", "reasoning_content": "Need the weather.",
                  "tool_calls": [call.model_dump()]},
                 {"role": "tool", "tool_call_id": call.id, "content": '{"celsius": 21}'}]
    r = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, max_tokens=64)
    assert r.choices[0].message.content == "It is 21 C in Paris." and r.choices[0].finish_reason == "stop"
    prompt = gen._encoding().decode(seen[0])
    # the turn rendered back as it came: its reasoning, its preamble on commentary before the call (not a final answer)
    assert ("<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant<|channel|>commentary<|message|>"
            "Checking.<|end|><|start|>assistant to=functions.get_weather" in prompt), prompt
    assert "<|channel|>final<|message|>Checking." not in prompt
    assert ('to=functions.get_weather<|channel|>commentary <|constrain|>json<|message|>{"city": "Paris"}' in prompt
            or 'to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}' in prompt), prompt
    assert '<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>{"celsius": 21}' in prompt

    script('<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Rome"}<|call|>')
    chunks = list(client.chat.completions.create(model=MODEL, messages=_user("Rome?"), tools=TOOLS, stream=True))
    calls = [tc for c in chunks for tc in (c.choices[0].delta.tool_calls or [])]
    assert calls[0].function.name == "get_weather" and calls[0].id.startswith("call_")
    assert json.loads("".join(tc.function.arguments or "" for tc in calls)) == {"city": "Rome"}
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_stop_sequences_cut_the_reply_and_free_the_slot(server, client, script):
    script("<|channel|>final<|message|>Hello world. STOP and more text<|return|>")
    r = client.chat.completions.create(model=MODEL, messages=_user("hi"), stop=["STOP", "never"], max_tokens=64)
    assert r.choices[0].message.content == "Hello world. " and r.choices[0].finish_reason == "stop"
    chunks = list(client.chat.completions.create(model=MODEL, messages=_user("hi"), stop="STOP", stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == "Hello world. "
    r = client.completions.create(model=MODEL, prompt="Say hello", stop=[" world"], max_tokens=64)
    assert r.choices[0].text == "<|channel|>final<|message|>Hello" and r.choices[0].finish_reason == "stop"
    wait_idle(server)


def test_n_choices_are_the_requests_with_seeds_seed_plus_i(server, client):
    kw = dict(model=MODEL, prompt=[5, 6, 7, 8], max_tokens=10, temperature=1.0, extra_body={"ignore_eos": True})
    r = client.completions.create(n=3, seed=7, logprobs=0, **kw)
    alone = [client.completions.create(seed=7 + i, **kw).choices[0].text for i in range(3)]
    assert [c.index for c in r.choices] == [0, 1, 2] and [c.text for c in r.choices] == alone and len(set(alone)) == 3
    assert r.usage.prompt_tokens == 4 and r.usage.completion_tokens == 30
    assert all(len(c.logprobs.token_logprobs) == 10 for c in r.choices)
    chunks = list(client.completions.create(n=3, seed=7, stream=True, stream_options={"include_usage": True}, **kw))
    texts, ends = ["", "", ""], [[], [], []]
    for c in chunks:
        for ch in c.choices:
            texts[ch.index] += ch.text
            ends[ch.index] += [ch.finish_reason] if ch.finish_reason else []
    assert texts == alone and ends == [["length"]] * 3 and chunks[-1].usage.completion_tokens == 30
    wait_idle(server)


def test_n_choices_stop_each_on_its_own(server, client, script):
    script("<|channel|>final<|message|>Hello world. STOP and more text<|return|>")
    r = client.chat.completions.create(model=MODEL, messages=_user("hi"), stop="STOP", n=2, max_tokens=64)
    assert [(c.index, c.message.content, c.finish_reason) for c in r.choices] == [(i, "Hello world. ", "stop")
                                                                                 for i in range(2)]
    chunks = list(client.chat.completions.create(model=MODEL, messages=_user("hi"), stop="STOP", n=2, stream=True))
    for i in range(2):
        mine = [ch for c in chunks for ch in c.choices if ch.index == i]
        assert mine[0].delta.role == "assistant" and [ch.finish_reason for ch in mine if ch.finish_reason] == ["stop"]
        assert "".join(ch.delta.content or "" for ch in mine) == "Hello world. "
    wait_idle(server)


def test_a_conversations_next_turn_reuses_its_prompt(server, client, script):
    from gptoss_fp8.serve.harmony import encoding

    seen = script("<|channel|>final<|message|>Four.<|return|>")
    turn = [{"role": "user", "content": "What is two plus two, in words?"}]
    before = metric(httpx.get(server.url + "/metrics").text, "gptoss_prompt_cached_tokens_total")
    r = client.chat.completions.create(model=MODEL, messages=turn, max_tokens=16)
    # (the system message alone is a head every chat without instructions shares: an earlier test's kept it)
    assert r.choices[0].message.content == "Four." and r.usage.prompt_tokens_details.cached_tokens in (0, _SYSTEM)
    turn += [{"role": "assistant", "content": "Four."}, {"role": "user", "content": "And three plus three?"}]
    chunks = list(client.chat.completions.create(model=MODEL, messages=turn, max_tokens=16, stream=True,
                                                 stream_options={"include_usage": True}))
    first, second = seen
    reply = encoding().encode("<|channel|>final<|message|>Four.", allowed_special="all")  # (then <|return|>)
    # Harmony renders the first turn's prompt again, then the reply (<|end|> for its <|return|>) and the question: the
    # prompt and the reply's tokens but the last are reused (the first request's end was saved)
    assert second[:len(first) + len(reply)] == first + reply
    assert chunks[-1].usage.prompt_tokens == len(second)
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == len(first) + len(reply)
    m = wait_idle(server)
    assert metric(m, "gptoss_prompt_cached_tokens_total") == (before + r.usage.prompt_tokens_details.cached_tokens
                                                              + len(first) + len(reply))


def test_conversations_with_the_same_instructions_share_their_head(server, client, script):
    system = {"role": "system", "content": "You answer in one word, about the tides of the North Sea only."}
    seen = script("<|channel|>final<|message|>Yes.<|return|>")
    r1 = client.chat.completions.create(model=MODEL, messages=[system, {"role": "user", "content": "Is it high tide?"}],
                                        max_tokens=8)
    r2 = client.chat.completions.create(model=MODEL, messages=[system, {"role": "user", "content": "And at noon?"}],
                                        max_tokens=8)
    head = len(harmony_head(system))
    assert seen[1][:head] == seen[0][:head] and seen[1][head:] != seen[0][head:]
    assert r1.usage.prompt_tokens_details.cached_tokens in (0, _SYSTEM)  # (the system message alone: another's head)
    assert r2.usage.prompt_tokens_details.cached_tokens == head and r2.choices[0].message.content == "Yes."
    wait_idle(server)


def test_a_document_asked_about_again_reuses_the_shared_part(server, client, script):
    doc = "The tides of the North Sea rise and fall twice a day, as the moon pulls. " * 8
    seen = script("<|channel|>final<|message|>Yes.<|return|>")
    r1 = client.chat.completions.create(model=MODEL, messages=_user(doc + "Is that so?"), max_tokens=8)
    r2 = client.chat.completions.create(model=MODEL, messages=_user(doc + "Why twice?"), max_tokens=8)
    shared = next(i for i, (x, y) in enumerate(zip(*seen, strict=False)) if x != y)
    rebuild = 15  # the ring of the one sliding layer (window 16) rebuilt from the last 15 shared tokens
    assert shared - rebuild > max(_SYSTEM, MIN_SHARED) and r1.choices[0].message.content == "Yes."
    assert r2.usage.prompt_tokens_details.cached_tokens == shared - rebuild and r2.choices[0].message.content == "Yes."
    wait_idle(server)


def harmony_head(*system: dict) -> list[int]:
    from gptoss_fp8.serve.harmony import render_chat_head

    prompt, head = render_chat_head([*system, {"role": "user", "content": "x"}])
    return prompt[:head]


_SYSTEM = len(harmony_head())  # Harmony's system message, the head of a chat without instructions

def test_completions_from_token_ids_equal_generate(server, client):
    model = server.served.engine.runner.model
    prompt = list(range(1000, 1037))  # 37 tokens: three prefill chunks of 16 on the server
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0, logprobs=0,
                                  extra_body={"ignore_eos": True})
    alone = gen.generate(model, prompt, get_ops("weights"), max_new_tokens=12)
    assert r.usage.completion_tokens == 12 and r.usage.prompt_tokens == 37
    assert r.choices[0].text == gen._encoding().decode(alone.tokens)
    assert len(r.choices[0].logprobs.token_logprobs) == 12 and all(lp <= 0 for lp in r.choices[0].logprobs.token_logprobs)


def test_seeds(client):
    def run(seed, **kw):
        r = client.completions.create(model=MODEL, prompt=[5, 6, 7, 8], max_tokens=16, temperature=1.0, seed=seed,
                                      logprobs=0, extra_body={"ignore_eos": True}, **kw)
        return r.choices[0].text, r.choices[0].logprobs.token_logprobs

    a, b, c = run(11), run(11), run(12)
    assert a == b and a != c
    top = run(11, top_p=0.05)  # a nucleus this small keeps the argmax only: the greedy reply
    greedy = client.completions.create(model=MODEL, prompt=[5, 6, 7, 8], max_tokens=16, temperature=0,
                                       extra_body={"ignore_eos": True})
    assert top[0] == greedy.choices[0].text


def _post(server, path, body, **kw):
    return httpx.post(server.url + path, content=body if isinstance(body, (bytes, str)) else json.dumps(body), **kw)


def test_bad_requests_are_one_line_400s(server):
    cases = [
        (b"{not json", "not valid JSON"),
        ({"model": MODEL, "messages": _user("hi"), "temprature": 0.5}, "temprature: unknown field"),
        ({"model": MODEL, "messages": []}, "messages"),
        ({"model": MODEL, "messages": _user("hi"), "n": 5}, "n 5: this server runs at most 4 sequences"),
        ({"model": MODEL, "messages": _user("hi"), "n": 0}, "n:"),
        ({"model": MODEL, "messages": _user("hi"), "top_logprobs": 2}, "top_logprobs 2 needs logprobs"),
        ({"model": MODEL, "messages": _user("hi"), "logprobs": True, "top_logprobs": 21}, "top_logprobs:"),
        ({"model": MODEL, "messages": _user("hi"), "presence_penalty": 2.5}, "presence_penalty:"),
        ({"model": MODEL, "messages": _user("hi"), "logit_bias": {"x": 1}}, "logit_bias.x"),
        ({"model": MODEL, "messages": _user("hi"), "logit_bias": {"10000000": 1}}, "logit_bias token id 10000000 is outside"),
        ({"model": MODEL, "messages": _user("hi"), "logit_bias": {"5": -101}}, "logit_bias of token 5: -101"),
        ({"model": MODEL, "messages": _user("hi"), "max_tokens": CTX}, f"exceed the context of {CTX} tokens"),
        ({"model": MODEL, "messages": [{"role": "robot", "content": "x"}]}, "message role 'robot'"),
        ({"model": MODEL, "messages": _user("hi"), "seed": 2**70}, "seed: Input should be less than or equal to"),
        ({"model": MODEL, "messages": [{"role": "user"}]}, "message 0 (user) has no content"),
        ({"model": MODEL, "messages": _user("hi") + [{"role": "tool", "tool_call_id": "c"}]}, "message 1 (tool) has no"),
        ({"model": MODEL, "messages": _user("hi") + [{"role": "assistant"}] + _user("hi")},
         "message 1 (assistant) has neither content nor tool_calls"),
        ({"model": MODEL, "messages": _user("hi"), "stream": "yes"}, "stream: Input should be a valid boolean"),
        ({"model": MODEL, "messages": _user("hi"), "logprobs": 1}, "logprobs: Input should be a valid boolean"),
    ]
    for body, want in cases:
        r = _post(server, "/v1/chat/completions", body)
        msg = r.json()["error"]["message"]
        assert r.status_code == 400 and want in msg and "\n" not in msg, (body, r.status_code, msg)
    r = _post(server, "/v1/completions", {"model": MODEL, "prompt": list(range(CTX + 5))})
    assert r.status_code == 400 and f"the context is {CTX} tokens" in r.json()["error"]["message"]
    r = _post(server, "/v1/completions", {"model": MODEL, "prompt": [1, 10**7]})
    assert r.status_code == 400 and "outside the vocabulary" in r.json()["error"]["message"]
    for prompt in ([True, 2], [1.0], [["a"]], ["a", 5], None):
        r = _post(server, "/v1/completions", {"model": MODEL, "prompt": prompt})
        assert r.status_code == 400 and "give a string or a list of token ids" in r.json()["error"]["message"], prompt
    r = _post(server, "/v1/completions", {"model": "gpt-4", "prompt": [1]})
    assert r.status_code == 404 and MODEL in r.json()["error"]["message"]


def test_queue_full_is_429_with_retry_after(server, monkeypatch):
    import contextlib

    monkeypatch.setattr(server.served.engine.scheduler, "max_waiting", 0)  # no queue beyond the 4 slots
    body = {"model": MODEL, "prompt": [1, 2], "max_tokens": 300, "ignore_eos": True, "stream": True}
    with httpx.Client(base_url=server.url, timeout=60) as c, contextlib.ExitStack() as streams:
        for _ in range(4):  # each stream's headers come with its first token: it holds a slot
            assert streams.enter_context(c.stream("POST", "/v1/completions", json=body)).status_code == 200
        r = c.post("/v1/completions", json={**body, "stream": False})
        assert r.status_code == 429 and r.headers["retry-after"] == "1"
        assert "all 4 KV slots are taken" in r.json()["error"]["message"]
    wait_idle(server)  # the 4 streams closed: cancelled, their slots free


def test_a_request_that_raises_fails_alone(server, monkeypatch):
    runner = server.served.engine.runner
    real = runner.prefill

    def prefill(slot, tokens, start):
        if 999 in tokens:
            raise RuntimeError("injected fault")
        return real(slot, tokens, start)

    def prefill_many(chunks):  # the step's prompts in one forward: it raises, then each runs alone
        if any(999 in tokens for _, tokens, _ in chunks):
            raise RuntimeError("injected fault")
        return real_many(chunks)

    real_many = runner.prefill_many
    monkeypatch.setattr(runner, "prefill", prefill)
    monkeypatch.setattr(runner, "prefill_many", prefill_many)

    async def main():
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as c:
            good = c.post("/v1/completions", json={"model": MODEL, "prompt": list(range(1, 40)), "max_tokens": 20,
                                                   "ignore_eos": True, "temperature": 0})
            bad = c.post("/v1/completions", json={"model": MODEL, "prompt": [5, 999, 7], "max_tokens": 20})
            return await asyncio.gather(good, bad)

    good, bad = asyncio.run(main())
    assert bad.status_code == 500 and "injected fault" in bad.json()["error"]["message"]
    assert good.status_code == 200 and good.json()["usage"]["completion_tokens"] == 20
    assert 'reason="error"' in wait_idle(server)


def test_api_key_guards_every_route_but_health(harmony_ckpt):
    with running_server(harmony_ckpt, max_batch=1, max_context=128, api_key="sekrit") as s:
        assert httpx.get(s.url + "/health").status_code == 200
        for path in ("/v1/models", "/metrics"):
            assert httpx.get(s.url + path).status_code == 401
        assert httpx.get(s.url + "/v1/models", headers={"Authorization": "Bearer sekrit"}).status_code == 200
        for header in ("bearer sekrit", "BEARER  sekrit"):  # (the scheme's case is free, RFC 9110)
            assert httpx.get(s.url + "/v1/models", headers={"Authorization": header}).status_code == 200
        for header in ("Bearer sekri", "Basic sekrit", "sekrit", "Bearer sekrit2"):
            assert httpx.get(s.url + "/v1/models", headers={"Authorization": header}).status_code == 401
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=s.url + "/v1", api_key="wrong", max_retries=0).models.list()
        ok = openai.OpenAI(base_url=s.url + "/v1", api_key="sekrit", max_retries=0)
        assert ok.completions.create(model=MODEL, prompt=[1, 2, 3], max_tokens=2).usage.completion_tokens >= 1
