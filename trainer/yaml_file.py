"""Reading a YAML file safely: the rules of `sweep`'s study files and of `python -m trainer`'s configs, in one place
(the trainer imports nothing of sweep, so they live here).

Bytes, then YAML. Whatever the input's size or shape, it is accepted or refused in well under a second, and an error
never renders the input (an alias bomb expands to gigabytes). A file that is not a regular file (a named pipe, a
device) is refused before it is opened: reading one would wait for a writer, or never end. Every problem is a
`YamlFileError` line: the key where it is ('' for the whole file) and what is wrong, in the words of the file's kind
(`what`: "study file", "config file").
"""

from __future__ import annotations

import math
import os
import re
import stat
from collections.abc import Sequence
from pathlib import Path
from typing import Any, ClassVar

import yaml

from trainer.config import underflows
from trainer.messages import CONTROL, short_repr

__all__ = ["MAX_DEPTH", "MAX_FILE_BYTES", "MAX_VALUES", "YamlFileError", "load_yaml", "read_text", "short_repr"]


class YamlFileError(ValueError):
    """A file (or `--set` value) that is no YAML of the kind expected: one (key, message) per problem."""

    def __init__(self, source: str | Path, problems: Sequence[tuple[str, str]]) -> None:
        self.source, self.problems = source, list(problems)
        super().__init__("; ".join(f"{key}: {message}" if key else message for key, message in self.problems))


MAX_FILE_BYTES = 1 << 20  # a study file is a few kilobytes; 1 MiB is far more than any needs
MAX_DEPTH = 32  # nesting of mappings and lists, aliases expanded (a study file needs about 6)
MAX_VALUES = 10_000  # values in the document with every alias expanded: anchors share values, they do not multiply
_MAX_PROBLEMS = 20  # reported of one file; a file with more is mostly not a study file

_SAFE: Any = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # libyaml when there: a 1 MiB file parses in ~0.1 s


_CORE = "tag:yaml.org,2002:"
_EXPONENT_TAG = "tag:sweep,2024:exponent"  # implicit only: a tag written in the file is refused (`_PLAIN_TAGS`)
# A number in exponent notation as YAML 1.2 reads it (`1e3`, `1.5e3`, `2E-4`, `-1e+3`). YAML 1.1, and so PyYAML,
# wants a dot and a signed exponent and reads `1e3` and `1.5e3` as strings.
_EXPONENT = re.compile(r"^[-+]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)[eE][-+]?[0-9]+$")


_INT_TAG = "tag:sweep,2024:int"  # implicit only, as the exponent's
# An integer as YAML 1.2's core schema reads it: decimal (`010` is 10), `0o` octal, `0x` hex. YAML 1.1, and so
# PyYAML, reads `010` as octal 8, `1:30` as 90 (base 60), and takes `0b11` and `1_000`: strings here, which an integer
# key refuses, rather than numbers the user did not write.
_INT = re.compile(r"^(?:[-+]?[0-9]+|0o[0-7]+|0x[0-9a-fA-F]+)$")
# A float as YAML 1.2 reads it (the exponent forms are `_EXPONENT`'s): no `_` separators, no base 60 (`1:30.5`).
_FLOAT = re.compile(r"^(?:[-+]?(?:[0-9]+\.[0-9]*|\.[0-9]+)|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$")


class _Loader(_SAFE):
    """The safe loader, without YAML 1.1's implicit dates (a study file has none, and `2024-13-45` would raise), and
    with YAML 1.2's integers (`_int`), floats (`_FLOAT`) and numbers in exponent notation (`_exponent`)."""

    yaml_implicit_resolvers: ClassVar = {
        first: [(_EXPONENT_TAG, _EXPONENT)] * (first in "-+.0123456789")
        + [(_INT_TAG, _INT)] * (first in "-+0123456789")
        + [(_CORE + "float", _FLOAT)] * (first in "-+.0123456789")
        + [(tag, pattern) for tag, pattern in resolvers
           if not tag.endswith((":timestamp", ":int", ":float", ":value"))]
        for first, resolvers in _SAFE.yaml_implicit_resolvers.items()}


INT_DIGITS = 4300  # Python reads and writes no int of more decimal digits as text (sys.set_int_max_str_digits)
_INT_LIMIT = 10**INT_DIGITS


