"""Tensor parallelism (issue #44): the tiny models' heads split over ranks, one process a rank.

A rank holds ``1 / size`` of the query heads and of the KV heads (every KV head where there are
fewer KV heads than ranks: the one its query heads read), so its attention backend sees a model of
its rank's heads alone and its KV pool holds those heads; MLA splits the query heads and keeps the
latent cache whole on every rank. The output projection and the MLP's down projection are
row-parallel: each rank's partial sums are added by an all-reduce (two a layer). Embeddings, norms
and the LM head are replicated, so every rank computes the same logits and greedy tokens, EAGLE's
acceptance included. Every rank builds the full seeded model and keeps its slices: rank weights are
the TP 1 model's, cut.

:func:`launch` starts the ranks the way PyTorch users do (``torch.multiprocessing``), gloo on the
CPU, NCCL on CUDA (one GPU a rank); a rank that raises ends the run with its error, the others
killed rather than left waiting in a collective. ``debug``: after each engine step every rank's
step (its batch's KV lengths and pages, its tokens) is compared across ranks by a checksum
collective, and a divergence raises on every rank.
"""
from __future__ import annotations

import os
import socket
import traceback
from dataclasses import dataclass, replace
from typing import Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from .limits import ConfigError
from .models import TinyConfig, TinyModel

# NVLink multicast stays off on the lent multi-GPU machines (their KINDS.md): every rank inherits these
NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


@dataclass(frozen=True)
class TensorParallel:
    """This process's rank of ``size`` (the default process group when ``size > 1``)."""

    rank: int = 0
    size: int = 1
    debug: bool = False

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of every rank's ``x`` (in place)."""
        if self.size > 1:
            dist.all_reduce(x)
        return x

    def part(self, n: int) -> slice:
        """This rank's share of ``n`` (``n % size == 0``)."""
        k = n // self.size
        return slice(self.rank * k, (self.rank + 1) * k)

    def kv_part(self, num_q_heads: int, num_kv_heads: int) -> slice:
        """This rank's KV heads: a share where there are at least ``size``, else the one its query heads read."""
        if num_kv_heads >= self.size:
            return self.part(num_kv_heads)
        first = self.part(num_q_heads).start // (num_q_heads // num_kv_heads)
        return slice(first, first + 1)

    def check_same(self, what: str, values: torch.Tensor) -> None:
        """Raise on every rank where ranks hold different ``values`` (debug mode; a checksum collective)."""
        if self.size == 1 or not self.debug:
            return
        v = values.detach().flatten().to("cpu", torch.float64)
        w = torch.arange(1, v.numel() + 1, dtype=torch.float64)
        mine = torch.stack([v.sum(), (v * w).sum(), torch.tensor(float(v.numel()))])
        dev = "cuda" if dist.get_backend() == "nccl" else "cpu"
        every = [torch.empty(3, dtype=torch.float64, device=dev) for _ in range(self.size)]
        dist.all_gather(every, mine.to(dev))
        sums = [tuple(t.tolist()) for t in every]
        if len(set(sums)) > 1:
            raise RuntimeError(f"tensor parallel: ranks diverged at {what}: checksums by rank {sums}")


