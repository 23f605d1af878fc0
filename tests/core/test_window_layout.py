"""Issue #42.2: a sliding group's layout starts each request's KV at the first page its first
query row sees, and lists no page before it. Against the batch's own window starts
(``check.features.window_starts``, not the module's) on random scenarios (every mode, ragged
lengths, shuffled pages, padded buckets), the host skip equal to the device one, and the step's
cache: one derivation per step and window, a graph key's buffers rewritten in place."""
import random

import numpy as np
import pytest
import torch

from attn_backends import ModelConfig, get_backend
from attn_backends.batch import ForwardMode, GraphKey
from attn_backends.check.features import window_starts
from attn_backends.check.scenarios import Scenario, draft_decode_spec, make_memory, materialize, verify_spec
from attn_backends.layout import build_layout, inputs_from_batch
from attn_backends.window_layout import step_window_layout, window_layout, window_skip_host

CFG = ModelConfig(num_layers=1, num_q_heads=4, num_kv_heads=2, head_dim=16, page_size=16)


def _step(mode: str, seed: int):
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
    return build_layout(inputs_from_batch(m.batch, mem, 1)), m.batch, mem


def _layout(mode: str, seed: int):
    return _step(mode, seed)[0]


def _pages(lay, i):
    return lay.kv_indices[int(lay.kv_indptr[i]):int(lay.kv_indptr[i + 1])].tolist()


@pytest.mark.parametrize("mode", ["decode", "verify_chain", "verify_tree", "draft_decode", "extend"])
@pytest.mark.parametrize("window", [1, 3, 16, 21, 40, 1000])
def test_window_layout_starts_at_the_first_visible_page(mode, window):
    for seed in range(3):
        lay, batch, _ = _step(mode, seed)
        win = window_layout(lay, window)
        ps = lay.page_size
        starts = [(base, first) for _, base, first in window_starts(batch)]
        # pad rows: their one row at seq_len - W (the canonical pad rule)
        starts += [(int(p), int(p)) for p in lay.prefix_lens[len(starts):]]
        for i, (base, first) in enumerate(starts):
            lo = max(0, first - window + 1)              # the first key the first row sees
            # a multi-branch draft starts at its prompt prefix's window (its branches' rows sit deeper)
            skip = (max(0, base - window + 1) if lay.draft_prefix_lens is not None else lo) // ps
            assert skip * ps <= lo, "a page the first row sees was dropped"
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
    a = _layout("draft_decode", 1)
    held = window_layout(a, 5)
    for t in (held.seq_lens_k, held.page_table, held.kv_indptr, held.kv_indices, held.prefix_lens,
              held.draft_prefix_lens):
        t.fill_(77)
    window_layout(a, 5, out=held)
    fresh = window_layout(a, 5)
    for k, v in fresh.as_dict().items():
        assert torch.equal(getattr(held, k), v) if isinstance(v, torch.Tensor) else getattr(held, k) == v, k


def test_bad_window_is_refused():
    with pytest.raises(ValueError, match="window=0 must be >= 1"):
        window_layout(_layout("decode", 0), 0)


def test_the_step_cache_derives_once_a_step_and_rewrites_a_keys_buffers():
    """Within a step one derivation serves every caller; an eager step's next derivation is fresh
    tensors (its layout is); a graph key's is its fixed buffers, rewritten."""
    _, batch, mem = _step("decode", 4)
    be = get_backend("torch_native", CFG, mem)
    be.init_forward_metadata(batch)
    view = be.forward_metadata.view
    first = step_window_layout(view, 21)
    assert step_window_layout(view, 21) is first and step_window_layout(view, 40) is not first
    later = step_window_layout(view._replace(step_id=view.step_id + 10 ** 6), 21)
    assert later is not first and later.kv_indices is not first.kv_indices
    graph = view._replace(key=GraphKey(batch.forward_mode, view.layout.bs, 1))
    held = step_window_layout(graph, 21)
    held.kv_indices.fill_(-5)
    again = step_window_layout(graph._replace(step_id=graph.step_id + 1), 21)
    assert again.kv_indices is held.kv_indices and torch.equal(again.kv_indices, first.kv_indices)
