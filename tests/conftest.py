"""Suite-wide set-up.

- A failed `slow` test (a real end-to-end run: processes, deadlines, kills on a shared CPU) is run
  once more, through pytest-rerunfailures; `-rR` (test.sh) lists every rerun in the summary, so
  an intermittent failure is reported, not hidden. Anything else fails at once.
- SIGINT: a shell without job control starts a background command (test.sh's second pytest, or
  `./test.sh &`) with SIGINT ignored, and an ignored signal stays ignored in every child, so the
  Ctrl-C tests' processes could not be interrupted. A handler of our own is reset to the default
  in each child instead.
- `extended` tests (`pytest.mark.extended`) are deselected unless MILES_TEST_EXTENDED=1: cases
  whose every axis another case in the suite also covers (a parallel layout that a combined layout
  includes), kept runnable for a full check; the summary counts them as deselected.
- Without CUDA, Triton kernels run in its interpreter (TRITON_INTERPRET=1). It must be set before
  anything imports `triton.language`: its library functions are built as interpreted or compiled
  when that module is first imported, and a test that sets it later finds compiled ones if an
  earlier test's import (peft, megatron-core, transformers) came first.
"""

import os
import shutil
import signal

import pytest

if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

if shutil.which("nvidia-smi") is None:
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if os.environ.get("MILES_TEST_EXTENDED") != "1":
        extended = [i for i in items if i.get_closest_marker("extended")]
        if extended:
            config.hook.pytest_deselected(items=extended)
            items[:] = [i for i in items if not i.get_closest_marker("extended")]
    if not config.pluginmanager.hasplugin("rerunfailures"):
        return
    for item in items:
        if item.get_closest_marker("slow") and not item.get_closest_marker("flaky"):
            item.add_marker(pytest.mark.flaky(reruns=1))
