"""Record shapes, tool calls, bad variants and chat-template overrides, against the template applied directly."""
import json
import re
from pathlib import Path

import numpy as np
import pytest

from helpers import CHATML, make_tokenizer, read_arrow, write_jsonl
from phase1a.config.schema import ConfigError, validate_config
from phase1a.core.errors import DataError
from phase1a.data.records import RECORD_FORMATS, RecordError, to_conversation
from phase1a.data.render import IGNORE_INDEX, Renderer, render_segments
from phase1a.data.templates import CHAT_TEMPLATES, apply_chat_template_setting, template_fingerprint
from phase1a.data.tokenizing import TokenizeOptions, tokenize_dataset, tokenize_fingerprint
from phase1a.evaluate.generation import generation_examples, stop_token_ids
from phase1a.train.packing import TokenRows

LLAMA3_TOKENS = ["<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
# A small tool-capable template in the style of Qwen2.5's: schemas in a system block, calls as JSON in tags.
TOOL_TEMPLATE = (
    "{% if tools %}<|im_start|>system\nTools: {{ tools | tojson }}<|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
    "{% for call in m.tool_calls or [] %}<tool_call>{{ call.function | tojson }}</tool_call>{% endfor %}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
WEATHER = [{"type": "function", "function": {"name": "weather", "description": "Weather in a city",
                                             "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]


def tokenize_records(path: Path, tokenizer, records: list, **options) -> list[dict]:
    path.mkdir(parents=True, exist_ok=True)
    result = tokenize_dataset(write_jsonl(path / "d.jsonl", records), tokenizer, 4096,
                              TokenizeOptions(validation_count=1, **options), path / "cache" / "fp")
    return read_arrow(result.train_path).to_pylist() + read_arrow(result.validation_path).to_pylist()


def reference_ids(tokenizer, messages: list[dict], tools: list | None = None) -> tuple[int, ...]:
    """Independent reference: the template applied to the whole conversation, tokenized in one call."""
    text = tokenizer.apply_chat_template(messages, tools=tools, tokenize=False)
    return tuple(tokenizer(text, add_special_tokens=False)["input_ids"])


def trained_text(tokenizer, row: dict) -> str:
    return tokenizer.decode([t for t, label in zip(row["input_ids"], row["labels"]) if label != IGNORE_INDEX])


def settings(**options) -> TokenizeOptions:
    return TokenizeOptions(**options)


# Per format: a record of number n, the equivalent chat messages, and the replies that are trained.
def _chat(n):
    messages = [{"role": "user", "content": f"Add {n} and 1."}, {"role": "assistant", "content": f"{n + 1}"},
                {"role": "user", "content": "And 2?"}, {"role": "assistant", "content": f"{n + 2}"}]
    return {"messages": messages}, messages, [f"{n + 1}", f"{n + 2}"]


def _sharegpt(n):
    record = {"system": "Be brief.", "conversations": [
        {"from": "human", "value": f"Add {n} and 1."}, {"from": "gpt", "value": f"{n + 1}"},
        {"from": "user", "value": "And 2?"}, {"from": "model", "value": f"{n + 2}"}]}
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": f"Add {n} and 1."}, {"role": "assistant", "content": f"{n + 1}"},
                {"role": "user", "content": "And 2?"}, {"role": "assistant", "content": f"{n + 2}"}]
    return record, messages, [f"{n + 1}", f"{n + 2}"]


def _alpaca(n):
    record = {"system": "Be brief.", "history": [[f"Add {n} and 1.", f"{n + 1}"]], "instruction": "Add 2.",
              "input": f"{n + 1}", "output": f"{n + 3}"}
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": f"Add {n} and 1."}, {"role": "assistant", "content": f"{n + 1}"},
                {"role": "user", "content": f"Add 2.\n\n{n + 1}"}, {"role": "assistant", "content": f"{n + 3}"}]
    return record, messages, [f"{n + 1}", f"{n + 3}"]


def _prompt_completion(n):
    prompt = [{"role": "user", "content": f"Add {n} and 1."}, {"role": "assistant", "content": f"{n + 1}"},
              {"role": "user", "content": "And 2?"}]
    completion = [{"role": "assistant", "content": f"{n + 2}"}]
    return {"prompt": prompt, "completion": completion}, prompt + completion, [f"{n + 2}"]  # TRL: completion only


def _prompt_completion_strings(n):
    messages = [{"role": "user", "content": f"Add {n} and 1."}, {"role": "assistant", "content": f"{n + 1}"}]
    return {"prompt": f"Add {n} and 1.", "completion": f"{n + 1}"}, messages, [f"{n + 1}"]


CASES = {"chat": _chat, "sharegpt": _sharegpt, "alpaca": _alpaca, "prompt_completion": _prompt_completion}


def test_every_registered_format_is_tested():
    assert set(CASES) | {"text"} == set(RECORD_FORMATS)  # text: test_tokenize_formats.py; docs: test_docs.py


def test_config_format_choices_are_the_registry():
    for name in RECORD_FORMATS:
        assert validate_config({"data": {"source": "/d.jsonl", "format": name}}).data.format == name
    with pytest.raises(ConfigError, match="one of: auto, " + ", ".join(RECORD_FORMATS)):
        validate_config({"data": {"source": "/d.jsonl", "format": "openai"}})
    with pytest.raises(ConfigError, match=r"data.role_map: .*\{'bot': 'robot'\}: map role names to one of system"):
        validate_config({"data": {"source": "/d.jsonl", "role_map": {"bot": "robot"}}})


@pytest.mark.parametrize("case", [*CASES.values(), _prompt_completion_strings], ids=[*CASES, "prompt_completion_strings"])
@pytest.mark.parametrize("fmt", ["auto", "named"])
def test_each_shape_tokenizes_like_its_messages(tmp_path, tokenizer, case, fmt):
    cases = [case(n) for n in (10, 20, 30)]
    name = "auto" if fmt == "auto" else case.__name__.removeprefix("_").removesuffix("_strings")
    rows = tokenize_records(tmp_path, tokenizer, [record for record, _, _ in cases], format=name)
    assert {tuple(row["input_ids"]) for row in rows} == {reference_ids(tokenizer, messages) for _, messages, _ in cases}
    replies = {"".join(f"{reply}<|im_end|>\n" for reply in replies) for _, _, replies in cases}
    assert {trained_text(tokenizer, row) for row in rows} == replies


def _weather_chat(n: int, ids: bool = True) -> dict:
    call = {"type": "function", "function": {"name": "weather", "arguments": json.dumps({"city": f"Paris {n}"})}}
    return {"tools": WEATHER, "messages": [
        {"role": "user", "content": f"Weather in Paris {n}?"},
        {"role": "assistant", "content": None, "tool_calls": [{**call, "id": f"c{n}"} if ids else call]},
        {"role": "tool", "content": "sunny", "name": "weather", **({"tool_call_id": f"c{n}"} if ids else {})},
        {"role": "assistant", "content": f"Sunny in Paris {n}."}]}


def _weather_reference(n: int) -> list[dict]:
    """What the template is given: arguments as an object, a call's missing text as ''."""
    return [{"role": "user", "content": f"Weather in Paris {n}?"},
            {"role": "assistant", "content": "", "tool_calls": [
                {"type": "function", "id": f"c{n}", "function": {"name": "weather", "arguments": {"city": f"Paris {n}"}}}]},
            {"role": "tool", "content": "sunny", "name": "weather", "tool_call_id": f"c{n}"},
            {"role": "assistant", "content": f"Sunny in Paris {n}."}]


def test_tool_calls_train_the_call_and_the_answer_not_the_tool_output(tmp_path):
    tools_tokenizer = make_tokenizer(TOOL_TEMPLATE)
    rows = tokenize_records(tmp_path, tools_tokenizer, [_weather_chat(n) for n in (1, 2, 3)])
    assert {tuple(r["input_ids"]) for r in rows} == {reference_ids(tools_tokenizer, _weather_reference(n), WEATHER)
                                                     for n in (1, 2, 3)}
    calls = {n: json.dumps({"name": "weather", "arguments": {"city": f"Paris {n}"}}) for n in (1, 2, 3)}
    assert {trained_text(tools_tokenizer, r) for r in rows} == {
        f"<tool_call>{calls[n]}</tool_call><|im_end|>\nSunny in Paris {n}.<|im_end|>\n" for n in (1, 2, 3)}
    assert all("Tools:" in tools_tokenizer.decode(r["input_ids"]) for r in rows)  # the schemas reached the template


def test_sharegpt_function_call_and_observation_are_a_tool_exchange(tmp_path):
    tools_tokenizer = make_tokenizer(TOOL_TEMPLATE)
    records = [{"tools": json.dumps(WEATHER), "conversations": [
        {"from": "human", "value": f"Weather in Paris {n}?"},
        {"from": "function_call", "value": json.dumps({"name": "weather", "arguments": {"city": f"Paris {n}"}})},
        {"from": "observation", "value": "sunny"}, {"from": "gpt", "value": f"Sunny in Paris {n}."}]} for n in (1, 2)]
    rows = tokenize_records(tmp_path, tools_tokenizer, records)
    expected = set()
    for n in (1, 2):
        messages = _weather_reference(n)
        del messages[1]["tool_calls"][0]["id"], messages[2]["tool_call_id"], messages[2]["name"]
        expected.add(reference_ids(tools_tokenizer, messages, WEATHER))
    assert {tuple(r["input_ids"]) for r in rows} == expected


def test_tool_conversations_render_per_record_and_plain_ones_by_recipe():
    tools_tokenizer = make_tokenizer(TOOL_TEMPLATE)
    renderer = Renderer(tools_tokenizer)
    with_tools = to_conversation(_weather_chat(1), "x", settings())
    assert renderer.segments(with_tools.messages, with_tools.tools) == render_segments(
        with_tools.messages, tools_tokenizer, with_tools.tools)
    plain = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    assert renderer.segments(plain) == render_segments(plain, tools_tokenizer)
    # One recipe, for the plain conversation's role sequence; the tool conversation never made one.
    assert list(renderer._recipes) == [("user", "assistant")]


def test_tool_calls_without_a_chat_template_are_an_error():
    with pytest.raises(DataError, match="tool calls and tools need a chat template.*data.chat_template"):
        conversation = to_conversation(_weather_chat(1), "x", settings())
        Renderer(make_tokenizer(chat_template=None)).segments(conversation.messages, conversation.tools)


def _calls(*ids):
    return [{"type": "function", **({"id": i} if i else {}), "function": {"name": "f", "arguments": "{}"}} for i in ids]


@pytest.mark.parametrize("record, path, reason", [
    ({"messages": [{"content": "q"}, {"role": "assistant", "content": "a"}]}, "messages[0].role: missing", "missing_role"),
    ({"messages": [{"role": "narrator", "content": "q"}, {"role": "assistant", "content": "a"}]},
     "messages[0].role: unknown role 'narrator'", "unknown_role"),
    ({"messages": [{"role": "user", "content": " "}, {"role": "assistant", "content": "a"}]},
     "messages[0].content: empty user turn", "empty_turn"),
    ({"messages": [{"role": "user", "content": "q"}, {"role": "assistant"}]},
     "messages[1].content: empty assistant turn", "empty_answer"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "q"}]}, {"role": "assistant", "content": "a"}]},
     "messages[0].content: must be a string (list)", "non_string_content"),
    ({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "", "tool_calls": _calls("a")},
                   {"role": "tool", "tool_call_id": "b", "content": "1"}, {"role": "assistant", "content": "a"}]},
     "messages[1].tool_calls[0]: no tool turn answers this call", "unanswered_tool_call"),
    ({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "", "tool_calls": _calls(None, None)},
                   {"role": "tool", "content": "1"}, {"role": "assistant", "content": "a"}]},
     "messages[1].tool_calls[1]: no tool turn answers this call", "unanswered_tool_call"),
    ({"messages": [{"role": "user", "content": "q"},
                   {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "f", "arguments": "{oops"}}]},
                   {"role": "tool", "content": "1"}, {"role": "assistant", "content": "a"}]},
     "messages[1].tool_calls[0].function.arguments: not valid JSON", "bad_tool_call"),
    ({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}, {"role": "user", "content": "q"}]},
     "messages[2]: the last message must be the assistant's", "last_turn_not_assistant"),
    ({"conversations": [{"value": "q"}, {"from": "gpt", "value": "a"}]}, "conversations[0].from: missing", "missing_role"),
    ({"conversations": [{"from": "narrator", "value": "q"}, {"from": "gpt", "value": "a"}]},
     "conversations[0].from: unknown role", "unknown_role"),
    ({"conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": ""}]},
     "conversations[1].value: empty assistant turn", "empty_answer"),
    ({"conversations": [{"from": "human", "value": 3}, {"from": "gpt", "value": "a"}]},
     "conversations[0].value: must be a string (int)", "non_string_content"),
    ({"conversations": [{"from": "human", "value": "q"}, {"from": "function_call", "value": "weather(Paris)"},
                        {"from": "observation", "value": "1"}, {"from": "gpt", "value": "a"}]},
     "conversations[1].value: expected JSON of a call", "bad_tool_call"),
    ({"conversations": [{"from": "human", "value": "q"}, {"from": "function_call", "value": '{"name": "f", "arguments": {}}'},
                        {"from": "gpt", "value": "a"}]},
     "conversations[1].tool_calls[0]: no tool turn answers this call", "unanswered_tool_call"),
    ({"conversations": [{"from": "gpt", "value": "a"}, {"from": "human", "value": "q"}]},
     "conversations[1]: the last message must be the assistant's", "last_turn_not_assistant"),
    ({"instruction": "q", "output": "a", "history": [["q0", None]]}, "history[0][1]: must be a string (NoneType)",
     "non_string_content"),
    ({"instruction": "q", "output": "a", "history": [["q0"]]}, "history[0]: expected a [user, assistant] pair",
     "bad_field:history"),
    ({"instruction": "q"}, "field 'output' is missing", "bad_field:output"),
    ({"prompt": [{"role": "user", "content": "q"}], "completion": [{"role": "user", "content": "a"}]},
     "completion[0]: the last message must be the assistant's", "last_turn_not_assistant"),
    ({"prompt": [{"role": "user"}], "completion": [{"role": "assistant", "content": "a"}]},
     "prompt[0].content: empty user turn", "empty_turn"),
    ({"prompt": "q", "completion": 3}, "field 'completion' must be a string (int)", "bad_field:completion"),
    # One rule for every format: an empty or blank turn is a bad record, `empty_answer` where it is the trained one.
    ({"prompt": "q", "completion": ""}, "field 'completion': empty assistant turn", "empty_answer"),
    ({"prompt": " \n", "completion": "a"}, "field 'prompt': empty user turn", "empty_turn"),
    ({"prompt": [{"role": "user", "content": "q"}], "completion": [{"role": "assistant", "content": " "}]},
     "completion[0].content: empty assistant turn", "empty_answer"),
    ({"instruction": "q", "output": ""}, "field 'output': empty assistant turn", "empty_answer"),
    ({"instruction": "", "input": "", "output": "a"}, "field 'instruction': empty user turn", "empty_turn"),
    ({"instruction": "q", "output": "a", "history": [["q0", ""]]}, "history[0][1]: empty assistant turn",
     "empty_answer"),
    ({"text": "\t"}, "field 'text': empty assistant turn", "empty_answer"),
    ({"messages": [{"role": "assistant", "content": "a"}], "system": 5}, "field 'system' must be a string (int)",
     "bad_field:system"),
    ({"question": "q"}, "no 'messages', 'conversations', 'instruction'/'output'", "unknown_schema"),
])
def test_bad_variants_name_location_field_path_and_reason(record, path, reason):
    with pytest.raises(RecordError) as error:
        to_conversation(record, "d.jsonl:7", settings())
    assert str(error.value).startswith(f"d.jsonl:7: {path}")
    assert error.value.reason == reason


