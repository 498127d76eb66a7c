"""The test tree's own layout: pytest's default import mode imports a test module by its basename
wherever its folder is not a package, so two such modules of one name stop the whole collection."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]


def test_test_modules_outside_packages_have_unique_basenames():
    seen: dict[str, list[str]] = defaultdict(list)
    for path in TESTS.rglob("test_*.py"):
        if not (path.parent / "__init__.py").exists():
            seen[path.name].append(str(path.relative_to(TESTS)))
    clashes = {name: paths for name, paths in seen.items() if len(paths) > 1}
    assert not clashes, f"test modules that share a basename (rename one): {clashes}"
    assert len(seen) > 100   # the walk found the suite
