"""Bug specs of the SWE task set: ONE table (`SPECS`), a correct function, the same with one bug,
the calls that tell them apart, and how hard the fix is to find.

A spec is data: the function's source with `{fn}` and constant slots, the fragment the bug
changes (`right` -> `wrong`), call and summary formats, and pools to draw names and constants
from. `instantiate(spec, rng, split)` fills the slots; the tasks module turns the result into a
repository, an issue and tests.

Design decisions:
- Graded difficulty, so a warm start can solve some tasks and not all:
    easy    a one-token fix that the issue names exactly ("`wrong` should be `right`"): the new
            line is a line of the `view` output with one quoted fragment of the issue replaced
            by the other.
    medium  a one-line fix that the issue only describes (the call, what it gave, what it
            should give): the model must find the line and rewrite it from the words it saw.
    hard    missing lines (an edge case): new lines inserted, written from the words it saw.
- Held-out tasks share no function names or constants with the train tasks: every pool is
  split by index parity (`split = "train"` draws the even entries, `"test"` the odd ones), for
  names, helpers and every constant slot. `tests/agentic/test_swe_tasks.py` checks it.
- Expected values are never written by hand: `miles.agentic.swe.tasks` runs the correct code on
  every call, and checks that the buggy code answers differently on the calls that must fail (and
  the same on the ones that must pass). A spec with a wrong call cannot produce a task.
- The bug is a change of one to three consecutive lines, so the known fix is one line-range
  replacement (the `edit` tool's call, and a unified diff in the row as SWE-bench has it).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

SPLITS = ("train", "test")


@dataclass(frozen=True)
class BugSpec:
    template: str
    kind: str
    difficulty: str                    # easy | medium | hard (module docstring)
    names: tuple[str, ...]             # the function's name; split by index parity
    good: str                          # source, with {fn}, {h} (the helper) and the slots
    right: str                         # the fragment of `good` that the bug changes ...
    wrong: str                         # ... into this
    fail: tuple[str, ...]              # calls the bug changes (the is the first)
    keep: tuple[str, ...]              # calls it does not change (PASS_TO_PASS)
    summary: str                       # what the function should do, as a user says it
    slots: dict[str, tuple[Any, ...]] = field(default_factory=dict)
    helpers: tuple[str, ...] = ()      # names of a helper defined in `good` ({h})


@dataclass
class Bug:
    template: str
    kind: str
    difficulty: str
    fn: str
    good: str
    bad: str
    fail: list[str]
    keep: list[str]
    summary: str
    hint: tuple[str, str] | None       # easy: (wrong, right) as the issue quotes them
    constants: dict[str, str]          # the slots' drawn values, as text
    helpers: list[str] = field(default_factory=list)


def _half(pool: tuple[Any, ...], split: str) -> tuple[Any, ...]:
    if split not in SPLITS:
        raise ValueError(f"split: expected one of {SPLITS}, got {split!r}")
    return pool[SPLITS.index(split)::2]


def instantiate(spec: BugSpec, rng: random.Random, split: str) -> Bug:
    """One bug of `spec` with names and constants from `split`'s half of every pool."""
    values: dict[str, Any] = {k: rng.choice(_half(pool, split)) for k, pool in spec.slots.items()}
    values["fn"] = rng.choice(_half(spec.names, split))
    if spec.helpers:
        values["h"] = rng.choice(_half(spec.helpers, split))
    good = spec.good.format(**values)
    right, wrong = spec.right.format(**values), spec.wrong.format(**values)
    if good.count(right) != 1:
        raise ValueError(f"spec {spec.template}: {right!r} must occur once in its source")
    hint = (wrong.strip(), right.strip()) if spec.difficulty == "easy" else None
    return Bug(spec.template, spec.kind, spec.difficulty, values["fn"], good, good.replace(right, wrong),
               [c.format(**values) for c in spec.fail], [c.format(**values) for c in spec.keep],
               spec.summary.format(**values), hint,
               {k: repr(v) for k, v in values.items() if k not in ("fn", "h")},
               [values["h"]] if spec.helpers else [])


def _ints(lo: int, hi: int, step: int = 1) -> tuple[int, ...]:
    return tuple(range(lo, hi, step))


