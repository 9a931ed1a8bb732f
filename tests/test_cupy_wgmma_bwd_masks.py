"""The wgmma backward's tile logic, compiled from the source with the host C++ compiler (no GPU).

The kernels decide per tile, from a few integer helpers, which work to do: the dK/dV CTA walks
the query tiles of ``row_range`` of its keys, the dQ CTA the key tiles of ``key_range`` of its
rows; a warpgroup skips a tile when ``tile_any_visible`` (attn_bwd_wgmma.cu, new) says none of its
(row, key) pairs is visible, and masks element by element only when ``tile_needs_mask`` says the
tile crosses a boundary. A skip that drops a visible pair, or a missing mask, is a wrong gradient.
This test extracts those functions (and ``SeqInfo``, ``is_visible``, ``keys_need_mask``, the dK/dV
walk ``QueryTileWalk``) from the backend source, compiles them for the host with ``__device__``
defined away, and checks them by
brute force over random geometries (Sq, Sk, both causal alignments, windows, tile positions):
``tile_any_visible`` is exactly "some pair visible", ``tile_needs_mask`` false means every pair of
the tile is visible, and the walks cover every visible pair of a CTA.
"""

import re
import shutil
import subprocess

import pytest
from portattn.backends.cupy import configs

SRC = configs.source(configs.WGMMA_SOURCE_FILES)
CXX = shutil.which("g++") or shutil.which("clang++")


def _extract(signature: str) -> str:
    """The text of the function (or struct) whose declaration contains ``signature``, from the
    start of its line to the matching closing brace."""
    at = SRC.index(signature)
    start = SRC.rindex("\n", 0, at) + 1
    depth, i = 0, SRC.index("{", at)
    while True:
        depth += {"{": 1, "}": -1}.get(SRC[i], 0)
        i += 1
        if depth == 0:
            break
    end = i + 1 if SRC[i:i + 1] == ";" else i
    return SRC[start:end]


HARNESS = r"""
#include <cstdio>
#include <cstdlib>
#include <algorithm>
using std::min; using std::max;
#define __device__
#define __forceinline__ inline
%(code)s

static unsigned long long rng = 88172645463325252ull;
static int rnd(int n) { rng ^= rng << 13; rng ^= rng >> 7; rng ^= rng << 17; return (int)(rng %% (unsigned long long)n); }

int main() {
    const int UNB = 1 << 30;
    const int sides[] = {0, 1, 5, 17, 64, 100, UNB};
    long long checked = 0, skipped = 0, unmasked = 0;
    for (int trial = 0; trial < 4000; ++trial) {
        SeqInfo s;
        s.sq = 1 + rnd(rnd(2) ? 300 : 70);
        s.sk = 1 + rnd(rnd(2) ? 300 : 70);
        s.q0 = s.k0 = 0;
        s.off_alibi = s.sk - s.sq;
        s.off_mask = rnd(2) ? 0 : s.off_alibi;
        const bool causal = rnd(2);
        const int left = sides[rnd(7)], right = causal ? 0 : sides[rnd(7)];
        // (rows per tile, keys per tile): dK/dV warpgroup 64 x 64, dQ warpgroup 64 x BN
        const int shapes[3][2] = {{64, 64}, {64, 128}, {64, 64}};
        for (int sh = 0; sh < 3; ++sh) {
            const int bm = shapes[sh][0], bn = shapes[sh][1];
            for (int m0 = 0; m0 < s.sq; m0 += bm)
                for (int n0 = 0; n0 < s.sk; n0 += bn) {
                    bool any = false, all = true;
                    for (int i = m0; i < m0 + bm; ++i)
                        for (int j = n0; j < n0 + bn; ++j) {
                            const bool v = is_visible(s, i, j, left, right);
                            any = any || v;
                            all = all && v;
                        }
                    const bool tav = tile_any_visible(s, m0, bm, n0, bn, left, right);
                    if (tav != any) {
                        printf("FAIL tile_any_visible=%%d, brute force %%d: sq %%d sk %%d off %%d left %%d right %%d m0 %%d bm %%d n0 %%d bn %%d\n",
                               tav, any, s.sq, s.sk, s.off_mask, left, right, m0, bm, n0, bn);
                        return 1;
                    }
                    if (!tile_needs_mask(s, m0, bm, n0, bn, left, right) && !all) {
                        printf("FAIL tile_needs_mask false with a masked pair: sq %%d sk %%d off %%d left %%d right %%d m0 %%d n0 %%d\n",
                               s.sq, s.sk, s.off_mask, left, right, m0, n0);
                        return 1;
                    }
                    skipped += !tav;
                    unmasked += !tile_needs_mask(s, m0, bm, n0, bn, left, right);
                    ++checked;
                }
        }
        // the dK/dV CTA's walk (128 keys, 64-row tiles: QueryTileWalk, one query head) covers every
        // row that sees one of its keys
        for (int n0 = 0; n0 < s.sk; n0 += 128) {
            int r_lo, r_hi;
            row_range(s, n0, n0 + 127, left, right, &r_lo, &r_hi);
            const QueryTileWalk<64> walk(0, 1, r_lo, r_hi);
            const int w_lo = walk.n_iter > 0 ? walk.row0(0) : 0;
            const int w_hi = walk.n_iter > 0 ? walk.row0(walk.n_iter - 1) + 64 : 0;
            for (int i = 0; i < s.sq; ++i)
                for (int j = n0; j < min(n0 + 128, s.sk); ++j)
                    if (is_visible(s, i, j, left, right) && !(i >= w_lo && i < w_hi)) {
                        printf("FAIL dK/dV walk misses row %%d of key %%d\n", i, j);
                        return 1;
                    }
        }
        // the dQ CTA's walk (128 rows, BN-key tiles from n_first) covers every key its rows see
        for (int m0 = 0; m0 < s.sq; m0 += 128) {
            int n_lo, n_hi;
            key_range(s, m0, m0 + 127, left, right, &n_lo, &n_hi);
            for (int bn = 64; bn <= 128; bn *= 2) {
                const int n_first = (n_lo / bn) * bn;
                for (int i = m0; i < min(m0 + 128, s.sq); ++i)
                    for (int j = 0; j < s.sk; ++j)
                        if (is_visible(s, i, j, left, right) && !(j >= n_first && j < n_hi)) {
                            printf("FAIL dQ walk misses key %%d of row %%d\n", j, i);
                            return 1;
                        }
            }
        }
    }
    printf("OK %%lld tiles, %%lld skipped, %%lld unmasked\n", checked, skipped, unmasked);
    return 0;
}
"""


