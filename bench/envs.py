"""Environment integrations: episodes per second and the adapter's own cost per episode.

    python bench/envs.py [--episodes 16] [--only verifiers,openenv,...]

Prints one JSON line per integration: {"bench": "envs", "integration", "episodes", "episodes_per_s",
"env_s_per_episode", "llm_s_per_episode", "adapter_overhead_ms_per_episode", "machine", ...}.

Design decisions:
- One module per integration under `bench/env_runs/<name>.py`, each with
  `run(episodes: int) -> dict` returning at least `episodes`, `wall_s`, `env_s` (time inside the
  environment package: its server calls, its verifier) and `llm_s` (time the policy's model calls
  took, measured where the adapter makes them). The adapter's overhead is what is left:
  (wall - env - llm) / episodes, the cost Miles adds around each episode.
- Every run uses the real package and a tiny real model, as the integration's test does; a runner
  whose package is not installed here prints a line with `"skipped"` and the reason, not a figure.
- The baseline in the same run is the environment alone (`env_s`) and the model alone (`llm_s`):
  the overhead is reported against both, so a slow model cannot hide a slow adapter.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import time
import traceback
from pathlib import Path
from miles.hostinfo import machine

RUNS = Path(__file__).resolve().parent / "env_runs"
INTEGRATIONS = ("verifiers", "openenv", "hud", "hud_openai_agent", "harbor", "nemo_gym")


def load_runner(name: str):
    path = RUNS / f"{name}.py"
    if not path.exists():
        return None
    spec = importlib.util.spec_from_file_location(f"env_runs_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.run


def figures(name: str, out: dict) -> dict:
    n = max(int(out["episodes"]), 1)
    wall, env, llm = float(out["wall_s"]), float(out.get("env_s", 0.0)), float(out.get("llm_s", 0.0))
    line = {"bench": "envs", "integration": name, "episodes": n,
            "episodes_per_s": round(n / wall, 3) if wall > 0 else None,
            "env_s_per_episode": round(env / n, 4), "llm_s_per_episode": round(llm / n, 4),
            "adapter_overhead_ms_per_episode": round(1000 * max(wall - env - llm, 0.0) / n, 2),
            "adapter_overhead_share": round(max(wall - env - llm, 0.0) / wall, 4) if wall > 0 else None}
    line.update({k: v for k, v in out.items() if k not in ("episodes", "wall_s", "env_s", "llm_s")})
    return line


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--episodes", type=int, default=16)
    p.add_argument("--only", default=",".join(INTEGRATIONS))
    args = p.parse_args(argv)
    failed = 0
    for name in [n.strip() for n in args.only.split(",") if n.strip()]:
        if name not in INTEGRATIONS:
            p.error(f"--only: {name!r} is not one of {', '.join(INTEGRATIONS)}")
        run = load_runner(name)
        base = {"bench": "envs", "integration": name, "machine": machine()}
        if run is None:
            print(json.dumps({**base, "skipped": f"bench/env_runs/{name}.py does not exist"}), flush=True)
            continue
        t0 = time.perf_counter()
        try:
            out = run(args.episodes)
        except ModuleNotFoundError as e:
            print(json.dumps({**base, "skipped": f"not installed here: {e}"}), flush=True)
            continue
        except Exception as e:  # one integration failing must not hide the others' figures
            failed += 1
            traceback.print_exc(file=sys.stderr)
            print(json.dumps({**base, "error": f"{type(e).__name__}: {e}",
                              "after_s": round(time.perf_counter() - t0, 1)}), flush=True)
            continue
        print(json.dumps({**figures(name, out), "machine": machine()}), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
