"""Tool-call parsers: each format's examples, tolerances, errors, and two properties.

Properties (Hypothesis): ``parse`` never raises, whatever the text (also text built from
the format's own markers), and ``parse(render(calls))`` gives the calls back.
"""

from __future__ import annotations

import json
import keyword
import string
from pathlib import Path

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from treerl.errors import ToolCallError, ToolErrorKind
from treerl.envs.parsers import (
    PARSERS,
    HermesParser,
    Llama3JsonParser,
    MistralParser,
    ParseResult,
    PythonicParser,
    Qwen3CoderParser,
    ToolCall,
    get_parser,
)

PROPERTY_SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def only_calls(result: ParseResult) -> list[ToolCall]:
    assert result.errors == [], [e.message for e in result.errors]
    return result.calls


def assert_malformed(result: ParseResult, count: int = 1) -> None:
    assert len(result.errors) == count, result
    for error in result.errors:
        assert isinstance(error, ToolCallError)
        assert error.kind is ToolErrorKind.MALFORMED
        assert "Write each call as" in error.message


# -- hermes ------------------------------------------------------------------------------


def test_hermes_reads_several_calls_and_keeps_the_prose():
    text = (
        "Let me check both.\n"
        '<tool_call>\n{"name": "weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "time", "arguments": {}}\n</tool_call>'
    )
    result = HermesParser().parse(text)
    assert only_calls(result) == [ToolCall("weather", {"city": "Paris"}), ToolCall("time", {})]
    assert result.content == "Let me check both."


@pytest.mark.parametrize(
    "text",
    [
        '<tool_call>\n{"name": "f", "arguments": {"x": 1}}',  # stopped on end of turn, no closing tag
        '<tool_call>\n{"name": "f", "parameters": {"x": 1}}\n</tool_call>',
        '<tool_call>\n{"name": "f", "arguments": "{\\"x\\": 1}"}\n</tool_call>',  # double-encoded
    ],
)
def test_hermes_tolerances(text):
    assert only_calls(HermesParser().parse(text)) == [ToolCall("f", {"x": 1})]


def test_hermes_unclosed_call_followed_by_prose_keeps_the_prose_as_content():
    result = HermesParser().parse('<tool_call>\n{"name": "f", "arguments": {}}\nThen I wait.')
    assert only_calls(result) == [ToolCall("f", {})]
    assert result.content == "Then I wait."


def test_hermes_bad_call_is_malformed_and_the_good_ones_are_kept():
    text = (
        '<tool_call>\n{"name": "f", "arguments": {"x": 1}\n</tool_call>\n'  # missing brace
        '<tool_call>\n{"name": "g", "arguments": {}}\n</tool_call>'
    )
    result = HermesParser().parse(text)
    assert result.calls == [ToolCall("g", {})]
    assert_malformed(result)
    assert "invalid JSON" in result.errors[0].message
    assert '"name": "<tool name>"' in result.errors[0].message  # shows what a good call looks like


@pytest.mark.parametrize(
    "text, reason",
    [
        ('<tool_call>\n{"arguments": {}}\n</tool_call>', '"name"'),
        ('<tool_call>\n{"name": "f", "arguments": [1]}\n</tool_call>', "must be a JSON object"),
        ('<tool_call>\n{"name": "f", "arguments": "nope"}\n</tool_call>', "not a JSON object"),
        ("<tool_call>\nget_weather(city='Paris')\n</tool_call>", "expected a JSON object"),
        ('{"name": "f"}</tool_call>', "without a <tool_call>"),
    ],
)
def test_hermes_malformed_reasons(text, reason):
    result = HermesParser().parse(text)
    assert_malformed(result)
    assert reason in result.errors[0].message


def test_hermes_braces_inside_json_strings_do_not_end_the_call():
    call = ToolCall("echo", {"text": "a </tool_call> and {\"b\"}"})
    assert only_calls(HermesParser().parse(HermesParser().render([call]))) == [call]


@pytest.mark.parametrize("parser_name", sorted(PARSERS))
def test_plain_text_has_no_calls_and_no_errors(parser_name):
    text = "The answer is 42. [See the note] {not json} and f(x) = 2x; done."
    result = get_parser(parser_name).parse(text)
    assert result == ParseResult(content=text, calls=[], errors=[])


