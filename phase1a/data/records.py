"""Instruction records in any of the common shapes, as conversations (the files are read by phase1a.data.datasource).

Every record becomes a `Conversation`: chat messages ending in an assistant turn (or, for plain `text`, one
trained text), plus the record's tool schemas if it has any. `RECORD_FORMATS` is the one list of shapes: the
config's choices, auto-detection, the documentation and the tests all read it. A bad record raises `RecordError`
naming where it is (file and line, or array index) and the field path; the caller decides whether that fails
the run or is skipped and counted under the error's `reason`. One rule for every format: an empty or blank turn
(a chat turn, a prompt, an instruction, a completion, an output, a text; not an assistant turn that only calls
tools) is a bad record: `empty_answer` where the turn is the one trained (an assistant turn, a completion, an
output, a text), `empty_turn` otherwise. An empty answer is a well-formed record with nothing to train (public
datasets have them: 2 in 5,000 Alpaca records): `NOTHING_TO_TRAIN`, skipped by default (`data.bad_records`).
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Callable, Literal, NamedTuple, Protocol

from phase1a.core.errors import DataError

ROLES = ("system", "user", "assistant", "tool")
# Reasons of records that are well-formed but have nothing to train: `data.bad_records: skip_empty` (the default)
# skips and counts them; every other reason is a malformed record, which fails the run unless `skip`.
NOTHING_TO_TRAIN = frozenset({"empty_answer"})
# data.bad_records: fail stops at every bad record, skip_empty skips only NOTHING_TO_TRAIN's, skip skips them all.
BadRecords = Literal["fail", "skip_empty", "skip"]
# Role names used by ShareGPT-style datasets (FastChat, Axolotl, LLaMA-Factory) and chat exports; data.role_map
# adds more (and wins where it names one of these). ShareGPT's `function_call` is not here: it becomes an
# assistant turn with tool calls.
ROLE_NAMES = {"system": "system", "user": "user", "human": "user", "assistant": "assistant", "gpt": "assistant",
              "model": "assistant", "bot": "assistant", "tool": "tool", "function": "tool", "observation": "tool",
              "ipython": "tool"}
# Message keys kept besides role and content: what chat templates read for tool use.
_TOOL_KEYS = ("tool_calls", "tool_call_id", "name")


class RecordSettings(Protocol):
    """What reading a record needs from the data settings (tokenizing passes its TokenizeOptions)."""

    format: str
    field_map: dict[str, str]
    role_map: dict[str, str]


@dataclass
class Conversation:
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None = None  # function schemas for the chat template (`tools=`)

    def identity(self) -> str:
        """The example's content as JSON: the key of the validation split and of duplicate detection."""
        return json.dumps(self.messages if self.tools is None else [self.messages, self.tools])


class RecordError(DataError):
    """One bad record; `reason` is the counter it is skipped under when bad records are skipped."""

    def __init__(self, message: str, reason: str) -> None:
        super().__init__(message)
        self.reason = reason

    def __reduce__(self):  # raised in a tokenize worker process, re-raised in the parent with its reason
        return type(self), (str(self), self.reason)


class UndecodableLine(NamedTuple):
    """A JSONL line that is not UTF-8: where its first bad byte is (1-based, in the line) and its value."""

    byte: int
    value: int


def parse_json_record(where: str, raw: str | Any) -> dict[str, Any]:
    """A JSONL line, or an already parsed record (a JSON array's item, a Parquet/CSV/Arrow row), as a record."""
    if isinstance(raw, UndecodableLine):
        raise RecordError(f"{where}: invalid UTF-8 at byte {raw.byte} of the line (0x{raw.value:02x}); save the "
                          "file as UTF-8, or skip such lines with data.bad_records: skip", "invalid_utf8")
    record = raw
    if isinstance(raw, str):
        try:
            record = json.loads(raw)
        except json.JSONDecodeError as error:
            raise RecordError(f"{where}: malformed JSON: {error.msg} at column {error.colno}",
                              "malformed_json") from None
    if not isinstance(record, dict):
        raise RecordError(f"{where}: expected a JSON object, got {type(record).__name__}", "not_an_object")
    return record


