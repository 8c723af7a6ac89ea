"""Reading configuration text safely, with the line of every key (torch-free).

Every parser here either returns values with their line numbers or raises
``castwise.errors.ConfigError`` naming the file and line: no other exception escapes for bad
input (broken syntax, binary data, oversize files, absurd nesting).
"""

from __future__ import annotations

import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from castwise.errors import ConfigError

# Training configurations are a few KB; anything this large is not one, and refusing it from
# the file size alone keeps `lint-config` instant on a mistaken argument (a checkpoint, a log).
MAX_BYTES = 4 * 1024 * 1024

Path_ = tuple[str | int, ...]  # a key path inside a document: ("bf16", "enabled")


def read_text(path: Path, shown: str) -> str:
    """The file's text, or ConfigError (missing, a folder, too large, binary, not UTF-8)."""
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        raise ConfigError("no such file", path=shown) from None
    except OSError as exc:
        raise ConfigError(f"cannot read the file ({exc.strerror or exc})", path=shown) from None
    if path.is_dir():
        raise ConfigError("is a folder, not a configuration file", path=shown)
    if size > MAX_BYTES:
        raise ConfigError(
            f"is {size / 2**20:.1f} MiB; training configurations are small, castwise reads files up "
            f"to {MAX_BYTES // 2**20} MiB. Pass the configuration file itself (config.env, "
            "default_config.yaml, ds_config.json, ...)",
            path=shown,
        )
    try:
        with path.open("rb") as fh:
            data = fh.read(MAX_BYTES + 1)  # bounded: a device or pipe reports no size
    except OSError as exc:
        raise ConfigError(f"cannot read the file ({exc.strerror or exc})", path=shown) from None
    if len(data) > MAX_BYTES:
        raise ConfigError(
            f"is larger than {MAX_BYTES // 2**20} MiB; training configurations are small. "
            "Pass the configuration file itself",
            path=shown,
        )
    nul = data.find(b"\x00")
    if nul >= 0:
        raise ConfigError(
            "is binary data (NUL byte), not a text configuration file", path=shown, line=data.count(b"\n", 0, nul) + 1
        )
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise ConfigError(
            "is not UTF-8 text (binary data?), not a configuration file",
            path=shown,
            line=data.count(b"\n", 0, exc.start) + 1,
        ) from None


@dataclass(frozen=True)
class Document:
    """A parsed mapping document: its values and the line of every key path."""

    data: dict[str, Any]
    lines: dict[Path_, int]

    def line(self, key: Path_) -> int:
        """The line of a key, or of its nearest parent that has one (1 when none does)."""
        while key:
            if key in self.lines:
                return self.lines[key]
            key = key[:-1]
        return 1

    def at(self, path: Path_) -> Any:
        """The value at a key path, None where a part of it is missing."""
        node: Any = self.data
        for part in path:
            node = node.get(part) if isinstance(node, dict) else None
        return node


def _need_mapping(data: Any, shown: str, kind: str) -> dict[str, Any]:
    if not isinstance(data, dict):
        got = "empty" if data is None else type(data).__name__
        raise ConfigError(
            f"{kind} document is {got}; a training configuration is a mapping of settings (key: value)",
            path=shown,
            line=1,
        )
    return data


# Configurations nest a few levels; a deeper document is refused before parsing (libyaml's C
# composer recurses without a limit and can overflow the C stack on pathological input).
MAX_DEPTH = 200


def _check_depth(text: str, shown: str, kind: str) -> None:
    depth = 0
    line = 1
    for c in text:
        if c in "[{":
            depth += 1
            if depth > MAX_DEPTH:
                raise ConfigError(
                    f"{kind} nested more than {MAX_DEPTH} levels deep; not a training configuration",
                    path=shown,
                    line=line,
                )
        elif c in "]}":
            depth = max(0, depth - 1)
        elif c == "\n":
            line += 1


# ---------------------------------------------------------------- JSON