# -- llama3_json -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text",
    [
        '<|python_tag|>{"name": "f", "parameters": {"x": 1}}; {"name": "g", "parameters": {}}',
        '{"name": "f", "parameters": {"x": 1}}\n{"name": "g", "parameters": {}}',
        '{"name": "f", "parameters": {"x": 1}}; {"name": "g", "arguments": {}}<|eom_id|>',
    ],
)
def test_llama3_json_calls(text):
    result = Llama3JsonParser().parse(text)
    assert only_calls(result) == [ToolCall("f", {"x": 1}), ToolCall("g", {})]
    assert result.content == ""


def test_llama3_json_prose_and_answers_stay_content():
    text = 'The result is:\n{"total": 3}\nas JSON.'
    assert Llama3JsonParser().parse(text) == ParseResult(content=text, calls=[], errors=[])


def test_llama3_json_malformed():
    result = Llama3JsonParser().parse('{"name": "f", "parameters": {"x": 1}\n{"name": "g", "parameters": {}}')
    assert result.calls == [ToolCall("g", {})]
    assert_malformed(result)
    tagged = Llama3JsonParser().parse('<|python_tag|>brave_search.call(query="x")')
    assert_malformed(tagged)
    assert tagged.calls == []


# -- mistral -----------------------------------------------------------------------------


def test_mistral_json_list_with_ids():
    text = 'Sure.[TOOL_CALLS][{"name": "f", "arguments": {"x": 1}, "id": "abc123xyz"}, {"name": "g", "arguments": {}}]'
    result = MistralParser().parse(text)
    assert only_calls(result) == [ToolCall("f", {"x": 1}, id="abc123xyz"), ToolCall("g", {})]
    assert result.content == "Sure."


def test_mistral_name_args_form():
    text = '[TOOL_CALLS]f[ARGS]{"x": 1}[TOOL_CALLS]g[CALL_ID]c1[ARGS]{}'
    assert only_calls(MistralParser().parse(text)) == [ToolCall("f", {"x": 1}), ToolCall("g", {}, id="c1")]


def test_mistral_malformed_keeps_valid_calls():
    result = MistralParser().parse('[TOOL_CALLS]f[ARGS]{"x": [1}[TOOL_CALLS]g[ARGS]{"y": 2}')
    assert result.calls == [ToolCall("g", {"y": 2})]
    assert_malformed(result)
    assert result.errors[0].tool_name == "f"


# -- pythonic ----------------------------------------------------------------------------


def test_pythonic_calls_with_literals():
    text = "I'll check.\n[weather(city=\"Paris]\", days=-2, opts={'units': 'c', 'hours': (1, 2)}), now(), ok(x=null)]"
    result = PythonicParser().parse(text)
    assert only_calls(result) == [
        ToolCall("weather", {"city": "Paris]", "days": -2, "opts": {"units": "c", "hours": [1, 2]}}),
        ToolCall("now", {}),
        ToolCall("ok", {"x": None}),
    ]
    assert result.content == "I'll check."


@pytest.mark.parametrize(
    "text, reason",
    [
        ('[f(a=__import__("os").system("x"))]', "not a literal"),
        ("[f(a=1 + 2)]", "not a literal"),
        ("[f(1)]", "positional"),
        ("[f(**kw)]", "**"),
        ("[f(a=1), 3]", "expected a call"),
        ("[f(a={1: 2})]", "keys are not all strings"),
        ("[f(a=1", "unbalanced"),
        ("[f(a=1)) ]", "invalid Python"),
    ],
)
def test_pythonic_rejects_anything_but_literals(text, reason):
    result = PythonicParser().parse(text)
    assert_malformed(result)
    assert reason in result.errors[0].message


def test_pythonic_is_never_evaluated(tmp_path):
    marker = tmp_path / "evaluated"
    PythonicParser().parse(f"[f(a=open({str(marker)!r}, 'w').write('x'))]")
    assert not marker.exists()


