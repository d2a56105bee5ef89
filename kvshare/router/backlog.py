"""What each replica still has to do: the requests this router has in flight on it, each with its expected
service time (pure: ``now`` is passed in).

pool_aware's queue term is the wait a new request can expect on a replica before its own prefill starts. A
count of requests in flight times a mean service time cannot tell a replica behind two long prompts from one
behind two short ones, nor one whose current request has almost finished from one whose current request just
began. The backlog keeps, for every request the router sent, the service time expected when it was placed
(its own prefill and load on that replica, by the measured rates, plus the replica's decode time), and::

    wait(r) = sum of expected service of r's jobs - time the oldest has been served so far (floored at 0)

where the oldest began its service when it was sent or when the job before it on r finished, whichever was
later: exact for a replica that serves one request at a time in order (the built-in engine); behind a batching
engine it overstates the wait as the count times the mean did. A job is in the backlog from the moment the
router sends it until its response has ended, failed or was given up: requests just placed count at once.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from itertools import islice


@dataclass(eq=False)
class Job:
    """One request in flight on ``replica``; ``work_s``: its expected service time when it was placed."""

    replica: int
    work_s: float
    sent_s: float
    is_done: bool = False


class Backlog:
    """Every replica's jobs in flight, oldest first."""

    def __init__(self, num_replicas: int) -> None:
        self._jobs: list[deque[Job]] = [deque() for _ in range(num_replicas)]
        self._last_done_s = [float("-inf")] * num_replicas  # when each replica's last job ended

    def begin(self, replica: int, work_s: float, now: float) -> Job:
        """A request sent to ``replica`` now, expected to hold it ``work_s`` seconds."""
        job = Job(replica, max(0.0, work_s), now)
        self._jobs[replica].append(job)
        return job

    def finish(self, job: Job, now: float) -> None:
        """The job's response ended (or failed, or was given up); a second call does nothing."""
        if job.is_done:
            return
        job.is_done = True
        jobs = self._jobs[job.replica]
        if jobs and jobs[0] is job:
            self._last_done_s[job.replica] = max(self._last_done_s[job.replica], now)
        jobs.remove(job)

    def num_jobs(self, replica: int) -> int:
        return len(self._jobs[replica])

    def wait_s(self, replica: int, now: float) -> float:
        """Expected seconds until ``replica`` has served every job it has now."""
        jobs = self._jobs[replica]
        if not jobs:
            return 0.0
        head = jobs[0]
        served_s = max(0.0, now - max(head.sent_s, self._last_done_s[replica]))
        return max(0.0, head.work_s - served_s) + sum(job.work_s for job in islice(jobs, 1, None))
