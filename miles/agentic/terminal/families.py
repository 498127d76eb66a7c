"""Terminal task families: each turns a seeded RNG into one task (instruction, files, oracle, checks).

A family is a function `rng -> TaskParts` (`rng` a `TaskRng`: its word, service and city pools
are the train ones or the held-out ones, disjoint, so a held-out task names nothing a train task
names). `tasks.py` writes the parts out in Harbor layout; the
families only decide what the task is.

Design decisions:
- Every expected value is computed here, in Python, and baked into the hidden checks: the verifier
  never recomputes it from files the agent could have changed.
- Ordering is byte order everywhere (instructions say `LC_ALL=C`), so Python's `sorted` on these
  ASCII strings and the shell's sort agree whatever the sandbox's locale.
- The initial state always fails the checks (the answer file is absent, the old value still there,
  the mode still 644): the null agent must score 0 on every task, and the generator asserts
  the conditions that would break it (e.g. a config whose broken key happens to be right).
- Files are ASCII text (the episode path writes `metadata["files"]` as text); the archive to
  extract is an uncompressed ustar of ASCII files, which is itself ASCII.
- Checks are bash lines over three helpers of the verifier script (`fail`, `same`, `same_word`),
  so each family's check reads as a list of conditions.
"""

from __future__ import annotations

import hashlib
import io
import itertools
import random
import tarfile
from dataclasses import dataclass, field

WORK = "/workspace"
WORDS = ("amber", "basil", "cedar", "delta", "ember", "fjord", "garnet", "harbor", "indigo", "juniper",
         "kelp", "lumen", "maple", "nectar", "onyx", "pepper", "quartz", "raven", "sierra", "tundra",
         "umber", "violet", "willow", "xenon", "yarrow", "zephyr", "acorn", "birch", "cobalt", "dune")
SERVICES = ("auth", "billing", "cache", "gateway", "indexer", "mailer", "payments", "search", "storage",
            "worker")
CITIES = ("oslo", "lima", "quito", "hanoi", "dakar", "perth", "turin", "kyoto", "porto", "cairo", "delhi")
# the held-out tasks' names: none of them occurs in a train task (a test checks it)
HELDOUT_WORDS = ("alder", "bramble", "canyon", "dahlia", "egret", "falcon", "glacier", "hazel", "iris",
                 "jasper", "kestrel", "lotus", "meadow", "nutmeg", "orchid", "pebble", "quill", "rowan",
                 "saffron", "thistle", "upland", "vervain", "walnut", "xylem", "yew", "zinnia", "aspen",
                 "bluff", "cinder", "dusk")
HELDOUT_SERVICES = ("ledger", "notifier", "profiler", "queue", "router", "scheduler", "tracer",
                    "uploader", "vault", "webhook")
HELDOUT_CITIES = ("accra", "baku", "cusco", "doha", "essen", "fargo", "goa", "hilo", "izmir", "jeddah",
                  "kobe")
# The CPU task set's names: coined two-syllable words (4,900), split by a hash into train (3/4)
# and held-out (1/4) pools, so a model that solves held-out tasks copies names it never saw in
# training (with 30 train words it could learn them instead of learning to copy).
_ONSETS, _VOWELS = "bdfgklmnprstvz", "aeiou"
# words the instructions, files and commands use themselves are no names (a test checks it)
_RESERVED = {"base", "data", "done", "dune", "file", "line", "make", "mode", "more", "name", "node",
             "none", "note", "pipe", "role", "same", "side", "size", "sole", "time", "todo", "zero"}
COINED = tuple(w for w in (a + b + c + d for a, b, c, d in itertools.product(_ONSETS, _VOWELS, _ONSETS, _VOWELS))
               if w not in _RESERVED)


def coined_heldout(word: str) -> bool:
    return hashlib.sha256(word.encode()).digest()[0] % 4 == 0


COINED_TRAIN = tuple(w for w in COINED if not coined_heldout(w))
COINED_HELDOUT = tuple(w for w in COINED if coined_heldout(w))
LEVELS = ("INFO", "WARN", "ERROR", "DEBUG")
EXTS = ("log", "txt", "csv", "md", "json", "cfg")


