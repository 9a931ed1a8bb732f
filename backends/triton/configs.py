"""Tile sizes and launch options of every Triton kernel, per vendor: the one source of truth.

The choice is a deterministic table (no autotuning): a function of the target (vendor and
architecture, read from the device at run time), the padded head dimension ``BLOCK_D`` and the
element size. The portability check (``python -m portattn.backends.triton.portability``)
compiles every entry of :func:`all_choices` for sm_80, sm_90, gfx90a and gfx942, so whatever
this module can return is known to compile and to fit the target's shared memory / LDS.

* NVIDIA: ``BLOCK_M``, ``BLOCK_N``, ``num_warps``, ``num_stages``; Hopper (sm_90+) gets deeper
  pipelines and larger tiles than Ampere (sm_80, 164 KiB shared memory); other sm_8x parts
  (≈100 KiB) get the small table.
* AMD CDNA (gfx90a, gfx942, …; 64 KiB LDS, 64-wide wavefronts): ``waves_per_eu``,
  ``matrix_instr_nonkdim`` (16×16 MFMA) and ``kpack``; ``num_stages`` ≤ 2 (the stream
  pipeliner), no Hopper-only features (nothing here uses TMA or warp specialisation).
* CPU (Triton's interpreter): tiles of 32, since the interpreter's cost is per program and per op.
"""

from __future__ import annotations

import functools
from dataclasses import asdict, dataclass

import torch


@dataclass(frozen=True)
class Target:
    """Where kernels run: vendor ``"nvidia"``/``"amd"``/``"cpu"`` and its architecture
    (compute capability as an int such as 90 for NVIDIA, ``"gfx942"`` for AMD, None for CPU)."""

    vendor: str
    arch: int | str | None = None

    def __str__(self) -> str:
        if self.vendor == "nvidia":
            return f"sm_{self.arch}"
        if self.vendor == "amd":
            return str(self.arch)
        return "interpreter"


@dataclass(frozen=True)
class KernelConfig:
    """Tile sizes and compiler options of one kernel launch."""

    block_m: int
    block_n: int
    num_warps: int = 4
    num_stages: int = 2
    waves_per_eu: int | None = None          # AMD only
    matrix_instr_nonkdim: int | None = None  # AMD only
    kpack: int | None = None                 # AMD only
    tma: bool = False   # forward, NVIDIA sm_90+: Q/K/V/O through tensor descriptors (kernels.attn_fwd)
    ws: bool = False    # forward, NVIDIA sm_90+: warp-specialised key loops
    # backward dK/dV only: two launches, dV (K resident, 2 products per tile pair) then dK (K, V
    # resident, 3 products), each program holding one float32 accumulator (kernels.attn_bwd_dkdv's PART)
    split: bool = False

    def launch_options(self) -> dict:
        """Keyword arguments for ``kernel[grid](..., **options)`` (and ``triton.compile``).
        ``enable_fp_fusion`` is pinned on (a*b+c as one fma, what the kernels were validated with):
        triton 3.9 warns that its default turns off in 3.10."""
        opts = {"num_warps": self.num_warps, "num_stages": self.num_stages, "enable_fp_fusion": True}
        for key in ("waves_per_eu", "matrix_instr_nonkdim", "kpack"):
            value = getattr(self, key)
            if value is not None:
                opts[key] = value
        return opts

    def short(self) -> str:
        extra = "".join(f" {k}={v}" for k, v in asdict(self).items()
                        if k in ("waves_per_eu", "matrix_instr_nonkdim", "kpack") and v is not None)
        extra += " tma" * self.tma + " ws" * self.ws + " split" * self.split
        return f"M{self.block_m} N{self.block_n} w{self.num_warps} s{self.num_stages}{extra}"


@dataclass(frozen=True)
class BackwardConfigs:
    """The backward's kernels: dK/dV (``block_n`` keys resident, ``block_m`` queries streaming),
    dQ (``block_m`` queries resident, ``block_n`` keys streaming) and the row-statistics prep.

    ``atomic``: the dK/dV config of FlashAttention-2's atomic dQ (the dK/dV kernel also adds
    dS K into a float32 dQ with atomic adds; no dQ kernel), or None. Used by 16-bit calls that
    do not request determinism and need no bias gradient (ops.backward); a separate row because
    it holds one more (BLOCK_M, BLOCK_D) float32 tile per program. ``atomic_by_default``: whether
    ``PORTATTN_TRITON_DQ=auto`` uses it (the row was timed faster than the deterministic one)."""

    dkdv: KernelConfig
    dq: KernelConfig
    prep: KernelConfig = KernelConfig(64, 16, 4, 1)
    atomic: KernelConfig | None = None
    atomic_by_default: bool = False


