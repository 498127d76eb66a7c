"""The episode store: every finished rollout episode, readable later (`miles episodes`, the
dashboard's episode browser at `/episodes`).

    <output_dir>/episodes.jsonl      one EpisodeRecord per line (msgspec JSON), newest last
    <output_dir>/episodes.1.jsonl    the previous file, after a rotation

Design decisions:
- The source of a transcript is the episode's own account, read from the finished sample: an
  agent's messages (`metadata["agent"]["messages"]`: the built-in tool agent and the SWE and
  terminal harnesses return them because the episode runner sets `task["keep_transcript"]` while
  this store is on; Harbor, HUD and OpenEnv always do), else a `rollout.generate` plug-in's
  `metadata["messages"]`, else the prompt and the decoded response as one assistant turn (the
  one-call path, or a black-box agent that keeps no transcript: the session server's rendering).
  The session server keeps token ids, not messages, so it is not asked.
- The rollout worker writes a group's records after its `PutGroup`, with the buffer's decision
  (keep / retry / drop / stale): a group dropped by `buffer.filter` is still there to read. The
  step that trained an episode is not known then; readers join it from `metrics.jsonl`, whose
  train rows list their `batch/prompt_indices` (the last kept attempt of a prompt is the trained
  one). An episode never trained is shown at the step its policy version was about to train.
- Compact and bounded: one msgspec Struct per record, `omit_defaults`, no token ids. Every failed
  or zero-reward episode is kept, and 1 in `logging.episodes_keep_success` successful ones (by a
  hash of the rollout id, so the samples of one trajectory tree stay together). Past half of
  `logging.episodes_max_mb` the file is rotated to `episodes.1.jsonl` (the older one deleted), so
  the two stay under the cap and the newest episodes are always kept; one log line per rotation.
- Never on the hot path, never fatal: the event loop only builds the Structs; encoding and
  writing happen on one writer thread behind a bounded queue (a full queue drops records and
  counts them). An error is logged once and the store stops; the run goes on.
- A writer killed mid-line leaves a torn last line: readers skip it with a warning, and a writer
  that appends to such a file starts on a new line first.
- A fresh job (rollout incarnation 0 with no checkpoint to resume) starts new files, as
  `metrics.jsonl` does; a resumed or restarted one appends.
"""

from __future__ import annotations

import json
import os
import queue
import re
import threading
import time
import zlib
from pathlib import Path
from typing import Any

import msgspec

from miles.wire.messages import scalar_reward

FILE, ROTATED = "episodes.jsonl", "episodes.1.jsonl"
MAX_PENDING = 4096          # records queued for the writer thread before new ones are dropped


class ToolCall(msgspec.Struct, omit_defaults=True):
    name: str
    arguments: str = ""     # as the model wrote them (JSON text)
    id: str = ""


class Turn(msgspec.Struct, omit_defaults=True):
    role: str               # system | user | assistant | tool
    content: str = ""
    reasoning: str = ""
    tool_calls: list[ToolCall] = []
    tool_call_id: str = ""  # a tool result: the call it answers
    name: str = ""          # a tool result: the tool's name


class EpisodeRecord(msgspec.Struct, omit_defaults=True, kw_only=True):
    run: str
    time: float                                  # unix seconds when written
    task: str                                    # the task id (see task_id)
    prompt_index: int                            # the prompt's stream position (unique per run)
    group_id: str
    rollout_id: str
    index: int = 0                               # the sample's position in its group
    attempt: int = 0                             # regenerations of this prompt before this one
    status: str                                  # completed | truncated | aborted | failed
    error: str = ""                              # why it failed (or what cut it off)
    reward: float | dict[str, float] | None = None
    score: float | None = None                   # the scalar reward (train.reward_key)
    messages: list[Turn] = []
    prompt_tokens: int = 0
    response_tokens: int = 0
    trained_tokens: int = 0                      # under the loss mask
    versions: list[int] = []                     # the policy versions its tokens came from
    sandbox_id: str = ""
    session_id: str = ""
    stop: str = ""                               # what ended the agent's loop
    decision: str = ""                           # the buffer's: keep | retry | drop | stale
    decision_reason: str = ""