def parse_json(text: str, shown: str) -> Document:
    _check_depth(text, shown, "JSON")
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"broken JSON: {exc.msg} (column {exc.colno})", path=shown, line=exc.lineno) from None
    except RecursionError:
        raise ConfigError("JSON nested too deeply to be a configuration", path=shown) from None
    data = _need_mapping(data, shown, "JSON")
    try:
        lines = _JsonLines(text).scan()
    except RecursionError:
        raise ConfigError("JSON nested too deeply to be a configuration", path=shown) from None
    return Document(data, lines)


class _JsonLines:
    """Line of every object key in (already validated) JSON text; json itself keeps none."""

    def __init__(self, text: str) -> None:
        self.s = text
        self.i = 0
        self.line = 1
        self.out: dict[Path_, int] = {}

    def scan(self) -> dict[Path_, int]:
        self._value(())
        return self.out

    def _ws(self) -> None:
        s, n = self.s, len(self.s)
        while self.i < n and s[self.i] in " \t\r\n":
            if s[self.i] == "\n":
                self.line += 1
            self.i += 1

    def _string(self) -> str:
        start = self.i
        self.i += 1
        s = self.s
        while s[self.i] != '"':
            self.i += 2 if s[self.i] == "\\" else 1
        self.i += 1
        return str(json.loads(s[start : self.i]))

    def _value(self, path: Path_) -> None:
        self._ws()
        c = self.s[self.i]
        if c == "{":
            self.i += 1
            self._ws()
            if self.s[self.i] == "}":
                self.i += 1
                return
            while True:
                self._ws()
                line = self.line
                key = self._string()
                self.out.setdefault((*path, key), line)
                self._ws()
                self.i += 1  # ':'
                self._value((*path, key))
                self._ws()
                c = self.s[self.i]
                self.i += 1
                if c == "}":
                    return
        elif c == "[":
            self.i += 1
            self._ws()
            if self.s[self.i] == "]":
                self.i += 1
                return
            index = 0
            while True:
                self.out.setdefault((*path, index), self.line)
                self._value((*path, index))
                index += 1
                self._ws()
                c = self.s[self.i]
                self.i += 1
                if c == "]":
                    return
        elif c == '"':
            self._string()
        else:
            m = re.compile(r"[^,\]}\s]+").match(self.s, self.i)
            self.i = m.end() if m else self.i + 1


# ---------------------------------------------------------------- YAML


def parse_yaml(text: str, shown: str) -> Document:
    import yaml

    _check_depth(text, shown, "YAML")
    # the pure-Python loader: its recursion is bounded by Python's limit (RecursionError, caught
    # below) where the C one can crash the process; configuration files are small
    loader = yaml.SafeLoader
    try:
        node = yaml.compose(text, Loader=loader)
        data = yaml.load(text, Loader=loader)
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        problem = exc.problem or exc.context or "syntax error"
        raise ConfigError(
            f"broken YAML: {problem}", path=shown, line=(mark.line + 1) if mark is not None else None
        ) from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"broken YAML: {exc}", path=shown) from None
    except RecursionError:
        raise ConfigError("YAML nested too deeply to be a configuration", path=shown) from None
    except (ValueError, TypeError, OverflowError) as exc:
        # SafeLoader's constructors raise these for malformed timestamps, ints and the like
        raise ConfigError(f"broken YAML value: {exc}", path=shown) from None
    data = _need_mapping(data, shown, "YAML")
    lines: dict[Path_, int] = {}
    try:
        _yaml_lines(node, (), lines)
    except RecursionError:
        raise ConfigError("YAML nested too deeply to be a configuration", path=shown) from None
    return Document(data, lines)


def _yaml_lines(node: Any, path: Path_, out: dict[Path_, int], seen: set[int] | None = None) -> None:
    import yaml

    # an alias reuses its anchor's node: visit each node once, or `&a [*b, *b, ...]` chains
    # (the "billion laughs") would take exponential time
    seen = set() if seen is None else seen
    if id(node) in seen:
        return
    seen.add(id(node))
    if isinstance(node, yaml.MappingNode):
        for key_node, value_node in node.value:
            if isinstance(key_node, yaml.ScalarNode):
                key = (*path, str(key_node.value))
                out.setdefault(key, key_node.start_mark.line + 1)
                _yaml_lines(value_node, key, out, seen)
    elif isinstance(node, yaml.SequenceNode):
        for index, item in enumerate(node.value):
            out.setdefault((*path, index), item.start_mark.line + 1)
            _yaml_lines(item, (*path, index), out, seen)


