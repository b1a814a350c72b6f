"""Tool calling: :mod:`flexpage.server.tools` (checks, prompts, the call grammar) and
:mod:`flexpage.server.tool_calls` (reading calls back) in this process, then a real
``flexpage serve`` driven by the official ``openai`` client.

The grammar tests run llguidance on SmolLM2's tokenizer: a text is accepted when the matcher
takes all its tokens and may stop there. The server tests check that every call the model makes
names one of the tools and that its arguments validate (``jsonschema``) against that tool's
``parameters``, streamed and not, with ``n=2``.
"""

from __future__ import annotations

import json
from typing import Any

import httpx
import jsonschema
import pytest
from server_fixtures import ServerProcess

from flexpage.server.protocol import APIError, ChatCompletionRequest, ChatMessage
from flexpage.server.tool_calls import ToolCallReader, finish_reason
from flexpage.server.tools import (
    TOOL_PROMPT,
    chat_inputs,
    check_messages,
    compile_tools,
    read_tool_prompt,
    template_renders_tools,
    tool_request,
)

MODEL = "SmolLM2-135M-Instruct"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.", "strict": True,
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "The time in a time zone.", "strict": True,
    "parameters": {"$defs": {"Zone": {"enum": ["UTC", "CET", "PST"]}}, "type": "object",
                   "properties": {"zone": {"$ref": "#/$defs/Zone"}}, "required": ["zone"],
                   "additionalProperties": False}}}
PING = {"type": "function", "function": {"name": "ping"}}  # no parameters: the empty object only
TOOLS = [WEATHER, TIME]
SCHEMAS = {t["function"]["name"]: t["function"].get("parameters") for t in [WEATHER, TIME, PING]}
ASK = [{"role": "user", "content": "What is the weather in Paris, and what time is it in UTC?"}]


def _request(**fields: Any) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"messages": ASK, **fields})


def _refused(fn: Any, param: str) -> str:
    with pytest.raises(APIError) as info:
        fn()
    assert info.value.status == 400 and info.value.param == param, (info.value.param, info.value.message)
    return info.value.message


def _call(name: str, arguments: dict) -> str:
    return f'<tool_call>\n{json.dumps({"name": name, "arguments": arguments})}\n</tool_call>'


def _assert_valid_call(call: Any) -> None:
    """An OpenAI tool call (dict or client object) of a known tool, with valid arguments."""
    call = call if isinstance(call, dict) else call.model_dump()
    assert call["type"] == "function" and call["id"].startswith("call_"), call
    name = call["function"]["name"]
    assert name in SCHEMAS, name
    arguments = json.loads(call["function"]["arguments"])
    jsonschema.validate(arguments, SCHEMAS[name] or {"type": "object", "maxProperties": 0})


# -- checks ----------------------------------------------------------------------------------------
def test_tool_requests_are_checked_field_by_field() -> None:
    assert tool_request(_request()) is None
    assert tool_request(_request(tool_choice="auto")) is None  # changes nothing without tools
    auto = tool_request(_request(tools=TOOLS))
    assert (auto.choice, auto.function, auto.parallel, auto.leading_text) == ("auto", None, True, True)
    named = tool_request(_request(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_time"}},
                                  parallel_tool_calls=False))
    assert (named.choice, named.function, named.parallel, named.leading_text) == ("function", "get_time", False, False)
    assert not tool_request(_request(tools=TOOLS, tool_choice="none")).reads_calls
    assert tool_request(_request(tools=TOOLS, tool_choice="none")).constraint() is None

    _refused(lambda: tool_request(_request(tools=[])), "tools")
    _refused(lambda: tool_request(_request(tool_choice="required")), "tool_choice")
    _refused(lambda: tool_request(_request(tool_choice={"type": "function", "function": {"name": "f"}})),
             "tool_choice")
    message = _refused(lambda: tool_request(_request(tools=TOOLS, tool_choice={"type": "function",
                                                                               "function": {"name": "get_tide"}})),
                       "tool_choice")
    assert "get_tide" in message and "get_weather" in message
    bad_name = {"type": "function", "function": {"name": "get weather"}}
    _refused(lambda: tool_request(_request(tools=[WEATHER, bad_name])), "tools.1.function.name")
    assert "tools.0" in _refused(lambda: tool_request(_request(tools=[WEATHER, TIME, WEATHER])),
                                 "tools.2.function.name")
    not_object = {"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}
    _refused(lambda: tool_request(_request(tools=[not_object])), "tools.0.function.parameters")


def test_schemas_the_grammar_library_refuses_name_their_tool(grammars: Any) -> None:
    bogus = {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"type": "bogus"}}}}}
    message = _refused(lambda: compile_tools(tool_request(_request(tools=[WEATHER, bogus])), grammars.compile),
                       "tools.1.function.parameters")
    assert "bogus" in message and "structured_outputs" not in message
    # "none" still checks the schemas: a bad tool is a bad request whatever the choice
    _refused(lambda: compile_tools(tool_request(_request(tools=[bogus], tool_choice="none")), grammars.compile),
             "tools.0.function.parameters")
    compile_tools(tool_request(_request(tools=TOOLS)), grammars.compile)


