"""The decode chunk pass's launch rules (``decode_attention.chunk_maxnreg``, ``chunk_fit``, ``chunk_resident``):
the register bound where it saves a wave, the wave fit where a one-wave budget's overrun would spill into a second."""
import pytest
import torch
from kernel_refs import assert_close, make_paged_batch, ref_paged_attention
from test_decode_attention import run_chunked

from attn_backends_kernels.decode_attention import chunk_fit, chunk_maxnreg, decode_attention_fwd
from attn_backends_kernels.extend_attention import extend_attention_fwd
from attn_backends_kernels.kv_walk import slot64
from attn_backends_kernels.schedule import chunk_workspace, slots_per_request


@pytest.mark.parametrize("bs,per_sm,want", [(24, 5.8, None), (24, 6.0, None), (24, 6.5, 64), (24, 8.0, 64),
                                            (48, 11.6, None), (33, 12.0, None), (64, 14.5, 64), (64, 15.5, 64),
                                            (96, 17.0, None), (128, 31.0, 64), (32, None, 64), (16, 15.5, None)])
def test_chunk_register_bound_where_it_saves_a_wave(bs, per_sm, want):
    """The chunk pass's 64 registers (8 programs an SM) where the budget takes a wave fewer of them than of the
    compiler's 6 (``chunk_resident``, GQA 32/8 d128): bs 48 (11.6 an SM, two waves either way) and budgets of one
    wave at 6 (5.8: the wave fit's instead) keep the compiler's count; 16 requests or fewer keep it anyway (64
    spills there)."""
    assert chunk_maxnreg(torch.bfloat16, 128, 32, bs, 4, per_sm) == want


@pytest.mark.parametrize("kv,bs,group,per_sm,want,few", [
    (torch.bfloat16, 24, 4, 5.8, True, 0), (torch.bfloat16, 24, 7, 6.0, True, 0),
    (torch.bfloat16, 24, 4, 6.5, False, 0), (torch.bfloat16, 48, 4, 11.6, False, 0),
    (torch.bfloat16, 32, 4, None, False, 0), (torch.bfloat16, 16, 4, 5.8, False, 0),
    (torch.float8_e4m3fn, 24, 4, 5.8, False, 0),
    (torch.bfloat16, 48, 8, 5.8, False, 0),      # GQA 8/1: 7 an SM at the compiler's registers, room for the overrun
    (torch.bfloat16, 24, 4, 4.5, False, 0),      # 6 an SM hold 4.5 and the overrun
    (torch.bfloat16, 24, 7, 6.0, False, 4),      # FEW_LAST at 4 chunks: GQA 28/4 holds 7 an SM, 6 at 8 chunks
    (torch.bfloat16, 24, 7, 6.0, True, 8), (torch.bfloat16, 24, 1, 6.0, True, 2),
    (torch.bfloat16, 24, 1, 6.0, False, 4),
])
def test_chunk_wave_fit_where_the_budget_is_one_wave(kv, bs, group, per_sm, want, few):
    """The wave fit where the budget is one wave of the compiled pass (``chunk_resident``: 6 programs an SM at d128
    for the groups whose compile with FEW_LAST ``few`` holds 6, else 7) and that holds fewer than the budget's plus
    one, on the rows the register bound serves (16-bit caches, more than 16 requests); the invariant schedule (None)
    has no fit."""
    assert chunk_fit(kv, 128, 32, bs, group, per_sm, few=few) is want


def test_the_rules_know_every_few_last_they_are_asked(monkeypatch):
    """``DECODE_FEW_LAST`` up to 8 gives the rules only compiles they know, for every split count, group and head
    dim; above 8 they refuse the unmeasured compile in one line (a probe passes maxnreg and fit instead)."""
    import attn_backends_kernels.decode_attention as mod
    for knob in range(17):
        monkeypatch.setattr(mod, "DECODE_FEW_LAST", knob)
        for splits in range(1, 65):
            few = mod.few_last(splits, "chunks", "pass")
            for group, dim in [(1, 128), (4, 128), (7, 128), (8, 128), (4, 64)]:
                args = (torch.bfloat16, dim, 32, 24, group, 24 * splits / 132)
                if few <= 8:
                    mod.chunk_fit(*args, few=few), mod.chunk_maxnreg(*args, few=few)
                    continue
                with pytest.raises(ValueError, match=f"FEW_LAST {few} not in"):
                    mod.chunk_fit(*args, few=few)