@dataclass
class TaskParts:
    family: str
    instruction: str
    files: dict[str, str]              # absolute sandbox path -> text (the environment)
    solve: str                         # solution/solve.sh body (bash)
    checks: list[str]                  # bash lines of tests/test.sh, after the helpers
    tags: list[str] = field(default_factory=list)
    # the "brief" task set's instruction and command: the same task in a few words, paths relative
    # to WORK (the sandbox's workdir); "" for the families outside CPU_FAMILIES
    brief: str = ""
    brief_solve: str = ""


class TaskRng(random.Random):
    """A family's RNG and the name pools it draws from: the train pools, or the held-out ones;
    `coined`: every name (word, service, city) from the coined pool of that side, and the
    families' fixed directory names replaced by one too (no held-out prompt repeats a train one)."""

    def __init__(self, seed: str, heldout: bool = False, coined: bool = False):
        super().__init__(seed)
        self.coined = coined
        if coined:
            self.words = self.services = self.cities = COINED_HELDOUT if heldout else COINED_TRAIN
            return
        self.words = HELDOUT_WORDS if heldout else WORDS
        self.services = HELDOUT_SERVICES if heldout else SERVICES
        self.cities = HELDOUT_CITIES if heldout else CITIES


def _names(rng: random.Random, pool: tuple[str, ...], k: int) -> list[str]:
    return rng.sample(pool, k)


def _dir(rng: TaskRng, fixed: tuple[str, ...]) -> str:
    """A fixed directory name (drawn as the "all" set always drew it), or with coined names a
    coined one."""
    if rng.coined:
        return rng.choice(rng.words)
    return fixed[0] if len(fixed) == 1 else rng.choice(fixed)


def rel(path: str) -> str:
    """A path under WORK as the brief set writes it: relative to the workdir."""
    return path.removeprefix(WORK + "/")


def _heredoc(path: str, text: str, tag: str = "MILES_EXPECTED") -> str:
    """`same PATH` fed the expected text through a quoted heredoc (no expansion)."""
    assert tag not in text
    return f"same {path} <<'{tag}'\n{text}\n{tag}"


def grep_count(rng: random.Random) -> TaskParts:
    svc, level = rng.choice(rng.services), rng.choice(LEVELS)
    lines, n = [], rng.randint(25, 60)
    for i in range(n):
        lv = rng.choice(LEVELS)
        words = " ".join(rng.sample(rng.words, 3))
        lines.append(f"2026-03-{1 + i % 28:02d}T{rng.randrange(24):02d}:{rng.randrange(60):02d}:00 {lv} {svc}: {words}")
    count = sum(line.split()[1] == level for line in lines)
    if count == 0:
        lines[0] = lines[0].replace(lines[0].split()[1], level, 1)
        count = 1
    path = f"{WORK}/logs/{svc}.log"
    return TaskParts(
        "grep-count",
        f"How many lines of `{path}` have the level `{level}` (the second field)? Write the number, "
        f"and nothing else, to `{WORK}/answer.txt`.",
        {path: "\n".join(lines) + "\n"},
        f"awk '$2 == \"{level}\"' {path} | wc -l > {WORK}/answer.txt",
        [f"same_word {WORK}/answer.txt {count}"], ["text", "grep"],
        # the level is the only upper-case word of a line: the second field, between spaces
        f"Count the {level} lines of {rel(path)} into answer.txt.",
        f"grep -c ' {level} ' {rel(path)} > answer.txt")


def sort_unique(rng: random.Random) -> TaskParts:
    vocab = _names(rng, rng.words, rng.randint(6, 12))
    words = [rng.choice(vocab) for _ in range(rng.randint(20, 40))]
    stem = _dir(rng, ("words", "tags", "labels", "colors", "names"))
    src, dst = f"{WORK}/data/{stem}.txt", f"{WORK}/{stem}-{rng.choice(('unique', 'distinct', 'set'))}.txt"
    want = "\n".join(sorted(set(words)))
    reverse = rng.random() < 0.5
    if reverse:
        want = "\n".join(sorted(set(words), reverse=True))
    order = "reverse byte order" if reverse else "byte order"
    return TaskParts(
        "sort-unique",
        f"`{src}` has one word per line, with repeats. Write each distinct word once, sorted in {order} "
        f"(as `LC_ALL=C sort{' -r' if reverse else ''}` does), one per line, to `{dst}`.",
        {src: "\n".join(words) + "\n"},
        f"LC_ALL=C sort -u{' -r' if reverse else ''} {src} > {dst}",
        [_heredoc(dst, want)], ["text", "sort"],
        f"Sort the distinct words of {rel(src)}{' in reverse' if reverse else ''} into {rel(dst)}.",
        f"LC_ALL=C sort -u{' -r' if reverse else ''} {rel(src)} > {rel(dst)}")


