"""`miles trace runs/<name> --sample ID | --step N | --prompt ID`: where a sample came from.

    prompt -> engine, version and weight digest -> turns and tool calls -> reward -> the step
    that trained it

Design decisions:
- Three files of the run directory, joined here and nowhere else: `provenance.jsonl` (one line
  per trained sample, the driver's, miles/rl/provenance.py), `weights/versions.jsonl` (the
  publisher's digest of each version and what each engine held) and `episodes.jsonl` (the
  transcripts, miles/episodes.py). A sample missing from one of them is shown with what the
  others know, and the line says which file lacked it.
- A sample ID is its `rollout_id/index` (the episode browser's key) or its `rollout_id` alone
  (every sample of that rollout). `--step` lists every sample trained at that step, `--prompt`
  every trained sample of that prompt index (all its attempts).
- A digest mismatch (the engine's digest for the sample's version differs from the publisher's)
  is one line starting with `MISMATCH`, and the exit code is 3, so a script can gate on it.
- Bad input is one line and exit code 2; nothing found is exit code 1.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from miles.episodes import FILE as EPISODES, EpisodeFile, EpisodeRecord, key_of
from miles.rl.provenance import FILE, VERSIONS, LineageRow, VersionRow, engine_key, read_jsonl
from miles.wire.messages import Provenance


class Lineage:
    """A run's lineage files, read once."""

    def __init__(self, run: Path):
        self.run = run
        self.rows: list[LineageRow] = read_jsonl(run / FILE, LineageRow)
        self.versions: dict[int, VersionRow] = {v.version: v for v in read_jsonl(run / VERSIONS, VersionRow)}
        self.episodes = EpisodeFile(run).refresh() if (run / EPISODES).exists() else None
        self._by_key = {} if self.episodes is None else {key_of(s): (s, name, off)
                                                         for s, name, off in self.episodes.rows}

    def select(self, *, sample: str | None = None, step: int | None = None,
               prompt: int | None = None) -> list[LineageRow]:
        if sample is not None:
            return [r for r in self.rows if f"{r.rollout_id}/{r.index}" == sample or r.rollout_id == sample]
        if step is not None:
            return [r for r in self.rows if r.step == step]
        return [r for r in self.rows if r.prompt_index == prompt]

    def episode(self, row: LineageRow) -> EpisodeRecord | None:
        hit = self._by_key.get(f"{row.rollout_id}/{row.index}")
        if hit is None:
            return None
        _, name, offset = hit
        return self.episodes.full(name, offset)

    def mismatch(self, p: Provenance) -> str:
        """'' or why the engine's weights differ from the publisher's for the sample's version."""
        v = self.versions.get(p.policy_version)
        if v is None or not v.digest:
            return ""
        engines = {engine_key(u): d for u, d in v.engine_digests.items()}
        have = engines.get(p.engine_id, "")
        if have and have != v.digest:
            return (f"MISMATCH: engine {p.engine_id} held weights {have[:12]} for version "
                    f"{p.policy_version}, the publisher sent {v.digest[:12]}")
        return ""


def _clock(t: float) -> str:
    return time.strftime("%H:%M:%S", time.localtime(t)) + f".{int(t * 1000) % 1000:03d}" if t else "?"


def _short(text: str, n: int = 100) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= n else text[: n - 3] + "..."