def test_pythonic_render_refuses_non_identifiers():
    with pytest.raises(ValueError, match="identifier"):
        PythonicParser().render([ToolCall("f", {"class": 1})])


# -- qwen3_coder -------------------------------------------------------------------------

WEATHER_SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string"},
        "days": {"type": "integer"},
        "scale": {"type": "number"},
        "hourly": {"type": "boolean"},
        "fields": {"type": "array", "items": {"type": "string"}},
        "opts": {"type": "object"},
        "unit": {"enum": ["1", "2"]},
        "note": {"type": ["string", "null"]},
    },
}


def qwen3_text(name: str, params: dict[str, str]) -> str:
    body = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in params.items())
    return f"<tool_call>\n<function={name}>\n{body}</function>\n</tool_call>"


def test_qwen3_coder_converts_values_with_the_schema():
    text = qwen3_text(
        "weather",
        {
            "city": "42",
            "days": "3",
            "scale": "1.5",
            "hourly": "True",
            "fields": '["t", "rain"]',
            "opts": '{"a": 1}',
            "unit": "1",
            "note": "null",
        },
    )
    (call,) = only_calls(Qwen3CoderParser().parse(text, {"weather": WEATHER_SCHEMA}))
    assert call == ToolCall(
        "weather",
        {
            "city": "42",
            "days": 3,
            "scale": 1.5,
            "hourly": True,
            "fields": ["t", "rain"],
            "opts": {"a": 1},
            "unit": "1",
            "note": None,
        },
    )


def test_qwen3_coder_without_schema_reads_json_else_text():
    text = qwen3_text("f", {"n": "3", "s": "hello world", "o": '{"a": [1]}'})
    assert only_calls(Qwen3CoderParser().parse(text)) == [ToolCall("f", {"n": 3, "s": "hello world", "o": {"a": [1]}})]


def test_qwen3_coder_values_that_do_not_convert_stay_text_for_validation_to_report():
    text = qwen3_text("weather", {"days": "three"})
    assert only_calls(Qwen3CoderParser().parse(text, {"weather": WEATHER_SCHEMA})) == [
        ToolCall("weather", {"days": "three"})
    ]


def test_text_formats_keep_strings_of_optional_str_parameters():
    # Optional[str] is ["string", "null"] and Literal["a", "1"] | None an anyOf: "2024", "true" and "1" are
    # strings there, not the number, boolean or integer JSON would read (which validation then refused).
    schemas = {"f": {"type": "object", "properties": {
        "site": {"type": ["string", "null"]},
        "mode": {"anyOf": [{"type": "string", "enum": ["a", "1"]}, {"type": "null"}]},
        "n": {"type": ["integer", "string"]},
        "x": {"type": ["number", "null"]},
    }}}
    written = {"site": "2024", "mode": "1", "n": "3", "x": "2"}
    expected = ToolCall("f", {"site": "2024", "mode": "1", "n": 3, "x": 2})
    assert only_calls(Qwen3CoderParser().parse(qwen3_text("f", written), schemas)) == [expected]
    glm = "<tool_call>f\n" + "".join(f"<arg_key>{k}</arg_key>\n<arg_value>{v}</arg_value>\n" for k, v in written.items())
    assert only_calls(get_parser("glm4_moe").parse(glm + "</tool_call>", schemas)) == [expected]
    nulls = {"site": "null", "mode": "null"}
    assert only_calls(Qwen3CoderParser().parse(qwen3_text("f", nulls), schemas)) == [ToolCall("f", {"site": None, "mode": None})]


def test_qwen3_coder_accepts_openai_style_schemas_and_missing_wrappers():
    openai = {"weather": {"type": "function", "function": {"name": "weather", "parameters": WEATHER_SCHEMA}}}
    text = "Checking.\n<function=weather>\n<parameter=days>\n3\n<parameter=city>\n7\n"  # no closing tags at all
    result = Qwen3CoderParser().parse(text, openai)
    assert only_calls(result) == [ToolCall("weather", {"days": 3, "city": "7"})]
    assert result.content == "Checking."