def _code() -> str:
    parts = [_extract("struct SeqInfo {"), _extract("void key_range("), _extract("void row_range("),
             _extract("bool keys_need_mask("), _extract("bool is_visible("), _extract("bool tile_needs_mask("),
             _extract("bool tile_any_visible("), "template <int BM>\n" + _extract("struct QueryTileWalk {")]
    return "\n".join(parts)


@pytest.mark.skipif(CXX is None, reason="needs a host C++ compiler (g++ or clang++)")
def test_tile_skip_and_mask_logic(tmp_path):
    code = _code()
    assert "tile_any_visible" in code and "key_range(s, m0, r_last" in code
    src = tmp_path / "masks.cpp"
    src.write_text(HARNESS % {"code": code})
    exe = tmp_path / "masks"
    subprocess.run([CXX, "-std=c++17", "-O2", "-o", str(exe), str(src)], check=True, capture_output=True, text=True)
    p = subprocess.run([str(exe)], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr
    n, skipped, unmasked = (int(x) for x in re.match(r"OK (\d+) tiles, (\d+) skipped, (\d+) unmasked", p.stdout).groups())
    # the random geometries reach all three outcomes (so the checks above were not vacuous)
    assert n > 10000 and skipped > 100 and unmasked > 100, p.stdout


@pytest.mark.skipif(CXX is None, reason="needs a host C++ compiler (g++ or clang++)")
def test_tile_logic_check_can_fail(tmp_path):
    """The same harness with tile_any_visible off by one key (the last key of the tile ignored)
    reports a failure: the brute force sees what a wrong skip drops."""
    code = _code().replace("min(hi, n0 + bn)", "min(hi, n0 + bn - 1)")
    assert code != _code()
    src = tmp_path / "masks_bad.cpp"
    src.write_text(HARNESS % {"code": code})
    exe = tmp_path / "masks_bad"
    subprocess.run([CXX, "-std=c++17", "-O2", "-o", str(exe), str(src)], check=True, capture_output=True, text=True)
    p = subprocess.run([str(exe)], capture_output=True, text=True, timeout=300)
    assert p.returncode == 1 and p.stdout.startswith("FAIL tile_any_visible"), p.stdout

