"""What each replica still has to do: the requests this router has in flight on it, each with its expected
service time (pure).

pool_aware's queue term is the wait a new request can expect on a replica before its own prefill starts. A
count of requests in flight times a mean service time cannot tell a replica behind two long prompts from one
behind two short ones. The backlog keeps, for every request the router sent, the service time expected when
it was placed (its own prefill and load on that replica, by the measured rates, plus the replica's measured
decode time), and::

    wait(r) = sum of the expected service of r's requests in flight

A request is in it from the moment the router sends it until its response has ended, failed or was given up:
requests just placed count at once. The one being served counts whole, not less the time it has had: its
decode length is not known ahead, and crediting its progress sent new requests behind requests that then ran
long (in a replay of the routing workload's arrivals against one-request-at-a-time replicas with the
measured service times, that raised p99 TTFT; kept whole, the replicas already idle win those requests).
Exact in the mean for a replica that serves one request at a time in order (the built-in engine); behind a
batching engine it overstates the wait, as the count times the mean did.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(eq=False)
class Job:
    """One request in flight on ``replica``; ``work_s``: its expected service time when it was placed."""

    replica: int
    work_s: float
    is_done: bool = False


class Backlog:
    """Every replica's jobs in flight, oldest first."""

    def __init__(self, num_replicas: int) -> None:
        self._jobs: list[list[Job]] = [[] for _ in range(num_replicas)]

    def begin(self, replica: int, work_s: float) -> Job:
        """A request sent to ``replica`` now, expected to hold it ``work_s`` seconds."""
        job = Job(replica, max(0.0, work_s))
        self._jobs[replica].append(job)
        return job

    def finish(self, job: Job) -> None:
        """The job's response ended (or failed, or was given up); a second call does nothing."""
        if not job.is_done:
            job.is_done = True
            self._jobs[job.replica].remove(job)

    def num_jobs(self, replica: int) -> int:
        return len(self._jobs[replica])

    def wait_s(self, replica: int) -> float:
        """Expected seconds until ``replica`` has served every job it has now."""
        return sum(job.work_s for job in self._jobs[replica])