def test_bad_records_skipped_are_counted_by_reason(tmp_path, tokenizer):
    good = [_chat(n)[0] for n in range(4)]
    bad = [{"messages": [{"role": "narrator", "content": "q"}, {"role": "assistant", "content": "a"}]},
           {"conversations": [{"from": "human", "value": "q"}]},
           {"conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": ""}]}]
    path = tmp_path / "d.jsonl"
    result = tokenize_dataset(write_jsonl(path, good + bad), tokenizer, 256, TokenizeOptions(bad_records="skip"),
                              tmp_path / "cache" / "fp")
    assert result.skipped == {"unknown_role": 1, "last_turn_not_assistant": 1, "empty_answer": 1}
    assert result.skipped_examples[0].startswith(f"{path}:5: messages[0].role: unknown role")


def test_records_with_nothing_to_train_are_skipped_by_default_and_said_once(tmp_path, tokenizer, caplog):
    """An empty answer (2 in 5,000 public Alpaca records) is skipped and counted by default, in one warning naming
    the count and where; a malformed record still stops the run, saying which setting would skip it."""
    caplog.set_level("WARNING", logger="phase1a")
    empty = [{"instruction": "q", "output": ""}, {"messages": [{"role": "user", "content": "q"},
                                                               {"role": "assistant", "content": " "}]}]
    path = write_jsonl(tmp_path / "d.jsonl", [_chat(n)[0] for n in range(4)] + empty)
    result = tokenize_dataset(path, tokenizer, 256, TokenizeOptions(), tmp_path / "cache" / "fp")
    assert result.skipped == {"empty_answer": 2}
    assert result.skipped_examples == [f"{path}:5: field 'output': empty assistant turn",
                                       f"{path}:6: messages[1].content: empty assistant turn"]
    warnings = [r.getMessage() for r in caplog.records if "nothing to train" in r.getMessage()]
    assert warnings == [f"2 record(s) with nothing to train skipped (empty_answer: 2), e.g. {path}:5: field 'output': "
                        f"empty assistant turn; {path}:6: messages[1].content: empty assistant turn; "
                        "data.bad_records: fail makes them errors"]

    with pytest.raises(RecordError, match=rf"^{re.escape(str(path))}:5: field 'output': empty assistant turn \(a record with nothing "
                                          r"to train; data.bad_records: skip_empty skips and counts these\)$"):
        tokenize_dataset(path, tokenizer, 256, TokenizeOptions(bad_records="fail"), tmp_path / "cache" / "fail")
    malformed = write_jsonl(tmp_path / "m.jsonl", [_chat(n)[0] for n in range(4)] + empty + [{"question": "q"}])
    with pytest.raises(RecordError, match=r"m.jsonl:7: no 'messages'.*\(data.bad_records: skip skips and counts bad "
                                          r"records\)$"):
        tokenize_dataset(malformed, tokenizer, 256, TokenizeOptions(), tmp_path / "cache" / "malformed")


