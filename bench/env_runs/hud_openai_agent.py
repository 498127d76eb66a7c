"""bench/env_runs/hud.py with HUD's own OpenAIChatAgent (`metadata.hud.agent = "hud"`) instead of
Miles' agent: the same episodes, for comparing what each agent costs inside HUD's rollout.

    python bench/envs.py --only hud,hud_openai_agent --episodes 16
"""

from __future__ import annotations

import importlib.util
from pathlib import Path


def run(episodes: int) -> dict:
    spec = importlib.util.spec_from_file_location("env_runs_hud", Path(__file__).with_name("hud.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.run(episodes, agent="hud")
