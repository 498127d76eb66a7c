"""The RL loop on two node daemons on loopback, started as `srun launch/miles.sh` starts them:
trainer ranks in one gloo group over both nodes, one engine fleet per node, the gateway on the
head. The agent quickstart on the same layout: the gateway and the TITO session server run under
the head's daemon, and the agent's turns reach node 1's engine through them. Then losing a node:
kill -9 of node 1's daemon stops the job with a named error and no orphans, and the same command
resumes from the newest checkpoint; kill -9 of the head stops node 1 within
`cluster.node_timeout_s` (the demo actors' cases below, on two and three nodes: the rule is the
node daemon's, whatever actors it runs)."""

import json
import os
import signal
import time
from pathlib import Path

import psutil
import pytest

ROOT = Path(__file__).resolve().parents[2]
RECIPE = ROOT / "recipes" / "quickstart_2node.toml"
NODE_TIMEOUT_S = 10.0


def _common(tmp_path, name):
    return [f"run.output_dir={json.dumps(str(tmp_path / name))}", "logging.progress=false",
            f"cluster.node_timeout_s={NODE_TIMEOUT_S}"]


def _records(out: Path, kind: str) -> list[dict]:
    path = out / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if f'"kind": "{kind}"' in line]


def _actors_of(pid: int) -> dict[str, int]:
    """Actor name -> pid of the actor processes a daemon started."""
    found = {}
    try:
        children = psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return found
    for child in children:
        try:
            name = child.environ().get("MILES_ACTOR_NAME")
        except psutil.Error:
            continue
        if name:
            found[name] = child.pid
    return found


def _tree(pid: int) -> set[int]:
    try:
        return {c.pid for c in psutil.Process(pid).children(recursive=True)}
    except psutil.NoSuchProcess:
        return set()


def _wait(procs, timeout_s: float, what: str) -> list[int]:
    deadline = time.monotonic() + timeout_s
    for p in procs:
        left = deadline - time.monotonic()
        try:
            p.wait(max(0.1, left))
        except Exception:
            raise AssertionError(f"{what}: daemon pid {p.pid} still running after {timeout_s}s") from None
    return [p.returncode for p in procs]


def _until(cond, timeout_s: float, what: str, procs=()):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if cond():
            return
        if any(p.poll() is not None for p in procs):
            raise AssertionError(f"a daemon exited while waiting for {what}")
        time.sleep(0.2)
    raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")


def _alive(pids) -> list[int]:
    out = []
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                out.append(pid)
        except psutil.NoSuchProcess:
            pass
    return out


@pytest.mark.slow
@pytest.mark.timeout(720)   # its own waits: 120 s to placement + 540 s for the run
def test_two_node_quickstart_learns_with_ranks_and_engines_on_both_nodes(tmp_path, cluster_launcher):
    out = tmp_path / "qs2"
    procs, logs = cluster_launcher(RECIPE, 2, [*_common(tmp_path, "qs2"), "loop.num_steps=60",
                                               "loop.eval_every=20", "loop.save_every=0"])
    placed: list[dict[str, int]] = [{}, {}]

    def both_placed() -> bool:
        for rank, p in enumerate(procs):
            placed[rank].update(_actors_of(p.pid))
        return "trainer/1" in placed[1] and "engines@1" in placed[1] and "trainer/0" in placed[0]

    _until(both_placed, 120, "trainer/0 on node 0, trainer/1 and engines@1 on node 1", procs)
    started = time.monotonic()
    codes = _wait(procs, 540, "the 2-node quickstart")
    text = logs[0].read_text() + logs[1].read_text()
    assert codes == [0, 0], text[-4000:]
    # ranks 0 and 1 ran under different daemons; the gateway, session and driver on the head
    assert {"trainer/0", "engines", "driver", "rollout"} <= set(placed[0]), placed
    assert {"trainer/1", "engines@1"} <= set(placed[1]) and "trainer/1" not in placed[0], placed
    evals = _records(out, "eval")
    assert [e["step"] for e in evals] == [0, 20, 40, 60]
    assert max(e["eval/reward"] for e in evals[-2:]) >= evals[0]["eval/reward"] + 0.1, evals
    train = _records(out, "train")
    assert [r["step"] for r in train] == list(range(1, 61))
    assert all(r["version"] == r["step"] + 1 for r in train)
    # both nodes' engines served generations, and every publish reached both of them
    # counters are cumulative; the last record may precede the final poll, so take each's maximum
    records = _records(out, "actors")
    fleet = {k: max(r.get(k, 0.0) for r in records) for k in set().union(*records)
             if all(isinstance(r.get(k, 0.0), (int, float)) for r in records)}
    assert fleet["engines/alive"] == 2.0, fleet
    assert fleet["engines/node0/requests_total"] > 0 and fleet["engines/node1/requests_total"] > 0, fleet
    last = train[-1]["version"]
    for node in (0, 1):
        engine_log = (out / "logs" / f"engine0.node{node}.log").read_text()
        assert f"weight version {last}:" in engine_log, engine_log[-2000:]
    print(f"2-node quickstart: held-out {evals[0]['eval/reward']:.3f} -> "
          f"{[e['eval/reward'] for e in evals[1:]]}, {time.monotonic() - started:.0f} s after placement")


