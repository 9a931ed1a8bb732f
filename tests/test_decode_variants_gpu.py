"""GPU checks of tools/decode_variants.py's rows, each made the table's row
(configs._DECODE_ROWS_NVIDIA) so that it runs through ``attention_with_kvcache`` itself: every
variant that changes the paged loop against the float64 oracle at decoding sizes (GQA 32:4, D 128, NaN in unused slots,
new rows appended, a length-0 sequence), and one CUDA-graph capture with a paged 64-row row of direct page loads."""

from __future__ import annotations

import pytest
import torch
from _scripts import load_script
from test_kvcache_gpu import capture_and_replay  # the capture / replay / compare of a decode step

from portattn import kvcache
from portattn.conformance.kvcache import KVProblem, check_kvcache, make_inputs

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA/ROCm GPU")
DEV = "cuda"


def _tool():
    return load_script("decode_variants", "tools")


def _variants(new_paths_only: bool = False):
    """tools/decode_variants.py's rows; ``new_paths_only``: those that change the paged loop's
    code (page-id carry, direct page loads, one page per 16-key tile), not only tiles and split
    counts (those the tool itself checks at every point it times)."""
    rows = [(cls, name, cfg, lays) for cls, group in _tool().VARIANTS.items() for name, cfg, lays in group]
    if new_paths_only:
        rows = [r for r in rows if r[2].page_ids or r[2].page_direct or r[2].block_n == 16]
    return rows


PROBLEMS = {
    ("narrow", "paged"): KVProblem(lengths=(8191, 17, 0), seqlen_q=1, seqlen_new=1, heads_q=32, heads_kv=4,
                                   head_dim=128, page_size=16, pages_per_seq=512, spare_pages=9, dtype="bfloat16"),
    ("narrow", "contig"): KVProblem(lengths=(4095, 0, 2500), seqlen_q=1, seqlen_new=1, heads_q=32, heads_kv=4,
                                    head_dim=128, capacity=4096, dtype="bfloat16"),
    ("wide", "paged"): KVProblem(lengths=(7000, 3, 0), seqlen_q=8, seqlen_new=8, heads_q=32, heads_kv=4,
                                 head_dim=128, page_size=16, pages_per_seq=512, spare_pages=5, dtype="bfloat16"),
    ("wide", "contig"): KVProblem(lengths=(4088, 1000, 0), seqlen_q=8, seqlen_new=8, heads_q=32, heads_kv=4,
                                  head_dim=128, capacity=4096, dtype="bfloat16"),
}


def _ok(results):
    bad = [r for r in results if not r.passed]
    assert not bad, "\n".join(map(str, results))


@pytest.fixture
def as_row(monkeypatch):
    """Make a DecodeConfig the table's row of its class and layout (plans cleared around)."""
    from portattn.backends.triton import configs, decode
    from portattn.backends.triton.configs import _nvidia_family, device_target

    def clear():
        decode._plan_cached.cache_clear()
        decode._LAUNCHES.clear()

    def put(cls, layout, cfg):
        target = device_target(torch.device(DEV, torch.cuda.current_device()))
        if target.vendor != "nvidia":
            pytest.skip("the rows table is NVIDIA's")
        family = _nvidia_family(int(target.arch))
        monkeypatch.setitem(configs._DECODE_ROWS_NVIDIA, family, {
            (128, cls, layout): (cfg.block_m, cfg.block_n, cfg.num_warps, cfg.num_stages, cfg.programs_per_sm,
                                 cfg.page_ids, cfg.page_direct)})
        clear()
        return decode
    yield put
    clear()


@pytest.mark.parametrize("cls, name, cfg, lays", _variants(new_paths_only=True),
                         ids=lambda x: x.replace(" ", "_") if isinstance(x, str) else "")
def test_variant_rows_match_the_oracle(as_row, cls, name, cfg, lays):
    """Each row that changes the paged loop on a paged-16 cache (its pages hold no whole tile but
    for N16: the page-id carry, the direct page loads, the page-fit tiles), as the table's row."""
    layouts = ["paged"]
    for layout in layouts:
        p = PROBLEMS[(cls, layout)]
        decode = as_row(cls, layout, cfg)
        inp = make_inputs(p, DEV)
        kv = kvcache.build_kvcache_spec(inp["q"], inp["k_cache"], inp["v_cache"], inp["k"], inp["v"],
                                        cache_seqlens=inp["cache_seqlens"], block_table=inp["block_table"],
                                        causal=True)
        assert decode.plan_summary(kv)["config"] == cfg.short(), (layout, decode.plan_summary(kv))
        _ok(check_kvcache(p, "triton", DEV))


def test_cuda_graph_capture_with_a_paged_wide_row(as_row):
    """The first wide variant with a new paged loop (direct page loads) as the paged 64-row row:
    a captured decode step (append + attention) replayed on new inputs equals the eager call,
    bit for bit."""
    cls, name, cfg, _ = next(v for v in _variants(new_paths_only=True) if v[0] == "wide")
    as_row(cls, "paged", cfg)
    p = KVProblem(lengths=(1500, 3), seqlen_q=8, seqlen_new=8, heads_q=32, heads_kv=4, head_dim=128,
                  dtype="bfloat16", page_size=16, pages_per_seq=128)
    capture_and_replay(p, steps=2)
