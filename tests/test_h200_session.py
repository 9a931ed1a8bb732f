"""tools/h200_session.sh without a GPU: the refusals, the step order, the commands a plan runs
(DRY_RUN=1), the deadline and the packing into at most 8 files; tools/merge_shards.py on CPU reports."""

from __future__ import annotations

import fnmatch
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
from _scripts import load_script

from portattn.conformance.catalogue import build_catalogue, select_cases

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tools" / "h200_session.sh"
STEPS = ("catalogue tests warm atomicdiag kvcache properties fastest bench decode overhead gluon gluonbwd cupywgmma cupybwd "
         "cupyfwd sweep ncu").split()

pytestmark = pytest.mark.skipif(shutil.which("bash") is None or shutil.which("timeout") is None,
                                reason="needs bash and coreutils' timeout")


def session(tmp_path, *steps, dry=True, **env):
    """Run the script from the repository root with OUT and the work dir under tmp_path."""
    full = {**os.environ, "OUT": str(tmp_path / "out"), "WORK": str(tmp_path / "work"), "PY": sys.executable,
            "GPU_TAG": "h200", **env}   # the report names of an H200 unless a test asks otherwise
    full.pop("DRY_RUN", None)
    if dry:
        full["DRY_RUN"] = "1"
    return subprocess.run(["bash", str(SCRIPT), *steps], cwd=ROOT, env=full, capture_output=True, text=True,
                          timeout=120)


def commands(stdout: str) -> list[list[str]]:
    """The commands a dry run printed (`+ timeout LIMIT CMD... > LOG`), as argument lists."""
    out = []
    for line in stdout.splitlines():
        if line.startswith("+ timeout "):
            out.append(shlex.split(line[2:].split(" > ")[0])[1:])   # [LIMIT, CMD...]
    return out


def matching(patterns: list[str]) -> list[str]:
    """The catalogue ids each pattern selects (as `conformance run --cases`: a glob, or a substring), concatenated."""
    ids = [case.id for case in build_catalogue()]
    return [i for p in patterns for i in ids if (fnmatch.fnmatch(i, p) if any(ch in p for ch in "*?[") else p in i)]


def test_unknown_steps_are_refused_with_the_list_of_steps(tmp_path):
    p = session(tmp_path, "warm", "nosuchstep")
    assert p.returncode == 2
    assert "unknown step 'nosuchstep'" in p.stderr
    listed = p.stderr.split("steps:", 1)[1].split()
    assert all(step in listed for step in STEPS), p.stderr
    assert not (tmp_path / "out").exists() and p.stdout == ""   # refused before anything ran


@pytest.mark.parametrize("spec, why", [
    ("tests:nosuchgroup", "unknown test group 'nosuchgroup'"),
    ("par:fastest", "'fastest' times things"),
    ("gluon:x", "gluon takes no argument"),
    ("gluonbwd:x", "gluonbwd takes no argument"),
    ("sweep:nosuch", "unknown sweep 'nosuch'"),
    ("warm:d128", "warm takes head dims"),
])
def test_bad_arguments_are_refused(tmp_path, spec, why):
    p = session(tmp_path, "warm", spec)
    assert p.returncode == 2 and why in p.stderr, p.stderr


def test_steps_run_in_the_order_given(tmp_path):
    p = session(tmp_path, "overhead", "warm:128", "gluon", "decode", "cupywgmma")
    assert p.returncode == 0, p.stderr
    heads = re.findall(r"^== \[(\d)\] (\S+):", p.stdout, re.M)
    assert heads == [("1", "overhead"), ("2", "warm:128"), ("3", "gluon"), ("4", "decode"), ("5", "cupywgmma")]
    scripts = [next(w for w in c if w.endswith(".py") or w == "portattn.cli") for c in commands(p.stdout)]
    assert scripts == ["benchmarks/overhead.py", "tools/gpu_launcher_check.py", "tools/warm_caches.py",
                       "tools/triton_gluon_check.py", "benchmarks/bench_decode.py", "tools/cupy_wgmma_check.py"]
    final = p.stdout.split("=" * 20 + " h200_session.sh", 1)[1].splitlines()
    assert [line.split()[1] for line in final[1:6]] == ["overhead", "warm:128", "gluon", "decode", "cupywgmma"]


