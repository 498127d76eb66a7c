"""Sample provenance (issue 40, item 1): the record, the journal that keeps it (with its format
number), the driver's lineage files and the digest-mismatch check."""

import json

import numpy as np
import pytest

from miles.actors.buffer import JOURNAL_FORMAT, Buffer
from miles.config import load_recipe
from miles.engines.sampling_params import sampling_params
from miles.rl.provenance import (LineageRow, ProvenanceLog, Stamper, VersionRow, as_dict, note_engine,
                                 read_jsonl)
from miles.wire.codec import Codec
from miles.wire.journal import Journal, JournalFormatError
from miles.wire.messages import (GetBatch, Group, NoteRolloutStart, Provenance, PutGroup, Reserve,
                                 Sample, VersionSpan)

from tests.rl.test_buffer_journal import ROOT


def sample(i=0, versions=(3,), reward=1.0, **meta):
    return Sample(tokens=np.arange(6, dtype=np.int32), response_length=2, reward=reward,
                  status="completed", weight_versions=[VersionSpan(v, 0, 2) for v in versions],
                  rollout_logprobs=np.array([-0.5, -0.25], np.float32), group_id="g", index=i,
                  rollout_id=f"g-{i}", metadata={"prompt_index": 7, **meta})


def stamped(**kw):
    recipe = load_recipe(ROOT / "recipes" / "quickstart.toml")
    s = sample(**kw)
    note_engine(s, {"engine_id": "127.0.0.1:30001", "engine_incarnation": 4242})
    Stamper(recipe).stamp(s, sampling_params(recipe.rollout, 11), queued_at=100.0, started_at=101.0)
    return s


def test_a_stamp_holds_every_field_the_issue_lists():
    s = stamped(versions=(3, 4), reward={"correct": 1.0, "format": 0.5}, session_id="sess-1",
                sandbox_id="sb-9", sandbox_image="python:3.11@sha256:abc")
    p = s.provenance
    assert (p.policy_version, p.versions) == (3, [3, 4])          # in-place: both versions
    assert (p.engine_id, p.engine_incarnation) == ("127.0.0.1:30001", 4242)
    assert p.sampling == {"temperature": 1.0, "top_p": 1.0, "top_k": -1.0, "max_new_tokens": 6.0,
                          "seed": 11.0}
    assert p.quant_format == "float32"   # unquantized: the engines' dtype
    assert (p.session_id, p.sandbox_id, p.image_digest) == ("sess-1", "sb-9", "sha256:abc")
    assert (p.env_name, p.verifier_name) == ("single_turn", "first_answer")
    assert p.reward_components == {"correct": 1.0, "format": 0.5}
    assert p.queued_at == 100.0 and p.started_at == 101.0 and p.finished_at >= 101.0
    assert p.trained_step == -1 and p.routing_digest == ""
    # R3: the routing digest is a hash of what the sample carries
    r = sample()
    r.routed_experts = np.ones((5, 2, 2), np.uint8)
    Stamper(load_recipe(ROOT / "recipes" / "quickstart.toml")).stamp(
        r, sampling_params(load_recipe(ROOT / "recipes" / "quickstart.toml").rollout, 1),
        queued_at=0.0, started_at=0.0)
    assert len(r.provenance.routing_digest) == 16


def test_the_record_is_compact_and_round_trips_the_wire():
    codec = Codec()
    plain, with_p = sample(), stamped()
    size = lambda m: sum(len(f) if isinstance(f, bytes) else f.nbytes for f in codec.encode("tell", m))
    extra = size(with_p) - size(plain)
    assert 0 < extra < 400, extra   # bench/provenance.py reports the figure
    back = codec.decode(codec.encode("tell", with_p))[1]
    assert back.provenance == with_p.provenance


async def test_the_buffer_journal_keeps_provenance_and_says_its_format(tmp_path):
    path = tmp_path / "journal.bin"
    a = Buffer()
    a.configure(groups_per_step=1, max_staleness=2, filter_spec="none")
    a.open_journal(path, restore=False)
    a.on_note_rollout_start(NoteRolloutStart(data_state={"position": 0}, owner=0))
    await a.on_reserve(Reserve(prompt_index=7, request_id="0-1", owner=0, timeout_s=5))
    s = stamped()
    await a.on_put_group(PutGroup(group=Group(group_id="g", samples=[s], prompt_index=7), slot=0, owner=0))
    b = Buffer()
    b.configure(groups_per_step=1, max_staleness=2, filter_spec="none")
    b.open_journal(path, restore=True)
    assert b.journal.format == JOURNAL_FORMAT == 2
    out = await b.on_get_batch(GetBatch(n_groups=1, request_id="s1"))
    assert out.groups[0].samples[0].provenance == s.provenance


