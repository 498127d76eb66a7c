"""A fleet that cannot start says so once its tries are spent: an engine is tried 1 +
`engine.max_restarts` times (here 2), then every `GetEngines` waiter gets the error (naming the
process, its command, its log's last lines and the tries), and the fleet's `run()` returns 1 so
its host process exits non-zero. Real engine and smg processes, real sockets, 127.0.0.1."""

from __future__ import annotations

import asyncio
import time

from miles.runtime import RemoteError, Runtime
from miles.engines.fleet import EngineFleet
from miles.config import Recipe, RunConfig
from miles.engines.config import EngineConfig
from miles.rl.config import ModelConfig
from miles.wire.messages import GetEngines


async def _start_fleet(tmp_path, model_path: str, **engine):
    recipe = Recipe(run=RunConfig(output_dir=str(tmp_path / "run")),
                    model=ModelConfig(path=model_path),
                    engine=EngineConfig(start_timeout_s=120.0, health_interval_s=0.5, **engine))
    fleet = EngineFleet()
    fleet.recipe = recipe
    runtime = Runtime()
    await fleet.start(runtime)
    return fleet, runtime, runtime.ref_at(fleet.server.endpoint, "engines")


async def _expect_start_failure(tmp_path, model_path, *, within_s: float, **engine) -> str:
    fleet, runtime, ref = await _start_fleet(tmp_path, model_path, max_restarts=1, **engine)
    t0 = time.monotonic()
    try:
        run = asyncio.ensure_future(fleet.run())
        waiters = [ref.call(GetEngines(), timeout_s=600) for _ in range(2)]
        results = await asyncio.gather(*waiters, return_exceptions=True)
        elapsed = time.monotonic() - t0
        assert all(isinstance(r, RemoteError) for r in results), results
        assert str(results[0]) == str(results[1])
        assert elapsed < within_s, f"the error took {elapsed:.1f} s"
        assert await asyncio.wait_for(run, 10) == 1
        late = await asyncio.gather(ref.call(GetEngines(), timeout_s=5), return_exceptions=True)
        assert isinstance(late[0], RemoteError), "a waiter that comes later gets the error too"
        return str(results[0])
    finally:
        await fleet.close()
        runtime.close()


async def test_missing_model_path_fails_every_waiter_at_once(tmp_path):
    message = await _expect_start_failure(tmp_path, str(tmp_path / "no-such-model"), within_s=60)
    assert "FleetError" in message and "engine 0 did not start after 2 tries" in message
    assert "miles.engines.embedded" in message  # the command
    assert "no-such-model" in message           # from the log's last lines


async def test_unsupported_dtype_fails_every_waiter_at_once(tmp_path, tiny_qwen3):
    message = await _expect_start_failure(tmp_path, str(tiny_qwen3), dtype="float8", within_s=30)
    assert "engine 0 did not start after 2 tries (engine.max_restarts = 1)" in message
    assert "--dtype float8" in message                 # the command
    assert "invalid choice: 'float8'" in message       # argparse's refusal, from the log


async def test_smg_that_cannot_import_fails_every_waiter_at_once(tmp_path, tiny_qwen3, monkeypatch):
    # smg's launcher imports setproctitle; a PYTHONPATH entry that makes that import fail is the
    # "missing Python module in smg" seen in the field (the engines do not import it).
    shadow = tmp_path / "shadow"
    shadow.mkdir()
    (shadow / "setproctitle.py").write_text(
        "raise ModuleNotFoundError(\"No module named 'setproctitle'\", name='setproctitle')\n")
    monkeypatch.setenv("PYTHONPATH", str(shadow))
    message = await _expect_start_failure(tmp_path, str(tiny_qwen3), within_s=90)
    assert "the gateway (smg) did not start" in message
    assert "-m smg launch" in message                       # the command
    assert "No module named 'setproctitle'" in message      # from its log


async def test_an_engine_that_fails_its_first_start_is_tried_again(tmp_path, tiny_qwen3):
    """A start failure at job start is a restart too: the first try is killed before /health,
    the second serves, and the fleet starts (no error for anyone)."""
    import psutil

    fleet, runtime, ref = await _start_fleet(tmp_path, str(tiny_qwen3))
    try:
        me, deadline = psutil.Process(), time.monotonic() + 60
        while not (procs := [p for p in me.children(recursive=True)
                             if "miles.engines.embedded" in " ".join(p.cmdline())]):
            assert time.monotonic() < deadline, "no engine process within 60 s"
            await asyncio.sleep(0.05)
        procs[0].kill()  # while it imports torch: seconds before /health
        engines = await ref.call(GetEngines(), timeout_s=180)
        assert len(engines.engine_urls) == 1 and engines.pending_urls == []
        assert fleet.restarts == 1 and fleet.slots[0].budget.total == 1
    finally:
        await fleet.close()
        runtime.close()
