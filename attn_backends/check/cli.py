"""``attn-backends``: list the registered backends, run the suites on them.

``attn-backends list [--device cpu|cuda]``
    every registered backend, available here or not (and why), with its capabilities.
``attn-backends check [--backend NAME|all|module:Class|path.py:Class] [--device cpu|cuda]
[--cases N] [--seed S] [--suite-cases M] [--suite NAME] [--mode MODE] [--jobs N] [--verbose]
[--json FILE] [--progress-every SECONDS]``
    runs the layout suite (backend x mode x invariant), then every suite registered in the
    entry-point group ``attn_backends.suites`` (this distribution registers the runner suite of
    ``runtime``: I7-I12, I14, I16), prints a table per suite with a legend, the first failures per
    invariant, each with the one command that replays its case alone; exit 1 on any failure.
    ``--jobs N`` runs the layout suite's cases in N processes (``cli_jobs``), with the same results.

Every misuse (an unknown or unloadable backend, a bad count, a backend that cannot run here)
is one line ``attn-backends: error: ...`` on stderr and exit status 2, before anything runs.

More subcommands come from the entry-point group ``attn_backends.commands``: each entry point is
a callable taking the argparse subparsers object; it adds its subparser and sets ``handler``
(``handler(args) -> exit status``). This distribution registers ``generate`` from the runtime.
"""
from __future__ import annotations

import argparse
import importlib
import inspect
import os
import shlex
import sys
import time
import traceback
from typing import Optional, TextIO

from .. import registry
from ..config import KV_DTYPE_NAMES
from . import cli_jobs
from .cli_list import cmd_list
from .cli_progress import progress_for
from .cli_report import BackendResult, as_json, print_result, write_json
from .report import LAYOUT_SUITE, SuiteReport

DEVICES = ("cpu", "cuda")
SUITE_MODULE = "attn_backends.check.suite"
SUITES_GROUP = "attn_backends.suites"   # more suites, e.g. runtime's runner-level invariants
COMMANDS_GROUP = "attn_backends.commands"  # more subcommands, e.g. the runtime's `generate`
EXIT_SIGPIPE = 128 + 13   # what a shell reports for a program that SIGPIPE ended (`| head`)


class UsageError(Exception):
    """A request the CLI refuses before running anything (exit status 2)."""


# --------------------------------------------------------------------------- check: what to run

def _resolve(backend: str, device: str) -> list:
    """``[(name, class)]`` that ``check`` runs; UsageError if one cannot run on ``device``."""
    if backend == "all":
        infos = registry.list_backends(device)
        names = [i.name for i in infos if i.available]
        if not names:
            why = "; ".join(f"{i.name}: {i.reason}" for i in infos)
            raise UsageError(f"no backend is available on {device} ({why})")
        return [(n, registry.get_backend_class(n)) for n in names]
    try:
        cls = registry.get_backend_class(backend)
    except ValueError as e:
        if ":" in backend:      # a target that does not load: the cause is the message
            raise UsageError(str(e)) from None
        known = ", ".join(i.name for i in registry.list_backends(device))
        raise UsageError(f"{e} (registered backends: {known})") from None
    reason = registry.unavailable_reason(cls, device)
    if reason:
        raise UsageError(f"backend {backend!r} is not available on {device}: {reason} "
                         "(see `attn-backends list`)")
    return [(backend, cls)]


def _load_suite_module():
    # Imported here, not at module level: `list` and `--help` need no suite (nor its imports).
    try:
        return importlib.import_module(SUITE_MODULE)
    except ModuleNotFoundError as e:
        if e.name != SUITE_MODULE:
            raise
        raise UsageError(f"{SUITE_MODULE} is missing from this installation") from None


def _extra_suites() -> list:
    """``(name, load)`` for each suite of the entry-point group; ``load()`` returns its run
    function, which takes run_suite's arguments. Found through the installed metadata, so
    attn_backends never imports runtime itself, and a suite is imported only when it runs."""
    from importlib.metadata import entry_points
    return [(ep.name, ep.load) for ep in sorted(entry_points(group=SUITES_GROUP), key=lambda e: e.name)]


