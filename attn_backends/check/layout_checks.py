"""Element-wise checks of one canonical layout dict (``as_layout()``) against the batch the
runner built, the KV memory, and the padding rules. Each returns messages; empty = holds."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..batch import ForwardMode
from ..layout import pad_seq_len

HOST_BOUNDS = {"max_seq_len_k"}   # graph mode may bake a static upper bound here


def poison(buffers: dict) -> None:
    """Fill static buffers with values no builder would write (I3: stale data must not survive a replay)."""
    for i, t in enumerate(buffers.values()):
        if t.dtype == torch.bool:
            t.fill_(True)
        elif t.dtype.is_floating_point:
            t.fill_(float("nan"))
        else:   # the largest value the dtype holds (uint8 masks: all bits set), or -7 where signed
            info = torch.iinfo(t.dtype)
            t.fill_(min(2 ** 30, info.max) if i % 2 else max(-7, info.min) or info.max)


def snapshot(buffers: dict) -> dict:
    return {k: (t.data_ptr(), tuple(t.shape), t.dtype) for k, t in buffers.items()}


def _pad_equal(r: torch.Tensor, e: torch.Tensor) -> bool:
    """``r`` (possibly a larger static buffer) equals ``e`` where ``e`` has data, zeros elsewhere."""
    if r.dim() != e.dim():
        return False
    if any(a < b for a, b in zip(r.shape, e.shape)):
        return False
    head = r[tuple(slice(0, n) for n in e.shape)]
    if not torch.equal(head.cpu(), e.cpu()):
        return False
    rest = r.clone()
    rest[tuple(slice(0, n) for n in e.shape)] = 0
    return not bool(rest.any())


def _first_diff(r: torch.Tensor, e: torch.Tensor) -> str:
    if r.shape != e.shape:
        return f"shape {tuple(r.shape)} vs {tuple(e.shape)}: {r.flatten()[:12].tolist()} vs {e.flatten()[:12].tolist()}"
    idx = (r.cpu() != e.cpu()).nonzero()
    if len(idx) == 0:
        return "equal"
    i = tuple(idx[0].tolist())
    return f"first difference at {list(i)}: {r[i].item()} vs {e[i].item()}"


def compare_layouts(r: dict, e: dict, exact: bool) -> list:
    """``r`` (replay) vs ``e`` (eager / earlier replay); non-exact allows static padding."""
    msgs = []
    for k in sorted(set(r) | set(e)):
        if k not in r or k not in e:
            msgs.append(f"field {k} present in only one layout")
            continue
        a, b = r[k], e[k]
        if isinstance(a, torch.Tensor):
            same = torch.equal(a.cpu(), b.cpu()) if exact or a.shape == b.shape else _pad_equal(a, b)
            if not same:
                msgs.append(f"{k}: replay != {'earlier replay' if exact else 'eager'} ({_first_diff(a, b)})")
        elif k in HOST_BOUNDS and not exact:
            if a < b:
                msgs.append(f"{k}: replay host value {a} < eager {b}")
        elif a != b:
            msgs.append(f"{k}: {a} vs {b}")
    return msgs


def _cdiv(a: torch.Tensor, b: int) -> torch.Tensor:
    return (a + b - 1) // b


@dataclass
class _Ctx:
    """One layout under check (``g``: host int64 copies) and what the runner wrote."""
    g: dict
    m: object
    mem: object
    fill: int
    qlen: torch.Tensor           # [bs] query rows per request as the runner laid them out
    cu: torch.Tensor             # [bs+1]

    @property
    def scn(self):
        return self.m.scenario


def check_layout(lay: dict, m, mem, fill: int) -> dict:
    """I1 (against the runner), I3, I4, I5, I6 for one layout of materialized batch ``m``."""
    scn = m.scenario
    out = {k: [] for k in ("I1", "I3", "I4", "I5", "I6")}
    g = {k: (v.cpu().to(torch.int64) if isinstance(v, torch.Tensor) and v.dtype != torch.bool else
             v.cpu() if isinstance(v, torch.Tensor) else v) for k, v in lay.items()}
    out["I1"] = [f"as_layout() lacks {k}" for k in ("cu_seqlens_q", "seq_lens_k", "prefix_lens", "max_seq_len_q",
                                                    "max_seq_len_k") if k not in g]
    if out["I1"]:
        return out
    bs, raw = scn.bs, scn.raw_bs
    uniform = scn.mode != ForwardMode.EXTEND
    qlen = torch.tensor([scn.width] * bs if uniform else list(scn.extend_lens) + [1] * (bs - raw))
    c = _Ctx(g, m, mem, fill, qlen, torch.cat([torch.zeros(1, dtype=torch.int64), qlen.cumsum(0)]))
    out["I1"] = _runner_layout(c)
    out["I3"] = _pad_rows(c)
    out["I4"] = _derived(c)
    out["I5"] = _kv_extent(c)
    out["I6"] = _capacity(c)
    return out


def _runner_layout(c: _Ctx) -> list:
    """I1: the layout the runner wrote (stride W, positions, KV slots, tree mask)."""
    g, scn, ps, msgs = c.g, c.scn, c.mem.page_size, []
    if g["cu_seqlens_q"].shape != c.cu.shape or not torch.equal(g["cu_seqlens_q"], c.cu):
        msgs.append(f"cu_seqlens_q {g['cu_seqlens_q'].tolist()} != runner layout {c.cu.tolist()}")
    if g["max_seq_len_q"] != int(c.qlen.max()):
        msgs.append(f"max_seq_len_q {g['max_seq_len_q']} != {int(c.qlen.max())}")
    pt = g.get("page_table")
    pos, loc = c.m.batch.positions.cpu(), c.m.batch.out_cache_loc.cpu()
    for i in range(scn.raw_bs):
        r0, n = int(c.cu[i]), int(c.qlen[i])
        want = g["prefix_lens"][i] + torch.arange(n)
        if not torch.equal(pos[r0:r0 + n], want):
            msgs.append(f"request {i}: runner positions {pos[r0:r0 + n].tolist()} != prefix_lens+j {want.tolist()}")
            break
        if pt is not None and int(want.max()) // ps < pt.shape[1]:
            slots = pt[i, want // ps] * ps + want % ps
            if not torch.equal(slots, loc[r0:r0 + n]):
                msgs.append(f"request {i}: page_table slots {slots.tolist()} "
                            f"!= out_cache_loc {loc[r0:r0 + n].tolist()}")
                break
    spec = scn.spec
    if spec is not None and spec.tree_mask is not None and scn.mode == ForwardMode.TARGET_VERIFY:
        cm = g.get("custom_mask")
        want = spec.tree_mask[:scn.raw_bs].cpu().reshape(-1)
        if cm is None or cm.numel() < want.numel() or not torch.equal(cm[:want.numel()], want):
            msgs.append("custom_mask of the real requests != the runner's tree mask")
    return msgs


def _pad_rows(c: _Ctx) -> list:
    """I3: pad rows hold the canonical pad values."""
    g, w, msgs = c.g, c.scn.width, []
    seq, pt = g["seq_lens_k"], g.get("page_table")
    pad_seq = pad_seq_len(c.fill, w)
    for i in range(c.scn.raw_bs, c.scn.bs):
        if int(seq[i]) != pad_seq or int(seq[i]) < max(w, 1):
            msgs.append(f"pad row {i}: seq_lens_k={int(seq[i])}, expected fill {pad_seq} (>= W={w})")
        if pt is not None and bool(pt[i].any()):
            held = pt[i][pt[i] != 0][:4].tolist()
            msgs.append(f"pad row {i}: page_table holds {held}, expected the reserved page 0")
        if "kv_indptr" in g and "kv_indices" in g:
            a, b = int(g["kv_indptr"][i]), int(g["kv_indptr"][i + 1])
            if 0 <= a <= b <= g["kv_indices"].numel() and bool(g["kv_indices"][a:b].any()):
                msgs.append(f"pad row {i}: kv_indices {g['kv_indices'][a:b].tolist()}, expected page 0")
        if "custom_mask" in g and w:
            blk = g["custom_mask"][i * w * w:(i + 1) * w * w].reshape(w, w)
            if not torch.equal(blk, torch.tril(torch.ones(w, w, dtype=torch.bool))):
                msgs.append(f"pad row {i}: custom_mask block is not the canonical causal block")
        if msgs:
            break
    return msgs


def _derived(c: _Ctx) -> list:
    """I4: sums, indptrs and maxima consistent with the padded tensors."""
    g, bs, w, ps, msgs = c.g, c.scn.bs, c.scn.width, c.mem.page_size, []
    seq, prefix, cu = g["seq_lens_k"], g["prefix_lens"], g["cu_seqlens_q"]
    if int(cu[0]) != 0 or bool((cu[1:] < cu[:-1]).any()):
        msgs.append(f"cu_seqlens_q not a non-decreasing indptr from 0: {cu.tolist()}")
    if not torch.equal(prefix, seq - c.qlen):
        msgs.append(f"prefix_lens {prefix.tolist()} != seq_lens_k - q_len {(seq - c.qlen).tolist()}")
    if g["max_seq_len_k"] < int(seq.max()):
        msgs.append(f"max_seq_len_k={g['max_seq_len_k']} < max(seq_lens_k)={int(seq.max())}")
    npages = _cdiv(seq, ps)
    if "kv_indptr" in g:
        want = torch.cat([torch.zeros(1, dtype=torch.int64), npages.cumsum(0)])
        if not torch.equal(g["kv_indptr"], want):
            msgs.append(f"kv_indptr {g['kv_indptr'].tolist()} != cumsum(cdiv(seq_lens_k, {ps})) {want.tolist()}")
    if "kv_last_page_len" in g and not torch.equal(g["kv_last_page_len"], seq - (npages - 1) * ps):
        msgs.append(f"kv_last_page_len {g['kv_last_page_len'].tolist()} inconsistent with seq_lens_k")
    if "mask_indptr" in g and w and not torch.equal(g["mask_indptr"], torch.arange(bs + 1) * w * w):
        msgs.append(f"mask_indptr {g['mask_indptr'].tolist()} != arange(bs+1)*W*W")
    spec = c.scn.spec
    if "draft_prefix_lens" in g and spec is not None:
        want = (seq - w * spec.draft_step).clamp(min=0)
        if not torch.equal(g["draft_prefix_lens"], want):
            msgs.append(f"draft_prefix_lens {g['draft_prefix_lens'].tolist()} != seq - W*step {want.tolist()}")
    return msgs


def _kv_extent(c: _Ctx) -> list:
    """I5: KV extent of the real requests; their pages through req_to_token."""
    g, scn, ps, msgs = c.g, c.scn, c.mem.page_size, []
    seq, pt = g["seq_lens_k"], g.get("page_table")
    r2t = c.mem.req_to_token.cpu().to(torch.int64)
    for i in range(scn.raw_bs):
        want = scn.prefix_lens[i] + int(c.qlen[i])
        if int(seq[i]) != want:
            msgs.append(f"request {i}: seq_lens_k={int(seq[i])} "
                        f"!= prefix {scn.prefix_lens[i]} + q_len {int(c.qlen[i])}")
            break
        n = int(_cdiv(seq[i], ps))
        pages = r2t[c.m.rows[i], torch.arange(n) * ps] // ps
        if pt is not None and (pt.shape[1] < n or not torch.equal(pt[i, :n], pages)):
            msgs.append(f"request {i}: page_table row {pt[i, :n].tolist()} != its {n} pages {pages.tolist()}")
            break
        if "kv_indices" in g and "kv_indptr" in g:
            a = int(g["kv_indptr"][i])
            seg = g["kv_indices"][a:a + n]
            if not torch.equal(seg, pages):
                msgs.append(f"request {i}: kv_indices {seg.tolist()} != its pages {pages.tolist()}")
                break
    return msgs


def _capacity(c: _Ctx) -> list:
    """I6: indices in range, buffers large enough."""
    g, mem, msgs = c.g, c.mem, []
    seq, pt, ps = g["seq_lens_k"], g.get("page_table"), mem.page_size
    num_pages = mem.num_slots // ps
    if pt is not None:
        if bool(((pt < 0) | (pt >= num_pages)).any()):
            msgs.append(f"page_table holds pages outside 0..{num_pages - 1}")
        if pt.shape[1] < int(_cdiv(seq, ps).max()):
            msgs.append(f"page_table has {pt.shape[1]} columns, a row needs {int(_cdiv(seq, ps).max())}")
    if "kv_indices" in g:
        ki = g["kv_indices"]
        if bool(((ki < 0) | (ki >= num_pages)).any()):
            msgs.append(f"kv_indices hold pages outside 0..{num_pages - 1}")
        if "kv_indptr" in g and int(g["kv_indptr"][-1]) > ki.numel():
            msgs.append(f"kv_indices capacity {ki.numel()} < kv_indptr[-1]={int(g['kv_indptr'][-1])}")
    if int(seq.max()) > mem.max_context_len:
        msgs.append(f"seq_lens_k max {int(seq.max())} > max_context_len {mem.max_context_len}")
    return msgs