def test_an_old_journal_without_a_header_reads_as_format_1_and_a_newer_one_is_refused(tmp_path):
    old = tmp_path / "old.bin"
    plain = Journal(old)                           # writes no header: what format 1 looked like
    plain.append(PutGroup(group=Group(group_id="g", samples=[sample()]), slot=0))
    plain.close()
    j = Journal(old, "buffer", JOURNAL_FORMAT)
    [rec] = j.read()
    assert j.format == 1 and rec.group.samples[0].provenance is None
    newer = tmp_path / "newer.bin"
    w = Journal(newer, "buffer", JOURNAL_FORMAT + 1)
    w.append(PutGroup(group=Group(group_id="g", samples=[sample()]), slot=0))
    w.close()
    assert isinstance(Journal(newer).read()[0], PutGroup)   # a plain reader reads any
    with pytest.raises(JournalFormatError, match=r"newer.bin: a 'buffer' journal of format 3; "
                                                 r"this Miles reads 'buffer' journals of format <= 2"):
        Journal(newer, "buffer", JOURNAL_FORMAT).read()


def test_the_driver_log_sets_the_trained_step_and_flags_a_digest_mismatch(tmp_path):
    log = ProvenanceLog(tmp_path, fresh=True)
    log.version(VersionRow(version=3, step=2, time=1.0, digest="aaa",
                           engine_digests={"http://127.0.0.1:30001": "aaa", "http://127.0.0.1:30002": "bbb"}))
    good = stamped()
    bad = stamped(i=1)
    bad.provenance.engine_id = "127.0.0.1:30002"
    metrics = log.write(5, [good, bad, sample(i=2)])   # the third: provenance off upstream
    assert metrics == {"provenance/digest_mismatch": 1.0, "provenance/samples": 2.0}
    rows = read_jsonl(tmp_path / "provenance.jsonl", LineageRow)
    assert [r.step for r in rows] == [5, 5, 5] and rows[2].provenance == {}
    rec = rows[0].record()
    assert (rec.trained_step, rec.weight_digest, rec.engine_id) == (5, "aaa", "127.0.0.1:30001")
    assert json.loads((tmp_path / "provenance.jsonl").read_text().splitlines()[0])["provenance"]["policy_version"] == 3
    assert as_dict(Provenance()) == {}
    # a resumed job appends; a fresh one starts over
    assert len(read_jsonl(ProvenanceLog(tmp_path, fresh=False).path, LineageRow)) == 3
    assert not ProvenanceLog(tmp_path, fresh=True).path.exists()


def test_provenance_off_and_a_bad_otel_value_are_recipe_keys():
    r = load_recipe(ROOT / "recipes" / "quickstart.toml", overrides=["logging.provenance=false"])
    assert r.logging.provenance is False and r.logging.otel == "none"
    with pytest.raises(ValueError, match="logging.otel: 'jaeger' is not none, console, file"):
        load_recipe(ROOT / "recipes" / "quickstart.toml", overrides=['logging.otel="jaeger"'])


def test_miles_trace_prints_the_lineage_and_flags_a_mismatch(tmp_path, capsys):
    import msgspec
    from miles.episodes import EpisodeRecord, ToolCall, Turn
    from miles.trace import main as trace

    log = ProvenanceLog(tmp_path, fresh=True)
    log.version(VersionRow(version=3, step=2, time=1.0, digest="a" * 64,
                           engine_digests={"http://127.0.0.1:30001": "a" * 64,
                                           "http://127.0.0.1:30002": "b" * 64}))
    good, bad = stamped(), stamped(i=1)
    bad.provenance.engine_id = "127.0.0.1:30002"
    log.write(4, [good, bad])
    ep = EpisodeRecord(run="t", time=1.0, task="t", prompt_index=7, group_id="g", rollout_id="g-0",
                       index=0, status="completed", messages=[
                           Turn(role="user", content="sort 382 ="),
                           Turn(role="assistant", content="", tool_calls=[
                               ToolCall(name="bash", arguments="ls")]),
                           Turn(role="assistant", content="238")])
    (tmp_path / "episodes.jsonl").write_bytes(msgspec.json.encode(ep) + b"\n")

    assert trace([str(tmp_path), "--sample", "g-0/0"]) == 0
    out = capsys.readouterr().out
    for want in ("prompt     7: 'sort 382 ='", "engine     127.0.0.1:30001 (pid 4242), policy version 3",
                 "weights    digest aaaaaaaaaaaaaaaa", "seed=11", "verifier first_answer",
                 "tool calls 1", "-> bash(ls)", "'238'", "trained    at step 4"):
        assert want in out, (want, out)
    assert trace([str(tmp_path), "--step", "4"]) == 3      # one of the two is a mismatch
    cap = capsys.readouterr()
    assert "MISMATCH: engine 127.0.0.1:30002 held weights bbbbbbbbbbbb for version 3, the publisher " \
           "sent aaaaaaaaaaaa" in cap.out and "1 of 2 samples" in cap.err
    assert "(not in episodes.jsonl" in cap.out                # g-1 has no transcript
    assert trace([str(tmp_path), "--prompt", "7", "--json"]) == 3
    rows = [json.loads(l) for l in capsys.readouterr().out.splitlines()]
    assert [r["sample"] for r in rows] == ["g-0/0", "g-1/1"] and rows[1]["mismatch"].startswith("MISMATCH")
    assert trace([str(tmp_path), "--step", "9"]) == 1
    assert "no trained sample matches --step 9 (2 trained samples" in capsys.readouterr().err
    assert trace([str(tmp_path / "nope"), "--step", "1"]) == 2
