"""Paged attention: the reference against dense attention, FlashInfer against the reference."""

from __future__ import annotations

import math

import pytest

pytest.importorskip("torch", reason="the hw backend needs torch: pip install -e '.[hw]'")

import torch
import torch.nn.functional as F

from disagg.errors import ConfigError
from disagg.hw.attention import (
    DECODE_BACKENDS,
    FLASHINFER_SHAPES,
    AttnShape,
    TorchAttention,
    error_against_reference,
    import_flashinfer,
    make_attention,
    parse_attention,
    random_problem,
)
from disagg.hw.batch import BatchMeta, Seq

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

# CPU: toy head sizes and pages of 4. GPU: FLASHINFER_SHAPES, the sizes FlashInfer builds for.
CPU_SHAPES = {
    "HND": AttnShape(8, 2, 32, 4, 32**-0.5, layout="HND"),
    "NHD": AttnShape(8, 2, 32, 4, 32**-0.5, layout="NHD"),
    "MLA": AttnShape(4, 1, 32, 4, 24**-0.5, mla=True, rope_dim=8),
}
PREFILL = [(0, 37), (50, 20), (129, 1), (16, 64)]  # (cached, new) per sequence: mixed chunks
DECODE = [(0, 1), (17, 1), (300, 1), (63, 1)]


def _dense_kv(cache: torch.Tensor, pages: list[int], n: int, shape: AttnShape) -> torch.Tensor:
    """Read tokens 0..n-1 back token by token (independent of gather_pages)."""
    rows = []
    for t in range(n):
        p, o = pages[t // shape.page_size], t % shape.page_size
        if shape.mla:
            rows.append(cache[p, o])
        elif shape.layout == "HND":
            rows.append(cache[p, :, :, o])  # [2, H, D]
        else:
            rows.append(cache[p, :, o])
    return torch.stack(rows, dim=-3 if not shape.mla else 0)


def _sdpa(q, k, v, scale):
    """Dense causal attention by torch's SDPA. q [L, Hq, D], k/v [S, Hkv, D]."""
    s, n = k.shape[0], q.shape[0]
    mask = torch.ones(n, s, dtype=torch.bool).tril(diagonal=s - n)
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask, scale=scale
    )
    return out.transpose(0, 1)


@pytest.mark.parametrize("lens", [PREFILL, DECODE], ids=["prefill", "decode"])
@pytest.mark.parametrize("kind", ["HND", "NHD", "MLA"])
def test_reference_equals_dense_unpaged_attention(kind: str, lens: list[tuple[int, int]]) -> None:
    shape = CPU_SHAPES[kind]
    seqs, cache, q, q_pe = random_problem(shape, lens)
    ref = TorchAttention(shape)
    ref.plan(BatchMeta.of(seqs, shape.page_size, cache.shape[0]))
    out = ref.run(cache, q, q_pe)
    row = 0
    for s in seqs:
        n = len(s.tokens)
        kv = _dense_kv(cache, list(s.pages), s.end, shape)
        if shape.mla:
            qq = torch.cat([q[row : row + n], q_pe[row : row + n]], -1)
            want = _sdpa(qq, kv[:, None], kv[:, None, : shape.head_dim], shape.sm_scale)
        else:
            want = _sdpa(q[row : row + n], kv[0], kv[1], shape.sm_scale)
        torch.testing.assert_close(out[row : row + n], want, atol=1e-5, rtol=1e-5)
        row += n


def test_a_sequence_without_enough_pages_is_rejected() -> None:
    with pytest.raises(ConfigError, match="need 2 pages"):
        BatchMeta.of([Seq.of([1, 2, 3], 4, [0])], page_size=4, num_pages=8)


def test_flashinfer_needs_cuda() -> None:
    with pytest.raises(ConfigError, match="CUDA"):
        make_attention("flashinfer", FLASHINFER_SHAPES["GQA-HND"], torch.device("cpu"))
    with pytest.raises(ConfigError, match="CUDA"):
        make_attention("flashinfer:cuda-cores", FLASHINFER_SHAPES["GQA-HND"], torch.device("cpu"))


def test_attention_choice_names_the_decode_kernel_or_the_choices() -> None:
    assert parse_attention("flashinfer:cuda-cores") == ("flashinfer", "cuda-cores")
    assert parse_attention("auto") == ("auto", None)
    cpu = make_attention("auto", FLASHINFER_SHAPES["GQA-HND"], torch.device("cpu"))
    assert isinstance(cpu, TorchAttention)
    for bad in ("flashinfer:fa9", "flash", "torch:fa2"):
        with pytest.raises(ConfigError, match=r"unknown attention .* flashinfer:fa2"):
            parse_attention(bad)


def test_missing_flashinfer_says_how_to_install() -> None:
    try:
        import flashinfer  # noqa: F401
    except ImportError:
        with pytest.raises(ConfigError, match=r"pip install disagg\[gpu\]"):
            import_flashinfer()
    else:
        pytest.skip("flashinfer is installed")


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("lens", [PREFILL, DECODE], ids=["prefill", "decode"])
@pytest.mark.parametrize("kind", list(FLASHINFER_SHAPES))
def test_flashinfer_matches_reference(kind: str, lens: list[tuple[int, int]]) -> None:
    err, scale = error_against_reference(FLASHINFER_SHAPES[kind], lens, torch.device("cuda"), 1)
    assert err <= 2e-2 * max(1.0, scale), f"max error {err} (output scale {scale})"
    assert math.isfinite(err)


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("kernel", DECODE_BACKENDS)
@pytest.mark.parametrize("kind", ["GQA-HND", "GQA-NHD"])
def test_every_flashinfer_decode_kernel_matches_reference(kind: str, kernel: str) -> None:
    """The decode kernels `--attention flashinfer:KERNEL` picks, each against the reference."""
    shape, dev = FLASHINFER_SHAPES[kind], torch.device("cuda")
    assert make_attention(f"flashinfer:{kernel}", shape, dev).decode_kernel == kernel  # picked
    err, scale = error_against_reference(shape, DECODE, dev, 7, kernel)
    assert math.isfinite(err) and err <= 2e-2 * max(1.0, scale), f"{kernel}: max error {err}"
