"""The batch kinds: one table that the suite's cases, the runner kinds of the runtime and the
command line all name. A kind is a forward mode plus what its mask needs."""
from __future__ import annotations

from dataclasses import dataclass

from .batch import ForwardMode


@dataclass(frozen=True)
class BatchKind:
    name: str
    mode: ForwardMode
    tree: bool = False      # TARGET_VERIFY with topk > 1: a tree mask
    draft: bool = False     # DECODE of topk draft branches per request (multi-step draft)

    def served_by(self, caps) -> bool:
        """Whether a backend with capabilities ``caps`` runs this kind."""
        return (self.mode in caps.modes and (caps.topk_gt1 or not self.tree)
                and (caps.draft_decode or not self.draft))


BATCH_KINDS: dict[str, BatchKind] = {k.name: k for k in (
    BatchKind("decode", ForwardMode.DECODE),
    BatchKind("draft_decode", ForwardMode.DECODE, draft=True),
    BatchKind("extend", ForwardMode.EXTEND),
    BatchKind("verify_chain", ForwardMode.TARGET_VERIFY),
    BatchKind("verify_tree", ForwardMode.TARGET_VERIFY, tree=True),
    BatchKind("draft_extend", ForwardMode.DRAFT_EXTEND),
)}


def kinds_served(caps) -> list[str]:
    """The names of the kinds a backend serves, in table order."""
    return [k.name for k in BATCH_KINDS.values() if k.served_by(caps)]
