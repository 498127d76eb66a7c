import asyncio

import verifiers.v1 as vf

WORDS = ["cat", "dog", "sun", "red", "sky", "box", "cup", "map", "pen", "owl", "hat", "egg"]


class EchoData(vf.TaskData):
    word: str
    turns: int = 2
    fail: str = ""           # "raise": the reward raises; "hang": it takes a minute (a server to kill mid-run)


def replies(trace: vf.Trace) -> list[str]:
    return [m.content if isinstance(m.content, str) else str(m.content or "")
            for m in trace.messages if m.role == "assistant"]


class EchoTask(vf.Task[EchoData]):
    @vf.reward(weight=1.0)
    async def says_word(self, trace: vf.Trace) -> float:
        if self.data.fail == "raise":
            raise RuntimeError(f"echo task {self.data.id}: the reward is broken on purpose")
        if self.data.fail == "hang":
            await asyncio.sleep(60)
        said = replies(trace)
        return float(bool(said) and self.data.word in said[-1])

    @vf.reward(weight=0.5)
    async def brief(self, trace: vf.Trace) -> float:
        said = replies(trace)
        return sum(len(r) <= 24 for r in said) / len(said) if said else 0.0

    @vf.metric
    async def model_turns(self, trace: vf.Trace) -> float:
        return float(len(replies(trace)))


class EchoConfig(vf.TasksetConfig):
    num_tasks: int = 12
    turns: int = 2
    fail_every: int = 0      # > 0: every fail_every-th task's reward raises


class EchoTaskset(vf.Taskset[EchoTask, EchoConfig]):
    def load(self) -> list[EchoTask]:
        cfg = self.config
        return [EchoTask(EchoData(idx=i, id=f"echo-{i}", word=WORDS[i % len(WORDS)], turns=cfg.turns,
                                  prompt=f"Say {WORDS[i % len(WORDS)]}.",
                                  fail="raise" if cfg.fail_every and i % cfg.fail_every == cfg.fail_every - 1 else ""),
                         cfg.task)
                for i in range(cfg.num_tasks)]