# ---------------------------------------------------------------- TOML

_TOML_ERR_LINE = re.compile(r"line (\d+)")


def parse_toml(text: str, shown: str) -> Document:
    # imported here: only TOML files pay for it
    if sys.version_info >= (3, 11):
        import tomllib
    else:  # pragma: no cover - exercised on 3.10 only
        import tomli as tomllib

    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        m = _TOML_ERR_LINE.search(str(exc))
        msg = str(exc).split(" (at ")[0]
        raise ConfigError(f"broken TOML: {msg}", path=shown, line=int(m.group(1)) if m else None) from None
    except RecursionError:
        raise ConfigError("TOML nested too deeply to be a configuration", path=shown) from None
    # tomllib keeps no positions: find each top-level key's line by its `key =` text
    lines: dict[Path_, int] = {}
    for number, raw in enumerate(text.splitlines(), 1):
        m = re.match(r"""\s*(?:"([^"]+)"|'([^']+)'|([A-Za-z0-9_\-]+))\s*=""", raw)
        if m:
            key = m.group(1) or m.group(2) or m.group(3)
            lines.setdefault((key,), number)
    return Document(data, lines)


# ---------------------------------------------------------------- shell (config.env)


@dataclass(frozen=True)
class ShellValue:
    """A variable's value with the line each character came from (after ${VAR} expansion)."""

    text: str
    char_lines: tuple[int, ...]
    line: int  # the line of the assignment

    def words(self) -> list[tuple[str, int]]:
        """Unquoted word splitting, as `$VAR` on a command line does: (word, its line)."""
        out: list[tuple[str, int]] = []
        for m in re.finditer(r"\S+", self.text):
            out.append((m.group(0), self.char_lines[m.start()] if self.char_lines else self.line))
        return out


@dataclass(frozen=True)
class Assignment:
    name: str
    value: ShellValue


_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