class EpisodeSummary(msgspec.Struct, kw_only=True):
    """A record without its messages (what the browser's list reads)."""
    run: str = ""
    time: float = 0.0
    task: str = ""
    prompt_index: int = 0
    group_id: str = ""
    rollout_id: str = ""
    index: int = 0
    attempt: int = 0
    status: str = ""
    error: str = ""
    reward: float | dict[str, float] | None = None
    score: float | None = None
    prompt_tokens: int = 0
    response_tokens: int = 0
    versions: list[int] = []
    sandbox_id: str = ""
    decision: str = ""
    decision_reason: str = ""


# ----- building records ------------------------------------------------------------------------

def task_id(sample) -> str:
    """The row's own id (`task_id`, `id`, `task_name`, `name`), else a short hash of the prompt:
    the same row gets the same id in every epoch."""
    meta = sample.metadata
    for key in ("task_id", "id", "task_name", "name"):
        if isinstance(meta.get(key), (str, int)) and meta.get(key) != "":
            return str(meta[key])
    return "p" + format(zlib.crc32(json.dumps(sample.prompt, sort_keys=True).encode()), "08x")


def _text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # OpenAI / Anthropic content parts
        return "\n".join(_text(p.get("text", p.get("content", ""))) if isinstance(p, dict)
                         else str(p) for p in content)
    return json.dumps(content) if isinstance(content, dict) else str(content)


def _arguments(args: Any) -> str:
    return args if isinstance(args, str) else json.dumps(args)


def turns_of(messages: list[Any]) -> list[Turn]:
    """OpenAI (or Anthropic content-block) messages as Turns; a tool result gets its tool's name."""
    names: dict[str, str] = {}
    out: list[Turn] = []
    for m in messages:
        if not isinstance(m, dict):
            out.append(Turn(role="?", content=str(m)))
            continue
        calls = []
        for c in m.get("tool_calls") or []:
            fn = c.get("function") or {}
            calls.append(ToolCall(name=str(fn.get("name", "")),
                                  arguments=_arguments(fn.get("arguments", "")),
                                  id=str(c.get("id") or "")))
        blocks = m.get("content") if isinstance(m.get("content"), list) else []
        results = []
        for b in blocks:   # Anthropic: tool_use / tool_result blocks
            if isinstance(b, dict) and b.get("type") == "tool_use":
                calls.append(ToolCall(name=str(b.get("name", "")),
                                      arguments=_arguments(b.get("input", {})),
                                      id=str(b.get("id") or "")))
            elif isinstance(b, dict) and b.get("type") == "tool_result":
                results.append(b)
        for c in calls:
            names[c.id] = c.name
        plain = [b for b in blocks
                 if not (isinstance(b, dict) and b.get("type") in ("tool_use", "tool_result"))]
        text = _text(plain) if blocks else _text(m.get("content"))
        call_id = str(m.get("tool_call_id") or "")
        if text or calls or not results:
            out.append(Turn(role=str(m.get("role", "?")), content=text, tool_calls=calls,
                            reasoning=_text(m.get("reasoning_content") or m.get("reasoning")),
                            tool_call_id=call_id,
                            name=str(m.get("name") or names.get(call_id, ""))))
        for b in results:
            rid = str(b.get("tool_use_id") or "")
            out.append(Turn(role="tool", content=_text(b.get("content")), tool_call_id=rid,
                            name=names.get(rid, "")))
    return out


def transcript(sample) -> list[Turn]:
    agent = sample.metadata.get("agent")
    messages = agent.get("messages") if isinstance(agent, dict) else None
    messages = messages or sample.metadata.get("messages")
    if isinstance(messages, list) and messages:
        return turns_of(messages)
    first = turns_of(sample.prompt) if isinstance(sample.prompt, list) else \
        [Turn(role="user", content=str(sample.prompt))]
    return [*first, Turn(role="assistant", content=sample.response)]


def failure_reason(sample) -> str:
    meta = sample.metadata
    return str(meta.get("error") or meta.get("agent_error") or meta.get("reason") or "")


def record_of(sample, run: str, reward_key: str = "", decision: str = "",
              reason: str = "") -> EpisodeRecord:
    meta = sample.metadata
    try:
        score = None if sample.reward is None else scalar_reward(sample.reward, reward_key)
    except ValueError:   # a dict reward and no train.reward_key: the components still show
        score = None
    agent = meta.get("agent") if isinstance(meta.get("agent"), dict) else {}
    mask = sample.loss_mask
    return EpisodeRecord(
        run=run, time=round(time.time(), 3), task=task_id(sample),
        prompt_index=int(meta.get("prompt_index", 0)), group_id=sample.group_id,
        rollout_id=sample.rollout_id, index=sample.index, attempt=int(meta.get("retries", 0)),
        status=str(sample.status), error=failure_reason(sample),
        reward=sample.reward, score=score, messages=transcript(sample),
        prompt_tokens=sample.prompt_length, response_tokens=sample.response_length,
        trained_tokens=int(mask.sum()) if mask is not None else sample.response_length,
        versions=sorted({int(s.version) for s in sample.weight_versions}),
        sandbox_id=str(meta.get("sandbox_id", "")), session_id=str(meta.get("session_id", "")),
        stop=str(agent.get("stop", "") or ""), decision=decision, decision_reason=reason)