def test_qwen3_coder_malformed():
    result = Qwen3CoderParser().parse("<tool_call>\nweather(city='x')\n</tool_call>" + qwen3_text("ok", {}))
    assert result.calls == [ToolCall("ok", {})]
    assert_malformed(result)
    assert "<function=tool_name>" in result.errors[0].message


# -- order ------------------------------------------------------------------------------

UNREADABLE = {
    "deepseek": '<｜tool▁call▁begin｜>function<｜tool▁sep｜>x\n```json\n{"a": }\n```<｜tool▁call▁end｜>',
    "glm4_moe": "<tool_call>\n</tool_call>",
    "harmony": '<|start|>assistant to=functions.x<|channel|>commentary json<|message|>{"a": }<|call|><|start|>assistant',
    "hermes": '<tool_call>\n{"name": "x", "arguments": {\n</tool_call>',
    "llama3_json": '{"name": "x", "parameters": {"a": }}',
    "mistral": '[TOOL_CALLS]x[ARGS]{"a": }',
    "pythonic": "[x(1)]",
    "qwen3_coder": "<tool_call>\nx(a=1)\n</tool_call>",
}


@pytest.mark.parametrize("name", sorted(PARSERS))
def test_calls_and_unreadable_calls_come_in_the_order_written(name):
    parser = get_parser(name)
    first, last = parser.render([ToolCall("f", {"a": 1})]), parser.render([ToolCall("g", {"b": 2})])
    if name == "deepseek":  # one list of calls around all three
        first, last = first.replace("<｜tool▁calls▁end｜>", ""), last.replace("<｜tool▁calls▁begin｜>", "")
    separator = "" if name in ("deepseek", "harmony") else "\n"
    result = parser.parse(separator.join([first, UNREADABLE[name], last]))
    assert [getattr(x, "name", "error") for x in result.in_order()] == ["f", "error", "g"]
    assert [c.name for c in result.calls] == ["f", "g"] and len(result.errors) == 1


# -- get_parser --------------------------------------------------------------------------


class FakeTokenizer:
    def __init__(self, chat_template):
        self.chat_template = chat_template


@pytest.mark.parametrize(
    "template, expected",
    [
        ("{{- '<tool_call>\\n<function=' + tool_call.name + '>' }}", Qwen3CoderParser),
        ("{{- '<tool_call>\\n' }}{{ tool_call | tojson }}", HermesParser),
        ("{{ '[TOOL_CALLS]' + tool_calls | tojson }}", MistralParser),
        ("{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>' }}", Llama3JsonParser),
        ("{{ '<|python_tag|>' }}", Llama3JsonParser),
        ("{{ '<start_of_turn>' + role }}", PythonicParser),  # Gemma: its tool-use templates ask for pythonic calls
        ("{{ message['content'] }}", HermesParser),
    ],
)
def test_get_parser_detects_the_chat_template(template, expected):
    assert type(get_parser(chat_template=template)) is expected
    assert type(get_parser(tokenizer=FakeTokenizer(template))) is expected
    assert type(get_parser(tokenizer=FakeTokenizer({"default": "x", "tool_use": template}))) is expected


def test_get_parser_name_wins_and_unknown_names_are_listed():
    assert type(get_parser("pythonic", chat_template="<tool_call>")) is PythonicParser
    assert type(get_parser()) is HermesParser
    with pytest.raises(ValueError, match="qwen3_coder"):
        get_parser("hermes2")


# -- properties --------------------------------------------------------------------------