@pytest.mark.slow
@pytest.mark.timeout(660)   # its own waits: 240 + 30 + 30 + 5 s to the loss, 300 s for the resume
def test_losing_a_node_stops_the_job_named_and_the_same_command_resumes(tmp_path, cluster_launcher):
    out = tmp_path / "lost"
    overrides = [*_common(tmp_path, "lost"), "loop.num_steps=8", "loop.save_every=2",
                 "loop.eval_every=0", 'eval.mode="off"']
    procs, logs = cluster_launcher(RECIPE, 2, overrides)
    ckpt = out / "checkpoints" / "step_000002" / "loop_state.json"
    _until(ckpt.exists, 240, f"the first checkpoint ({ckpt})", procs)
    _until(lambda: "trainer/1" in _actors_of(procs[1].pid) and "engines@1" in _actors_of(procs[1].pid),
           30, "node 1's actors", procs)
    pids = _tree(procs[0].pid) | _tree(procs[1].pid)
    killed = time.monotonic()
    os.kill(procs[1].pid, signal.SIGKILL)
    grace_s = 10.0  # cluster.shutdown_grace_s: the head's own actors are stopped in order
    code = _wait(procs[:1], NODE_TIMEOUT_S + grace_s + 10, "the head after node 1 was lost")[0]
    took = time.monotonic() - killed
    procs[1].wait(5)
    head_log = logs[0].read_text()
    assert code != 0, head_log[-3000:]
    lost = [line for line in head_log.splitlines() if "shutting down: node 1 lost:" in line]
    assert lost, head_log[-3000:]
    assert "its actors: engines@1, trainer/1" in lost[0] and "run the same command again to resume" in lost[0]
    assert "checkpoint " in lost[0] and "/checkpoints/step_" in lost[0], lost[0]
    time.sleep(1.0)
    assert _alive(pids) == [], "orphans after losing node 1"
    print(f"node 1 lost: the head exited {took:.1f} s after the kill ({lost[0].split('; its')[0]})")

    procs, logs = cluster_launcher(RECIPE, 2, overrides)  # the same command again, on both nodes
    codes = _wait(procs, 300, "the resumed 2-node run")
    head_log = logs[0].read_text()
    assert codes == [0, 0], head_log[-3000:]
    assert any("resumed from" in line and "/checkpoints/step_" in line for line in head_log.splitlines())
    steps = [r["step"] for r in _records(out, "train")]
    assert steps[-1] == 8 and steps.count(1) == 1, steps  # continued, not started over