def _plan_suites(args) -> list:
    """``[(suite name, run, cases)]`` in running order, from --suite, --mode and the counts."""
    extra = _extra_suites()
    known = [LAYOUT_SUITE] + [n for n, _ in extra]
    if args.suite not in (None, "all") and args.suite not in known:
        raise UsageError(f"unknown suite {args.suite!r} (suites: {', '.join(known)}, all)")
    if args.mode is not None and args.suite not in (None, LAYOUT_SUITE):
        raise UsageError(f"--mode selects a mode of the {LAYOUT_SUITE} suite; suite {args.suite!r} takes no mode")
    wanted = args.suite or (LAYOUT_SUITE if args.mode else "all")
    if wanted not in ("all", LAYOUT_SUITE) and not args.suite_cases:
        raise UsageError(f"--suite {wanted} with --suite-cases 0 runs nothing")
    plan = []
    if wanted in ("all", LAYOUT_SUITE):
        plan.append((LAYOUT_SUITE, _load_suite_module().run_suite, args.cases))
    for name, load in extra:
        if wanted in ("all", name) and args.suite_cases:
            try:
                plan.append((name, load(), args.suite_cases))
            except Exception as e:  # noqa: BLE001 - an installed suite that cannot import
                raise UsageError(f"cannot load the suite {name!r} of the entry-point group {SUITES_GROUP}: "
                                 f"{type(e).__name__}: {e}") from None
    return plan


def _check_mode(args, backends: list) -> list:
    """The backends that declare ``--mode`` (all of them without --mode); UsageError if none does."""
    if args.mode is None:
        return backends
    suite = _load_suite_module()
    if args.mode not in suite.MODES:
        raise UsageError(f"--mode {args.mode!r} is not a mode of the {LAYOUT_SUITE} suite "
                         f"(modes: {', '.join(suite.MODES)})")
    keep = [(n, c) for n, c in backends if args.mode in suite.declared_modes(c.capabilities)]
    if not keep:
        n, c = backends[0]
        declared = ", ".join(suite.declared_modes(c.capabilities))
        raise UsageError(f"backend {n!r} does not declare mode {args.mode} (it declares {declared})"
                         if len(backends) == 1 else f"no backend available on {args.device} declares mode {args.mode}")
    return keep


def _kv_dtype_refusal(args, caps) -> Optional[str]:
    """Why a backend of ``caps`` cannot read ``--kv-dtype`` here (on this GPU's compute capability too)."""
    if KV_DTYPE_NAMES[args.kv_dtype] not in caps.kv_dtypes:
        return f"it reads {caps.kv_reads()}"
    return caps.fp8_gpu_refusal(registry.device_sm()) if args.device == "cuda" else None


def _check_kv_dtype(args, backends: list) -> tuple:
    """``(kept, left)``: the backends that read ``--kv-dtype`` (all of them at ``model``) and the
    others with their reason; UsageError if none does."""
    if KV_DTYPE_NAMES[args.kv_dtype] is None:
        return backends, []
    why = {n: _kv_dtype_refusal(args, c.capabilities) for n, c in backends}
    keep = [(n, c) for n, c in backends if why[n] is None]
    if not keep:
        n = backends[0][0]
        raise UsageError(f"backend {n!r} does not read an {args.kv_dtype} KV cache here ({why[n]})"
                         if len(backends) == 1 else f"no backend available on {args.device} reads an "
                         f"{args.kv_dtype} KV cache")
    return keep, [f"{n} ({r})" for n, r in why.items() if r]


def _check_json_path(path: Optional[str]) -> None:
    if path is None:
        return
    parent = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path) or not os.path.isdir(parent) or not os.access(parent, os.W_OK):
        raise UsageError(f"--json {path}: cannot write a file there ({parent} must be a writable folder)")


# --------------------------------------------------------------------------- check: running

def _takes(fn, keyword: str) -> bool:
    """Whether ``fn`` accepts ``keyword`` (by name or a ``**kwargs``)."""
    params = inspect.signature(fn).parameters.values()
    return any(p.name == keyword or p.kind == p.VAR_KEYWORD for p in params)