MARKERS = {
    "glm4_moe": ["<tool_call>", "</tool_call>", "<tool_call>f\n", "<arg_key>", "</arg_key>", "<arg_value>",
                 "</arg_value>", "a", "\n", "{", "1"],
    "deepseek": ["<｜tool▁calls▁begin｜>", "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>", "function",
                 "f\n", "```json\n", "\n```", '{"a": ', "{", "}"],
    "harmony": ["<|start|>assistant", " to=functions.f", "<|channel|>", "analysis", "commentary", "final",
                "<|message|>", "<|end|>", "<|call|>", '{"a": ', "{", "}", " json"],
    "hermes": ["<tool_call>", "</tool_call>", '{"name": "f", "arguments": ', '"parameters"', "{", "}", '"', "\n"],
    "llama3_json": ["<|python_tag|>", '{"name": "f", "parameters": ', "{", "}", ";", "\n", '"', "<|eom_id|>"],
    "mistral": ["[TOOL_CALLS]", "[ARGS]", "[CALL_ID]", '[{"name": "f", "arguments": ', "f", "{", "}", "[", "]"],
    "pythonic": ["[f(", "a=", ")", "]", "[", "(", '"', "'", '"""', "\n", ",", "1", "<|python_start|>", "\\", "\x00"],
    "qwen3_coder": ["<tool_call>", "</tool_call>", "<function=f>", "<function=", "</function>", "<parameter=a>",
                    "<parameter=", "</parameter>", "\n", "{", "1", ">"],
}
SCHEMAS = {"f": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string"}}}}


def adversarial_text(markers):
    piece = st.one_of(st.sampled_from(markers), st.text(max_size=6))
    return st.lists(piece, max_size=25).map("".join)


@pytest.mark.parametrize("parser_name", sorted(PARSERS))
@PROPERTY_SETTINGS
@given(data=st.data())
def test_parse_never_raises(parser_name, data):
    text = data.draw(st.one_of(st.text(max_size=200), adversarial_text(MARKERS[parser_name])))
    result = get_parser(parser_name).parse(text, SCHEMAS)
    assert isinstance(result.content, str)
    assert all(isinstance(c, ToolCall) and isinstance(c.arguments, dict) for c in result.calls)
    assert all(e.kind is ToolErrorKind.MALFORMED for e in result.errors)


@pytest.mark.parametrize("parser_name", sorted(PARSERS))
@pytest.mark.parametrize("opener", ["[", "{", "(", '{"a": '])
def test_parse_survives_deep_nesting(parser_name, opener):
    prefix = {"glm4_moe": "<tool_call>f\n<arg_key>a</arg_key>\n<arg_value>",
              "deepseek": "<｜tool▁call▁begin｜>function<｜tool▁sep｜>f\n```json\n", "harmony": " to=functions.f<|channel|>commentary json<|message|>", "hermes": "<tool_call>", "llama3_json": "<|python_tag|>", "mistral": "[TOOL_CALLS]",
              "pythonic": "[f(a=", "qwen3_coder": "<function=f>\n<parameter=a>\n"}[parser_name]
    result = get_parser(parser_name).parse(prefix + opener * 5_000, SCHEMAS)
    if parser_name == "qwen3_coder":
        # Values are text in this format: an unreadable integer stays text for validation to report.
        assert [c.name for c in result.calls] == ["f"] and result.errors == []
    else:
        assert result.calls == []
        assert_malformed(result)


IDENTIFIERS = st.text(string.ascii_letters + "_", min_size=1, max_size=6).flatmap(
    lambda head: st.text(string.ascii_letters + string.digits + "_", max_size=6).map(lambda tail: head + tail)
).filter(lambda name: not keyword.iskeyword(name))
JSON_SCALARS = st.one_of(
    st.none(), st.booleans(), st.integers(-(10**12), 10**12), st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=12),
    # Strings that read as other JSON types are where typed formats go wrong.
    st.sampled_from(["3", "-1.5", "true", "None", "null", "[1]", '{"a": 1}', " 2 ", "\n", ""]),
)
JSON_VALUES = st.recursive(
    JSON_SCALARS,
    lambda inner: st.one_of(st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=5), inner, max_size=3)),
    max_leaves=8,
)
CALLS = st.lists(
    st.builds(ToolCall, name=IDENTIFIERS, arguments=st.dictionaries(IDENTIFIERS, JSON_VALUES, max_size=4)),
    min_size=1,
    max_size=3,
)


@pytest.mark.parametrize("parser_name", ["deepseek", "hermes", "llama3_json", "mistral", "pythonic"])
@PROPERTY_SETTINGS
@given(calls=CALLS)
def test_render_then_parse_gives_the_calls_back(parser_name, calls):
    parser = get_parser(parser_name)
    result = parser.parse(parser.render(calls))
    assert only_calls(result) == calls
    assert result.content == ""


