"""Issue #11 defect 5: the layout builder's own padding is exercised. One pad rule, one owner
(:func:`layout.canonical_rows`): whatever a caller leaves in the rows ``raw_bs..bs-1`` (a real
request's row, huge lengths, a wrong tree mask or accept length, NaN queries and K/V), the
eager layout and the real rows' output equal those of the cleanly padded batch, bit for bit."""
import dataclasses
import random

import pytest
import torch
from test_nan_padding import MODES, _scenario  # noqa: I001 (a sibling test module)

from attn_backends import ModelConfig, get_backend
from attn_backends.check.scenarios import make_memory, materialize

CFG = ModelConfig(num_layers=1, num_q_heads=4, num_kv_heads=2, head_dim=16, page_size=16)


def _garbage(m, fill_rows):
    """The batch of ``m`` with its pad rows overwritten by garbage a caller might leave there."""
    b, raw = m.batch, m.batch.raw_bs
    req, seq = b.req_pool_indices.clone(), b.seq_lens.clone()
    req[raw:] = fill_rows
    seq[raw:] = 10 ** 6
    spec = b.spec_info
    if spec is not None and spec.tree_mask is not None:
        tm = spec.tree_mask.clone()
        tm[raw:] = ~tm[raw:]
        spec = dataclasses.replace(spec, tree_mask=tm)
    if spec is not None and spec.accept_lens is not None:
        acc = spec.accept_lens.clone()
        acc[raw:] = 10 ** 4
        spec = dataclasses.replace(spec, accept_lens=acc)
    return dataclasses.replace(b, req_pool_indices=req, seq_lens=seq, seq_lens_cpu=seq.clone(), spec_info=spec)


def _layout_and_output(be, batch, pad_value: float):
    be.init_forward_metadata(batch)
    lay = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in be.forward_metadata.as_layout().items()}
    g = torch.Generator().manual_seed(3)
    n, raw_rows = batch.num_tokens, batch.raw_bs * batch.width
    q = torch.randn(n, CFG.num_q_heads, CFG.qk_dim, generator=g)
    k = torch.randn(n, CFG.num_kv_heads, CFG.qk_dim, generator=g)
    v = torch.randn(n, CFG.num_kv_heads, CFG.out_dim, generator=g)
    for t in (q, k, v):
        t[raw_rows:] = pad_value
    return lay, be.forward(q, k, v, CFG.layer(0), batch)[:raw_rows]


def garbage_pad_messages(mode: str) -> list:
    """What differs between a cleanly padded batch and the same batch with garbage pad rows."""
    mem = make_memory(CFG, num_pages=40, max_reqs=8, max_context_len=128, seed=2)
    be = get_backend("torch_native", CFG, mem)
    m = materialize(_scenario(mode, 4, [30, 9], random.Random(1)), mem, 1)
    clean_lay, clean_out = _layout_and_output(be, m.batch, 0.0)
    lay, out = _layout_and_output(be, _garbage(m, m.rows[0]), float("nan"))
    msgs = [f"{k}: garbage in the pad rows reached the layout" for k in clean_lay
            if not (torch.equal(lay[k], clean_lay[k]) if isinstance(lay[k], torch.Tensor) else lay[k] == clean_lay[k])]
    if not torch.equal(out, clean_out):
        msgs.append("garbage in the pad rows changed a real row's output")
    return msgs


@pytest.mark.parametrize("mode", MODES)
def test_eager_builder_pads_garbage_rows(mode):
    msgs = garbage_pad_messages(mode)
    assert not msgs, "\n".join(msgs)