def device_target(device: torch.device) -> Target:
    """The :class:`Target` of a torch device (CPU tensors run under the interpreter).

    Cached per indexed device (``torch.cuda.get_device_properties`` costs ~20 us a call on a
    slow host, and a device's properties do not change); ``cuda`` without an index means the
    current device, which can change, so it is not cached."""
    if device.type != "cuda":
        return _CPU
    if device.index is None:
        return _device_target(device)
    return _indexed_device_target(device)


_CPU = Target("cpu")


@functools.lru_cache(maxsize=64)
def _indexed_device_target(device: torch.device) -> Target:
    return _device_target(device)


def _device_target(device: torch.device) -> Target:
    props = torch.cuda.get_device_properties(device)
    if getattr(torch.version, "hip", None):
        return Target("amd", getattr(props, "gcnArchName", "gfx942").split(":")[0])
    return Target("nvidia", props.major * 10 + props.minor)


def padded_dim(d: int) -> int:
    """Block size covering a head dimension: the next power of two, at least 16 (tl.dot's minimum)."""
    return max(16, 1 << (max(1, d) - 1).bit_length())


PADDED_DIMS = (16, 32, 64, 128, 256)


def _nvidia_family(arch: int) -> str:
    if arch >= 90:
        return "hopper"
    if arch in (80, 87):
        return "ampere"
    return "small"   # sm_86/89/12x: ~100 KiB of shared memory per block


# fwd tables: BLOCK_D -> (BLOCK_M, BLOCK_N, num_warps, num_stages[, tma, ws]), for 2-byte inputs;
# the optional flags (Hopper rows only; forward_config drops them below sm_90 and for float32)
# turn on the forward's tensor-descriptor loads/stores and warp-specialised key loops
# (tools/triton_sweep.py --fwd-only times them against the plain rows).
# Hopper D=128 measured on the H200 (2026-11-29, bf16, B4 H16 S4096, fwd TFLOP/s non-causal/causal):
# (128,64) w8 s3: 457/397; (128,128) w8 s3: 430/375; (128,32) w4 s4: 396/341; (64,64) w4 s3: 374/338;
# (128,64) w4 s3: 226/199. Torch SDPA in the same run: flash 338/304, cuDNN 603/517.
# Re-swept 2026-12-01 (tools/triton_sweep.py, S 1k-16k, causal and not; time relative to each cell's best,
# mean of 6 cells): D64 (128,64,4,3) 1.02, (64,64,4,3) 1.03, (128,128,8,3) 1.17; D128 (128,64,8,3) 1.00,
# (128,128,8,3) 1.07; D256 (128,32,8,3) 1.00, (128,64,8,2) 1.03, (128,32,8,2) 1.35.
_FWD_NVIDIA = {
# 8 warps for BLOCK_M = 128 everywhere: with 4, ptxas spilled (sm_80 D128: 32 registers and a
# 6.5 KB stack frame; sm_90 D32: 1.3 KB); D256 uses BLOCK_N = 32 (BLOCK_N = 64 spilled on sm_90).
# hopper D256: tools/triton_sweep.py --fwd-only on the H200 (2026-12-01, bf16, 16k tokens, S 1k-16k,
# causal and not, time relative to each cell's best, mean of 6): TMA loads (tensor descriptors) with
# BLOCK_N 64 and 2 stages 1.000, the same with pointers 1.061, this N32 s3 row 1.101 (TMA up to
# 1.18x faster at S >= 4k), so D256 runs the TMA row; the pointer row (128, 32, 8, 3) is what sm_90
# float32 and the other targets keep. D64 and D128 keep pointer loads on the evidence (TMA: 1.066
# and 1.067 at their best).
    "hopper": {16: (128, 64, 8, 3), 32: (128, 64, 8, 3), 64: (128, 64, 4, 3), 128: (128, 64, 8, 3),
               256: (128, 64, 8, 2, True, False)},
    "ampere": {16: (128, 64, 8, 3), 32: (128, 64, 8, 3), 64: (128, 64, 8, 3), 128: (128, 64, 8, 3), 256: (128, 32, 8, 2)},
    "small":  {16: (128, 64, 4, 2), 32: (128, 64, 4, 2), 64: (64, 64, 4, 2), 128: (64, 64, 4, 2), 256: (64, 32, 4, 1)},
}
#: the plain rows that a table's rows with 16-bit Hopper flags stand for where the flags do not apply
#: (float32 inputs; sm_8x): the forward's TMA rows (the pointer row) and the backward's split dK/dV
#: rows (the fused row): kernel -> family -> BLOCK_D -> row
_PLAIN_ROWS = {"fwd": {"hopper": {256: (128, 32, 8, 3)}}, "dkdv": {"hopper": {256: (32, 32, 4, 3)}}}