def _run_backend(name: str, cls, plan: list, args, out: TextIO, err: TextIO) -> BackendResult:
    modes = [args.mode] if args.mode else None
    kv = KV_DTYPE_NAMES[args.kv_dtype]
    kv_kw = {} if kv is None else {"kv_dtype": kv}     # an entry-point suite without the keyword runs at model
    report, t0, crashed = SuiteReport(), time.monotonic(), ""
    for suite, run, cases in plan:
        if kv_kw and suite != LAYOUT_SUITE and not _takes(run, "kv_dtype"):
            print(f"note: the {suite} suite takes no kv_dtype: not run at --kv-dtype {args.kv_dtype}", file=err)
            continue
        if suite != LAYOUT_SUITE and cls.capabilities.layout_only:
            print(f"note: the {suite} suite runs forwards: not run on {name}, which declares layout checks only "
                  f"({cls.capabilities.layout_only})", file=err)
            continue
        progress = progress_for(f"{name} {suite}", err, args.progress_every)
        n0 = len(report.failures)
        try:
            spread = suite == LAYOUT_SUITE and args.jobs > 1 and cli_jobs.usable()
            todo = _load_suite_module().layout_modes(cls.capabilities, modes) if spread else []
            if cases * len(todo) > 1:       # --jobs, and more than one case: over worker processes
                cli_jobs.run_layout_jobs(name, args.jobs, todo, device=args.device, cases=cases, seed=args.seed,
                                         progress=progress, report=report, kv_dtype=kv)
            elif suite == LAYOUT_SUITE:
                run(name, device=args.device, cases=cases, seed=args.seed, modes=modes, progress=progress,
                    report=report, **kv_kw)
            else:
                run(name, device=args.device, cases=cases, seed=args.seed, progress=progress, report=report,
                    **kv_kw)
        except Exception as e:  # noqa: BLE001 - a backend that crashes a suite is a finding; go on
            crashed = f"{suite} suite: {type(e).__name__}: {e}"
            print(f"FAIL {name}: the {crashed}", file=out)
            if args.verbose:
                traceback.print_exc(file=out)
            else:
                print("  (--verbose prints the traceback)", file=out)
        finally:
            if progress is not None:
                progress.close()
        for f in report.failures[n0:]:
            f.suite, f.device, f.kv_dtype = suite, args.device, args.kv_dtype
    return BackendResult(name, report, time.monotonic() - t0, crashed)


def cmd_check(args, out: TextIO, err: TextIO) -> int:
    _check_json_path(args.json)
    declared = _check_mode(args, _resolve(args.backend, args.device))
    backends, left = _check_kv_dtype(args, declared)
    if left:
        print(f"note: not run, they do not read a {args.kv_dtype} KV cache here: {', '.join(left)}", file=err,
              flush=True)
    plan = _plan_suites(args)
    if args.suite in (None, "all") and not args.mode and args.suite_cases and len(plan) == 1:
        print(f"note: no suite of the entry-point group {SUITES_GROUP} is installed, so only the "
              f"{LAYOUT_SUITE} suite runs (the runner suite of attn_backends_runtime registers with "
              "`pip install -e .`)", file=err, flush=True)
    results, status = [], None
    try:
        for name, cls in backends:
            runs = ", ".join(f"{suite} {cases} {'cases per mode' if suite == LAYOUT_SUITE else 'cases'}"
                             for suite, _, cases in plan)
            print(f"== {name} on {args.device}, seed {args.seed}: {runs}"
                  + (f", mode {args.mode}" if args.mode else "")
                  + (f", KV {args.kv_dtype}" if args.kv_dtype != "model" else ""), file=out, flush=True)
            results.append(_run_backend(name, cls, plan, args, out, err))
            print_result(results[-1], out, args.verbose)
            print(file=out, flush=True)
        failed = [r.name for r in results if not r.ok]
        status = 1 if failed else 0
        if len(results) > 1:
            print(f"{len(failed)} of {len(results)} backends failed: {', '.join(failed)}" if failed
                  else f"all {len(results)} backends ok", file=out)
    finally:   # also after a closed pipe or ^C: the results so far, status null
        if args.json:
            write_json(args.json, as_json(results, command=shlex.join(["attn-backends"] + args.argv),
                                          device=args.device, seed=args.seed, cases=args.cases,
                                          suite_cases=args.suite_cases, status=status))
    if args.json:
        print(f"results written to {args.json}", file=out)
    return status


# --------------------------------------------------------------------------- main

class _Parser(argparse.ArgumentParser):
    """Usage mistakes as one line (UsageError, exit status 2), not usage text plus an error."""

    def error(self, message: str):
        raise UsageError(f"{message} (see `{self.prog} --help`)")


def count(least: int):
    """An argparse type: a whole number >= ``least`` (the parser's error names the flag)."""
    def parse(s: str) -> int:
        try:
            v = int(s)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{s!r} is not a whole number") from None
        if v < least:
            raise argparse.ArgumentTypeError(f"{v} is below the least value {least}")
        return v
    parse.__name__ = f"count >= {least}"
    return parse