def test_dry_gluonbwd_runs_the_backward_check_inside_its_limit(tmp_path):
    """The gluonbwd step: tools/triton_gluon_bwd_check.py with its own limit (GLUONBWD_LIMIT, 260 s
    by default), its files into the step's folder, a --time-limit 20 s inside it, GLUONBWD_ARGS passed."""
    p = session(tmp_path, "gluonbwd", GLUONBWD_ARGS="--quick")
    assert p.returncode == 0, p.stderr
    assert re.findall(r"^== \[(\d)\] (\S+):", p.stdout, re.M) == [("1", "gluonbwd")]
    (cmd,) = commands(p.stdout)
    assert cmd[0] == "260" and cmd[1:3] == [sys.executable, "tools/triton_gluon_bwd_check.py"], cmd
    assert "--quick" in cmd
    out = cmd[cmd.index("--out") + 1]
    assert out.endswith("gluonbwd") or "gluonbwd" in Path(out).name, out
    assert cmd[cmd.index("--time-limit") + 1] == "240", cmd
    p = session(tmp_path, "gluonbwd", GLUONBWD_LIMIT="90")
    (cmd,) = commands(p.stdout)
    assert cmd[0] == "90" and cmd[cmd.index("--time-limit") + 1] == "70" and "--quick" not in cmd, cmd


def test_dry_catalogue_then_fastest(tmp_path):
    p = session(tmp_path, "catalogue", "fastest")
    assert p.returncode == 0, p.stderr
    cmds = commands(p.stdout)
    shards = [c for c in cmds if c[1:5] == [sys.executable, "-m", "portattn.cli", "conformance"]]
    assert len(shards) == 9 + 3 + 3   # triton, cupy, then reference, sdpa, onnx one process each
    by_backend: dict[str, list[str]] = {}
    for c in shards:
        assert c[0] == "480" and c[5:10] == ["run", "--devices", "cuda", "--no-progress", "--backends"], c
        assert c[-2] == "--out" and c[-1].endswith(".json")
        backend, cases = c[10], c[c.index("--cases") + 1:-2] if "--cases" in c else None
        by_backend.setdefault(backend, []).extend(cases or ["*"])
    catalogue = sorted(case.id for case in build_catalogue())
    for backend in ("triton", "cupy"):   # the shards' exact globs: every case once
        ran = matching(by_backend[backend])
        assert sorted(ran) == catalogue, backend
    assert by_backend["reference"] == by_backend["sdpa"] == by_backend["onnx"] == ["*"]
    assert "tools/merge_shards.py" in p.stdout
    fastest = cmds[-1]
    assert cmds.index(fastest) > cmds.index(shards[-1])
    assert fastest[0] == "480" and fastest[1:3] == [sys.executable, "benchmarks/bench_fastest.py"]
    assert fastest[3:] == ["--full", "--out", str(tmp_path / "work" / "02-fastest"), "--tag", "h200", "--time-limit", "440"]


def test_dry_fastest_halves_take_one_part_each(tmp_path):
    for part in ("inference", "training"):
        p = session(tmp_path / part, f"fastest:{part}")
        assert p.returncode == 0, p.stderr
        (cmd,) = [c for c in commands(p.stdout) if c[1:3] == [sys.executable, "benchmarks/bench_fastest.py"]]
        assert cmd[3:6] == ["--full", "--part", part] and cmd[cmd.index("--tag") + 1] == f"h200-{part}"


def test_dry_catalogue_with_prev_runs_what_prev_lacks(tmp_path):
    have = [c.id for c in build_catalogue()][:-5]
    prev = tmp_path / "prev.json"
    prev.write_text(json.dumps({"results": [{"case": c, "backend": "triton", "seconds": 1.0} for c in have]}))
    p = session(tmp_path, "catalogue:triton", PREV=str(prev))
    assert p.returncode == 0, p.stderr
    cases = [w for c in commands(p.stdout) for w in c[c.index("--cases") + 1:-2]]
    ran = matching(cases)
    assert sorted(ran) == sorted(c.id for c in build_catalogue()[-5:])
    assert f"--prev {prev}" in p.stdout


