"""OpenTelemetry spans of an RL run (`logging.otel`), through the real opentelemetry SDK.

    driver:   miles.step  (one trace per RL step)
                ├─ miles.train
                ├─ miles.weights.publish
                └─ miles.eval
    rollout:  miles.episode  (one trace per episode, i.e. per sample)
                ├─ miles.turn        (one per message of its transcript)
                └─ miles.tool_call   (one per tool call of an assistant turn)

Design decisions:
- Off by default, and then free: `telemetry(recipe, service)` returns `NOOP`, whose methods
  return at once, and nothing imports opentelemetry (a test asserts it is not in sys.modules).
- Spans are recorded when their work is over, with the start and end times measured by the code
  that did the work (the provenance record's timestamps for an episode): the hot path carries no
  span objects, and an episode's span holds its provenance whole. The turns of an episode have
  no clock of their own in the transcript; their spans cover the episode's generation window in
  equal parts and carry their role, index and tool-call count.
- Every attribute is under `miles.*` (docs/provenance.md lists them). Sample ids, policy
  version, engine, weight digest on the episode; the ids of the samples a step trained on the
  step (`miles.step.sample_ids`), so a trained sample's lineage joins across the two traces.
- Sampling: `logging.otel_sample_rate` is the SDK's TraceIdRatioBased sampler on the root spans
  (a step, an episode); children follow their root.
- Export is the SDK's BatchSpanProcessor (a thread, never the event loop): "console" prints
  spans, "file" writes one JSON object per line to `<output_dir>/otel_spans.jsonl`, a URL is an
  OTLP/HTTP collector (spans to `<url>/v1/traces`). `close()` flushes.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

SPAN_FILE = "otel_spans.jsonl"


class _Noop:
    enabled = False

    def span(self, name: str, start_s: float, end_s: float, attrs: dict[str, Any] | None = None,
             parent=None):
        return None

    def episode(self, sample) -> None:
        return None

    def close(self) -> None:
        return None


NOOP = _Noop()


def telemetry(recipe, service: str):
    """The process's span recorder: `NOOP` when `logging.otel` is "none"."""
    cfg = recipe.logging
    if cfg.otel == "none":
        return NOOP
    return Telemetry(cfg.otel, service, sample_rate=cfg.otel_sample_rate,
                     run=recipe.run.name, output_dir=recipe.output_dir)


def _attr(v: Any):
    if isinstance(v, (bool, int, float, str)):
        return v
    if isinstance(v, (list, tuple)) and all(isinstance(x, (int, float, str, bool)) for x in v):
        return list(v)
    return str(v)