def test_tool_turns_are_checked() -> None:
    def check(*messages: dict) -> None:
        check_messages([ChatMessage.model_validate(m) for m in messages])

    call = {"id": "call_1", "type": "function", "function": {"name": "get_time", "arguments": '{"zone": "UTC"}'}}
    check({"role": "user", "content": "hi"}, {"role": "assistant", "content": None, "tool_calls": [call]},
          {"role": "tool", "tool_call_id": "call_1", "content": "12:00"})
    _refused(lambda: check({"role": "tool", "content": "12:00"}), "messages.0.tool_call_id")
    _refused(lambda: check({"role": "assistant", "tool_calls": [call]}, {"role": "tool", "tool_call_id": "call_2",
                                                                         "content": "x"}), "messages.1.tool_call_id")
    _refused(lambda: check({"role": "user", "tool_calls": [call]}), "messages.0.tool_calls")
    for arguments in ("{", "[1]", ""):
        bad = {**call, "function": {"name": "get_time", "arguments": arguments}}
        _refused(lambda: check({"role": "user", "content": "hi"}, {"role": "assistant", "tool_calls": [bad]}),
                 "messages.1.tool_calls.0.function.arguments")


def test_read_tool_prompt(tmp_path: Any) -> None:
    good = tmp_path / "good.txt"
    good.write_text("Tools:\n{tools}\n")
    assert read_tool_prompt(str(good)) == "Tools:\n{tools}\n"
    bad = tmp_path / "bad.txt"
    bad.write_text("no slot")
    with pytest.raises(ValueError, match="slot"):
        read_tool_prompt(str(bad))
    with pytest.raises(ValueError, match="cannot read"):
        read_tool_prompt(str(tmp_path / "missing.txt"))


# -- prompts ---------------------------------------------------------------------------------------
SECOND_TURN = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Paris and time in UTC?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_a", "type": "function", "function": {"name": "get_weather",
                                                          "arguments": '{"city": "Paris", "unit": "celsius"}'}},
        {"id": "call_b", "type": "function", "function": {"name": "get_time", "arguments": '{"zone":"UTC"}'}}]},
    {"role": "tool", "tool_call_id": "call_a", "content": "18 C"},
    {"role": "tool", "tool_call_id": "call_b", "content": "12:00"},
]


def test_a_plain_chatml_template_gets_the_tool_prompt_and_tool_turns_as_text(tokenizer: Any) -> None:
    assert not template_renders_tools(tokenizer)
    messages = [ChatMessage.model_validate(m) for m in SECOND_TURN]
    rendered, extra = chat_inputs(messages, tool_request(_request(tools=TOOLS)), native=False)
    assert extra == {}
    listed = "\n".join(json.dumps({"type": "function", "function": {k: v for k, v in t["function"].items()
                                                                     if k != "strict"}}) for t in TOOLS)
    assert rendered == [
        {"role": "system", "content": "Be brief.\n\n" + TOOL_PROMPT.replace("{tools}", listed)},
        {"role": "user", "content": "Weather in Paris and time in UTC?"},
        {"role": "assistant", "content": _call("get_weather", {"city": "Paris", "unit": "celsius"}) + "\n"
                                         + _call("get_time", {"zone": "UTC"})},
        {"role": "user", "content": "<tool_response>\n18 C\n</tool_response>\n<tool_response>\n12:00\n"
                                    "</tool_response>"},
    ]
    text = tokenizer.apply_chat_template(rendered, add_generation_prompt=True, tokenize=False)
    assert text.startswith("<|im_start|>system\nBe brief.\n\n# Tools\n") and text.endswith("<|im_start|>assistant\n")
    assert '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather"' in text
    # without a system message the tool prompt is one; a custom template replaces the default
    rendered, _ = chat_inputs(messages[1:2], tool_request(_request(tools=[PING])), native=False,
                              prompt_template="Call: {tools}")
    assert rendered[0] == {"role": "system", "content": 'Call: {"type": "function", "function": {"name": "ping"}}'}
    # no tools: the history still renders, with no tool prompt
    rendered, _ = chat_inputs(messages, None, native=False)
    assert rendered[0] == {"role": "system", "content": "Be brief."} and len(rendered) == 4