def test_dry_catalogue_rerun_runs_every_case_again_on_top_of_prev(tmp_path):
    """RERUN=1 with PREV: the backend's whole selection runs again (planned from PREV's seconds),
    merged on top of PREV (whose other backends' results stay)."""
    have = [c.id for c in build_catalogue()][:-5]
    prev = tmp_path / "prev.json"
    prev.write_text(json.dumps({"results": [{"case": c, "backend": "cupy", "seconds": 1.0} for c in have]}))
    p = session(tmp_path, "catalogue:cupy", PREV=str(prev), TIMES=str(prev), RERUN="1")
    assert p.returncode == 0, p.stderr
    cases = [w for c in commands(p.stdout) for w in c[c.index("--cases") + 1:-2]]
    assert sorted(set(matching(cases))) == sorted(c.id for c in build_catalogue())
    assert f"--prev {prev}" in p.stdout


def test_fastest_cells_quick_and_the_test_groups(tmp_path):
    p = session(tmp_path, "fastest:D128 S1k fwd,D256 S16k fwd+bwd", "fastest:quick", "par:tests:atomic,cupy",
                "par:warm", FASTEST_LIMIT="100")
    assert p.returncode == 0, p.stderr
    cmds = commands(p.stdout)
    assert cmds[0][0] == "100" and cmds[0][3:7] == ["--cells", "D128 S1k fwd", "D256 S16k fwd+bwd", "--out"]
    assert cmds[0][cmds[0].index("--tag") + 1] == "h200-cells" and cmds[0][-1] == "60"
    assert "--quick" in cmds[1]
    atomic, cupy = cmds[2], cmds[3]
    assert atomic[atomic.index("-n") + 1] == "0" and atomic[-1] == "tests/test_triton_atomic_dq.py"
    assert {"tests/test_cupy.py", "tests/test_cupy_wgmma.py", "tests/test_cupy_wgmma_layout.py"} <= set(cupy)
    assert [c[-3] for c in cmds[4:]] == ["64", "128", "256"] and len(cmds) == 7   # warm: one per head dim


def test_past_the_deadline_steps_are_skipped_and_still_packed(tmp_path):
    p = session(tmp_path, "warm", "fastest", DEADLINE_S="0")
    assert p.returncode == 0, p.stderr
    assert commands(p.stdout) == []
    assert re.search(r"^\[1\] warm .*skipped", p.stdout, re.M) and re.search(r"^\[2\] fastest .*skipped", p.stdout, re.M)
    assert (tmp_path / "out" / "results.tgz").exists()


def test_packing_leaves_at_most_8_files_and_the_summary_last(tmp_path):
    p = session(tmp_path, "par:tests:gluon", "par:atomicdiag", "fastest", "bench")
    assert p.returncode == 0, p.stderr
    files = sorted(f.name for f in (tmp_path / "out").rglob("*") if f.is_file())
    assert files == ["env.txt", "results.tgz", "summary.txt"]
    with tarfile.open(tmp_path / "out" / "results.tgz") as tar:
        names = tar.getnames()
    assert {"./summary.txt", "./env.txt", "./steps/03-fastest.out"} <= set(names)
    tail = p.stdout.strip().splitlines()[-6:]   # the summary of the whole call ends the output
    assert tail[0].startswith("=" * 20 + " h200_session.sh par:tests:gluon par:atomicdiag fastest bench")
    assert [line.split()[0] for line in tail[1:5]] == ["[1]", "[2]", "[3]", "[4]"]
    assert tail[1] in (tmp_path / "out" / "summary.txt").read_text()


