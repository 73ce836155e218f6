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
