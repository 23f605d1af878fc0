"""The GQA kernels' sliding window, sinks and softcap (issue #42) against float64 over the paged
cache: decode in each schedule (split, chunks with either merge, invariant) and the causal extend
(prefill of several query blocks, split); tree, draft and verify rows run through the backend
(tests/backends/test_windows_sinks_softcap.py). The window's poison: NaN in every KV slot before
each request's window leaves the output bitwise unchanged, so no kernel reads there: decode in two
schedules, and the extend kernel's prefill, chunked verify, tree and draft paths."""
import pytest
import torch
from kernel_refs import assert_close, make_paged_batch, ref_paged_attention

from attn_backends_kernels.attention_core import decode_workspace
from attn_backends_kernels.decode_attention import decode_attention_fwd
from attn_backends_kernels.extend_attention import extend_attention_fwd
from attn_backends_kernels.schedule import chunk_workspace, slots_per_request

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = [pytest.mark.cuda] if DEVICE == "cuda" else []
H, HKV, D, PAGE = 4, 2, 16, 16
LENS = [70, 5, 300, 33]
# (window, softcap, sinks): windows of 1, not a page multiple, over the longest request; a cap that
# binds (scores of several units); sinks of large magnitude
CASES = {"w1": (1, None, None), "w37_cap": (37, 0.7, None), "w1000": (1000, None, None),
         "sinks": (None, None, [9.0, -11.0, 0.5, 3.0]), "w20_cap_sinks": (20, 2.0, [-9.0, 12.0, 1.5, 0.0])}


