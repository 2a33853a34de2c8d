"""Quoting, one function per target: every value that reaches a launch script, a README line or a
manifest goes through here, and nowhere else quotes. Pure functions, no TensorFlow.

- `sh`: one bash word that is exactly the value: anything not plainly safe goes in single quotes
  (`'` -> `'\\''`); inside single quotes bash expands nothing, non-ASCII bytes pass as they are.
  `sh_path` is the same with `~` / `~/` at its start expanded to $HOME, as bash would.
- `cmd`: one argument on a line of a .cmd file: first quoted as a Windows program parses its own
  command line (`windows_arg`, the C-runtime rules: `"` groups, `\\` escapes a quote), then escaped
  for the batch line (`cmd_escape`): every `"` becomes `^"`, so cmd never enters its quoted state
  and every `& | < > ( ) ^` is `^`-escaped with certainty; every `%` is doubled (the only escape for
  `%` in a batch file); `!` is literal because the scripts turn delayed expansion off. Text inside
  real double quotes (a program, `pushd "..."`, `set "N=..."`) goes through `cmd_in_quotes`.
- `ps`: a PowerShell single-quoted literal (nothing expands; `'` and its typographic look-alikes,
  which PowerShell also ends strings with, are doubled).
- `md`: Markdown inline code whose fence is longer than any run of backticks in the value, with
  `|` escaped so that it stays in its table cell.
- `systemd`: one word of a systemd unit's command line (`ExecStart=`): in double quotes, `\\` and
  `"` escaped C-style, `%` written `%%` (a specifier) and `$` written `$$` (a variable).
  `systemd_value`: the rest of any other setting's line (a path, a user, a description): `%` written
  `%%`; leading or trailing whitespace (which systemd strips) and a trailing `\\` (which continues
  the line) are refused.
- `yaml_dump`: a document written by the YAML library, then parsed back and compared with what
  was given, so that no value can add a key or a document.

Control characters, NEL, U+2028/U+2029 and bidi controls end or reorder a line in at least one of
these targets (bash, cmd, PowerShell, YAML, Markdown): every function refuses them (QuoteError, a
one-line message naming the value).
"""

from __future__ import annotations

import re

import yaml

from od_dist.cluster.messages import shown, unsafe_char

_SH_SAFE = re.compile(r"[A-Za-z0-9_@%+=:,./-]+")
_CMD_SPECIAL = set("&|<>()^")
_MD_PLAIN = re.compile(r"[A-Za-z0-9.:%-]+(:[0-9]+)?")
PS_SINGLE_QUOTES = "'\u2018\u2019\u201a\u201b"  # PowerShell ends a '...' string on any of these


class QuoteError(ValueError):
    """A value that no script, README or manifest line can carry; the message names it and the fix."""


def check(value: str, what: str = "value") -> str:
    """`value` when it fits on one line of any target, else QuoteError."""
    bad = unsafe_char(value)
    if bad:
        raise QuoteError(
            f"{what}: '{shown(value)}': contains a control character ('{bad}': newline, tab, line "
            "separator, ...); scripts, READMEs and manifests take each value on one line: remove it"
        )
    return value


# ----- bash ------------------------------------------------------------------------------------


def sh(value: str) -> str:
    """One bash word that is exactly `value`."""
    check(value)
    if _SH_SAFE.fullmatch(value):
        return value
    return "'" + value.replace("'", "'\\''") + "'"


def sh_path(value: str) -> str:
    """A path as one bash word, `~` or `~/` at its start expanded to $HOME as bash would."""
    if value == "~":
        return '"$HOME"'
    if value.startswith("~/"):
        return '"$HOME"' + sh(value[1:])
    return sh(value)


# ----- Windows command lines and cmd -------------------------------------------------------------


def windows_arg(value: str) -> str:
    """One argument of a Windows command line, as the C runtime (and CommandLineToArgvW) splits it:
    quoted when empty or holding whitespace (the C runtime splits at space and tab only; quoting
    any Unicode space as well costs nothing) or a quote; backslashes doubled only before a quote."""
    check(value)
    if value and not any(c.isspace() or c == '"' for c in value):
        return value
    out, backslashes = ['"'], 0
    for c in value:
        if c == "\\":
            backslashes += 1
            continue
        out.append("\\" * (2 * backslashes + 1) if c == '"' else "\\" * backslashes)
        out.append(c)
        backslashes = 0
    out.append("\\" * (2 * backslashes) + '"')
    return "".join(out)


