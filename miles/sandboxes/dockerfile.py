"""A Dockerfile parser for the host backends, which replay a task's Dockerfile instead of building
an image (rootfs.py). Container backends hand the file to a real builder and never use this.

Supported: line continuations (with `# escape=`), comments, shell and JSON (exec) forms, flags
(`--chown=...`), `ARG`/`ENV` substitution (`$V`, `${V}`, `${V:-default}`, `${V:+alt}`) where
Docker applies it (not inside RUN, whose shell sees the variables as environment).

Design decisions:
- Parse everything, judge later: unsupported instructions are reported by the replayer with the
  file, line and reason, so one message says what to change (or which backend to use).
- Errors are DockerfileError with `path:line` first, like a compiler.
"""

from __future__ import annotations

import json
import re
import shlex

import msgspec

from miles.sandboxes.base import SandboxError


class DockerfileError(SandboxError):
    pass


class Instruction(msgspec.Struct, frozen=True):
    cmd: str                    # upper case: RUN, COPY, ...
    args: str                   # the raw argument text (continuations joined)
    line: int                   # 1-based line of the instruction's first line
    flags: dict[str, str] = {}  # --name=value options before the arguments
    json_args: list[str] | None = None  # exec form, when the arguments are a JSON array


_DIRECTIVE = re.compile(r"^#\s*([a-zA-Z]+)\s*=\s*(\S+)\s*$")
_FLAG = re.compile(r"^--([a-z-]+)(?:=(\S*))?$")
_VAR = re.compile(r"\$(?:\{(\w+)(?::([-+])([^}]*))?\}|(\w+))")


def parse(text: str, path: str = "Dockerfile") -> list[Instruction]:
    escape = "\\"
    lines = text.splitlines()
    i = 0
    # Parser directives only count before the first instruction or other comment.
    while i < len(lines):
        m = _DIRECTIVE.match(lines[i])
        if not m:
            break
        if m.group(1).lower() == "escape":
            escape = m.group(2)
        i += 1
    out: list[Instruction] = []
    while i < len(lines):
        start, raw = i + 1, lines[i]
        i += 1
        stripped = raw.strip()
        if not stripped or stripped.startswith("#"):
            continue
        parts = [raw.rstrip()]
        while parts[-1].endswith(escape) and i <= len(lines):
            parts[-1] = parts[-1][:-len(escape)]
            # Comment and empty lines inside a continuation are skipped, as Docker does.
            while i < len(lines) and (not lines[i].strip() or lines[i].lstrip().startswith("#")):
                i += 1
            if i >= len(lines):
                break
            parts.append(lines[i].rstrip())
            i += 1
        joined = " ".join(p.strip() for p in parts)
        cmd, _, rest = joined.partition(" ")
        flags: dict[str, str] = {}
        rest = rest.strip()
        while rest.startswith("--"):
            token, _, remainder = rest.partition(" ")
            m = _FLAG.match(token)
            if not m:
                raise DockerfileError(f"{path}:{start}: bad flag {token!r}")
            flags[m.group(1)] = m.group(2) or ""
            rest = remainder.strip()
        json_args = None
        if rest.startswith("["):
            try:
                candidate = json.loads(rest)
            except json.JSONDecodeError:
                candidate = None
            if isinstance(candidate, list) and all(isinstance(a, str) for a in candidate):
                json_args = candidate
        out.append(Instruction(cmd=cmd.upper(), args=rest, line=start, flags=flags,
                               json_args=json_args))
    return out


def substitute(text: str, variables: dict[str, str]) -> str:
    def one(m: re.Match) -> str:
        value = variables.get(m.group(1) or m.group(4), "")
        op, word = m.group(2), m.group(3) or ""
        if op == "-":
            return value or word
        if op == "+":
            return word if value else ""
        return value
    return _VAR.sub(one, text)


def parse_env(ins: Instruction, variables: dict[str, str], path: str) -> dict[str, str]:
    """ENV/ARG/LABEL bodies: `K=V K2="v 2"`, or the legacy `ENV K the rest`."""
    body = ins.args
    if "=" not in body.split(" ", 1)[0]:
        key, _, value = body.partition(" ")
        if not key or ins.cmd == "ARG":
            return {key: ""} if key else {}
        return {key: substitute(value.strip(), variables)}
    out = {}
    try:
        tokens = shlex.split(body, posix=True)
    except ValueError as exc:
        raise DockerfileError(f"{path}:{ins.line}: cannot parse {ins.cmd} {body!r}: {exc}")
    for token in tokens:
        key, eq, value = token.partition("=")
        out[key] = substitute(value, {**variables, **out}) if eq else ""
    return out


def copy_operands(ins: Instruction, variables: dict[str, str], path: str) -> tuple[list[str], str]:
    """COPY/ADD sources and destination, after substitution."""
    items = ins.json_args if ins.json_args is not None else shlex.split(ins.args)
    items = [substitute(x, variables) for x in items]
    if len(items) < 2:
        raise DockerfileError(f"{path}:{ins.line}: {ins.cmd} needs a source and a destination, "
                              f"got {ins.args!r}")
    return items[:-1], items[-1]