NATIVE_TEMPLATE = ("{% if tools %}TOOLS {{ tools | map(attribute='function.name') | join(',') }}{{ '\\n' }}"
                   "{% endif %}"
                   "{% for m in messages %}{{ m.role }}: {% if m.tool_calls %}"
                   "{% for c in m.tool_calls %}{{ c.function.name }}{{ c.function.arguments | tojson }};{% endfor %}"
                   "{% else %}{{ m.content }}{% endif %}{% if m.role == 'tool' %} ({{ m.name }}, "
                   "{{ m.tool_call_id }}){% endif %}{{ '\\n' }}{% endfor %}")


def test_a_template_that_renders_tools_gets_them_in_openai_shape(tokenizer: Any) -> None:
    class WithTools:
        chat_template = NATIVE_TEMPLATE

    assert template_renders_tools(WithTools())
    assert template_renders_tools(type("Named", (), {"chat_template": {"default": "x", "tool_use": NATIVE_TEMPLATE}}))
    messages = [ChatMessage.model_validate(m) for m in SECOND_TURN]
    rendered, extra = chat_inputs(messages, tool_request(_request(tools=TOOLS)), native=True)
    text = tokenizer.apply_chat_template(rendered, chat_template=NATIVE_TEMPLATE, tokenize=False, **extra)
    assert text == ("TOOLS get_weather,get_time\nsystem: Be brief.\nuser: Weather in Paris and time in UTC?\n"
                    'assistant: get_weather{"city": "Paris", "unit": "celsius"};get_time{"zone": "UTC"};\n'
                    "tool: 18 C (get_weather, call_a)\ntool: 12:00 (get_time, call_b)\n")


# -- the call grammar ------------------------------------------------------------------------------
def _accepts(grammars: Any, tools: Any, text: str, tokenizer: Any) -> bool:
    matcher = grammars.compile(tools.constraint()).matcher()
    ok = all(matcher.accept(t) for t in tokenizer.encode(text, add_special_tokens=False))
    return ok and matcher.inner.is_accepting()


WEATHER_CALL = _call("get_weather", {"city": "Paris", "unit": "celsius"})
TIME_CALL = _call("get_time", {"zone": "UTC"})
PING_CALL = _call("ping", {})
GRAMMAR_CASES = {
    # text: accepted by (auto, required, required with parallel_tool_calls false, named get_time)
    "It is sunny <b>today</b>.": (True, False, False, False),
    WEATHER_CALL: (True, True, True, False),
    TIME_CALL: (True, True, True, True),
    PING_CALL: (True, True, True, False),
    "Let me look.\n" + TIME_CALL: (True, False, False, False),
    WEATHER_CALL + "\n" + TIME_CALL: (True, True, False, False),
    WEATHER_CALL + "\nand more": (False, False, False, False),
    _call("get_time", {"zone": "EST"}): (False, False, False, False),  # not in the enum
    _call("get_weather", {"city": "Paris"}): (False, False, False, False),  # unit missing
    _call("ping", {"x": 1}): (False, False, False, False),  # no parameters: {} only
    _call("get_tide", {}): (False, False, False, False),
    '<tool_call>\n{"name":"get_time", "arguments": {"zone": "UTC"}}\n</tool_call>': (False,) * 4,  # compact only
    "<tool_call> then text": (False,) * 4,  # the tag commits to a call
}