def top_value(rng: random.Random) -> TaskParts:
    column = rng.choice(("city", "product"))
    cities = _names(rng, rng.cities if column == "city" else rng.words, rng.randint(4, 7))
    weights = [rng.randint(1, 9) for _ in cities]
    top = max(range(len(cities)), key=lambda i: weights[i])
    weights[top] += 3  # a unique winner
    rows = [c for c, w in zip(cities, weights) for _ in range(w)]
    rng.shuffle(rows)
    path = f"{WORK}/{rng.choice(('sales', 'orders', 'visits'))}-{rng.randint(2020, 2026)}.csv"
    cols = ["customer", column, "amount"]
    k = rng.randrange(3)
    cols.insert(k, "id") if k != 1 else None
    def line(i: int, c: str) -> str:
        values = {"customer": f"{rng.choice(rng.words)}{i}", column: c, "amount": str(rng.randint(5, 500)), "id": str(i)}
        return ",".join(values[x] for x in cols) + "\n"
    body = ",".join(cols) + "\n" + "".join(line(i, c) for i, c in enumerate(rows))
    return TaskParts(
        "top-value",
        f"Which {column} occurs most often in the `{column}` column of `{path}` (a CSV with a header "
        f"line)? Write it, and nothing else, to `{WORK}/answer.txt`.",
        {path: body},
        # the column found by its name (in the prompt), not by its position (only in the file)
        f"awk -F, 'NR == 1 {{for (i = 1; i <= NF; i++) if ($i == \"{column}\") c = i; next}} "
        f"{{print $c}}' {path} | sort | uniq -c | sort -rn | head -1 | awk '{{print $2}}' > {WORK}/answer.txt",
        [f"same_word {WORK}/answer.txt {cities[top]}"], ["text", "uniq"])


def column_sum(rng: random.Random) -> TaskParts:
    items = _names(rng, rng.words, 5)
    item = items[0]
    rows = [(i, rng.choice(items), rng.randint(1, 40), rng.randint(1, 99)) for i in range(rng.randint(15, 30))]
    rows[rng.randrange(len(rows))] = (0, item, rng.randint(1, 40), 7)
    path = f"{WORK}/orders.csv"
    body = "id,item,qty,price\n" + "".join(f"{i + 1},{it},{q},{p}\n" for i, (_, it, q, p) in enumerate(rows))
    total = sum(q for _, it, q, _ in rows if it == item)
    return TaskParts(
        "column-sum",
        f"`{path}` is a CSV with the header `id,item,qty,price`. Write the sum of `qty` over the rows whose "
        f"item is `{item}`, and nothing else, to `{WORK}/answer.txt`.",
        {path: body},
        f"awk -F, 'NR > 1 && $2 == \"{item}\" {{s += $3}} END {{print s}}' {path} > {WORK}/answer.txt",
        [f"same_word {WORK}/answer.txt {total}"], ["text", "awk"],
        # no item is named "item": the header row never matches
        f"Sum the qty of item {item} in orders.csv into answer.txt.",
        f"awk -F, '$2 == \"{item}\" {{s += $3}} END {{print s}}' orders.csv > answer.txt")


def sed_replace(rng: random.Random) -> TaskParts:
    old = f"{rng.choice(rng.words)}-db{rng.randint(1, 9)}"
    new = f"{rng.choice(rng.words)}-db{rng.randint(10, 99)}"
    files, expected = {}, {}
    for name in _names(rng, rng.services, rng.randint(2, 4)):
        lines = [f"# {name} settings", f"name = {name}"]
        for k in range(rng.randint(2, 4)):
            lines.append(f"replica{k} = {old}:{5432 + k}" if rng.random() < 0.7 else f"mirror{k} = {old}")
        lines.append(f"timeout = {rng.randint(1, 60)}")
        text = "\n".join(lines) + "\n"
        if old not in text:
            text += f"primary = {old}\n"
        files[f"{WORK}/etc/{name}.conf"] = text
        expected[f"{WORK}/etc/{name}.conf"] = text.replace(old, new)
    notes = f"{WORK}/etc/NOTES.txt"
    files[notes] = expected[notes] = f"the old host {old} is kept here on purpose\n"
    checks = [_heredoc(p, t.rstrip("\n")) for p, t in expected.items()]
    return TaskParts(
        "sed-replace",
        f"The database host `{old}` was renamed `{new}`. Replace every occurrence of `{old}` with `{new}` "
        f"in all `.conf` files under `{WORK}/etc`. Do not change any other file or line.",
        files, f"sed -i 's/{old}/{new}/g' {WORK}/etc/*.conf", checks, ["text", "sed"],
        f"Replace {old} with {new} in etc/*.conf.", f"sed -i s/{old}/{new}/g etc/*.conf")


