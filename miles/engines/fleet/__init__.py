"""EngineFleet: launches the rollout engines and the smg gateway in front of them, and keeps them up.

Design decisions:
- One actor owns the fleet of a node: N engines (embedded or real SGLang, `engine.kind`) and the
  gateway. Everyone else asks it `GetEngines` for the gateway URL (generation) and the engine
  URLs (control: pause, weight updates go to each engine directly).
- An engine that does not start is retried, at job start too: each engine gets 1 +
  `engine.max_restarts` tries (backoff between them, `miles.supervise.RestartBudget`). The fleet
  serves once one engine of its node is up; the others keep being tried in the background and
  join as pending. Only when no engine came up after its tries (a bad model path, a wrong flag)
  is the start the fleet's end: every `GetEngines` waiter gets that error at once (it names the
  process, its command and its log's last lines), the error is logged once to the console, and
  `run()` returns 1 so the host process exits non-zero and the node daemon ends the job. smg or
  the session server that does not start ends the fleet the same way.
- Engines and the gateway are health-checked every `engine.health_interval_s`. A dead engine is
  removed from the gateway at once (its requests fail fast, new ones go to the others) and
  relaunched on a fresh port. The restarted engine is listed in `EngineSet.pending_urls`: it has
  the model's initial weights, so it takes no traffic until the driver has published the current
  version to it and says `EnginesUpdated`; only then, and only if it reports that version (else
  it is restarted), is it added to the gateway.
- `generation` is bumped when an engine joins (becomes pending), because that is what needs a
  publish. A death does not bump it: the trainer drops an engine that does not answer, the next
  `GetEngines` leaves it out, and an empty set must not read as "publish now". Moving an engine
  from pending to serving does not bump it either (nothing to publish).
- Engine restarts (a death before `/health` is one more failed start: a restart, never fatal)
  are rate-limited, never given up: at most `engine.max_restarts` within any
  `engine.restart_window_s`, the n-th of a window after `backoff_s * 2**n` (the fleet role's
  `[actors.engines] restart.backoff_s` / `backoff_max_s`); with the window full the next try
  waits until the oldest restart ages out. Meanwhile the fleet runs degraded and logs how many
  engines serve. When no engine is up (serving or pending) for `engine.no_engine_timeout_s`,
  the fleet ends the job with one line: the last cause and how many restarts were tried.
- The fleet actor itself is restarted by the node daemon (a new incarnation; callers' retries
  reach it). Its engine servers die with it (PDEATHSIG), so the new incarnation does not adopt
  them: it reads `<output_dir>/engines/<name>.json` (the gateway's and session server's ports,
  the generation and the version, written on every change), starts smg and the session server
  on the same ports (every client's URL stays valid; the session token file is kept) and new
  engines as pending under a generation past every earlier one, so the driver publishes the
  current weights to them. Only an incarnation > 0 reads that file (a new job starts afresh).
- The gateway is restarted on its own port (every client's gateway URL stays valid) in front of
  the serving engines, under the same crash-loop rule. If it cannot come back (the port cannot be
  re-bound, smg crash-loops) the fleet fails loudly.
- The engines' logs go to files in the run directory (they are chatty); failures quote their tail.
- The TITO session server (`[session]`, on when `session.enabled = "on"`, or "auto" with
  `rollout.agent` set) starts after the gateway, in front of it, on its own port, with a per-job
  token in `<output_dir>/session.token` (0600; only the path is on its command line). `GetEngines`
  carries its URL and the token file. It is probed every health interval (`/health`; failing
  every probe for `SESSION_WEDGED_S` counts as a death) and restarted on its own port under the
  same crash-loop rule as the gateway; if it cannot come back the fleet fails loudly. A restarted server has lost its
  open sessions (the rollout side sees 404 on collect and counts a failed episode).
- With the session server on, smg must pin a session's routing key (`X-SMG-Routing-Key`) to one
  engine so its KV prefix is reused: the `manual` policy (a new key goes to the least loaded
  engine) and `consistent_hashing` do; any other `engine.gateway_policy` is replaced by `manual`,
  with a warning. smg's `--routing-key-override` must stay off: it makes the body `rid` win over
  the header, and TITO's rids differ per turn.
- Fleet metrics (prefix-cache hit rate of the engines, open sessions, requests served per engine
  and per node) are polled once per health interval by a task of their own; `metrics()` returns
  the last values and never waits on HTTP.
- Several nodes (`[actors.engines] nodes = [..]`, `per_node = true`): one fleet per node; the first
  node's owns the gateway and the session server and lists every node's engines, the others only
  launch, supervise and report theirs (`nodes.py` has the protocol).
  `engine.num_engines` is per node. A one-node fleet runs none of that code.

Files: `fleet.py` (the actor: start, `GetEngines`, `EnginesUpdated`), `watch.py` (health checks,
restarts), `metrics.py`, `slots.py`, `nodes.py` (several nodes), `teacher.py` (the teacher's fleet).
"""

from miles.engines.fleet.fleet import EngineFleet
from miles.engines.fleet.nodes import FleetError
from miles.engines.fleet.teacher import TeacherFleet

__all__ = ["EngineFleet", "FleetError", "TeacherFleet"]
