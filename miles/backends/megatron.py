"""MegatronBackend: the megatron-core training backend (TP x PP x CP x EP x DP), not built yet.

It will implement the same five methods as the FSDP backend (see base.py); until then choosing
`train.backend = "megatron"` fails at construction with a message that says so, instead of at the
first call deep inside a run.
"""

from __future__ import annotations

from miles.backends.base import TrainingBackend

NEXT_ISSUE = "issue 5 (Megatron backend)"


class MegatronBackend(TrainingBackend):
    name = "megatron"

    def __init__(self) -> None:
        raise NotImplementedError(f"train.backend='megatron' is not implemented yet; it is planned "
                                  f"in {NEXT_ISSUE}. Use train.backend='fsdp' for now.")

    # The abstract methods are declared so the class is complete; __init__ never lets one run.
    def init(self, config, rank, loss=None):  # pragma: no cover
        raise NotImplementedError

    def train(self, samples):  # pragma: no cover
        raise NotImplementedError

    def update_weights(self, transport, version):  # pragma: no cover
        raise NotImplementedError

    def save_model(self, path, hf=False, extra_state=None):  # pragma: no cover
        raise NotImplementedError

    def load_model(self, path):  # pragma: no cover
        raise NotImplementedError

    def sleep(self):  # pragma: no cover
        raise NotImplementedError

    def wake_up(self):  # pragma: no cover
        raise NotImplementedError

    @property
    def step(self):  # pragma: no cover
        raise NotImplementedError
