"""docs/figures.md, generated from the bench JSON lines kept in bench/results/*.jsonl.

    python bench/figures.py             # rewrite docs/figures.md from bench/results/*.jsonl
    python bench/figures.py --check     # exit 1 naming the command when docs/figures.md is stale
    python bench/figures.py record --topic wire --id actor-call-p50-2026-12 \\
        --what "actor call() p50" --figure call_p50_us --baseline zmq_call_p50_us \\
        -- .venv/bin/python bench/wire.py --calls 2000
                                        # run a bench, append its JSON line as a row, regenerate
    python bench/figures.py record ... --output FILE -- COMMAND
                                        # the same from FILE, COMMAND's saved stdout (a long bench)

Every bench prints one JSON line of figures and the machine. `record` runs the bench command
given after `--`, echoes its output (as `tee` would), takes its last JSON object line, appends one
row to `bench/results/<topic>.jsonl` and regenerates the page: the row's figure and baseline are
the named keys of the bench's line (`--figure a,b --baseline c`, dotted paths reach nested
objects), and the whole line is kept unchanged under `result`. The benches' lines carry
`machine` as a string (`miles.hostinfo.machine`); where one does not (chaos.py's is the CPU
architecture alone), give `--machine`. A bench that prints a line per configuration (envs.py per
integration, offload.py per model and mode, chaos.py per case) is recorded one line at a time
with `--where KEY=VALUE` (`--where integration=hud`).

The row schema (one JSON object per line, decoded by msgspec into `Row`; unknown fields refused):
  id           the row's anchor, `[a-z0-9-]+`, unique over all files: `docs/figures.md#<id>`
  topic        one of TOPICS (the page's sections, in that order)
  what         what was measured (markdown)
  date         the day it ran, YYYY-MM-DD
  machine      where it ran ("2-core CPU", "1x H200", or the bench's own `machine` string)
  command      the command that printed the figure
  figure       the result (markdown)
  baseline     the baseline measured in the same run, or "none" where the run had none
  transcribed  true for the rows copied once from the README's old figures table and the docs'
               tables; such rows name their `source`
  source       transcribed from (`README.md`, `docs/recovery.md`, ...)
  result       recorded rows: the bench's own JSON line

Design decisions:
- The page is data, not prose: a figure is added by appending a line, never by editing the page,
  and a test (tests/runtime/test_figures.py) fails when the committed page is not what the rows
  give. Rows keep their anchors forever, so the README links to them.
- `record` instead of `bench/x.py | tee -a bench/results/x.jsonl`: a bench's own line names
  neither the day nor the command, and its figures sit under keys of its own; the wrapper adds
  the first two and picks the figure and baseline keys once, so every row reads the same.
- A bad row stops the generator with one line naming the file, the line and the field.
- Transcribed rows keep the old table's text. The old table gave a date only for some rows; the
  others carry the day their README line was last written (from `git blame`), the closest record
  of when they were measured.
- Within a topic, the newest rows come first; rows of one day keep their file order.
"""

from __future__ import annotations

import argparse
import datetime
import json
import re
import shlex
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Annotated, Any

import msgspec

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
PAGE = ROOT / "docs" / "figures.md"
REGENERATE = "python bench/figures.py"

# (topic, section title): the page's sections, in order
TOPICS = {
    "quickstart": "Quickstarts and learning",
    "async": "Fully-async against sync",
    "engine": "The embedded engine",
    "train": "Training steps",
    "weights": "Weight publish",
    "memory": "Optimizer offload",
    "quant": "Low precision",
    "moe": "MoE and R3",
    "agentic": "Agents, sandboxes and sessions",
    "envs": "Environment integrations",
    "wire": "Wire and data plane",
    "recovery": "Recovery",
    "capacity": "Capacity model",
    "tests": "Tests and CI",
}

