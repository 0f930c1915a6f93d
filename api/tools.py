"""Tool calls for chat completions: the prompt side, the grammar side, and the output parser.

Owns:
- what `tool_choice` means here (vLLM's rules): `none` → plain text (tools still in the prompt);
  `auto` → the model decides, and its `<tool_call>` blocks are parsed (`--enable-auto-tool-choice
  --tool-call-parser hermes`; without them `auto` is a 400, as in vLLM); `required` and a named
  function → the output is constrained by a grammar to one or more hermes tool-call blocks whose
  arguments validate against the function's `parameters` schema (`tool_constraint`);
- the messages and tools handed to the chat template (assistant `tool_calls` with their
  arguments as objects, `tool` messages with `tool_call_id`);
- `HermesToolParser`: the text of one choice → content deltas and tool-call deltas in OpenAI's
  streaming shape (name first, with an id; then the arguments in pieces), used for streamed and
  whole responses alike, so both give the same calls.

Hermes format (NousResearch Hermes 2 Pro; vLLM's `hermes` parser): each call is
`<tool_call>\\n{"name": NAME, "arguments": {...}}\\n</tool_call>` in the assistant's text.
"""

from __future__ import annotations

import json
import re
import uuid

from api.protocol import ChatCompletionRequest, NamedToolChoice
from scheduler.request import ParamError, StructuredOutputs

PARSERS = ("hermes",)
START, END = "<tool_call>", "</tool_call>"
_NAME = re.compile(r'"name"\s*:\s*("(?:[^"\\]|\\.)*")')
_ARGS = re.compile(r'"arguments"\s*:\s*')
# The JSON of constrained calls: the template's style, no free whitespace (a small model given
# free whitespace can loop on it).
_JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def tool_mode(body: ChatCompletionRequest, auto_enabled: bool) -> str | None:
    """"auto", "required", "named", or None (no tool calls parsed).

    Raises: ParamError for `auto` (the default when tools are given) without
    `--enable-auto-tool-choice` (vLLM's message)."""
    if not body.tools or body.tool_choice == "none":
        return None
    if isinstance(body.tool_choice, NamedToolChoice):
        return "named"
    if body.tool_choice == "required":
        return "required"
    if not auto_enabled:
        raise ParamError('"auto" tool choice requires --enable-auto-tool-choice and '
                         "--tool-call-parser to be set", "tool_choice")
    return "auto"


def _call_schema(function) -> dict:
    params = function.parameters or {"type": "object", "properties": {}}
    return {"type": "object", "properties": {"name": {"const": function.name},
                                             "arguments": params},
            "required": ["name", "arguments"], "additionalProperties": False,
            "x-guidance": _JSON_STYLE}


def tool_constraint(body: ChatCompletionRequest, mode: str | None) -> StructuredOutputs | None:
    """The grammar (Lark, with llguidance's `%json` schemas) of a `required` or named choice:
    hermes blocks, one per call — several, newline-separated, for `required` with
    `parallel_tool_calls`. None for the other modes."""
    if mode not in ("required", "named"):
        return None
    functions = [t.function for t in body.tools]
    if mode == "named":
        functions = [f for f in functions if f.name == body.tool_choice.function.name]
    rules = [f"t{i}: %json {json.dumps(_call_schema(f))}" for i, f in enumerate(functions)]
    many = mode == "required" and body.parallel_tool_calls
    lark = "\n".join([
        'start: call ("\\n" call)*' if many else "start: call",
        f'call: "{START}\\n" body "\\n{END}"',
        "body: " + " | ".join(f"t{i}" for i in range(len(functions))), *rules])
    return StructuredOutputs("grammar", lark)


def template_messages(body: ChatCompletionRequest) -> list[dict]:
    """The conversation as chat templates expect it (content as text, None as "")."""
    out = []
    for m in body.messages:
        msg: dict = {"role": m.role, "content": m.text()}
        if m.tool_calls:
            msg["tool_calls"] = [{"id": c.id, "type": "function", "function": {
                "name": c.function.name, "arguments": _loads_or_text(c.function.arguments)}}
                for c in m.tool_calls]
        if m.tool_call_id is not None:
            msg["tool_call_id"] = m.tool_call_id
        if m.name is not None:
            msg["name"] = m.name
        if m.role == "assistant" and (m.reasoning or m.reasoning_content) is not None:
            msg["reasoning"] = msg["reasoning_content"] = m.reasoning or m.reasoning_content
        out.append(msg)
    return out


def system_for_developer(messages: list[dict], template: str) -> list[dict]:
    """`developer` messages as `system` ones where the chat template knows no developer role,
    all system messages then merged into one at the start ("\n\n"-joined) when there is more
    than one or one not first (vLLM's `_convert_developer_to_system` and
    `_consolidate_system_messages`)."""
    if not any(m["role"] == "developer" for m in messages) or \
            '"developer"' in template or "'developer'" in template:
        return messages
    messages = [{**m, "role": "system"} if m["role"] == "developer" else m for m in messages]
    systems = [i for i, m in enumerate(messages) if m["role"] == "system"]
    if len(systems) < 2 and systems != [] and systems[0] == 0:
        return messages
    merged = "\n\n".join(c for i in systems if (c := messages[i]["content"]))
    return [{"role": "system", "content": merged},
            *(m for m in messages if m["role"] != "system")]


