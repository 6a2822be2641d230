"""The random-weight transformer: determinism, the page byte layout, chunking, depth."""

from __future__ import annotations

import hashlib
import multiprocessing as mp

import numpy as np
import pytest

pytest.importorskip("torch", reason="the hw backend needs torch: pip install -e '.[hw]'")

import torch
import torch.nn.functional as F

from disagg.core.kvcache import PageLayout
from disagg.errors import ConfigError
from disagg.hw.batch import Seq
from disagg.hw.cache import KVCache
from disagg.hw.device import resolve_device
from disagg.hw.model import TorchOps, Transformer, apply_rope, rms_norm, rope_tables, rotate
from disagg.hw.specs import tiny_gqa, tiny_mla
from disagg.models import LLAMA_31_8B

PROMPT = [3, 14, 15, 92, 65, 35, 89, 79, 32, 38, 46]


def weights_digest(seed: int) -> str:
    """sha256 over every weight of a tiny model (runs in a child process too)."""
    m = Transformer(tiny_gqa(), seed=seed)
    h = hashlib.sha256()
    for t in [m.embed, m.lm_head, *(w for layer in m.layers for w in layer.values())]:
        h.update(t.contiguous().numpy().tobytes())
    return h.hexdigest()


def test_weights_are_identical_across_processes_and_differ_across_seeds() -> None:
    with mp.get_context("spawn").Pool(1) as pool:
        child = pool.apply(weights_digest, (7,))
    assert child == weights_digest(7)
    assert weights_digest(8) != child


