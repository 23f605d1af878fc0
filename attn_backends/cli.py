"""``attn-backends``: list the registered backends, run the layout-equivalence suite.

``attn-backends list [--device cpu|cuda]``
    every registered backend, available here or not (and why), with its capabilities.
``attn-backends check [--backend NAME|all|module:Class] [--device cpu|cuda] [--cases N] [--seed S]
[--suite-cases M]``
    runs the layout suite (backend x mode x invariant), then every suite registered in the
    entry-point group ``attn_backends.suites`` (this distribution registers the runner suite of
    ``runtime``: I7, I8, I10-I12, I14), prints the matrix and each failure with the seed that
    replays it; exit 1 on any failure, 2 for a backend that cannot run here.

More subcommands come from the entry-point group ``attn_backends.commands``: each entry point is
a callable taking the argparse subparsers object; it adds its subparser and sets ``handler``
(``handler(args) -> exit status``). This distribution registers ``generate`` from ``runtime``.
"""
from __future__ import annotations

import argparse
import importlib
import sys
import time
from typing import Callable, Optional, TextIO

from . import registry

DEVICES = ("cpu", "cuda")
SUITE_MODULE = "attn_backends.testing.suite"
SUITES_GROUP = "attn_backends.suites"   # more suites, e.g. runtime's runner-level invariants
COMMANDS_GROUP = "attn_backends.commands"  # more subcommands, e.g. runtime's `generate`
MODE_ABBREV = {"EXTEND": "extend", "DECODE": "decode", "TARGET_VERIFY": "verify",
               "DRAFT_EXTEND": "draft_extend", "IDLE": "idle"}


class UsageError(Exception):
    """A request the CLI refuses before running anything (exit status 2)."""


# --------------------------------------------------------------------------- list

def _table(head: list, rows: list) -> str:
    """Left-aligned columns; the last column is not padded (it holds free text)."""
    widths = [max(len(r[i]) for r in [head] + rows) for i in range(len(head) - 1)]
    fmt = lambda r: "  ".join([c.ljust(w) for c, w in zip(r, widths)] + [r[-1]]).rstrip()  # noqa: E731
    return "\n".join([fmt(head), fmt(["-" * max(len(h), 1) for h in head[:-1]] + ["-" * len(head[-1])])]
                     + [fmt(r) for r in rows])


def _caps_cells(caps) -> list:
    if caps is None:
        return ["-"] * 6
    modes = sorted(caps.modes, key=int)
    kinds = "+".join(k for k, on in (("MHA", caps.mha), ("MLA", caps.mla)) if on) or "-"
    return [",".join(MODE_ABBREV.get(m.name, m.name.lower()) for m in modes), kinds,
            ",".join(map(str, caps.page_sizes)), "yes" if caps.topk_gt1 else "no",
            caps.graph.name.lower(),
            ",".join(caps.devices) + (f" (sm_{caps.min_sm}+)" if caps.min_sm else "")]


def cmd_list(args, out: TextIO) -> int:
    device = args.device or ("cuda" if _cuda_available() else "cpu")
    infos = registry.list_backends(device)
    head = ["backend", "available", "modes", "kind", "page sizes", "topk>1", "graphs", "devices",
            "reason"]
    rows = [[i.name, "yes" if i.available else "no", *_caps_cells(i.capabilities),
             "" if i.available else (i.reason or "?")] for i in infos]
    print(f"backends on {device} ({sum(i.available for i in infos)} of {len(infos)} available):", file=out)
    print(_table(head, rows), file=out)
    return 0


# --------------------------------------------------------------------------- check

def _cuda_available() -> bool:
    import torch
    return torch.cuda.is_available()


def _resolve(backend: str, device: str) -> list:
    """The backend names ``check`` runs; UsageError if one cannot run on ``device``."""
    if backend == "all":
        infos = registry.list_backends(device)
        names = [i.name for i in infos if i.available]
        if not names:
            why = "; ".join(f"{i.name}: {i.reason}" for i in infos)
            raise UsageError(f"no backend is available on {device} ({why})")
        return names
    try:
        cls = registry.get_backend_class(backend)
    except ValueError as e:
        known = ", ".join(i.name for i in registry.list_backends(device))
        raise UsageError(f"{e}; registered backends: {known}") from None
    reason = registry.unavailable_reason(cls, device)
    if reason:
        raise UsageError(f"backend {backend!r} is not available on {device}: {reason} "
                         "(see `attn-backends list`)")
    return [backend]


def progress_bar(label: str, stream: TextIO, width: int = 30) -> Callable[[int, int], None]:
    """A ``progress(done, total)`` callback drawing a one-line ``\\r`` bar on ``stream``."""
    start = time.monotonic()

    def update(done: int, total: int) -> None:
        frac = done / total if total else 1.0
        fill = int(width * frac)
        bar = "#" * fill + "." * (width - fill)
        stream.write(f"\r{label} [{bar}] {done}/{total} {time.monotonic() - start:5.1f}s")
        if done >= total:
            stream.write("\n")
        stream.flush()

    return update


