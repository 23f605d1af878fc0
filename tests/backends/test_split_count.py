"""The split-KV count of the triton backends (``triton_common.choose_num_kv_splits``): about
``per_sm`` programs per SM, a power of two (but a count below ``exact_below``: GQA decode), never
more than the pages, at most 32 splits, and 64 for a batch of few programs with at most 4 query
rows (256, ``deep``, for a GQA decode of at most 8 programs). Host logic: the SM count is patched and the CUDA
device is only a ``torch.device`` object, so this runs without a GPU."""
from types import SimpleNamespace

import pytest
import torch

from attn_backends.backends import triton_common as tc

CUDA0 = torch.device("cuda", 0)


@pytest.mark.parametrize("programs,per_sm,width,max_pages,want", [
    (8, 16, 1, 2048, 64),      # 8 programs, 16 per SM wanted, W 1: the 64 cap
    (32, 16, 1, 2048, 32),     # 32 programs keep the 32 cap (64 is slower for GQA decode bs 4)
    (128, 16, 1, 2048, 16),    # 128 programs: per_sm x SMs / programs
    (8, 8, 4, 2048, 64),       # 4 query rows still take the 64 cap
    (8, 16, 8, 2048, 32),      # 8 rows (the tree) keep 32
    (1, 2, 1, 512, 64),        # MLA16 decode bs 1
    (4, 2, 1, 512, 64),        # MLA16 decode bs 4
    (8, 2, 1, 512, 32),        # MLA16 decode bs 8: wants 33
    (1, 2, 1, 40, 32),         # never more than the pages (a power of two below 40)
    (1, 2, 1, 1, 1),
])
def test_split_count(h200, programs, per_sm, width, max_pages, want):
    assert tc.choose_num_kv_splits(programs, CUDA0, max_pages, per_sm, width) == want


def test_floor(h200):
    """``floor`` raises a count the programs would take to 1, never past the pages or the cap, nor
    past ``floor_per_sm`` programs an SM where that is given."""
    assert tc.choose_num_kv_splits(1024, CUDA0, 2048, 8, 1) == 1
    assert tc.choose_num_kv_splits(1024, CUDA0, 2048, 8, 1, floor=2) == 2
    assert tc.choose_num_kv_splits(1024, CUDA0, 1, 8, 1, floor=2) == 1
    assert tc.choose_num_kv_splits(8, CUDA0, 2048, 8, 1, floor=2) == 64
    assert tc.choose_num_kv_splits(1024, CUDA0, 2048, 2, 8, floor=4, floor_per_sm=16) == 2   # 16 x 132 // 1024
    assert tc.choose_num_kv_splits(512, CUDA0, 2048, 2, 8, floor=4, floor_per_sm=16) == 4
    assert tc.choose_num_kv_splits(4096, CUDA0, 2048, 2, 8, floor=4, floor_per_sm=16) == 1


def test_exact_below(h200):
    """Counts below ``exact_below`` are taken as they are; from it on, a power of two."""
    assert tc.choose_num_kv_splits(128, CUDA0, 2048, 6, 1) == 4                      # 6.19 -> 4
    assert tc.choose_num_kv_splits(128, CUDA0, 2048, 6, 1, exact_below=8) == 6
    assert tc.choose_num_kv_splits(256, CUDA0, 2048, 6, 1, exact_below=8) == 3
    assert tc.choose_num_kv_splits(32, CUDA0, 2048, 6, 1, exact_below=8) == 16       # 24.75: a power of two
    assert tc.choose_num_kv_splits(64, CUDA0, 2048, 6, 1, exact_below=8) == 8        # 12.4
    assert tc.choose_num_kv_splits(128, CUDA0, 5, 6, 1, exact_below=8) == 5          # never past the pages
    assert tc.choose_num_kv_splits(1024, CUDA0, 2048, 6, 1, floor=2, exact_below=8) == 2


def test_interpreter_takes_two_splits():
    assert tc.choose_num_kv_splits(8, torch.device("cpu"), 2048, 16, 1) == 2


