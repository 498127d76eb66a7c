"""Bug templates of the SWE task set: a correct function, the same function with one bug, and the
calls that tell them apart.

Each template is `template(rng) -> Bug`: the function's name, its argument names where they
matter, and its constants come from `rng`, so two tasks of one template differ in the text the
model reads (names, numbers, the call in the issue) and only the kind of mistake is shared.

Design decisions:
- Expected values are never written by hand: `miles.agentic.swe.tasks` runs the correct code on
  every call and writes what it returned into the tests, and checks that the buggy code answers
  differently on the calls that must fail (and the same on the ones that must pass). A template
  with a wrong call cannot produce a task.
- The bug is a change of one to three consecutive lines, so the known fix is one line-range
  replacement (what the oracle sends through the harness's `edit` tool, and a unified diff in the
  row as SWE-bench has it).
- Kinds: off_by_one, wrong_operator, missing_edge_case, wrong_default, swapped_args,
  wrong_variable, missing_step: the mistakes of SWE-smith's procedural bug injection, written as
  source so that every one reads like code a person wrote.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field


@dataclass
class Bug:
    template: str
    kind: str
    fn: str                     # the function the tests call
    good: str                   # source of the correct definition(s)
    bad: str                    # the same with the bug
    fail: list[str]             # calls whose result the bug changes (the is the first)
    keep: list[str]             # calls the bug does not change (PASS_TO_PASS)
    summary: str                # what the function should do, as the user would say it
    helpers: list[str] = field(default_factory=list)   # other functions defined in `good`


def _pick(rng: random.Random, *names: str) -> str:
    return rng.choice(names)


def clamp(rng: random.Random) -> Bug:
    fn = _pick(rng, "clamp", "bound", "limit_to_range", "fit_range")
    lo, hi = rng.randrange(0, 20), rng.randrange(40, 90)
    good = (f"def {fn}(value, low, high):\n"
            f'    """Return value limited to the range [low, high]."""\n'
            f"    if value < low:\n"
            f"        return low\n"
            f"    if value > high:\n"
            f"        return high\n"
            f"    return value\n")
    bad = good.replace("        return high\n", "        return low\n")
    return Bug("clamp", "wrong_variable", fn, good, bad,
               fail=[f"{fn}({hi + rng.randrange(1, 30)}, {lo}, {hi})", f"{fn}({hi + 1}, {lo}, {hi})"],
               keep=[f"{fn}({(lo + hi) // 2}, {lo}, {hi})", f"{fn}({lo - 3}, {lo}, {hi})"],
               summary=f"`{fn}` should cap a value at `high` when it is above the range")


def chunk(rng: random.Random) -> Bug:
    fn = _pick(rng, "chunk", "batches", "split_every", "group_by_size")
    size = rng.randrange(2, 5)
    n = size * rng.randrange(2, 4) + 1        # one element is left over for the last chunk
    good = (f"def {fn}(items, size):\n"
            f'    """Split items into consecutive lists of at most `size` elements."""\n'
            f"    if size < 1:\n"
            f'        raise ValueError("size must be at least 1")\n'
            f"    return [items[i:i + size] for i in range(0, len(items), size)]\n")
    bad = good.replace("range(0, len(items), size)", "range(0, len(items) - 1, size)")
    return Bug("chunk", "off_by_one", fn, good, bad,
               fail=[f"{fn}(list(range({n})), {size})", f"{fn}(['a'], {size})"],
               keep=[f"{fn}(list(range({size * 2})), {size})", f"{fn}([], {size})"],
               summary=f"`{fn}` should keep every element, the last chunk may be shorter")


def mean(rng: random.Random) -> Bug:
    fn = _pick(rng, "mean", "average", "avg_or_default", "safe_mean")
    default = rng.choice(["0.0", "None", "-1.0"])
    vals = [rng.randrange(1, 50) for _ in range(rng.randrange(2, 5))]
    good = (f"def {fn}(values, default={default}):\n"
            f'    """Average of values; `default` when there are none."""\n'
            f"    if not values:\n"
            f"        return default\n"
            f"    return sum(values) / len(values)\n")
    bad = good.replace("    if not values:\n        return default\n", "")
    return Bug("mean", "missing_edge_case", fn, good, bad,
               fail=[f"{fn}([])", f"{fn}([], default=7)"], keep=[f"{fn}({vals})", f"{fn}([{vals[0]}])"],
               summary=f"`{fn}` of an empty list should return the default, not raise")


def count_long(rng: random.Random) -> Bug:
    fn = _pick(rng, "count_long_words", "count_words", "long_word_count")
    k = rng.randrange(3, 6)
    word = "".join(rng.choice("abcdefghij") for _ in range(k))
    short = word[:k - 1]
    longer = word + "xy"
    good = (f"def {fn}(text, min_length={k}):\n"
            f'    """Count the words of text that have at least min_length characters."""\n'
            f"    return sum(1 for word in text.split() if len(word) >= min_length)\n")
    bad = good.replace(">= min_length", "> min_length")
    return Bug("count_long", "wrong_operator", fn, good, bad,
               fail=[f"{fn}({word!r})", f"{fn}({(word + ' ' + short + ' ' + word)!r})"],
               keep=[f"{fn}({(short + ' ' + longer)!r})", f"{fn}('')"],
               summary=f"`{fn}` should count words of exactly min_length characters too")


def discount(rng: random.Random) -> Bug:
    fn = _pick(rng, "apply_discount", "discounted", "sale_price", "price_after_discount")
    price, pct = rng.randrange(20, 400), rng.choice([5, 10, 15, 20, 25, 30, 40, 50])
    good = (f"def {fn}(price, percent):\n"
            f'    """Price after taking `percent` percent off, rounded to cents."""\n'
            f"    return round(price * (100 - percent) / 100, 2)\n")
    bad = good.replace("(100 - percent)", "(100 + percent)")
    return Bug("discount", "wrong_operator", fn, good, bad,
               fail=[f"{fn}({price}, {pct})", f"{fn}({price + 1}.5, {pct // 5})"],
               keep=[f"{fn}({price}, 0)", f"{fn}(0, {pct})"],
               summary=f"`{fn}` should lower the price by the percentage")


def last_n(rng: random.Random) -> Bug:
    fn = _pick(rng, "last_n", "tail", "take_last", "newest")
    items = rng.sample(range(10, 99), rng.randrange(3, 6))
    good = (f"def {fn}(items, n):\n"
            f'    """The last n items (none when n is 0 or less)."""\n'
            f"    if n <= 0:\n"
            f"        return []\n"
            f"    return items[-n:]\n")
    bad = good.replace("    if n <= 0:\n        return []\n", "")
    return Bug("last_n", "missing_edge_case", fn, good, bad,
               fail=[f"{fn}({items}, 0)", f"{fn}({items[:2]}, 0)"],
               keep=[f"{fn}({items}, 2)", f"{fn}({items}, 1)"],
               summary=f"`{fn}` with n = 0 should give an empty list")


def parse_pair(rng: random.Random) -> Bug:
    fn = _pick(rng, "parse_pair", "split_setting", "parse_option", "key_value")
    seps = ["=", ":", "->"]
    sep = rng.choice(seps)
    wrong = rng.choice([s for s in seps if s != sep])
    key, val = _pick(rng, "name", "color", "size", "mode", "level"), str(rng.randrange(1, 999))
    good = (f'def {fn}(line, sep="{sep}"):\n'
            f'    """Split "key{sep}value" into (key, value), both stripped."""\n'
            f"    key, _, value = line.partition(sep)\n"
            f"    return key.strip(), value.strip()\n")
    bad = good.replace(f'sep="{sep}"', f'sep="{wrong}"', 1)
    return Bug("parse_pair", "wrong_default", fn, good, bad,
               fail=[f"{fn}({(key + ' ' + sep + ' ' + val)!r})", f"{fn}({('x' + sep + 'y')!r})"],
               keep=[f"{fn}({(key + '|' + val)!r}, sep='|')", f"{fn}('  {key}  ', sep='|')"],
               summary=f"`{fn}` should split on {sep!r} when no separator is given")


def backoff(rng: random.Random) -> Bug:
    fn = _pick(rng, "backoff_delays", "retry_delays", "wait_times")
    base = rng.choice([1, 2, 3, 5, 10])
    n = rng.randrange(3, 6)
    good = (f"def {fn}(attempts, base={base}):\n"
            f'    """Delays before each of `attempts` retries: base, 2*base, 4*base, ..."""\n'
            f"    return [base * 2 ** i for i in range(attempts)]\n")
    bad = good.replace("range(attempts)", "range(1, attempts)")
    return Bug("backoff", "off_by_one", fn, good, bad,
               fail=[f"{fn}({n})", f"{fn}(1, base={base + 1})"], keep=[f"{fn}(0)"],
               summary=f"`{fn}` should give one delay per attempt, starting at base")


def share(rng: random.Random) -> Bug:
    inner = _pick(rng, "split_evenly", "per_part", "even_share")
    fn = _pick(rng, "share_per_person", "allowance", "budget_each")
    total, people = rng.randrange(100, 900), rng.randrange(3, 9)
    good = (f"def {inner}(total, count):\n"
            f'    """Each of `count` equal parts of `total`, rounded down (0 for no parts)."""\n'
            f"    if count == 0:\n"
            f"        return 0\n"
            f"    return total // count\n"
            f"\n\n"
            f"def {fn}(budget, people):\n"
            f'    """How much each person gets from the budget."""\n'
            f"    return {inner}(budget, people)\n")
    bad = good.replace(f"return {inner}(budget, people)", f"return {inner}(people, budget)")
    return Bug("share", "swapped_args", fn, good, bad,
               fail=[f"{fn}({total}, {people})", f"{fn}({total * 2}, {people + 1})"],
               keep=[f"{fn}(0, 0)", f"{inner}({total}, {people})"],
               summary=f"`{fn}` should divide the budget among the people", helpers=[inner])


def leap(rng: random.Random) -> Bug:
    fn = _pick(rng, "is_leap", "leap_year", "has_feb_29")
    century = rng.choice([1600, 2000, 2400])
    good = (f"def {fn}(year):\n"
            f'    """Whether year is a leap year in the Gregorian calendar."""\n'
            f"    if year % 400 == 0:\n"
            f"        return True\n"
            f"    if year % 100 == 0:\n"
            f"        return False\n"
            f"    return year % 4 == 0\n")
    bad = good.replace("    if year % 400 == 0:\n        return True\n", "")
    return Bug("leap", "missing_edge_case", fn, good, bad,
               fail=[f"{fn}({century})", f"{fn}({century + 400 * rng.randrange(1, 3)})"],
               keep=[f"{fn}({century + 100})", f"{fn}({rng.randrange(1901, 1999)})", f"{fn}(2024)"],
               summary=f"`{fn}` should treat years divisible by 400 as leap years")


def slug(rng: random.Random) -> Bug:
    fn = _pick(rng, "slugify", "make_slug", "url_name")
    sep = rng.choice(["-", "_", "."])
    words = rng.sample(["Big", "Red", "Fast", "Old", "New", "Blue", "Cat", "Box", "Tree", "Road"], 3)
    good = (f'def {fn}(title, sep="{sep}"):\n'
            f'    """Lower-case slug of title: its words joined by sep."""\n'
            f"    return sep.join(title.lower().split())\n")
    bad = good.replace("title.lower().split()", "title.split()")
    return Bug("slug", "missing_step", fn, good, bad,
               fail=[f"{fn}({' '.join(words)!r})", f"{fn}({words[0].upper()!r})"],
               keep=[f"{fn}({' '.join(w.lower() for w in words)!r})", f"{fn}('')"],
               summary=f"`{fn}` should lower-case the title")


def inclusive_sum(rng: random.Random) -> Bug:
    fn = _pick(rng, "sum_between", "range_total", "sum_inclusive")
    a = rng.randrange(1, 20)
    b = a + rng.randrange(2, 15)
    good = (f"def {fn}(start, stop):\n"
            f'    """Sum of the integers from start to stop, both included."""\n'
            f"    return sum(range(start, stop + 1))\n")
    bad = good.replace("range(start, stop + 1)", "range(start, stop)")
    return Bug("inclusive_sum", "off_by_one", fn, good, bad,
               fail=[f"{fn}({a}, {b})", f"{fn}({b}, {b})"], keep=[f"{fn}({b}, {a})", f"{fn}(0, 0)"],
               summary=f"`{fn}` should include stop in the sum")


def best_record(rng: random.Random) -> Bug:
    fn = _pick(rng, "best_record", "top_entry", "max_by_field")
    fld = _pick(rng, "score", "points", "sales", "age")
    vals = rng.sample(range(1, 99), 3)
    recs = [{"id": i, fld: v} for i, v in enumerate(vals)]
    good = (f"def {fn}(records, field):\n"
            f'    """The record with the largest value of field (the first on ties); None when empty."""\n'
            f"    best = None\n"
            f"    for record in records:\n"
            f"        if best is None or record[field] > best[field]:\n"
            f"            best = record\n"
            f"    return best\n")
    bad = good.replace("record[field] > best[field]", "record[field] < best[field]")
    return Bug("best_record", "wrong_operator", fn, good, bad,
               fail=[f"{fn}({recs}, {fld!r})", f"{fn}({recs[::-1]}, {fld!r})"],
               keep=[f"{fn}([], {fld!r})", f"{fn}({recs[:1]}, {fld!r})"],
               summary=f"`{fn}` should return the record with the largest {fld}")


TEMPLATES = [clamp, chunk, mean, count_long, discount, last_n, parse_pair, backoff, share, leap, slug,
             inclusive_sum, best_record]
