"""The validation ladder (``kvshare validate``, docs/validate.md): bytes, helpers, full pool, service.

runner.py           run the selected levels, one report     report.py   verdicts, rich table, JSON
checked_pool.py     the pool (own or --pool), one client, the arena's CUDA registration
bytes_level.py      1. transfer round trips + CUDA delay/ordering checks (kvshare.transfer.bytecheck)
helpers_level.py    2. layout conversions against slow references
full_pool.py        3. every page allocated, written, verified (check_full_pool); full_pool_level.py wraps it
service*.py         4. pool ON == pool OFF on live replicas, with provenance
(the output-equality rule is kvshare.outputs, shared with the replica's audit and the bench)
"""
