"""The flags every command spells alike: ``--log-level`` (with ``--loglevel`` and ``-v`` kept as
they were pinned), and ``agent-outbox --version``."""

from __future__ import annotations

from importlib.metadata import version

import pytest

from workers.cli.flags import log_level
from workers.cli.main import build_parser, main


def test_version_names_the_distribution(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0
    assert capsys.readouterr().out.strip() == f"agent-outbox-ledger {version('agent-outbox-ledger')}"


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["run", "--log-level", "debug"], "DEBUG"),
        (["run", "--loglevel", "WARNING"], "WARNING"),  # Celery's spelling, pinned before
        (["--log-level", "error", "run"], "ERROR"),  # before the subcommand: the same setting
        (["worker", "--loglevel", "info"], "INFO"),
        (["serve", "--log-level", "debug"], "DEBUG"),  # pinned before, lower case
        (["serve", "--loglevel", "warning"], "WARNING"),
        (["sandbox", "--log-level", "info"], "INFO"),
        (["sandbox", "--loglevel", "debug"], "DEBUG"),
        (["--log-level", "debug", "ops", "list"], "DEBUG"),
    ],
)
def test_every_command_with_a_log_level_reads_log_level_and_its_aliases(argv: list[str], expected: str) -> None:
    assert log_level(build_parser().parse_args(argv), "unset") == expected


def test_without_the_flag_each_command_keeps_its_default_and_v_still_counts() -> None:
    args = build_parser().parse_args(["-vv", "run"])
    assert args.verbose == 2 and log_level(args, "INFO") == "INFO"
    assert log_level(build_parser().parse_args(["serve"]), "info") == "INFO"


def test_an_unknown_level_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as done:
        build_parser().parse_args(["run", "--log-level", "loud"])
    assert done.value.code == 2 and "--log-level" in capsys.readouterr().err


def test_each_command_is_named_beside_the_module_that_registers_it():
    """A command loads only its own module (main.REGISTRARS): the names there must be exactly
    what each module registers, or a command would be missing or load the wrong module."""
    import argparse

    from workers.cli.main import REGISTRARS, _load

    for spec, names in REGISTRARS.items():
        sub = argparse.ArgumentParser().add_subparsers()
        register = _load(spec)
        assert register is not None, spec
        register(sub)
        assert tuple(sorted(sub.choices)) == tuple(sorted(names)), spec


@pytest.mark.parametrize(
    ("argv", "command"),
    [
        (["submit", "--key", "k"], "submit"),
        (["--log-level", "debug", "run"], "run"),
        (["--loglevel", "WARNING", "-v", "ops", "list"], "ops"),
        (["-vv", "--version"], "--version"),
        (["submit", "--help"], "submit"),
        (["--help"], None),
        ([], None),
    ],
)
def test_the_command_is_found_before_the_parser_loads_it(argv, command):
    from workers.cli.main import command_in

    assert command_in(argv) == command


def test_an_unknown_command_lists_every_choice(capsys):
    with pytest.raises(SystemExit):
        main(["no-such-command"])
    err = capsys.readouterr().err
    assert "invalid choice" in err and "submit" in err and "sandbox" in err
