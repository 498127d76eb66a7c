"""`[sandbox]`: the sandbox backend and the limits of each episode's sandbox. Mounted into
`miles.config.Recipe`."""

from __future__ import annotations

from typing import Annotated

from msgspec import Meta

from miles.sections import NonNegative, Positive, Section


class SandboxConfig(Section):
    """`[sandbox]`: one fresh sandbox per episode, created before its first tool call and destroyed
    after the verifier in every outcome. A task's `metadata["image"]` overrides `image`, its
    `metadata["sandbox"]` (SandboxSpec fields: a Harbor task's Dockerfile, limits, network) goes over
    these keys for its episode (network only if both allow it), and its `metadata["files"]`
    ({path: text}) are written into the sandbox when it is created."""
    backend: str = ""                 # "" (none) | subprocess | bwrap | docker | e2b | daytona | modal | agentenv
    image: str = ""                   # default image (container and cloud backends)
    rootfs: str = ""                  # or a host directory as the root tree (subprocess, bwrap)
    # CPU cores per sandbox (where the backend enforces it)
    cpu: Annotated[float, Meta(gt=0.0, le=512.0)] = 1.0
    # memory limit per sandbox
    memory_mb: Annotated[int, Meta(ge=16)] = 1024
    # give the sandbox network access
    network: bool = False
    # a sandbox left alive this long is destroyed by the backend (a safety net; the run destroys each
    # after its episode)
    ttl_s: Annotated[float, Meta(ge=1.0, le=604800.0)] = 3600.0
    max_concurrent: Positive = 32     # live sandboxes at once (the pool's bound)
    create_rate_per_s: NonNegative = 0.0  # 0: unlimited
    options: dict[str, str | int | float | bool] = {}  # backend constructor options
