"""``attn-backends list``: every registered backend, available here or not (and why), with its
capabilities, in lines of at most 100 columns."""
from __future__ import annotations

import os
import textwrap
from typing import TextIO

import torch

from .. import registry
from ..base import GraphSupport
from ..batch import ForwardMode
from ..capabilities import FEATURE_WORDS
from ..config import KV_DTYPE_NAMES
from .report import WIDTH, grid

ALL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
MODE_ABBREV = {"EXTEND": "extend", "DECODE": "decode", "TARGET_VERIFY": "verify",
               "DRAFT_EXTEND": "draft_extend", "IDLE": "idle"}


def _caps_cells(caps) -> list:
    if caps is None:
        return ["-"] * 5
    kinds = "+".join(k for k, on in (("MHA", caps.mha), ("MLA", caps.mla)) if on) or "-"
    return [kinds, ",".join(map(str, caps.page_sizes)), "yes" if caps.topk_gt1 else "no",
            caps.graph.name.lower(), ",".join(caps.devices) + (f" (sm_{caps.min_sm}+)" if caps.min_sm else "")
            + (" (layout checks only)" if caps.layout_only else "")]


def _class_of(info):
    try:
        return registry.get_backend_class(info.target)
    except ValueError:
        return None


def graph_label(caps, mode: ForwardMode) -> str:
    """How a mode runs under graphs: "full" (captured in the runner's graph) or "piecewise" (the
    rest of the model captured, attention eager between the pieces)."""
    g = caps.graph_for(mode)
    full = g == GraphSupport.ALWAYS or (g == GraphSupport.UNIFORM_BATCH and mode.is_uniform())
    return "full" if full else "piecewise"


def _notes(info, builtins: set) -> list:
    """The indented lines under a backend's row: modes (with their graph support), limits,
    preference, origin, why not here."""
    notes = []
    if info.capabilities is not None:
        caps = info.capabilities
        notes.append("modes: " + ", ".join(f"{MODE_ABBREV.get(m.name, m.name.lower())} [{graph_label(caps, m)}]"
                                           for m in sorted(caps.modes, key=int)))
        limits = []
        if set(caps.dtypes) != set(ALL_DTYPES):
            limits.append(f"dtypes {', '.join(str(d)[6:] for d in caps.dtypes)}")
        if caps.head_dims is not None:
            limits.append(f"head dims {', '.join(map(str, caps.head_dims))}")
        if caps.kv_dtypes:                     # check's --kv-dtype names: what an engine's flag says
            names = {d: n for n, d in KV_DTYPE_NAMES.items() if d is not None}
            limits.append(f"KV caches: model's, {', '.join(names.get(d, str(d)[6:]) for d in caps.kv_dtypes)}")
        if caps.features():                    # what a model beyond plain causal attention needs of it
            limits.append(f"attention: {', '.join(FEATURE_WORDS[f] for f in caps.features())}")
        if limits:
            notes.append("; ".join(limits))
        if caps.cannot:
            notes.append(f"cannot: {caps.cannot}")
        by_mode = getattr(_class_of(info), "by_mode", None)
        if by_mode:
            notes.append("runs: " + ", ".join(f"{MODE_ABBREV.get(m.name, m.name)} on {'|'.join(filter(None, p))}"
                                              for m, p in sorted(by_mode.items())))
        if caps.preference:
            notes.append(f"preference: {caps.preference}")
    if info.name not in builtins:
        notes.append(f"plugin: {info.target}")
    if not info.available:
        notes.append(f"not available: {info.reason or '?'}")
    return notes


def _override_note(known: set) -> str:
    """What ``ATTN_BACKENDS_BACKEND`` makes select() take, when it is set ("" otherwise)."""
    value = os.environ.get(registry.ENV_BACKEND, "")
    how = f"{registry.ENV_BACKEND}={value}"
    try:
        names = registry.parse_override(value, how)
    except ValueError as e:
        return f"{e}: select() raises this"
    if not names:
        return ""
    note = f"{how}: select() takes " + ", ".join(f"{n} in {m.name}" if m else n for m, n in names.items())
    unknown = [n for n in names.values() if n not in known and ":" not in n]
    return note + (f"; unknown: {', '.join(unknown)} (select() raises)" if unknown else " where it serves, "
                   "else raises its reason")


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
    note = _override_note({i.name for i in infos})
    if note:
        print("\n".join(textwrap.wrap(note, WIDTH, subsequent_indent="  ", break_on_hyphens=False)), file=out)
    print("\n".join(lines[:2]), file=out)
    for line, info in zip(lines[2:], infos):
        print(line, file=out)
        for note in _notes(info, builtins):
            print("\n".join(textwrap.wrap(note, WIDTH, initial_indent="    ", subsequent_indent="      ",
                                             break_on_hyphens=False)), file=out)
    return 0
