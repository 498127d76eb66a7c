"""Each kind of bad recipe gets one clear error naming the key path, the value and the expectation."""

import subprocess
import sys

import pytest

from miles.config import RecipeError, load_recipe

GOOD = '''
[run]
name = "t"
[actors.driver]
class = "miles.demo:DemoDriver"
main = true
'''


@pytest.mark.parametrize("text, overrides, expected", [
    ('[run]\nnmae = "x"', [], r"run\.nmae: unknown key; expected one of: name, "),
    ('[cluster]\nhead_port = "abc"', [], r"cluster\.head_port = 'abc': expected `int`, got `str`"),
    ('[actors.a]\nclass = "m:C"\nnode = "z"', [], r"actors\.a\.node = 'z': expected `int`"),
    ('[actors.a]\nclass = "m:C"\nfoo = 1', [], r"actors\.a\.foo: unknown key"),
    ('[actors.a]\nnode = 1', [], r"actors\.a\.class: required key is missing"),
    ('[actors.a]\nclass = "mC"', [], r"actors\.a\.class = 'mC': expected 'module:Class'"),
    ('[actors.a]\nclass = "m:C"\nrestart = {max_restart = 2}', [], r"actors\.a\.restart\.max_restart: unknown key"),
    ('[run', [], r"not valid TOML"),
    (GOOD, ["run.seed=abc"], r"run\.seed = 'abc': expected `int`, got `str`"),
    (GOOD, ["run.seed"], r"expected section\.key=value"),
    (GOOD, ["nosection.key=1"], r"nosection: unknown key"),
    ('[cluster]\nhead_port = 70000', [], r"cluster\.head_port = 70000"),
    ('[actors.a]\nclass = "m:C"\nmain = true\n[actors.b]\nclass = "m:C"\nmain = true', [], r"only one actor may be main"),
    ('[sft]\nsteps = 100\nuntil_heldout = 0.3\ncheck_every = 10\ncheck_from = 150', [],
     r"sft\.check_from = 150: expected at most sft\.steps \(100\)"),
    ('[sft]\nsteps = 100\nuntil_heldout = 0.3', [], r"sft\.check_every = 0: expected 1 to sft\.steps"),
])
def test_bad_recipes(text, overrides, expected):
    with pytest.raises(RecipeError, match=expected):
        load_recipe(text=text, overrides=overrides)


def test_a_recipe_without_a_warm_start_ignores_its_held_out_target():
    """sft.steps = 0 (a test's override of a recipe that stops its warm start at a target): no
    check runs, so none of the check's keys is refused."""
    r = load_recipe(text='[sft]\nsteps = 0\nuntil_heldout = 0.3\ncheck_every = 10\ncheck_from = 150\n'
                         '[eval]\nmode = "off"')
    assert r.sft.steps == 0


def test_overrides_are_typed_like_toml():
    r = load_recipe(text=GOOD, overrides=["run.seed=7", "run.name=other", "cluster.heartbeat_interval_s=0.5",
                                          "actors.driver.options={x = [1, 2]}"])
    assert (r.run.seed, r.run.name, r.cluster.heartbeat_interval_s) == (7, "other", 0.5)
    assert r.actors["driver"].options == {"x": [1, 2]}


def test_miles_check_cli(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text('[run]\nseed = "x"\n')
    out = subprocess.run([sys.executable, "-m", "miles.cli", "check", str(bad)], capture_output=True, text=True)
    assert out.returncode == 2 and "run.seed = 'x'" in out.stderr
    good = tmp_path / "good.toml"
    good.write_text(GOOD)
    out = subprocess.run([sys.executable, "-m", "miles.cli", "check", str(good)], capture_output=True, text=True)
    assert out.returncode == 0 and "recipe OK" in out.stdout and "driver" in out.stdout
    out = subprocess.run([sys.executable, "-m", "miles.cli", "check", str(tmp_path / "missing.toml")],
                         capture_output=True, text=True)
    assert out.returncode == 2 and "cannot read recipe" in out.stderr