def fix_config(rng: random.Random) -> TaskParts:
    port, good_level = rng.randint(1025, 9999), rng.choice(("debug", "info", "warning"))
    wrong_port = port + rng.randint(1, 50)
    wrong_level = rng.choice([x for x in ("debug", "info", "warning", "error") if x != good_level])
    svc = rng.choice(rng.services)
    typo = rng.random() < 0.5
    path = f"{WORK}/{svc}/config.ini"
    head = ["[service]", f"name = {svc}", f"workers = {rng.randint(1, 16)}", "", "[server]",
            "host = 0.0.0.0"]
    good = head + [f"port = {port}", f"log_level = {good_level}", "", "[cache]", f"size_mb = {rng.randint(8, 512)}"]
    broken = list(good)
    broken[6] = f"prot = {port}" if typo else f"port = {wrong_port}"
    broken[7] = f"log_level = {wrong_level}"
    assert broken != good
    fix = ("the key `prot` is a typo of `port`, " if typo else "") + f"it must listen on port {port}"
    solve = (f"sed -i -e 's/^prot = /port = /' -e 's/^port = .*/port = {port}/' "
             f"-e 's/^log_level = .*/log_level = {good_level}/' {path}")
    return TaskParts(
        "fix-config",
        f"The service config `{path}` is broken: {fix}, and it must log at level `{good_level}`. Fix "
        f"`{path}` in place; leave every other line as it is.",
        {path: "\n".join(broken) + "\n"}, solve, [_heredoc(path, "\n".join(good))], ["config", "sed"])


def archive_create(rng: random.Random) -> TaskParts:
    d = _dir(rng, ("docs", "reports", "notes", "drafts"))
    files = {}
    for name in _names(rng, rng.words, rng.randint(2, 4)):
        files[f"{WORK}/{d}/{name}.txt"] = f"{name} {rng.randint(100, 999)}\n"
    sub = rng.choice(rng.words)
    files[f"{WORK}/{d}/{sub}/index.md"] = f"# {sub}\n"
    gz = rng.random() < 0.6
    out = f"{WORK}/{d}-{rng.choice(('backup', 'snapshot', 'archive'))}{rng.randint(1, 9)}.tar{'.gz' if gz else ''}"
    z = "z" if gz else ""
    members = sorted(p.removeprefix(f"{WORK}/") for p in files)
    checks = [f"[ -f {out} ] || fail 'no archive {out}'",
              f"gzip -t {out} 2>/dev/null || fail 'not gzip-compressed'" if gz else
              f"gzip -t {out} 2>/dev/null && fail 'compressed, expected a plain tar'",
              f"tar -t{z}f {out} | grep -v '/$' | sed 's|^\\./||' | LC_ALL=C sort > /tmp/members.txt",
              _heredoc("/tmp/members.txt", "\n".join(members)),
              f"rm -rf /tmp/unpacked && mkdir -p /tmp/unpacked && tar -x{z}f {out} -C /tmp/unpacked"]
    checks += [_heredoc(f"/tmp/unpacked/{m}", files[f"{WORK}/{m}"].rstrip("\n")) for m in members]
    return TaskParts(
        "archive-create",
        f"Make a {'gzip-compressed' if gz else 'plain (uncompressed)'} tar archive `{out}` of the directory "
        f"`{WORK}/{d}`, with member paths relative to `{WORK}` (they start with `{d}/`).",
        files, f"cd {WORK} && tar -c{z}f {out} {d}", checks, ["archive", "tar"],
        f"Tar {d} into {rel(out)}.", f"tar -c{z}f {rel(out)} {d}")   # .gz in the name: compressed


