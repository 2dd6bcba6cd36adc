"""gptoss-fp8 serve's Responses API (POST /v1/responses, GET / DELETE /v1/responses/{id}) through the official openai
client against a real uvicorn server on loopback: output items from Harmony (reasoning, messages with their phase,
function calls), OpenAI's stream events (checked by the client's own stream accumulator), a tool-call round trip
through previous_response_id, the token limit, stored responses, logprobs, reasoning passed back, bad input.

The synthetic weights give noise, so the model's choices are scripted (serve_util.scripted); the rendering, parsing,
streaming and storing are real."""

import json

import httpx
import openai
import pytest
from serve_util import MODEL, metric, running_server, wait_idle

from gptoss_fp8.serve import harmony
from gptoss_fp8.verify import generate as gen

pytest.importorskip("openai_harmony")

REASONED = ("<|channel|>analysis<|message|>User asks 2+2. Answer 4.<|end|><|start|>assistant<|channel|>final"
            "<|message|>2 + 2 = 4.<|return|>")
CALL = ("<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant<|channel|>commentary<|message|>"
        "Checking the weather.<|end|><|start|>assistant<|channel|>commentary to=functions.get_weather "
        '<|constrain|>json<|message|>{"city": "Paris"}<|call|>')
TOOLS = [{"type": "function", "name": "get_weather", "description": "Current weather in a city",
          "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}]


@pytest.fixture(scope="module")
def server(harmony_ckpt):
    with running_server(harmony_ckpt, max_batch=2, max_context=512, chunk=64) as s:
        yield s


def _ids(text):
    return gen._encoding().encode(text, allowed_special="all")


def test_reasoning_and_answer_plain_and_streamed(server, client, script):
    seen = script(REASONED)
    r = client.responses.create(model=MODEL, input="What is 2+2?", instructions="Be brief.",
                                reasoning={"effort": "low"}, max_output_tokens=64)
    assert r.status == "completed" and r.output_text == "2 + 2 = 4." and r.error is None
    reasoning, message = r.output
    assert reasoning.type == "reasoning" and reasoning.summary == []
    assert [c.text for c in reasoning.content] == ["User asks 2+2. Answer 4."] and reasoning.encrypted_content is None
    assert message.type == "message" and message.phase == "final_answer" and message.status == "completed"
    assert r.usage.input_tokens == len(seen[0]) and r.usage.output_tokens == len(_ids(REASONED))
    assert 0 < r.usage.output_tokens_details.reasoning_tokens < r.usage.output_tokens
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    # the prompt is the chat API's rendering of the same conversation
    want, _ = harmony.render_chat_head([{"role": "system", "content": "Be brief."},
                                        {"role": "user", "content": "What is 2+2?"}], None, "low")
    assert seen[0] == want and "Reasoning: low" in gen._encoding().decode(seen[0])

    with client.responses.stream(model=MODEL, input="What is 2+2?", instructions="Be brief.",
                                 reasoning={"effort": "low"}, max_output_tokens=64) as stream:
        events = list(stream)
        final = stream.get_final_response()  # the client's own accumulation of the events
    assert [e.sequence_number for e in events] == list(range(len(events)))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    assert kinds.count("response.output_item.added") == kinds.count("response.output_item.done") == 2
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == "User asks 2+2. Answer 4."
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == "2 + 2 = 4."
    assert final.output_text == "2 + 2 = 4." and final.usage.output_tokens == r.usage.output_tokens
    assert [item.type for item in final.output] == ["reasoning", "message"] and final.id != r.id


def test_a_tool_call_round_trip_through_previous_response_id(server, client, script):
    seen = script(CALL)
    r = client.responses.create(model=MODEL, input="Weather in Paris?", instructions="Answer in Celsius.", tools=TOOLS)
    assert [item.type for item in r.output] == ["reasoning", "message", "function_call"]
    assert r.output[1].phase == "commentary" and r.output[1].content[0].text == "Checking the weather."
    call = r.output[2]
    assert call.name == "get_weather" and json.loads(call.arguments) == {"city": "Paris"}
    assert call.call_id.startswith("call_") and r.status == "completed" and r.output_text == "Checking the weather."
    first = seen[0]
    assert "type get_weather = (_: {" in gen._encoding().decode(first)

    seen = script("<|channel|>final<|message|>It is 21 C in Paris.<|return|>")
    r2 = client.responses.create(model=MODEL, previous_response_id=r.id, tools=TOOLS, instructions="Answer in Celsius.",
                                 input=[{"type": "function_call_output", "call_id": call.call_id,
                                         "output": '{"celsius": 21}'}])
    assert r2.output_text == "It is 21 C in Paris." and r2.previous_response_id == r.id
    prompt = seen[0]
    # the model ended the first turn with a call: the next prompt goes on from its own ids (the first prompt, the
    # reply as generated, then the tool's output and <|start|>assistant), and the prefix cache gives back all of the
    # first prompt and reply but the <|call|> (the reply's last token is not in the KV cache)
    tool = harmony.render_after_call([{"role": "tool", "tool_call_id": call.call_id, "content": '{"celsius": 21}'}],
                                     {call.call_id: "get_weather"})
    assert prompt == first + _ids(CALL) + tool
    assert gen._encoding().decode(tool) == ('<|start|>functions.get_weather to=assistant<|channel|>commentary'
                                            '<|message|>{"celsius": 21}<|end|><|start|>assistant')
    assert r2.usage.input_tokens_details.cached_tokens == len(first) + len(_ids(CALL)) - 1
    # the same conversation sent whole (the client's items back as input): Harmony's rendering of it, the preamble on
    # its channel (its call header as Harmony writes it, so the cache gives back less)
    seen = script("<|channel|>final<|message|>It is 21 C in Paris.<|return|>")
    items = [{"role": "user", "content": "Weather in Paris?"}, *[item.model_dump(exclude_none=True) for item in r.output],
             {"type": "function_call_output", "call_id": call.call_id, "output": '{"celsius": 21}'}]
    r3 = client.responses.create(model=MODEL, input=items, tools=TOOLS, store=False, instructions="Answer in Celsius.")
    want, _ = harmony.render_chat_head([
        {"role": "system", "content": "Answer in Celsius."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "reasoning_content": "Need the weather."},
        {"role": "assistant", "content": "Checking the weather.", "channel": "commentary"},
        {"role": "assistant", "tool_calls": [{"id": call.call_id, "function": {"name": "get_weather",
                                                                            "arguments": call.arguments}}]},
        {"role": "tool", "tool_call_id": call.call_id, "content": '{"celsius": 21}'}],
        [{"type": "function", "function": {k: TOOLS[0][k] for k in ("name", "description", "parameters")}}])
    text = gen._encoding().decode(seen[0])
    assert seen[0] == want and r3.output_text == r2.output_text and '{"celsius": 21}' in text
    assert "<|channel|>commentary<|message|>Checking the weather.<|end|>" in text  # the preamble stays one
    assert len(first) < r3.usage.input_tokens_details.cached_tokens < len(want)
    # the first turn's instructions are not carried over (as in OpenAI's API): another header, so the stored
    # conversation is rendered again without them
    seen = script("<|channel|>final<|message|>It is 21 C in Paris.<|return|>")
    client.responses.create(model=MODEL, previous_response_id=r.id, tools=TOOLS,
                            input=[{"type": "function_call_output", "call_id": call.call_id, "output": '{"celsius": 21}'}])
    text = gen._encoding().decode(seen[0])
    assert "Answer in Celsius." not in text and '{"celsius": 21}' in text and "Need the weather." in text
    # a developer message after the call changes the header: the conversation rendered again, the message in it
    seen = script("<|channel|>final<|message|>21 C.<|return|>")
    client.responses.create(model=MODEL, previous_response_id=r.id, tools=TOOLS, instructions="Answer in Celsius.",
                            input=[{"role": "developer", "content": "Be terse."},
                                   {"type": "function_call_output", "call_id": call.call_id, "output": "21"}])
    text = gen._encoding().decode(seen[0])
    assert "Answer in Celsius.\n\nBe terse." in text and seen[0][:len(first)] != first
    # a response that ended with a final answer keeps no ids: the next turn is Harmony's rendering (it drops the
    # finished turn's reasoning)
    seen = script("<|channel|>final<|message|>Anything else?<|return|>")
    r4 = client.responses.create(model=MODEL, previous_response_id=r2.id, tools=TOOLS, instructions="Answer in Celsius.",
                                 input="Thanks.")
    text = gen._encoding().decode(seen[0])
    assert r4.output_text == "Anything else?" and text.endswith("<|start|>user<|message|>Thanks.<|end|><|start|>assistant")
    assert "It is 21 C in Paris.<|end|>" in text

    # streamed: the call's arguments as deltas, then done with the whole of them
    script(CALL)
    with client.responses.stream(model=MODEL, input="Weather in Paris?", tools=TOOLS) as stream:
        events = list(stream)
        final = stream.get_final_response()
    args = [e for e in events if e.type.startswith("response.function_call_arguments")]
    assert "".join(e.delta for e in args[:-1]) == args[-1].arguments == call.arguments
    assert final.output[2].arguments == call.arguments and final.output[2].status == "completed"


def test_the_token_limit_is_an_incomplete_response(client, script):
    script(REASONED)
    r = client.responses.create(model=MODEL, input="What is 2+2?", max_output_tokens=4)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.output_tokens == 4 and r.output[-1].status == "incomplete"
    script(REASONED)
    events = list(client.responses.create(model=MODEL, input="What is 2+2?", max_output_tokens=4, stream=True))
    assert events[-1].type == "response.incomplete" and events[-1].response.status == "incomplete"
    assert events[-2].type == "response.output_item.done" and events[-2].item.status == "incomplete"


def test_stored_responses_get_delete_and_store_false(server, client, script):
    script(REASONED)
    r = client.responses.create(model=MODEL, input="What is 2+2?", metadata={"k": "v"})
    got = client.responses.retrieve(r.id)
    assert got.output_text == r.output_text and got.metadata == {"k": "v"} and got.usage == r.usage
    assert [(i.type, i.role, i.content[0].text) for i in client.responses.input_items.list(r.id)] == [
        ("message", "user", "What is 2+2?")]
    r2 = client.responses.create(model=MODEL, previous_response_id=r.id, input=[
        {"role": "user", "content": "and 3+3?"}, {"role": "user", "content": [{"type": "input_text", "text": "and 4+4?"}]},
        {"role": "user", "content": "and 5+5?"}])
    items = client.responses.input_items.list(r2.id)  # this response's own input, newest first
    assert [i.content[0].text for i in items.data] == ["and 5+5?", "and 4+4?", "and 3+3?"] and not items.has_more
    first = client.responses.input_items.list(r2.id, order="asc", limit=2)
    assert [i.content[0].text for i in first.data] == ["and 3+3?", "and 4+4?"] and first.has_more
    rest = client.responses.input_items.list(r2.id, order="asc", after=first.last_id)
    assert [i.content[0].text for i in rest.data] == ["and 5+5?"] and len({i.id for i in items.data}) == 3
    client.responses.delete(r.id)
    with pytest.raises(openai.NotFoundError, match="not stored here"):
        client.responses.retrieve(r.id)
    with pytest.raises(openai.NotFoundError, match="previous_response_id"):
        client.responses.create(model=MODEL, input="and 3+3?", previous_response_id=r.id)
    script(REASONED)
    r = client.responses.create(model=MODEL, input="What is 2+2?", store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)


def test_output_text_logprobs_and_reasoning_passed_back_sealed(client, script):
    script(REASONED)
    r = client.responses.create(model=MODEL, input="What is 2+2?", top_logprobs=2,
                                include=["message.output_text.logprobs", "reasoning.encrypted_content"])
    lps = r.output[1].content[0].logprobs  # one per token of the answer, the sampler's first 2 alternatives
    assert "".join(lp.token for lp in lps) == "2 + 2 = 4." and {lp.logprob for lp in lps} == {-0.5}
    assert all(len(lp.top_logprobs) == 2 for lp in lps)
    sealed = r.output[0].encrypted_content
    assert sealed and "User asks" not in sealed
    # a client that keeps nothing but the sealed reasoning (store false, Codex's way) sends it back
    seen = script(CALL)
    item = {"type": "reasoning", "id": r.output[0].id, "summary": [], "encrypted_content": sealed}
    client.responses.create(model=MODEL, store=False, input=[
        {"role": "user", "content": "What is 2+2?"}, item,
        {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "call_1", "output": "sunny"}], tools=TOOLS)
    assert "User asks 2+2. Answer 4." in gen._encoding().decode(seen[0])


@pytest.mark.parametrize("body, where", [
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input_image"),
    ({"input": [{"type": "item_reference", "id": "x"}]}, "item_reference"),
    ({"input": "hi", "tools": [{"type": "web_search"}]}, "only function tools"),
    ({"input": "hi", "text": {"format": {"type": "yaml"}}}, "text.format.type"),
    ({"input": "hi", "background": True}, "background"),
    ({"input": "hi", "temprature": 1}, "temprature: unknown field"),
    ({"input": [{"type": "function_call_output", "call_id": "nope", "output": "x"}]}, "a tool result for call id 'nope'"),
    ({"input": [{"type": "reasoning", "summary": [], "encrypted_content": "gAAAA"}]}, "another provider"),
    ({"input": [{"type": "reasoning", "summary": [], "encrypted_content": "gptoss-fp8:abc"}]}, "is damaged"),
    ({"input": [{"type": "reasoning", "summary": [], "encrypted_content": "gptoss-fp8:/w=="}]}, "is damaged"),
    ({"input": [{"type": "function_call", "name": "f"}]}, "has no 'call_id'"),
    ({"input": [{"role": "user", "content": [5]}]}, "content must be a string or a list of content parts"),
    ({"input": [{"type": "reasoning", "content": [5]}]}, "content must be a list of parts"),
    ({"input": [{"type": "reasoning", "summary": [], "encrypted_content": 5}]}, "encrypted_content must be a string"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": {"a": 1}}]},
     "arguments must be a string"),
    ({"input": [{"type": "function_call_output", "call_id": "c", "output": 5}]}, "output must be a string or a list"),
])
def test_bad_requests_are_one_line_400s(server, body, where):
    r = httpx.post(server.url + "/v1/responses", json={"model": MODEL, **body})
    assert r.status_code == 400, r.text
    msg = r.json()["error"]["message"]
    assert where in msg and "\n" not in msg, msg


def test_a_failed_request_and_a_client_that_leaves(server, client, script, monkeypatch):
    runner = server.served.engine.runner

    def fault(*a, **kw):
        raise RuntimeError("injected fault")

    monkeypatch.setattr(runner, "prefill", fault)
    monkeypatch.setattr(runner, "prefill_many", fault)
    with pytest.raises(openai.InternalServerError, match="injected fault"):
        client.responses.create(model=MODEL, input="hi")
    events = list(client.responses.create(model=MODEL, input="hi", stream=True))
    assert [e.type for e in events] == ["response.created", "response.in_progress", "response.failed"]
    assert "injected fault" in events[-1].response.error.message and events[-1].response.status == "failed"
    monkeypatch.undo()
    script("<|channel|>final<|message|>" + "la " * 400 + "<|return|>")
    before = _cancelled(wait_idle(server))
    with httpx.stream("POST", server.url + "/v1/responses", json={"model": MODEL, "input": "hi", "stream": True}) as r:
        assert next(r.iter_lines()) == "event: response.created"  # then the client leaves
    m = wait_idle(server)  # its request was cancelled, not run to its 400 tokens
    assert _cancelled(m) == before + 1


def _cancelled(metrics: str) -> float:
    try:
        return metric(metrics, 'gptoss_requests_finished_total{reason="cancelled"}')
    except KeyError:
        return 0


SCHEMA = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99},
                                           "color": {"enum": ["red", "green"]}},
          "required": ["n", "color"], "additionalProperties": False}