# ---- one entry point ---------------------------------------------------------------------------------------

def to_conversation(record: dict[str, Any], where: str, settings: RecordSettings) -> Conversation:
    """Normalise one record: field_map, the format (detected for `auto`), roles, the `system` column, tools."""
    record = apply_field_map(record, settings.field_map)
    try:
        shape = detect_format(record, where) if settings.format == "auto" else RECORD_FORMATS[settings.format]
        messages = shape.to_messages(record, where, settings.role_map)
        if not shape.conversational:
            return Conversation(messages)
        return Conversation(_with_system_column(record, messages, where), _tools(record, where))
    except RecordError as error:
        raise _in_user_terms(error, settings.field_map) from None


def _in_user_terms(error: RecordError, field_map: dict[str, str]) -> RecordError:
    """The message with each mapped field under the user's own name, where the formats only know theirs: a
    quoted field (`'answer' (mapped to completion)`) and a path into a turn list (`dialog[2].content`, with
    `(dialog is mapped to messages)` at the end). Both forms are exact: field names are quoted, paths index."""
    message, notes = str(error), []
    for source, target in field_map.items():
        message = message.replace(f"'{target}'", f"'{source}' (mapped to {target})")
        message, count = re.subn(rf"(?<![\w.'])({re.escape(target)})(?=\[)", source, message)
        if count:
            notes.append(f"{source} is mapped to {target}")
    return RecordError(message + (f" ({'; '.join(notes)})" if notes else ""), error.reason)


def apply_field_map(record: dict[str, Any], field_map: dict[str, str]) -> dict[str, Any]:
    """Move each source (a dotted path reaches into nested objects: `meta.question`) to its top-level name."""
    for source, target in field_map.items():
        *parents, leaf = source.split(".")
        holder = record
        for key in parents:
            holder = holder.get(key) if isinstance(holder, dict) else None
        if isinstance(holder, dict) and leaf in holder:
            record[target] = holder.pop(leaf)
    return record


def detect_format(record: dict[str, Any], where: str) -> RecordFormat:
    """The first registered format one of whose fields the record has (None counts as absent: a dataset
    with mixed shapes fills the other shapes' columns with nulls)."""
    for shape in RECORD_FORMATS.values():
        for field in shape.fields:
            if record.get(field) is not None:
                return shape
    wanted = ", ".join("/".join(f"'{f}'" for f in shape.fields) for shape in RECORD_FORMATS.values())
    fields = ", ".join(sorted(record)) or "none"
    raise RecordError(f"{where}: no {wanted} field (fields: {fields}); map other names with data.field_map",
                      "unknown_schema")


# ---- the formats ---------------------------------------------------------------------------------------------

def _text(record: dict, field: str, where: str, optional: bool = False) -> str:
    value = record.get(field)
    if optional and value is None:
        return ""
    if value is None:
        raise RecordError(f"{where}: field {field!r} is missing", f"bad_field:{field}")
    if not isinstance(value, str):
        raise RecordError(f"{where}: field {field!r} must be a string ({type(value).__name__})", f"bad_field:{field}")
    return value


def _turn_text(record: dict, field: str, where: str, role: str) -> str:
    """A field that is a whole turn (a prompt, a completion, a text): empty is a bad record, as an empty turn of a
    chat is (`_turn`): one rule for every format (the module docstring)."""
    value = _text(record, field, where)
    _require_content(value, f"field {field!r}", where, role)
    return value


def _require_content(text: str, path: str, where: str, role: str) -> None:
    """An empty or blank turn has nothing to train on (an assistant's) or to answer (a user's)."""
    if not text.strip():
        reason = "empty_answer" if role == "assistant" else "empty_turn"
        raise RecordError(f"{where}: {path}: empty {role} turn", reason)


