"""Prometheus `/metrics` on every node and the dashboard on the head (`miles.observe`), with
the table of this node's actors they show."""

from __future__ import annotations

from pathlib import Path

from miles.config import Recipe
from miles.node.cluster import NodeEnv


class Metrics:
    """The daemon's part that serves its metrics and actor table."""

    recipe: Recipe
    node: NodeEnv
    children: list
    registry_actor: object

    async def _serve_metrics(self):
        """Prometheus `/metrics` on every node, and the dashboard on the head (miles.observe)."""
        port = self.recipe.logging.metrics_port
        if port < 0:
            return None
        derived = port == 0
        port = port or self.recipe.cluster.head_port + 1 + self.node.node_rank
        from miles.observe import make_app, serve
        app = make_app(Path(self.recipe.output_dir), actors_fn=self.actor_table,
                       node_rank=self.node.node_rank, dashboard=self.node.node_rank == 0)
        try:
            runner, bound = await serve(app, self.node.host, port, any_port_if_taken=derived)
        except OSError as e:  # the run goes on without it: a scrape target is not worth a job
            self._log(f"metrics endpoint not served: port {port} (logging.metrics_port): {e}")
            return None
        if bound != port:
            self._log(f"metrics port {port} (cluster.head_port + 1 + node rank) is taken: serving on {bound}")
            port = bound
        (Path(self.recipe.output_dir) / f"metrics_url.node{self.node.node_rank}").write_text(
            f"http://{self.node.host}:{port}/\n")
        return runner

    def actor_table(self) -> list[dict]:
        """This node's actors (process state, incarnation, restarts) and, on the head, every
        actor's heartbeat age and event-loop lag from the registry."""
        beats = {}
        if self.registry_actor is not None:
            for name in list(self.registry_actor.entries):
                info = self.registry_actor._info(name)
                beats[name] = {"heartbeat_age_s": round(info.last_seen_s, 3),
                               "loop_lag_ms": info.loop_lag_ms, "node": info.node_rank}
        rows = []
        for c in self.children:
            alive = c.proc is not None and c.proc.alive
            rows.append({"name": c.name, "node": self.node.node_rank, "up": alive,
                         "state": "up" if alive else ("gave up" if c.gave_up else "down"),
                         "incarnation": c.incarnation, "restarts": c.restarts, **beats.pop(c.name, {})})
        for name, beat in sorted(beats.items()):   # actors of other nodes, as the head sees them
            if not name.startswith("node/"):
                rows.append({"name": name, "up": beat["heartbeat_age_s"] < self.recipe.cluster.liveness_timeout_s,
                             **beat})
        return rows