# what a section's rows add up to, where one row does not say it
INTROS = {
    "async": (
        "The target: fully-async at least 2x faster per step than sync at average staleness <= 2, "
        "with the reward curve within noise of sync. On two H200s it is met with room (2.3-2.4x at "
        "staleness ~1.5), and the reward curves agree within seed-to-seed noise (measured on the "
        "CPU, where the quickstart's task learns within the bench's time). On the 2-core CPU "
        "max_staleness 2 gives 1.94-2.17x: engine, trainer, gateway and actors share two cores, "
        "fully-async keeps 88% of them busy and the engine's single thread saturated, so the "
        "machine is the limit. A faster engine would not change the ratio much: it speeds up the "
        "sync step's straggler (~240 sequential decode steps per step) as much as the fully-async "
        "step (~64 larger batched ones)."),
    "wire": ("The data plane's run, per DP size, path and send, is tabulated in full in "
             "[gpu_and_clusters.md](gpu_and_clusters.md#several-nodes-slurm-or-torchrun-style)."),
    "recovery": ("What each failure does, and the node-loss timings: "
                 "[recovery.md](recovery.md)."),
    "capacity": ("The calibration tables, configuration by configuration, and the projections: "
                 "[capacity.md](capacity.md#calibration-and-validation)."),
}

Text = Annotated[str, msgspec.Meta(min_length=1)]
ID_PATTERN = r"^[a-z0-9][a-z0-9-]*$"


