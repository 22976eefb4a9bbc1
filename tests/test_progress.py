"""The run's progress bar: counts with or without a visible bar; the postfix only when shown."""

from __future__ import annotations

from daskgen.client.progress import Progress


def test_progress_counts_and_shows_the_postfix_only_when_enabled(capsys):
    with Progress(10, enabled=True) as shown, Progress(10, enabled=False) as hidden:
        for bar in (shown, hidden):
            bar.in_flight = "2/4"
            bar.update(4, 100, failed=1)
            bar.update(2, 50)
        assert (shown.tokens, shown.failed, shown.prompts) == (150, 1, 6)
        assert (hidden.tokens, hidden.failed, hidden.prompts) == (150, 1, 6)  # --no-progress still counts
        assert "in_flight=2/4" in shown.postfix and "failed=1" in shown.postfix
        assert hidden.postfix == ""  # nothing formatted for a bar nobody sees


def test_the_postfix_shows_the_in_flight_target_until_a_stop_began():
    with Progress(10, enabled=True) as bar:
        bar.in_flight_now(14, 16, stopping=False)
        bar.update(1, 10)
        assert "in_flight=14/16" in bar.postfix
        bar.in_flight_now(9, 1, stopping=True)  # a drained worker's target: nothing more goes out
        bar.update(1, 10)
        assert "in_flight=9," in bar.postfix + "," and "/1" not in bar.postfix
