import pytest

from miles.backends import RankInfo, make_backend


@pytest.fixture
def backends():
    """make(cfg, loss) -> an initialized one-rank FSDP backend in this process (gloo, an in-process
    store); every backend made shares the one process group, which is destroyed at the end."""
    made = []

    def make(cfg, loss):
        backend = make_backend("fsdp")
        backend.init(cfg, RankInfo(), loss)
        made.append(backend)
        return backend

    yield make
    if made:
        made[-1].close()
