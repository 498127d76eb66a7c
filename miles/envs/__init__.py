"""Environment plug-in layers: what one sample (an episode) or one step runs through, and the
adapters for the environment ecosystems (each a `rollout.agent` plug-in; docs/environments.md).

    context.py        EpisodeContext: what a `rollout.generate` plug-in gets (engine, limits, sandbox)
    episode.py        run_episode / EpisodeEnv: the depth, the verifier, the sandbox's lifetime, metrics
    agent.py          `rollout.agent`: an OpenAI/Anthropic-compatible agent in a TITO session
    function.py       `rollout.function`: one call per step replaces per-sample scheduling
    tool_agent.py     the built-in ReAct-style tool agent
    verifiers_env.py  Verifiers environments, in-process or served by Verifiers' own env server
    openenv_env.py    OpenEnv environment servers driven over their WebSocket (own venv)
    hud_env.py        HUD env templates on LocalRuntime, Miles' agent (or HUD's) on the session
    harbor_env.py     Harbor tasks as Harbor trials (trial server in its own Python 3.12 venv)
    nemo_gym_env.py   NeMo Gym resources servers and agent /run (own Python 3.12 venv)
    servers/          the processes those venvs run (no torch, no Miles imports beyond the stdlib)
"""