def _ascii_tar(members: dict[str, str]) -> str:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.USTAR_FORMAT) as tar:
        for name, text in members.items():
            data = text.encode("ascii")
            info = tarfile.TarInfo(name)
            info.size, info.mode, info.mtime = len(data), 0o644, 1700000000
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue().decode("ascii")


def archive_extract(rng: random.Random) -> TaskParts:
    version = f"{rng.randint(1, 4)}.{rng.randint(0, 20)}.{rng.randint(0, 9)}"
    top = f"release-{version}"
    members = {f"{top}/VERSION": version + "\n"}
    for name in _names(rng, rng.words, rng.randint(2, 4)):
        members[f"{top}/{rng.choice(('bin', 'lib', 'share'))}/{name}.txt"] = f"{name}={rng.randint(0, 9999)}\n"
    dest = rng.choice(("opt", "unpacked", "srv"))
    tar = f"{WORK}/{rng.choice(('bundle', 'dist', 'pkg'))}-{rng.choice(rng.words)}.tar"
    checks = [_heredoc(f"{WORK}/{dest}/{m}", t.rstrip("\n")) for m, t in members.items()]
    checks.append(f"same_word {WORK}/version.txt {version}")
    return TaskParts(
        "archive-extract",
        f"Extract the tar archive `{tar}` into the directory `{WORK}/{dest}` (create it), "
        f"then write the release version, read from the `VERSION` file inside, to `{WORK}/version.txt`.",
        {tar: _ascii_tar(members)},
        f"mkdir -p {WORK}/{dest} && tar -xf {tar} -C {WORK}/{dest} && "   # the top dir: only in the tar
        f"cat {WORK}/{dest}/*/VERSION > {WORK}/version.txt",
        checks, ["archive", "tar"])


def permissions(rng: random.Random) -> TaskParts:
    script, key = rng.choice(rng.services), rng.choice(rng.words)
    word = rng.choice(rng.words)
    sp, kp = f"{WORK}/scripts/{script}.sh", f"{WORK}/keys/{key}.pem"
    mode = rng.choice(("755", "700", "750"))
    return TaskParts(
        "permissions",
        f"Give `{sp}` the mode `{mode}` so that it can be run, and make the key `{kp}` readable and "
        f"writable by its owner only (mode `600`).",
        {sp: f"#!/bin/sh\necho {word}\n", kp: f"-----BEGIN KEY-----\n{rng.getrandbits(64):016x}\n-----END KEY-----\n"},
        f"chmod {mode} {sp} && chmod 600 {kp}",
        [f"[ \"$(stat -c %a {sp})\" = {mode} ] || fail \"mode of {sp} is $(stat -c %a {sp})\"",
         f"[ \"$(stat -c %a {kp})\" = 600 ] || fail \"mode of {kp} is $(stat -c %a {kp})\"",
         f"[ \"$({sp})\" = {word} ] || fail '{sp} does not run'"], ["permissions"],
        f"Set mode {mode} on {rel(sp)} and 600 on {rel(kp)}.", f"chmod {mode} {rel(sp)} && chmod 600 {rel(kp)}")


def _tree(rng: random.Random, root: str) -> dict[str, str]:
    files = {}
    dirs = ["", *(f"{a}/" for a in _names(rng, rng.words, 3)), f"{rng.choice(rng.words)}/{rng.choice(rng.words)}/"]
    for _ in range(rng.randint(10, 16)):
        name = f"{rng.choice(dirs)}{rng.choice(rng.words)}{rng.randint(1, 99)}.{rng.choice(EXTS)}"
        files[f"{root}/{name}"] = "x" * rng.choice((3, 40, 120, 300, 900)) + "\n"
    return files