def format_lineage(lin: Lineage, row: LineageRow) -> tuple[str, bool]:
    """The lineage of one trained sample as text, and whether it is a mismatch."""
    p = row.record()
    ep = lin.episode(row)
    out = [f"sample {row.rollout_id}/{row.index}  (group {row.group_id}, status {row.status})"]
    prompt = ""
    if ep is not None and ep.messages:
        first = next((t for t in ep.messages if t.role == "user"), ep.messages[0])
        prompt = f": {_short(first.content, 80)!r}"
    out.append(f"  prompt     {row.prompt_index}{prompt}")
    bad = ""
    if p is None:
        out.append("  engine     (no provenance: logging.provenance was off for this sample)")
    else:
        digest = p.weight_digest or (lin.versions.get(p.policy_version) or VersionRow(0, 0, 0.0)).digest
        also = f" (tokens from versions {p.versions})" if len(p.versions) > 1 else ""
        out.append(f"  engine     {p.engine_id or '?'} (pid {p.engine_incarnation or '?'}), "
                   f"policy version {p.policy_version}{also}")
        out.append(f"  weights    " + (f"digest {digest[:16]}" if digest else
                                       "digest not recorded (weights.check_weights = false)"))
        bad = lin.mismatch(p)
        sp = p.sampling
        if sp:
            out.append("  sampling   " + " ".join(f"{k}={int(v) if k == 'seed' else format(v, 'g')}"
                                                  for k, v in sp.items())
                       + (f"; quant {p.quant_format}" if p.quant_format else ""))
        env = f"{p.env_name} {p.env_version}".strip()
        ver = f"{p.verifier_name} {p.verifier_version}".strip()
        out.append(f"  env        {env or '?'}; verifier {ver or '?'}")
        extras = [f"{k} {v}" for k, v in (("session", p.session_id), ("sandbox", p.sandbox_id),
                                          ("image", p.image_digest), ("routing", p.routing_digest)) if v]
        if extras:
            out.append("  context    " + ", ".join(extras))
        out.append(f"  times      queued {_clock(p.queued_at)}, started +{max(0.0, p.started_at - p.queued_at):.3f} s, "
                   f"finished +{max(0.0, p.finished_at - p.queued_at):.3f} s")
    if ep is None:
        out.append(f"  turns      (not in {EPISODES}: logging.episodes off, or sampled out)")
    else:
        calls = sum(len(t.tool_calls) for t in ep.messages)
        out.append(f"  turns      {len(ep.messages)} ({', '.join(t.role for t in ep.messages)}), "
                   f"tool calls {calls}")
        for t in ep.messages:
            if t.role == "user" and t is ep.messages[0]:
                continue
            for c in t.tool_calls:
                out.append(f"    {t.role:<9} -> {c.name}({_short(c.arguments, 60)})")
            if t.content:
                out.append(f"    {t.role:<9} {_short(t.content)!r}")
    comps = p.reward_components if p is not None else {}
    reward = json.dumps(row.reward) if row.reward is not None else "none"
    out.append(f"  reward     {reward}" + (f"  components {comps}" if comps and len(comps) > 1 else ""))
    out.append(f"  trained    at step {row.step}")
    if bad:
        out.append("  " + bad)
    return "\n".join(out), bool(bad)


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="miles trace", description="a trained sample's lineage")
    p.add_argument("run", help="the run directory (runs/<name>)")
    which = p.add_mutually_exclusive_group(required=True)
    which.add_argument("--sample", help="rollout_id/index, or rollout_id (all its samples)")
    which.add_argument("--step", type=int, help="every sample trained at this step")
    which.add_argument("--prompt", type=int, help="every trained sample of this prompt index")
    p.add_argument("--json", action="store_true", help="one JSON object per sample")
    args = p.parse_args(argv)
    run = Path(args.run)
    if not (run / FILE).exists():
        print(f"miles trace: {args.run}: no {FILE} (not a run directory, or logging.provenance = "
              f"false)", file=sys.stderr)
        return 2
    lin = Lineage(run)
    rows = lin.select(sample=args.sample, step=args.step, prompt=args.prompt)
    if not rows:
        what = (f"--sample {args.sample}" if args.sample is not None else
                f"--step {args.step}" if args.step is not None else f"--prompt {args.prompt}")
        print(f"miles trace: {args.run}: no trained sample matches {what} "
              f"({len(lin.rows)} trained samples in {FILE})", file=sys.stderr)
        return 1
    mismatches = 0
    for row in rows:
        if args.json:
            rec = row.record()
            bad = lin.mismatch(rec) if rec is not None else ""
            print(json.dumps({"sample": f"{row.rollout_id}/{row.index}", "step": row.step,
                              "prompt_index": row.prompt_index, "reward": row.reward,
                              "provenance": row.provenance, "mismatch": bad}))
        else:
            text, bad = format_lineage(lin, row)
            print(text)
        mismatches += bool(bad)
    if mismatches:
        print(f"{mismatches} of {len(rows)} samples were generated on weights whose digest differs "
              f"from the publisher's", file=sys.stderr)
        return 3
    return 0