@pytest.mark.parametrize("knob", [0, 8])
@pytest.mark.parametrize("schedule,fits", [("chunks", True), ("chunks", False), ("invariant", False)])
def test_chunk_register_bound_sees_the_budget(monkeypatch, schedule, fits, knob):
    """``decode_attention_fwd`` hands the rules its budget's programs an SM (bs x KV heads x chunks a request over
    the SMs: OFFLINE_SMS for tensors on no GPU) and the FEW_LAST it compiles with (2 chunks a request: 2 where
    ``DECODE_FEW_LAST`` ``knob`` allows) on the chunk schedule, and None (0) on the invariant one; the chunk
    launch takes ``chunk_fit``'s answer (a GPU's: patched), and the fitted schedule matches the reference."""
    import attn_backends_kernels.decode_attention as mod
    seen, launched = [], []
    real, real_launch = mod.chunk_maxnreg, mod.chunk_launch
    monkeypatch.setattr(mod, "DECODE_FEW_LAST", knob)
    monkeypatch.setattr(mod, "chunk_maxnreg", lambda *a, **kw: seen.append((a[-1], kw["few"])) or real(*a, **kw))
    monkeypatch.setattr(mod, "chunk_fit", lambda *a, **kw: fits)
    monkeypatch.setattr(mod, "chunk_launch", lambda *a, **kw: launched.append(kw["fit"]) or real_launch(*a, **kw))
    seq_lens = [3000, 9, 70]      # 8 whole chunks of 9 tiles overrun a budget of 6: the fit takes 6 of 12 tiles
    page_table, lens, num_pages = make_paged_batch(seq_lens, 16, device="cpu", seed=0)
    q, out = torch.randn(3, 4, 16), torch.empty(3, 4, 16)
    kv = torch.randn(num_pages * 16, 2, 16)
    ws = chunk_workspace(3, slots_per_request(schedule, 2, page_table.shape[1] * 16), 1, 4, 2, 16, "cpu")
    decode_attention_fwd(q, kv, kv.clone(), page_table, lens, 16, 0.25, 2, out, ws, schedule=schedule, merge="pass")
    assert seen == [(3 * 2 * 2 / mod.OFFLINE_SMS, 2 if knob else 0) if schedule == "chunks" else (None, 0)]
    assert launched == [fits]
    ref = ref_paged_attention(q, kv, kv, page_table, lens, torch.arange(4, dtype=torch.int32), 16, 0.25)
    assert_close(out, ref, 1e-5)


@pytest.mark.parametrize("warps,stages", [(8, 2), (4, 3)])
def test_chunk_rules_keep_off_other_launches(monkeypatch, warps, stages):
    """The rules read the default launch's residency (4 warps, 2 stages): another keeps the compiler's registers and
    no fit, whatever the budget."""
    import attn_backends_kernels.decode_attention as mod
    launched = []
    real_launch = mod.chunk_launch
    monkeypatch.setattr(mod, "chunk_fit", lambda *a, **kw: True)
    monkeypatch.setattr(mod, "chunk_maxnreg", lambda *a, **kw: 64)
    monkeypatch.setattr(mod, "chunk_launch", lambda *a, **kw: launched.append(kw["fit"]) or real_launch(*a, **kw))
    page_table, lens, num_pages = make_paged_batch([300, 9, 70], 16, device="cpu", seed=0)
    q, out = torch.randn(3, 4, 16), torch.empty(3, 4, 16)
    kv = torch.randn(num_pages * 16, 2, 16)
    ws = chunk_workspace(3, slots_per_request("chunks", 2, page_table.shape[1] * 16), 1, 4, 2, 16, "cpu")
    decode_attention_fwd(q, kv, kv.clone(), page_table, lens, 16, 0.25, 2, out, ws, schedule="chunks", merge="pass",
                         num_warps=warps, num_stages=stages)
    assert launched == [False]
    ref = ref_paged_attention(q, kv, kv, page_table, lens, torch.arange(4, dtype=torch.int32), 16, 0.25)
    assert_close(out, ref, 1e-5)


@pytest.mark.cuda
@pytest.mark.parametrize("H,Hkv,per_request,fitted", [(28, 4, 7, True), (8, 1, 28, False)])
def test_decode_chunks_take_the_fit_where_the_pass_holds_no_overrun_gpu(monkeypatch, H, Hkv, per_request, fitted):
    """At a budget of one wave (5.3 programs an SM on 132 SMs) the chunk pass at the compiler's registers takes the
    wave fit (a negative budget) where ``chunk_fit`` asks (``fitted``: its answer on 132 SMs), and either schedule
    matches the float64 reference on a long tail of 25 requests (24 and the pad row)."""
    import attn_backends_kernels.decode_attention as mod
    budgets = []
    real = mod.launch
    monkeypatch.setattr(mod, "launch", lambda k, g, *a, **kw: (k is mod._decode_chunk_kernel and budgets.append(a[12]))
                        or real(k, g, *a, **kw))
    lens = [32768] + [256 + 97 * i for i in range(23)]
    out, ref, ws = run_chunked(lens, 16, H, Hkv, 128, per_request, torch.bfloat16, "cuda", block_n=None,
                               merge="pass")
    assert_close(out[:len(lens)], ref, 1e-2)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    want = chunk_fit(torch.bfloat16, 128, 32, 25, H // Hkv, 25 * Hkv * per_request / sms,
                     few=mod.few_last(per_request, "chunks", "pass"))
    assert want == fitted or sms != 132
    assert len(budgets) == 1 and (budgets[0] < 0) == want, (budgets, want)


