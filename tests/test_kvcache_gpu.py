"""attention_with_kvcache on a GPU (skipped without one): the triton split-KV kernels at real
sizes against the float64 oracle, every split count, the generic path of sdpa/reference, and a
CUDA-graph capture of the decode call (in-place append included) replayed on new inputs.

    PYTHONPATH=. python -m pytest tests/test_kvcache_gpu.py -q
"""

from __future__ import annotations

import pytest
import torch

from portattn import kvcache
from portattn.conformance.kvcache import KVProblem, check_kvcache, kv_catalogue, make_inputs

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA/ROCm GPU")
DEV = "cuda"


def _ok(results):
    bad = [r for r in results if not r.passed]
    assert not bad, "\n".join(map(str, results))


# name -> KVProblem at decoding sizes (GQA 32:4 / 8:1 / 4:4, D 64/96/128/256, caches to 16k)
REAL = {
    "sq1/gqa8/d128/contig/bf16": KVProblem(lengths=(4095, 0, 1, 2500), seqlen_q=1, seqlen_new=1, heads_q=32,
                                           heads_kv=4, head_dim=128, capacity=4096, dtype="bfloat16"),
    "sq1/gqa8/d128/page16/bf16": KVProblem(lengths=(8191, 17, 0, 5000), seqlen_q=1, seqlen_new=1, heads_q=32,
                                           heads_kv=4, head_dim=128, page_size=16, pages_per_seq=512,
                                           spare_pages=9, dtype="bfloat16"),
    "sq1/gqa8/d128/page256/fp16": KVProblem(lengths=(16383, 300), seqlen_q=1, seqlen_new=1, heads_q=32, heads_kv=4,
                                            head_dim=128, page_size=256, pages_per_seq=64, dtype="float16"),
    "sq8/gqa8/d128/contig/bf16": KVProblem(lengths=(4088, 1000, 0), seqlen_q=8, seqlen_new=8, heads_q=32, heads_kv=4,
                                           head_dim=128, capacity=4096, dtype="bfloat16"),
    "sq8/gqa8/d128/page256/bf16": KVProblem(lengths=(7000, 3), seqlen_q=8, seqlen_new=8, heads_q=32, heads_kv=4,
                                            head_dim=128, page_size=256, pages_per_seq=32, dtype="bfloat16"),
    "sq16/mqa/d64/page16/fp16": KVProblem(lengths=(2000, 0), seqlen_q=16, seqlen_new=16, heads_q=8, heads_kv=1,
                                          head_dim=64, page_size=16, pages_per_seq=128, dtype="float16"),
    "sq1/d256/fp16": KVProblem(lengths=(3000, 1), seqlen_q=1, seqlen_new=1, heads_q=4, heads_kv=4, head_dim=256,
                               capacity=3072, dtype="float16"),
    "sq2/d96-dv64/fp32": KVProblem(lengths=(1500, 700), seqlen_q=2, seqlen_new=2, heads_q=8, heads_kv=2, head_dim=96,
                                   head_dim_v=64, capacity=2048, dtype="float32"),
    "sq4/window-softcap-alibi/bf16": KVProblem(lengths=(3000, 60), seqlen_q=4, seqlen_new=4, heads_q=16, heads_kv=2,
                                               head_dim=128, capacity=4096, window=(256, 0), softcap=30.0, alibi=True,
                                               dtype="bfloat16"),
    "sq3/top-left/page16/fp32": KVProblem(lengths=(900, 2), seqlen_q=3, seqlen_new=1, heads_q=8, heads_kv=8,
                                          head_dim=64, page_size=16, pages_per_seq=64, alignment="top_left",
                                          dtype="float32"),
}


@pytest.mark.parametrize("name", sorted(REAL))
def test_triton_real_sizes(name):
    _ok(check_kvcache(REAL[name], "triton", DEV))


@pytest.mark.parametrize("case_id, problem", kv_catalogue())
def test_catalogue_triton(case_id, problem):
    _ok(check_kvcache(problem, "triton", DEV))


@pytest.mark.parametrize("splits", [1, 2, 5, 16, 128])
def test_every_split_count(splits):
    _ok(check_kvcache(REAL["sq1/gqa8/d128/page16/bf16"], "triton", DEV, num_splits=splits))
    _ok(check_kvcache(REAL["sq8/gqa8/d128/contig/bf16"], "triton", DEV, num_splits=splits))


@pytest.mark.parametrize("backend", ["sdpa", "reference"])
def test_generic_path_on_the_gpu(backend):
    p = KVProblem(lengths=(1000, 0, 1), seqlen_q=4, seqlen_new=2, heads_q=8, heads_kv=2, head_dim=64,
                  page_size=16, pages_per_seq=64, dtype="bfloat16")
    _ok(check_kvcache(p, backend, DEV))


def test_triton_is_the_default_on_nvidia():
    inp = make_inputs(REAL["sq1/gqa8/d128/contig/bf16"], DEV)
    exp = kvcache.explain_kvcache(inp["q"], inp["k_cache"], inp["v_cache"], cache_seqlens=inp["cache_seqlens"])
    assert exp.selected == "triton", str(exp)


