"""Prompt data sources: JSONL or Parquet rows (prompt, label, metadata), or a user's own by import path.

Design decisions:
- A data source is an iterator of `Prompt`s with a resumable position: `state()` returns a small
  dict that a checkpoint stores and `restore(state)` continues from, so a resumed run sees the
  same prompts it would have seen without the interruption.
- Epochs reshuffle with a seed derived from (seed, epoch): the order is a pure function of the
  position, which is what makes resume exact.
- A row must have the prompt key; a missing or wrong-typed prompt is an error naming the file,
  the row number and the key, raised when the file is loaded, not halfway through a run.
- User sources: `data.source = "my_pkg.data:make_source"`, a callable `(config) -> DataSource`
  (or any object with `__next__`, `state`, `restore`).
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any, Protocol

import msgspec


class Prompt(msgspec.Struct, kw_only=True):
    index: int                                    # position in the stream (unique per run)
    prompt: str | list[dict[str, Any]]            # text, or chat messages
    label: str | None = None
    metadata: dict[str, Any] = {}


class DataSource(Protocol):
    def __next__(self) -> Prompt: ...
    def state(self) -> dict: ...
    def restore(self, state: dict) -> None: ...


def load_rows(path: str | Path, prompt_key: str = "prompt", label_key: str = "label",
              metadata_key: str = "metadata") -> list[dict]:
    """Rows of a .jsonl or .parquet file, checked up front."""
    path = Path(path)
    if not path.exists():
        raise ValueError(f"data.path = {str(path)!r}: no such file")
    if path.suffix == ".parquet":
        try:
            import pyarrow.parquet as pq
        except ImportError:
            raise ValueError(f"data.path = {str(path)!r}: Parquet needs pyarrow "
                             f"(pip install pyarrow)") from None
        rows = pq.read_table(path).to_pylist()
    elif path.suffix in (".jsonl", ".json"):
        rows = []
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if not line.strip():
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{n}: not valid JSON: {e.msg}") from None
    else:
        raise ValueError(f"data.path = {str(path)!r}: expected a .jsonl or .parquet file")
    for n, row in enumerate(rows, 1):
        if not isinstance(row, dict) or prompt_key not in row:
            raise ValueError(f"{path}: row {n} has no {prompt_key!r} key (data.prompt_key)")
        if not isinstance(row[prompt_key], (str, list)):
            raise ValueError(f"{path}: row {n}: {prompt_key!r} must be text or a list of "
                             f"messages, got {type(row[prompt_key]).__name__}")
    return rows


class FileSource:
    """Shuffled epochs over the rows of a file; resumable."""

    def __init__(self, path: str | Path, *, prompt_key: str = "prompt", label_key: str = "label",
                 metadata_key: str = "metadata", shuffle: bool = True, seed: int = 0):
        self.rows = load_rows(path, prompt_key, label_key, metadata_key)
        if not self.rows:
            raise ValueError(f"data.path = {str(path)!r}: the file has no rows")
        self.keys = (prompt_key, label_key, metadata_key)
        self.shuffle, self.seed = shuffle, seed
        self.position = 0
        self._epoch, self._order = -1, list(range(len(self.rows)))

    def _order_for(self, epoch: int) -> list[int]:
        order = list(range(len(self.rows)))
        if self.shuffle:
            random.Random(self.seed * 1_000_003 + epoch).shuffle(order)
        return order

    def __iter__(self):
        return self

    def __next__(self) -> Prompt:
        prompt = self.at(self.position)
        self.position += 1
        return prompt

    def at(self, index: int) -> Prompt:
        """The prompt at stream position `index` (the same one `next` gave or will give)."""
        epoch, offset = divmod(index, len(self.rows))
        if epoch != self._epoch:
            self._epoch, self._order = epoch, self._order_for(epoch)
        row = self.rows[self._order[offset]]
        pk, lk, mk = self.keys
        label = row.get(lk)
        return Prompt(index=index, prompt=row[pk], label=None if label is None else str(label),
                      metadata=dict(row.get(mk) or {}))

    def state(self) -> dict:
        return {"position": self.position}

    def restore(self, state: dict) -> None:
        self.position = int(state.get("position", 0))
