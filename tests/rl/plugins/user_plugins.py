"""A user's own plug-ins, loaded by import path in the tests (the plug-in contract)."""

from miles.actors.buffer import BufferPolicy, Decision
from miles.rl.data import Prompt


async def length_reward(sample) -> dict:
    """An async reward returning several named values."""
    return {"len": float(len(sample.response)), "has_digit": float(any(c.isdigit() for c in sample.response))}


def group_reward(samples):
    """A batched reward: one call per group."""
    return [float(i) for i, _ in enumerate(samples)]


class CountingSource:
    """A user data source: any iterator with state()/restore()."""

    def __init__(self, recipe):
        self.position = 0

    def __next__(self):
        p = Prompt(index=self.position, prompt=f"count {self.position}", label=str(self.position))
        self.position += 1
        return p

    def state(self):
        return {"position": self.position}

    def restore(self, state):
        self.position = state["position"]


def make_source(recipe):
    return CountingSource(recipe)


class DropOdd(BufferPolicy):
    def on_put(self, group):
        return Decision("drop", "odd prompt") if group.prompt_index % 2 else Decision("keep")


def zero_reward(sample) -> float:
    """Every sample fails: with buffer.filter = "nonzero_std" no group is ever kept."""
    return 0.0