def test_a_real_run_reports_a_failing_step_and_goes_on(tmp_path):
    """Not dry, with a stand-in for python: a step whose tool fails is reported with its status,
    one that outruns its limit is stopped (124), the next steps still run, the packing is real."""
    fake = tmp_path / "fakepy"
    fake.write_text('#!/bin/sh\ncase "$1" in\n  -m) echo "portattn info";;\n  tools/cupy_fwd_check.py) echo broken; exit 3;;\n'
                    '  *) exec sleep 30;;\nesac\n')
    fake.chmod(0o755)
    p = session(tmp_path, "cupyfwd", "cupywgmma", "cupyfwd", dry=False, PY=str(fake), CUPYWGMMA_LIMIT="1")
    assert p.returncode == 0, p.stderr
    assert re.search(r"^\[1\] cupyfwd +rc=3 ", p.stdout, re.M), p.stdout
    assert re.search(r"^\[2\] cupywgmma +rc=124 ", p.stdout, re.M), p.stdout   # stopped at its 1 s limit
    assert re.search(r"^\[3\] cupyfwd +rc=3 ", p.stdout, re.M), p.stdout
    assert "== [2] cupywgmma: rc=124 (stopped at its limit)" in p.stdout
    assert (tmp_path / "work" / "01-cupyfwd" / "cupy_fwd_check.log").read_text() == "broken\n"
    assert "portattn info" in (tmp_path / "out" / "env.txt").read_text()
    assert sorted(f.name for f in (tmp_path / "out").rglob("*") if f.is_file()) == ["env.txt", "results.tgz", "summary.txt"]


# ----- tools/merge_shards.py ------------------------------------------------------------------

def _shard(directory: Path, name: str, backend: str, patterns: list[str], *, write: bool = True):
    from portattn.conformance.runner import run_cases, write_report
    (directory / f"{name}.sel").write_text("\n".join([backend, *patterns]) + "\n")
    if write:
        report = run_cases(select_cases(patterns=patterns), [backend], ["cpu"], progress=False)
        write_report(report, str(directory / f"{name}.json"))


def test_merge_shards_drops_repeats_lists_lost_shards_and_completes_prev(tmp_path):
    merge_shards = load_script("merge_shards", "tools")
    small = [c.id for c in select_cases(patterns=["core/fp32/sq1-sk1/*"])][:3]
    assert len(small) == 3
    d = tmp_path / "shards"
    d.mkdir()
    _shard(d, "a", "reference", small[:2])
    _shard(d, "b", "reference", small[1:2])            # a repeat of a's second case
    _shard(d, "c", "reference", small[2:], write=False)  # stopped before its first case
    merged, notes = merge_shards.merge(str(d))
    assert sorted(r["case"] for r in merged["results"]) == sorted(small[:2])
    assert merged["not_run"] == [small[2]] and merged["interrupted"]
    assert any("no report" in n for n in notes) and any("dropped 1" in n for n in notes)
    out = tmp_path / "merged.json"
    assert merge_shards.main([str(d), "--out", str(out)]) == 1   # a case did not run

    d2 = tmp_path / "shards2"
    d2.mkdir()
    _shard(d2, "rest", "reference", small[2:])
    merged, _ = merge_shards.merge(str(d2), prev=str(out))
    assert sorted(r["case"] for r in merged["results"]) == sorted(small)
    assert "not_run" not in merged and "interrupted" not in merged
    assert merge_shards.main([str(d2), "--out", str(tmp_path / "full.json"), "--prev", str(out)]) == 0


def test_merge_shards_carries_an_older_catalogue_forward_only_when_its_cases_are_unchanged(tmp_path):
    """A PREV of an older catalogue version is relabelled (``carried_from`` records it) when every
    case it has is in the current catalogue with the same problem; a changed case refuses it."""
    from portattn.conformance.catalogue import CATALOGUE_VERSION
    merge_shards = load_script("merge_shards", "tools")
    small = [c.id for c in select_cases(patterns=["core/fp32/sq1-sk1/*"])][:2]
    d = tmp_path / "shards"
    d.mkdir()
    _shard(d, "old", "reference", small[:1])
    old = json.loads((d / "old.json").read_text())
    (d / "old.json").unlink()
    (d / "old.sel").unlink()
    old["catalogue_version"] = str(int(CATALOGUE_VERSION) - 1)
    prev = tmp_path / "prev.json"
    prev.write_text(json.dumps(old))
    _shard(d, "new", "reference", small[1:])
    merged, notes = merge_shards.merge(str(d), prev=str(prev))
    assert merged["catalogue_version"] == CATALOGUE_VERSION
    assert merged["carried_from"]["catalogue_version"] == old["catalogue_version"]
    assert sorted(r["case"] for r in merged["results"]) == sorted(small)
    assert any("carried" in n for n in notes)

    old["cases"][small[0]]["problem"]["seed"] += 1     # the older catalogue had other inputs there
    prev.write_text(json.dumps(old))
    with pytest.raises(ValueError, match="cannot be carried"):
        merge_shards.merge(str(d), prev=str(prev))
    assert merge_shards.main([str(d), "--out", str(tmp_path / "m.json"), "--prev", str(prev)]) == 2