def _engine_pids(daemon_pid: int) -> list[int]:
    out = []
    try:
        children = psutil.Process(daemon_pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return out
    for child in children:
        try:
            if "miles.engines.embedded" in child.cmdline():
                out.append(child.pid)
        except psutil.Error:
            continue
    return out


@pytest.mark.slow
@pytest.mark.timeout(600)   # its own waits: 240 s to the kill + 300 s for the run
def test_an_engine_killed_on_node_1_is_restarted_there_and_rejoins_after_a_publish(tmp_path, cluster_launcher):
    """Node 1's fleet restarts its engine and reports it; the head's fleet holds it pending until
    the driver has published the current weights to it, then it serves again."""
    out = tmp_path / "eng"
    procs, logs = cluster_launcher(RECIPE, 2, [*_common(tmp_path, "eng"), "loop.num_steps=40",
                                               "loop.save_every=0", "loop.eval_every=0",
                                               'eval.mode="off"'])
    _until(lambda: len(_records(out, "train")) >= 2 and _engine_pids(procs[1].pid), 240,
           "two RL steps and node 1's engine", procs)
    (engine_pid,) = _engine_pids(procs[1].pid)
    os.kill(engine_pid, signal.SIGKILL)
    codes = _wait(procs, 300, "the run after node 1's engine was killed")
    head_log = logs[0].read_text()
    assert codes == [0, 0], head_log[-3000:]
    fleet_log = (out / "logs" / "engines.log").read_text()  # the head's fleet, INFO lines included
    assert "engine 1 (node 1, http://127.0.0.1:" in fleet_log and "that node restarts it" in fleet_log
    assert "engine 1 (node 1) restarted at" in fleet_log, fleet_log[-3000:]
    # alive/pending are gauges and generation a counter: some record after the restart must show
    # the restarted engine serving (the last record may precede the final poll, so not only it)
    records = _records(out, "actors")
    rejoined = [r for r in records if r.get("engines/generation") == 1.0
                and r.get("engines/alive") == 2.0 and r.get("engines/pending") == 0.0]
    assert rejoined, [{k: r.get(k) for k in ("step", "engines/alive", "engines/pending",
                                             "engines/generation")} for r in records]
    assert max(r.get("engines/generation", 0.0) for r in records) == 1.0
    train = _records(out, "train")
    assert [r["step"] for r in train] == list(range(1, 41))
    # the restarted engine (the same log file, appended) took the final weights
    engine_log = (out / "logs" / "engine0.node1.log").read_text()
    fresh_url = fleet_log.split("engine 1 (node 1) restarted at ")[1].split(";")[0]
    assert f"on {fresh_url}" in engine_log, engine_log[-2000:]
    assert f"weight version {train[-1]['version']}:" in engine_log.split(f"on {fresh_url}")[1]
    assert not psutil.pid_exists(engine_pid) or psutil.Process(engine_pid).status() == psutil.STATUS_ZOMBIE


# The agent quickstart laid out as quickstart_2node lays out the CPU quickstart: the head's fleet
# then runs the TITO session server in front of its gateway, which lists both nodes' engines.
AGENT_RECIPE = ROOT / "recipes" / "agent_quickstart.toml"


def _agent_2node_recipe(path: Path) -> Path:
    """agent_quickstart.toml followed by quickstart_2node.toml's [cluster] and [actors.*]
    sections (the agent recipe has none of its own): neither file's settings are copied here."""
    layout, agent = RECIPE.read_text(), AGENT_RECIPE.read_text()
    assert "\n[cluster]" in layout and "[cluster]" not in agent and "[actors." not in agent
    path.write_text(agent + layout[layout.index("\n[cluster]"):])
    return path


def _processes_of(daemon_pid: int, is_it) -> list[psutil.Process]:
    """The processes under a daemon whose command line `is_it(cmdline)` accepts."""
    out = []
    try:
        children = psutil.Process(daemon_pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return out
    for child in children:
        try:
            if is_it(child.cmdline()):
                out.append(child)
        except psutil.Error:
            continue
    return out


def _is_gateway(cmd: list[str]) -> bool:
    return bool(cmd) and cmd[0].startswith("smg::")  # smg names its router process so


def _is_module(module: str):
    return lambda cmd: cmd[1:3] == ["-m", module]


def _flag(cmd: list[str], name: str) -> str:
    return cmd[cmd.index(name) + 1]


def _listens_on(proc: psutil.Process, port: int) -> bool:
    return any(c.status == psutil.CONN_LISTEN and c.laddr.port == port
               for c in proc.net_connections(kind="tcp"))


@pytest.mark.slow
@pytest.mark.timeout(600)   # ~50 s here (2 shared cores); its own waits: 240 + 300 s
def test_two_node_agent_run_has_gateway_and_session_server_on_the_head_and_reaches_node_1(
        tmp_path, cluster_launcher):
    import urllib.request

    out = tmp_path / "agent2"
    steps = 3
    procs, logs = cluster_launcher(_agent_2node_recipe(tmp_path / "agent_2node.toml"), 2, [
        *_common(tmp_path, "agent2"), f"loop.num_steps={steps}", "loop.eval_every=0", 'eval.mode="off"',
        "sft.until_heldout=0"])
    seen: dict = {}

    def servers_up() -> bool:
        """The gateway and the session server under node 0, an engine under each node, and the
        gateway's worker list as the session server's engine URL answers it."""
        gateways = _processes_of(procs[0].pid, _is_gateway)
        sessions = _processes_of(procs[0].pid, _is_module("miles.tito.server"))
        engines = [_processes_of(p.pid, _is_module("miles.engines.embedded")) for p in procs]
        if not (gateways and sessions and all(engines)):
            return False
        try:
            seen.update(session=sessions[0].cmdline(),
                        engines=[[e.cmdline() for e in node] for node in engines])
            gateway_url = _flag(seen["session"], "--engine-url")
            seen["gateway_listens"] = _listens_on(gateways[0], int(gateway_url.rsplit(":", 1)[1]))
            with urllib.request.urlopen(gateway_url + "/workers", timeout=5) as resp:
                seen["workers"] = {w["url"] for w in json.loads(resp.read())["workers"]}
        except (psutil.Error, OSError, ValueError, KeyError):
            return False
        # up once the gateway lists an engine per node (it registers each as it answers)
        return len(seen["workers"]) >= len(procs)

    _until(servers_up, 240, "the gateway and session server on node 0, an engine on each node", procs)
    pids = _tree(procs[0].pid) | _tree(procs[1].pid)
    # the head runs the gateway and the session server, node 1 neither; the session server sends
    # to that gateway, and the gateway lists node 1's engine
    assert not _processes_of(procs[1].pid, _is_gateway), "a gateway on node 1"
    assert not _processes_of(procs[1].pid, _is_module("miles.tito.server")), "a session server on node 1"
    assert seen["gateway_listens"], f"its --engine-url is not node 0's smg: {seen['session']}"
    urls = [[f"http://{_flag(cmd, '--host')}:{_flag(cmd, '--port')}" for cmd in node]
            for node in seen["engines"]]
    assert set(urls[0]) | set(urls[1]) == seen["workers"], (urls, seen["workers"])

    codes = _wait(procs, 300, "the 2-node agent run")
    head_log = logs[0].read_text()
    assert codes == [0, 0], head_log[-4000:]
    assert [r["step"] for r in _records(out, "train")] == list(range(1, steps + 1))
    # Every generation goes session server -> gateway -> an engine (no evaluation runs): node 1's
    # engine served agent turns through the head's gateway, and the episodes completed.
    # counters are cumulative; the last record may precede the final poll, so take each's maximum
    records = _records(out, "actors")
    fleet = {k: max(r.get(k, 0.0) for r in records) for k in set().union(*records)
             if all(isinstance(r.get(k, 0.0), (int, float)) for r in records)}
    assert fleet["engines/node1/requests_total"] > 0 and fleet["engines/node0/requests_total"] > 0, fleet
    assert fleet["episode/count"] >= steps * 4 * 8 and fleet["episode/failed"] == 0, fleet
    assert fleet["episode/tool_calls"] > 0 and fleet["rollout/samples_failed"] == 0, fleet
    # nothing left: no open session of this run, no sandbox, no process of either node
    rollout_log = (out / "logs" / "rollout.log").read_text().splitlines()
    settled = [line for line in rollout_log if "episodes settled:" in line]
    closed = [line for line in rollout_log if "episodes closed:" in line]
    assert settled and "sessions of this run open: 0; sandboxes live: 0" in settled[0], settled
    assert closed and "live at close 0; swept 0" in closed[0], closed
    time.sleep(1.0)
    assert _alive(pids) == [], "processes left after the 2-node agent run"
    print(f"2-node agent run: {fleet['episode/count']:.0f} episodes, requests served per node "
          f"{fleet['engines/node0/requests_total']:.0f} / {fleet['engines/node1/requests_total']:.0f}")

# Fast cases of the same rules without the RL loop: demo actors, one of them placed per node.
PER_NODE = '''
[run]
name = "t"
output_dir = "@OUT@"
[cluster]
head_port = @PORT@
heartbeat_interval_s = 0.5
shutdown_grace_s = 3
node_timeout_s = 4.0
[actors.driver]
class = "miles.demo:DemoDriver"
node = 0
main = true
options = { samples = 100000, tokens = 64, batch = 64, retries = 2 }
[actors.sink]
class = "miles.demo:Sink"
nodes = [0, 1]
per_node = true
options = { delay_s = 0.5 }
'''


def _registered(out: Path) -> set[str]:
    """The actors the head's registry knows (its dashboard's /api/actors)."""
    import urllib.request
    try:
        url = (out / "metrics_url.node0").read_text().strip()
        with urllib.request.urlopen(url + "api/actors", timeout=2) as resp:
            return {row["name"] for row in json.loads(resp.read())}
    except (OSError, ValueError):
        return set()


def _started(procs, names_by_rank, out: Path, timeout_s=30.0):
    def placed():
        return (all(set(names) <= set(_actors_of(p.pid)) for p, names in zip(procs, names_by_rank))
                and {n for names in names_by_rank for n in names} <= _registered(out))
    _until(placed, timeout_s, f"actors {names_by_rank} on their nodes, registered", procs)


@pytest.mark.parametrize("nnodes", [2, 3])
def test_per_node_placement_names_one_actor_per_node_and_a_lost_node_ends_the_job(node_launcher, nnodes):
    """One sink per node, named by node; killing node 1 (the middle one of three) ends the job on
    every node that is left, each saying which node was lost."""
    recipe = PER_NODE.replace("nodes = [0, 1]", f"nodes = {list(range(nnodes))}")
    procs, _, logs = node_launcher(recipe, nnodes=nnodes)
    names = [["driver", "sink"]] + [[f"sink@{rank}"] for rank in range(1, nnodes)]
    _started(procs, names, logs[0].parent / "run")
    assert [sorted(_actors_of(p.pid)) for p in procs] == [sorted(n) for n in names]
    pids = set().union(*(_tree(p.pid) for p in procs))
    left = [p for rank, p in enumerate(procs) if rank != 1]
    killed = time.monotonic()
    os.kill(procs[1].pid, signal.SIGKILL)
    codes = _wait(left, 4.0 + 3 + 10, "the other nodes after node 1 was lost")
    took = time.monotonic() - killed
    text = logs[0].read_text()
    assert codes == [1] * len(left), text[-3000:]
    line = next(l for l in text.splitlines() if "shutting down: node 1 lost:" in l)
    assert "its actors: sink@1;" in line and "stopped before the first checkpoint" in line, line
    assert "(cluster.node_timeout_s = 4.0)" in line
    assert took < 4.0 + 3 + 5, took
    for log in logs[2:]:  # the head passed the reason on to the nodes that are left
        assert "shutting down: node 1 lost:" in log.read_text(), log.read_text()[-3000:]
    time.sleep(0.5)
    assert _alive(pids) == []


def test_a_lost_head_ends_the_other_nodes_within_the_node_timeout(node_launcher):
    procs, _, logs = node_launcher(PER_NODE, nnodes=2)
    _started(procs, [["driver", "sink"], ["sink@1"]], logs[0].parent / "run")
    pids = _tree(procs[0].pid) | _tree(procs[1].pid)
    killed = time.monotonic()
    os.kill(procs[0].pid, signal.SIGKILL)
    code = _wait(procs[1:], 4.0 + 3 + 10, "node 1 after the head was lost")[0]
    took = time.monotonic() - killed
    text = logs[1].read_text()
    assert code == 1, text[-3000:]
    assert "shutting down: the head (node 0) lost: its registry at tcp://127.0.0.1:" in text, text[-3000:]
    assert 4.0 <= took < 4.0 + 3 + 5, took  # not before the deadline, and soon after it
    time.sleep(0.5)
    assert _alive(pids) == []