@pytest.mark.parametrize("heads", [32, 64])
@pytest.mark.parametrize("width,bs,want", [
    (1, 1, 64), (1, 2, 32), (1, 4, 24), (1, 8, 12), (1, 16, 6),       # decode: 6 per SM, exact (chunks)
    (1, 32, 6), (1, 64, 4), (1, 128, 4),                              # 3, 2, 2 (>= 2), then chunks doubled
    (4, 1, 64), (4, 4, 16), (4, 16, 4), (4, 64, 1),                  # chain verify <= 4 rows: 4
    (8, 1, 32), (8, 4, 8), (8, 16, 4), (8, 64, 4), (8, 128, 2),       # the 8-row tree: 2, >= 4 to 16
    (64, 16, 16), (64, 128, 2),                                       # extend: 16 per SM
])
def test_triton_backend_split_counts(h200, monkeypatch, heads, width, bs, want, kv_dtype=None, schedule=None,
                                     max_context_len=2048 * 16):
    """The ``triton`` backend's counts (``_splits``) for GQA 32/8 and 64/8, per mode as the cases
    say: decode 6 programs an SM, the count taken as it is (the chunk schedule cuts any; below 8 on
    equal splits) and at least 2 splits (one
    split is slower at bs 128), and on the chunk schedule twice the chunks where that leaves fewer
    than 4 a request; chain verify and the 8-row tree fewer splits as the batch grows, extend 16
    programs an SM. The counts follow the probes (figures: bench/RESULTS.md, 'Split counts' and
    'Ragged batches')."""
    from attn_backends import ModelConfig, get_backend
    from attn_backends.batch import ForwardMode
    from attn_backends.check.scenarios import make_memory
    from attn_backends.layout import MaskKind

    monkeypatch.setenv("TRITON_INTERPRET", "1")               # a CPU backend; the count is for CUDA0
    cfg = ModelConfig(num_layers=1, num_q_heads=heads, num_kv_heads=8, head_dim=16, page_size=16, kv_dtype=kv_dtype)
    mem = make_memory(cfg, num_pages=4, max_reqs=2, max_context_len=max_context_len)
    be = get_backend("triton", cfg, mem)
    be.schedule = schedule or be.schedule
    monkeypatch.setattr(mem, "device", CUDA0)                 # host logic only: the count for an H200
    mode = {1: ForwardMode.DECODE, 64: ForwardMode.EXTEND}.get(width, ForwardMode.TARGET_VERIFY)
    mask = MaskKind.TREE if width == 8 else MaskKind.CAUSAL
    lay = SimpleNamespace(bs=bs, width=width, max_seq_len_q=width, mode=mode, mask=mask)
    assert be._splits(lay) == want


def test_one_request_decode_takes_the_split_rule_count(h200, monkeypatch):
    """A decode of one request runs on equal splits (``TritonBackend._chunked``), so the chunk schedule's
    doubling does not reach it: a context of 3 pages gives 3 splits at bs 1 (6 would split past the pages)
    and 6 chunks a request at bs 2."""
    test_triton_backend_split_counts(h200, monkeypatch, 32, 1, 1, 3, max_context_len=48)
    test_triton_backend_split_counts(h200, monkeypatch, 32, 1, 2, 6, max_context_len=48)


@pytest.mark.parametrize("programs,want", [(1, 64), (4, 64), (5, 64), (8, 64), (9, 32), (16, 32)])
def test_wide_and_deep_counts(h200, programs, want):
    """64 splits where ``programs * 64`` stays within 4 x SMs; ``deep``: 256 whatever the programs, never
    more than the pages (a power of two)."""
    assert tc.choose_num_kv_splits(programs, CUDA0, 4096, 6, 1) == want
    assert tc.choose_num_kv_splits(programs, CUDA0, 4096, 6, 1, deep=True) == tc.DEEP_MAX_KV_SPLITS
    assert tc.choose_num_kv_splits(programs, CUDA0, 200, 6, 1, deep=True) == 128
    assert [tc.choose_num_kv_splits(programs, CUDA0, n, 6, 1, deep=True) for n in (0, 1, 3)] == [1, 1, 2]


def _gqa8_1(monkeypatch, head_dim=128, kv_dtype=None, invariant=False):
    from attn_backends import ModelConfig
    from attn_backends.backends.triton_backend import TritonBackend
    from attn_backends.check.scenarios import make_memory

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    cfg = ModelConfig(num_layers=1, num_q_heads=8, num_kv_heads=1, head_dim=head_dim, page_size=16, kv_dtype=kv_dtype)
    mem = make_memory(cfg, num_pages=4, max_reqs=2, max_context_len=2048 * 16)
    be = TritonBackend(cfg, mem, batch_invariant=invariant)
    monkeypatch.setattr(mem, "device", CUDA0)
    return be