class _Shell:
    """The subset of POSIX sh that config.env files use: assignments, `export`, quoting,
    comments, line continuations and $VAR / ${VAR} / ${VAR:-default} expansion. Any other
    command is skipped to the end of its line (it cannot be evaluated from the file alone)."""

    def __init__(self, text: str, shown: str) -> None:
        self.s = text
        self.n = len(text)
        self.i = 0
        self.line = 1
        self.shown = shown
        self.vars: dict[str, ShellValue] = {}
        self.assignments: list[Assignment] = []

    def _adv(self) -> str:
        c = self.s[self.i]
        self.i += 1
        if c == "\n":
            self.line += 1
        return c

    def run(self) -> list[Assignment]:
        while self.i < self.n:
            c = self.s[self.i]
            if c in " \t\r\n;":
                self._adv()
            elif c == "#":
                self._skip_line()
            else:
                self._statement()
        return self.assignments

    def _skip_line(self) -> None:
        while self.i < self.n and self.s[self.i] != "\n":
            self.i += 1

    def _statement(self) -> None:
        m = _NAME.match(self.s, self.i)
        if m and m.group(0) in ("export", "declare", "local", "readonly"):
            self.i = m.end()
            while self.i < self.n and self.s[self.i] in " \t":
                self.i += 1
            while self.i < self.n and self.s[self.i] == "-":  # declare -x
                while self.i < self.n and self.s[self.i] not in " \t\n":
                    self.i += 1
                while self.i < self.n and self.s[self.i] in " \t":
                    self.i += 1
            m = _NAME.match(self.s, self.i)
            if m and (m.end() >= self.n or self.s[m.end()] != "="):
                self.i = m.end()  # `export NAME` (no value): nothing to record
                return
        if m and m.end() < self.n and self.s[m.end()] == "=":
            name = m.group(0)
            line = self.line
            self.i = m.end() + 1
            text, char_lines = self._word()
            value = ShellValue(text, tuple(char_lines), line)
            self.vars[name] = value
            self.assignments.append(Assignment(name, value))
            return
        self._skip_command()

    def _skip_command(self) -> None:
        # a command castwise does not evaluate (if, source, echo...): skip it, quotes included
        while self.i < self.n and self.s[self.i] != "\n":
            c = self.s[self.i]
            if c in "\"'":
                start_line = self.line
                self._adv()
                while self.i < self.n and self.s[self.i] != c:
                    if c == '"' and self.s[self.i] == "\\" and self.i + 1 < self.n:
                        self._adv()
                    self._adv()
                if self.i >= self.n:
                    raise ConfigError(f"unterminated {c} quote", path=self.shown, line=start_line)
            elif c == "\\" and self.i + 1 < self.n:
                self._adv()
            self._adv()

    def _word(self) -> tuple[str, list[int]]:
        out: list[str] = []
        lines: list[int] = []

        def emit(text: str, line: int) -> None:
            out.append(text)
            lines.extend([line] * len(text))

        def emit_value(v: ShellValue) -> None:
            out.append(v.text)
            lines.extend(v.char_lines)

        while self.i < self.n:
            c = self.s[self.i]
            if c in " \t\r\n;":
                break
            if c == "'":
                start_line = self.line
                self._adv()
                while self.i < self.n and self.s[self.i] != "'":
                    line = self.line
                    emit(self._adv(), line)
                if self.i >= self.n:
                    raise ConfigError("unterminated ' quote", path=self.shown, line=start_line)
                self._adv()
            elif c == '"':
                start_line = self.line
                self._adv()
                while self.i < self.n and self.s[self.i] != '"':
                    d = self.s[self.i]
                    if d == "\\" and self.i + 1 < self.n and self.s[self.i + 1] in '"\\$`\n':
                        self._adv()
                        line = self.line
                        e = self._adv()
                        if e != "\n":
                            emit(e, line)
                    elif d == "$":
                        self._expand(emit, emit_value)
                    else:
                        line = self.line
                        emit(self._adv(), line)
                if self.i >= self.n:
                    raise ConfigError('unterminated " quote', path=self.shown, line=start_line)
                self._adv()
            elif c == "\\":
                self._adv()
                if self.i < self.n:
                    line = self.line
                    e = self._adv()
                    if e != "\n":
                        emit(e, line)
            elif c == "$":
                self._expand(emit, emit_value)
            else:
                line = self.line
                emit(self._adv(), line)
        return "".join(out), lines

    def _expand(self, emit: Any, emit_value: Any) -> None:
        line = self.line
        self._adv()  # '$'
        if self.i >= self.n:
            emit("$", line)
            return
        c = self.s[self.i]
        if c == "{":
            close = self.s.find("}", self.i)
            if close < 0 or "\n" in self.s[self.i : close]:
                raise ConfigError("unterminated ${...} expansion", path=self.shown, line=line)
            body = self.s[self.i + 1 : close]
            self.i = close + 1
            m = re.match(r"([A-Za-z_][A-Za-z0-9_]*)(?::?-(.*))?$", body, re.S)
            if not m:
                emit("${" + body + "}", line)  # ${#VAR}, ${VAR/x/y}: not evaluated
                return
            value = self.vars.get(m.group(1))
            if value is not None and (value.text or m.group(2) is None):
                emit_value(value)
            elif m.group(2) is not None:
                emit(m.group(2), line)
        elif c == "(":
            # $(command): cannot be evaluated from the file; keep its text
            depth, start = 0, self.i
            while self.i < self.n:
                d = self._adv()
                depth += (d == "(") - (d == ")")
                if depth == 0:
                    break
            emit("$" + self.s[start : self.i], line)
        else:
            m = _NAME.match(self.s, self.i)
            if m:
                self.i = m.end()
                value = self.vars.get(m.group(0))
                if value is not None:
                    emit_value(value)
            else:
                emit("$", line)


def parse_shell(text: str, shown: str) -> list[Assignment]:
    """Every assignment in a config.env, in order, values expanded as the shell would."""
    return _Shell(text, shown).run()


def looks_like_shell(text: str) -> bool:
    """True when the first statement of the text is a shell assignment (`export X=...`)."""
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        return re.match(r"(export\s+)?[A-Za-z_][A-Za-z0-9_]*=", line) is not None
    return False