def find_files(rng: random.Random) -> TaskParts:
    root, out = f"{WORK}/tree", f"{WORK}/found.txt"
    files = _tree(rng, root)
    by_size = rng.random() < 0.5
    if by_size:
        limit = rng.choice((100, 200, 500))
        hits = sorted(p.removeprefix(root + "/") for p, t in files.items() if len(t) > limit)
        what = f"larger than {limit} bytes"
        solve = f"cd {root} && find . -type f -size +{limit}c | sed 's|^\\./||' | LC_ALL=C sort > {out}"
    else:
        ext = rng.choice(EXTS)
        files[f"{root}/{rng.choice(rng.words)}.{ext}.bak"] = "old\n"   # *.ext must not match it
        files[f"{root}/{rng.choice(rng.words)}/{rng.choice(rng.words)}0.{ext}"] = "new\n"
        hits = sorted(p.removeprefix(root + "/") for p in files if p.endswith("." + ext))
        what = f"whose name ends in `.{ext}`"
        solve = f"cd {root} && find . -type f -name '*.{ext}' | sed 's|^\\./||' | LC_ALL=C sort > {out}"
    if not hits:   # a tree without a match: draw another (the RNG has moved on)
        return find_files(rng)
    return TaskParts(
        "find-files",
        f"List every file under `{root}` (any depth) {what}: their paths relative to `{root}` "
        f"(no leading `./`), sorted in byte order (`LC_ALL=C sort`), one per line, in `{out}`.",
        files, solve, [_heredoc(out, "\n".join(hits))], ["find"])


def write_script(rng: random.Random) -> TaskParts:
    op, word = rng.choice((("sum", "+"), ("product", "*"), ("difference (first minus second)", "-")))
    name = f"{rng.choice(rng.words)}-{op.split()[0]}"
    path = f"{WORK}/bin/{name}"
    pairs = [(rng.randint(-50, 99), rng.randint(0, 99)) for _ in range(3)]
    checks = [f"[ -x {path} ] || fail '{path} is not executable'"]
    for a, b in pairs:
        want = a + b if word == "+" else a * b if word == "*" else a - b
        checks.append(f"got=$({path} {a} {b} 2>/dev/null); [ \"$got\" = {want} ] || fail \"{name} {a} {b}: $got\"")
    return TaskParts(
        "write-script",
        f"Write an executable script `{path}` that takes two integer arguments and prints their {op}, "
        f"and nothing else.",
        {f"{WORK}/bin/README": "put scripts here\n"},
        f"cat > {path} <<'EOF'\n#!/bin/bash\necho $(( $1 {word} $2 ))\nEOF\nchmod +x {path}",
        checks, ["script"])


def rename_ext(rng: random.Random) -> TaskParts:
    d, src, dst = f"{WORK}/{_dir(rng, ('inbox',))}", rng.choice(("txt", "log")), rng.choice(("md", "bak"))
    files, after = {}, {}
    for name in _names(rng, rng.words, rng.randint(3, 6)):
        files[f"{d}/{name}.{src}"] = after[f"{d}/{name}.{dst}"] = f"{name}\n"
    keep = f"{d}/{rng.choice(rng.words)}.csv"
    files[keep] = after[keep] = "a,b\n"
    listing = "\n".join(sorted(p.removeprefix(d + "/") for p in after))
    checks = [f"(cd {d} && ls -A | LC_ALL=C sort) > /tmp/listing.txt", _heredoc("/tmp/listing.txt", listing)]
    checks += [_heredoc(p, t.rstrip("\n")) for p, t in after.items()]
    return TaskParts(
        "rename-ext",
        f"Rename every `.{src}` file in `{d}` to the same name with the extension `.{dst}` (so `a.{src}` "
        f"becomes `a.{dst}`). Leave the other files alone.",
        files, f"cd {d} && for f in *.{src}; do mv \"$f\" \"${{f%.{src}}}.{dst}\"; done", checks, ["files"],
        f"Rename {rel(d)}/*.{src} to *.{dst}.",
        f"cd {rel(d)} && for f in *.{src}; do mv \"$f\" \"${{f%.{src}}}.{dst}\"; done")


def grep_which(rng: random.Random) -> TaskParts:
    d = f"{WORK}/{_dir(rng, ('notes',))}"
    token = f"TICKET-{rng.randint(1000, 9999)}"
    names = [f"{w}.txt" for w in _names(rng, rng.words, rng.randint(5, 9))]
    files = {f"{d}/{n}": " ".join(rng.sample(rng.words, 6)) + f"\nref TICKET-{rng.randint(10, 999)}\n" for n in names}
    target = rng.choice(names)
    files[f"{d}/{target}"] += f"see {token} for details\n"
    return TaskParts(
        "grep-which",
        f"Exactly one file in `{d}` mentions `{token}`. Write its file name (without the directory), and "
        f"nothing else, to `{WORK}/answer.txt`.",
        files, f"grep -l '{token}' {d}/* | xargs -n1 basename > {WORK}/answer.txt",
        [f"same_word {WORK}/answer.txt {target}"], ["grep", "find"],
        f"Which file in {rel(d)} has {token}? Its name into answer.txt.",
        f"cd {rel(d)} && grep -l {token} * > ../answer.txt")