def keep(sample, score: float | None, keep_success: int) -> bool:
    """Every failure and zero-reward episode; 1 in `keep_success` of the others."""
    if keep_success <= 1 or sample.status not in ("completed", "truncated") or not score \
            or score <= 0:
        return True
    return zlib.crc32(sample.rollout_id.encode()) % keep_success == 0


# ----- the writer ------------------------------------------------------------------------------

class EpisodeStore:
    """Appends records on a writer thread; the rollout worker calls `write(group, decision)`."""

    def __init__(self, run_dir: str | Path, run: str, *, max_mb: float = 256.0,
                 keep_success: int = 1, reward_key: str = "", fresh: bool = False):
        self.dir = Path(run_dir)
        self.path, self.rotated = self.dir / FILE, self.dir / ROTATED
        self.run, self.reward_key, self.keep_success = run, reward_key, keep_success
        self.half_bytes = int(max_mb * 1e6 / 2)
        self.counts = {"written": 0, "sampled_out": 0, "dropped": 0, "rotations": 0}
        self.failed = False
        self._queue: queue.Queue = queue.Queue(maxsize=MAX_PENDING)
        self.dir.mkdir(parents=True, exist_ok=True)
        if fresh:
            for p in (self.path, self.rotated):
                p.unlink(missing_ok=True)
        self._thread = threading.Thread(target=self._run, name="episode-writer", daemon=True)
        self._thread.start()

    @classmethod
    def for_recipe(cls, recipe, incarnation: int) -> "EpisodeStore | None":
        cfg = recipe.logging
        if not cfg.episodes:
            return None
        checkpoints = (Path(recipe.output_dir) / "checkpoints").glob("step_*")
        resumable = recipe.loop.resume and any((p / "loop_state.json").exists()
                                               for p in checkpoints)
        return cls(recipe.output_dir, recipe.run.name, max_mb=cfg.episodes_max_mb,
                   keep_success=cfg.episodes_keep_success, reward_key=recipe.train.reward_key,
                   fresh=incarnation == 0 and not resumable)

    def write(self, group, decision: str = "", reason: str = "") -> None:
        """Queue the records of a group's samples (on the event loop: builds Structs only)."""
        if self.failed:
            return
        try:
            for s in group.samples:
                rec = record_of(s, self.run, self.reward_key, decision, reason)
                if not keep(s, rec.score, self.keep_success):
                    self.counts["sampled_out"] += 1
                    continue
                try:
                    self._queue.put_nowait(rec)
                except queue.Full:   # the disk is slower than the rollout: never wait for it
                    self.counts["dropped"] += 1
        except Exception as e:   # a record we cannot build must not cost the group
            self._fail(f"building a record of group {getattr(group, 'group_id', '?')}", e)

    def _fail(self, what: str, e: Exception) -> None:
        if not self.failed:
            self.failed = True
            print(f"ERROR [episodes] {what}: {type(e).__name__}: {e}; no more episodes are kept "
                  f"in {self.path} (the run goes on)", flush=True)

    def _run(self) -> None:
        encoder = msgspec.json.Encoder()
        f = None
        try:
            f = self._open()
            while True:
                rec = self._queue.get()
                if rec is None:
                    break
                line = encoder.encode(rec) + b"\n"
                if f.tell() + len(line) > self.half_bytes and f.tell() > 0:
                    f.close()
                    os.replace(self.path, self.rotated)
                    self.counts["rotations"] += 1
                    print(f"[episodes] {self.path.name} reached half of logging.episodes_max_mb "
                          f"({self.half_bytes * 2 / 1e6:g} MB): moved to {ROTATED}, the older "
                          f"episodes there deleted", flush=True)
                    f = self._open()
                f.write(line)
                if self._queue.empty():
                    f.flush()
                self.counts["written"] += 1
        except Exception as e:   # a full disk, a removed directory: logged once, the run goes on
            self._fail("writing", e)
        finally:
            if f is not None:
                try:
                    f.close()
                except OSError:
                    pass

    def _open(self):
        f = open(self.path, "ab")
        if f.tell() > 0:   # a writer killed mid-line left a torn one: start ours on a new line
            with open(self.path, "rb") as r:
                r.seek(-1, os.SEEK_END)
                if r.read(1) != b"\n":
                    f.write(b"\n")
        return f

    def close(self, timeout_s: float = 30.0) -> None:
        """Write what is queued, then stop the thread (waits at most `timeout_s`)."""
        try:
            self._queue.put(None, timeout=timeout_s)
        except queue.Full:
            pass
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            print(f"[episodes] the writer did not finish within {timeout_s} s; records still "
                  f"queued are lost", flush=True)

    def metrics(self) -> dict[str, float]:
        return {f"episodes/{k}": float(v) for k, v in self.counts.items()}