def _layer0_kv(m: Transformer, tokens: list[int]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Layer 0's K and V (GQA) or latent (MLA) recomputed from the weights, position 0 on."""
    s, layer = m.spec, m.layers[0]
    a = rms_norm(m.embed[torch.tensor(tokens)], layer["ln1"])
    freqs = torch.arange(len(tokens))[:, None].float() * m.inv_freq[None]
    cos, sin = freqs.cos()[:, None], freqs.sin()[:, None]
    if m.mla:
        ckv, kpe = F.linear(a, layer["w_dkv"]).split([s.kv_lora_rank, s.qk_rope_dim], -1)
        kpe = apply_rope(kpe[:, None], cos, sin)[:, 0]
        return torch.cat([rms_norm(ckv, layer["kv_norm"]), kpe], -1), None
    qkv = F.linear(a, layer["wqkv"]).view(len(tokens), -1, s.head_dim)
    k = apply_rope(qkv[:, s.heads : s.heads + s.kv_heads], cos, sin)
    return k, qkv[:, s.heads + s.kv_heads :]


@pytest.mark.parametrize("kind", ["HND", "NHD", "MLA"])
def test_kv_written_by_the_model_sits_where_page_layout_says(kind: str) -> None:
    mla = kind == "MLA"
    m = Transformer(tiny_mla() if mla else tiny_gqa(), seed=3)
    cache = m.new_cache(12, page_size=4, layout="HND" if mla else kind)  # type: ignore[arg-type]
    pages = [5, 2, 9]
    m.forward([Seq.of(PROMPT, 0, pages)], cache)
    k, v = _layer0_kv(m, PROMPT)
    lay: PageLayout = cache.layout
    raw = cache.layers[0].contiguous().view(-1).view(torch.uint8).numpy()

    def read(page: int, kv: int, head: int, token: int, dim: int) -> float:
        at = page * lay.page_bytes + lay.offset(kv, head, token, dim)
        return float(np.frombuffer(raw[at : at + 4].tobytes(), dtype=np.float32)[0])

    for t in range(len(PROMPT)):
        page, slot = pages[t // 4], t % 4
        if mla:
            want = k[t]
            got = [read(page, 0, 0, slot, d) for d in range(lay.head_dim)]
            np.testing.assert_allclose(got, want.numpy(), rtol=1e-5, atol=1e-6)
            continue
        for head in range(lay.heads):
            for kv, src in ((0, k), (1, v)):
                got = [read(page, kv, head, slot, d) for d in range(lay.head_dim)]
                np.testing.assert_allclose(got, src[t, head].numpy(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("spec", [tiny_gqa(layers=3), tiny_mla(layers=3)], ids=["gqa", "mla"])
def test_a_pass_writes_each_layers_cache_once(spec) -> None:  # type: ignore[no-untyped-def]
    """One indexed write a layer (K and V together): on a GPU each is a kernel to launch."""
    m = Transformer(spec, seed=0)
    cache = m.new_cache(4, 4)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        m.forward([Seq.of(PROMPT, 0, [0, 1, 2])], cache)
    writes = [e for e in prof.events() if e.name == "aten::index_put_"]
    assert len(writes) == spec.layers


@pytest.mark.parametrize("spec", [tiny_gqa(), tiny_mla()], ids=["gqa", "mla"])
def test_chunked_prefill_equals_one_shot(spec) -> None:  # type: ignore[no-untyped-def]
    m = Transformer(spec, seed=1)
    pages = [7, 1, 4]
    whole = m.forward([Seq.of(PROMPT, 0, pages, hidden_at=-1)], m.new_cache(8, 4))
    cache = m.new_cache(8, 4)
    m.forward([Seq.of(PROMPT[:5], 0, pages)], cache)
    m.forward([Seq.of(PROMPT[5:9], 5, pages)], cache)
    last = m.forward([Seq.of(PROMPT[9:], 9, pages)], cache)
    torch.testing.assert_close(last.logits, whole.logits, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(last.hidden, whole.hidden, atol=1e-5, rtol=1e-5)


def test_hidden_at_returns_the_chosen_position() -> None:
    m = Transformer(tiny_gqa(), seed=1)
    full = m.forward([Seq.of(PROMPT, 0, [0, 1, 2], hidden_at=4)], m.new_cache(4, 4))
    short = m.forward([Seq.of(PROMPT[:5], 0, [0, 1], hidden_at=-1)], m.new_cache(4, 4))
    torch.testing.assert_close(full.hidden, short.hidden, atol=1e-5, rtol=1e-5)


def test_a_batch_equals_its_sequences_run_alone() -> None:
    m = Transformer(tiny_mla(), seed=2)
    a, b = Seq.of(PROMPT, 0, [0, 1, 2]), Seq.of(PROMPT[:6][::-1], 0, [3, 4])
    both = m.forward([a, b], m.new_cache(6, 4))
    alone = [m.forward([s], m.new_cache(6, 4)).logits[0] for s in (a, b)]
    torch.testing.assert_close(both.logits, torch.stack(alone), atol=1e-5, rtol=1e-5)


def test_activations_stay_finite_over_many_layers() -> None:
    m = Transformer(tiny_gqa(layers=64), seed=0)
    out = m.forward([Seq.of(PROMPT, 0, [0, 1, 2])], m.new_cache(3, 4))
    assert torch.isfinite(out.logits).all()
    rms = out.hidden.pow(2).mean().sqrt().item()
    assert 0.1 < rms < 10, rms


def test_weight_bytes_count_what_is_allocated() -> None:
    m = Transformer(tiny_gqa(), seed=0)
    tensors = [
        m.embed,
        m.lm_head,
        *(w for layer in m.layers for n, w in layer.items() if n[0] == "w"),
    ]
    assert m.weight_bytes() == sum(t.numel() * 4 for t in tensors)


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is present")
def test_asking_for_a_gpu_without_one_is_a_clear_error() -> None:
    with pytest.raises(ConfigError, match="no CUDA GPU"):
        resolve_device("cuda")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_page_pool_larger_than_the_gpu_is_a_clear_error() -> None:
    with pytest.raises(ConfigError, match="GiB free"):
        KVCache.allocate(LLAMA_31_8B, 10**7, 16, torch.device("cuda"), torch.bfloat16)


def test_three_kernel_rope_equals_the_rotate_half_formula() -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 3, 16, generator=g)
    pos, inv_freq = torch.tensor([0, 1, 7, 100, 4095]), 500000.0 ** (-torch.arange(8) / 8)
    freqs = pos[:, None].float() * inv_freq[None]
    want = apply_rope(x, freqs.cos()[:, None], freqs.sin()[:, None])
    got = rotate(x, *rope_tables(pos, inv_freq, torch.float32))
    torch.testing.assert_close(got, want)
    assert not torch.allclose(got[1:], x[1:])  # it did rotate


def test_fused_ops_stay_off_the_cpu() -> None:
    m = Transformer(tiny_gqa(layers=1), seed=0, fused_ops=True)
    assert type(m.ops()) is TorchOps  # FlashInfer's fused kernels are CUDA only


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_fused_ops_give_the_torch_ops_logits_on_gpu() -> None:
    """FlashInfer's RMSNorm, SiLU-and-mul and RoPE against torch's, through two Llama layers:
    same first token, logits within bf16 noise, and the KV they wrote too."""
    m = Transformer(LLAMA_31_8B.with_layers(2), seed=0, device="cuda")
    seqs = [Seq.of(list(range(100, 160)), 0, range(4)), Seq.of(PROMPT, 0, range(4, 5))]
    out = {}
    for fused in (False, True):
        m.fused_ops = fused
        cache = m.new_cache(8, 16)
        out[fused] = (m.forward(seqs, cache).logits, cache.layers[1].float())
    (want, kv_want), (got, kv_got) = out[False], out[True]
    assert torch.equal(want.argmax(-1), got.argmax(-1))
    assert (got - want).abs().max() <= 0.05 * want.abs().max()
    assert (kv_got - kv_want).abs().max() <= 0.05 * kv_want.abs().max()
