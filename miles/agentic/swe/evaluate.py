"""Held-out evaluation of an agentic recipe from a weights snapshot, as a command: `eval.mode =
"external"` runs it, and it prints the metrics (pass@1, pass@k, reward) as one JSON line.

    [eval]
    mode = "external"
    command = "python -m miles.agentic.swe.evaluate --checkpoint {checkpoint} --step {step}"

    python -m miles.agentic.swe.evaluate --checkpoint runs/swe_cpu/eval/step_000020 --step 20

Design decisions:
- It is the evaluator's fleet mode in a process of its own: `miles.actors.evaluator.Evaluator`
  with the run's resolved recipe, scoring the snapshot on an embedded engine it starts (with a
  session server in front for the agent), each held-out prompt `eval.samples_per_prompt` times
  through the episode runner (harness, sandbox, verifier). The three modes therefore report the
  same metrics, computed by the same code; only where the weights come from differs.
- The recipe is the run's own (`recipe.resolved.node0.json` in the run directory, which holds
  `eval/step_N`), or `--recipe` (a resolved JSON or a TOML recipe with `--set` overrides). Nothing
  is guessed from the current directory.
- Not SWE-specific: any recipe with a depth (`rollout.agent` / `rollout.generate`) or none.
- Exit 1 with the evaluator's error on stderr when the evaluation failed: the run's evaluator
  then skips that point, as for its own modes.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path

import msgspec


def load_run_recipe(checkpoint: str, recipe_path: str | None, overrides: list[str]):
    from miles.config import load_recipe, recipe_from_json

    if recipe_path is None:
        resolved = Path(checkpoint).resolve().parents[1] / "recipe.resolved.node0.json"
        if not resolved.is_file():
            raise SystemExit(f"--checkpoint {checkpoint}: no {resolved.name} in {resolved.parent} (expected "
                             f"<run dir>/eval/step_N); pass --recipe")
        recipe_path = str(resolved)
    if recipe_path.endswith(".json"):
        if overrides:
            raise SystemExit("--set: only with a TOML --recipe (a resolved JSON recipe is final)")
        return recipe_from_json(Path(recipe_path).read_bytes())
    from miles.rl.sources import prepare_recipe
    return prepare_recipe(load_recipe(recipe_path, overrides))


async def evaluate(recipe, checkpoint: str, step: int) -> dict[str, float]:
    from miles.actors.evaluator import Evaluator
    from miles.wire.messages import Evaluate

    recipe = msgspec.structs.replace(recipe, eval=msgspec.structs.replace(recipe.eval, mode="fleet"))
    evaluator = Evaluator()
    evaluator.recipe = recipe
    await evaluator.on_start()
    result = await evaluator.on_evaluate(Evaluate(step=step, version=step, checkpoint_dir=checkpoint))
    if not result.ok:
        raise RuntimeError(result.error)
    return {k.removeprefix("eval/"): v for k, v in result.metrics.items()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--checkpoint", required=True, help="an HF weights directory (the run's eval/step_N)")
    ap.add_argument("--step", type=int, default=0)
    ap.add_argument("--recipe", default=None, help="default: the run's recipe.resolved.node0.json")
    ap.add_argument("--set", action="append", default=[], dest="overrides", metavar="KEY=VALUE")
    args = ap.parse_args(argv)
    recipe = load_run_recipe(args.checkpoint, args.recipe, args.overrides)
    try:
        metrics = asyncio.run(evaluate(recipe, args.checkpoint, args.step))
    except Exception as e:  # noqa: BLE001 - the run's evaluator reads the exit code and the log
        print(f"evaluation of {args.checkpoint} failed: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    print(json.dumps(metrics), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