# ----- the readers -----------------------------------------------------------------------------

class EpisodeFile:
    """The run's episodes, read incrementally: `refresh()` decodes only what was appended since
    (the browser calls it on every request), `full(key)` reads one record with its messages."""

    def __init__(self, run_dir: str | Path):
        self.dir = Path(run_dir)
        self.rows: list[tuple[EpisodeSummary, str, int]] = []   # (summary, file name, offset)
        self.warnings: list[str] = []
        self._seen: dict[str, tuple[int, int]] = {}            # file -> (inode, bytes read)
        self._decoder = msgspec.json.Decoder(EpisodeSummary)
        self._lock = threading.Lock()

    def refresh(self) -> "EpisodeFile":
        with self._lock:
            stats = {}
            for name in (ROTATED, FILE):
                try:
                    st = (self.dir / name).stat()
                    stats[name] = (st.st_ino, st.st_size)
                except FileNotFoundError:
                    pass
            changed = any(name not in stats or stats[name][0] != ino or stats[name][1] < done
                          for name, (ino, done) in self._seen.items())
            if changed:   # rotated, or a fresh job rewrote them: read both again
                self.rows, self.warnings, self._seen = [], [], {}
            for name in (ROTATED, FILE):
                if name in stats:
                    self._read(name, stats[name][0])
            return self

    def _read(self, name: str, inode: int) -> None:
        start = self._seen.get(name, (inode, 0))[1]
        with open(self.dir / name, "rb") as f:
            f.seek(start)
            data = f.read()
        end = data.rfind(b"\n") + 1          # an unfinished last line waits for its newline
        offset = start
        for n, line in enumerate(data[:end].split(b"\n")[:-1]):
            if line.strip():
                try:
                    self.rows.append((self._decoder.decode(line), name, offset))
                except (msgspec.DecodeError, msgspec.ValidationError) as e:
                    self.warnings.append(f"{name}: skipped an unreadable record at byte {offset} "
                                         f"({str(e)[:120]})")
            offset += len(line) + 1
        self._seen[name] = (inode, start + end)

    def torn_tail(self) -> str | None:
        """A warning when the newest file ends in a line without its newline (a killed writer)."""
        try:
            with open(self.dir / FILE, "rb") as f:
                f.seek(0, os.SEEK_END)
                if f.tell() == 0:
                    return None
                f.seek(-1, os.SEEK_END)
                if f.read(1) == b"\n":
                    return None
        except FileNotFoundError:
            return None
        return f"{FILE}: skipped a torn last line (its writer was killed mid-write)"

    def full(self, name: str, offset: int) -> EpisodeRecord:
        with open(self.dir / name, "rb") as f:
            f.seek(offset)
            return msgspec.json.decode(f.readline(), type=EpisodeRecord)


def key_of(s) -> str:
    return f"{s.rollout_id}/{s.index}"


def trained_steps(rows: list[dict]) -> tuple[dict[int, int], int | None]:
    """From metrics.jsonl: prompt index -> the step that trained it, and the version offset
    (a train row's version minus its step) that maps a policy version to a step."""
    steps, base = {}, None
    for r in rows:
        if r.get("kind") == "train":
            for p in r.get("batch/prompt_indices") or []:
                steps[int(p)] = int(r["step"])
            if base is None and isinstance(r.get("version"), int):
                base = int(r["version"]) - int(r["step"])
    return steps, base