def template_tools(body: ChatCompletionRequest) -> list[dict] | None:
    """`tools` for the chat template (OpenAI's shape), or None."""
    return [t.model_dump(exclude_none=True) for t in body.tools] if body.tools else None


def _loads_or_text(text: str):
    try:
        return json.loads(text)
    except ValueError:
        return text


def _parse_call(text: str) -> tuple[str | None, object]:
    """(name, arguments) of a hermes call's JSON text; (None, None) when it is not one."""
    try:
        obj = json.loads(text)
    except ValueError:
        return None, None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None, None
    return obj["name"], obj.get("arguments", {})


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `marker`."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:k]):
            return k
    return 0


class HermesToolParser:
    """Incremental parser of one choice's text (see the module docstring).

    `feed(text)` and `finish()` return deltas: dicts with "content" (str) and/or "tool_calls"
    (OpenAI's `[{index, id, type, function: {name, arguments}}]` on a call's first delta, then
    `[{index, function: {arguments}}]`). Text that may still turn into a marker is held back
    until it is decided. `calls` accumulates the calls (id, name, arguments text);
    `complete[i]` is whether call i's JSON was whole (False: cut short, e.g. by max_tokens —
    its arguments are then what was streamed, or "{}").
    """

    def __init__(self) -> None:
        self.buf = ""             # undecided text outside a call
        self.call = None          # text of the open call, or None
        self.name_sent = False    # the open call's first delta (id, name) is out
        self.calls: list[dict] = []
        self.complete: list[bool] = []

    def feed(self, text: str) -> list[dict]:
        """Deltas for newly generated `text`."""
        self.buf += text
        deltas: list[dict] = []
        while self.buf:
            if self.call is None:
                i = self.buf.find(START)
                if i < 0:
                    keep = _partial_suffix(self.buf, START)
                    self._content(deltas, self.buf[:len(self.buf) - keep])
                    self.buf = self.buf[len(self.buf) - keep:]
                    return deltas
                self._content(deltas, self.buf[:i])
                self.buf, self.call = self.buf[i + len(START):], ""
                self.name_sent = False
            self.call += self.buf
            self.buf = ""
            j = self.call.find(END)
            if j < 0:
                self._progress(deltas)
                return deltas
            self.buf = self.call[j + len(END):]
            self._close(deltas, self.call[:j])
            self.call = None
        return deltas

    def finish(self) -> list[dict]:
        """Deltas for whatever is held back at the end of the choice (an unterminated call
        is closed if its JSON is complete, else returned as content)."""
        deltas: list[dict] = []
        if self.call is not None:
            self._close(deltas, self.call)
            self.call = None
        self._content(deltas, self.buf)
        self.buf = ""
        return deltas

    def _content(self, deltas: list[dict], text: str) -> None:
        if text and not (self.calls and not text.strip()):   # blank lines between calls
            deltas.append({"content": text})

    def _progress(self, deltas: list[dict]) -> None:
        """Emit the name once complete, then the arguments as they grow (trailing braces and
        whitespace held back: they may close the call's object)."""
        if not self.name_sent:
            m = _NAME.search(self.call)
            args = _ARGS.search(self.call)
            if m is None or (args is not None and args.start() < m.start()):
                return
            self._start_call(deltas, json.loads(m.group(1)))
        m = _ARGS.search(self.call)
        if m is None:
            return
        raw = self.call[m.end():]
        raw = raw[:len(raw) - _partial_suffix(raw, END)].rstrip(" \t\r\n}")
        sent = len(self.calls[-1]["function"]["arguments"])
        if len(raw) > sent:
            self._args(deltas, raw[sent:])

    def _close(self, deltas: list[dict], text: str) -> None:
        name, args = _parse_call(text)
        if name is None and not self.name_sent:      # not a call after all: it was text
            self._content(deltas, START + text)
            return
        if not self.name_sent:
            self._start_call(deltas, name)
        self.complete[-1] = name is not None
        final = self._arguments_text(text, args)
        sent = self.calls[-1]["function"]["arguments"]
        # What was streamed is a prefix of `final` for every complete hermes block; a call cut
        # short (max_tokens) keeps the text streamed so far, so both response shapes agree.
        if sent and not final.startswith(sent):
            return
        if final[len(sent):]:
            self._args(deltas, final[len(sent):])

    def _arguments_text(self, text: str, args) -> str:
        """The arguments as the model wrote them, if that is their JSON; else re-serialised."""
        m = _ARGS.search(text)
        if m is not None:
            raw = text[m.end():].rstrip()
            raw = raw[:-1].rstrip() if raw.endswith("}") else raw
            try:
                if json.loads(raw) == args:
                    return raw
            except ValueError:
                pass
        return json.dumps(args if args is not None else {})

    def _start_call(self, deltas: list[dict], name: str | None) -> None:
        call = {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                "function": {"name": name or "", "arguments": ""}}
        self.calls.append(call)
        self.complete.append(False)
        self.name_sent = True
        deltas.append({"tool_calls": [{"index": len(self.calls) - 1, "id": call["id"],
                                       "type": "function",
                                       "function": {"name": call["function"]["name"],
                                                    "arguments": ""}}]})

    def _args(self, deltas: list[dict], piece: str) -> None:
        self.calls[-1]["function"]["arguments"] += piece
        deltas.append({"tool_calls": [{"index": len(self.calls) - 1,
                                       "function": {"arguments": piece}}]})
