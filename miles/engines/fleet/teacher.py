"""TeacherFleet: the engines of on-policy distillation's frozen teacher (`[teacher]`), on the rollout side.

Design decisions:
- It is an `EngineFleet` over the recipe as the teacher sees it (`teacher_recipe`): the teacher's
  model and `[teacher.engine]` in place of `[model]` and `[engine]`, its logs under
  `<output_dir>/teacher/logs/`, no session server, no quantized updates, no routing capture. So
  the teacher's engines and their gateway are launched, health-checked, restarted under the same
  crash-loop rule and stopped with the job by the one launcher the policy's engines use.
- The teacher never gets weights: nobody publishes to this fleet (the driver and the trainer talk
  to `engines` only). A restarted teacher engine therefore serves at once, where a policy engine
  would wait, pending, for the current version.
- The rollout worker asks it `GetEngines` for the gateway URL and scores every finished sample
  there (`miles.rl.teacher_scores`).
"""

from __future__ import annotations

import logging
from pathlib import Path

import msgspec

from miles.engines.fleet.fleet import EngineFleet

log = logging.getLogger(__name__)


def teacher_recipe(recipe):
    """The recipe an engine fleet of the teacher runs on (`recipe.teacher.path` is set by then)."""
    teacher = recipe.teacher
    model = msgspec.structs.replace(recipe.model, path=teacher.path, tiny="", tiny_overrides={})
    run = msgspec.structs.replace(recipe.run, output_dir=str(Path(recipe.output_dir) / "teacher"))
    return msgspec.structs.replace(
        recipe, run=run, model=model, engine=teacher.engine,
        session=msgspec.structs.replace(recipe.session, enabled="off"),
        quant=type(recipe.quant)(),
        rollout=msgspec.structs.replace(recipe.rollout, return_routed_experts=False, r3=False))


class TeacherFleet(EngineFleet):
    def __init__(self, name: str = "teacher_engines"):
        super().__init__(name)

    async def on_start(self) -> None:
        if not self.recipe.teacher.path:
            raise ValueError(f"{self.name}: teacher.path is empty (set teacher.path or teacher.tiny)")
        self.recipe = teacher_recipe(self.recipe)
        await super().on_start()

    async def _relaunch(self, slot) -> None:
        await super()._relaunch(slot)
        if slot.engine is None or slot.pending_since < 0:
            return
        slot.pending_since = -1  # frozen weights: nothing to wait for
        if self.gateway is not None and self.gateway.process.alive:
            try:
                await self.gateway.add_worker(slot.engine.url, timeout_s=30.0)
            except Exception as e:  # noqa: BLE001 - it may have died meanwhile: the watcher sees it
                log.warning("could not add teacher engine %s to the gateway: %s", slot.engine.url, e)