def test_the_call_grammar_of_each_choice(grammars: Any, tokenizer: Any) -> None:
    choices = [tool_request(_request(tools=[*TOOLS, PING])),
               tool_request(_request(tools=[*TOOLS, PING], tool_choice="required")),
               tool_request(_request(tools=[*TOOLS, PING], tool_choice="required", parallel_tool_calls=False)),
               tool_request(_request(tools=[*TOOLS, PING], tool_choice={"type": "function",
                                                                        "function": {"name": "get_time"}}))]
    for tools in choices:
        compile_tools(tools, grammars.compile)
    for text, expected in GRAMMAR_CASES.items():
        got = tuple(_accepts(grammars, tools, text, tokenizer) for tools in choices)
        assert got == expected, text


# -- reading calls back ----------------------------------------------------------------------------
def _read(text: str, leading_text: bool, step: int | None = None) -> tuple[str, list[dict], ToolCallReader]:
    """Content and calls of ``text``, fed whole (``step`` None) or ``step`` characters at a time."""
    reader = ToolCallReader(leading_text)
    content, calls = "", []
    cuts = [len(text)] if step is None else [*range(step, len(text), step), len(text)]
    for cut in cuts:
        piece, new = reader.feed(text[:cut], final=cut == len(text))
        content += piece
        calls += new
    return content, calls, reader


@pytest.mark.parametrize("leading_text", [True, False])
def test_streamed_calls_add_up_to_the_collected_message(leading_text: bool) -> None:
    texts = ["Let me look. \n" + WEATHER_CALL + "\n" + TIME_CALL, WEATHER_CALL, "Plain text, no <tool call> at all <",
             TIME_CALL + "\n" + WEATHER_CALL[:30], "trailing space  \n"]
    for text in texts:
        whole = _read(text, leading_text)
        for step in (1, 3, 7):
            content, calls, _ = _read(text, leading_text, step)
            assert content == whole[0], (text, step)
            assert [c["function"] for c in calls] == [c["function"] for c in whole[1]], (text, step)
            assert [c["index"] for c in calls] == list(range(len(calls)))


def test_what_is_content_and_what_is_a_call() -> None:
    content, calls, reader = _read("Let me look. \n" + WEATHER_CALL + "\n" + TIME_CALL, leading_text=True)
    assert content == "Let me look."  # the space and newline before the call are not content
    assert [c["function"] for c in calls] == [{"name": "get_weather", "arguments": '{"city": "Paris", "unit": '
                                                                                   '"celsius"}'},
                                              {"name": "get_time", "arguments": '{"zone": "UTC"}'}]
    assert len({c["id"] for c in reader.calls}) == 2 and "index" not in reader.calls[0]
    assert finish_reason("stop", reader) == "tool_calls"
    assert finish_reason("length", reader) == "length"
    # required: calls only; a call cut by max_tokens is content, and no call
    content, calls, reader = _read(WEATHER_CALL[:40], leading_text=False)
    assert (content, calls) == (WEATHER_CALL[:40], [])
    assert finish_reason("length", reader) == "length" and finish_reason("stop", reader) == "stop"
    # one whole call then a cut one: the whole one stays (a stream has sent it already)
    content, calls, _ = _read(TIME_CALL + "\n" + WEATHER_CALL[:30], leading_text=False)
    assert content == WEATHER_CALL[:30] and [c["function"]["name"] for c in calls] == ["get_time"]
    # auto with no call: the text, whitespace and all
    assert _read("  Hi <tool", leading_text=True)[:2] == ("  Hi <tool", [])


# -- fixtures for the in-process tests -------------------------------------------------------------
@pytest.fixture(scope="module")
def tokenizer(default_model_path: Any) -> Any:
    from flexpage.model.loader import load_tokenizer

    return load_tokenizer(default_model_path)


@pytest.fixture(scope="module")
def grammars(tokenizer: Any) -> Any:
    """The engine's grammar compiler, over SmolLM2's tokenizer."""
    from flexpage.structured.compiler import GrammarCompiler
    from flexpage.structured.llguidance_backend import LLGuidanceBackend

    return GrammarCompiler(lambda: LLGuidanceBackend(tokenizer, len(tokenizer), [tokenizer.eos_token_id]))


# -- a real server ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def server(default_model_path: Any) -> Any:
    server = ServerProcess("--dtype", "float32", "--num-blocks", "256", "--max-num-seqs", "8",
                           "--max-model-len", "1024")
    server.start()
    try:
        yield server.wait_ready(timeout=300)
    finally:
        server.stop()