def _chat(record: dict, where: str, role_map: dict[str, str]) -> list[dict[str, Any]]:
    messages = _turns(record.get("messages"), "messages", where, role_map, role_key="role", content_key="content")
    return _checked(messages, where, lambda index: f"messages[{index}]")


def _sharegpt(record: dict, where: str, role_map: dict[str, str]) -> list[dict[str, Any]]:
    messages = _turns(record.get("conversations"), "conversations", where, role_map, role_key="from",
                      content_key="value")
    return _checked(messages, where, lambda index: f"conversations[{index}]")


def _alpaca(record: dict, where: str, role_map: dict[str, str]) -> list[dict[str, Any]]:
    messages = []
    history = record.get("history")
    if history is not None:
        if not isinstance(history, list):
            raise RecordError(f"{where}: history: expected a list of [user, assistant] pairs", "bad_field:history")
        for index, pair in enumerate(history):
            if not (isinstance(pair, list) and len(pair) == 2):
                raise RecordError(f"{where}: history[{index}]: expected a [user, assistant] pair", "bad_field:history")
            for role, turn, text in zip(("user", "assistant"), (0, 1), pair):
                if not isinstance(text, str):
                    raise RecordError(f"{where}: history[{index}][{turn}]: must be a string "
                                      f"({type(text).__name__})", "non_string_content")
                _require_content(text, f"history[{index}][{turn}]", where, role)
                messages.append({"role": role, "content": text})
    prompt = _text(record, "instruction", where)
    extra = _text(record, "input", where, optional=True)
    if extra.strip():
        prompt = f"{prompt}\n\n{extra}"
    _require_content(prompt, "field 'instruction'", where, "user")
    return messages + [{"role": "user", "content": prompt},
                       {"role": "assistant", "content": _turn_text(record, "output", where, "assistant")}]


def _prompt_completion(record: dict, where: str, role_map: dict[str, str]) -> list[dict[str, Any]]:
    prompt, completion = record.get("prompt"), record.get("completion")
    if isinstance(prompt, list) or isinstance(completion, list):  # TRL's conversational form
        context = _turns(prompt, "prompt", where, role_map, "role", "content")
        answer = _turns(completion, "completion", where, role_map, "role", "content")

        def path_of(index: int) -> str:
            return f"prompt[{index}]" if index < len(context) else f"completion[{index - len(context)}]"

        # Only the completion is trained (TRL's semantics): assistant turns of the prompt are context.
        context = [{**m, "train": False} if m["role"] == "assistant" else m for m in context]
        return _checked(context + answer, where, path_of)
    return [{"role": "user", "content": _turn_text(record, "prompt", where, "user")},
            {"role": "assistant", "content": _turn_text(record, "completion", where, "assistant")}]


def _plain_text(record: dict, where: str, role_map: dict[str, str]) -> list[dict[str, Any]]:
    """All of it is trained: one assistant message the renderer writes without a template."""
    return [{"role": "assistant", "content": _turn_text(record, "text", where, "assistant")}]


@dataclass(frozen=True)
class RecordFormat:
    name: str
    description: str
    fields: tuple[str, ...]  # any of these (not null) identifies the format in `auto`, in registry order
    to_messages: Callable[[dict, str, dict[str, str]], list[dict[str, Any]]]  # (record, where, data.role_map)
    conversational: bool = True  # takes a `system` column and `tools`, ends in an assistant turn


