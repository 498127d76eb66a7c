"""Terminal-Bench-style terminal tasks in Harbor layout, the terminal agent, its oracle and null agents.

    families.py   the task families: seeded RNG -> instruction, files, oracle commands, hidden checks
    tasks.py      Harbor-layout task directories and the `data.task` rows (train / held-out / SFT)
    agent.py      the terminal agent (the tool agent with bash + submit), the Harbor verifier,
                  the oracle and null agents

Recipes: recipes/terminal_cpu.toml, recipes/terminal_h200.toml, recipes/terminal_cluster.toml.
"""
