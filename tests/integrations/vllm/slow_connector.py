"""kvshare's connector with a slow load for the tests: every load's copy waits $KVSHARE_TEST_LOAD_DELAY_S first.

The wait is in the worker's verify-and-copy, so it lands where the load runs: inside vLLM's step for a load
in the step (every other request's decoding waits too), on the loader thread for an asynchronous one.
"""

import os
import time

from kvshare.integrations.vllm.connector import KVShareConnector


class SlowLoadConnector(KVShareConnector):
    def register_kv_caches(self, kv_caches) -> None:
        super().register_kv_caches(kv_caches)
        delay_s, copy = float(os.environ.get("KVSHARE_TEST_LOAD_DELAY_S", "0")), self._worker.verify_and_copy

        def slow(load):
            time.sleep(delay_s)
            return copy(load)

        self._worker.verify_and_copy = slow