def _lay(bs, width=1):
    from attn_backends.batch import ForwardMode
    from attn_backends.layout import MaskKind
    mode = ForwardMode.DECODE if width == 1 else ForwardMode.TARGET_VERIFY
    return SimpleNamespace(bs=bs, width=width, max_seq_len_q=width, mode=mode, mask=MaskKind.CAUSAL)


@pytest.mark.parametrize("kv_dtype", [None, torch.float8_e4m3fn])
@pytest.mark.parametrize("width,bs,want", [(1, 1, 256), (1, 2, 256), (1, 5, 256), (1, 8, 256), (1, 9, 32),
                                           (4, 1, 64), (4, 2, 64)])
def test_few_programs_decode_goes_deep(h200, monkeypatch, width, bs, want, kv_dtype):
    """GQA 8/1 d128, bf16 and FP8 caches: a decode of at most 8 programs (bs x KV heads) takes 256 equal
    splits (``TritonBackend.SPLIT_DECODE_PROGRAMS``); 9 requests take the chunks, verify keeps 64."""
    be = _gqa8_1(monkeypatch, kv_dtype=kv_dtype)
    assert be._splits(_lay(bs, width)) == want
    if width == 1:
        assert be._chunked(_lay(bs)) == (bs > 8), f"bs {bs}: chunked {be._chunked(_lay(bs))}"


@pytest.mark.parametrize("kind", ["d64", "invariant"])
def test_what_was_not_measured_stays_at_64(h200, monkeypatch, kind):
    """The deep splits are what was measured (group x Dv >= 1024 at Dv <= 128): 8/1 at d64 keeps 64 splits
    at bs 1 and the chunks at bs 2; the invariant schedule keeps its chunks."""
    be = _gqa8_1(monkeypatch, **{"d64": dict(head_dim=64), "invariant": dict(invariant=True)}[kind])
    assert be._splits(_lay(1)) == 64
    assert be._chunked(_lay(2)) and be._chunked(_lay(1)) == (kind == "invariant")


@pytest.mark.parametrize("bs,want", [(32, 3), (64, 2), (128, 2)])
def test_equal_splits_keep_the_split_count(h200, monkeypatch, bs, want):
    """The doubling is the chunk schedule's: equal splits (``schedule = "split"``) keep 3, 2, 2."""
    test_triton_backend_split_counts(h200, monkeypatch, 32, 1, bs, want, schedule="split")


@pytest.mark.parametrize("bs,want", [(1, 64), (2, 32), (8, 24), (16, 12), (24, 8), (32, 6), (64, 3), (128, 2)])
def test_triton_fp8_decode_takes_twice_the_programs(h200, monkeypatch, bs, want):
    """An FP8 cache's decode: 12 programs an SM, not 6 (its 64-token tiles hold half a bf16
    tile's bytes in flight), the caps and the floor of 2 as for bf16; other modes unchanged."""
    test_triton_backend_split_counts(h200, monkeypatch, 32, 1, bs, want, kv_dtype=torch.float8_e4m3fn)
    test_triton_backend_split_counts(h200, monkeypatch, 32, 4, 16, 4, kv_dtype=torch.float8_e4m3fn)


def test_one_token_extends_on_fp8_keep_the_decode_count_of_bf16(h200, monkeypatch):
    """An EXTEND batch of one-token extends (width 1) runs the extend kernel: 6 an SM on FP8 too."""
    from attn_backends import ModelConfig, get_backend
    from attn_backends.batch import ForwardMode
    from attn_backends.check.scenarios import make_memory
    from attn_backends.layout import MaskKind

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    cfg = ModelConfig(num_layers=1, num_q_heads=32, num_kv_heads=8, head_dim=16, page_size=16,
                      kv_dtype=torch.float8_e4m3fn)
    mem = make_memory(cfg, num_pages=4, max_reqs=2, max_context_len=2048 * 16)
    be = get_backend("triton", cfg, mem)
    monkeypatch.setattr(mem, "device", CUDA0)
    lay = SimpleNamespace(bs=16, width=0, max_seq_len_q=1, mode=ForwardMode.EXTEND, mask=MaskKind.CAUSAL)
    assert be._splits(lay) == 6
    assert be._splits(SimpleNamespace(**(vars(lay) | dict(width=1, mode=ForwardMode.DECODE)))) == 12


