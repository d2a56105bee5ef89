"""`kvshare load` reports while it runs: requests, errors, the response bytes and their rate."""

from kvshare.commands.load import load_progress
from kvshare.reliability.load import LoadConfig, run_load
from tests.bench.fake_server import fake_app
from tests.serve.live import LiveApp


def test_load_reports_progress_with_the_bytes_received():
    """Fails when run_load takes no progress callback (the command printed nothing for its whole duration)."""
    seen = []
    with LiveApp(fake_app(first_token_delay_s=0.01)) as url:
        summary = run_load(
            LoadConfig(url=url, num_sessions=2, duration_s=1.2, model="m", check_share=0.0),
            lambda tally, elapsed_s: seen.append((elapsed_s, tally.num_bytes)),
        )
    assert len(seen) >= 2 and seen[-1][0] >= 1.0
    assert [b for _, b in seen] == sorted(b for _, b in seen) and seen[-1][1] > 0
    assert summary["unfinished"] == 0


def test_the_progress_bar_shows_requests_bytes_and_rate():
    from rich.console import Console

    from kvshare.reliability.summary import LoadTally

    console = Console(record=True, force_terminal=True, width=160)
    with load_progress(10.0, console) as on_progress:
        tally = LoadTally(started_at=0.0)
        tally.num_ok, tally.num_errors, tally.num_bytes = 3, 1, 5 << 20
        on_progress(tally, 2.0)
    assert "3 ok, 1 errors, 5.00 MiB at 2.50 MiB/s" in console.export_text()
