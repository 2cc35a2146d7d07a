"""Progress on stderr: a bar on a terminal, plain lines (rate, ETA) in a log."""

import io

import fabric.observe.progress as progress
from fabric.observe.progress import Progress


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_off_a_terminal_lines_have_rate_and_eta_and_no_carriage_return(monkeypatch):
    clock = iter([0.0, 1.0, 7.0, 8.0, 9.0])
    monkeypatch.setattr(progress.time, "monotonic", lambda: next(clock))
    out = io.StringIO()
    p = Progress(100, "requests", "serving", stream=out)
    p.update(10)  # t=1: too soon after the start for a line
    p.update(50)  # t=7: a line
    p.update(100)  # t=8: the last, always
    p.close()
    lines = out.getvalue().splitlines()
    assert lines == [
        "serving: 50/100 requests (50%), 7.1 requests/s, ETA 7 s",
        "serving: 100/100 requests (100%), 12.5 requests/s, done",
    ]
    assert "\r" not in out.getvalue()


def test_on_a_terminal_a_bar_shows_rate_and_eta():
    out = Terminal()
    with Progress(20, "turns", "conversing", stream=out) as p:
        for i in range(1, 21):
            p.update(i)
    text = out.getvalue()
    assert "conversing" in text and "20/20" in text and "turns/s" in text


def test_durations_read_as_a_person_would():
    assert progress._duration(42.4) == "42 s"
    assert progress._duration(125) == "2 min 05 s"
    assert progress._duration(3 * 3600 + 61) == "3 h 01 min"
    assert progress._duration(float("inf")) == "unknown"
