"""The canonical view of an SGLang ``ForwardMetadata`` (Triton backend): what its kernels read,
stated as the contract's fields (``docs/plugin-guide.md`` section 4). Split from ``triton.py``."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch

from attn_backends import ForwardMode
from attn_backends.base import ForwardMetadata

I32 = torch.int32


@dataclass(eq=False)
class SGLangMetadata(ForwardMetadata):
    """SGLang's ``ForwardMetadata`` (``sgl``) with what the canonical view needs: the mode, ``bs``,
    W, and, in graph mode, fixed buffers the derived fields are written into (so that their
    addresses hold from capture to replay, like SGLang's own)."""

    sgl: object = None
    mode: ForwardMode = ForwardMode.DECODE
    bs: int = 0
    width: int = 1
    max_k: int = 0
    tree: bool = False
    own: dict = field(default_factory=dict)
    runner_seq: Optional[torch.Tensor] = None     # the runner's seq_lens (what a forward of SGLang's reads)
    # a captured draft step: the kv_indices buffer row its kernels read through the pointer of the
    # capture's slice (draft.py, graph_kv_indices); None elsewhere
    kv_full: Optional[torch.Tensor] = None

    def _out(self, name: str, value: torch.Tensor) -> torch.Tensor:
        buf = self.own.get(name)
        if buf is None or self.key is None:
            return value if value.dtype == torch.bool else value.to(I32)
        buf.copy_(value)
        return buf

    def _draft_blocks(self, prefix: torch.Tensor) -> torch.Tensor:
        """The ``W x W`` draft block of each request in SGLang's verify mask (rows of prefix + W
        entries from ``mask_indptr[i]``); an all-False block where its ``mask_indptr`` points
        outside the buffer or at a row length that does not fit."""
        m, w = self.sgl, self.width
        starts, lens = m.mask_indptr[:self.bs + 1].tolist(), prefix.tolist()
        blocks = []
        for i in range(self.bs):
            a, n = starts[i], w * (lens[i] + w)
            ok = 0 <= a and a + n <= m.custom_mask.numel() and starts[i + 1] - a == n
            rows = m.custom_mask[a:a + n].view(w, lens[i] + w)[:, lens[i]:] if ok else None
            blocks.append(rows.bool() if ok else torch.zeros(w, w, dtype=torch.bool, device=prefix.device))
        return torch.stack(blocks).reshape(-1)

    def as_layout(self) -> dict:
        """The canonical fields of what SGLang's kernels read (host reads: the suite's, after the
        replay; never inside one)."""
        m, bs, w = self.sgl, self.bs, self.width
        indptr = m.kv_indptr[:bs + 1]
        kv_len = (indptr[1:] - indptr[:-1]).to(I32)                  # KV tokens SGLang's kernel reads
        if self.mode == ForwardMode.DECODE:          # the decode kernel reads kv_indptr's tokens, one row
            cu = torch.arange(bs + 1, dtype=I32, device=indptr.device)
            prefix, seq = kv_len - 1, kv_len
        else:   # the extend kernel: kv_indptr's tokens are the prefix, qo_indptr's rows come after them
            cu = m.qo_indptr[:bs + 1]
            prefix = kv_len
            seq = kv_len + (cu[1:] - cu[:-1]).to(I32)
        out = {"cu_seqlens_q": self._out("cu_seqlens_q", cu), "seq_lens_k": self._out("seq_lens_k", seq),
               "prefix_lens": self._out("prefix_lens", prefix),
               "max_seq_len_q": m.max_extend_len if isinstance(m.max_extend_len, int) else w,
               "max_seq_len_k": self.max_k}
        if self.mode == ForwardMode.TARGET_VERIFY and self.tree:
            out["custom_mask"] = self._out("custom_mask", self._draft_blocks(prefix))
        if self.mode == ForwardMode.DECODE:   # decode: SGLang's paged form covers the whole KV, the canonical one
            out["kv_indptr"] = indptr
            used, kv = int(indptr[-1]), m.kv_indices if self.kv_full is None else self.kv_full
            out["kv_indices"] = kv[:used] if 0 <= used <= kv.numel() else kv
        return out