class Row(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    id: Annotated[str, msgspec.Meta(pattern=ID_PATTERN)]
    topic: Text
    what: Text
    date: datetime.date
    machine: Text
    command: Text
    figure: Text
    baseline: Text
    transcribed: bool = False
    source: str = ""
    result: dict[str, Any] | None = None


class IdOnly(msgspec.Struct):
    id: Annotated[str, msgspec.Meta(pattern=ID_PATTERN)]


class RowError(ValueError):
    """A bad row: its file, line and field."""


def _field_of(message: str) -> str:
    """The field a msgspec validation message is about (`... - at `$.date``, `... field `id``)."""
    at = re.search(r"at `\$\.([^`\[]+)", message)
    if at:
        return at.group(1)
    missing = re.search(r"field `([^`]+)`", message)
    return missing.group(1) if missing else "(the line)"


def load_rows(results: Path = RESULTS) -> list[tuple[Path, int, Row]]:
    """Every row of `results/*.jsonl` in file order, validated; RowError on the first bad one."""
    decoder = msgspec.json.Decoder(Row)
    rows: list[tuple[Path, int, Row]] = []
    seen: dict[str, str] = {}
    for path in sorted(results.glob("*.jsonl")):
        name = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
        for lineno, line in enumerate(path.read_text().splitlines(), 1):
            if not line.strip():
                continue
            where = f"{name}:{lineno}"
            try:
                row = decoder.decode(line)
            except msgspec.ValidationError as e:
                raise RowError(f"{where}: field `{_field_of(str(e))}`: {e}") from None
            except msgspec.DecodeError as e:
                raise RowError(f"{where}: not a JSON object: {e}") from None
            if row.topic not in TOPICS:
                raise RowError(f"{where}: field `topic`: {row.topic!r} is not one of "
                               f"{', '.join(TOPICS)}")
            if row.id in TOPICS:
                raise RowError(f"{where}: field `id`: {row.id!r} is a section's anchor")
            if row.id in seen:
                raise RowError(f"{where}: field `id`: {row.id!r} is already the id of "
                               f"{seen[row.id]}")
            if row.transcribed and not row.source:
                raise RowError(f"{where}: field `source`: a transcribed row names where it "
                               "came from")
            seen[row.id] = where
            rows.append((path, lineno, row))
    return rows


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def render(rows: list[tuple[Path, int, Row]]) -> str:
    out = [
        "# Figures",
        "",
        f"Generated by `{REGENERATE}` from the bench JSON lines in `bench/results/*.jsonl`; do",
        "not edit by hand. Every benchmark in `bench/` prints one JSON line with the machine and a",
        "baseline measured in the same run. To add a row, run the bench through the generator,",
        "which appends its line and regenerates this page (the module docstring of",
        "`bench/figures.py` gives the row schema):",
        "",
        "```bash",
        "python bench/figures.py record --topic wire --id my-row --what \"actor call() p50\" \\",
        "    --figure call_p50_us --baseline zmq_call_p50_us -- .venv/bin/python bench/wire.py",
        "```",
        "",
        "Rows marked *transcribed* were copied once from the README's former figures table (and",
        "from tables in these docs); their date is the day given with the figure, else the day",
        "its README line was last written. \"2-core CPU\" is the development and CI machine class;",
        "\"loaded\" means other work shared it.",
        "",
    ]
    by_topic: dict[str, list[tuple[int, Row]]] = {t: [] for t in TOPICS}
    for order, (_, _, row) in enumerate(rows):
        by_topic[row.topic].append((order, row))
    out += textwrap.wrap(" · ".join(f"[{title}](#{topic})" for topic, title in TOPICS.items()
                                    if by_topic[topic]), 100, break_long_words=False,
                         break_on_hyphens=False)
    out.append("")
    for topic, title in TOPICS.items():
        entries = sorted(by_topic[topic], key=lambda e: (-e[1].date.toordinal(), e[0]))
        if not entries:
            continue
        out += [f'<a id="{topic}"></a>', "", f"## {title}", ""]
        if topic in INTROS:
            out += textwrap.wrap(INTROS[topic], 100) + [""]
        out += ["| what | figure | same-run baseline | machine | date | command |",
                "| --- | --- | --- | --- | --- | --- |"]
        for _, row in entries:
            mark = " *(transcribed)*" if row.transcribed else ""
            out.append(f'| <a id="{row.id}"></a>{_cell(row.what)}{mark} | {_cell(row.figure)} | '
                       f"{_cell(row.baseline)} | {_cell(row.machine)} | {row.date.isoformat()} | "
                       f"`{_cell(row.command)}` |")
        out.append("")
    return "\n".join(out)


def _lookup(result: dict, dotted: str) -> Any:
    value: Any = result
    for part in dotted.split("."):
        if not isinstance(value, dict) or part not in value:
            raise KeyError(dotted)
        value = value[part]
    return value


def _figures_text(result: dict, keys: str) -> str:
    parts = []
    for key in (k.strip() for k in keys.split(",") if k.strip()):
        try:
            value = _lookup(result, key)
        except KeyError:
            raise SystemExit(f"figures record: the bench's line has no `{key}` "
                             f"(its keys: {', '.join(result)})") from None
        text = value if isinstance(value, str) else json.dumps(value, separators=(", ", ": "))
        parts.append(f"{key} {text}")
    return "; ".join(parts)


def last_json_line(output: str, where: list[str] = ()) -> dict:
    """The last JSON object line of `output` whose `KEY=VALUE` pairs of `where` all match
    (values compared as text): benches that print a line per configuration (envs, offload, chaos)
    are recorded one configuration at a time."""
    wanted = []
    for pair in where:
        key, sep, value = pair.partition("=")
        if not sep:
            raise SystemExit(f"figures record: --where {pair!r}: expected KEY=VALUE")
        wanted.append((key, value))
    for line in reversed(output.splitlines()):
        line = line.strip()
        if line.startswith("{"):
            try:
                value = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(value, dict) and all(
                    k in value and str(value[k]) == v for k, v in wanted):
                return value
    raise SystemExit("figures record: the command printed no JSON object line"
                     + (f" with {', '.join(where)}" if where else ""))


def record(args: argparse.Namespace) -> None:
    if args.topic not in TOPICS:
        raise SystemExit(f"figures record: --topic = {args.topic!r}: expected one of "
                         f"{', '.join(TOPICS)}")
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        raise SystemExit("figures record: give the bench command after --")
    results = Path(args.results)
    try:  # a bad id, or a bad row already kept, is said before the bench runs (it may take minutes)
        known = {row.id for _, _, row in load_rows(results)}
        msgspec.convert({"id": args.id}, IdOnly)
    except (RowError, msgspec.ValidationError) as e:
        raise SystemExit(f"figures record: {e}") from None
    if args.id in known:
        raise SystemExit(f"figures record: --id = {args.id!r} is taken: ids are anchors, "
                         "never reused")
    if args.output:   # the bench already ran (for an hour, say): its saved stdout
        lines = Path(args.output).read_text().splitlines(keepends=True)
    else:
        proc = subprocess.Popen(command, stdout=subprocess.PIPE, text=True, cwd=ROOT)
        lines = []
        for line in proc.stdout:  # echoed as it comes: a bench may run for minutes
            sys.stdout.write(line)
            lines.append(line)
        if proc.wait() != 0:
            raise SystemExit(f"figures record: the bench exited {proc.returncode}; nothing recorded")
    result = last_json_line("".join(lines), args.where)
    machine = args.machine or result.get("machine")
    if not isinstance(machine, str) or not machine:
        raise SystemExit("figures record: the bench's line has no `machine` string: give --machine")
    row = Row(id=args.id, topic=args.topic, what=args.what,
              date=datetime.datetime.now(datetime.timezone.utc).date(), machine=machine,
              command=shlex.join(command), figure=_figures_text(result, args.figure),
              baseline=_figures_text(result, args.baseline) if args.baseline else "none",
              result=result)
    results.mkdir(parents=True, exist_ok=True)
    path = results / f"{args.topic}.jsonl"
    with path.open("a") as f:
        f.write(msgspec.json.encode(row).decode() + "\n")
    write_page(results, Path(args.page))
    print(f"figures: recorded {args.id} in {path}", file=sys.stderr)


def write_page(results: Path, page: Path) -> None:
    try:
        text = render(load_rows(results))
    except RowError as e:
        raise SystemExit(f"figures: {e}") from None
    page.write_text(text + "\n")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--results", default=str(RESULTS), help="the rows' folder")
    parser.add_argument("--page", default=str(PAGE), help="the page written")
    parser.add_argument("--check", action="store_true", help="only compare with the page")
    sub = parser.add_subparsers(dest="cmd")
    rec = sub.add_parser("record", help="run a bench, append its line as a row, regenerate")
    rec.add_argument("--topic", required=True, help=", ".join(TOPICS))
    rec.add_argument("--id", required=True, help="the row's anchor, [a-z0-9-]+")
    rec.add_argument("--what", required=True, help="what was measured")
    rec.add_argument("--figure", required=True, help="keys of the bench's line: a,b.c")
    rec.add_argument("--baseline", default="", help="keys of the same-run baseline")
    rec.add_argument("--machine", default="", help="when the bench's line has no `machine`")
    rec.add_argument("--where", action="append", default=[], metavar="KEY=VALUE",
                     help="record the last line with this field (repeatable)")
    rec.add_argument("--output", default="", metavar="FILE",
                     help="the saved stdout of the bench command given after --, which already ran: "
                          "recorded from there, not run again")
    rec.add_argument("command", nargs=argparse.REMAINDER, help="-- the bench command")
    args = parser.parse_args(argv)
    if args.cmd == "record":
        record(args)
        return
    if args.check:
        try:
            text = render(load_rows(Path(args.results))) + "\n"
        except RowError as e:
            raise SystemExit(f"figures: {e}") from None
        if not Path(args.page).exists() or Path(args.page).read_text() != text:
            raise SystemExit(f"{args.page} is out of date: run `{REGENERATE}`")
        return
    write_page(Path(args.results), Path(args.page))


if __name__ == "__main__":
    main()