def test_split_pages(h200):
    """``split_pages``: a split spans that many pages at least where the splits left give a
    quarter of the SMs (33) a program; otherwise a page."""
    assert tc.choose_num_kv_splits(4, CUDA0, 32, 1, 4) == 32                   # a page a split
    assert tc.choose_num_kv_splits(4, CUDA0, 32, 1, 4, split_pages=2) == 16    # 4 x 16 programs
    assert tc.choose_num_kv_splits(1, CUDA0, 32, 1, 4, split_pages=2) == 32    # 16 programs: too few
    assert tc.choose_num_kv_splits(4, CUDA0, 128, 1, 4, split_pages=2) == 32   # below the pages anyway


@pytest.mark.parametrize("heads,width,bs,max_context,want", [
    (16, 4, 4, 2048, 16), (16, 4, 1, 2048, 32), (16, 4, 4, 8192, 32), (16, 4, 16, 2048, 8),
    (16, 1, 4, 2048, 32),                         # decode: a page a split (64 tokens)
    (128, 4, 1, 2048, 16), (128, 4, 4, 2048, 4),  # MLA128 verify4: 8 programs a request
    (16, 1, 16, 8192, 16), (16, 1, 128, 8192, 2),  # Triton decode: two programs an SM
    ("swap", 1, 16, 8192, 8), ("swap", 1, 64, 2048, 2), ("swap", 1, 128, 8192, 1),   # transposed: one
    ("swap", 1, 1, 8192, 64), ("swap", 1, 4, 2048, 32),   # the cap and the pages, as on Triton
    ("swap", 1, 80, 8192, 1), ("swap", 1, 140, 8192, 1), ("swap", 1, 3, 8192, 32),   # one an SM, uneven
    ("swap32", 1, 64, 8192, 1), (32, 1, 64, 8192, 2),      # 32 heads: two 16-head programs a request
])
def test_triton_mla_split_counts(h200, monkeypatch, heads, width, bs, max_context, want):
    """The ``triton_mla`` backend's counts (``_splits``) at the sweep's MLA rows and others (page
    64): verify takes two 64-token tiles a split where 33 programs or more remain, bs 1 keeps a
    tile a split; 16-head decode takes two programs an SM on the Triton kernel, one on the
    transposed kernel ("swap": where ``decodes_transposed``), also where that fills the SMs
    unevenly (bs 80: 80 programs, bs 140: two waves, bs 3: 96), where it is still the faster kernel
    (figures: bench/RESULTS.md, 'Split counts' and 'MLA kernels')."""
    swap = str(heads).startswith("swap")
    heads = {"swap": 16, "swap32": 32}.get(heads, heads)
    from attn_backends import ModelConfig, get_backend
    from attn_backends.batch import ForwardMode
    from attn_backends.check.scenarios import make_memory
    from attn_backends.layout import MaskKind

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    cfg = ModelConfig(num_layers=1, num_q_heads=heads, num_kv_heads=1, head_dim=16, is_mla=True,
                      kv_lora_rank=512, qk_rope_head_dim=64, page_size=64)
    mem = make_memory(cfg, num_pages=4, max_reqs=2, max_context_len=max_context)
    be = get_backend("triton_mla", cfg, mem)
    monkeypatch.setattr(be, "_decodes_transposed", lambda: swap)
    monkeypatch.setattr(mem, "device", CUDA0)                 # host logic only: the count for an H200
    mode = ForwardMode.DECODE if width == 1 else ForwardMode.TARGET_VERIFY
    lay = SimpleNamespace(bs=bs, width=width, max_seq_len_q=width, mode=mode, mask=MaskKind.CAUSAL)
    assert be._splits(lay) == want
    on_swap = be._split_rule(width, lay)[0] == 1 and width == 1 and heads < 64
    assert on_swap == (swap and width == 1), "the kernel the count is for"
    if on_swap:   # a tree or draft mask on one row a request, or ragged rows, run on the Triton kernel
        for other in ({"mask": MaskKind.TREE}, {"mask": MaskKind.DRAFT}, {"mode": ForwardMode.EXTEND, "width": 0}):
            assert be._split_rule(1, SimpleNamespace(**(vars(lay) | other))) == (2, 1, None), other


