"""kvshare's connector with a fault for the tests: tensor parallel rank 1 dies in the middle of a store.

Armed by the file named in $KVSHARE_TEST_DIE_FILE: once it exists, the next step that stores makes
rank 1 write part of its heads into the reserved pages and exit at once, as a crashed rank would.
"""

import os

from kvshare.integrations.vllm.connector import KVShareConnector


class DyingConnector(KVShareConnector):
    def wait_for_save(self) -> None:
        plan, armed = self._plan(), os.environ.get("KVSHARE_TEST_DIE_FILE", "")
        if self._worker is not None and self._worker.heads.tp_rank == 1 and plan.stores and os.path.exists(armed):
            spec = plan.stores[0]
            client, _ = self._worker.pool.client_for(spec.pool_id)
            self._worker.copy_out(client, spec, spec.grants[: (len(spec.grants) + 1) // 2])
            os._exit(17)
        super().wait_for_save()