@pytest.fixture
def ending(server, monkeypatch):
    """The real sampler (the grammar's masks applied) on logits favouring <|end|>, so that the random weights' reasoning
    and preambles end and the reply reaches its final message or call."""
    engine = server.served.engine
    real = engine.sampler

    def sampler(logits, seqs):
        logits = logits.float().clone()
        logits[:, 200007] += 1e4  # (the random weights' logits are large)
        return real(logits, seqs)

    monkeypatch.setattr(engine, "sampler", sampler)


def _fits(text):
    body = json.loads(text)
    assert set(body) == {"n", "color"} and 0 <= body["n"] <= 99 and body["color"] in ("red", "green"), text


def test_structured_output_through_both_apis(server, client, ending):
    def counts():
        m = httpx.get(server.url + "/metrics").text
        return [metric(m, f"gptoss_structured_{k}_tokens_total") for k in ("checked", "refused", "masked")]

    before = counts()
    fmt = {"type": "json_schema", "name": "pick", "schema": SCHEMA, "strict": True}
    r = client.responses.create(model=MODEL, input="Pick one.", text={"format": fmt}, temperature=1,
                                max_output_tokens=300)
    assert r.status == "completed" and r.output[-1].phase == "final_answer" and r.text.format.type == "json_schema"
    _fits(r.output_text)
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Pick one."}], n=2,
                                          response_format={"type": "json_schema", "json_schema": {"name": "pick",
                                                                                                  "schema": SCHEMA}},
                                          temperature=1, seed=3, max_tokens=300)
    for choice in chat.choices:  # each choice its own matcher
        assert choice.finish_reason == "stop"
        _fits(choice.message.content)
    # completions (vLLM's extension): the text itself is the JSON, then <|endoftext|>
    done = client.completions.create(model=MODEL, prompt=[5, 6, 7, 8], max_tokens=60, temperature=1, seed=1,
                                     extra_body={"response_format": {"type": "json_schema",
                                                                     "json_schema": {"schema": SCHEMA}}})
    assert done.choices[0].finish_reason == "stop"
    _fits(done.choices[0].text)
    # a named function with strict arguments: a call must come, its arguments fit
    tools = [{**TOOLS[0], "strict": True, "parameters": {
        "type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}}, "required": ["city"],
        "additionalProperties": False}}]
    r = client.responses.create(model=MODEL, input="Weather?", tools=tools, temperature=1, max_output_tokens=300,
                                tool_choice={"type": "function", "name": "get_weather"})
    call = r.output[-1]
    assert call.type == "function_call" and call.name == "get_weather"
    assert json.loads(call.arguments) in ({"city": "Paris"}, {"city": "Rome"})
    chat_tools = [{"type": "function", "function": {k: v for k, v in tools[0].items() if k != "type"}}]
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Weather?"}],
                                          tools=chat_tools, tool_choice="required", temperature=1, max_tokens=300)
    assert chat.choices[0].finish_reason == "tool_calls"
    assert json.loads(chat.choices[0].message.tool_calls[0].function.arguments) in ({"city": "Paris"}, {"city": "Rome"})
    # the fixture's <|end|> wins every free draw and is refused almost everywhere: checked, refused, then masks made
    # first for the next 8 steps
    checked, refused, masked = (a - b for a, b in zip(counts(), before, strict=True))
    assert checked >= refused > 0 and masked > 0, (checked, refused, masked)


