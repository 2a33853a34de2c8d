"""YAML loading for files a user (or an attacker) hands us.

`yaml.safe_load` builds no objects, but it still expands aliases (a "billion laughs" file
eats memory), recurses on deep nesting and silently keeps the last of two duplicate keys.
This loader refuses all three, and caps the file size, before any value is used.
"""

from __future__ import annotations

import yaml

MAX_BYTES = 1 << 20  # a cluster file is a few hundred bytes; 1 MiB is generous
MAX_DEPTH = 20


class YamlError(ValueError):
    """A file that cannot be read as a plain YAML document; the message is for the user."""


class _StrictLoader(yaml.SafeLoader):
    def __init__(self, stream):
        super().__init__(stream)
        self._depth = 0

    def compose_node(self, parent, index):
        if self.check_event(yaml.AliasEvent):
            event = self.peek_event()
            raise YamlError(
                f"line {event.start_mark.line + 1}: YAML aliases (*{event.anchor}) are not "
                "allowed; write the value out in full"
            )
        self._depth += 1
        if self._depth > MAX_DEPTH:
            mark = self.peek_event().start_mark
            raise YamlError(
                f"line {mark.line + 1}: nesting deeper than {MAX_DEPTH} levels; "
                "a cluster file is a flat mapping"
            )
        try:
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1

    def construct_mapping(self, node, deep=False):
        seen = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            try:
                hash(key)
            except TypeError:
                raise YamlError(
                    f"line {key_node.start_mark.line + 1}: a mapping key must be a plain "
                    "value, not a list or mapping"
                ) from None
            if key in seen:
                raise YamlError(
                    f"line {key_node.start_mark.line + 1}: duplicate key '{key}' "
                    f"(first on line {seen[key]}); keep only one"
                )
            seen[key] = key_node.start_mark.line + 1
        return super().construct_mapping(node, deep=deep)

    def construct_base60(self, node):
        # YAML 1.1 reads 1:20 as 80 (base 60); nobody writing a cluster file means that.
        try:
            value = yaml.SafeLoader.yaml_constructors[node.tag](self, node)
        except ValueError:  # e.g. more digits than Python converts (4300)
            raise YamlError(
                f"line {node.start_mark.line + 1}: a number of {len(str(node.value))} characters; "
                "write a plain number of sensible size"
            ) from None
        if ":" in str(node.value):
            raise YamlError(
                f"line {node.start_mark.line + 1}: '{node.value}' is a YAML 1.1 base-60 number "
                f"(read as {value}); write a plain number, or quote it if it is text"
            )
        return value


for _tag in ("tag:yaml.org,2002:int", "tag:yaml.org,2002:float"):
    _StrictLoader.add_constructor(_tag, _StrictLoader.construct_base60)


def loads(text: str):
    """Parses one YAML document; raises YamlError with a one-line message."""
    if len(text.encode("utf-8", "surrogatepass")) > MAX_BYTES:
        raise YamlError(f"file is larger than {MAX_BYTES} bytes; is it the right file?")
    try:
        return yaml.load(text, Loader=_StrictLoader)  # noqa: S506 (a SafeLoader subclass)
    except YamlError:
        raise
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark else ""
        raise YamlError(f"{where}invalid YAML: {e.problem or e.context}") from None
    except yaml.YAMLError as e:
        raise YamlError(f"invalid YAML: {e}") from None


def load_file(path: str):
    """Reads and parses a YAML file, refusing huge files before reading them whole."""
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_BYTES + 1)
    except OSError as e:
        raise YamlError(f"cannot read it: {e.strerror}") from None
    if len(data) > MAX_BYTES:
        raise YamlError(f"file is larger than {MAX_BYTES} bytes; is it the right file?")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise YamlError(f"not UTF-8 text (byte {e.start}); save it as UTF-8") from None
    return loads(text)