def _load_run_suite():
    # Imported here, not at module level: `list` and `--help` need no suite (nor its imports).
    try:
        return importlib.import_module(SUITE_MODULE).run_suite
    except ModuleNotFoundError as e:
        if e.name != SUITE_MODULE:
            raise
        raise UsageError(f"{SUITE_MODULE} is missing from this installation") from None


def _extra_suites() -> list:
    """``(name, run)`` for each suite in the entry-point group: same signature as run_suite.
    Found through the installed metadata, so attn_backends never imports runtime itself."""
    from importlib.metadata import entry_points
    return [(ep.name, ep.load()) for ep in sorted(entry_points(group=SUITES_GROUP), key=lambda e: e.name)]


def cmd_check(args, out: TextIO, err: TextIO) -> int:
    names = _resolve(args.backend, args.device)
    run_suite = _load_run_suite()
    extra = _extra_suites() if args.suite_cases else []
    failures = 0
    for name in names:
        print(f"== {name} on {args.device}: {args.cases} cases per mode, seed {args.seed}", file=out)
        out.flush()  # the header before the bar, which goes to the other stream
        progress = progress_bar(name, err) if err.isatty() else None
        t0 = time.monotonic()
        report = run_suite(name, device=args.device, cases=args.cases, seed=args.seed, progress=progress)
        for suite_name, run in extra:
            bar = progress_bar(f"{name} ({suite_name})", err) if err.isatty() else None
            run(name, device=args.device, cases=args.suite_cases, seed=args.seed, progress=bar, report=report)
        print(report.table(), file=out)
        for f in report.failures:
            print(f"\nFAIL {f}", file=out)
        failures += len(report.failures)
        print(f"{name}: {'ok' if not report.failures else f'{len(report.failures)} failure(s)'} "
              f"in {time.monotonic() - t0:.1f}s\n", file=out)
    if failures:
        print(f"{failures} failure(s)", file=out)
        return 1
    return 0


# --------------------------------------------------------------------------- main

def _extra_commands() -> list:
    """The entry points of ``attn_backends.commands``, by name (found through the installed
    metadata: attn_backends never imports runtime itself)."""
    from importlib.metadata import entry_points
    return sorted(entry_points(group=COMMANDS_GROUP), key=lambda e: e.name)


def _register_commands(sub) -> None:
    for ep in _extra_commands():
        if ep.name in sub.choices:
            raise UsageError(f"entry point {ep.value!r} of {COMMANDS_GROUP} redefines the command {ep.name!r}")
        try:
            register = ep.load()
        except Exception as e:  # noqa: BLE001 - a broken plugin must not take `list` and `check` down
            print(f"attn-backends: warning: command {ep.name!r} ({ep.value}) failed to load: {e}", file=sys.stderr)
            continue
        register(sub)


def _positive(s: str) -> int:
    v = int(s)
    if v < 1:
        raise argparse.ArgumentTypeError(f"{v} must be >= 1")
    return v


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="attn-backends", description="Pluggable attention backends: "
                                "list them, check them against the layout contract.")
    sub = p.add_subparsers(dest="command", required=True)
    ls = sub.add_parser("list", help="every registered backend, available or not, and its capabilities")
    ls.add_argument("--device", choices=DEVICES, default=None,
                    help="device to check availability on (default: cuda if present, else cpu)")
    ck = sub.add_parser("check", help="run the layout-equivalence suite on a backend")
    ck.add_argument("--backend", default="torch_native",
                    help="a registered name, 'all' (every backend available on --device) or "
                         "'package.module:Class' (default: torch_native)")
    ck.add_argument("--device", choices=DEVICES, default="cpu", help="default: cpu")
    ck.add_argument("--cases", type=_positive, default=200, help="random cases per mode (default: 200)")
    ck.add_argument("--seed", type=int, default=0,
                    help="random seed; a failure prints the seed that replays it (default: 0)")
    ck.add_argument("--suite-cases", type=int, default=60,
                    help=f"random cases, in all, for each suite of the '{SUITES_GROUP}' entry-point group, "
                         "e.g. the runner invariants spread over the runner kinds (default: 60; 0 skips them)")
    _register_commands(sub)
    return p


def main(argv: Optional[list] = None) -> int:
    try:
        args = build_parser().parse_args(argv)
        if args.command == "list":
            return cmd_list(args, sys.stdout)
        if args.command == "check":
            return cmd_check(args, sys.stdout, sys.stderr)
        return args.handler(args)
    except UsageError as e:
        print(f"attn-backends: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
