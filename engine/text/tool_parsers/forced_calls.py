"""Tool calls a grammar forces (OpenAI's `tool_choice` "required" or a named function),
streamed as they are generated.

Unlike a `ToolCallStream`, which sends a call only once the free text has formed it
whole, these streams know the output's shape in advance, so a call's arguments go out
fragment by fragment while the model writes them. The arguments are the text as
generated, not re-serialized (the grammar made it JSON); an output cut by a length
limit leaves them truncated (the caller reports finish_reason "length").

Both streams follow `ToolCallStream`'s contract: `feed(delta)` -> `ToolStreamDelta`;
`finish()` at the end of the output (again: empty); `feed` after it raises RuntimeError;
`result()` after `finish` is what the deltas added up to, whatever the chunking."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum, auto

from engine.text.tool_parsers.call_ids import CallIdFunction
from engine.text.tool_parsers.call_json import load_json
from engine.text.tool_parsers.tool_call import (
    ParsedToolCalls,
    ToolCall,
    ToolCallDelta,
    ToolStreamDelta,
)

_SPACE = " \t\n\r"  # JSON whitespace
_OPEN_CALL = ("{", '"name"', ":", '"')  # the tokens from an element's start to its name
_AFTER_NAME = (",", '"parameters"', ":")
_CLOSER = {"{": "}", "[": "]"}


class NamedCallStream:
    """The whole output is the arguments (a JSON object) of one known function.

    Contract (besides the module's):
    - The first `feed`, even of "", returns the call's first delta: index 0, its `id`
      and `name`, `arguments=""`; `finish()` returns it instead when no feed came. It is
      sent exactly once.
    - Every non-empty delta is sent as it came, as an arguments fragment of index 0.
    - `result()`: no content, one call whose arguments are the whole text (an empty
      output makes a call with arguments "")."""

    def __init__(self, name: str, call_id: CallIdFunction) -> None:
        self._id = call_id(0)
        self._name = name
        self._arguments: list[str] = []
        self._started = False
        self._finished = False

    def feed(self, delta: str) -> ToolStreamDelta:
        if self._finished:
            raise RuntimeError("NamedCallStream.feed after finish(); start a new stream")
        deltas = self._start()
        if delta:
            self._arguments.append(delta)
            deltas += (ToolCallDelta(0, arguments=delta),)
        return ToolStreamDelta(tool_calls=deltas)

    def finish(self) -> ToolStreamDelta:
        if self._finished:
            return ToolStreamDelta()
        self._finished = True
        return ToolStreamDelta(tool_calls=self._start())

    def result(self) -> ParsedToolCalls:
        """The call of the whole output (call after `finish`)."""
        return ParsedToolCalls(None, [ToolCall(self._id, self._name, "".join(self._arguments))])

    def _start(self) -> tuple[ToolCallDelta, ...]:
        if self._started:
            return ()
        self._started = True
        return (ToolCallDelta(0, id=self._id, name=self._name),)


class _Part(Enum):
    """Where the array's text has got to."""

    TOKENS = auto()  # fixed tokens expected (`{`, `"name"`, `:`, ...), whitespace between
    NAME = auto()  # inside an element's name string
    VALUE = auto()  # the parameters value, from its `{` to the matching `}`
    NEXT = auto()  # after an element: `,` and another, or `]`
    END = auto()  # after `]`: whitespace only
    BROKEN = auto()  # the text left the shape: the rest is ignored


@dataclass
class _Call:
    id: str
    name: str
    arguments: list[str] = field(default_factory=list)


class _Deltas:
    """One feed's call deltas, in order; the argument chars a call gets in this feed
    merged into one fragment."""

    def __init__(self, index: int) -> None:
        self._deltas: list[ToolCallDelta] = []
        self._chars: list[str] = []
        self._index = index  # the call the chars belong to

    def start(self, index: int, call_id: str, name: str) -> None:
        self._flush()
        self._deltas.append(ToolCallDelta(index, id=call_id, name=name))
        self._index = index

    def add(self, char: str) -> None:
        self._chars.append(char)

    def done(self) -> tuple[ToolCallDelta, ...]:
        self._flush()
        return tuple(self._deltas)

    def _flush(self) -> None:
        if self._chars:
            self._deltas.append(ToolCallDelta(self._index, arguments="".join(self._chars)))
            self._chars = []


class CallArrayStream:
    """The output is a JSON array of calls, as the "required" grammar writes it:
    `[{"name":"f","parameters":{...}},...]`, `name` then `parameters` in each element;
    JSON whitespace between tokens is allowed.

    Contract (besides the module's):
    - A call's first delta (index, `id`, `name`, `arguments=""`) is sent as soon as its
      name string closes (escapes in it decoded); then its parameters value (an object)
      is sent char for char as written, as one fragment per feed: the fragments of an
      index concatenate to exactly the value's JSON text. String, escape and bracket
      state are followed to find where the value ends.
    - Text that leaves this shape (a bug, or a cut output: unterminated, wrong key,
      mismatched bracket, empty name, text after `]`) is never an error: nothing more
      is sent from the first char that leaves it; the calls sent so far stand, with
      the arguments sent so far.
    - `result()`: those calls and no content; or, when no call was sent, no calls and
      the whole text as content (which `finish()` then sends)."""

    _part: _Part
    _tokens: tuple[str, ...]  # TOKENS: the fixed tokens still expected
    _at: int  # TOKENS: how many chars of `_tokens[0]` have come
    _then: _Part  # TOKENS: the part after the last token

    def __init__(self, call_id: CallIdFunction) -> None:
        self._call_id = call_id
        self._text: list[str] = []
        self._calls: list[_Call] = []
        self._name: list[str] = []  # the open name string's raw chars
        self._open: list[str] = []  # the value's open brackets
        self._in_string = False  # inside a string of the value
        self._escaped = False  # the last char inside a string was an escaping backslash
        self._handlers = {
            _Part.TOKENS: self._token,
            _Part.NAME: self._name_char,
            _Part.VALUE: self._value_char,
            _Part.NEXT: self._next_char,
            _Part.END: self._end_char,
        }
        self._expect(("[", *_OPEN_CALL), _Part.NAME)
        self._finished = False

    def feed(self, delta: str) -> ToolStreamDelta:
        if self._finished:
            raise RuntimeError("CallArrayStream.feed after finish(); start a new stream")
        self._text.append(delta)
        deltas = _Deltas(len(self._calls) - 1)
        for char in delta:
            if self._part is _Part.BROKEN:
                break
            self._handlers[self._part](char, deltas)
        out = deltas.done()
        for d in out:
            if d.id is None:
                self._calls[d.index].arguments.append(d.arguments)
        return ToolStreamDelta(tool_calls=out)

    def finish(self) -> ToolStreamDelta:
        if self._finished:
            return ToolStreamDelta()
        self._finished = True
        return ToolStreamDelta(content="" if self._calls else "".join(self._text))

    def result(self) -> ParsedToolCalls:
        """The calls sent (or the text, when none was), after `finish`."""
        calls = [ToolCall(c.id, c.name, "".join(c.arguments)) for c in self._calls]
        return ParsedToolCalls(None if calls else "".join(self._text), calls)

    def _expect(self, tokens: tuple[str, ...], then: _Part) -> None:
        self._part, self._tokens, self._at, self._then = _Part.TOKENS, tokens, 0, then

    def _token(self, char: str, deltas: _Deltas) -> None:
        """A char of the next fixed token (whitespace allowed before a token)."""
        if self._at == 0 and char in _SPACE:
            return
        if char != self._tokens[0][self._at]:
            self._part = _Part.BROKEN
            return
        self._at += 1
        if self._at == len(self._tokens[0]):
            self._tokens, self._at = self._tokens[1:], 0
            if not self._tokens:
                self._part = self._then

    def _string_goes_on(self, char: str) -> bool:
        """Follow one char inside a JSON string; False when it is the closing quote."""
        if self._escaped or char != '"':
            self._escaped = not self._escaped and char == "\\"
            return True
        return False

    def _name_char(self, char: str, deltas: _Deltas) -> None:
        if self._string_goes_on(char):
            self._name.append(char)
            return
        ok, name = load_json('"' + "".join(self._name) + '"')
        self._name = []
        if not ok or not name:
            self._part = _Part.BROKEN
            return
        call = _Call(self._call_id(len(self._calls)), name)
        self._calls.append(call)
        deltas.start(len(self._calls) - 1, call.id, name)
        self._expect(_AFTER_NAME, _Part.VALUE)

    def _value_char(self, char: str, deltas: _Deltas) -> None:
        """A char of the parameters value, or whitespace before it."""
        if self._in_string:
            self._in_string = self._string_goes_on(char)
        elif not self._open and char in _SPACE:
            return
        elif char in _CLOSER and (self._open or char == "{"):
            self._open.append(char)
        elif self._open and char == _CLOSER[self._open[-1]]:
            self._open.pop()
        elif not self._open or char in "}]":
            self._part = _Part.BROKEN
            return
        elif char == '"':
            self._in_string = True
        deltas.add(char)
        if not self._open:
            self._expect(("}",), _Part.NEXT)

    def _next_char(self, char: str, deltas: _Deltas) -> None:
        if char == ",":
            self._expect(_OPEN_CALL, _Part.NAME)
        elif char == "]":
            self._part = _Part.END
        elif char not in _SPACE:
            self._part = _Part.BROKEN

    def _end_char(self, char: str, deltas: _Deltas) -> None:
        if char not in _SPACE:
            self._part = _Part.BROKEN
