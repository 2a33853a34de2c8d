"""One-line problem messages: a value echoed on one line (unsafe characters escaped, cut to a
length), then what is wrong and the fix; and the closest known key for a misspelt one."""

from __future__ import annotations

import difflib
import re

# Characters that end a line in some shell, YAML or Markdown (control characters, NEL, U+2028,
# U+2029) or reorder how a line reads (bidi controls): no value od-dist writes anywhere may hold one.
UNSAFE_CHARS = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029\u200e\u200f\u202a-\u202e\u2066-\u2069]")
SHOWN_MAX = 80  # characters of a value echoed in a message
PATH_SHOWN_MAX = 4096  # a path is echoed whole: the longest one Linux opens (PATH_MAX)
# What gives TensorFlow CUDA's libraries (setup.cfg's gpu extra): said by the trainer that finds no
# GPU and by `od-dist doctor`.
GPU_INSTALL = 'pip install -e ".[gpu]"'


def unsafe_char(text: str) -> str | None:
    """The first character of `text` that no line of a script, README or manifest may hold, as
    Python writes it (e.g. '\\n'), else None."""
    found = UNSAFE_CHARS.search(text)
    return None if found is None else repr(found.group())[1:-1]


def shown(value, limit: int = SHOWN_MAX) -> str:
    """A value as an error message echoes it: on one line (unsafe characters escaped) and cut."""
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 64:
        return f"a number of about {int(value.bit_length() * 0.30103) + 1} digits"  # str() may refuse it
    text = value if isinstance(value, str) else repr(value)
    text = UNSAFE_CHARS.sub(lambda m: repr(m.group())[1:-1], text)
    if len(text) > limit:
        text = f"{text[: limit - 20]}...({len(text)} characters)"
    return text


def problem(key: str, value, what: str, fix: str, limit: int = SHOWN_MAX) -> str:
    return f"{shown(key)}: '{shown(value, limit)}': {what}; {fix}"


def did_you_mean(word, choices, what: str = "keys") -> str:
    """The closest of `choices` to a misspelt `word`, else the first dozen `choices` (the cluster
    file's keys, a pipeline's)."""
    choices = list(choices)
    close = difflib.get_close_matches(str(word), choices, n=1, cutoff=0.6)
    if close:
        return f"did you mean '{close[0]}'?"
    shown = ", ".join(choices[:12]) + (", ..." if len(choices) > 12 else "")
    return f"known {what}: {shown}"