QWEN3_MARKUP = ("<tool_call>", "</tool_call>", "<function=", "</function>", "<parameter=", "</parameter>")


def json_type(value) -> str:
    for kind, name in ((bool, "boolean"), (int, "integer"), (float, "number"), (str, "string"),
                       (list, "array"), (dict, "object"), (type(None), "null")):
        if isinstance(value, kind):
            return name
    raise AssertionError(value)


def as_text(value) -> str:
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


@PROPERTY_SETTINGS
@given(calls=st.lists(CALLS.map(lambda calls: calls[0]), min_size=1, max_size=3, unique_by=lambda c: c.name))
def test_qwen3_coder_render_then_parse_with_schemas(calls):
    # Values are raw text in this format, so text holding the format's own markup cannot
    # round-trip; everything else must, with strings kept as written.
    assume(not any(tag in as_text(v) for c in calls for v in c.arguments.values() for tag in QWEN3_MARKUP))
    schemas = {
        c.name: {"type": "object", "properties": {k: {"type": json_type(v)} for k, v in c.arguments.items()}}
        for c in calls
    }
    parser = Qwen3CoderParser()
    result = parser.parse(parser.render(calls), schemas)
    assert only_calls(result) == calls
    assert result.content == ""


GLM_MARKUP = ("<tool_call>", "</tool_call>", "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>")


@PROPERTY_SETTINGS
@given(calls=st.lists(CALLS.map(lambda calls: calls[0]), min_size=1, max_size=3, unique_by=lambda c: c.name))
def test_glm_render_then_parse_with_schemas(calls):
    # As in qwen3_coder, values are text: strings stay as written when the schema says string.
    assume(not any(tag in as_text(v) for c in calls for v in c.arguments.values() for tag in GLM_MARKUP))
    schemas = {
        c.name: {"type": "object", "properties": {k: {"type": json_type(v)} for k, v in c.arguments.items()}}
        for c in calls
    }
    parser = get_parser("glm4_moe")
    result = parser.parse(parser.render(calls), schemas)
    assert only_calls(result) == calls
    assert result.content == ""


def test_glm_and_deepseek_are_picked_from_their_templates():
    real = Path(__file__).parent / "templates" / "real"
    glm = get_parser(chat_template=(real / "glm4_moe.jinja").read_text())
    deepseek = get_parser(chat_template=(real / "deepseek_r1.jinja").read_text())
    assert (glm.name, glm.reasoning, deepseek.name, deepseek.reasoning) == (
        "glm4_moe", ("<think>", "</think>"), "deepseek", ("<think>", "</think>"))
    r = deepseek.parse("I need it.\n</think>\n\n<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>f\n"
                       '```json\n{"a": 1}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>')
    assert r.calls == [ToolCall("f", {"a": 1})] and r.reasoning == "I need it." and r.content == ""
    # DeepSeek-V3.1: the name before the separator, bare JSON after it.
    assert deepseek.parse('<｜tool▁call▁begin｜>f<｜tool▁sep｜>{"a": 2}<｜tool▁call▁end｜>').calls == [ToolCall("f", {"a": 2})]
    r = glm.parse("\n<think>plan</think>\n<tool_call>f\n<arg_key>a</arg_key>\n<arg_value>17</arg_value>\n"
                  "<arg_key>s</arg_key>\n<arg_value>17</arg_value>\n</tool_call>",
                  {"f": {"properties": {"a": {"type": "integer"}, "s": {"type": "string"}}}})
    assert r.calls == [ToolCall("f", {"a": 17, "s": "17"})] and r.reasoning == "plan"
    (error,) = glm.parse("<tool_call>f\n<arg_key>a</arg_key>17</tool_call>").errors
    assert error.kind is ToolErrorKind.MALFORMED and "<arg_value>" in error.message


# -- reasoning: a call inside <think> is not a call ---------------------------------------------

THINKING_CALL = '<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>'