@pytest.mark.parametrize("path, body, where", [
    ("/v1/responses", {"input": "hi", "text": {"format": {"type": "json_schema", "name": "x"}}}, "needs its schema"),
    ("/v1/responses", {"input": "hi", "tool_choice": "required"}, "needs tools"),
    ("/v1/responses", {"input": "hi", "tools": TOOLS, "tool_choice": {"type": "function", "name": "nope"}},
     "not among the tools"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "response_format": {"type": "xml"}},
     "give text, json_object or json_schema"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "response_format": {
        "type": "json_schema", "json_schema": {"schema": {"type": "integer", "minimum": 5, "maximum": 1,
                                                          "x-guidance": {"lenient": 7}}}}}, "cannot be enforced"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "response_format": {
        "type": "json_schema", "json_schema": 5}}, "response_format: a json_schema format needs its schema"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [5]}]}, "content must be a string or a list"),
    ("/v1/chat/completions", {"messages": [{"role": "assistant", "reasoning_content": 5}]},
     "reasoning_content must be a string"),
    ("/v1/chat/completions", {"messages": [{"role": "assistant", "tool_calls": [
        {"id": "a", "type": "function", "function": {"name": "f", "arguments": {"a": 1}}}]}]},
     "function.arguments must be a string"),
    ("/v1/chat/completions", {"messages": [{"role": "assistant", "tool_calls": [{"id": "a"}]}]},
     "tool_calls must be a list of"),
])
def test_bad_formats_and_messages_are_one_line_400s(server, path, body, where):
    r = httpx.post(server.url + path, json={"model": MODEL, **body})
    assert r.status_code == 400, r.text
    msg = r.json()["error"]["message"]
    assert where in msg and "\n" not in msg, msg


def test_models_and_unknown_routes_answer_in_openai_form(server, client):
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError, match="'gpt-4' is not served here"):
        client.models.retrieve("gpt-4")
    for method, path, status, where in (("GET", "/v1/nope", 404, "no route GET /v1/nope"),
                                        ("GET", "/v1/chat/completions", 405, "GET is not allowed")):
        r = httpx.request(method, server.url + path)
        assert r.status_code == status and where in r.json()["error"]["message"], r.text
