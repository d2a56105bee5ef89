"""A profile hook for every process of a vLLM server, for ``benchmarks/vllm_load_path.py``.

Python imports ``sitecustomize`` at start-up from the first directory of its path that has one; that script
puts this directory first in the servers' PYTHONPATH and sets KVSHARE_PATH_EVENTS (a folder) and
KVSHARE_PATH_ROOT (the kvshare package's directory, with its trailing separator). Without them this does
nothing. With them, every thread of the process (``sys.setprofile`` here, ``threading.setprofile`` for
threads started later; a forked child keeps both) records each call of a kvshare function as
``[monotonic time, file under kvshare/, function, thread, process]``, and vLLM's
``Scheduler.update_from_output`` called with a sampled token as the file ``<first token>``. A thread of the
process appends the new records to ``KVSHARE_PATH_EVENTS/<pid>.jsonl`` every 0.2 s. CLOCK_MONOTONIC is the
same in every process of the host, so the script lays the processes' records on one time line.
"""

import os

_DIR = os.environ.get("KVSHARE_PATH_EVENTS")
_ROOT = os.environ.get("KVSHARE_PATH_ROOT")

if _DIR and _ROOT:
    import json
    import sys
    import threading
    import time

    _SCHEDULER = os.path.join("vllm", "v1", "core", "sched", "scheduler.py")
    _records: list = []

    def _process() -> str:
        try:
            with open("/proc/self/comm") as f:
                return f.read().strip()
        except OSError:
            return "?"

    def _hook(frame, event, arg):
        if event != "call":
            return
        code = frame.f_code
        name = code.co_filename
        if name.startswith(_ROOT):
            if code.co_name != "<module>":
                _records.append(
                    (time.monotonic(), name[len(_ROOT) :], code.co_qualname, threading.current_thread().name)
                )
        elif code.co_name == "update_from_output" and name.endswith(_SCHEDULER):
            sampled = getattr(frame.f_locals.get("model_runner_output"), "sampled_token_ids", None)
            if sampled and any(len(tokens) for tokens in sampled):
                _records.append(
                    (time.monotonic(), "<first token>", "update_from_output", threading.current_thread().name)
                )

    def _flush_forever() -> None:
        path = os.path.join(_DIR, f"{os.getpid()}.jsonl")
        done = 0
        while True:
            time.sleep(0.2)
            new, done = _records[done:], len(_records)
            if new:
                process = _process()
                with open(path, "a") as f:
                    f.writelines(json.dumps([*r, process]) + "\n" for r in new)

    def _start() -> None:
        threading.Thread(target=_flush_forever, name="path-events", daemon=True).start()

    def _after_fork() -> None:
        _records.clear()
        _start()

    os.makedirs(_DIR, exist_ok=True)
    os.register_at_fork(after_in_child=_after_fork)
    sys.setprofile(_hook)
    threading.setprofile(_hook)
    _start()
