"""The current-figures table of ``benchmarks/README.md`` says what its records say.

Each row names its goal and whether it is met, links the records it quotes, and gives the commands that
wrote them; every number of its figure is a number of those records, and every record it links was written
by one of its commands.  The page opens by saying that no run used a GPU.
"""

from __future__ import annotations

import re

from tests.conftest import REPO
from tests.test_benchmarks import table_rows

BENCH = REPO / "benchmarks"
README = BENCH / "README.md"
COLUMNS = ("measure", "figure", "goal", "met", "record", "command")
NUMBER = re.compile(r"\d+(?:,\d{3})*(?:\.\d+)?")
RECORD = re.compile(r"\]\((results/[^)#\s]+\.md)\)")
COMMAND = re.compile(r"`([^`]*python benchmarks/[^`]+)`")


def figure_rows() -> list[dict[str, str]]:
    return table_rows(README.read_text(), *COLUMNS)


def record_command(record: str) -> str:
    """The command line a record was written by (its ``Command:`` line)."""
    line = next(line for line in record.splitlines() if line.startswith("Command: `"))
    return line.removeprefix("Command: `").removesuffix("`")


def runs_as(command: str, record_cmd: str) -> bool:
    """Whether the record was written by ``command``: its script, and each ``--flag value`` of it
    (``<placeholder>`` values stand for any)."""
    command = re.sub(r"\s*<[^>]*>", "", command)
    script, *flags = command.split(" --")
    padded = f" {record_cmd} "
    return script.split()[-1] in record_cmd.split() and all(f" --{flag} " in padded for flag in flags)


def test_the_page_says_first_that_no_run_used_a_gpu():
    first = next(line for line in README.read_text().splitlines()[1:] if line.strip())
    assert first.startswith("**No GPU run yet.**"), first


def test_each_row_names_a_goal_whether_it_is_met_its_records_and_commands():
    rows = figure_rows()
    assert 12 <= len(rows) <= 24, len(rows)
    for row in rows:
        assert all(row[column] for column in COLUMNS), row
        assert (row["goal"] == "—") == (row["met"] == "—"), row  # a goal says whether it is met; none, no verdict
        assert RECORD.findall(row["record"]) and COMMAND.findall(row["command"]), row


def test_every_number_of_a_figure_is_in_its_records():
    for row in figure_rows():
        records = [(BENCH / link).read_text() for link in RECORD.findall(row["record"])]
        found = {number for text in records for number in NUMBER.findall(text)}
        missing = [number for number in NUMBER.findall(row["figure"]) if number not in found]
        assert not missing, (row["measure"], missing)


def test_every_record_of_a_row_was_written_by_one_of_its_commands():
    for row in figure_rows():
        commands = COMMAND.findall(row["command"])
        for link in RECORD.findall(row["record"]):
            ran = record_command((BENCH / link).read_text())
            assert any(runs_as(command, ran) for command in commands), (link, ran, commands)
        for command in commands:
            script = command.split("python ", 1)[1].split()[0]
            assert (REPO / script).is_file(), command
