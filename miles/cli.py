"""The `miles` command: `miles run recipe.toml [--set k=v ...]`, `miles check recipe.toml`,
`miles replay runs/<name>/wire/driver.mlw [--step N] [--resend URL]` (see `miles/replay.py`),
`miles dashboard RUN`, `miles status RUN`, `miles logs RUN ACTOR`, `miles episodes RUN`,
`miles ledger RUN` (see
`miles/ops_cli.py`), `miles trace RUN --sample ID | --step N | --prompt ID` (a sample's lineage,
see `miles/trace.py`),
`miles plan recipe.toml [--gpus N] [--model-size S]` (a capacity model, see `miles/plan.py`).

Both commands run the same checks first (`load_recipe`, then `check_recipe`): a broken recipe ends
with exit code 2 and one line, `miles: <source>: <key.path> = <value>: <what was expected>`,
before any process starts. Warnings go to stderr and do not stop either command.
"""

from __future__ import annotations

import argparse
import sys

import msgspec

from miles.config import RecipeError, load_recipe
from miles.recipe_checks import check_placement, check_recipe


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="miles", description="Ray-free RL post-training")
    sub = p.add_subparsers(dest="command", required=True)
    for name, text in (("run", "run a recipe (one node daemon; launch/miles.sh runs one per node)"),
                       ("check", "validate a recipe and print its placement")):
        c = sub.add_parser(name, help=text)
        c.add_argument("recipe")
        c.add_argument("--set", dest="overrides", action="append", default=[],
                       metavar="SECTION.KEY=VALUE", help="override a recipe value (repeatable)")
    # listed for --help only: `miles replay ...` is dispatched before this parser (see main)
    sub.add_parser("replay", help="re-run a step recorded by logging.record_wire (miles replay -h)")
    sub.add_parser("dashboard", help="serve a run's dashboard: miles dashboard runs/<name>")
    sub.add_parser("status", help="a live run's actors, restarts and lag, and its ledger's totals: "
                                  "miles status runs/<name>")
    sub.add_parser("ledger", help="prove every prompt read was trained once, filtered/dropped with a "
                                  "reason, or is pending: miles ledger runs/<name> [--json]")
    sub.add_parser("logs", help="an actor's log: miles logs runs/<name> ACTOR [-n N] [-f]")
    sub.add_parser("episodes", help="episode transcripts: miles episodes runs/<name> [--step N] "
                                    "[--reward R] [--task ID] [-n K]")
    sub.add_parser("trace", help="a trained sample's lineage (engine, version, weight digest, turns, "
                                 "reward, step): miles trace runs/<name> --sample ID | --step N | --prompt ID")
    sub.add_parser("plan", help="predict step time, idle and staleness: miles plan recipe.toml --gpus N")
    return p


def describe(recipe) -> str:
    lines = [f"run {recipe.run.name!r}: output {recipe.output_dir}"]
    for role, spec in sorted(recipe.actors.items()):
        nodes = spec.nodes if spec.nodes is not None else [spec.node]
        extra = f" x{spec.procs_per_node}/node" if spec.procs_per_node > 1 else ""
        lines.append(f"  {role:<12} {spec.cls:<40} nodes {nodes}{extra}{'  (main)' if spec.main else ''}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["replay"]:  # its own flags (miles/replay.py)
        from miles.replay import main as replay_main
        return replay_main(argv[1:])
    if argv[:1] and argv[0] in ("dashboard", "status", "logs", "episodes", "ledger"):
        from miles.ops_cli import COMMANDS
        return COMMANDS[argv[0]](argv[1:])
    if argv[:1] == ["trace"]:
        from miles.trace import main as trace_main
        return trace_main(argv[1:])
    if argv[:1] == ["plan"]:
        from miles.plan import main as plan_main
        return plan_main(argv[1:])
    args = _parser().parse_args(argv)
    try:
        recipe = load_recipe(args.recipe, args.overrides)
        warnings = check_recipe(recipe, args.recipe)
        if args.command == "run":
            from miles.node import detect_node_env
            check_placement(recipe, detect_node_env().nnodes, args.recipe)
    except RecipeError as e:
        print(f"miles: {e}", file=sys.stderr)
        return 2
    for warning in warnings:
        print(f"miles: warning: {args.recipe}: {warning}", file=sys.stderr)
    if args.command == "check":
        from miles.rl.sources import with_default_actors
        print(describe(with_default_actors(recipe)))  # the placement `run` will start
        print("recipe OK")
        return 0
    from miles.loop import RESUME_EXIT_CODE
    from miles.node import run_node
    from miles.rl.sources import prepare_recipe

    for attempt in range(recipe.loop.auto_resumes + 1):
        code = run_node(recipe, prepare_recipe)
        if code != RESUME_EXIT_CODE or attempt == recipe.loop.auto_resumes:
            return code
        # The driver asked for it (a trainer rank died): the same job, from its newest checkpoint.
        print(f"miles: restarting the job from its newest checkpoint "
              f"(auto-resume {attempt + 1} of loop.auto_resumes = {recipe.loop.auto_resumes})",
              file=sys.stderr, flush=True)
        recipe = msgspec.structs.replace(recipe, loop=msgspec.structs.replace(recipe.loop, resume=True))
    return code


if __name__ == "__main__":
    sys.exit(main())
