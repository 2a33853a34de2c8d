"""A small reader of protobuf text format (what an Object Detection API ``pipeline.config`` and a
``label_map.pbtxt`` are written in), without the schema: ``name: value``, ``name { ... }`` (also
``name: { ... }`` and ``< ... >``), lists ``name: [1, 2]``, ``#`` comments, quoted strings with
escapes, numbers, ``true``/``false`` and enum names. An extension field (``[full.name] { ... }``,
``[full.name]: value``; also an ``Any``'s ``[type.googleapis.com/full.name]``) is read and left
out: its schema lives in a proto we do not have; ``Message.extensions`` names each. Blocks nest at most ``MAX_DEPTH`` deep and
integers fit 64 bits, as in protobuf's own parsers.

A message is a ``Message``: field name -> list of values (every field may repeat); a value is a
``str``, ``int``, ``float``, ``bool``, ``Enum`` or a nested ``Message``. Without the schema a
quoted string and an enum name are told apart by their quotes, and ``1`` is an int even where the
field is a float (the caller converts). Errors are ``TextFormatError`` with line and column.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field


class TextFormatError(ValueError):
    """A syntax error; ``line`` and ``column`` are 1-based."""

    def __init__(self, message: str, line: int, column: int):
        super().__init__(f"line {line}, column {column}: {message}")
        self.line, self.column = line, column


class Enum(str):
    """An unquoted identifier value (an enum such as SIGMOID or V2)."""


@dataclass
class Message:
    fields: dict[str, list] = field(default_factory=dict)
    line: int = 1  # where the message (or the file) starts
    extensions: list[tuple[str, int]] = field(default_factory=list)  # (full name, line) skipped

    def get(self, name: str, default=None):
        """The last value of ``name`` (the text format's rule for a repeated scalar), or default."""
        values = self.fields.get(name)
        return values[-1] if values else default

    def all(self, name: str) -> list:
        return self.fields.get(name, [])

    def message(self, name: str) -> Message | None:
        value = self.get(name)
        return value if isinstance(value, Message) else None

    def only(self) -> tuple[str, Message | object] | tuple[None, None]:
        """The one field set in a ``oneof``-style message (``learning_rate { cosine_... { } }``)."""
        for name, values in self.fields.items():
            return name, values[-1]
        return None, None


_TOKEN = re.compile(
    r"""
    (?P<space>[ \t\r\f\v]+|\n)
  | (?P<comment>\#[^\n]*)
  | (?P<string>"(?:[^"\\\n]|\\.)*"|'(?:[^'\\\n]|\\.)*')
  | (?P<number>[-+]?(?:0[xX][0-9a-fA-F]+|(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?)[fF]?)
  | (?P<ident>[-+]?[A-Za-z_][A-Za-z0-9_.]*)
  | (?P<punct>[{}\[\]<>:,;/])
    """,
    re.X,
)
MAX_DEPTH = 100  # blocks inside blocks: protobuf's own parsers stop at 100; a pipeline.config nests ~6
# The widest integer a protobuf field holds (int64 and uint64): anything longer is no setting.
INT_MIN, INT_MAX = -(2**63), 2**64 - 1
_ESCAPES = {"n": "\n", "t": "\t", "r": "\r", "'": "'", '"': '"', "\\": "\\", "a": "\a", "b": "\b"}
_ESCAPES.update({"f": "\f", "v": "\v", "?": "?"})
_CLOSE = {"{": "}", "<": ">"}


@dataclass(frozen=True)
class _Tok:
    kind: str
    text: str
    line: int
    column: int


def _tokens(text: str) -> list[_Tok]:
    out, pos, line, line_start = [], 0, 1, 0
    while pos < len(text):
        m = _TOKEN.match(text, pos)
        column = pos - line_start + 1
        if m is None and text[pos] in "'\"":
            raise TextFormatError("string not closed on its line; add the closing quote", line, column)
        if m is None:
            raise TextFormatError(f"unexpected character {text[pos]!r}", line, column)
        kind = m.lastgroup
        if kind == "space" and m.group() == "\n":
            line, line_start = line + 1, m.end()
        elif kind == "number" and m.end() < len(text) and re.match(r"[A-Za-z_]", text[m.end()]):
            raise TextFormatError(f"bad number {text[pos : m.end() + 1]!r}...", line, column)
        elif kind not in ("space", "comment"):
            out.append(_Tok(kind, m.group(), line, column))
        pos = m.end()
    out.append(_Tok("end", "", line, pos - line_start + 1))
    return out


def _unquote(tok: _Tok) -> str:
    # Escaped bytes (octal, hex) may spell UTF-8 sequences: gather bytes, decode once.
    body, out, i = tok.text[1:-1], bytearray(), 0
    while i < len(body):
        c = body[i]
        if c != "\\":
            out += c.encode("utf-8")
            i += 1
            continue
        nxt = body[i + 1]
        if nxt in _ESCAPES:
            out += _ESCAPES[nxt].encode("utf-8")
            i += 2
        elif nxt in "01234567":
            digits = re.match(r"[0-7]{1,3}", body[i + 1 :]).group()
            out.append(int(digits, 8) & 0xFF)
            i += 1 + len(digits)
        elif nxt == "x" and re.match(r"[0-9a-fA-F]{1,2}", body[i + 2 :]):
            digits = re.match(r"[0-9a-fA-F]{1,2}", body[i + 2 :]).group()
            out.append(int(digits, 16))
            i += 2 + len(digits)
        else:
            raise TextFormatError(f"unknown escape '\\{nxt}' in a string", tok.line, tok.column + i + 1)
    return out.decode("utf-8", errors="replace")


class _Parser:
    def __init__(self, text: str):
        self.toks = _tokens(text)
        self.i = 0
        self.depth = 0

    def peek(self) -> _Tok:
        return self.toks[self.i]

    def take(self) -> _Tok:
        tok = self.toks[self.i]
        self.i += 1
        return tok

    def fail(self, tok: _Tok, want: str):
        found = "the end of the file" if tok.kind == "end" else f"'{tok.text}'"
        raise TextFormatError(f"expected {want}, found {found}", tok.line, tok.column)

    def message(self, close: str | None, line: int) -> Message:
        if self.depth > MAX_DEPTH:  # one Python frame per level: a RecursionError long before the end
            tok = self.toks[self.i - 1]
            raise TextFormatError(
                f"blocks nested more than {MAX_DEPTH} deep; no pipeline.config or label map nests so deep: "
                "fix the file",
                tok.line,
                tok.column,
            )
        self.depth += 1
        try:
            return self._fields(close, line)
        finally:
            self.depth -= 1

    def _fields(self, close: str | None, line: int) -> Message:
        msg = Message(line=line)
        while True:
            tok = self.peek()
            if close is None and tok.kind == "end":
                return msg
            if close is not None and tok.text == close and tok.kind == "punct":
                self.take()
                return msg
            if tok.kind == "end":
                raise TextFormatError(
                    f"missing '{close}' for the block opened on line {line}", tok.line, tok.column
                )
            if tok.kind == "punct" and tok.text == "[":
                name = self.extension_name()
                self.field(Message(), f"[{name}]")  # read to its end, then left out
                msg.extensions.append((name, tok.line))
            elif tok.kind != "ident" or tok.text[0] in "+-":
                self.fail(tok, "a field name" + (f" or '{close}'" if close else ""))
            else:
                name = self.take().text
                self.field(msg, name)
            if self.peek().kind == "punct" and self.peek().text in ",;":
                self.take()

    def extension_name(self) -> str:
        """``[a.b.C.d]`` or ``[host/a.b.C]`` -> its full name (between the brackets)."""
        self.take()
        parts = []
        while True:
            tok = self.take()
            if not (tok.kind == "ident" and tok.text[0] not in "+-"):
                self.fail(tok, "an extension's full name")
            parts.append(tok.text)
            tok = self.take()
            if tok.kind == "punct" and tok.text == "]":
                return "".join(parts)
            if not (tok.kind == "punct" and tok.text == "/"):
                self.fail(tok, f"']' after '[{''.join(parts)}'")
            parts.append("/")

    def field(self, msg: Message, name: str) -> None:
        tok = self.peek()
        colon = tok.kind == "punct" and tok.text == ":"
        if colon:
            self.take()
            tok = self.peek()
        if tok.kind == "punct" and tok.text in _CLOSE:
            self.take()
            msg.fields.setdefault(name, []).append(self.message(_CLOSE[tok.text], tok.line))
            return
        if not colon:
            self.fail(tok, f"':' or '{{' after '{name}'")
        if tok.kind == "punct" and tok.text == "[":
            self.take()
            values = msg.fields.setdefault(name, [])
            if self.peek().text == "]" and self.peek().kind == "punct":
                self.take()
                return
            while True:
                inner = self.peek()
                if inner.kind == "punct" and inner.text in _CLOSE:
                    self.take()
                    values.append(self.message(_CLOSE[inner.text], inner.line))
                else:
                    values.append(self.scalar())
                sep = self.take()
                if sep.kind == "punct" and sep.text == "]":
                    return
                if not (sep.kind == "punct" and sep.text == ","):
                    self.fail(sep, "',' or ']' in the list")
        msg.fields.setdefault(name, []).append(self.scalar())

    def scalar(self):
        tok = self.take()
        if tok.kind == "string":
            parts = [_unquote(tok)]
            while self.peek().kind == "string":  # adjacent strings are concatenated
                parts.append(_unquote(self.take()))
            return "".join(parts)
        if tok.kind == "number":
            text = (
                tok.text.rstrip("fF") if not tok.text.lower().startswith(("0x", "-0x", "+0x")) else tok.text
            )
            if re.fullmatch(r"[-+]?0[xX][0-9a-fA-F]+", text):
                return self.integer(tok, text, 16)
            if re.fullmatch(r"[-+]?\d+", text) and not tok.text.endswith(("f", "F")):
                return self.integer(tok, text, 10)
            return float(text)
        if tok.kind == "ident":
            low = tok.text.lower()
            if low in ("true", "t"):
                return True
            if low in ("false", "f"):
                return False
            if low.lstrip("+-") in ("inf", "infinity", "nan"):
                return float(low)
            if tok.text[0] in "+-":
                self.fail(tok, "a value")
            return Enum(tok.text)
        self.fail(tok, "a value")

    @staticmethod
    def integer(tok: _Tok, text: str, base: int) -> int:
        # The length first: Python refuses to convert more than 4300 decimal digits (a traceback).
        digits = len(text.lstrip("+-"))
        value = int(text, base) if digits <= 40 else None
        if value is None or not INT_MIN <= value <= INT_MAX:
            shown = text if len(text) <= 24 else f"{text[:20]}... ({digits} digits)"
            raise TextFormatError(
                f"integer {shown} out of range: protobuf integers have 64 bits at most; fix the value",
                tok.line,
                tok.column,
            )
        return value


def parse(text: str) -> Message:
    """Parses a whole text-format file. Raises TextFormatError."""
    return _Parser(text).message(None, 1)