RECORD_FORMATS: dict[str, RecordFormat] = {shape.name: shape for shape in (
    RecordFormat("chat", "OpenAI role/content turns; assistant turns may carry `tool_calls` (content null or empty), "
                         "`tool` turns keep `tool_call_id` and `name`; an optional `tools` list of function schemas "
                         "goes to the template", ("messages",), _chat),
    RecordFormat("sharegpt", "from/value turns: human/user, gpt/assistant/model/bot, system, "
                             "tool/function/observation/ipython, and `function_call` (JSON of a name and arguments, or "
                             "a list of them: an assistant tool call); `tools` as a list or JSON text (LLaMA-Factory)",
                 ("conversations",), _sharegpt),
    RecordFormat("alpaca", "`instruction`, optional `input` (appended after a blank line), `output`, optional "
                           "`history` of [user, assistant] pairs before the instruction (LLaMA-Factory)",
                 ("instruction", "output"), _alpaca),
    RecordFormat("prompt_completion", "`prompt` and `completion` as strings, or as lists of messages (TRL): then only "
                                      "the completion is trained, replies inside the prompt are context",
                 ("prompt", "completion"), _prompt_completion),
    RecordFormat("text", "plain text, no template, all of it trained", ("text",), _plain_text, conversational=False),
)}


# ---- turns ---------------------------------------------------------------------------------------------------

def _turns(turns: Any, field: str, where: str, role_map: dict[str, str], role_key: str,
           content_key: str) -> list[dict[str, Any]]:
    if not isinstance(turns, list) or not turns:
        raise RecordError(f"{where}: field '{field}' must be a non-empty list", f"bad_field:{field}")
    messages = []
    for index, turn in enumerate(turns):
        # The common turn (a known role, non-empty text, nothing else) costs a few lookups: this is per record
        # on the tokenize hot path. Everything else, errors included, takes the full check.
        if isinstance(turn, dict) and len(turn) == 2:
            name, content = turn.get(role_key), turn.get(content_key)
            role = (role_map.get(name) or ROLE_NAMES.get(name)) if isinstance(name, str) else None
            if role in ROLES and type(content) is str and content and not content.isspace():
                messages.append({"role": role, "content": content})
                continue
        messages.append(_turn(turn, f"{field}[{index}]", where, role_map, role_key, content_key))
    return messages


def _turn(turn: Any, path: str, where: str, role_map: dict[str, str], role_key: str,
          content_key: str) -> dict[str, Any]:
    if not isinstance(turn, dict):
        raise RecordError(f"{where}: {path}: expected an object with '{role_key}' and '{content_key}'", "bad_turn")
    name = turn.get(role_key)
    if name is None:
        raise RecordError(f"{where}: {path}.{role_key}: missing", "missing_role")
    content = turn.get(content_key)
    if name == "function_call" and role_key == "from":
        calls = _sharegpt_calls(content, f"{path}.{content_key}", where)
        return {"role": "assistant", "content": "", "tool_calls": calls}
    role = (role_map.get(name) or ROLE_NAMES.get(name)) if isinstance(name, str) else None
    if role not in ROLES:
        known = ", ".join(sorted({**ROLE_NAMES, **role_map}))
        raise RecordError(f"{where}: {path}.{role_key}: unknown role {name!r} (known: {known}; "
                          "add others with data.role_map)", "unknown_role")
    message: dict[str, Any] = {"role": role}
    # Datasets with mixed turn shapes fill absent keys with null; null means absent.
    extras = {key: turn[key] for key in _TOOL_KEYS if turn.get(key) is not None}
    if "tool_calls" in extras:
        extras["tool_calls"] = _tool_calls(extras["tool_calls"], f"{path}.tool_calls", where)
    calls = role == "assistant" and "tool_calls" in extras
    if content is not None and not isinstance(content, str):
        raise RecordError(f"{where}: {path}.{content_key}: must be a string ({type(content).__name__})",
                          "non_string_content")
    if not calls:
        _require_content(content or "", f"{path}.{content_key}", where, role)
    message["content"] = content or ""  # a tool-call turn may have no text
    message.update(extras)
    return message