@pytest.mark.parametrize("reply, calls, reasoning", [
    (f"<think>\nMaybe {THINKING_CALL}?\n</think>\n\nNo call needed.", [], f"Maybe {THINKING_CALL}?"),
    (f"<think>\nPlan: {THINKING_CALL}\n</think>\n\n{THINKING_CALL}", ["f"], f"Plan: {THINKING_CALL}"),
    # The template opened <think> in the generation prompt: the reply starts inside it.
    (f"I could write {THINKING_CALL}\n</think>\n\nDone.", [], f"I could write {THINKING_CALL}"),
    # Cut off while thinking: everything is reasoning.
    (f"<think>\nfirst {THINKING_CALL}", [], f"first {THINKING_CALL}"),
    (f"no reasoning {THINKING_CALL}", ["f"], None),
])
def test_calls_inside_reasoning_are_not_calls(reply, calls, reasoning):
    parser = get_parser("hermes", reasoning=("<think>", "</think>"))
    result = parser.parse(reply, SCHEMAS)
    assert [c.name for c in result.calls] == calls and result.errors == []
    assert result.reasoning == reasoning
    assert "<think>" not in result.content and "</think>" not in result.content
    # Without reasoning markers the same reply's calls are all read (the old behaviour).
    assert len(get_parser("hermes").parse(reply).calls) == reply.count("<tool_call>")


def test_reasoning_follows_the_template_and_can_be_set_per_parser():
    qwen3 = (Path(__file__).parent / "templates" / "real" / "qwen3.jinja").read_text()
    qwen2_5 = (Path(__file__).parent / "templates" / "real" / "qwen2_5.jinja").read_text()
    assert get_parser(chat_template=qwen3).reasoning == ("<think>", "</think>")
    assert get_parser(chat_template=qwen2_5).reasoning is None
    assert get_parser(chat_template=qwen3, reasoning=None).reasoning is None  # switched off
    assert get_parser("qwen3_coder", chat_template=qwen3).reasoning == ("<think>", "</think>")
    assert QWEN3_CODER_WITH_REASONING.parse("<think><function=f>\n</function></think>ok").calls == []
    custom = HermesParser(reasoning=("<reasoning>", "</reasoning>"))
    assert custom.parse(f"<reasoning>{THINKING_CALL}</reasoning>{THINKING_CALL}").reasoning == THINKING_CALL
    with pytest.raises(ValueError, match="reasoning=.*pair of non-empty markers"):
        HermesParser(reasoning=("<think>",))


QWEN3_CODER_WITH_REASONING = get_parser("qwen3_coder", reasoning=("<think>", "</think>"))


# -- harmony (gpt-oss) --------------------------------------------------------------------------


def test_harmony_reads_calls_addressed_to_functions_and_keeps_analysis_as_reasoning():
    parser = get_parser(chat_template=(Path(__file__).parent / "templates" / "real" / "gpt_oss.jinja").read_text())
    assert parser.name == "harmony" and parser.reasoning is None
    # The form gpt-oss's template renders (recipient in the role header) ...
    r = parser.parse('<|channel|>analysis<|message|>Use <tool_call>{"name": "g"}</tool_call>? No: multiply.<|end|>'
                     '<|start|>assistant to=functions.f<|channel|>commentary json<|message|>{"a": 1}<|call|>')
    assert r.calls == [ToolCall("f", {"a": 1})] and r.errors == [] and r.content == ""
    assert r.reasoning.startswith("Use <tool_call>")
    # ... and the one in the channel header, with <|constrain|>.
    r = parser.parse('<|channel|>commentary to=functions.f <|constrain|>json<|message|>{"b": "x"}')
    assert r.calls == [ToolCall("f", {"b": "x"})]
    r = parser.parse("<|channel|>analysis<|message|>Easy.<|end|><|start|>assistant<|channel|>final<|message|>It is 4.")
    assert (r.calls, r.content, r.reasoning) == ([], "It is 4.", "Easy.")
    (error,) = parser.parse(" to=functions.f<|channel|>commentary json<|message|>[1, 2]").errors
    assert error.kind is ToolErrorKind.MALFORMED and error.tool_name == "f" and "JSON object" in error.message
    assert "to=functions.<tool name>" in error.message
    assert parser.parse("Just text.").content == "Just text."
