"""Fuzz from outside: a foreign process sends malformed frames to every endpoint of a running job
(the registry, the node daemon, the real buffer, a sink, the driver). No actor dies, every bad
frame is counted in `bad_frames`, every readable header gets an error reply, and real calls are
served afterwards."""

import asyncio
import json
import sys
import time
from pathlib import Path

import psutil

from miles.runtime import Runtime
from miles.wire.messages import GetMetrics, ListActors, Ping, Pong, Shutdown

HERE = Path(__file__).resolve().parent

RECIPE = '''
[run]
output_dir = "@OUT@"
[cluster]
head_port = @PORT@
heartbeat_interval_s = 0.5
[actors.driver]
class = "supervision_actors:Waiter"
main = true
[actors.buffer]
class = "miles.actors.buffer:Buffer"
[actors.sink]
class = "miles.demo:Sink"
'''


async def _actors(client, names, timeout_s=60.0):
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            listing = await client.registry.call(ListActors(), timeout_s=5)
            infos = {a.name: a for a in listing.actors}
            if all(n in infos and infos[n].alive for n in names):
                return infos
        except Exception:
            pass
        assert time.monotonic() < deadline, f"actors {names} did not come up"
        await asyncio.sleep(0.2)


async def test_malformed_frames_from_a_foreign_process_crash_nothing(node_launcher):
    (daemon,), port, logs = node_launcher(RECIPE)
    client = Runtime(registry=f"tcp://127.0.0.1:{port}")
    try:
        infos = await _actors(client, ["node/0", "driver", "buffer", "sink"])
        targets = {"registry": (client.registry_endpoint, daemon.pid)}
        targets.update({n: (infos[n].endpoint, infos[n].pid)
                        for n in ("node/0", "driver", "buffer", "sink")})
        refs = {n: client.ref_at(ep, n) for n, (ep, _) in targets.items()}
        before = {n: (await r.call(GetMetrics(), timeout_s=10)).values["bad_frames"]
                  for n, r in refs.items()}
        proc = await asyncio.create_subprocess_exec(
            sys.executable, str(HERE / "fuzz_client.py"), *(ep for ep, _ in targets.values()),
            stdout=asyncio.subprocess.PIPE)
        out, _ = await asyncio.wait_for(proc.communicate(), 120)
        assert proc.returncode == 0
        report = json.loads(out)
        for name, (endpoint, pid) in targets.items():
            assert psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE, name
            r = report[endpoint]
            got = {int(i): m for i, m in r["replies"].items()}
            assert set(got) == set(r["expect_reply"]), (name, sorted(set(r["expect_reply"]) - set(got)))
            assert all(m.startswith("bad frame (") and len(m) < 400 for m in got.values()), name
            pong = await refs[name].call(Ping(payload=b"after"), timeout_s=10)
            assert isinstance(pong, Pong) and pong.payload == b"after"
            bad = (await refs[name].call(GetMetrics(), timeout_s=10)).values["bad_frames"]
            assert bad - before[name] == r["sent"], name
        assert all(infos[n].pid == a.pid for n, a in (await _actors(client, ["buffer"])).items()
                   if n in infos)  # nothing was restarted
        await refs["node/0"].call(Shutdown(reason="fuzz test done"), timeout_s=10)
        assert await asyncio.to_thread(daemon.wait, 30) == 0
    finally:
        client.close()
    assert "Traceback" not in logs[0].read_text()