def _post(server: ServerProcess, body: dict) -> httpx.Response:
    return httpx.post(server.base_url + "/v1/chat/completions", json={"model": MODEL, **body}, timeout=300)


def _check_shape(model: str, body: dict) -> None:
    from flexpage.server.schema import RESPONSE_MODELS

    RESPONSE_MODELS[model].model_validate(body)


@pytest.mark.slow
def test_required_calls_validate_for_every_choice(server: ServerProcess) -> None:
    """Parallel calls: SmolLM2-135M rarely stops after a call, so the choices may end at
    max_tokens; every call made is whole and valid, and a cut one is content."""
    response = _post(server, {"messages": ASK, "tools": TOOLS, "tool_choice": "required", "n": 2,
                              "temperature": 0.8, "seed": 7, "max_tokens": 64})
    assert response.status_code == 200, response.text
    body = response.json()
    _check_shape("ChatCompletionResponse", body)
    assert len(body["choices"]) == 2
    for choice in body["choices"]:
        message = choice["message"]
        assert message["tool_calls"], choice
        for call in message["tool_calls"]:
            _assert_valid_call(call)
        if choice["finish_reason"] == "length":
            assert message["content"].startswith("<tool_call>"), choice
        else:
            assert choice["finish_reason"] == "tool_calls" and message["content"] is None, choice
    ids = [c["id"] for choice in body["choices"] for c in choice["message"]["tool_calls"]]
    assert len(set(ids)) == len(ids)


@pytest.mark.slow
def test_a_named_function_streamed_and_not(server: ServerProcess) -> None:
    client = server.openai()
    named = {"type": "function", "function": {"name": "get_weather"}}
    plain = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice=named, n=2,
                                           temperature=0.8, seed=3, max_tokens=96)
    for choice in plain.choices:
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        assert [c.function.name for c in choice.message.tool_calls] == ["get_weather"]
        _assert_valid_call(choice.message.tool_calls[0])
    # the same seed streamed: the same calls, in OpenAI's delta shape
    stream = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice=named, n=2,
                                            temperature=0.8, seed=3, max_tokens=96, stream=True)
    calls: dict[int, list] = {0: [], 1: []}
    finish: dict[int, str] = {}
    for chunk in stream:
        _check_shape("ChatCompletionChunk", chunk.model_dump(exclude_unset=True))
        for choice in chunk.choices:
            assert not choice.delta.content
            calls[choice.index] += choice.delta.tool_calls or []
            finish[choice.index] = choice.finish_reason or finish.get(choice.index)
    assert finish == {0: "tool_calls", 1: "tool_calls"}
    for index, choice in enumerate(plain.choices):
        assert [c.function.model_dump() for c in calls[index]] == [choice.message.tool_calls[0].function.model_dump()]
        _assert_valid_call(calls[index][0])
    # the client's stream helper assembles the deltas (it insists on strict tools: ours are)
    with client.chat.completions.stream(model=MODEL, messages=ASK, tools=TOOLS, tool_choice=named,
                                        temperature=0.8, seed=3, max_tokens=96) as events:
        final = events.get_final_completion()
    call = final.choices[0].message.tool_calls[0]
    assert call.function.parsed_arguments == json.loads(plain.choices[0].message.tool_calls[0].function.arguments)
    # the second turn as clients write it: the response's own message object, then the result
    message = plain.choices[0].message
    turn = [*ASK, message, {"role": "tool", "tool_call_id": message.tool_calls[0].id, "content": "18 C"}]
    second = client.chat.completions.create(model=MODEL, messages=turn, tools=TOOLS, temperature=0, max_tokens=8)
    assert second.choices[0].finish_reason in ("stop", "length", "tool_calls")


@pytest.mark.slow
def test_required_streamed_with_one_call_at_most(server: ServerProcess) -> None:
    stream = server.openai().chat.completions.create(
        model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required", parallel_tool_calls=False, n=2,
        temperature=1.0, seed=11, max_tokens=96, stream=True, stream_options={"include_usage": True})
    calls: dict[int, list] = {0: [], 1: []}
    finish: dict[int, str] = {}
    for chunk in stream:
        for choice in chunk.choices:
            calls[choice.index] += choice.delta.tool_calls or []
            finish[choice.index] = choice.finish_reason or finish.get(choice.index)
    assert finish == {0: "tool_calls", 1: "tool_calls"}  # one call, then the grammar ends the output
    for index in (0, 1):
        assert len(calls[index]) == 1 and calls[index][0].index == 0
        _assert_valid_call(calls[index][0])