def windows_command_line(args: list[str]) -> str:
    """The arguments after the program name, joined into one Windows command line."""
    return " ".join(windows_arg(a) for a in args)


def cmd_escape(text: str) -> str:
    """A piece of a command line, escaped for a line of a .cmd/.bat file (delayed expansion off).

    Every `"` is written `^"`: cmd then never enters its quoted state, so escaping every other
    special character with `^` is always right, and the program still receives the quotes."""
    check(text)
    out = []
    for c in text:
        if c == "%":
            out.append("%%")
        elif c == '"' or c in _CMD_SPECIAL:
            out.append("^" + c)
        else:
            out.append(c)
    return "".join(out)


def cmd(value: str) -> str:
    """One argument on a line of a .cmd file that the program receives as exactly `value`."""
    return cmd_escape(windows_arg(value))


def cmd_in_quotes(path: str) -> str:
    """Text for inside real double quotes in a batch file (a program to run, `pushd`, `set "N=..."`):
    there only `%` is special. Windows paths cannot contain `"`."""
    check(path)
    if '"' in path:
        raise QuoteError(f"{shown(path)}: a Windows path cannot contain '\"': fix the hosts settings")
    return path.replace("%", "%%")


# ----- PowerShell --------------------------------------------------------------------------------


def ps(value: str) -> str:
    """A PowerShell single-quoted string that is exactly `value`."""
    check(value)
    return "'" + "".join(c + c if c in PS_SINGLE_QUOTES else c for c in value) + "'"


# ----- systemd unit files ------------------------------------------------------------------------


def systemd(value: str) -> str:
    """One word of a unit file's command line (`ExecStart=`) that is exactly `value`."""
    check(value)
    text = value.replace("\\", "\\\\").replace('"', '\\"').replace("%", "%%").replace("$", "$$")
    return f'"{text}"'


def systemd_value(value: str) -> str:
    """The value of a unit file's setting other than a command line, read as it is but for specifiers."""
    check(value)
    if value != value.strip() or value.endswith("\\"):
        raise QuoteError(
            f"'{shown(value)}': begins or ends with whitespace (which systemd strips) or ends with '\\' "
            "(which continues the unit file's line): remove it"
        )
    return value.replace("%", "%%")


# ----- Markdown ----------------------------------------------------------------------------------


def md(value: str, table: bool = False) -> str:
    """Inline code that shows exactly `value` (in a table cell: `table`, `|` escaped there)."""
    check(value)
    longest = max((len(run) for run in re.findall(r"`+", value)), default=0)
    fence = "`" * (longest + 1)
    pad = " " if value.startswith("`") or value.endswith("`") or not value.strip() else ""
    text = value.replace("|", "\\|") if table else value
    return f"{fence}{pad}{text}{pad}{fence}"


def md_word(value: str, table: bool = False) -> str:
    """`value` as it is when Markdown reads nothing into it (a host, an address), else `md`."""
    return value if _MD_PLAIN.fullmatch(check(value)) else md(value, table)


# ----- YAML --------------------------------------------------------------------------------------


def yaml_dump(doc, comment: str = "") -> str:
    """`doc` as YAML by the library after `comment` (its lines as `# ` comments), the whole text
    checked to parse back to exactly `doc`: no value can end a comment, add a key or a document."""

    def walk(node):
        if isinstance(node, dict):
            for k, v in node.items():
                walk(k)
                walk(v)
        elif isinstance(node, list):
            for v in node:
                walk(v)
        elif isinstance(node, str):
            check(node)

    walk(doc)
    head = "".join(f"# {check(line, 'comment')}".rstrip() + "\n" for line in comment.rstrip("\n").split("\n"))
    text = head + yaml.safe_dump(
        doc, sort_keys=False, default_flow_style=False, allow_unicode=True, width=1000
    )
    if list(yaml.safe_load_all(text)) != [doc]:
        raise QuoteError("the manifest does not parse back to the values given; report this as a bug")
    return text
