"""Tests of configurator.py: defaults < config file < --options, and every bad value as one UsageError."""
from dataclasses import dataclass

import pytest

from configurator import UsageError, check, parse, setting


@dataclass
class Demo:
    lr: float = setting(1e-3, "learning rate", lo=0.0, hi=1.0)
    mode: str = setting("a", "a mode", choices=("a", "b"))
    steps: int = setting(10, "steps", lo=1)
    flag: bool = setting(True, "a switch")


def test_defaults_then_config_file_then_options_each_coerced_to_its_type(tmp_path):
    preset = tmp_path / "p.py"
    preset.write_text("lr = 0.5\nsteps = 20\n")
    values, given = parse([str(preset), "--steps", "30", "--no_flag", "--mode=b"], (Demo,), "")
    assert values == {"lr": 0.5, "mode": "b", "steps": 30, "flag": False} and given == {"steps", "flag", "mode"}
    assert parse(["--flag=false"], (Demo,), "")[0]["flag"] is False


@pytest.mark.parametrize("argv, message", [
    (["--lr", "2"], "--lr 2.0 is invalid; it must be >= 0.0 and <= 1.0"),
    (["--lr", "nan"], "--lr nan is invalid; it must be a finite number"),
    (["--mode", "c"], "--mode 'c' is invalid; choose one of a, b"),
    (["--steps", "x"], "--steps expects int, got 'x'"),
    (["--step", "3"], "unknown option --step; see --help"),
    (["--steps"], "--steps needs a value"),
])
def test_a_bad_value_is_one_usage_error_naming_the_option(argv, message):
    with pytest.raises(UsageError) as e:
        check(Demo(**parse(argv, (Demo,), "")[0]))
    assert str(e.value) == message


def test_a_config_file_with_an_unknown_setting_names_the_file(tmp_path):
    preset = tmp_path / "p.py"
    preset.write_text("lrate = 0.5\n")
    with pytest.raises(UsageError, match=f"unknown {preset}: setting lrate"):
        parse([str(preset)], (Demo,), "")