@pytest.mark.parametrize("heads,width,bs,max_context,want", [
    (64, 4, 1, 2048, 32), (32, 4, 1, 2048, 32),   # 64 splits would be 32 tokens: a tile (64) each
    (64, 4, 1, 8192, 64), (64, 4, 4, 2048, 16),   # at or below the tiles anyway
    (64, 1, 1, 2048, 64), (32, 8, 1, 2048, 32),   # decode: a page a split; the tree's cap
])
def test_triton_split_counts_take_a_tile_a_split(h200, monkeypatch, heads, width, bs, max_context, want):
    """The ``triton`` backend (GQA x/8, page 16): verify and extend splits span a 64-token kernel
    tile at least where 33 programs or more remain: a split shorter than the tile leaves part
    of it idle (figures: bench/RESULTS.md, 'Split counts')."""
    from attn_backends import ModelConfig, get_backend
    from attn_backends.check.scenarios import make_memory

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    cfg = ModelConfig(num_layers=1, num_q_heads=heads, num_kv_heads=8, head_dim=16, page_size=16)
    be = get_backend("triton", cfg, make_memory(cfg, num_pages=4, max_reqs=2, max_context_len=max_context))
    per_sm, floor, floor_per_sm = be._split_rule(width)
    got = tc.choose_num_kv_splits(be._programs(bs, width), CUDA0, max_context // 16, per_sm, width, floor,
                                  floor_per_sm, be._split_pages(width))
    assert got == want


def test_a_bare_cuda_device_is_the_current_one(monkeypatch):
    """``torch.device("cuda")`` names the current device (``torch.cuda.set_device``, one GPU a rank),
    not device 0: the SM count and the sm_90 check read that device's properties."""
    from attn_backends_kernels.mla import wgmma as mla_wgmma

    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    sms = {0: 16, 1: 132}
    monkeypatch.setattr(tc, "sm_count", lambda index: sms[index])
    cuda = torch.device("cuda")
    assert tc.choose_num_kv_splits(128, cuda, 2048, 16, 1) == tc.choose_num_kv_splits(
        128, torch.device("cuda", 1), 2048, 16, 1) == 16
    assert tc.choose_num_kv_splits(128, CUDA0, 2048, 16, 1) == 2
    capability = {0: (8, 0), 1: (9, 0)}
    monkeypatch.setattr(mla_wgmma, "capability", lambda index: capability[index])
    monkeypatch.setattr(torch.version, "hip", None)
    assert mla_wgmma.hopper_device(cuda) and mla_wgmma.hopper_device(torch.device("cuda", 1))
    assert not mla_wgmma.hopper_device(CUDA0)


def test_the_interpreter_keeps_two_decode_chunks(monkeypatch):
    """The doubling is for a GPU's occupancy: on the CPU (the interpreter's 2 splits) decode keeps 2."""
    from attn_backends import ModelConfig, get_backend
    from attn_backends.batch import ForwardMode
    from attn_backends.check.scenarios import make_memory
    from attn_backends.layout import MaskKind

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    cfg = ModelConfig(num_layers=1, num_q_heads=32, num_kv_heads=8, head_dim=16, page_size=16)
    be = get_backend("triton", cfg, make_memory(cfg, num_pages=4, max_reqs=2, max_context_len=2048 * 16))
    lay = SimpleNamespace(bs=64, width=1, max_seq_len_q=1, mode=ForwardMode.DECODE, mask=MaskKind.CAUSAL)
    assert be._splits(lay) == 2