def annotate(summaries: list, rows: list[dict]) -> list[dict[str, Any]]:
    """Per episode: its step, and whether that step trained it (`trained`); the last kept attempt
    of a prompt is the one a train row's prompt indices mean."""
    steps, base = trained_steps(rows)
    last_kept: dict[int, str] = {}
    for s in summaries:
        if s.decision == "keep":
            last_kept[s.prompt_index] = s.group_id
    out = []
    for s in summaries:
        step = steps.get(s.prompt_index) if last_kept.get(s.prompt_index) == s.group_id else None
        trained = step is not None
        if step is None and s.versions and base is not None:
            step = min(s.versions) - base + 1   # the step this policy version was about to train
        out.append({"step": step, "trained": trained})
    return out


REWARD = re.compile(r"^\s*(<=|>=|<|>|=|==)?\s*(-?[0-9.]+(?:e-?[0-9]+)?)\s*$")


def parse_reward(text: str) -> tuple[str, float]:
    """`0`, `>0`, `<=0.5`, ... -> (operator, value); ValueError naming what was expected."""
    m = REWARD.match(text or "")
    try:
        value = float(m.group(2)) if m else None
    except ValueError:
        value = None
    if value is None:
        raise ValueError(f"reward {text!r}: expected a number, optionally after <, <=, >, >= "
                         f"(e.g. 0, '>0', '<=0.5')")
    return (m.group(1) or "=").replace("==", "="), value


def matches(s, info: dict, *, step: int | None = None, reward: tuple[str, float] | None = None,
            task: str | None = None) -> bool:
    if step is not None and info["step"] != step:
        return False
    if task is not None and task != s.task and task not in s.task:
        return False
    if reward is not None:
        if s.score is None:
            return False
        op, v = reward
        ok = {"=": abs(s.score - v) < 1e-9, "<": s.score < v, "<=": s.score <= v,
              ">": s.score > v, ">=": s.score >= v}[op]
        if not ok:
            return False
    return True


def select(index: EpisodeFile, rows: list[dict], *, step=None, reward=None, task=None,
           n: int | None = None) -> tuple[list[tuple[Any, str, int, dict]], int]:
    """(the newest `n` matching episodes, oldest first, as (summary, file, offset, info); how many
    episodes there are in all)."""
    summaries = [r[0] for r in index.rows]
    infos = annotate(summaries, rows)
    hits = [(s, name, off, info) for (s, name, off), info in zip(index.rows, infos)
            if matches(s, info, step=step, reward=reward, task=task)]
    return (hits[-n:] if n else hits), len(summaries)


def to_json(s, info: dict, key: str | None = None) -> dict[str, Any]:
    fields = {f: getattr(s, f) for f in s.__struct_fields__}   # omitted defaults included
    return {**msgspec.to_builtins(fields), **info, "key": key or key_of(s)}


def format_episode(rec: EpisodeRecord, info: dict) -> str:
    """A readable transcript: a header (task, step, status, reward, tokens, versions, sandbox),
    then each turn with its tool calls."""
    step = "step ?" if info.get("step") is None else f"step {info['step']}"
    step += " (trained)" if info.get("trained") else " (not trained)"
    reward = "none" if rec.reward is None else (
        json.dumps(rec.reward) if isinstance(rec.reward, dict) else f"{rec.reward:g}")
    versions = ",".join(map(str, rec.versions)) or "?"
    head = [f"== episode {rec.rollout_id} sample {rec.index}  task {rec.task}  {step}  "
            f"policy version {versions}",
            f"   status {rec.status}  reward {reward}  tokens: prompt {rec.prompt_tokens}, "
            f"response {rec.response_tokens} ({rec.trained_tokens} trained)",
            f"   sandbox {rec.sandbox_id or '-'}  session {rec.session_id or '-'}  "
            f"buffer {rec.decision or '-'}"
            f"{': ' + rec.decision_reason if rec.decision_reason else ''}"
            f"{'  stop ' + rec.stop if rec.stop else ''}"]
    if rec.error:
        head.append(f"   reason: {rec.error}")
    lines = []
    for t in rec.messages:
        who = f"tool {t.name}" if t.role == "tool" and t.name else t.role
        lines.append(f"[{who}] {t.content}".rstrip())
        if t.reasoning:
            lines.append(f"   (reasoning) {t.reasoning}")
        for c in t.tool_calls:
            lines.append(f"   -> {c.name}({c.arguments})")
    return "\n".join(head + lines) + "\n"
