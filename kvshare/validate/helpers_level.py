"""Level 2, helpers: every engine KV layout <-> canonical page conversion against its slow reference.

Families (each on CPU tensors, and on CUDA tensors too when the device is CUDA; the
references always run on CPU, element by element, from the documented memory order):

    engine       kv [L, 2, H, T, D] <-> pages [n, L, 2, C, H, D]       kvshare.transfer.layouts
    vllm_layout  cpu_attn, flash_attn (4-D, three memory orders), flash_attn_5d  kvshare.integrations.vllm.layout
    vllm_staged  the same layouts <-> staged pages, the connector's GPU path
                                                                 kvshare.integrations.vllm.paged_destination
    wsum32       the GPU-computed page checksum against the host's             kvshare.pool.wsum
    identity     a changed weight -> another namespace, a renamed copy -> the same  kvshare.validate.identity_check

with non-contiguous block tables, partially filled last blocks, token ranges that
start and end inside blocks, and several dtypes (float32, bfloat16, float16,
float8_e4m3fn). Scatters are also checked not to touch any other byte. The fast
functions are looked up on their modules at call time, so a broken converter
(a test monkeypatches one) is what this level runs.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from kvshare.validate.identity_check import identity_rows
from kvshare.validate.report import FAIL, PASS, SKIP, LevelResult, Row, verdict_of

DTYPES = ("float32", "bfloat16", "float16", "float8_e4m3fn")


@dataclass
class Tally:
    """Cases run and bytes compared for one (family, device)."""

    cases: int = 0
    bytes: int = 0
    wrong: int = 0
    failures: list[str] = field(default_factory=list)

    def compare(self, what: str, fast: torch.Tensor, slow: torch.Tensor) -> None:
        from kvshare.transfer.layouts import as_bits

        a, b = as_bits(fast.detach()).cpu().contiguous(), as_bits(slow.detach()).cpu().contiguous()
        self.cases += 1
        self.bytes += b.numel() * b.element_size()
        if a.shape != b.shape:
            self.wrong += b.numel() * b.element_size()
            self.failures.append(f"{what}: shape {tuple(a.shape)} != {tuple(b.shape)}")
        elif not torch.equal(a, b):
            self.wrong += int((a.view(torch.uint8) != b.view(torch.uint8)).sum())
            self.failures.append(what)


def random_bits(shape, dtype: str, seed: int) -> torch.Tensor:
    """A CPU tensor of ``dtype`` holding random bits (NaN and inf patterns included)."""
    from kvshare.transfer.layouts import as_bits, torch_dtype

    t = torch.empty(shape, dtype=torch_dtype(dtype))
    bits = as_bits(t)
    info = torch.iinfo(bits.dtype)
    bits.copy_(
        torch.randint(info.min, info.max, bits.shape, dtype=bits.dtype, generator=torch.Generator().manual_seed(seed))
    )
    return t


# -- engine layout ---------------------------------------------------------------------------------


def check_engine(device: str, tally: Tally) -> None:
    from kvshare.layout import KVLayout
    from kvshare.transfer import layouts, reference

    for d, dtype in enumerate(DTYPES):
        lay = KVLayout(num_layers=2, num_kv_heads=3, head_dim=4, dtype=dtype, chunk_tokens=8)
        kv = random_bits((2, 2, 3, 6 * 8 + 5, 4), dtype, seed=d)  # capacity not a whole number of chunks
        for first_chunk, num_chunks in ((0, 6), (2, 3), (5, 1)):
            # integer views, as the transfers call them: bytes move exactly, whatever the dtype
            pages = torch.empty((num_chunks, 2, 2, 8, 3, 4), dtype=kv.dtype, device=device)
            layouts.engine_to_chunks(layouts.as_bits(pages), layouts.as_bits(kv.to(device)), first_chunk * 8)
            expected = reference.reference_engine_to_pages(kv, lay, first_chunk, num_chunks)
            tally.compare(f"engine->pages {dtype} chunks {first_chunk}+{num_chunks}", pages, expected)
            fast = random_bits(kv.shape, dtype, seed=100 + d)
            slow = fast.clone()
            fast = fast.to(device)
            layouts.chunks_to_engine(layouts.as_bits(fast), layouts.as_bits(pages), first_chunk * 8)
            reference.reference_pages_to_engine(slow, expected, lay, first_chunk)
            tally.compare(f"pages->engine {dtype} chunks {first_chunk}+{num_chunks}", fast, slow)  # rest untouched too


# -- kvshare.integrations.vllm.layout (the connector's views) ------------------------------------------

B, H, N, D = 6, 2, 4, 8
# (backend, name, CPU base tensor shape, view of the base as the layer tensor vLLM hands over)
VLLM_KINDS = (
    ("CPU_ATTN", "cpu_attn", (B, H, N, 2 * D), lambda t: t),
    ("FLASH_ATTN", "flash_attn HND", (B, H, N, 2 * D), lambda t: t),
    ("FLASH_ATTN", "flash_attn NHD", (B, N, H, 2 * D), lambda t: t.permute(0, 2, 1, 3)),
    ("FLASH_ATTN", "flash_attn padded", (B, 2, H, N, 2 * D), lambda t: t[:, 1]),  # blocks further apart than their size
    ("FLASH_ATTN", "flash_attn_5d", (2, B, N, H, D), lambda t: t),
)
TOKEN_RANGES = ((0, B * N), (3, 9), (N, 1), (5, 2 * N - 1))  # start and end inside blocks, one token


def check_vllm_layout(kind, device: str, tally: Tally) -> None:
    from kvshare.integrations.vllm import layout as V
    from kvshare.transfer.layouts import torch_dtype

    backend, name, base_shape, view = kind
    for d, dtype in enumerate(("float32", "bfloat16", "float8_e4m3fn")):
        base = random_bits(base_shape, dtype, seed=200 + d)
        layer_cpu = view(base)
        layout = V.detect_layout(backend, layer_cpu, H, D, N, torch_dtype(dtype))
        for start, count in TOKEN_RANGES:
            block_ids = torch.randperm(B, generator=torch.Generator().manual_seed(start + count)).tolist()
            what = f"{name} {dtype} tokens {start}..{start + count - 1}"
            kv = random_bits((2, count, H, D), dtype, seed=300 + count)
            fast_base = base.clone().to(device)
            fast = view(fast_base)
            slow_base = base.clone()
            V.scatter_tokens(fast, layout, kv.to(device), V.slot_indices(start, count, block_ids, N, fast.device))
            V.reference_scatter(view(slow_base), layout, kv, start, block_ids)
            tally.compare(f"scatter {what}", fast_base, slow_base)  # nothing outside the slots touched
            out = torch.empty((2, count, H, D), dtype=kv.dtype, device=device)
            V.gather_tokens(fast, layout, V.slot_indices(start, count, block_ids, N, fast.device), out)
            tally.compare(f"gather {what}", out, V.reference_gather(view(slow_base), layout, start, count, block_ids))


def check_vllm_staged(kind, device: str, tally: Tally) -> None:
    """The GPU path's scatter/gather between staged canonical pages and vLLM's blocks (paged_destination)."""
    from kvshare.integrations.vllm import layout as V
    from kvshare.integrations.vllm import paged_destination as S
    from kvshare.transfer.layouts import torch_dtype

    backend, name, base_shape, view = kind
    C = 2 * N  # a page holds two blocks
    for d, dtype in enumerate(("float32", "bfloat16", "float8_e4m3fn")):
        base = random_bits(base_shape, dtype, seed=400 + d)
        layout = V.detect_layout(backend, view(base), H, D, N, torch_dtype(dtype))
        block_ids = torch.randperm(B, generator=torch.Generator().manual_seed(d)).tolist()
        chunks = [0, 1, 2]  # pages of chunks 0..2: every block of the table
        staged = random_bits((len(chunks), 2, C, H, D), dtype, seed=500 + d)  # one layer of three staged pages
        for lo, hi in ((0, C), (3, C), (0, 5), (1, 2)):  # whole pages, a load starting / ending inside a page
            what = f"{name} {dtype} pages 0..2 tokens {lo}..{hi - 1}"
            segment = S.Segment(0, len(chunks), lo, hi)
            slots = tuple(t.to(device) for t in S.token_slots(block_ids, chunks, C, N))
            fast_base, slow_base = base.clone().to(device), base.clone()
            width = S.word_bytes([view(fast_base)], layout)  # the wide words the GPU path indexes, as it does
            blocks = S.widen(layout.kv_blocks(V.as_bits(view(fast_base))), width)
            S.scatter_staged(blocks, S.widen(V.as_bits(staged).to(device), width), slots, segment, 0)
            for page, chunk in enumerate(chunks):
                V.reference_scatter(view(slow_base), layout, staged[page, :, lo:hi], chunk * C + lo, block_ids)
            tally.compare(f"staged scatter {what}", fast_base, slow_base)  # nothing outside the slots touched
            out = torch.zeros_like(V.as_bits(staged)).to(device)
            S.gather_staged(blocks, S.widen(out, width), slots, segment, 0)
            want = torch.zeros_like(V.as_bits(staged))
            for page, chunk in enumerate(chunks):
                want[page, :, lo:hi] = V.as_bits(
                    V.reference_gather(view(slow_base), layout, chunk * C + lo, hi - lo, block_ids)
                )
            tally.compare(f"staged gather {what}", out, want)


def check_wsum32(device: str, tally: Tally) -> None:
    """WSUM32 page checksums in torch on ``device`` (whole pages and in pieces) against the host's numpy."""
    from kvshare.pool.checksum import wsum32
    from kvshare.pool.wsum import add_rows, as_unsigned, page_sums

    def as_tensor(values: list[int]) -> torch.Tensor:  # unsigned 64-bit values, exactly, as int64 bits
        return torch.tensor([v - (1 << 64) if v >= 1 << 63 else v for v in values], dtype=torch.int64)

    for seed, num_words in enumerate((1, 3, 1024, 3 * 1024 + 4, 1 << 18)):
        pages = random_bits((4, num_words), "float32", seed=600 + seed).view(torch.int32)
        host = as_tensor([wsum32(p.numpy()) for p in pages])
        tally.compare(f"wsum32 {num_words} words", as_tensor(as_unsigned(page_sums(pages.to(device)))), host)
        if num_words % 4 == 0:  # the same pages summed in four pieces, in another order
            acc = torch.zeros(4, dtype=torch.int64, device=device)
            q = num_words // 4
            for piece in (3, 1, 0, 2):
                add_rows(acc, pages[:, piece * q : (piece + 1) * q].contiguous().to(device), piece * q)
            tally.compare(f"wsum32 {num_words} words in pieces", as_tensor(as_unsigned(acc)), host)