def shard_config(c: TinyConfig, tp: TensorParallel) -> TinyConfig:
    """The rank's model: its query heads, its KV heads; ConfigError for a split that does not divide."""
    n = tp.size
    if n == 1:
        return c
    if c.num_q_heads % n:
        raise ConfigError(lambda x: f"--tp {n}: the model's {c.num_q_heads} query heads do not split over {n} ranks")
    if not c.is_mla and c.num_kv_heads % n and n % c.num_kv_heads:
        raise ConfigError(lambda x: f"--tp {n}: the model's {c.num_kv_heads} KV heads neither split over {n} ranks "
                                    f"nor divide them (replicated)")
    if c.intermediate_size % n:
        raise ConfigError(lambda x: f"--tp {n}: the MLP's {c.intermediate_size} columns do not split over {n} ranks")
    kv = c.num_kv_heads if c.is_mla else max(1, c.num_kv_heads // n)
    return replace(c, num_q_heads=c.num_q_heads // n, num_kv_heads=kv, intermediate_size=c.intermediate_size // n)


def _linear(w: torch.Tensor) -> nn.Linear:
    out = nn.Linear(w.shape[1], w.shape[0], bias=False, device="meta")     # no initialisation to throw away
    out.weight = nn.Parameter(w, requires_grad=False)
    return out


def _rows(linear: nn.Linear, index) -> nn.Linear:
    return _linear(linear.weight.data[index].clone())


def _cols(linear: nn.Linear, cols: slice) -> nn.Linear:
    return _linear(linear.weight.data[:, cols].clone())


def _heads(start_stop: slice, width: int, offset: int = 0) -> list:
    return list(range(offset + start_stop.start * width, offset + start_stop.stop * width))


def shard_model(model: TinyModel, tp: TensorParallel) -> TinyModel:
    """``model`` (the full seeded model) cut to the rank's share, in place: each block's heads and MLP
    columns, its output and down projections' partial sums all-reduced; the rest replicated."""
    if tp.size == 1:
        return model
    c, local = model.config, shard_config(model.config, tp)
    q = tp.part(c.num_q_heads)
    for block in model.layers:
        if c.is_mla:
            d = c.qk_nope_head_dim + c.qk_rope_head_dim
            block.q_proj = _rows(block.q_proj, _heads(q, d))
            block.w_kc = nn.Parameter(block.w_kc.data[q].clone(), requires_grad=False)
            block.w_vc = nn.Parameter(block.w_vc.data[q].clone(), requires_grad=False)
            block.o = _cols(block.o, slice(q.start * c.v_head_dim, q.stop * c.v_head_dim))
        else:
            kv, d = tp.kv_part(c.num_q_heads, c.num_kv_heads), c.head_dim
            nq, nkv = c.num_q_heads * d, c.num_kv_heads * d
            block.qkv = _rows(block.qkv, _heads(q, d) + _heads(kv, d, nq) + _heads(kv, d, nq + nkv))
            block.o = _cols(block.o, slice(q.start * d, q.stop * d))
        if block.sinks is not None:
            block.sinks = nn.Parameter(block.sinks.data[q].clone(), requires_grad=False)
        inter = tp.part(c.intermediate_size)
        gate_up = list(range(inter.start, inter.stop))
        block.mlp.gate_up = _rows(block.mlp.gate_up, gate_up + [i + c.intermediate_size for i in gate_up])
        block.mlp.down = _cols(block.mlp.down, inter)
        block.c = local
        block.layer = local.attention().layer(block.layer.layer_id, sinks=block.sinks)
        block.reduce = tp.all_reduce
    model.config = local
    return model.to(next(model.embed.parameters()).device)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank: int, size: int, device: str, port: int, debug: bool, fn: Callable, args: tuple,
               results) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    for k, v in NO_MULTICAST.items():
        os.environ.setdefault(k, v)
    if device == "cuda":
        torch.cuda.set_device(rank)
    dist.init_process_group("nccl" if device == "cuda" else "gloo", rank=rank, world_size=size,
                            **({"device_id": torch.device("cuda", rank)} if device == "cuda" else {}))
    try:
        out = fn(TensorParallel(rank, size, debug), *args)
        results.put((rank, out))
    except BaseException as e:     # recorded before this rank's exit can fail a peer's collective
        results.put((rank, RankFailed(rank, f"{type(e).__name__}: {e}", traceback.format_exc())))
        raise
    finally:
        dist.destroy_process_group()


class RankFailed(RuntimeError):
    """A rank's error, raised by :func:`launch`: the first rank that failed (the others' errors, a
    collective broken by its exit, follow from it)."""

    def __init__(self, rank: int, error: str, trace: str = "") -> None:
        super().__init__(f"tensor parallel: rank {rank} failed: {error}")
        self.rank, self.error, self.trace = rank, error, trace

    def __reduce__(self):
        return RankFailed, (self.rank, self.error, self.trace)


def launch(fn: Callable, size: int, device: str = "cpu", args: tuple = (), debug: bool = False) -> list:
    """``fn(tp, *args)`` on ``size`` ranks, one process each (``torch.multiprocessing`` spawn); the
    ranks' return values in rank order. A rank that raises ends the run: the other ranks are killed
    (none is left waiting in a collective) and :class:`RankFailed` names the first rank that failed,
    with its error and traceback."""
    if device == "cuda" and torch.cuda.device_count() < size:
        raise ConfigError(lambda x: f"--tp {size} on cuda needs {size} GPUs, this machine has "
                                    f"{torch.cuda.device_count()}")
    for k, v in NO_MULTICAST.items():
        os.environ.setdefault(k, v)
    ctx = mp.get_context("spawn")
    results = ctx.SimpleQueue()
    failure, out = None, {}

    def drain() -> None:               # read while the ranks run: a result larger than the pipe blocks its put
        while not results.empty():
            rank, value = results.get()
            if isinstance(value, RankFailed) and "failed" not in out:
                out["failed"] = value      # the first recorded: the cause
            out.setdefault(rank, value)
    procs = mp.start_processes(_rank_main, args=(size, device, _free_port(), debug, fn, args, results),
                               nprocs=size, join=False, start_method="spawn")
    try:
        while not procs.join(timeout=0.05):
            drain()
    except (mp.ProcessRaisedException, mp.ProcessExitedException) as e:
        failure = e
    drain()
    if failure is not None:
        silent = isinstance(failure, mp.ProcessExitedException) and failure.error_index not in out
        if silent or "failed" not in out:  # a rank killed by a signal records nothing: it is the cause
            raise RankFailed(failure.error_index, str(failure).strip()) from failure
        raise out["failed"] from failure
    return [out[r] for r in range(size)]


__all__ = ("TensorParallel", "RankFailed", "launch", "shard_config", "shard_model", "NO_MULTICAST")