def set_difference(rng: random.Random) -> TaskParts:
    users = [f"{w}{rng.randint(1, 9)}" for w in _names(rng, rng.words, rng.randint(8, 14))]
    done = rng.sample(users, rng.randint(2, len(users) - 3))
    todo = [u for u in users if u not in done]
    shuffled = list(done)
    rng.shuffle(shuffled)
    team = rng.choice(rng.services)
    a, b = f"{WORK}/{team}-members.txt", f"{WORK}/{team}-{rng.choice(('trained', 'onboarded', 'paid'))}.txt"
    out = f"{WORK}/{team}-{rng.choice(('todo', 'report', 'result'))}.txt"
    inter = rng.random() < 0.4
    want = [u for u in users if u in done] if inter else todo
    which = "that are also in" if inter else "that are not in"
    return TaskParts(
        "set-difference",
        f"`{a}` and `{b}` list user names, one per line. Write the names of `{a}` {which} `{b}`, in the "
        f"order of `{a}`, one per line, to `{out}`.",
        {a: "\n".join(users) + "\n", b: "\n".join(shuffled) + "\n"},
        f"grep -{'' if inter else 'v'}xFf {b} {a} > {out}",
        [_heredoc(out, "\n".join(want))], ["text", "grep"],
        f"Names of {rel(a)} {'also' if inter else 'not'} in {rel(b)} into {rel(out)}.",
        f"grep -{'' if inter else 'v'}xFf {rel(b)} {rel(a)} > {rel(out)}")


def filter_csv(rng: random.Random) -> TaskParts:
    roles = ("admin", "editor", "viewer", "owner")
    role = rng.choice(roles)
    rows = [(f"{w}{i}", rng.choice(roles)) for i, w in enumerate(rng.sample(rng.words, rng.randint(8, 14)))]
    if not any(r == role for _, r in rows):
        rows[0] = (rows[0][0], role)
    org = _dir(rng, ("acme", "globex", "initech", "umbrella", "hooli"))
    field = rng.choice(("name", "email"))
    path, out = f"{WORK}/{org}/users.csv", f"{WORK}/{org}-{role}-{field}s.txt"
    body = "name,role,email\n" + "".join(f"{n},{r},{n}@{org}.example\n" for n, r in rows)
    want = "\n".join(n if field == "name" else f"{n}@{org}.example" for n, r in rows if r == role)
    return TaskParts(
        "filter-csv",
        f"`{path}` is a CSV with the header `name,role,email`. Write the {field}s of the users whose role "
        f"is `{role}`, in file order, one per line, to `{out}`.",
        {path: body}, f"awk -F, 'NR > 1 && $2 == \"{role}\" {{print ${1 if field == 'name' else 3}}}' {path} > {out}",
        [_heredoc(out, want)], ["text", "awk"],
        f"The {field}s of role {role} in {rel(path)} into {rel(out)}.",
        f"awk -F, '$2 == \"{role}\" {{print ${1 if field == 'name' else 3}}}' {rel(path)} > {rel(out)}")


FAMILIES = (grep_count, sort_unique, top_value, column_sum, sed_replace, fix_config, archive_create,
            archive_extract, permissions, find_files, write_script, rename_ext, grep_which,
            set_difference, filter_csv)

# The CPU task set (`tasks.terminal_tasks_cpu`): the families whose command is one fixed shape with
# the prompt's names and values copied in (up to ~95 tokens with the tiny tokenizer), graded by how
# much is copied. A 2-layer model learns these shapes from many coined-name tasks; the longer
# families above (awk programs over a column found by name, heredoc scripts) it cannot.
CPU_FAMILIES = (sed_replace, archive_create, sort_unique, rename_ext, grep_count, permissions, grep_which,
                set_difference, column_sum, filter_csv)
DIFFICULTY = {"sed-replace": "easy", "archive-create": "easy", "sort-unique": "easy", "rename-ext": "easy",
              "grep-count": "medium", "permissions": "medium", "grep-which": "medium",
              "set-difference": "medium", "column-sum": "hard", "filter-csv": "hard"}
