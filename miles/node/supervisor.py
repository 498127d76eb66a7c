"""Supervision of a node's actor processes: start, restart with backoff within the restart
budget, crash-loop detection, liveness kills, the causes the daemon reports, and stopping."""

from __future__ import annotations

import asyncio
import signal
import sys
import time
from pathlib import Path

from miles.config import Recipe
from miles.node.cluster import CALL_TIMEOUT_S, NodeEnv
from miles.node.logs import _indent, _last_error_line, _normalized
from miles.node.placement import Child
from miles.supervise import LogFollower, RestartBudget, SupervisedProcess
from miles.wire.messages import ListActors

CRASH_LOOP_WINDOW_S = 30.0  # a death this soon after start counts as a start failure


class Supervisor:
    """The daemon's part that starts its children and keeps them running."""

    recipe: Recipe
    node: NodeEnv
    children: list[Child]
    _shutting_down: bool

    def _spawn_child(self, child: Child) -> None:
        if child.log_path is None:
            child.log_path = self.recipe.output_dir / "logs" / f"{child.name.replace('/', '_')}.log"
            child.log_path.parent.mkdir(parents=True, exist_ok=True)
            from miles.console import forwarder
            child.follower = LogFollower(child.log_path, f"[{child.name}] ".encode(),
                                         forwarder(self.progress, self._write_console))
        proc = self._take_spare(child) or SupervisedProcess(
            child.name, [sys.executable, "-m", "miles.runtime.host"], env=self._child_env(child),
            log_path=child.log_path).start()
        child.proc, child.log_offset = proc, proc.log_offset
        child.started_at = proc.started_at
        child.exit_code = None
        child.registered = child.reported_slow_start = False
        self._spawn(self._supervise(child, proc))
        if child.spec.restart.spare:
            self._spawn(self._keep_spare(child, child.incarnation))

    def _take_spare(self, child: Child) -> SupervisedProcess | None:
        """The child's warm spare as its next incarnation (restart.spare), or None."""
        spare, child.spare = child.spare, None
        if spare is None:
            return None
        if not spare.alive or spare.env.get("MILES_INCARNATION") != str(child.incarnation):
            spare.signal_all(signal.SIGKILL)
            return None
        spare.log_offset = child.log_path.stat().st_size if child.log_path.exists() else 0
        spare.started_at = time.monotonic()
        go = Path(spare.env["MILES_SPARE_GO"])
        ready = Path(f"{go}.ready").exists()
        go.touch()
        self._log(f"{child.name}: incarnation {child.incarnation} is the warm spare (pid {spare.pid}, "
                  f"{'ready' if ready else 'still importing'})")
        return spare

    async def _keep_spare(self, child: Child, incarnation: int) -> None:
        """Once incarnation `incarnation` has registered (a spare started earlier would take the
        CPU its start needs), start the next one as a spare: imported, waiting for its go."""
        try:
            await self.runtime.lookup(child.name, wait_s=self.recipe.cluster.start_timeout_s,
                                      min_incarnation=incarnation)
        except Exception:  # noqa: BLE001 - not registered in time: the spare comes anyway
            pass
        if self._shutting_down or child.incarnation != incarnation or child.spare is not None:
            return
        env = self._child_env(child)
        go = child.log_path.parent / f".spare-{child.name.replace('/', '_')}-{incarnation + 1}.go"
        go.unlink(missing_ok=True)
        env.update(MILES_INCARNATION=str(incarnation + 1), MILES_SPARE_GO=str(go))
        try:
            child.spare = SupervisedProcess(f"{child.name} (spare)", [sys.executable, "-m", "miles.runtime.host"],
                                            env=env, log_path=child.log_path).start()
        except OSError as e:  # the restart starts a fresh process then
            self._log(f"{child.name}: no warm spare ({type(e).__name__}: {e})")

    async def _supervise(self, child: Child, proc: SupervisedProcess) -> None:
        code = await proc.wait()
        if proc is not child.proc:
            return
        child.follower.pump(flush_partial=True)  # its last words before ours
        child.exit_code = code
        if self._shutting_down:
            return
        if child.spec.main:
            reason = f"main actor {child.name} exited with {code}"
            if code != 0:
                reason = self._failure(child, await self._death_cause(child, code))
                if self.node.node_rank == 0 and self.node.nnodes > 1:
                    # It may have failed because a node is gone: say that, the cause, instead.
                    # Not RESUME_EXIT_CODE then: `miles run` on this node alone must not restart
                    # a job whose other node is gone.
                    await asyncio.sleep(2 * self.recipe.cluster.heartbeat_interval_s + 0.5)
                    lost = self._lost_node()
                    reason, code = (lost, 1) if lost else (reason, code)
            if self.node.node_rank != 0:  # the head ends the job for every node
                await self._tell_head(reason, code)
            await self.shutdown(reason, code)
            return
        if code == 0:
            return
        cause = await self._death_cause(child, code)
        # A signal after registration came from outside (an OOM killer, a chaos test, an
        # operator): not the actor failing the same way on every start. So is a SIGKILL before
        # it (no code of ours sends one): a kill during a restart is not a crash loop.
        early = code != -signal.SIGKILL and (not child.registered or (
            code > 0 and time.monotonic() - child.started_at < CRASH_LOOP_WINDOW_S))
        signature = (code, _normalized(_last_error_line(child.log_tail())))
        policy = child.spec.restart
        if early and child.early_failure == signature:
            await self._give_up(child, f"{cause}, as incarnation {child.incarnation - 1} did "
                                       f"(a crash loop: not restarted)")
            return
        child.early_failure = signature if early else None
        if child.budget is None:
            child.budget = RestartBudget(policy.max_restarts, policy.window_s, policy.backoff_s,
                                         policy.backoff_max_s)
        if child.budget.exhausted():
            await self._give_up(child, f"{cause}; restart budget (restart.max_restarts = "
                                       f"{policy.max_restarts}) used up within restart.window_s "
                                       f"= {policy.window_s} s")
            return
        delay = child.budget.delay_s()
        child.budget.record()
        self._log(f"{child.name} exited with {code}; restarting in {delay:.1f}s "
                  f"(restart {child.budget.recent()}/{policy.max_restarts} in "
                  f"restart.window_s = {policy.window_s} s)")
        await asyncio.sleep(delay)
        if self._shutting_down:
            return
        siblings = [c for c in child.group if c is not child and c.proc and c.proc.alive
                    ] if len(child.group) > 1 else []
        for sib in siblings:  # a torch process group cannot take back one rank: restart them all
            await self._terminate(sib, self.recipe.cluster.shutdown_grace_s)
        for c in [child, *siblings]:
            c.restarts += 1 if c is child else 0
            c.incarnation += 1
            self._spawn_child(c)

    async def _death_cause(self, child: Child, code: int) -> str:
        if not child.registered:  # the watcher may not have looked since it registered
            child.registered = await self._is_registered(child)
        how = (f"was killed by {signal.Signals(-code).name}" if code < 0 and -code in
               signal.valid_signals() else f"exited with code {code}")
        when = ("before it registered" if not child.registered else
                f"{time.monotonic() - child.started_at:.0f}s after its start")
        error = _last_error_line(child.log_tail())
        return f"incarnation {child.incarnation} {how} {when}" + (f" ({error})" if error else "")

    async def _is_registered(self, child: Child) -> bool:
        try:
            listing = await self.runtime.registry.call(ListActors(), timeout_s=CALL_TIMEOUT_S)
        except Exception:
            return False
        return any(a.name == child.name and a.incarnation == child.incarnation and a.endpoint
                   for a in listing.actors)

    def _failure(self, child: Child, cause: str) -> str:
        return (f"actor {child.name} failed: {cause}; last lines of its log ({child.log_path}):\n"
                f"{_indent(child.log_tail())}")

    async def _give_up(self, child: Child, cause: str) -> None:
        """Nothing else can finish without this actor: end the job rather than hang its callers."""
        child.gave_up = True
        reason = self._failure(child, cause)
        if self.node.node_rank != 0:
            await self._tell_head(reason, 1)
        await self.shutdown(reason, 1)

    async def _watch_liveness(self) -> None:
        """Kill (and so restart) children that are running but stopped heart-beating; note which
        incarnations have registered (a death before that is a start failure)."""
        cl = self.recipe.cluster
        while True:
            await asyncio.sleep(max(0.5, cl.heartbeat_interval_s))
            try:
                listing = await self.runtime.registry.call(ListActors(), timeout_s=CALL_TIMEOUT_S)
            except Exception:
                continue
            infos = {a.name: a for a in listing.actors}
            now = time.monotonic()
            for child in self.children:
                info = infos.get(child.name)
                if child.proc is None or not child.proc.alive or self._shutting_down:
                    continue
                current = info is not None and info.incarnation == child.incarnation and info.endpoint
                child.registered = child.registered or bool(current)
                if (not child.registered and not child.reported_slow_start
                        and now - child.started_at > cl.start_timeout_s):
                    child.reported_slow_start = True
                    self._log(f"{child.name} (incarnation {child.incarnation}) has not registered "
                              f"{now - child.started_at:.0f}s after its start (cluster."
                              f"start_timeout_s = {cl.start_timeout_s}); last lines of its log "
                              f"({child.log_path}):\n{_indent(child.log_tail())}")
                if current and not info.alive and now - child.started_at > cl.liveness_timeout_s:
                    self._log(f"{child.name} (incarnation {child.incarnation}, pid {child.proc.pid}) "
                              f"sent no heartbeat for {info.last_seen_s:.1f}s (cluster."
                              f"liveness_timeout_s = {cl.liveness_timeout_s}): killing it; last "
                              f"lines of its log ({child.log_path}):\n{_indent(child.log_tail())}")
                    child.proc.signal_all(signal.SIGKILL)

    async def _terminate(self, child: Child, grace_s: float) -> None:
        if child.spare is not None:  # a spare waits for its go and holds nothing: no grace
            child.spare.signal_all(signal.SIGKILL)
            child.spare = None
        proc = child.proc
        if proc is None or not proc.alive:
            return
        child.proc = None  # the supervisor must not restart it
        if await proc.stop_async(grace_s, term_descendants=False) is None:
            self._log(f"{child.name} (pid {proc.pid}) did not exit {grace_s}s after SIGTERM "
                      f"(cluster.shutdown_grace_s) nor after SIGKILL: leaving it")