def test_report_files_take_the_card_name(tmp_path):
    """GPU_TAG (or, unset, the card nvidia-smi names) names the merged catalogue, the KV-cache
    report and the fastest grid's files, so an H100 call does not write H200 reports."""
    p = session(tmp_path / "set", "catalogue:cupy", "kvcache", "fastest:training", GPU_TAG="h100")
    assert p.returncode == 0, p.stderr
    merge = [line for line in p.stdout.splitlines() if line.startswith("+ ") and "tools/merge_shards.py" in line]
    assert merge and all("/conformance-h100.json" in line and "conformance-h200" not in line for line in merge)
    # the shard plan takes the per-case seconds of the H200's report while the H100 has none
    assert "--seconds-from benchmarks/results/conformance-h200.json" in p.stdout
    assert "conformance-kvcache-h100.json" in p.stdout
    (cmd,) = [c for c in commands(p.stdout) if c[1:3] == [sys.executable, "benchmarks/bench_fastest.py"]]
    assert cmd[cmd.index("--tag") + 1] == "h100-training"
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "nvidia-smi").write_text("#!/bin/sh\necho 'NVIDIA H100 80GB HBM3'\n")
    (fake / "nvidia-smi").chmod(0o755)
    env = {"PATH": f"{fake}:{os.environ['PATH']}", "GPU_TAG": ""}
    p = session(tmp_path / "smi", "fastest", **env)
    assert p.returncode == 0, p.stderr
    (cmd,) = [c for c in commands(p.stdout) if c[1:3] == [sys.executable, "benchmarks/bench_fastest.py"]]
    assert cmd[cmd.index("--tag") + 1] == "h100"
    (fake / "nvidia-smi").write_text("#!/bin/sh\nexit 9\n")   # no card answers: the H200's names
    p = session(tmp_path / "none", "fastest", **env)
    (cmd,) = [c for c in commands(p.stdout) if c[1:3] == [sys.executable, "benchmarks/bench_fastest.py"]]
    assert cmd[cmd.index("--tag") + 1] == "h200"


def test_warm_caches_runs_every_length_it_is_given_and_defaults_to_the_grid(tmp_path):
    """tools/warm_caches.py, the `warm` step: forward, training forward and backward at each
    sequence length (the dispatch rows that pick a kernel key on the query rows, so a warm at one
    length left the benchmark's Gluon compiles to its timed run); by default the grid's lengths."""
    bench = load_script("bench_attention")
    tool = [sys.executable, str(ROOT / "tools" / "warm_caches.py")]
    p = subprocess.run(tool + ["--help"], capture_output=True, text=True, timeout=120)
    assert ",".join(map(str, bench.SEQLENS)) in " ".join(p.stdout.split()), p.stdout
    p = subprocess.run(tool + ["--d", "32", "--backends", "chunked,nonesuch", "--seqlens", "48,80", "--device", "cpu",
                               "--hidden", "64"], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    assert re.search(r"^warm D32 bf16: \d+s \(2 lengths\)$", p.stdout, re.M), p.stdout
    # a backend that cannot run is reported once (not once per length), and the others still run
    assert len(re.findall(r"^nonesuch D32 bf16 S48 causal=(False|True): ", p.stdout, re.M)) == 2, p.stdout
    assert not re.search(r"^chunked ", p.stdout, re.M), p.stdout
