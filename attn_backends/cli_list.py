"""``attn-backends list``: every registered backend, available here or not (and why), with its
capabilities, in lines of at most 100 columns."""
from __future__ import annotations

import textwrap
from typing import TextIO

import torch

from . import registry
from .testing.report import WIDTH, grid

MODE_ABBREV = {"EXTEND": "extend", "DECODE": "decode", "TARGET_VERIFY": "verify",
               "DRAFT_EXTEND": "draft_extend", "IDLE": "idle"}


def _caps_cells(caps) -> list:
    if caps is None:
        return ["-"] * 5
    kinds = "+".join(k for k, on in (("MHA", caps.mha), ("MLA", caps.mla)) if on) or "-"
    return [kinds, ",".join(map(str, caps.page_sizes)), "yes" if caps.topk_gt1 else "no",
            caps.graph.name.lower(), ",".join(caps.devices) + (f" (sm_{caps.min_sm}+)" if caps.min_sm else "")]


def _notes(info, builtins: set) -> list:
    """The indented lines under a backend's row: modes, preference, origin, why not here."""
    notes = []
    if info.capabilities is not None:
        caps = info.capabilities
        notes.append("modes: " + ", ".join(MODE_ABBREV.get(m.name, m.name.lower())
                                           for m in sorted(caps.modes, key=int)))
        if caps.preference:
            notes.append(f"preference: {caps.preference}")
    if info.name not in builtins:
        notes.append(f"plugin: {info.target}")
    if not info.available:
        notes.append(f"not available: {info.reason or '?'}")
    return notes


def cmd_list(args, out: TextIO) -> int:
    """A row of capabilities per registered backend, and under it the modes, the declared
    preference, where a plugin comes from and why a backend is not available here."""
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    infos = registry.list_backends(device)
    builtins = set(registry.builtin_names())
    head = ["backend", "here", "kind", "page sizes", "topk>1", "graphs", "devices"]
    rows = [[i.name, "yes" if i.available else "no", *_caps_cells(i.capabilities)] for i in infos]
    lines = grid(head, rows, width=1 << 30).splitlines()   # one line per backend: its notes follow it
    print(f"backends on {device}: {sum(i.available for i in infos)} of {len(infos)} available", file=out)
    print("\n".join(lines[:2]), file=out)
    for line, info in zip(lines[2:], infos):
        print(line, file=out)
        for note in _notes(info, builtins):
            print("\n".join(textwrap.wrap(note, WIDTH, initial_indent="    ", subsequent_indent="      ",
                                             break_on_hyphens=False)), file=out)
    return 0