@pytest.mark.parametrize("family,heads,kv_heads,width,bs,want_exact,want_pow2,fits", [
    ("gqa", 28, 4, 1, 13, 15, 8, False),     # 52 programs, 6 an SM wanted: 15.2; 6 an SM is no wave
    ("gqa", 32, 8, 1, 11, 9, 8, False),      # 88 programs: 9
    ("gqa", 32, 8, 64, 12, 16, 16, False),   # extend: never chunked, a power of two either way (22 wanted)
    ("mla", 128, 1, 1, 13, 5, 4, True),      # 26 programs (two 64-head tiles a request), one an SM: 5 fill 130
    ("mla", 16, 1, 1, 13, 10, 8, True),      # the transposed kernel, one an SM: 10
    ("mla", 16, 1, 1, 3, 44, 32, True),
    ("mla", 128, 1, 1, 48, 4, 1, True),      # 96 programs, 36 SMs idle at a chunk a request: 4 fill 3 waves to 97 %
    ("mla", 128, 1, 1, 24, 2, 2, False),     # 96 programs of 132 again, but 2 chunks a request: no budget of waves
    ("mla", 128, 1, 1, 80, 2, 1, True),      # 160 programs: 2 waves at 61 %, 2 chunks 3 waves at 81 %
    ("mla", 128, 1, 1, 56, 1, 1, False),     # 112 programs: 85 % at any count of at most 3 waves
    ("mla", 16, 1, 1, 100, 1, 1, False),     # 16 heads, 100 programs: 76 % at every count of at most 3 waves
    ("mla", 16, 1, 1, 80, 3, 1, True),       # 80 programs (the transposed kernel, one an SM): 3 fill 2 waves to 91 %
    ("mla", 128, 1, 4, 3, 5, 4, True),       # verify: 24 programs, 5 splits fill 120 of 132 SMs
    ("mla32", 128, 1, 1, 13, 4, 4, False),   # a float32 cache: "auto" takes the split, a power of two either way
])
def test_exact_chunk_splits(h200, monkeypatch, family, heads, kv_heads, width, bs, want_exact, want_pow2, fits):
    """``EXACT_CHUNK_SPLITS`` (the default; off in the ``Pow2Splits*`` classes): a chunked launch
    takes the split rule's count as it is; without it, and for launches that are not chunked, a power
    of two below it (MLA on a 16-bit cache: ``schedule = "auto"`` chunks there on sm_90). ``fits``:
    the launch asks for the wave fit (``_split_plan``: one-an-SM programs whose budget fills at least
    7/8 of the SMs, or a budget of several waves, MLA's decode alone), never without the
    exact count."""
    from attn_backends import ModelConfig, get_backend
    from attn_backends.backends import triton_mla
    from attn_backends.batch import ForwardMode
    from attn_backends.check.scenarios import make_memory
    from attn_backends.layout import MaskKind

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(triton_mla, "hopper_device", lambda device: True)   # "auto" chunks as on an H200
    mla = family.startswith("mla")
    dtype = torch.float32 if family == "mla32" else torch.float16
    cfg = (ModelConfig(num_layers=1, num_q_heads=heads, num_kv_heads=1, head_dim=16, is_mla=True, kv_lora_rank=512,
                       qk_rope_head_dim=64, page_size=64, dtype=dtype) if mla else
           ModelConfig(num_layers=1, num_q_heads=heads, num_kv_heads=kv_heads, head_dim=16, page_size=16))
    mem = make_memory(cfg, num_pages=4, max_reqs=2, max_context_len=16384)
    mode = ForwardMode.DECODE if width == 1 else ForwardMode.TARGET_VERIFY if mla else ForwardMode.EXTEND
    lay = SimpleNamespace(bs=bs, width=width if width == 1 or mla else 0, max_seq_len_q=width, mode=mode,
                          mask=MaskKind.CAUSAL)
    got, fit, many = {}, {}, {}
    for name in (("triton_mla", "attn_backends.backends.triton_mla:Pow2SplitsTritonMLABackend") if mla else
                 ("triton", "attn_backends.backends.triton_backend:Pow2SplitsTritonBackend")):
        be = get_backend(name, cfg, mem)
        monkeypatch.setattr(be, "_decodes_transposed", lambda: heads < 64, raising=False)
        monkeypatch.setattr(mem, "device", CUDA0)
        got[name.split(":")[-1]] = be._splits(lay)
        fit[name.split(":")[-1]], many[name.split(":")[-1]] = be._split_plan(lay)[1:]
        monkeypatch.setattr(mem, "device", torch.device("cpu"))
    assert list(got.values()) == [want_exact, want_pow2], got
    assert list(fit.values()) == [fits, False], fit
    assert list(many.values()) == [want_pow2 == 1 < want_exact, False], many     # more than 1 only as waves