def _batch(lens, rows_each, seed=1):
    pt, seq, num_pages = make_paged_batch(lens, PAGE, pad_rows=1, device=DEVICE, seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    k = torch.randn(num_pages * PAGE, HKV, D, generator=g).to(DEVICE)
    v = torch.randn(num_pages * PAGE, HKV, D, generator=g).to(DEVICE)
    q = (3 * torch.randn(sum(rows_each), H, D, generator=g)).to(DEVICE)
    return pt, seq, k, v, q


def _decode(q, k, v, pt, seq, schedule, window, cap, sinks):
    bs = q.shape[0]
    out = torch.full_like(q, float("nan"))
    ws = (decode_workspace(bs, H, D, 3, DEVICE) if schedule == "split" else
          chunk_workspace(bs, slots_per_request(schedule, 3, pt.shape[1] * PAGE), 1, H, HKV, D, DEVICE))
    merge = {"split": "last", "chunks": "pass", "chunks_last": "last", "invariant": "pass"}[schedule]
    decode_attention_fwd(q, k, v, pt, seq, PAGE, D ** -0.5, 3, out, ws, schedule=schedule.split("_")[0],
                         merge=merge, window=window, softcap=cap, sinks=sinks)
    return out


def _sinks(sinks):
    return None if sinks is None else torch.tensor(sinks, device=DEVICE)


DECODE_CASES = [(s, c) for s in ("split", "chunks") for c in CASES] + \
    [("chunks_last", "w20_cap_sinks"), ("invariant", "w37_cap"), ("invariant", "w20_cap_sinks")]


@pytest.mark.parametrize("schedule,case", DECODE_CASES)
def test_decode(schedule, case):
    window, cap, sinks = CASES[case]
    pt, seq, k, v, q = _batch(LENS, [1] * (len(LENS) + 1))
    out = _decode(q, k, v, pt, seq, schedule, window, cap, _sinks(sinks))
    cu = torch.arange(q.shape[0] + 1, dtype=torch.int32)
    ref = ref_paged_attention(q, k, v, pt, seq, cu, PAGE, D ** -0.5, window=window, softcap=cap, sinks=_sinks(sinks))
    assert_close(out[:len(LENS)], ref[:len(LENS)], 1e-5)


@pytest.mark.parametrize("case", ["w1", "w37_cap", "w20_cap_sinks"])
def test_extend_prefill(case):
    """Ragged prefill of several 16-row query blocks over cached prefixes: each block's rows read
    from their own window on (``window_lo``)."""
    window, cap, sinks = CASES[case]
    new = [40, 3, 70, 17]
    pt, seq, k, v, q = _batch([p + n for p, n in zip([30, 0, 230, 16], new)], new + [1])
    cu = torch.tensor([0] + torch.tensor(new + [1]).cumsum(0).tolist(), dtype=torch.int32, device=DEVICE)
    out = torch.full_like(q, float("nan"))
    extend_attention_fwd(q, k, v, pt, seq, cu, PAGE, D ** -0.5, max(new), out, num_kv_splits=2, block_q=16,
                         window=window, softcap=cap, sinks=_sinks(sinks))
    ref = ref_paged_attention(q, k, v, pt, seq, cu, PAGE, D ** -0.5, window=window, softcap=cap, sinks=_sinks(sinks))
    assert_close(out[:sum(new)], ref[:sum(new)], 1e-5)


@pytest.mark.parametrize("schedule", ["split", "chunks"])
def test_decode_never_reads_before_the_window(schedule):
    """NaN in every slot of the positions before each request's window (whole pages and the first
    page's head alike): the output's bits do not change."""
    window = 37
    pt, seq, k, v, q = _batch(LENS, [1] * (len(LENS) + 1))
    clean = _decode(q, k, v, pt, seq, schedule, window, None, None)
    for i, n in enumerate(LENS):
        for p in range(max(0, n - window)):
            slot = int(pt[i, p // PAGE]) * PAGE + p % PAGE
            k[slot], v[slot] = float("nan"), float("nan")
    poisoned = _decode(q, k, v, pt, seq, schedule, window, None, None)
    assert torch.equal(clean[:len(LENS)], poisoned[:len(LENS)])


def test_feature_arguments_refused_in_one_line():
    pt, seq, k, v, q = _batch([20], [1, 1])
    out = torch.empty_like(q)
    for kw, text in [(dict(window=0), "window=0 must be an int >= 1"), (dict(softcap=-1.0), "softcap=-1.0"),
                     (dict(sinks=torch.zeros(H + 1, device=DEVICE)), "one float logit a query head (4)")]:
        with pytest.raises(ValueError, match=text.replace("(", r"\(").replace(")", r"\)")):
            decode_attention_fwd(q, k, v, pt, seq, PAGE, 1.0, 1, out, **kw)


LONG = [700, 5, 1100, 330]      # windows past MIN_CHUNK_TOKENS: a windowed request over several chunks


@pytest.mark.parametrize("schedule,window", [("chunks", 600), ("chunks_last", 300), ("invariant", 600)])
def test_decode_window_over_several_chunks(schedule, window):
    """The chunk schedule cuts each request from its window's start (``chunk_of``'s ``lo``) into several
    chunks, and the merge pass recomputes the same schedule."""
    sinks = _sinks([-11.0, 11.0, 0.5, 3.0])
    pt, seq, k, v, q = _batch(LONG, [1] * (len(LONG) + 1))
    out = _decode(q, k, v, pt, seq, schedule, window, 0.7, sinks)
    cu = torch.arange(q.shape[0] + 1, dtype=torch.int32)
    ref = ref_paged_attention(q, k, v, pt, seq, cu, PAGE, D ** -0.5, window=window, softcap=0.7, sinks=sinks)
    assert_close(out[:len(LONG)], ref[:len(LONG)], 1e-5)


def test_verify_rows_window_over_several_chunks():
    """Causal verify rows (W = 4) on the chunk schedule, each row's window from its own position."""
    W, window, sinks = 4, 600, _sinks([9.0, -11.0, 0.5, 3.0])
    pt, seq, k, v, q = _batch(LONG, [W] * (len(LONG) + 1))
    bs = len(LONG) + 1
    cu = torch.arange(0, bs * W + 1, W, dtype=torch.int32, device=DEVICE)
    out = torch.full_like(q, float("nan"))
    ws = chunk_workspace(bs, slots_per_request("chunks", 3, pt.shape[1] * PAGE), W, H, HKV, D, DEVICE)
    extend_attention_fwd(q, k, v, pt, seq, cu, PAGE, D ** -0.5, W, out, num_kv_splits=3, workspace=ws,
                         schedule="chunks", merge="pass", window=window, softcap=0.7, sinks=sinks)
    ref = ref_paged_attention(q, k, v, pt, seq, cu, PAGE, D ** -0.5, window=window, softcap=0.7, sinks=sinks)
    assert_close(out[:len(LONG) * W], ref[:len(LONG) * W], 1e-5)


def _poison_before(k, v, pt, firsts, window):
    """NaN in every slot of the positions before each request's window start (its first row at
    ``firsts[i]`` sees from ``firsts[i] - window + 1``), whole pages and a page's head alike."""
    for i, first in enumerate(firsts):
        for p in range(max(0, first - window + 1)):
            slot = int(pt[i, p // PAGE]) * PAGE + p % PAGE
            k[slot], v[slot] = float("nan"), float("nan")


@pytest.mark.parametrize("kind", ["prefill", "verify_chunks", "tree", "draft"])
def test_extend_family_never_reads_before_the_window(kind):
    """The extend kernel's paths (prefill blocks on splits, verify rows on the chunk schedule, a
    tree's rows by depth, draft branches by step): NaN at every position before each request's
    window start, whole pages and the first page's head alike, leaves the output's bits unchanged
    (the suites' I17 poisons whole pages only)."""
    window, W, prefixes = 21, 4, [70, 3, 300, 45]
    kw, lens, rows = {}, [p + W for p in prefixes], [W] * len(prefixes)
    firsts = list(prefixes)                                       # the first row (a tree's root) at the prefix
    if kind == "prefill":
        rows = [40, 3, 70, 17]
        lens = [p + n for p, n in zip(prefixes, rows)]
    pt, seq, k, v, q = _batch(lens, rows + [rows[0]])
    bs = len(lens) + 1
    cu = torch.tensor([0] + torch.tensor(rows + [rows[0]]).cumsum(0).tolist(), dtype=torch.int32, device=DEVICE)
    if kind == "verify_chunks":
        kw = dict(num_kv_splits=3, schedule="chunks", merge="pass",
                  workspace=chunk_workspace(bs, slots_per_request("chunks", 3, pt.shape[1] * PAGE), W, H, HKV, D,
                                            DEVICE))
    elif kind == "tree":          # root, two children of the root, a grandchild of the first: depths 0, 1, 1, 2
        tree = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]], dtype=torch.bool)
        kw = dict(mask="tree", custom_mask=tree.flatten().repeat(bs).to(DEVICE), num_kv_splits=2)
    elif kind == "draft":         # W branches at draft step 2: the prompt, then 2 x W branch tokens
        step = 2
        base = [n - W * step for n in lens]
        kw = dict(mask="draft", draft_prefix_lens=torch.tensor(base + [0], dtype=torch.int32, device=DEVICE)
                  .clamp(min=0), num_kv_splits=2)
        firsts = [b + step - 1 for b in base]                    # every branch row sits at its step
    else:
        kw = dict(num_kv_splits=2, block_q=16)

    def run():
        out = torch.full_like(q, float("nan"))
        extend_attention_fwd(q, k, v, pt, seq, cu, PAGE, D ** -0.5, max(rows), out, window=window, **kw)
        return out[:sum(rows)]
    clean = run()
    assert not clean.isnan().any()
    _poison_before(k, v, pt, firsts, window)
    assert torch.equal(run(), clean), kind
