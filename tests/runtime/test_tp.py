"""Tensor parallelism (runtime/tp.py) on the CPU: two gloo processes generate exactly TP 1's tokens
(float32 tiny models: GQA with KV heads split and replicated, MLA, sinks and windows; plain decode,
EAGLE chain and tree); a rank that fails ends the run with its error; debug mode fails a rank whose
step diverges; splits that do not divide are refused in one line. On a machine with two GPUs the
same runs take NCCL (``test_tp_two_gpus``)."""
import random

import pytest
import torch

from attn_backends.check.cli import main
from attn_backends_runtime.eagle import SpecConfig
from attn_backends_runtime.engine import Engine, EngineConfig
from attn_backends_runtime.limits import ConfigError
from attn_backends_runtime.models import TinyConfig, gptoss_like
from attn_backends_runtime.request import SamplingParams
from attn_backends_runtime.tp import RankFailed, TensorParallel, launch, shard_config

MODELS = {"gqa kv split": TinyConfig(), "gqa kv replicated": TinyConfig(num_q_heads=4, num_kv_heads=1),
          "mla": TinyConfig(is_mla=True), "sinks and windows": gptoss_like()}
SPECS = {"plain": None, "eagle": SpecConfig("eagle", 1, 3, 4), "tree": SpecConfig("eagle", 2, 2, 4)}


def _outputs(tp, device, cases, backend="torch_native", skew=False, replays=None):
    """Every case's generated tokens on this rank (``backend`` "triton": triton or triton_mla by the model;
    ``skew``: rank 1's LM head negated, a diverging rank; ``replays``: a list each case's graph replays go to)."""
    out = {}
    for name, model, spec in cases:
        be = ("triton_mla" if model.is_mla else "triton") if backend == "triton" else backend
        cfg = EngineConfig(model, be, spec, device, max_batch=3, max_context_len=96, max_prefill_tokens=64,
                           tp=tp)
        engine = Engine(cfg)
        if skew and tp.rank == 1:
            with torch.no_grad():
                engine.target_model.lm_head.weight.mul_(-1.0)
        rng = random.Random(0)
        prompts = [[rng.randrange(model.vocab_size) for _ in range(rng.randint(5, 12))] for _ in range(3)]
        out[name] = [r.output for r in engine.generate(prompts, SamplingParams(8))]
        if replays is not None:
            replays.append(sum(c["graph"] for ex in engine.executors for c in ex.counts.values()))
    return out


def _fail_on_rank_one(tp):
    if tp.rank == 1:
        raise RuntimeError("rank 1 planted failure")
    torch.distributed.barrier()        # rank 0 waits in a collective that rank 1 never joins


# every model plain; EAGLE chain and tree on the split GQA heads, chain on MLA
CASES = ([(f"{m} plain", MODELS[m], None) for m in MODELS]
         + [(f"gqa kv split {s}", MODELS["gqa kv split"], SPECS[s]) for s in ("eagle", "tree")]
         + [("mla eagle", MODELS["mla"], SPECS["eagle"])])


def test_two_ranks_generate_the_tokens_of_one():
    one = _outputs(None, "cpu", CASES)
    two = launch(_outputs, 2, "cpu", ("cpu", CASES), debug=True)
    assert two[0] == two[1], "the ranks disagree"
    assert two[0] == one, {k: (one[k], two[0][k]) for k in one if one[k] != two[0][k]}


def test_a_failing_rank_ends_the_run_with_its_error():
    with pytest.raises(RankFailed, match="rank 1 failed: RuntimeError: rank 1 planted failure"):
        launch(_fail_on_rank_one, 2, "cpu")


def _large(tp):
    return bytes(200_000)            # more than a pipe holds: the launcher must read while the ranks run


def test_results_larger_than_a_pipe_come_back():
    assert [len(r) for r in launch(_large, 2, "cpu")] == [200_000, 200_000]


def test_debug_mode_fails_a_diverging_rank():
    cases = [("gqa", MODELS["gqa kv split"], None)]
    with pytest.raises(RankFailed, match="ranks diverged"):
        launch(_outputs, 2, "cpu", ("cpu", cases, "torch_native", True), debug=True)


@pytest.mark.parametrize("model,size,match", [
    (TinyConfig(num_q_heads=4), 3, "4 query heads do not split over 3"),
    (TinyConfig(num_q_heads=6, num_kv_heads=3), 2, "3 KV heads neither split over 2"),
    (TinyConfig(intermediate_size=130), 4, "130 columns do not split over 4"),
])
def test_splits_that_do_not_divide_are_refused(model, size, match):
    with pytest.raises(ConfigError) as e:
        shard_config(model, TensorParallel(0, size))
    assert match in e.value.render(None)


def test_generate_tp_prints_the_tokens_of_tp_1(capsys):
    argv = ["generate", "--model", "tiny-mla", "--max-tokens", "6", "--batch", "2", "--no-graphs"]
    assert main(argv) == 0
    one = [line for line in capsys.readouterr().out.splitlines() if line.startswith("[")]
    assert main(argv + ["--tp", "2", "--tp-debug"]) == 0
    text = capsys.readouterr().out
    assert [line for line in text.splitlines() if line.startswith("[")] == one and "TP 2" in text
    assert main(["generate", "--tp-debug"]) == 2
    assert "--tp-debug compares ranks" in capsys.readouterr().err
    assert main(["generate", "--tp", "2", "--backend", "no_such_backend", "--max-tokens", "2"]) == 2
    err = capsys.readouterr().err            # a rank's refusal: TP 1's one line, not a rank's traceback
    assert "no_such_backend" in err and "Traceback" not in err, err


@pytest.mark.cuda
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_tp_two_gpus():
    """NCCL, CUDA graphs (the all-reduce captured) and EAGLE at TP 2 against TP 1, float32 on the Triton backends;
    every engine replayed graphs (a run that fell back to eager everywhere would pass the token check alone)."""
    cases = [(f"{m} {s}", MODELS[m], SPECS[s]) for m in ("gqa kv split", "mla") for s in ("plain", "eagle")]
    one, one_replays = _outputs_and_replays(None, "cuda", cases)
    two = launch(_outputs_and_replays, 2, "cuda", ("cuda", cases), debug=True)
    assert two[0][0] == two[1][0] == one, {k: (one[k], two[0][0][k], two[1][0][k]) for k in one}
    assert min(one_replays + two[0][1] + two[1][1]) > 0, (one_replays, two[0][1], two[1][1])


def _outputs_and_replays(tp, device, cases):
    """``_outputs`` on the Triton backends and each case's graph replays on this rank."""
    replays = []
    return _outputs(tp, device, cases, backend="triton", replays=replays), replays