@pytest.mark.slow
def test_a_call_cut_by_max_tokens_is_content(server: ServerProcess) -> None:
    body = {"messages": ASK, "tools": TOOLS, "tool_choice": "required", "temperature": 0, "max_tokens": 6}
    choice = _post(server, body).json()["choices"][0]
    assert choice["finish_reason"] == "length" and "tool_calls" not in choice["message"]
    assert choice["message"]["content"].startswith("<tool_call>")
    events = _sse(_post(server, {**body, "stream": True}))
    content = "".join(e["choices"][0]["delta"].get("content") or "" for e in events if e["choices"])
    assert content == choice["message"]["content"]
    assert not any(e["choices"][0]["delta"].get("tool_calls") for e in events if e["choices"])
    assert events[-1]["choices"][0]["finish_reason"] == "length"


@pytest.mark.slow
def test_auto_calls_if_it_calls_validate_and_a_second_turn_is_accepted(server: ServerProcess) -> None:
    client = server.openai()
    first = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, n=2, temperature=1.0, seed=5,
                                           max_tokens=40)
    for choice in first.choices:
        assert choice.finish_reason in ("stop", "length", "tool_calls")
        for call in choice.message.tool_calls or []:
            _assert_valid_call(call)
        assert (choice.finish_reason == "tool_calls") == bool(choice.message.tool_calls)
        if not choice.message.tool_calls:
            assert isinstance(choice.message.content, str)
    turn = [ASK[0], {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_time", "arguments": '{"zone": "UTC"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "12:00"}]
    second = client.chat.completions.create(model=MODEL, messages=turn, tools=TOOLS, tool_choice="none",
                                            temperature=0, max_tokens=12)
    assert second.choices[0].message.tool_calls is None and second.choices[0].message.content
    assert second.usage.prompt_tokens > 150  # the tools are still shown with "none"


BAD = [
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "a": {"type": "bogus"}}}}}]}, "tools.0.function.parameters"),
    ({"tools": [WEATHER, WEATHER]}, "tools.1.function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": "x"}}]}, "tools.0.function.parameters"),
    ({"tools": [{"type": "retrieval"}]}, "tools.0.type"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "get_tide"}}}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS, "response_format": {"type": "json_object"}}, "tools"),
    ({"tools": TOOLS, "tool_choice": "required", "structured_outputs": {"regex": "a+"}}, "tools"),
    ({"messages": [*ASK, {"role": "tool", "content": "12:00"}]}, "messages.1.tool_call_id"),
    ({"messages": [*ASK, {"role": "assistant", "tool_calls": [{"id": "c", "type": "function", "function": {
        "name": "get_time", "arguments": "{zone: UTC}"}}]}]}, "messages.1.tool_calls.0.function.arguments"),
]


@pytest.mark.slow
def test_bad_tool_requests_get_400_naming_the_field(server: ServerProcess) -> None:
    for extra, param in BAD:
        response = _post(server, {"messages": ASK, "max_tokens": 4, **extra})
        assert response.status_code == 400, (extra, response.text)
        error = response.json()["error"]
        assert error["param"] == param, (extra, error)
        _check_shape("ErrorResponse", response.json())
    # tools are not shown to /v1/completions: refused, not ignored
    response = httpx.post(server.base_url + "/v1/completions", json={"model": MODEL, "prompt": "hi", "tools": TOOLS},
                          timeout=60)
    assert response.status_code == 400 and response.json()["error"]["param"] == "tools"
    # with tool_choice "none" the tools constrain nothing, so response_format applies
    response = _post(server, {"messages": [{"role": "user", "content": 'Reply with {"a": 1}.'}], "tools": TOOLS,
                              "tool_choice": "none", "response_format": {"type": "json_object"}, "max_tokens": 60,
                              "temperature": 0})
    choice = response.json()["choices"][0]
    assert choice["finish_reason"] == "stop" and isinstance(json.loads(choice["message"]["content"]), dict), choice


def _sse(response: httpx.Response) -> list[dict]:
    assert response.status_code == 200, response.text
    lines = [line[6:] for line in response.text.splitlines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]
