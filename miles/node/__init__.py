"""The per-node daemon: `python -m miles.node recipe.toml` (what `miles run` and `launch/miles.sh` start).

Design decisions:
- Where am I: node rank, node count and head host come from Slurm (`SLURM_NODEID`,
  `SLURM_NNODES`, first host of `SLURM_JOB_NODELIST`), else torchrun-style variables (`NODE_RANK`,
  `NNODES`, `MASTER_ADDR`), else it is a one-node run. `MILES_HEAD_HOST` / `MILES_HOST` override.
  Slurm host lists are expanded by `scontrol show hostnames` where it is installed, else by
  `parse_nodelist` (every bracket group, zero padding kept).
- The head node (rank 0) hosts the registry in the daemon's own event loop. Every actor runs in
  a child process of its node's daemon (`miles.runtime.host`), so a crash, an OOM or a `kill -9`
  takes down one actor, never the daemon, and the actor can be restarted alone.
- Supervision: a child that exits non-zero (or by signal) is restarted with exponential backoff
  until `restart.max_restarts` restarts within `restart.window_s` are used up; each restart gets a new incarnation number so callers
  of the old one fail fast and `retries` reach the new one. A child that is alive but silent (no
  heartbeat for `cluster.liveness_timeout_s`) is killed and restarted the same way; the log line
  names it, its incarnation, the seconds since its last heartbeat and its log's last lines.
- No crash loops: an incarnation that dies early (before it registered, or by an error exit
  within `CRASH_LOOP_WINDOW_S` of its start) with the same exit code and last error line as the
  incarnation before it would fail the same way again, so it is not restarted. The first start
  gets one retry that way (a port taken a moment ago is not a code error); a bad import or an
  `on_start` that raises ends the run after two quick starts, within seconds.
- A non-main actor that is given up on (crash loop, or restart budget used up) ends the job:
  nothing else can finish without it, and waiting on it would hang every caller. Its node tells
  the head, which shuts every node down with exit code 1 and one message:
  "actor X failed: <cause>; last lines of its log (<path>): ...".
- Process groups launched like torchrun: ranks get RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE,
  MASTER_ADDR, MASTER_PORT (port = head_port + 10 + role index). A dead rank restarts the
  group's ranks on its node (a torch process group cannot take back one rank).
- Children are `miles.supervise.SupervisedProcess`es: their own process group and
  PR_SET_PDEATHSIG(SIGKILL), so even a `kill -9` of the daemon takes them down; on SIGTERM/SIGINT
  the daemon sends SIGTERM to every child's group, waits `cluster.shutdown_grace_s`, then
  SIGKILLs what is left, servers the actor started in sessions of their own included (those are
  left to the actor to stop in order during the grace period).
- Ctrl-C: children are in groups of their own, so a terminal's SIGINT reaches only the daemon;
  it stops the children (which exit quietly) and prints one line: where the run stopped (the
  newest complete checkpoint's `loop_state.json`) and that the same command resumes it.
- Logs: every child writes to `<output_dir>/logs/<actor name>.log` (`/` -> `_`), appended
  across incarnations, and the daemon follows those files onto its console with a `[name] `
  prefix. A child never writes into a pipe, so no line is too long and a slow console never
  blocks an actor; a line over 64 KiB reaches the console in 64 KiB pieces, the file whole.
- Every wait has a deadline that names what it waited for: other nodes at start
  (`cluster.start_timeout_s`), children at shutdown (`cluster.shutdown_grace_s`, then SIGKILL),
  calls to other daemons (5 s). A child that has not registered `cluster.start_timeout_s` after
  its start is reported once with its log's last lines (an actor may legitimately load a model
  for longer; its own waits carry their deadlines).
- When the `main` actor exits, the job is over: the head tells the other daemons to shut down and
  exits with the main actor's code.
"""

from miles.node.cluster import NodeEnv, detect_node_env, expand_nodelist, parse_nodelist
from miles.node.daemon import NodeDaemon, run_node
from miles.node.logs import where_stopped
from miles.node.placement import Child, ephemeral_port_range

__all__ = ["NodeDaemon", "NodeEnv", "Child", "detect_node_env", "expand_nodelist",
           "parse_nodelist", "ephemeral_port_range", "run_node", "where_stopped"]