_WORDS = ("cedar", "plum", "quartz", "ember", "lagoon", "tundra", "maple", "violet", "harbor", "fjord",
          "sable", "onyx", "willow", "basalt", "meadow", "cobalt")
_TITLES = ("Big Red Fox", "Old Blue Road", "Fast New Tree", "Tall Green Hill", "Cold Dark Lake",
           "Warm Soft Sand", "Bright Pale Moon", "Deep Wide River", "Quiet Small Town", "Sharp Gray Rock")
_FIELDS = ("score", "points", "sales", "height", "weight", "rank", "votes", "miles")


def _records(i: int) -> tuple[str, str, str, str]:
    fld = _FIELDS[i % len(_FIELDS)]
    vals = [(i * 37 + 11) % 90 + 5, (i * 53 + 7) % 90 + 5, (i * 71 + 3) % 90 + 5]
    vals = [v + k * 100 for k, v in enumerate(vals)] if len(set(vals)) < 3 else vals
    recs = [{"id": k, fld: v} for k, v in enumerate(vals)]
    return fld, repr(recs), repr(recs[::-1]), repr(recs[:1])


SPECS: tuple[BugSpec, ...] = (
    # -- easy: the issue quotes the wrong fragment and the right one
    BugSpec("count_long", "wrong_operator", "easy",
            ("count_long_words", "count_words", "long_word_count", "words_at_least", "tally_long",
             "count_wide_words"),
            "def {fn}(text, min_length={w[3]}):\n"
            '    """Count the words of text that have at least min_length characters."""\n'
            "    return sum(1 for word in text.split() if len(word) >= min_length)\n",
            ">= min_length", "> min_length",
            ("{fn}({w[0]!r})", "{fn}('{w[0]} {w[1]} {w[0]}')"), ("{fn}('{w[1]} {w[2]}')", "{fn}('')"),
            "`{fn}` should count words of exactly min_length characters too",
            {"w": tuple((w, w[:-1], w + "xy", len(w)) for w in _WORDS)}),
    BugSpec("discount", "wrong_operator", "easy",
            ("apply_discount", "discounted", "sale_price", "price_after_discount", "marked_down",
             "reduced_price"),
            "def {fn}(price, percent):\n"
            '    """Price after taking `percent` percent off, rounded to cents."""\n'
            "    return round(price * (100 - percent) / 100, 2)\n",
            "(100 - percent)", "(100 + percent)",
            ("{fn}({price}, {pct})", "{fn}({price2}.5, {pct2})"), ("{fn}({price}, 0)", "{fn}(0, {pct})"),
            "`{fn}` should lower the price by the percentage",
            {"price": _ints(20, 400, 7), "pct": _ints(5, 55, 5), "price2": _ints(11, 99, 3),
             "pct2": _ints(1, 10)}),
    BugSpec("parse_pair", "wrong_default", "easy",
            ("parse_pair", "split_setting", "parse_option", "key_value", "read_entry", "split_field"),
            'def {fn}(line, sep="{s[0]}"):\n'
            '    """Split "key{s[0]}value" into (key, value), both stripped."""\n'
            "    key, _, value = line.partition(sep)\n"
            "    return key.strip(), value.strip()\n",
            'sep="{s[0]}"):', 'sep="{s[1]}"):',
            ("{fn}('{key} {s[0]} {val}')", "{fn}('x{s[0]}y')"), ("{fn}('{key}|{val}', sep='|')",
                                                                 "{fn}('  {key}  ', sep='|')"),
            "`{fn}` should split on {s[0]!r} when no separator is given",
            {"s": (("=", ":"), (":", "="), ("->", "="), ("=>", ":"), ("::", "="), ("~", "="),
                   ("+=", ";"), (";", ",")),
             "key": ("name", "color", "size", "mode", "level", "shade", "unit", "tier"),
             "val": _ints(101, 999, 37)}),
    BugSpec("backoff", "off_by_one", "easy",
            ("backoff_delays", "retry_delays", "wait_times", "pause_schedule", "sleep_steps",
             "delay_plan"),
            "def {fn}(attempts, base={base}):\n"
            '    """Delays before each of `attempts` retries: base, 2*base, 4*base, ..."""\n'
            "    return [base * 2 ** i for i in range(attempts)]\n",
            "range(attempts)", "range(1, attempts)",
            ("{fn}({n})", "{fn}(1, base={base2})"), ("{fn}(0)",),
            "`{fn}` should give one delay per attempt, starting at base",
            {"base": _ints(1, 11), "n": _ints(3, 9), "base2": _ints(12, 30, 3)}),
    BugSpec("inclusive_sum", "off_by_one", "easy",
            ("sum_between", "range_total", "sum_inclusive", "total_from_to", "span_sum", "add_up_range"),
            "def {fn}(start, stop):\n"
            '    """Sum of the integers from start to stop, both included."""\n'
            "    return sum(range(start, stop + 1))\n",
            "range(start, stop + 1)", "range(start, stop)",
            ("{fn}({a}, {b})", "{fn}({b}, {b})"), ("{fn}({b}, {a})", "{fn}(0, 0)"),
            "`{fn}` should include stop in the sum",
            {"a": _ints(1, 20), "b": _ints(25, 45)}),
    BugSpec("best_record", "wrong_operator", "easy",
            ("best_record", "top_entry", "max_by_field", "leading_row", "highest_item", "winner_of"),
            "def {fn}(records, field):\n"
            '    """The record with the largest value of field (the first on ties); None when empty."""\n'
            "    best = None\n"
            "    for record in records:\n"
            "        if best is None or record[field] > best[field]:\n"
            "            best = record\n"
            "    return best\n",
            "record[field] > best[field]", "record[field] < best[field]",
            ("{fn}({r[1]}, {r[0]!r})", "{fn}({r[2]}, {r[0]!r})"),
            ("{fn}([], {r[0]!r})", "{fn}({r[3]}, {r[0]!r})"),
            "`{fn}` should return the record with the largest {r[0]}",
            {"r": tuple(_records(i) for i in range(12))}),
    # -- medium: one line, described, not quoted
    BugSpec("clamp", "wrong_variable", "medium",
            ("clamp", "bound", "limit_to_range", "fit_range", "restrict", "pin_between"),
            "def {fn}(value, low, high):\n"
            '    """Return value limited to the range [low, high]."""\n'
            "    if value < low:\n"
            "        return low\n"
            "    if value > high:\n"
            "        return high\n"
            "    return value\n",
            "high:\n        return high\n", "high:\n        return low\n",
            ("{fn}({over}, {lo}, {hi})", "{fn}({over2}, {lo}, {hi})"),
            ("{fn}({mid}, {lo}, {hi})", "{fn}({below}, {lo}, {hi})"),
            "`{fn}` should cap a value at `high` when it is above the range",
            {"lo": _ints(0, 20), "hi": _ints(40, 90, 3), "over": _ints(100, 150, 3),
             "over2": _ints(150, 200, 3), "mid": _ints(25, 36), "below": _ints(-20, -1)}),
    BugSpec("chunk", "off_by_one", "medium",
            ("chunk", "batches", "split_every", "group_by_size", "slice_up", "cut_into"),
            "def {fn}(items, size):\n"
            '    """Split items into consecutive lists of at most `size` elements."""\n'
            "    if size < 1:\n"
            '        raise ValueError("size must be at least 1")\n'
            "    return [items[i:i + size] for i in range(0, len(items), size)]\n",
            "range(0, len(items), size)", "range(0, len(items) - 1, size)",
            ("{fn}(list(range({z[1]})), {z[0]})", "{fn}(['a'], {z[0]})"),
            ("{fn}(list(range({z[2]})), {z[0]})", "{fn}([], {z[0]})"),
            "`{fn}` should keep every element, the last chunk may be shorter",
            {"z": tuple((s, s * m + 1, 2 * s) for s in (2, 3, 4, 5) for m in (2, 3))}),
    BugSpec("share", "swapped_args", "medium",
            ("share_per_person", "allowance", "budget_each", "portion_for", "cut_per_head", "dole_out"),
            "def {h}(total, count):\n"
            '    """Each of `count` equal parts of `total`, rounded down (0 for no parts)."""\n'
            "    if count == 0:\n"
            "        return 0\n"
            "    return total // count\n"
            "\n\n"
            "def {fn}(budget, people):\n"
            '    """How much each person gets from the budget."""\n'
            "    return {h}(budget, people)\n",
            "return {h}(budget, people)", "return {h}(people, budget)",
            ("{fn}({total}, {people})", "{fn}({total2}, {people})"), ("{fn}(0, 0)", "{h}({total}, {people})"),
            "`{fn}` should divide the budget among the people",
            {"total": _ints(100, 900, 23), "people": _ints(3, 9), "total2": _ints(1000, 2000, 41)},
            helpers=("split_evenly", "per_part", "even_share", "equal_slice", "fair_part", "divide_up")),
    BugSpec("slug", "missing_step", "medium",
            ("slugify", "make_slug", "url_name", "path_token", "handle_for", "dashed_name"),
            'def {fn}(title, sep="{sep}"):\n'
            '    """Lower-case slug of title: its words joined by sep."""\n'
            "    return sep.join(title.lower().split())\n",
            "title.lower().split()", "title.split()",
            ("{fn}({t!r})", "{fn}({t_up!r})"), ("{fn}({t_low!r})", "{fn}('')"),
            "`{fn}` should lower-case the title",
            {"sep": ("-", "_", ".", "+", "~", "--"),
             **{k: tuple(f(t) for t in _TITLES) for k, f in
                (("t", str), ("t_up", lambda t: t.split()[0].upper()), ("t_low", str.lower))}}),
    # -- hard: lines are missing
    BugSpec("mean", "missing_edge_case", "hard",
            ("mean", "average", "avg_or_default", "safe_mean", "arith_mean", "mean_value"),
            "def {fn}(values, default={default}):\n"
            '    """Average of values; `default` when there are none."""\n'
            "    if not values:\n"
            "        return default\n"
            "    return sum(values) / len(values)\n",
            "    if not values:\n        return default\n", "",
            ("{fn}([])", "{fn}([], default={alt})"), ("{fn}({vals})", "{fn}([{one}])"),
            "`{fn}` of an empty list should return the default, not raise",
            {"default": ("0.0", "None", "-1.0", "0", "-1", "-2.0"), "alt": _ints(3, 13),
             "vals": tuple([a, a + 7, a * 2 + 1] for a in range(2, 14)), "one": _ints(20, 40)}),
    BugSpec("last_n", "missing_edge_case", "hard",
            ("last_n", "tail", "take_last", "newest", "final_items", "trailing"),
            "def {fn}(items, n):\n"
            '    """The last n items (none when n is 0 or less)."""\n'
            "    if n <= 0:\n"
            "        return []\n"
            "    return items[-n:]\n",
            "    if n <= 0:\n        return []\n", "",
            ("{fn}({items}, 0)", "{fn}({items2}, 0)"), ("{fn}({items}, 2)", "{fn}({items}, 1)"),
            "`{fn}` with n = 0 should give an empty list",
            {"items": tuple([a, a + 3, a + 11, a + 20] for a in range(10, 22)),
             "items2": tuple([a, a + 1] for a in range(50, 62))}),
    BugSpec("leap", "missing_edge_case", "hard",
            ("is_leap", "leap_year", "has_feb_29", "long_year", "is_bissextile", "year_has_366"),
            "def {fn}(year):\n"
            '    """Whether year is a leap year in the Gregorian calendar."""\n'
            "    if year % 400 == 0:\n"
            "        return True\n"
            "    if year % 100 == 0:\n"
            "        return False\n"
            "    return year % 4 == 0\n",
            "    if year % 400 == 0:\n        return True\n", "",
            ("{fn}({c})", "{fn}({c2})"), ("{fn}({c100})", "{fn}({y})", "{fn}(2024)"),
            "`{fn}` should treat years divisible by 400 as leap years",
            {"c": (1200, 1600, 2000, 2400), "c2": (2800, 3200, 3600, 4000),
             "c100": (1700, 1800, 1900, 2100, 2200, 2300), "y": _ints(1901, 1999, 4)}),
)

DIFFICULTIES = ("easy", "medium", "hard")
