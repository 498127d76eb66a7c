"""The episode store (`miles.episodes`): records written by the real writer thread, the size
cap, success sampling, a torn last line; `miles episodes` on a run directory; the dashboard's
episode browser rendered by a real headless Chromium."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pytest

from miles.episodes import FILE, ROTATED, EpisodeFile, EpisodeStore, select
from miles.wire.messages import Group, Sample, VersionSpan
from tests.ports import cluster_port
from tests.runtime.test_observe import free_port, render

ROOT = Path(__file__).resolve().parents[2]
MILES = [sys.executable, "-m", "miles.cli"]


def agent_sample(prompt_index: int, i: int, reward, status="completed", error="", version=1) -> Sample:
    """A finished tool-agent sample as the episode runner leaves it (messages in metadata)."""
    messages = [{"role": "user", "content": f"Submit the number in k{prompt_index}.txt."},
                {"role": "assistant", "content": "", "tool_calls": [
                    {"id": "call_0", "type": "function",
                     "function": {"name": "read_file",
                                  "arguments": json.dumps({"path": f"k{prompt_index}.txt"})}}]},
                {"role": "tool", "tool_call_id": "call_0", "content": f"{100 + prompt_index}"},
                {"role": "assistant", "content": "", "tool_calls": [
                    {"id": "call_1", "type": "function",
                     "function": {"name": "submit", "arguments": json.dumps({"answer": "123"})}}]}]
    meta = {"prompt_index": prompt_index, "retries": 0, "task_id": f"find-{prompt_index}",
            "agent": {"messages": messages, "stop": "submitted"}, "session_id": f"s{prompt_index}-{i}",
            "sandbox_id": f"sbx-{prompt_index}-{i}"}
    if error:
        meta["error"] = error
    return Sample(tokens=np.arange(30, dtype=np.int32), response_length=12, loss_mask=np.ones(12, np.uint8),
                  weight_versions=[VersionSpan(version, 0, 12)], reward=reward, status=status,
                  group_id=f"p{prompt_index}-a0", rollout_id=f"p{prompt_index}-a0-{i}", index=i,
                  prompt=f"Submit the number in k{prompt_index}.txt.", metadata=meta)


def group(prompt_index: int, rewards, version=1, **kw) -> Group:
    return Group(group_id=f"p{prompt_index}-a0", prompt_index=prompt_index,
                 samples=[agent_sample(prompt_index, i, r, version=version, **kw)
                          for i, r in enumerate(rewards)])


def write_run(run: Path) -> None:
    """Three steps of records from the real store, and the metrics rows that say what was trained."""
    store = EpisodeStore(run, "demo", fresh=True)
    store.write(group(0, [1.0, 0.0]), "keep")
    store.write(group(1, [0.0, 0.0]), "drop", "buffer.filter nonzero_std")
    store.write(group(2, [{"correct": 1.0, "format": 0.0}, {"correct": 0.0, "format": 1.0}]), "keep")
    store.write(group(3, [None, None], status="failed", error="reward: ValueError: task row 3 is malformed",
                      version=2), "keep")
    store.close()
    rows = [{"kind": "train", "step": 1, "version": 2, "batch/prompt_indices": [0, 2]},
            {"kind": "train", "step": 2, "version": 3, "batch/prompt_indices": [3]}]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_records_round_trip_with_turns_tool_calls_and_the_trained_step(tmp_path):
    write_run(tmp_path)
    index = EpisodeFile(tmp_path).refresh()
    assert [(s.prompt_index, s.index) for s, _, _ in index.rows] == \
        [(p, i) for p in range(4) for i in range(2)]
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    hits, total = select(index, rows)
    assert total == 8
    steps = {(s.prompt_index, s.index): (info["step"], info["trained"]) for s, _, _, info in hits}
    # trained at 1 and 2 by the metrics rows; the dropped group at the step its version 1 was about to train
    assert steps[(0, 0)] == (1, True) and steps[(3, 1)] == (2, True) and steps[(1, 0)] == (1, False)
    rec = index.full(*hits[0][1:3])
    assert [t.role for t in rec.messages] == ["user", "assistant", "tool", "assistant"]
    assert rec.messages[1].tool_calls[0].name == "read_file"
    assert json.loads(rec.messages[1].tool_calls[0].arguments) == {"path": "k0.txt"}
    assert rec.messages[2].name == "read_file" and rec.messages[2].content == "100"
    assert (rec.task, rec.sandbox_id, rec.versions, rec.stop) == ("find-0", "sbx-0-0", [1], "submitted")
    assert (rec.prompt_tokens, rec.response_tokens, rec.trained_tokens, rec.score) == (18, 12, 12, 1.0)
    failed = index.full(*hits[6][1:3])
    assert failed.status == "failed" and "malformed" in failed.error
    assert index.full(*hits[4][1:3]).reward == {"correct": 1.0, "format": 0.0}


def test_successes_are_sampled_and_every_failure_is_kept(tmp_path):
    store = EpisodeStore(tmp_path, "demo", keep_success=4, fresh=True)
    for p in range(50):
        store.write(group(p, [1.0, 0.0]), "keep")
    store.close()
    rows = EpisodeFile(tmp_path).refresh().rows
    zeros = [s for s, _, _ in rows if s.score == 0.0]
    ones = [s for s, _, _ in rows if s.score == 1.0]
    assert len(zeros) == 50                  # every zero-reward episode
    assert 3 <= len(ones) <= 25, len(ones)    # about 1 in 4 of the 50 successes (a hash of the id)
    assert store.counts["sampled_out"] == 50 - len(ones)


def test_the_cap_rotates_and_keeps_the_newest_under_it(tmp_path, capfd):
    store = EpisodeStore(tmp_path, "demo", max_mb=0.02, fresh=True)   # 10 kB per file
    for p in range(60):
        store.write(group(p, [0.0]), "keep")
    store.close()
    files = [tmp_path / FILE, tmp_path / ROTATED]
    assert all(f.exists() for f in files) and sum(f.stat().st_size for f in files) <= 20_000
    assert store.counts["rotations"] >= 2
    rows = EpisodeFile(tmp_path).refresh().rows
    assert rows[-1][0].prompt_index == 59 and rows[0][0].prompt_index > 0   # the oldest went
    assert [s.prompt_index for s, _, _ in rows] == sorted(s.prompt_index for s, _, _ in rows)
    assert "reached half of logging.episodes_max_mb" in capfd.readouterr().out


def test_a_torn_last_line_is_skipped_with_a_warning_and_the_next_writer_starts_a_new_line(tmp_path):
    write_run(tmp_path)
    with open(tmp_path / FILE, "ab") as f:      # a writer killed mid-record
        f.write(b'{"run":"demo","time":1.0,"task":"find-9","prom')
    index = EpisodeFile(tmp_path).refresh()
    assert len(index.rows) == 8 and "torn last line" in index.torn_tail()
    out = subprocess.run([*MILES, "episodes", str(tmp_path), "-n", "1"], capture_output=True, text=True,
                         timeout=60, cwd=ROOT)
    assert out.returncode == 0 and "skipped a torn last line" in out.stderr, out.stderr
    store = EpisodeStore(tmp_path, "demo")      # a restarted worker appends
    store.write(group(7, [0.0]), "keep")
    store.close()
    index = EpisodeFile(tmp_path).refresh()
    assert [s.prompt_index for s, _, _ in index.rows][-1] == 7 and len(index.rows) == 9
    assert len(index.warnings) == 1 and "unreadable record" in index.warnings[0]


def test_a_write_error_is_logged_once_and_the_run_goes_on(tmp_path, capfd):
    store = EpisodeStore(tmp_path / "run", "demo", fresh=True)
    store.close()
    (tmp_path / "run" / FILE).unlink()
    (tmp_path / "run" / FILE).mkdir()           # the writer cannot open its file
    store = EpisodeStore(tmp_path / "run", "demo")
    for p in range(3):
        store.write(group(p, [0.0]), "keep")    # never raises
    store.close()
    assert capfd.readouterr().out.count("ERROR [episodes]") == 1 and store.failed


def episodes_cli(*args) -> subprocess.CompletedProcess:
    return subprocess.run([*MILES, "episodes", *map(str, args)], capture_output=True, text=True,
                          timeout=60, cwd=ROOT)


def test_miles_episodes_prints_transcripts_and_filters_combine(tmp_path):
    write_run(tmp_path)
    out = episodes_cli(tmp_path, "--step", 1, "--reward", 0)
    assert out.returncode == 0, out.stderr
    heads = [line for line in out.stdout.splitlines() if line.startswith("== episode")]
    # step 1: prompt 0 (trained) and prompt 1 (dropped, generated for step 1); reward 0: one of each
    assert [h.split()[2] for h in heads] == ["p0-a0-1", "p1-a0-0", "p1-a0-1"], out.stdout
    assert "[tool read_file] 101" in out.stdout and '-> submit({"answer": "123"})' in out.stdout
    assert "buffer drop: buffer.filter nonzero_std" in out.stdout
    assert "sandbox sbx-1-0" in out.stdout and "policy version 1" in out.stdout
    assert "tokens: prompt 18, response 12 (12 trained)" in out.stdout
    out = episodes_cli(tmp_path, "--task", "find-3", "-n", 1)
    assert out.returncode == 0 and "reason: reward: ValueError: task row 3 is malformed" in out.stdout
    assert out.stdout.count("== episode") == 1 and "step 2 (trained)" in out.stdout
    out = episodes_cli(tmp_path, "--reward", ">0", "--json", "-n", 0)
    got = [json.loads(line) for line in out.stdout.splitlines()]
    # a dict reward without train.reward_key has no score
    assert [(e["task"], e["index"]) for e in got] == [("find-0", 0)]
    assert got[0]["messages"][2] == {"role": "tool", "content": "100", "tool_call_id": "call_0",
                                     "name": "read_file"}


def test_miles_episodes_bad_input_is_one_line_and_exit_2(tmp_path):
    write_run(tmp_path)
    for args, needle in [((tmp_path / "nosuch",), "no such run directory"),
                         ((tmp_path, "--step", "x"), "--step 'x': expected a step number"),
                         ((tmp_path, "--reward", "lots"), "--reward 'lots': expected a number"),
                         ((tmp_path, "-n", "-3"), "-n '-3': expected a count")]:
        out = episodes_cli(*args)
        assert out.returncode == 2 and needle in out.stderr, (args, out.stderr)
        assert len(out.stderr.strip().splitlines()) == 1
    (tmp_path / "empty").mkdir()
    out = episodes_cli(tmp_path / "empty")
    assert out.returncode == 2 and "no episodes.jsonl" in out.stderr
    out = episodes_cli(tmp_path, "--task", "nosuch")
    assert out.returncode == 1 and "no episode of 8" in out.stderr


def test_the_episode_browser_lists_filters_and_opens_episodes_in_chromium(tmp_path):
    run = tmp_path / "run"
    (run / "logs").mkdir(parents=True)
    write_run(run)
    port = free_port()
    dash = subprocess.Popen([*MILES, "dashboard", str(run), "--port", str(port)], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while True:
            try:
                urllib.request.urlopen(base + "/api/episodes", timeout=2).read()
                break
            except OSError:
                assert time.monotonic() < deadline, "miles dashboard did not answer within 60 s"
                time.sleep(0.3)
        dom, _ = render(base + "/episodes?reward=0", tmp_path)
        assert 'data-rendered="3"' in dom, dom[:3000]      # the three zero-reward episodes, listed
        assert dom.count('class="episode') == 3 and "find-1" in dom and "find-3" not in dom
        key = "p3-a0-1/1"
        dom, _ = render(f"{base}/episodes?task=find-3#{urllib.request.quote(key, safe='')}", tmp_path)
        assert f'data-opened="{key}"' in dom, dom[:3000]
        import re
        turns = re.findall(r'class="turn (\w+)"', dom)
        assert turns == ["user", "assistant", "tool", "assistant"], turns
        assert "→ read_file" in dom and "k3.txt" in dom
        assert 'class="reason"' in dom and "task row 3 is malformed" in dom   # the failure's reason
        with pytest.raises(urllib.error.HTTPError) as bad:   # a bad filter: 400 and one line
            urllib.request.urlopen(base + "/api/episodes?step=x", timeout=10)
        assert bad.value.code == 400
        assert json.loads(bad.value.read()) == {"error": "step 'x': expected a step number"}
    finally:
        import os
        os.killpg(dash.pid, 9)
        dash.wait()


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_real_agent_run_keeps_its_episodes_for_the_cli_and_the_browser(tmp_path):
    """The agent quickstart, one step from the random-weight model: every episode the rollout
    worker put is in episodes.jsonl with the agent's messages, its sandbox and session, and the
    step that trained it; `miles episodes` and the browser read them."""
    import os
    out = tmp_path / "aq"
    sets = [f"run.output_dir={json.dumps(str(out))}", "run.name=\"aq\"", "logging.progress=false",
            f"cluster.head_port={cluster_port()}", "sft.steps=0", "loop.num_steps=1",
            "loop.groups_per_step=2", "rollout.n_samples_per_prompt=2", "eval.mode=\"off\"",
            "buffer.filter=\"none\"", "agent.max_turns=2", "logging.plot=false"]
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SLURM_", "MILES_", "NODE_RANK", "NNODES"))}
    proc = subprocess.run([*MILES, "run", str(ROOT / "recipes" / "agent_quickstart.toml"),
                           *[a for kv in sets for a in ("--set", kv)]], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=540)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    cli = episodes_cli(out, "--json", "-n", 0)
    assert cli.returncode == 0, cli.stderr
    got = [json.loads(line) for line in cli.stdout.splitlines()]
    trained = json.loads(next(line for line in (out / "metrics.jsonl").read_text().splitlines()
                              if '"kind": "train"' in line))["batch/prompt_indices"]
    assert len(got) >= 4 and {e["prompt_index"] for e in got if e["trained"]} == set(trained)
    assert all(e["step"] == 1 for e in got if e["trained"])
    for e in got:
        assert e["run"] == "aq" and e["decision"] == "keep" and e["versions"], e
        assert e["messages"][0]["role"] == "user" and e["messages"][1]["role"] == "assistant"
        assert e["messages"][0]["content"] and e["sandbox_id"] and e["session_id"]
        assert e["response_tokens"] > 0 and e["status"] in ("completed", "truncated")
    text = episodes_cli(out, "--step", 1, "-n", 0)
    assert text.returncode == 0 and "step 1 (trained)" in text.stdout and "[user] " in text.stdout
    port = free_port()
    dash = subprocess.Popen([*MILES, "dashboard", str(out), "--port", str(port)], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while True:
            try:
                urllib.request.urlopen(base + "/api/episodes", timeout=2).read()
                break
            except OSError:
                assert time.monotonic() < deadline, "miles dashboard did not answer within 60 s"
                time.sleep(0.3)
        key = got[0]["key"]
        dom, _ = render(f"{base}/episodes#{urllib.request.quote(key, safe='')}", tmp_path)
        assert f'data-rendered="{len(got)}"' in dom and f'data-opened="{key}"' in dom, dom[:3000]
        assert dom.count('class="episode') == len(got)
        import re
        assert re.findall(r'class="turn (\w+)"', dom)[:2] == ["user", "assistant"]
        assert got[0]["sandbox_id"] in dom
    finally:
        os.killpg(dash.pid, 9)
        dash.wait()
