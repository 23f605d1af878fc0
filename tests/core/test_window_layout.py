"""Issue #42.2: a sliding group's layout starts each request's KV at the first page its first
query row sees, and lists no page before it. Against a brute force from the step's layout on
random scenarios (every mode, ragged lengths, shuffled pages, padded buckets), the host skip
equal to the device one, and the step's cache sharing one layout per window and step."""
import random

import numpy as np
import pytest
import torch

from attn_backends import ModelConfig
from attn_backends.batch import ForwardMode
from attn_backends.check.scenarios import Scenario, draft_decode_spec, make_memory, materialize, verify_spec
from attn_backends.layout import build_layout, inputs_from_batch
from attn_backends.window_layout import first_positions, window_layout, window_skip_host

CFG = ModelConfig(num_layers=1, num_q_heads=4, num_kv_heads=2, head_dim=16, page_size=16)


def _layout(mode: str, seed: int):
    rng = random.Random(seed)
    mem = make_memory(CFG, num_pages=80, max_reqs=8, max_context_len=128, page_order="interleaved", seed=seed)
    prefixes = [rng.randint(0, 100) for _ in range(rng.randint(1, 5))]
    bs = len(prefixes) + rng.randint(0, 2)
    spec = {"verify_chain": verify_spec(3, bs, rng), "verify_tree": verify_spec(4, bs, rng, topk=2, steps=2),
            "draft_decode": draft_decode_spec(2, 2, 1)}.get(mode)
    kind = {"extend": ForwardMode.EXTEND, "decode": ForwardMode.DECODE}.get(mode, ForwardMode.TARGET_VERIFY)
    kind = ForwardMode.DECODE if mode == "draft_decode" else kind
    scn = Scenario(kind, bs, prefixes, spec, name=mode,
                   extend_lens=[rng.randint(1, 9) for _ in prefixes] if mode == "extend" else None)
    m = materialize(scn, mem, 1)
    return build_layout(inputs_from_batch(m.batch, mem, 1))


def _pages(lay, i):
    return lay.kv_indices[int(lay.kv_indptr[i]):int(lay.kv_indptr[i + 1])].tolist()


@pytest.mark.parametrize("mode", ["decode", "verify_chain", "verify_tree", "draft_decode", "extend"])
@pytest.mark.parametrize("window", [1, 3, 16, 21, 40, 1000])
def test_window_layout_starts_at_the_first_visible_page(mode, window):
    for seed in range(3):
        lay = _layout(mode, seed)
        win = window_layout(lay, window)
        ps = lay.page_size
        firsts = first_positions(lay).tolist()
        for i in range(lay.bs):
            lo = max(0, firsts[i] - window + 1)          # the first key the first row sees
            skip = lo // ps
            assert _pages(win, i) == _pages(lay, i)[skip:], (mode, window, seed, i)
            assert win.seq_lens_k[i] == lay.seq_lens_k[i] - skip * ps
            assert win.prefix_lens[i] == lay.prefix_lens[i] - skip * ps
            if lay.draft_prefix_lens is not None:
                assert win.draft_prefix_lens[i] == lay.draft_prefix_lens[i] - skip * ps
            npg = len(_pages(win, i))
            assert win.page_table[i, :npg].tolist() == _pages(win, i) and not win.page_table[i, npg:].any()
        assert not win.kv_indices[int(win.kv_indptr[-1]):].any()
        assert win.kv_last_page_len is lay.kv_last_page_len and win.cu_seqlens_q is lay.cu_seqlens_q


def test_host_skip_matches_the_device():
    for seed in range(4):
        lay = _layout("verify_chain", seed)
        win = window_layout(lay, 6)
        seq = lay.seq_lens_k.numpy()
        q = np.diff(lay.cu_seqlens_q.numpy())
        assert (seq - window_skip_host(seq, q, 6, lay.page_size) == win.seq_lens_k.numpy()).all()


def test_into_buffers_rewrites_every_field():
    """A graph step's buffers hold the previous step's values: a derivation into them equals a
    fresh one (no field left from before)."""
    a, b = _layout("decode", 1), _layout("decode", 2)
    if a.bs != b.bs or a.kv_indices.shape != b.kv_indices.shape:
        b = _layout("decode", 1)
    held = window_layout(a, 5)
    for t in (held.seq_lens_k, held.page_table, held.kv_indptr, held.kv_indices, held.prefix_lens):
        t.fill_(77)
    window_layout(a, 5, out=held)
    fresh = window_layout(a, 5)
    for k, v in fresh.as_dict().items():
        assert torch.equal(getattr(held, k), v) if isinstance(v, torch.Tensor) else getattr(held, k) == v, k


def test_bad_window_is_refused():
    with pytest.raises(ValueError, match="window=0 must be >= 1"):
        window_layout(_layout("decode", 0), 0)
