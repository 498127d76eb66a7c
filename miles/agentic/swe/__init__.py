"""SWE-style coding tasks and their harness (issue 18, the coding half).

    bugs.py      bug templates: a correct function, the same with one bug, the calls that differ
    tasks.py     the task set from a seed (`data.task = "miles.agentic.swe.tasks:tasks"`)
    harness.py   the mini-SWE-agent-style agent: bash, view, edit by line range, search, submit
    scripted.py  the oracle (applies the known fix through the same tools) and the null agent
    verify.py    the verifier: hidden tests in the episode's sandbox after the agent is done
    evaluate.py  the external eval command: the evaluator's fleet mode on a snapshot, pass@k
"""