def _seconds(s: str) -> float:
    try:
        v = float(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{s!r} is not a number of seconds") from None
    if not v >= 0:
        raise argparse.ArgumentTypeError(f"{s} is below 0 seconds")
    return v


def _extra_commands() -> list:
    """The entry points of ``attn_backends.commands``, by name (found through the installed
    metadata: attn_backends never imports the runtime itself)."""
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


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="attn-backends", description="Pluggable attention backends: list them, check them "
                "against the layout contract.")
    sub = p.add_subparsers(dest="command", required=True)
    ls = sub.add_parser("list", help="every registered backend, available or not, and its capabilities")
    ls.add_argument("--device", choices=DEVICES, default=None,
                    help="device to check availability on (default: cuda if present, else cpu)")
    ck = sub.add_parser("check", help="run the layout-equivalence suite (and the entry-point suites) on a backend")
    ck.add_argument("--backend", default="torch_native",
                    help="a registered name, 'all' (every backend available on --device), 'package.module:Class' "
                         "(importable, the current folder included) or 'path/to/file.py:Class' (default: torch_native)")
    ck.add_argument("--device", choices=DEVICES, default="cpu", help="default: cpu")
    ck.add_argument("--cases", type=count(1), default=200,
                    help="random cases per mode of the layout suite (default: 200); with 1, the case's seed is --seed")
    ck.add_argument("--seed", type=int, default=0,
                    help="random seed; each failure prints the command that replays its case alone (default: 0)")
    ck.add_argument("--suite-cases", type=count(0), default=60,
                    help=f"random cases, in all, for each suite of the '{SUITES_GROUP}' entry-point group, "
                         "e.g. the runner invariants over the runner kinds (default: 60; 0 skips them); the "
                         "runner suite draws each runner kind the backend declares at least once, so below "
                         "that number of kinds it runs one case of each")
    ck.add_argument("--suite", default=None,
                    help=f"run only this suite: '{LAYOUT_SUITE}', the name of an entry-point suite such as "
                         "'runner', or 'all' (default: all; --mode alone implies layout)")
    ck.add_argument("--mode", default=None,
                    help="run the layout suite in this mode only (decode, extend, verify_chain, verify_tree, "
                         "draft_extend, draft_decode)")
    ck.add_argument("--kv-dtype", choices=list(KV_DTYPE_NAMES), default="model",
                    help="the suites' KV caches in this dtype (FP8 with per-layer scales other than 1), on the "
                         "backends that read it (default: model, the model's dtype)")
    ck.add_argument("--jobs", type=count(1), default=1,
                    help="worker processes for the layout suite's cases (default: 1); the results are "
                         "those of one process. On a GPU mostly Triton compiling kernels, which the "
                         "workers do side by side")
    ck.add_argument("--verbose", action="store_true",
                    help="print every failure in full, and the traceback of a suite that crashed")
    ck.add_argument("--json", metavar="FILE", default=None,
                    help="write every result (counts, every failure with its replay command) to FILE")
    ck.add_argument("--progress-every", metavar="SECONDS", type=_seconds, default=30.0,
                    help="when stderr is not a terminal, a progress line this often (default: 30; 0: none); "
                         "on a terminal a bar shows cases done and time left")
    _register_commands(sub)
    return p


def _quiet_stdout() -> None:
    """After a closed pipe: send what is left to /dev/null so that exit does not raise again."""
    try:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    except (OSError, ValueError, AttributeError):
        pass


def main(argv: Optional[list] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if os.getcwd() not in sys.path:   # `module:Class` finds modules of the current folder, as `python -m` does
        sys.path.append(os.getcwd())
    try:
        args = build_parser().parse_args(argv)
        args.argv = argv
        if args.command == "list":
            status = cmd_list(args, sys.stdout)
        elif args.command == "check":
            status = cmd_check(args, sys.stdout, sys.stderr)
        else:
            status = args.handler(args)
        sys.stdout.flush()            # a closed pipe shows here, inside the try, not at exit
        return status
    except UsageError as e:
        print(f"attn-backends: error: {e}", file=sys.stderr)
        return 2
    except BrokenPipeError:           # `attn-backends list | head -1`: the reader has gone
        _quiet_stdout()
        return EXIT_SIGPIPE
    except KeyboardInterrupt:
        print("attn-backends: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