def _plain_row(kernel: str, family: str, block_d: int, row: tuple) -> tuple:
    """The row ``row`` replaced, for a problem its flags do not apply to (``_PLAIN_ROWS``), else ``row``."""
    return _PLAIN_ROWS[kernel].get(family, {}).get(block_d, row)

# bwd tables: BLOCK_D -> (dK/dV (BLOCK_M streamed queries, BLOCK_N resident keys, warps, stages[, split]),
#                         dQ (BLOCK_M resident queries, BLOCK_N streamed keys, warps, stages)), 2-byte inputs.
# ``split`` (KernelConfig.split, 16-bit only): dK/dV as a dV launch and a dK launch; tools/triton_sweep.py
# --bwd-variants times split rows against these.
_BWD_NVIDIA = {
    # measured on the H200 (2026-12-01, tools/triton_sweep.py, bf16, 16k tokens, hidden 2048, S 1k-16k,
    # causal and not; backward time relative to the best config of each cell, mean over the 6 cells):
    # D64 dK/dV (32,128,4,3) 1.00, (64,64,4,3) 1.11, (64,128,8,3) 1.16; dQ (64,64,4,3) 1.00, (64,32,4,3) 1.02.
    # D128 dK/dV (64,128,8,2) 1.007, (64,128,8,3) 1.008, (32,64,4,3) 1.06; dQ (64,32,4,3) 1.00, (128,32,8,3) 1.02.
    # D256 dK/dV (32,32,4,3) 1.007, (32,64,8,2) 1.02; dQ (64,16,4,2) 1.00, (32,64,4,2) 1.06.
    # Split dK/dV (tools/triton_sweep.py --bwd-variants, H200 2026-12-01, the same grid, backward alone,
    # relative to each cell's best): D256 (32,128,8,2,split) 1.000, (16,128,8,2,split) 1.30, the fused
    # (32,32,4,3) 1.33: 0.73-0.82 x FA2 (fused 0.51-0.65); D128 split 1.29-1.53 and D64 split 1.25 lose.
    "hopper": {16: ((32, 128, 4, 3), (64, 64, 4, 3)), 32: ((32, 128, 4, 3), (64, 64, 4, 3)),
               64: ((32, 128, 4, 3), (64, 64, 4, 3)), 128: ((64, 128, 8, 2), (64, 32, 4, 3)),
               256: ((32, 128, 8, 2, True), (64, 16, 4, 2))},
    "ampere": {16: ((32, 64, 4, 2), (64, 32, 4, 2)), 32: ((32, 64, 4, 2), (64, 32, 4, 2)),
               64: ((32, 64, 4, 2), (64, 32, 4, 2)), 128: ((32, 64, 4, 2), (64, 32, 4, 2)),
               256: ((16, 32, 4, 1), (32, 16, 4, 1))},
    "small":  {16: ((32, 64, 4, 2), (64, 32, 4, 2)), 32: ((32, 64, 4, 2), (64, 32, 4, 2)),
               64: ((32, 64, 4, 2), (64, 32, 4, 2)), 128: ((32, 64, 4, 1), (64, 32, 4, 1)),
               256: ((16, 32, 4, 1), (32, 16, 4, 1))},
}
# atomic-dQ dK/dV rows (BackwardConfigs.atomic): BLOCK_D -> (BLOCK_M, BLOCK_N, warps, stages[, split]),
# 16-bit only, for calls that do not request determinism; a missing entry keeps the two-kernel
# backward. Timed on the H200 (2026-12-02, tools/triton_sweep.py --bwd-variants, bf16, 16k tokens,
# hidden 2048, S 1k/4k/16k, causal and not, backward alone; benchmarks/results/triton-bwd-atomic-h200.*;
# each candidate checked against float64 at ragged S 200/333 first). Mean time relative to each
# cell's best: D64 the deterministic row 1.000, atomic (64,64,4,3) 1.10, (64,128,8,2) 1.12,
# (32,128,4,3) 1.26; D128 atomic (64,128,8,2) 1.014, (64,128,8,3) 1.02, deterministic 1.03,
# (32,128,8,2) 1.07; D256 atomic (32,128,8,2,split) 1.000, (16,128,8,3,split) 1.15, deterministic
# 1.22, (16,128,8,2,split) 1.34. Speed-up of the best atomic row over the deterministic backward:
# D64 0.86-0.96, D128 0.95-1.07 (1.02-1.07 at S >= 4k), D256 1.15-1.25 (0.86-1.02 x FA2).
# Ampere and AMD: off (not timed there; the portability check compiles their dK/dV rows with atomic dQ).
#: the head dims (BLOCK_D) whose atomic row ``PORTATTN_TRITON_DQ=auto`` (the default) uses: those
#: the H200 sweep timed faster than the deterministic backward; ``PORTATTN_TRITON_DQ=atomic``
#: turns every row on.
_BWD_ATOMIC_BY_DEFAULT: dict = {"hopper": frozenset({128, 256}), "ampere": frozenset(), "small": frozenset()}
_BWD_ATOMIC_NVIDIA: dict = {
    "hopper": {16: (64, 64, 4, 3), 32: (64, 64, 4, 3), 64: (64, 64, 4, 3), 128: (64, 128, 8, 2),
               256: (32, 128, 8, 2, True)},
    "ampere": {},
    "small": {},
}
# AMD CDNA (64 KiB LDS): BLOCK_D -> (BLOCK_M, BLOCK_N, num_warps, num_stages, waves_per_eu)
# (8 warps: with 4, the all-features variant spilled 10-170 VGPRs in the portability check)
_FWD_AMD = {16: (128, 64, 8, 2, 2), 32: (128, 64, 8, 2, 2), 64: (128, 64, 8, 2, 2), 128: (128, 32, 8, 2, 2),
            256: (64, 32, 4, 1, 1)}
