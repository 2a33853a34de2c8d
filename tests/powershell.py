"""PowerShell's string quoting as its language specification writes it, for the tests to read
generated .ps1 lines without the code that writes them (od_dist/render/quote.py).

PowerShell Language Specification 3.0, section 2.3.5.2 (String literals):
  single-quote-character: ' (U+0027), Left single quotation mark (U+2018), Right single quotation
    mark (U+2019), Single low-9 quotation mark (U+201A), Single high-reversed-9 quotation mark (U+201B)
  double-quote-character: " (U+0022), Left double quotation mark (U+201C), Right double quotation
    mark (U+201D), Double low-9 quotation mark (U+201E)
  verbatim-string-part: any character except a single-quote-character, or two of them (one quote)
  expandable-string-part: ... except $, a double-quote-character and ` (the backtick, U+0060,
    which escapes the next character)
"""

SINGLE_QUOTES = "'\u2018\u2019\u201a\u201b"
DOUBLE_QUOTES = '"\u201c\u201d\u201e'
BACKTICK = "`"


def unquote(text):
    """The tokenizer on a verbatim (single-quoted) string at the start of `text`: any single-quote
    character ends it unless doubled. Returns (value, the rest of the text after the closing one)."""
    assert text[0] in SINGLE_QUOTES, text
    out, i = [], 1
    while i < len(text):
        if text[i] in SINGLE_QUOTES:
            if i + 1 < len(text) and text[i + 1] in SINGLE_QUOTES:
                out.append(text[i + 1])
                i += 2
                continue
            return "".join(out), text[i + 1 :]
        out.append(text[i])
        i += 1
    raise ValueError("unterminated string")


def outside_single_quotes(line):
    """A line without its verbatim strings (where nothing expands), and those strings' values."""
    rest, kept, literals = line, [], []
    while rest:
        if rest[0] in SINGLE_QUOTES:
            value, rest = unquote(rest)
            literals.append(value)
        else:
            kept.append(rest[0])
            rest = rest[1:]
    return "".join(kept), literals


def literal(text):
    """The value of a verbatim string that is the whole of `text`."""
    value, rest = unquote(text)
    assert rest == "", text
    return value