class Telemetry:
    enabled = True

    def __init__(self, target: str, service: str, *, sample_rate: float = 1.0, run: str = "",
                 output_dir: str | Path = ".", schedule_delay_ms: int = 1000):
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased

        if target == "console":
            from opentelemetry.sdk.trace.export import ConsoleSpanExporter
            exporter = ConsoleSpanExporter()
        elif target == "file":
            exporter = _file_exporter(Path(output_dir) / SPAN_FILE)
        else:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
            exporter = OTLPSpanExporter(endpoint=target.rstrip("/") + "/v1/traces")
        self.provider = TracerProvider(
            resource=Resource.create({"service.name": f"miles.{service}", "miles.run": run}),
            sampler=ParentBased(TraceIdRatioBased(sample_rate)))
        self.provider.add_span_processor(BatchSpanProcessor(exporter, schedule_delay_millis=schedule_delay_ms))
        self.tracer = self.provider.get_tracer("miles")
        from opentelemetry import trace as _trace
        self._set_span_in_context = _trace.set_span_in_context

    def span(self, name: str, start_s: float, end_s: float, attrs: dict[str, Any] | None = None,
             parent=None):
        """Record one finished span (unix-second times); returns it, to parent others."""
        ctx = self._set_span_in_context(parent) if parent is not None else None
        span = self.tracer.start_span(name, context=ctx, start_time=int(start_s * 1e9),
                                      attributes={k: _attr(v) for k, v in (attrs or {}).items()})
        span.end(end_time=int(max(end_s, start_s) * 1e9))
        return span

    def episode(self, sample) -> None:
        """An episode's span from its provenance, with one child per turn and per tool call."""
        p = sample.provenance
        if p is None:
            return
        attrs = {"miles.sample.id": f"{sample.rollout_id}/{sample.index}",
                 "miles.sample.group_id": sample.group_id,
                 "miles.sample.prompt_index": int(sample.metadata.get("prompt_index", -1)),
                 "miles.sample.status": str(sample.status),
                 "miles.sample.response_tokens": sample.response_length,
                 "miles.policy_version": p.policy_version, "miles.versions": p.versions,
                 "miles.engine.id": p.engine_id, "miles.engine.incarnation": p.engine_incarnation,
                 "miles.weights.digest": p.weight_digest, "miles.quant.format": p.quant_format,
                 "miles.routing.digest": p.routing_digest, "miles.session.id": p.session_id,
                 "miles.sandbox.id": p.sandbox_id, "miles.sandbox.image_digest": p.image_digest,
                 "miles.env.name": p.env_name, "miles.env.version": p.env_version,
                 "miles.verifier.name": p.verifier_name, "miles.verifier.version": p.verifier_version,
                 "miles.queued_at": p.queued_at}
        attrs.update({f"miles.sampling.{k}": v for k, v in p.sampling.items()})
        attrs.update({f"miles.reward.{k}": v for k, v in p.reward_components.items()})
        root = self.span("miles.episode", p.queued_at, p.finished_at,
                         {k: v for k, v in attrs.items() if v not in ("", [])})
        turns = _turns(sample)
        if not turns:
            return
        width = (p.finished_at - p.started_at) / len(turns)
        for i, (role, calls) in enumerate(turns):
            t0 = p.started_at + i * width
            turn = self.span("miles.turn", t0, t0 + width, {"miles.turn.index": i, "miles.turn.role": role,
                                                            "miles.turn.tool_calls": len(calls)}, parent=root)
            for name in calls:
                self.span("miles.tool_call", t0, t0 + width, {"miles.tool.name": name,
                                                              "miles.turn.index": i}, parent=turn)

    def close(self) -> None:
        self.provider.force_flush(10_000)
        self.provider.shutdown()


def step_spans(t: "Telemetry", step: int, version: int, samples: list, start_s: float, train_s: float,
               publish_at_s: float, times: dict[str, float], transport: str, provenance=None) -> None:
    """The driver's spans of one RL step: the step, its train and its weight publish (offsets in
    seconds from `start_s`, the step's wall-clock start)."""
    root = t.span("miles.step", start_s, time.time(), {
        "miles.step": step, "miles.policy_version": version, "miles.step.samples": len(samples),
        "miles.step.sample_ids": [f"{s.rollout_id}/{s.index}" for s in samples]})
    t.span("miles.train", start_s, start_s + train_s, {"miles.step": step}, parent=root)
    t0 = start_s + publish_at_s
    t.span("miles.weights.publish", t0, t0 + times.get("perf/publish_s", 0.0), {
        "miles.policy_version": version, "miles.weights.transport": transport,
        "miles.weights.stall_s": times.get("weights/stall_s", 0.0),
        "miles.weights.digest": provenance.digests.get(version, "") if provenance is not None else ""},
        parent=root)


def _turns(sample) -> list[tuple[str, list[str]]]:
    """(role, tool names) per message of the episode's transcript (the one-call path: one
    assistant turn)."""
    agent = sample.metadata.get("agent")
    messages = agent.get("messages") if isinstance(agent, dict) else None
    messages = messages or sample.metadata.get("messages")
    if not isinstance(messages, list) or not messages:
        return [("assistant", [])]
    out = []
    for m in messages:
        if not isinstance(m, dict):
            continue
        calls = [str((c.get("function") or {}).get("name", "")) for c in m.get("tool_calls") or []
                 if isinstance(c, dict)]
        out.append((str(m.get("role", "?")), calls))
    return out


def _file_exporter(path: Path):
    from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

    class JsonLinesExporter(SpanExporter):
        """One span per line (the SDK's own JSON form, made one line)."""

        def __init__(self) -> None:
            path.parent.mkdir(parents=True, exist_ok=True)
            self._f = open(path, "a", encoding="utf-8")

        def export(self, spans) -> SpanExportResult:
            import json
            for s in spans:
                self._f.write(json.dumps(json.loads(s.to_json())) + "\n")
            self._f.flush()
            return SpanExportResult.SUCCESS

        def shutdown(self) -> None:
            self._f.close()

    return JsonLinesExporter()