# -- the level -------------------------------------------------------------------------------------


def _families():
    families = [("engine [L,2,H,T,D]", check_engine, None)]
    try:
        import kvshare.integrations.vllm.layout  # noqa: F401
    except ImportError:
        return families, "kvshare.integrations.vllm.layout is not installed"
    families += [(f"vllm_layout {k[1]}", check_vllm_layout, k) for k in VLLM_KINDS]
    families += [(f"vllm_staged {k[1]}", check_vllm_staged, k) for k in VLLM_KINDS]
    families += [("wsum32 checksum", check_wsum32, None)]
    return families, ""


def run_helpers_level(device: str) -> LevelResult:
    started = time.perf_counter()
    devices = ["cpu"] + ([device] if device.startswith("cuda") else [])
    families, missing = _families()
    rows: list[Row] = []
    total = Tally()
    for name, check, arg in families:
        for dev in devices:
            tally = Tally()
            try:
                check(dev, tally) if arg is None else check(arg, dev, tally)
            except Exception as exc:  # a converter that raises is a failed conversion, reported with its message
                tally.failures.append(f"raised {type(exc).__name__}: {exc}")
            ok = not tally.failures and tally.cases > 0
            detail = "" if ok else f"{len(tally.failures)} wrong: " + "; ".join(tally.failures[:3])
            rows.append(
                Row(
                    f"{name} on {dev}",
                    PASS if ok else FAIL,
                    detail,
                    {"cases": tally.cases, "bytes": tally.bytes, "wrong": tally.wrong},
                )
            )
            total.cases += tally.cases
            total.bytes += tally.bytes
            total.wrong += tally.wrong
    if missing:
        rows.append(Row("vllm_layout", SKIP, missing))
    rows += identity_rows()
    if not device.startswith("cuda"):
        rows.append(Row("on cuda", SKIP, f"device {device}: fast converters not run on GPU tensors"))
    status = verdict_of(rows)
    summary = (
        f"{len(families)} layouts x {len(devices)} device(s) ({', '.join(devices)}): {total.cases} cases, "
        f"{total.bytes} bytes compared with the references, {total.wrong} wrong"
    )
    figures = {"cases": total.cases, "bytes": total.bytes, "wrong": total.wrong, "devices": devices}
    return LevelResult("helpers", status, summary, rows, figures, time.perf_counter() - started)