def _int(loader: Any, node: yaml.ScalarNode) -> int:
    text = str(node.value)
    value = int(text[2:], 8) if text.startswith("0o") else int(text[2:], 16) if text.startswith("0x") else int(text)
    if abs(value) >= _INT_LIMIT:  # hex and octal escape Python's limit on reading: writing the value (a message,
        # JSON) raised later, a traceback, or the study half-written (review)
        raise yaml.constructor.ConstructorError(
            None, None, f"a whole number of more than {INT_DIGITS} digits; expected a number of at most "
            f"{INT_DIGITS}", node.start_mark)
    return value


def _exponent(loader: Any, node: yaml.ScalarNode) -> int | float:
    """`1e3` as a number: an int when the value is a whole number (`max_steps: 1e3` is 1000, `1.5e3` is 1500), so an
    integer key takes it, else a float (`1e-3`). A plain `1.5` or `2.0` stays a float, which an integer key refuses."""
    value = _not_underflowed(node, float(node.value))
    return int(value) if math.isfinite(value) and value.is_integer() else value


def _not_underflowed(node: yaml.ScalarNode, value: float) -> float:
    """`value`, read from `node`'s exponent notation, unless it underflowed: 1e-400 is not 0."""
    if underflows(node.value, value):
        raise yaml.constructor.ConstructorError(None, None, f"{node.value} is too small for a 64-bit float (it would "
                                                "be read as 0); write 0 if 0 is meant", node.start_mark)
    return value


def _core_int(loader: Any, node: yaml.ScalarNode) -> int:
    """An integer tagged `!!int` as YAML 1.2 reads it, as an untagged one is: `!!int 010` is 10, where PyYAML's own
    constructor (YAML 1.1) made it 8 and took `1_000`, `0b11` and `1:20` (review)."""
    if not _INT.match(str(node.value)):
        raise yaml.constructor.ConstructorError(None, None, f"{node.value} is not a YAML 1.2 integer", node.start_mark)
    return _int(loader, node)


def _core_float(loader: Any, node: yaml.ScalarNode) -> float:
    """A float tagged `!!float` (or an untagged `1.5`) as YAML 1.2 reads it: no `_` separators, no base 60."""
    text = str(node.value)
    if not (_FLOAT.match(text) or _EXPONENT.match(text) or re.match(r"^[-+]?[0-9]+$", text)):
        raise yaml.constructor.ConstructorError(None, None, f"{text} is not a YAML 1.2 float", node.start_mark)
    value = float(yaml.constructor.SafeConstructor.construct_yaml_float(loader, node))
    return _not_underflowed(node, value) if _EXPONENT.match(text) else value


_Loader.add_constructor(_EXPONENT_TAG, _exponent)
_Loader.add_constructor(_INT_TAG, _int)
_Loader.add_constructor(_CORE + "int", _core_int)
_Loader.add_constructor(_CORE + "float", _core_float)
_LOADER = _Loader
# Explicit tags that only restate a plain value. Others (`!!python/object`, `!!binary`, `!!set`, `!custom`) are
# refused: a study file holds plain values, and the safe loader would fail on most with a message of many lines.
_PLAIN_TAGS = frozenset({"!", *(_CORE + name for name in ("str", "int", "float", "bool", "null", "seq", "map"))})
_BOMS = [(b"\x00\x00\xfe\xff", "UTF-32"), (b"\xff\xfe\x00\x00", "UTF-32"), (b"\xfe\xff", "UTF-16"),
         (b"\xff\xfe", "UTF-16")]
# Control characters, and the bidirectional overrides and isolates (they reorder the text after them as shown).
# Also what shows as nothing and belongs to no word (a zero-width space, a byte-order mark, a word joiner, the
# direction marks): a key holding one printed as the name it was refused beside (review: "fixed.max_\u200bsteps:
# unknown key (did you mean 'max_steps'?)" read "max_steps"). Not a no-break space nor the joiners (U+200C, U+200D),
# which are a word's own (Persian spelling, emoji: diff review, a choice's ZWNJ was escaped in the trials' CSV).
_CONTROL = re.compile(CONTROL.pattern[:-1] + r"\u061c\u180e\u200b\u200e\u200f\u2028\u2029\u202a-\u202e\u2060-\u2064"
                      r"\u2066-\u2069\ufeff]")