def test_slot64_where_an_offset_reaches_2_31():
    """int64 slot arithmetic exactly where a KV buffer's largest element offset reaches 2^31 (shapes alone: meta)."""
    fits = torch.empty(2 ** 24, 1, 128, device="meta")              # largest offset 2^31 - 1
    past = torch.empty(2 ** 24 + 1, 1, 128, device="meta")
    assert not slot64(fits, fits) and slot64(fits, past) and slot64(past)
    view = torch.empty(2 ** 22 + 1, 2, 256, device="meta")[:, :, :128]      # 2^30 elements, offsets past 2^31
    assert slot64(view) and not slot64(view[:-1])
    edge = torch.empty(2 ** 23 + 1, 256, device="meta")[:, :1]              # largest offset exactly 2^31
    assert slot64(edge) and not slot64(edge[:-1])


@pytest.mark.parametrize("wide", [False, True])
def test_decode_slot_width_by_pass(monkeypatch, wide):
    """The split pass takes ``slot64``'s answer for its cache, the chunk pass int64 slots whatever the cache (the
    residency its rules read); both match the reference."""
    import attn_backends_kernels.decode_attention as mod
    widths, real_launch = {}, mod.launch
    monkeypatch.setattr(mod, "slot64", lambda *buffers: wide)
    monkeypatch.setattr(mod, "launch", lambda k, g, *a, **kw: widths.setdefault(k.__name__, kw.get("SLOT64"))
                        and False or real_launch(k, g, *a, **kw))
    page_table, lens, num_pages = make_paged_batch([300, 9, 70], 16, device="cpu", seed=1)
    q, kv = torch.randn(3, 4, 16), torch.randn(num_pages * 16, 2, 16)
    ref = ref_paged_attention(q, kv, kv, page_table, lens, torch.arange(4, dtype=torch.int32), 16, 0.25)
    for schedule in ("split", "chunks"):
        out = torch.empty(3, 4, 16)
        ws = chunk_workspace(3, slots_per_request(schedule, 2, page_table.shape[1] * 16), 1, 4, 2, 16, "cpu")
        decode_attention_fwd(q, kv, kv.clone(), page_table, lens, 16, 0.25, 2, out,
                             ws if schedule == "chunks" else None, schedule=schedule,
                             **(dict(merge="pass") if schedule == "chunks" else {}))
        assert_close(out, ref, 1e-5)
    assert widths["_decode_split_kernel"] is wide and widths["_decode_chunk_kernel"] is True, widths


@pytest.mark.cuda
def test_kernels_read_a_cache_past_2_31_elements_gpu():
    """A cache past 2^31 elements (int64 slots: ``slot64``), its pages at the top and NaN below them: the decode
    split and chunk passes and a verify extend equal the float64 reference over those pages (int32 slots there
    wrap to negative offsets: an illegal address, or garbage)."""
    seq_lens = [700, 33, 1500]
    page_table, lens, num_pages = make_paged_batch(seq_lens, 16, device="cuda", seed=3)
    base = 2 ** 31 // (16 * 128)               # the first page whose elements start at 2^31 (1 KV head, d128)
    k = torch.full(((base + num_pages) * 16, 1, 128), float("nan"), dtype=torch.bfloat16, device="cuda")
    v = torch.full_like(k, float("nan"))
    k[base * 16:], v[base * 16:] = torch.randn_like(k[base * 16:]), torch.randn_like(v[base * 16:])
    assert slot64(k, v)
    top, scale = page_table + base, 128 ** -0.5
    q = torch.randn(3, 8, 128, device="cuda", dtype=torch.bfloat16)
    cu = torch.arange(4, dtype=torch.int32, device="cuda")
    ref = ref_paged_attention(q, k[base * 16:], v[base * 16:], page_table, lens, cu, 16, scale)
    for schedule in ("split", "chunks"):
        out = torch.empty_like(q)
        ws = chunk_workspace(3, slots_per_request(schedule, 4, page_table.shape[1] * 16), 1, 8, 1, 128, "cuda")
        decode_attention_fwd(q, k, v, top, lens, 16, scale, 4, out, ws if schedule == "chunks" else None,
                             schedule=schedule, **(dict(merge="pass") if schedule == "chunks" else {}))
        assert_close(out, ref, 1e-2)
    qv, cu4 = torch.randn(12, 8, 128, device="cuda", dtype=torch.bfloat16), 4 * cu
    out = torch.empty_like(qv)
    extend_attention_fwd(qv, k, v, top, lens, cu4, 16, scale, 4, out)
    assert_close(out, ref_paged_attention(qv, k[base * 16:], v[base * 16:], page_table, lens, cu4, 16, scale), 1e-2)