def _tool_calls(calls: Any, path: str, where: str) -> list[dict[str, Any]]:
    """OpenAI tool calls; a JSON-string `arguments` is parsed, since templates write arguments with `tojson`."""
    if not isinstance(calls, list) or not calls:
        raise RecordError(f"{where}: {path}: expected a non-empty list of tool calls", "bad_tool_call")
    normalised = []
    for index, call in enumerate(calls):
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise RecordError(f"{where}: {path}[{index}].function.name: missing", "bad_tool_call")
        arguments = _arguments(function.get("arguments"), f"{path}[{index}].function.arguments", where)
        normalised.append({**{k: v for k, v in call.items() if v is not None},
                           "function": {"name": function["name"], "arguments": arguments}})
    return normalised


def _arguments(arguments: Any, path: str, where: str) -> dict[str, Any]:
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            raise RecordError(f"{where}: {path}: not valid JSON", "bad_tool_call") from None
    if not isinstance(arguments, dict):
        raise RecordError(f"{where}: {path}: expected an object of arguments", "bad_tool_call")
    return arguments


def _sharegpt_calls(value: Any, path: str, where: str) -> list[dict[str, Any]]:
    """LLaMA-Factory's function_call turn: JSON text of {"name", "arguments"} or a list of them."""
    try:
        calls = json.loads(value) if isinstance(value, str) else None
    except json.JSONDecodeError:
        calls = None
    calls = [calls] if isinstance(calls, dict) else calls
    if not isinstance(calls, list) or not calls or not all(isinstance(c, dict) for c in calls):
        raise RecordError(f"{where}: {path}: expected JSON of a call {{\"name\", \"arguments\"}} or a list of them",
                          "bad_tool_call")
    return _tool_calls([{"type": "function", "function": call} for call in calls], path, where)


def _with_system_column(record: dict, messages: list[dict[str, Any]], where: str) -> list[dict[str, Any]]:
    """A per-record `system` string is the system prompt, unless the conversation has its own."""
    system = _text(record, "system", where, optional=True)
    if not system.strip() or messages[0]["role"] == "system":
        return messages
    return [{"role": "system", "content": system}, *messages]


def _checked(messages: list[dict[str, Any]], where: str, path_of: Callable[[int], str]) -> list[dict[str, Any]]:
    """The conversation ends in an assistant turn and answers every tool call; `path_of` names a turn."""
    if messages[-1]["role"] != "assistant":
        raise RecordError(f"{where}: {path_of(len(messages) - 1)}: the last message must be the assistant's "
                          f"(it is {messages[-1]['role']!r})", "last_turn_not_assistant")
    for index, message in enumerate(messages):
        if "tool_calls" in message:
            _check_answered(messages, index, where, path_of(index))
    return messages


def _check_answered(messages: list[dict[str, Any]], index: int, where: str, path: str) -> None:
    """Every call of messages[index] has a tool turn among those that follow it: by id when all calls have ids,
    else by count."""
    calls = messages[index]["tool_calls"]
    answers = []
    for message in messages[index + 1:]:
        if message["role"] != "tool":
            break
        answers.append(message)
    ids = [call.get("id") for call in calls]
    if all(isinstance(i, str) for i in ids):
        answered = {message.get("tool_call_id") for message in answers}
        missing = [number for number, call_id in enumerate(ids) if call_id not in answered]
    else:
        missing = list(range(len(answers), len(calls)))
    if missing:
        raise RecordError(f"{where}: {path}.tool_calls[{missing[0]}]: no tool turn answers this call "
                          f"({len(answers)} tool turns follow)", "unanswered_tool_call")


def _tools(record: dict, where: str) -> list[dict[str, Any]] | None:
    """The record's function schemas: a list, or JSON text of one (LLaMA-Factory stores them as a string)."""
    tools = record.get("tools")
    if isinstance(tools, str):
        try:
            tools = json.loads(tools) if tools.strip() else None
        except json.JSONDecodeError:
            raise RecordError(f"{where}: tools: not valid JSON", "bad_field:tools") from None
    if tools is None or tools == []:
        return None
    if not isinstance(tools, list) or not all(isinstance(tool, dict) for tool in tools):
        raise RecordError(f"{where}: tools: expected a list of function schemas", "bad_field:tools")
    return tools