def printable(line: str, keep: str = "") -> str:
    """`line` with each control character written as its escape (`\x1b`): an error line quotes keys, paths and
    names from a file, and a key holding a terminal's escape sequence must not retitle or clear the terminal that
    prints it; nor may a right-to-left override (`\u202e`) make a line read as another. `keep`: characters left as
    they are (a page's line breaks and tabs)."""
    return _CONTROL.sub(lambda match: match.group() if match.group() in keep else repr(match.group())[1:-1], line)


_NOT_REGULAR = ((stat.S_ISFIFO, "a named pipe"), (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                (stat.S_ISSOCK, "a socket"))


def read_text(path: Path, what: str = "study file") -> str:
    """The file as text, refused with one line when it is no regular file, too large, binary, or not UTF-8. A UTF-8
    byte-order mark is dropped; a UTF-16 or UTF-32 file is refused (save it as UTF-8)."""
    try:
        mode = os.stat(path).st_mode
    except OSError:
        mode = stat.S_IFREG  # opening it says why
    for test, kind in _NOT_REGULAR:
        if test(mode):
            raise YamlFileError(path, [("", f"cannot read the {what}: it is {kind}, not a regular file; expected a "
                                            "YAML file")])
    try:
        with open(path, "rb") as handle:
            data = handle.read(MAX_FILE_BYTES + 1)
    except OSError as exc:
        raise YamlFileError(path, [("", f"cannot read the {what}: {exc.strerror or exc}")]) from None
    if len(data) > MAX_FILE_BYTES:
        raise YamlFileError(path, [("", f"the file is larger than {MAX_FILE_BYTES >> 20} MiB; a {what} is a few "
                                         "kilobytes of YAML (is it the right file?)")])
    for bom, encoding in _BOMS:
        if data.startswith(bom):
            raise YamlFileError(path, [("", f"the file is {encoding} text; save it as UTF-8")])
    if b"\x00" in data:
        line = data[:data.index(b"\x00")].count(b"\n") + 1
        raise YamlFileError(path, [("", f"line {line}: a NUL byte: this is a binary file, not YAML text")])
    try:
        return data.decode("utf-8").removeprefix("\ufeff")
    except UnicodeDecodeError as exc:
        line = data[:exc.start].count(b"\n") + 1
        column = exc.start - (data.rfind(b"\n", 0, exc.start) + 1) + 1
        raise YamlFileError(path, [("", f"line {line}, column {column}: byte 0x{data[exc.start]:02x} is not UTF-8; "
                                         "save the file as UTF-8 text")]) from None


class _Node:
    """A mapping or list being read in `_structure_problems`: where it is and what it holds so far."""

    def __init__(self, path: str, mapping: bool, anchor: str | None, merge_into: _Node | None = None) -> None:
        self.path, self.mapping, self.anchor = path, mapping, anchor
        self.key: str | None = None  # a mapping's key whose value comes next; None: a key comes next
        self.keys: dict[str, int] = {}  # a mapping's keys so far, and the line of each
        self.merged: dict[str, int] = {}  # the keys its merge keys (`<<: *defaults`) gave it, and the merge's line
        self.numbers: dict[float | int, int] = {}  # a mapping's number keys so far (`1` and `1.0` are one), by line
        self.merge_into = merge_into  # the mapping whose `<<` this value (or this list's items) is merged into
        self.items: list[set[str]] = []  # a list's: the keys of each mapping in it (what `<<: *list` merges)
        self.index = 0  # a list's next item
        self.size, self.height = 1, 1  # values in it (itself too) and its depth, aliases expanded

    def child_path(self) -> str:
        if not self.mapping:
            return f"{self.path}[{self.index}]"
        return f"{self.path}.{self.key}" if self.path else str(self.key)


class _Fatal(Exception):
    """A problem after which reading further is pointless or unbounded (a bomb, a loop, a deep nest)."""


def _implicit_kind(plain: str) -> str | None:
    """What YAML makes of a plain (unquoted) scalar other than a string: `off` and `yes` a boolean (YAML 1.1's words,
    which PyYAML keeps), `1.5` a number, `~` null; None for a string."""
    tag = _LOADER.resolve(_LOADER, yaml.ScalarNode, plain, (True, False))
    kinds = {"bool": "a boolean", "int": "a number", "float": "a number", "exponent": "a number", "null": "null",
             "timestamp": "a date"}
    return kinds.get(tag.rpartition(":")[2], None) if tag != "tag:yaml.org,2002:str" else None


def _number_key(event: Any) -> int | float | None:
    """The number a mapping's plain key is (a user's mapping keyed by numbers), or None for a name."""
    key = str(event.value)
    if event.tag is None and event.implicit[0] and _implicit_kind(key) == "a number":
        try:
            value = _LOADER(key).get_single_data()
        except Exception:  # noqa: BLE001 - not a number after all: a name
            return None
        return value if isinstance(value, (int, float)) and not isinstance(value, bool) else None
    return None


def _structure_problems(text: str, prefix: str = "", what: str = "study file") -> list[tuple[str, str]]:
    """Problems of the YAML's shape, found from the parser's events, before any value is built: duplicate keys,
    keys that are not plain, tags, more than one document, and the size and depth the document has once its aliases
    are expanded. Linear in the text: the expansion is counted (an anchor's size times its uses), never done."""
    problems: list[tuple[str, str]] = []
    anchors: dict[str, tuple[int, int]] = {}  # name: (values, depth) of the anchored value
    # name: what merging the anchored value gives, the keys of each mapping: one for a mapping (its merged keys too),
    # one per item for a list of them (`<<: *presets`)
    anchor_merges: dict[str, list[set[str]]] = {}
    stack: list[_Node] = []
    total, documents = 0, 0

    def where(path: str) -> str:
        path = path if len(path) <= 60 else path[:60] + "..."  # 30 levels of [0] say no more than 3 do
        return f"{prefix}{'' if path.startswith('[') or not prefix or not path else '.'}{path}"

    def fatal(path: str, message: str) -> _Fatal:
        problems.append((where(path), message))
        return _Fatal()

    def add(size: int, height: int, new: int) -> None:
        """A finished value of `size` values (`new` of them not counted yet): count it in its parent and the
        document."""
        nonlocal total
        total += new
        if total > MAX_VALUES:
            expanded = " once its aliases are expanded (an alias bomb?)" if anchors else ""
            raise fatal(parent_path(), f"line {line}: the file holds more than {MAX_VALUES} values{expanded}; a "
                                       f"{what} holds a few hundred")
        if stack:
            parent = stack[-1]
            parent.size += size
            parent.height = max(parent.height, height + 1)
            if len(stack) + height > MAX_DEPTH:
                raise fatal(parent.path, f"line {line}: nested more than {MAX_DEPTH} levels deep")
            if parent.mapping:
                parent.key = None
            else:
                parent.index += 1

    def parent_path() -> str:
        return stack[-1].path if stack else ""

    def merge_target() -> _Node | None:
        """The mapping a value starting here is merged into: it is a `<<` key's value, or an item of its list."""
        if not stack:
            return None
        parent = stack[-1]
        return parent if parent.mapping and parent.key == "<<" else None if parent.mapping else parent.merge_into

    def merge(target: _Node, keys: set[str]) -> None:
        """`keys` merged into `target`. A key that two merged mappings give is refused: YAML takes the first one's
        value, PyYAML either, by the key's hash (`<<: [{max_steps: 4}, {max_steps: 400}]` trained 400 steps). A key
        of the mapping's own wins over a merged one, as YAML says: that is what a merge is for."""
        for key in sorted(keys):
            seen_once(target, target.merged, key, "given by two merged mappings (<<, {lines}): give it once")

    def seen_once(node: _Node, seen: dict[Any, int], key: Any, twice: str) -> None:
        """`key` of `node` read on this line: noted in `seen`, or, when `seen` has it already, a problem worded
        `twice` (its `{lines}` says where)."""
        if key not in seen:
            seen[key] = line
            return
        lines = f"twice on line {line}" if seen[key] == line else f"lines {seen[key]} and {line}"
        problems.append((where(f"{node.path}.{key}" if node.path else key), twice.format(lines=lines)))

    def place(event: Any) -> str | None:
        """The path of the value this event starts; None when it is a mapping's key (read here)."""
        if not stack:
            return ""
        parent = stack[-1]
        if not parent.mapping or parent.key is not None:
            return parent.child_path()
        if not isinstance(event, yaml.ScalarEvent) or event.anchor is not None:
            raise fatal(parent.path, f"line {line}: a key must be a plain name, not a list, a mapping or an alias")
        key = event.value
        if key == "<<" and event.tag is None and event.implicit[0] and key not in parent.keys:  # `<<: *defaults`
            parent.keys[key] = line
        elif event.tag is None and event.implicit[0] and (kind := _implicit_kind(key)) is not None \
                and (kind in ("a boolean", "null") or not (parent.path or prefix)):
            # A boolean or null key is YAML 1.1's trap (`on:`, `no:`) wherever it stands; a number is a name only
            # among the file's own top-level keys: below them a mapping may be the user's, keyed by numbers on
            # purpose (a loop's `class_weights: {0: 1.0, 1: 5.0}`).
            problems.append((where(f"{parent.path}.{key}" if parent.path else key),
                             f"line {line}: the key {key} is read as {kind} by YAML, not as a name; quote it "
                             f"('{key}') if it is meant"))
            parent.keys.setdefault(key, line)
        else:
            # A number key is stored as its text (`010` as "10", `1.0` as "1.0": the config is JSON): two keys that
            # are one text, or one number (`1` and `1.0`, which YAML's mapping makes one key), are duplicates, and a
            # dot in one would read as a path (review: the second of two silently won; `0.5` arrived as 0, then 5).
            number = _number_key(event)
            stored = key if number is None else str(number)
            same = None if number is None else int(number) if isinstance(number, float) and number.is_integer() \
                else number  # the one key YAML's mapping makes of `1` and `1.0`
            if number is not None and "." in stored and "[" not in parent.path:  # a list item's keys stay whole
                problems.append((where(f"{parent.path}.{key}" if parent.path else key),
                                 f"line {line}: the key {key} is read as a number by YAML ({stored}), and a dot "
                                 f"in a key makes it a path ({' then '.join(stored.split('.'))}); write the key "
                                 "without a dot, or use a list"))
            twice = "duplicate key ({lines}): the second would silently replace the first"
            if same is not None and same in parent.numbers:
                seen_once(parent, parent.numbers, same, twice)
            else:
                seen_once(parent, parent.keys, stored, twice)
                if same is not None:
                    parent.numbers[same] = line
        parent.key = key
        return None

    def check_tag(event: Any, path: str) -> None:
        if event.tag is None:
            return
        tag = event.tag.replace(_CORE, "!!")
        if event.tag not in _PLAIN_TAGS:
            problems.append((where(path), f"line {line}: the tag {short_repr(tag)} is not allowed; a {what} holds "
                                          "plain values (numbers, strings, true/false, lists, mappings)"))
        elif isinstance(event, yaml.ScalarEvent) and event.tag.startswith(_CORE):
            try:  # `!!int abc`: the value its tag refuses, found here where its key is known
                loader.construct_object(yaml.ScalarNode(event.tag, event.value))
            except Exception:  # noqa: BLE001 - PyYAML's constructors raise what their conversion raises
                problems.append((where(path), f"line {line}: {short_repr(event.value)} is not a valid {tag}"))

    loader = _LOADER(text)
    line = 1
    try:
        while loader.check_event():
            event = loader.get_event()
            line = event.start_mark.line + 1
            if isinstance(event, yaml.DocumentStartEvent):
                documents += 1
                if documents > 1:
                    raise fatal("", f"line {line}: a second YAML document (---); a {what} is one document")
            elif isinstance(event, yaml.AliasEvent):
                target = merge_target()
                path = place(event)
                merged = anchor_merges.get(event.anchor or "", [])
                for keys in merged:
                    if target is not None:
                        merge(target, keys)
                if stack and not stack[-1].mapping:
                    stack[-1].items += merged
                if event.anchor in {node.anchor for node in stack}:
                    raise fatal(path or "", f"line {line}: the alias *{event.anchor} refers to a value that holds it "
                                            "(a loop)")
                if event.anchor not in anchors:
                    raise fatal(path or "", f"line {line}: the alias *{event.anchor} has no anchor &{event.anchor} "
                                            "before it")
                size, height = anchors[event.anchor]
                add(size, height, size)
            elif isinstance(event, yaml.ScalarEvent):
                path = place(event)
                if path is not None:
                    check_tag(event, path)
                    if event.anchor is not None:
                        anchors[event.anchor] = (1, 0)
                        anchor_merges.pop(event.anchor, None)  # redefined: a scalar merges nothing
                    add(1, 0, 1)
            elif isinstance(event, (yaml.MappingStartEvent, yaml.SequenceStartEvent)):
                target = merge_target()
                path = place(event) or ""
                check_tag(event, path)
                stack.append(_Node(path, isinstance(event, yaml.MappingStartEvent), event.anchor, target))
                if len(stack) > MAX_DEPTH:
                    raise fatal(path, f"line {line}: nested more than {MAX_DEPTH} levels deep")
            elif isinstance(event, (yaml.MappingEndEvent, yaml.SequenceEndEvent)):
                node = stack.pop()
                keys = {*node.keys, *node.merged} - {"<<"} if node.mapping else set()
                if node.anchor is not None:
                    anchors[node.anchor] = (node.size, node.height)
                    anchor_merges[node.anchor] = [keys] if node.mapping else node.items
                if node.mapping and node.merge_into is not None:
                    merge(node.merge_into, keys)
                if node.mapping and stack and not stack[-1].mapping:
                    stack[-1].items.append(keys)
                add(node.size, node.height, 1)
            if len(problems) >= _MAX_PROBLEMS:
                break
    except _Fatal:
        pass
    except yaml.YAMLError as exc:
        problems.append((prefix, _yaml_error(exc, text)))
    return problems


def _yaml_error(exc: yaml.YAMLError, text: str) -> str:
    """A parser's error as one line: where, and what (PyYAML's own text spans several and quotes the input)."""
    if isinstance(exc, yaml.reader.ReaderError):
        line = text[:exc.position].count("\n") + 1 if isinstance(exc.position, int) else "?"
        char = exc.character if isinstance(exc.character, int) else ord(str(exc.character)[:1] or "\0")
        return f"invalid YAML: line {line}: the character U+{char:04X} is not allowed (a control character)"
    mark = getattr(exc, "problem_mark", None)
    where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""
    problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
    context = getattr(exc, "context", None)
    hint = ""
    if mark is not None and "cannot start any token" in problem:
        at = text.splitlines()[mark.line][mark.column:mark.column + 1] if mark.line < len(text.splitlines()) else ""
        hint = "; a tab: YAML indents with spaces only" if at == "\t" else ""
    elif (("mapping values are not allowed" in problem or "could not find expected ':'" in problem)
          and mark is not None and mark.column > 1024):  # PyYAML's limit on a simple key, on the error's own line
        hint = "; a key longer than 1024 characters is not one YAML reads"
    return (f"invalid YAML: {where}{problem}" + (f" ({context})" if context and "while" not in context else "")
            + hint)


def load_yaml(text: str, source: str | Path, prefix: str = "", what: str = "study file") -> Any:
    """YAML text as plain Python values, refused (`YamlFileError`, every problem a line) when its shape is not one a
    `what` can have: see `_structure_problems`. `prefix` is the key the text is the value of (for `--set`)."""
    problems = _structure_problems(text, prefix, what)
    if problems:
        raise YamlFileError(source, problems)
    try:
        return yaml.load(text, Loader=_LOADER)  # the safe loader: libyaml's CSafeLoader, or SafeLoader
    except yaml.YAMLError as exc:
        raise YamlFileError(source, [(prefix, _yaml_error(exc, text))]) from None
    except (ValueError, TypeError, KeyError, OverflowError) as exc:  # a value its tag refuses (checked above)
        digits = re.search(rf"\d{{{INT_DIGITS + 1},}}", text) if "digits" in str(exc) else None
        if digits is not None:  # Python's limit on reading an int from text (sys.set_int_max_str_digits)
            line = text[:digits.start()].count("\n") + 1
            raise YamlFileError(source, [(prefix, f"line {line}: a whole number of {len(digits.group())} digits; "
                                                  f"expected a number of at most {INT_DIGITS}")]) from None
        raise YamlFileError(source, [(prefix, f"a value YAML cannot read: {short_repr(str(exc))}")]) from None