_BWD_AMD = {16: ((32, 64), (64, 32), 4, 1, 1), 32: ((32, 64), (64, 32), 4, 1, 1), 64: ((32, 64), (64, 32), 4, 1, 1),
            128: ((32, 64), (64, 32), 4, 1, 1), 256: ((16, 32), (32, 16), 4, 1, 1)}

_INTERPRETER = KernelConfig(32, 32, 4, 1)


def _shrink(m: int, n: int, stages: int, elem_size: int, block_d: int) -> tuple[int, int, int]:
    """float32 tiles are twice the bytes: halve both sides of large tiles, else the larger side
    (not below 16), and pipeline one stage less (fp32 D256 on sm_90 spilled 9.5 KB at 2 stages).
    At D 256 the larger side is halved once more: the float32 scores' float64 operands
    (kernels._scores) made the sm_80 forward's M64 N32 tiles 172 KB of shared memory."""
    def halve_larger(m, n):
        if m >= n and m > 16:
            return m // 2, n
        return m, (n // 2 if n > 16 else n)

    if elem_size <= 2:
        return m, n, stages
    m, n = (m // 2, n // 2) if m >= 64 and n >= 64 else halve_larger(m, n)
    if block_d >= 256:
        m, n = halve_larger(m, n)
    return m, n, max(1, stages - 1)


@functools.lru_cache(maxsize=256)
def forward_config(target: Target, block_d: int, elem_size: int) -> KernelConfig:
    """Config of the forward kernel for head-dim block ``block_d`` (max of D and Dv, padded)."""
    if target.vendor == "cpu":
        return _INTERPRETER
    if target.vendor == "amd":
        m, n, w, s, wpe = _FWD_AMD[block_d]
        m, n, s = _shrink(m, n, s, elem_size, block_d)
        return KernelConfig(m, n, w, s, waves_per_eu=wpe, matrix_instr_nonkdim=16, kpack=1)
    family = _nvidia_family(int(target.arch))
    hopper = int(target.arch) >= 90 and elem_size <= 2   # TMA / warp specialisation: sm_90+, 16-bit only
    row = _FWD_NVIDIA[family][block_d]
    if not hopper and len(row) > 4:   # a TMA row: float32 (and sm_8x) keep the pointer row
        row = _plain_row("fwd", family, block_d, row)
    m, n, w, s, *flags = row
    m, n, s = _shrink(m, n, s, elem_size, block_d)
    tma, ws = (tuple(flags) + (False, False))[:2]
    return KernelConfig(m, n, w, s, tma=bool(tma) and hopper, ws=bool(ws) and hopper)


@functools.lru_cache(maxsize=256)
def backward_configs(target: Target, block_d: int, elem_size: int) -> BackwardConfigs:
    """Configs of the two backward kernels (dK/dV; delta + dQ)."""
    if target.vendor == "cpu":
        return BackwardConfigs(_INTERPRETER, _INTERPRETER, KernelConfig(32, 16, 4, 1))
    if target.vendor == "amd":
        (m1, n1), (m2, n2), w, s, wpe = _BWD_AMD[block_d]
        amd = dict(waves_per_eu=wpe, matrix_instr_nonkdim=16, kpack=1)
        w1 = w2 = w
        s1 = s2 = s
        split = False
    else:
        family = _nvidia_family(int(target.arch))
        dkdv, dq = _BWD_NVIDIA[family][block_d]
        split = len(dkdv) > 4 and bool(dkdv[4]) and elem_size <= 2
        if len(dkdv) > 4 and not split:   # a split row: float32 keeps the fused row it replaced
            dkdv = _plain_row("dkdv", family, block_d, dkdv)
        (m1, n1, w1, s1), (m2, n2, w2, s2) = dkdv[:4], dq
        amd = {}
    m1, n1, s1 = _shrink(m1, n1, s1, elem_size, block_d)
    m2, n2, s2 = _shrink(m2, n2, s2, elem_size, block_d)
    atomic, by_default = None, False
    if target.vendor == "nvidia" and elem_size <= 2:   # the atomic path is 16-bit only (ops.backward)
        family = _nvidia_family(int(target.arch))
        row = _BWD_ATOMIC_NVIDIA[family].get(block_d)
        if row is not None:
            atomic = KernelConfig(*row[:4], split=len(row) > 4 and bool(row[4]))
            by_default = block_d in _BWD_ATOMIC_BY_DEFAULT[family]
    return BackwardConfigs(KernelConfig(m1, n1, w1, s1, split=split, **amd), KernelConfig(m2, n2, w2, s2, **amd),
                           atomic=atomic, atomic_by_default=by_default)


def atomic_dkdv_config(target: Target, block_d: int, elem_size: int) -> KernelConfig:
    """The dK/dV config that atomic dQ runs with on ``target``: the table's atomic row, or, where
    the table has none (atomic dQ is off there), its dK/dV row, which the portability check
    compiles with ``DQ_ATOMIC`` so that turning a row on is known to compile."""
    bwd = backward_configs(target, block_d, elem_size)
    return bwd.atomic or bwd.dkdv


#: Targets the portability check compiles for, with their shared memory (LDS) limit in bytes.
PORTABILITY_TARGETS = (
    (Target("nvidia", 80), 166912),   # A100: 164 KiB, 163 KiB usable per block
    (Target("nvidia", 90), 232448),   # H100/H200: 227 KiB per block
    (Target("amd", "gfx90a"), 65536),  # MI200: 64 KiB LDS
    (Target("amd", "gfx942"), 65536),  # MI300: 64 KiB LDS
)

#: Element sizes of the supported dtypes (fp16 and bf16 share the 2-byte tables).
ELEM_SIZES = {torch.float16: 2, torch.bfloat16: 2, torch.float32: 4}


# ----- decode (split-KV) kernels: backends/triton/decode.py ------------------------------------
# BLOCK_D -> (BLOCK_N, num_warps, num_stages) for 2-byte inputs and a packed query tile of at
# most 32 rows (GQA group x Sq); 64 rows take 8 warps and one stage less (sm_90 D128 bf16:
# M64 w4 s3 needed 254 registers, w8 218; M128 spilled even at BLOCK_N 32, so tiles stop at 64). Decode is bound by
# the K/V bytes: 16-byte loads (a D 128 bf16 row is 16 lanes x 16 B), BLOCK_N 64-128 keys per
# iteration and 3-4 stages keep >= 64 KB in flight per program (PERF_NOTES §7). Not yet measured
# on a GPU: benchmarks/bench_decode.py --sweep times the alternatives.
_DECODE_NVIDIA = {
    # hopper D128: tools/decode_sweep.py on the H200, 2026-12-01 (948 trials, bf16 GQA 32:4): N64 w4 s3
    # has the best geometric mean over the Sq 1 points (0.989 of each point's best; s4 0.956)
    "hopper": {16: (128, 4, 3), 32: (128, 4, 3), 64: (128, 4, 3), 128: (64, 4, 3), 256: (32, 4, 3)},
    "ampere": {16: (128, 4, 3), 32: (128, 4, 3), 64: (128, 4, 3), 128: (64, 4, 3), 256: (32, 4, 2)},
    "small":  {16: (64, 4, 2), 32: (64, 4, 2), 64: (64, 4, 2), 128: (32, 4, 2), 256: (16, 4, 2)},
}
# Packed tiles of 64 rows (Sq 8 at GQA 8, ...) on NVIDIA: BLOCK_D -> (BLOCK_M cap, BLOCK_N, num_warps,
# num_stages), replacing the rule above (8 warps, BLOCK_N <= 64, one stage less) where an entry exists.
# A cap of 32 splits the rows into two programs that each read the K/V tiles (the second read
# mostly from L2) but run two per SM. tools/decode_sweep.py prints the rows to paste here.
# hopper D128: the H200 sweep of 2026-12-01 (bench_decode --sweep, B8 Sq8 Sk32k, 4 splits, bf16) read
# M64 N64 w4 s3 3.55 TB/s against the rule's w8 s3 2.61 (w8 s3 with 8 splits 2.90; N32 w8 s4 2.06;
# N128 w8 s2 2.14): 4 warps, 254 registers, no spill (sm_90 D128 bf16); tools/decode_sweep.py
# (2026-12-01, the Sq 8 points, contiguous and paged): s4 geomean 0.802 of each point's best, s3 0.787.
_DECODE_WIDE_NVIDIA: dict = {"hopper": {128: (64, 64, 4, 4)}, "ampere": {}, "small": {}}
# AMD CDNA (64 KiB LDS; the stream pipeliner: num_stages <= 2): (BLOCK_N, num_warps, num_stages, waves_per_eu)
_DECODE_AMD = {16: (64, 4, 2, 2), 32: (64, 4, 2, 2), 64: (64, 4, 2, 2), 128: (32, 4, 2, 2), 256: (16, 4, 1, 1)}
#: resident decode programs per SM / CU the split heuristic plans for
_DECODE_PROGRAMS_PER_SM = {"nvidia": 2, "amd": 2, "cpu": 2}
#: the packed query-tile heights the decode kernel uses (powers of two, >= 16 for tl.dot)
DECODE_BLOCK_MS = (16, 32, 64)


@dataclass(frozen=True)
class DecodeConfig(KernelConfig):
    """A decode tile with the decode kernel's own knobs (tools/decode_sweep.py's variants, and the
    rows of :data:`_DECODE_ROWS_NVIDIA`):

    * ``programs_per_sm``: the resident programs per SM the split heuristic
      (``decode.num_splits_for``) plans for (0: :func:`decode_programs_per_sm`);
    * ``page_ids``: with a paged cache whose pages do not hold whole tiles, the key loop carries
      the next tile's int32 page ids instead of its int64 K and V row offsets
      (``decode.PAGE_FIT_IDS``): fewer loop-carried registers, the offsets computed per tile;
    * ``page_direct``: with a paged cache, each tile's page ids are loaded in the iteration that
      reads it, no carry (``decode.PAGE_FIT_DIRECT``: the pipeliner prefetches them itself)."""

    programs_per_sm: int = 0
    page_ids: bool = False
    page_direct: bool = False

    def short(self) -> str:
        return (super().short() + (f" p{self.programs_per_sm}" if self.programs_per_sm else "")
                + " ids" * self.page_ids + " direct" * self.page_direct)


# Rows with the decode knobs on NVIDIA, 2-byte inputs: (BLOCK_D, tile height class, cache layout)
# -> (BLOCK_M cap, BLOCK_N, num_warps, num_stages, programs_per_sm, page_ids, page_direct), replacing the rows
# above where an entry exists; height class "wide" (64-row tiles: Sq 8 at GQA 8) or "narrow"
# (<= 32 rows), layout "contig" or "paged" (every page size). Picked by tools/decode_variants.py
# on the H200 (2026-12-01, bf16 GQA 32:4 D128, Sq 1/8 x B 1/8 x Sk 4k/32k/128k, contiguous and
# paged 16/256; benchmarks/results/decode-variants-h200.txt): paged 64-row tiles with the page ids
# loaded in the tile's own iteration, 6 stages and two programs per SM (M64 N64 w4: 112 KB of
# shared memory, 186 registers) against the rule's row: paged 16 at Sq 8 0.84-0.92 of the
# contiguous cache (was 0.54-0.86), paged 256 0.87-0.98. No narrow (Sq 1) or contiguous variant
# beat the rule's rows by more than 2 %.
_DECODE_ROWS_NVIDIA: dict = {"hopper": {(128, "wide", "paged"): (64, 64, 4, 6, 2, False, True)},
                             "ampere": {}, "small": {}}


def decode_config(target: Target, block_d: int, elem_size: int, block_m: int, paged: bool = False) -> KernelConfig:
    """Config of the split-KV decode kernel for a packed (GQA x Sq) tile of ``block_m`` rows.

    The returned ``block_m`` may be smaller (more row blocks, K/V read once per block): at most
    64 rows, 32 at D 256, and 16 for float32 (whose scores are float64 dots, kernels._scores) —
    the portability check found spills beyond these (sm_90 fp16 D256 M64: 48 B; sm_80 fp32 D64
    M32 N64: 5 KB; fp32 D256 M64: 328 B) and AMD LDS overflows (fp32 D256 M64: 128 KB). A
    :data:`_DECODE_ROWS_NVIDIA` row for the tile height and the layout (``paged``: a paged cache)
    replaces the rule where one exists (a :class:`DecodeConfig`)."""
    cap = 32 if block_d >= 256 else 64
    if elem_size > 2:
        cap = 16
    block_m = min(block_m, cap)
    if target.vendor == "cpu":
        return KernelConfig(block_m, 16, 4, 1)   # small tiles: CPU tests then split the keys too
    if target.vendor == "amd":
        n, w, s, wpe = _DECODE_AMD[block_d]
        amd = dict(waves_per_eu=wpe, matrix_instr_nonkdim=16, kpack=1)
    else:
        family = _nvidia_family(int(target.arch))
        n, w, s = _DECODE_NVIDIA[family][block_d]
        amd = {}
        row = _DECODE_ROWS_NVIDIA[family].get((block_d, "wide" if block_m >= 64 else "narrow",
                                               "paged" if paged else "contig")) if elem_size <= 2 else None
        if row is not None:
            cap, n, w, s, per_sm, ids, direct = row
            return DecodeConfig(min(block_m, cap), n, w, s, programs_per_sm=per_sm, page_ids=bool(ids),
                                page_direct=bool(direct))
        wide = _DECODE_WIDE_NVIDIA[family].get(block_d) if block_m >= 64 and elem_size <= 2 else None
        if wide is not None:
            cap, n, w, s = wide
            return KernelConfig(min(block_m, cap), n, w, s)
    if block_m >= 64:
        w, n, s = 8, min(n, 64), max(2 if target.vendor == "nvidia" else 1, s - 1)
    if elem_size > 2:
        n, s = max(16, n // 2), max(1, s - 1)
        if block_d >= 256 and target.vendor == "nvidia":
            w = 8   # sm_80 fp32 D256 M16 N16 spilled 56 B with 4 warps (gfx942: 22 VGPRs with 8)
    return KernelConfig(block_m, n, w, s, **amd)


def decode_programs_per_sm(target: Target, block_m: int = 16) -> int:
    """Decode programs resident per SM / CU that the split heuristic plans for: 2 for tiles of
    up to 32 rows (sm_90 D128 bf16 M16: 104 KB shared memory, 160 registers x 128 threads), 1
    for 64 rows (8 warps x 196 registers)."""
    per = _DECODE_PROGRAMS_PER_SM.get(target.vendor, 1)
    return per if block_m < 64 or target.vendor == "cpu" else 1
