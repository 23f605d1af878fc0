"""Element-wise checks of one canonical layout dict (``as_layout()``) against the batch the
runner built, the KV memory, and the padding rules. Each returns messages; empty = holds."""
from __future__ import annotations

import torch

from ..batch import ForwardMode

HOST_BOUNDS = {"max_seq_len_k"}   # graph mode may bake a static upper bound here


def poison(buffers: dict) -> None:
    """Fill static buffers with values no builder would write (I3/F: stale data must not survive)."""
    for i, t in enumerate(buffers.values()):
        if t.dtype == torch.bool:
            t.fill_(True)
        elif t.dtype.is_floating_point:
            t.fill_(float("nan"))
        else:
            t.fill_(2 ** 30 if i % 2 else -7)


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


def check_layout(lay: dict, m, mem, fill: int) -> dict:
    """I1 (against the runner), I3, I4, I5, I6 for one layout of materialized batch ``m``."""
    scn, batch = m.scenario, m.batch
    bs, raw, ps = scn.bs, scn.raw_bs, mem.page_size
    out = {k: [] for k in ("I1", "I3", "I4", "I5", "I6")}
    g = {k: (v.cpu().to(torch.int64) if isinstance(v, torch.Tensor) and v.dtype != torch.bool else
             v.cpu() if isinstance(v, torch.Tensor) else v) for k, v in lay.items()}
    for need in ("cu_seqlens_q", "seq_lens_k", "prefix_lens", "max_seq_len_q", "max_seq_len_k"):
        if need not in g:
            out["I1"].append(f"as_layout() lacks {need}")
    if out["I1"]:
        return out
    uniform = scn.mode != ForwardMode.EXTEND
    w = scn.width
    qlen = torch.tensor([w] * bs if uniform else list(scn.extend_lens) + [1] * (bs - raw))
    cu = torch.cat([torch.zeros(1, dtype=torch.int64), qlen.cumsum(0)])
    seq, prefix = g["seq_lens_k"], g["prefix_lens"]
    spec = scn.spec
    # ---- I1: the layout the runner wrote (stride W, positions, KV slots, tree mask)
    if g["cu_seqlens_q"].shape != cu.shape or not torch.equal(g["cu_seqlens_q"], cu):
        out["I1"].append(f"cu_seqlens_q {g['cu_seqlens_q'].tolist()} != runner layout {cu.tolist()}")
    if g["max_seq_len_q"] != int(qlen.max()):
        out["I1"].append(f"max_seq_len_q {g['max_seq_len_q']} != {int(qlen.max())}")
    pt = g.get("page_table")
    pos, loc = batch.positions.cpu(), batch.out_cache_loc.cpu()
    for i in range(raw):
        r0, n = int(cu[i]), int(qlen[i])
        want = prefix[i] + torch.arange(n)
        if not torch.equal(pos[r0:r0 + n], want):
            out["I1"].append(f"request {i}: runner positions {pos[r0:r0 + n].tolist()} "
                             f"!= prefix_lens+j {want.tolist()}")
            break
        if pt is not None and int(want.max()) // ps < pt.shape[1]:
            slots = pt[i, want // ps] * ps + want % ps
            if not torch.equal(slots, loc[r0:r0 + n]):
                out["I1"].append(f"request {i}: page_table slots {slots.tolist()} "
                                 f"!= out_cache_loc {loc[r0:r0 + n].tolist()}")
                break
    if spec is not None and spec.tree_mask is not None and scn.mode == ForwardMode.TARGET_VERIFY:
        cm = g.get("custom_mask")
        want = spec.tree_mask[:raw].cpu().reshape(-1)
        if cm is None or cm.numel() < want.numel() or not torch.equal(cm[:want.numel()], want):
            out["I1"].append("custom_mask of the real requests != the runner's tree mask")
    # ---- I3: pad rows
    pad_seq = max(fill, w or 1)
    for i in range(raw, bs):
        if int(seq[i]) != pad_seq or int(seq[i]) < max(w, 1):
            out["I3"].append(f"pad row {i}: seq_lens_k={int(seq[i])}, expected fill {pad_seq} (>= W={w})")
        if pt is not None and bool(pt[i].any()):
            held = pt[i][pt[i] != 0][:4].tolist()
            out["I3"].append(f"pad row {i}: page_table holds {held}, expected the reserved page 0")
        if "kv_indptr" in g and "kv_indices" in g:
            a, b = int(g["kv_indptr"][i]), int(g["kv_indptr"][i + 1])
            if 0 <= a <= b <= g["kv_indices"].numel() and bool(g["kv_indices"][a:b].any()):
                out["I3"].append(f"pad row {i}: kv_indices {g['kv_indices'][a:b].tolist()}, expected page 0")
        if "custom_mask" in g and w:
            blk = g["custom_mask"][i * w * w:(i + 1) * w * w].reshape(w, w)
            if not torch.equal(blk, torch.tril(torch.ones(w, w, dtype=torch.bool))):
                out["I3"].append(f"pad row {i}: custom_mask block is not the canonical causal block")
        if out["I3"]:
            break
    # ---- I4: derived consistency
    c = g["cu_seqlens_q"]
    if int(c[0]) != 0 or bool((c[1:] < c[:-1]).any()):
        out["I4"].append(f"cu_seqlens_q not a non-decreasing indptr from 0: {c.tolist()}")
    if not torch.equal(prefix, seq - qlen):
        out["I4"].append(f"prefix_lens {prefix.tolist()} != seq_lens_k - q_len {(seq - qlen).tolist()}")
    if g["max_seq_len_k"] < int(seq.max()):
        out["I4"].append(f"max_seq_len_k={g['max_seq_len_k']} < max(seq_lens_k)={int(seq.max())}")
    npages = _cdiv(seq, ps)
    if "kv_indptr" in g:
        ip = g["kv_indptr"]
        want = torch.cat([torch.zeros(1, dtype=torch.int64), npages.cumsum(0)])
        if not torch.equal(ip, want):
            out["I4"].append(f"kv_indptr {ip.tolist()} != cumsum(cdiv(seq_lens_k, {ps})) {want.tolist()}")
    if "kv_last_page_len" in g and not torch.equal(g["kv_last_page_len"], seq - (npages - 1) * ps):
        out["I4"].append(f"kv_last_page_len {g['kv_last_page_len'].tolist()} inconsistent with seq_lens_k")
    if "mask_indptr" in g and w and not torch.equal(g["mask_indptr"], torch.arange(bs + 1) * w * w):
        out["I4"].append(f"mask_indptr {g['mask_indptr'].tolist()} != arange(bs+1)*W*W")
    if "draft_prefix_lens" in g and spec is not None:
        want = (seq - w * spec.draft_step).clamp(min=0)
        if not torch.equal(g["draft_prefix_lens"], want):
            out["I4"].append(f"draft_prefix_lens {g['draft_prefix_lens'].tolist()} != seq - W*step {want.tolist()}")
    # ---- I5: KV extent of the real requests, pages through req_to_token
    r2t = mem.req_to_token.cpu().to(torch.int64)
    for i in range(raw):
        want = scn.prefix_lens[i] + int(qlen[i])
        if int(seq[i]) != want:
            out["I5"].append(f"request {i}: seq_lens_k={int(seq[i])} "
                             f"!= prefix {scn.prefix_lens[i]} + q_len {int(qlen[i])}")
            break
        n = int(npages[i])
        pages = r2t[m.rows[i], torch.arange(n) * ps] // ps
        if pt is not None and (pt.shape[1] < n or not torch.equal(pt[i, :n], pages)):
            out["I5"].append(f"request {i}: page_table row {pt[i, :n].tolist()} != its {n} pages {pages.tolist()}")
            break
        if "kv_indices" in g and "kv_indptr" in g:
            a = int(g["kv_indptr"][i])
            seg = g["kv_indices"][a:a + n]
            if not torch.equal(seg, pages):
                out["I5"].append(f"request {i}: kv_indices {seg.tolist()} != its pages {pages.tolist()}")
                break
    # ---- I6: capacity and index range
    num_pages = mem.num_slots // ps
    if pt is not None:
        if bool(((pt < 0) | (pt >= num_pages)).any()):
            out["I6"].append(f"page_table holds pages outside 0..{num_pages - 1}")
        if pt.shape[1] < int(npages.max()):
            out["I6"].append(f"page_table has {pt.shape[1]} columns, a row needs {int(npages.max())}")
    if "kv_indices" in g:
        ki = g["kv_indices"]
        if bool(((ki < 0) | (ki >= num_pages)).any()):
            out["I6"].append(f"kv_indices hold pages outside 0..{num_pages - 1}")
        if "kv_indptr" in g and int(g["kv_indptr"][-1]) > ki.numel():
            out["I6"].append(f"kv_indices capacity {ki.numel()} < kv_indptr[-1]={int(g['kv_indptr'][-1])}")
    if int(seq.max()) > mem.max_context_len:
        out["I6"].append(f"seq_lens_k max {int(seq.max())} > max_context_len {mem.max_context_len}")
    return out
