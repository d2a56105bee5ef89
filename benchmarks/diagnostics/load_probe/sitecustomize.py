"""Times every CUDA pool load's units in any Python process started with this folder on PYTHONPATH and
KVSHARE_LOAD_PROBE=1 (a diagnostic for issue 18, for the service: `kvshare up`'s replicas inherit both).

Each unit's copies (copy stream) and scatter (reshape stream) get a pair of CUDA events; when the load's
handle has waited for its end, one line goes to stderr (the replica's log)::

    kvshare-load-probe {"units": .., "bytes": .., "load_s": .., "copy_busy_s": .., "copy_gaps_s": ..,
                        "max_copy_s": .., "scatter_late_s": .., "max_scatter_late_s": .., "scatter_busy_s": ..}

``copy_busy_s``: the copies' own durations; ``copy_gaps_s``: first copy's start to last copy's end, less
that (the copy stream waiting for a staging buffer or for the enqueue); ``scatter_late_s``: the scatters'
start after their copy's end (waiting for SMs). Slower copies point at the bus or host memory; gaps at the
staging pipeline or the host threads. The same measure as benchmarks/diagnostics/diag_load_beside_forward.py.
"""
import os

if os.environ.get("KVSHARE_LOAD_PROBE") == "1":
    import importlib.abc
    import importlib.util
    import sys

    def _patch(module) -> None:
        import json

        import torch

        state = {"copies": [], "scatters": []}
        transfer_cls, handle_cls = module.CudaTransfer, module.CudaLoadHandle
        load, host_copies, scatter, wait_all = (transfer_cls.load, transfer_cls._host_copies, module.chunks_to_engine,
                                               handle_cls.wait_all)

        def timed(fn, stream, into):
            before, after = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            before.record(stream)
            result = fn()
            after.record(stream)
            into.append((before, after))
            return result

        def probed_load(self, kv, first_chunk, pages):
            state["copies"], state["scatters"] = [], []
            handle = load(self, kv, first_chunk, pages)
            handle._probe = (state["copies"], state["scatters"])
            return handle

        def probed_copies(self, unit, buf, stream, to_device):
            if not to_device:
                return host_copies(self, unit, buf, stream, to_device)
            return timed(lambda: host_copies(self, unit, buf, stream, to_device), stream, state["copies"])

        def probed_scatter(*args):
            return timed(lambda: scatter(*args), torch.cuda.current_stream(), state["scatters"])

        def probed_wait_all(self):
            wait_all(self)
            probe = getattr(self, "_probe", None)
            if not probe or not probe[0] or self.seconds is None:
                return
            self._probe = None
            copies, scatters = probe
            for _, after in copies + scatters:
                after.synchronize()
            ms = lambda a, b: a.elapsed_time(b)  # noqa: E731
            busy = sum(ms(a, b) for a, b in copies)
            late = [ms(c[1], s[0]) for c, s in zip(copies, scatters)]
            row = {"units": len(copies), "bytes": self.num_bytes, "load_s": round(self.seconds, 4),
                   "copy_busy_s": round(busy / 1e3, 4),
                   "copy_gaps_s": round((ms(copies[0][0], copies[-1][1]) - busy) / 1e3, 4),
                   "max_copy_s": round(max(ms(a, b) for a, b in copies) / 1e3, 4),
                   "scatter_late_s": round(sum(x for x in late if x > 0) / 1e3, 4),
                   "max_scatter_late_s": round(max(late) / 1e3, 4) if late else None,
                   "scatter_busy_s": round(sum(ms(a, b) for a, b in scatters) / 1e3, 4)}
            print("kvshare-load-probe " + json.dumps(row), file=sys.stderr, flush=True)

        transfer_cls.load, transfer_cls._host_copies, handle_cls.wait_all = probed_load, probed_copies, probed_wait_all
        module.chunks_to_engine = probed_scatter

    class _AfterImport(importlib.abc.MetaPathFinder):
        """Patches kvshare.transfer.cuda once it is imported (nothing else is imported early)."""

        def find_spec(self, name, path=None, target=None):
            if name != "kvshare.transfer.cuda":
                return None
            sys.meta_path.remove(self)
            spec = importlib.util.find_spec(name)
            loader = spec.loader
            exec_module = loader.exec_module

            def exec_and_patch(module):
                exec_module(module)
                _patch(module)
            loader.exec_module = exec_and_patch
            return spec

    sys.meta_path.insert(0, _AfterImport())