def test_dotted_field_map_reaches_into_nested_records():
    record = {"id": 1, "meta": {"question": "q", "answer": {"text": "a"}}, "sys": "Be brief."}
    options = settings(field_map={"meta.question": "prompt", "meta.answer.text": "completion", "sys": "system"})
    assert to_conversation(record, "x", options).messages == [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
    # A path that is not there leaves the record as it is: the error names the format's fields.
    with pytest.raises(RecordError, match="no 'messages'"):
        to_conversation({"meta": {"other": 1}}, "x", options)


def test_system_column_is_prepended_unless_the_conversation_has_one():
    chat = {"system": "Column.", "messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}
    assert to_conversation(chat, "x", settings()).messages[0] == {"role": "system", "content": "Column."}
    own = {**chat, "messages": [{"role": "system", "content": "Own."}, *chat["messages"]]}
    assert [m["content"] for m in to_conversation(own, "x", settings()).messages] == ["Own.", "q", "a"]
    text = {"system": "Column.", "text": "plain"}  # plain text takes no system prompt
    assert to_conversation(text, "x", settings()).messages == [{"role": "assistant", "content": "plain"}]


def test_role_map_adds_role_names_to_chat_and_sharegpt():
    options = settings(role_map={"teacher": "assistant", "student": "user"})
    sharegpt = {"conversations": [{"from": "student", "value": "q"}, {"from": "teacher", "value": "a"}]}
    chat = {"messages": [{"role": "student", "content": "q"}, {"role": "teacher", "content": "a"}]}
    expected = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
    assert to_conversation(sharegpt, "x", options).messages == expected
    assert to_conversation(chat, "x", options).messages == expected


def test_nulls_from_a_mixed_dataset_count_as_absent():
    """A datasets table of mixed shapes fills other shapes' columns and turn keys with null."""
    record = {"messages": None, "conversations": [{"from": "human", "value": "q", "tool_calls": None},
                                                   {"from": "gpt", "value": "a", "tool_calls": None}],
              "text": None, "tools": None, "system": None}
    assert to_conversation(record, "x", settings()).messages == [{"role": "user", "content": "q"},
                                                                 {"role": "assistant", "content": "a"}]


def _llama3_tokenizer():
    tokenizer = make_tokenizer(chat_template=None)
    tokenizer.add_special_tokens({"additional_special_tokens": LLAMA3_TOKENS})
    return tokenizer


def test_named_template_overrides_the_tokenizers_own(tmp_path):
    messages = _chat(5)[1]
    records = [_chat(n)[0] for n in (5, 6, 7)]
    fallback = tokenize_records(tmp_path / "fallback", _llama3_tokenizer(), records)
    llama3 = apply_chat_template_setting(_llama3_tokenizer(), "llama3")
    overridden = tokenize_records(tmp_path / "llama3", llama3, records)
    assert {tuple(r["input_ids"]) for r in overridden} != {tuple(r["input_ids"]) for r in fallback}
    assert reference_ids(llama3, messages) in {tuple(r["input_ids"]) for r in overridden}
    assert {trained_text(llama3, r) for r in overridden} == {f"{n + 1}<|eot_id|>{n + 2}<|eot_id|>" for n in (5, 6, 7)}
    # It renders incrementally and content verbatim, so the fast recipe path reproduces per-record rendering.
    assert Renderer(llama3).segments(messages) == render_segments(messages, llama3)

    chatml = apply_chat_template_setting(make_tokenizer(chat_template=None), "chatml")
    assert chatml.chat_template == CHAT_TEMPLATES["chatml"]
    assert render_segments(messages, chatml) == render_segments(messages, make_tokenizer(CHATML))


def test_end_of_turn_token_of_the_override_stops_generation(tmp_path):
    llama3 = apply_chat_template_setting(_llama3_tokenizer(), "llama3")
    assert llama3.eos_token == "<|im_end|>"  # not the template's end of turn
    path = tmp_path / "d.jsonl"
    data = tokenize_dataset(write_jsonl(path, [_chat(n)[0] for n in range(6)]), llama3, 256,
                            TokenizeOptions(validation_count=2), tmp_path / "cache" / "fp")
    rows = TokenRows.load(data.validation_path)
    examples = generation_examples(rows, np.arange(len(rows)))
    eot = llama3.convert_tokens_to_ids("<|eot_id|>")
    assert stop_token_ids(llama3, None, examples) == sorted({llama3.eos_token_id, eot})
    assert stop_token_ids(llama3, None) == [llama3.eos_token_id]


def test_template_control_tokens_must_be_single_tokens():
    with pytest.raises(DataError, match=r"data.chat_template llama3: <\|end_header_id\|> is not a single token"):
        apply_chat_template_setting(make_tokenizer(), "llama3")


def test_template_file_is_applied_and_keys_the_cache(tmp_path):
    path = tmp_path / "tools.jinja"
    path.write_text(TOOL_TEMPLATE)
    tokenizer = apply_chat_template_setting(make_tokenizer(), str(path))
    assert tokenizer.chat_template == TOOL_TEMPLATE

    def fingerprint(setting):
        return tokenize_fingerprint("data", "tokenizer", 256, TokenizeOptions(chat_template=setting))

    before = fingerprint(str(path))
    assert len({fingerprint(None), fingerprint("chatml"), fingerprint("llama3"), before}) == 4
    assert template_fingerprint(str(path)) == template_fingerprint(str(path))
    path.write_text(TOOL_TEMPLATE.replace("Tools:", "Functions:"))
    assert fingerprint(str(path)) != before  # same path, edited text: a new cache key
    with pytest.raises(DataError, match=r"data.chat_template: .*missing.jinja: no such file, and not a named template"):
        fingerprint(str(tmp_path / "missing.jinja"))


def test_errors_under_a_field_map_use_the_users_names():
    options = settings(field_map={"dialog": "messages", "answer": "completion"})
    with pytest.raises(RecordError) as turn:
        to_conversation({"dialog": [{"role": "user", "content": ""}, {"role": "assistant", "content": "a"}]}, "d.jsonl:7",
                        options)
    assert str(turn.value).startswith("d.jsonl:7: dialog[0].content: ") and str(turn.value).endswith(
        "(dialog is mapped to messages)")
    with pytest.raises(RecordError, match=r"^d.jsonl:3: field 'answer' \(mapped to completion\) is missing$"):
        to_conversation({"prompt": "q"}, "d.jsonl:3", options)
