"""docs/figures.md is what `python bench/figures.py` renders from bench/results/*.jsonl, and the
README stays one page whose links land.

The generator is loaded from its file (bench/ is not a package); `record` runs a real child
process, as it runs a bench.
"""

import importlib.util
import json
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _figures():
    spec = importlib.util.spec_from_file_location("figures", ROOT / "bench" / "figures.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["figures"] = module  # msgspec resolves the Row's annotations through it
    spec.loader.exec_module(module)
    return module


figures = _figures()


def test_the_committed_page_is_what_the_rows_give():
    committed = (ROOT / "docs" / "figures.md").read_text()
    assert committed == figures.render(figures.load_rows()) + "\n", (
        "docs/figures.md is out of date: run `python bench/figures.py`")


def test_every_row_has_its_fields_and_an_anchor():
    rows = figures.load_rows()
    assert len(rows) >= 70  # the transcribed table and the docs' rows, plus recorded ones
    page = (ROOT / "docs" / "figures.md").read_text()
    for path, lineno, row in rows:
        where = f"{path.name}:{lineno}"
        for field in ("what", "machine", "command", "figure", "baseline"):
            assert getattr(row, field).strip(), f"{where}: empty {field}"
        assert row.transcribed == bool(row.source), f"{where}: transcribed rows name their source"
        assert row.transcribed or row.result is not None, f"{where}: a new row keeps its bench line"
        assert f'<a id="{row.id}"></a>' in page, where
    assert any(not row.transcribed for _, _, row in rows), "no row recorded from real bench output"


@pytest.mark.parametrize("line, field", [
    ('{"id": "x", "topic": "wire", "what": "w", "date": "2026-12-01", "machine": "m", '
     '"command": "c", "figure": "f"}', "baseline"),
    ('{"id": "x", "topic": "wire", "what": "w", "date": "2026-12-32", "machine": "m", '
     '"command": "c", "figure": "f", "baseline": "b"}', "date"),
    ('{"id": "Bad Id", "topic": "wire", "what": "w", "date": "2026-12-01", "machine": "m", '
     '"command": "c", "figure": "f", "baseline": "b"}', "id"),
    ('{"id": "wire", "topic": "wire", "what": "w", "date": "2026-12-01", "machine": "m", '
     '"command": "c", "figure": "f", "baseline": "b"}', "id"),
    ('{"id": "x", "topic": "gossip", "what": "w", "date": "2026-12-01", "machine": "m", '
     '"command": "c", "figure": "f", "baseline": "b"}', "topic"),
    ('{"id": "x", "topic": "wire", "what": "", "date": "2026-12-01", "machine": "m", '
     '"command": "c", "figure": "f", "baseline": "b"}', "what"),
])
def test_a_bad_row_names_its_file_line_and_field(tmp_path, line, field):
    good = ('{"id": "ok", "topic": "wire", "what": "w", "date": "2026-12-01", "machine": "m", '
            '"command": "c", "figure": "f", "baseline": "b"}')
    (tmp_path / "wire.jsonl").write_text(good + "\n" + line + "\n")
    with pytest.raises(figures.RowError) as err:
        figures.load_rows(tmp_path)
    assert f"wire.jsonl:2: field `{field}`" in str(err.value)


def test_check_names_the_command_when_the_page_is_stale(tmp_path, capsys):
    page = tmp_path / "figures.md"
    page.write_text("# Figures\n")
    with pytest.raises(SystemExit) as stop:
        figures.main(["--page", str(page), "--check"])
    assert "out of date: run `python bench/figures.py`" in str(stop.value)


def test_record_appends_the_bench_line_and_regenerates(tmp_path):
    results, page = tmp_path / "results", tmp_path / "figures.md"
    line = {"bench": "demo", "call_p50_us": 150.5, "zmq": {"call_p50_us": 120.0}, "machine": "m"}
    bench = ["-c", f"import json; print('warming up'); print(json.dumps({line!r}))"]
    figures.main(["--results", str(results), "--page", str(page), "record", "--topic", "wire",
                  "--id", "demo-call", "--what", "a call", "--figure", "call_p50_us",
                  "--baseline", "zmq.call_p50_us", "--", sys.executable, *bench])
    (kept,) = (results / "wire.jsonl").read_text().splitlines()
    row = json.loads(kept)
    assert row["figure"] == "call_p50_us 150.5" and row["baseline"] == "zmq.call_p50_us 120.0"
    assert row["result"] == line and row["machine"] == "m" and "transcribed" not in row
    assert row["command"].startswith(sys.executable)
    assert '<a id="demo-call"></a>a call | call_p50_us 150.5 |' in page.read_text()
    with pytest.raises(SystemExit) as stop:  # an id is an anchor: never reused
        figures.main(["--results", str(results), "--page", str(page), "record", "--topic", "wire",
                      "--id", "demo-call", "--what", "a", "--figure", "x", "--", sys.executable,
                      "-c", "print(1)"])
    assert "is taken" in str(stop.value)


def test_record_takes_the_saved_output_of_a_bench_that_already_ran(tmp_path):
    """`--output FILE`: an hour-long bench is recorded from its saved stdout, under its command,
    which does not run again."""
    results, page = tmp_path / "results", tmp_path / "figures.md"
    saved = tmp_path / "out.jsonl"
    saved.write_text('{"note": "a seed"}\n' + json.dumps({"gain": 0.24, "machine": "m"}) + "\n")
    figures.main(["--results", str(results), "--page", str(page), "record", "--topic", "agentic",
                  "--id", "demo-gain", "--what", "a gain", "--figure", "gain", "--output", str(saved),
                  "--", sys.executable, "-c", "raise SystemExit('ran again')"])
    row = json.loads((results / "agentic.jsonl").read_text())
    assert row["figure"] == "gain 0.24" and row["result"]["gain"] == 0.24
    assert row["command"].startswith(sys.executable) and "ran again" in row["command"]


def test_record_picks_the_line_of_one_configuration(tmp_path):
    results, page = tmp_path / "results", tmp_path / "figures.md"
    lines = [{"integration": name, "episodes_per_s": rate, "env_s": 0.1, "machine": "m"}
             for name, rate in (("hud", 10.5), ("harbor", 1.2), ("openenv", 12.0))]
    printed = "; ".join(f"print(json.dumps({line!r}))" for line in lines)
    figures.main(["--results", str(results), "--page", str(page), "record", "--topic", "envs",
                  "--id", "harbor-rate", "--what", "harbor", "--figure", "episodes_per_s",
                  "--baseline", "env_s", "--where", "integration=harbor", "--",
                  sys.executable, "-c", f"import json; {printed}"])
    row = json.loads((results / "envs.jsonl").read_text())
    assert row["figure"] == "episodes_per_s 1.2" and row["result"]["integration"] == "harbor"
    with pytest.raises(SystemExit) as stop:
        figures.main(["--results", str(results), "--page", str(page), "record", "--topic", "envs",
                      "--id", "nemo-rate", "--what", "x", "--figure", "episodes_per_s",
                      "--where", "integration=nemo_gym", "--", sys.executable, "-c",
                      f"import json; {printed}"])
    assert "no JSON object line with integration=nemo_gym" in str(stop.value)


def test_the_readme_is_one_page_and_its_links_land():
    readme = ROOT / "README.md"
    text = readme.read_text()
    assert len(text.splitlines()) <= 150, "README.md: at most 150 lines"
    assert len(text.encode()) <= 12 * 1024, "README.md: at most 12 KB"
    ids = {row.id for _, _, row in figures.load_rows()}
    anchors = re.findall(r"docs/figures\.md#([a-z0-9-]+)", text)
    assert 1 <= len(anchors) <= 5, "the README shows at most 5 headline figures"
    assert set(anchors) <= ids, f"README links to rows that do not exist: {set(anchors) - ids}"
    for target in re.findall(r"\]\(([^)#\s]+)", text):
        if not target.startswith("http"):
            assert (ROOT / target).exists(), f"README links to {target}, which does not exist"
    for doc in ("architecture", "configuration", "extending", "environments", "gpu_and_clusters",
                "recovery", "capacity", "glossary", "figures"):
        assert f"(docs/{doc}.md)" in text, f"the README's map of the docs lacks docs/{doc}.md"