def capture_and_replay(p: KVProblem, steps: int) -> dict:
    """Capture one decode step (append + attention, through ``p``'s block table when paged) and
    replay it ``steps`` times on new q/k/v and lengths (``p.seqlen_new`` more each time); each
    replay equals the eager call on an identical cache, bit for bit. Returns the inputs
    (``inp``), the captured caches (``kc``, ``vc``) and the eager ones (``kc_ref``, ``vc_ref``),
    the step's q/k/v and the lengths after the last step (``lens``)."""
    inp = make_inputs(p, DEV)
    kc, vc = inp["k_cache"], inp["v_cache"]
    kc_ref, vc_ref = kc.clone(), vc.clone()
    q_s, k_s, v_s = inp["q"].clone(), inp["k"].clone(), inp["v"].clone()
    lens_s = inp["cache_seqlens"].clone()
    kw = dict(block_table=inp["block_table"], causal=True, return_lse=True, backend="triton")

    # warm up (compiles) on scratch caches of the same shapes, on a side stream as capture wants
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        kvcache.attention_with_kvcache(q_s, kc.clone(), vc.clone(), k_s, v_s, cache_seqlens=lens_s, **kw)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out_s, lse_s = kvcache.attention_with_kvcache(q_s, kc, vc, k_s, v_s, cache_seqlens=lens_s, **kw)

    gen = torch.Generator(device=DEV).manual_seed(5)
    lens = inp["cache_seqlens"].clone()
    for _step in range(steps):
        for t in (q_s, k_s, v_s):
            t.copy_(torch.randn(t.shape, generator=gen, device=DEV, dtype=torch.float32))
        lens_s.copy_(lens)
        graph.replay()
        want, want_lse = kvcache.attention_with_kvcache(q_s.clone(), kc_ref, vc_ref, k_s.clone(), v_s.clone(),
                                                        cache_seqlens=lens.clone(), **kw)
        torch.cuda.synchronize()
        assert torch.equal(out_s, want) and torch.equal(lse_s, want_lse)
        lens += p.seqlen_new
    return dict(inp=inp, kc=kc, vc=vc, kc_ref=kc_ref, vc_ref=vc_ref, q=q_s, k=k_s, v=v_s, lens=lens)


@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("sq", [1, 8])
def test_cuda_graph_capture_matches_eager(paged, sq):
    """Capture one decode step (append + attention) and replay it on new q/k/v and lengths; each
    replay equals the eager call on an identical cache, bit for bit, and the caches agree."""
    layout = dict(page_size=16, pages_per_seq=128) if paged else dict(capacity=2048)
    p = KVProblem(lengths=(1500, 3), seqlen_q=sq, seqlen_new=sq, heads_q=32, heads_kv=4, head_dim=128,
                  dtype="bfloat16", **layout)
    r = capture_and_replay(p, steps=3)
    kc, vc, kc_ref, vc_ref, lens = r["kc"], r["vc"], r["kc_ref"], r["vc_ref"], r["lens"]
    assert torch.equal(torch.nan_to_num(kc, nan=7.0), torch.nan_to_num(kc_ref, nan=7.0))
    assert torch.equal(torch.nan_to_num(vc, nan=7.0), torch.nan_to_num(vc_ref, nan=7.0))
    # and the eager result itself is right (against the float64 oracle) on the last state
    last = KVProblem(**{**p.__dict__, "lengths": tuple(int(x) for x in (lens - sq).tolist())})
    state = dict(r["inp"], k_cache=kc_ref.clone(), v_cache=vc_ref.clone(), q=r["q"].clone(), k=r["k"].clone(),
                 v=r["v"].clone(), cache_seqlens=(lens - sq).to(torch.int32))
    # the oracle appends again at the same positions: the same values, so the expected caches hold
    _ok(check_kvcache(last, "triton", DEV, inputs=state)[:2])


@pytest.mark.parametrize("name, splits", [("sq1/gqa8/d128/contig/bf16", 0), ("sq1/gqa8/d128/contig/bf16", 64),
                                          ("sq1/gqa8/d128/page16/bf16", 32), ("sq8/gqa8/d128/page256/bf16", 16),
                                          ("sq16/mqa/d64/page16/fp16", 8), ("sq4/window-softcap-alibi/bf16", 4)])
def test_append_in_the_split_kernel_matches_the_separate_launch(name, splits, monkeypatch):
    """decode.FOLD_APPEND (every program writes the new rows it reads, then a barrier) against
    the separate append launch: the same caches and the same bits, over 5 repetitions (a race
    between programs would show as a difference), with many splits reading the new rows."""
    from portattn.backends.triton import decode
    p = REAL[name]
    inp = make_inputs(p, DEV)
    kw = dict(block_table=inp["block_table"], causal=p.causal, causal_alignment=p.alignment, window=p.window,
              softcap=p.softcap, alibi_slopes=inp["alibi_slopes"], num_splits=splits)
    results = {}
    for fold in (False, True):
        monkeypatch.setattr(decode, "FOLD_APPEND", fold)
        for rep in range(5):
            kc, vc = inp["k_cache"].clone(), inp["v_cache"].clone()
            kv = kvcache.build_kvcache_spec(inp["q"], kc, vc, inp["k"], inp["v"], cache_seqlens=inp["cache_seqlens"],
                                            **kw)
            assert decode._launch_plan(kv).fold == fold
            out, lse = decode.forward(kv)
            got = tuple(torch.nan_to_num(t, nan=7.0) for t in (out, lse, kc, vc))
            if (fold, rep) == (False, 0):
                want = got
            results[(fold, rep)] = all(torch.equal(a, b) for a, b in zip(got, want))
    assert all(results.values()), results
