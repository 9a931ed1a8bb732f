"""``conformance run``: every catalogue case x every backend x every device, into one report.

The report (JSON, see docs/conformance.md) records the machine (host, CPU, GPUs and driver),
library versions, the catalogue version, each backend's availability, and one entry per
case x backend x device: verdict (pass / fail / skip with reasons), the score
``max|out - ref| / max|naive - ref|``, every comparison's numbers (out, lse, gradients), what
could not be checked, the sha256 of the output bytes and the seconds it took.
"""

from __future__ import annotations

import datetime as _dt
import importlib.metadata
import json
import os
import platform
import shutil
import subprocess
import sys
import time

import torch

from ..registry import get_backend, list_backends
from .catalogue import CATALOGUE_VERSION, Case, select_cases
from .checker import Checker, Outcome

REPORT_FORMAT = "portattn-conformance-report"
REPORT_FORMAT_VERSION = 1
_PACKAGES = ("portattn", "torch", "triton", "pytorch-triton-rocm", "cupy-cuda12x", "cupy-cuda13x", "cupy-rocm-6-0",
             "onnx", "onnxruntime", "onnxruntime-gpu", "onnxscript", "numpy", "hypothesis")


# ----- environment ---------------------------------------------------------------------------

def available_devices() -> list[str]:
    devices = ["cpu"]
    if torch.cuda.is_available():
        devices.append("cuda")
    return devices


def _run_quiet(cmd: list[str]) -> str:
    if shutil.which(cmd[0]) is None:
        return ""
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=20).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def gpu_info() -> list[dict]:
    """Name, compute capability / arch, memory and driver of each visible GPU."""
    if not torch.cuda.is_available():
        return []
    driver = ""
    if torch.version.hip:
        out = _run_quiet(["rocm-smi", "--showdriverversion"])
        driver = next((ln.split(":")[-1].strip() for ln in out.splitlines() if "version" in ln.lower()), "")
    else:
        driver = _run_quiet(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"]).splitlines()[:1]
        driver = driver[0] if driver else ""
    gpus = []
    for i in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(i)
        gpus.append({
            "index": i, "name": props.name,
            "arch": getattr(props, "gcnArchName", None) or f"sm_{props.major}{props.minor}",
            "memory_gib": round(props.total_memory / 2**30, 1),
            "multiprocessors": props.multi_processor_count,
            "driver": driver,
        })
    return gpus


def environment() -> dict:
    versions = {}
    for pkg in _PACKAGES:
        try:
            versions[pkg] = importlib.metadata.version(pkg)
        except importlib.metadata.PackageNotFoundError:
            pass
    return {
        "host": platform.node(),
        "platform": platform.platform(),
        "cpu": _cpu_name(),
        "cpu_count": os.cpu_count(),
        "python": sys.version.split()[0],
        "torch_cuda": torch.version.cuda,
        "torch_hip": getattr(torch.version, "hip", None),
        "triton_interpret": os.environ.get("TRITON_INTERPRET", ""),
        "gpus": gpu_info(),
        "versions": versions,
    }


def backend_table(names: list[str]) -> dict:
    table = {}
    for name in names:
        try:
            b = get_backend(name)
            table[name] = {"available": b.available, "reasons": b.availability(),
                           "capabilities": b.capabilities()}
        except ValueError as exc:
            table[name] = {"available": False, "reasons": [str(exc)], "capabilities": {}}
    return table


# ----- progress ------------------------------------------------------------------------------

class _Progress:
    """A rich progress bar when rich is installed and stderr is a terminal; plain lines otherwise."""

    def __init__(self, total: int, enabled: bool = True):
        self.total, self.done, self.enabled = total, 0, enabled
        self._bar = None
        self._last_print = 0.0
        if enabled and sys.stderr.isatty():
            try:
                from rich.progress import (
                    BarColumn,
                    MofNCompleteColumn,
                    Progress,
                    TextColumn,
                    TimeElapsedColumn,
                    TimeRemainingColumn,
                )
                self._bar = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                                     TimeElapsedColumn(), TimeRemainingColumn(), transient=False)
                self._task = self._bar.add_task("conformance", total=total)
                self._bar.start()
            except ImportError:
                self._bar = None

    def advance(self, label: str, failures: int):
        self.done += 1
        if not self.enabled:
            return
        text = f"{label} ({failures} failed)" if failures else label
        if self._bar is not None:
            self._bar.update(self._task, advance=1, description=text[:60])
        else:
            now = time.monotonic()
            if now - self._last_print > 2.0 or self.done == self.total:
                print(f"[{self.done}/{self.total}] {text}", file=sys.stderr, flush=True)
                self._last_print = now

    def close(self):
        if self._bar is not None:
            self._bar.stop()


# ----- the run -------------------------------------------------------------------------------

def _large_skip(case: Case, device: str) -> list[str]:
    if case.tier == "large" and torch.device(device).type == "cpu":
        return ["large case: runs on GPU devices only (CPU sizes are capped for the Triton interpreter)"]
    return []


def run_cases(cases: list[Case], backends: list[str] | None = None, devices: list[str] | None = None, *,
              progress: bool = True, direct: bool = False) -> dict:
    """Run ``cases`` through ``backends`` on ``devices``; return the report dict.

    Interrupted (Ctrl-C, or SIGTERM from ``timeout`` when the CLI installed its handler), the
    report holds the cases that finished and ``"interrupted": true``: a time-boxed GPU run
    keeps what it measured."""
    backends = list(backends) if backends else list_backends()
    devices = list(devices) if devices else available_devices()
    started = time.time()
    results, failures, done, interrupted = [], 0, [], False
    bar = _Progress(len(cases) * len(devices), progress)
    try:
        for case in cases:
            case_results = []
            for device in devices:
                skip = _large_skip(case, device)
                checker = Checker(case.problem, device, direct=direct)
                for name in backends:
                    if skip:
                        outcome = Outcome(backend=name, device=str(torch.device(device)), verdict="skip", reasons=skip)
                    else:
                        outcome = checker.check(name)
                    failures += outcome.verdict == "fail"
                    case_results.append({"case": case.id, **outcome.to_dict()})
                bar.advance(case.id, failures)
            results += case_results        # whole cases only: all its devices and backends
            done.append(case)
    except KeyboardInterrupt:
        interrupted = True
    finally:
        bar.close()
    report = {
        "format": REPORT_FORMAT,
        "format_version": REPORT_FORMAT_VERSION,
        "catalogue_version": CATALOGUE_VERSION,
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "seconds": round(time.time() - started, 1),
        "command": " ".join(sys.argv),
        "environment": environment(),
        "devices": [str(torch.device(d)) for d in devices],
        "backends": backend_table(backends),
        "cases": {c.id: {"tier": c.tier, "quick": c.quick, "problem": c.problem.to_dict(),
                         "description": c.problem.describe()} for c in done},
        "results": results,
    }
    if interrupted:
        report["interrupted"] = True
        finished = {c.id for c in done}
        report["not_run"] = [c.id for c in cases if c.id not in finished]
    report["summary"] = summarize(report)
    return report


def summarize(report: dict) -> dict:
    """Per backend@device: counts of pass/fail/skip, worst score and worst lse error."""
    rows: dict[str, dict] = {}
    for r in report["results"]:
        key = f"{r['backend']}@{r['device']}"
        row = rows.setdefault(key, {"pass": 0, "fail": 0, "known": 0, "skip": 0, "worst_score": 0.0,
                                    "worst_lse_err": 0.0, "seconds": 0.0})
        row[r["verdict"]] += 1
        row["seconds"] = round(row["seconds"] + r["seconds"], 3)
        score = _num(r.get("score"))
        if score is not None and r["verdict"] in ("pass", "fail"):
            row["worst_score"] = max(row["worst_score"], score)
        lse = r["checks"].get("lse", {}).get("max_err")
        if _num(lse) is not None:
            row["worst_lse_err"] = max(row["worst_lse_err"], _num(lse))
    for row in rows.values():
        for key in ("worst_score", "worst_lse_err"):
            if row[key] == float("inf"):
                row[key] = "inf"
    failed = sum(row["fail"] for row in rows.values())
    return {"by_backend": rows, "failed": failed, "passed": sum(row["pass"] for row in rows.values()),
            "known": sum(row.get("known", 0) for row in rows.values()),
            "skipped": sum(row["skip"] for row in rows.values())}


def _num(x):
    if x is None:
        return None
    if isinstance(x, str):
        try:
            return float(x)
        except ValueError:
            return None
    return float(x)


def report_text(report: dict) -> str:
    """JSON with one case and one result per line (compact, and line-wise diffable in git)."""
    def line(obj) -> str:
        return json.dumps(obj, separators=(",", ":"), allow_nan=False)

    head = {k: v for k, v in report.items() if k not in ("cases", "results")}
    text = json.dumps(head, indent=1, allow_nan=False)
    cases = ",\n".join(f"  {json.dumps(cid)}:{line(c)}" for cid, c in report.get("cases", {}).items())
    results = ",\n".join(f"  {line(r)}" for r in report.get("results", []))
    return text[:-2] + f',\n "cases": {{\n{cases}\n }},\n "results": [\n{results}\n ]\n}}\n'


def write_report(report: dict, path: str) -> None:
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    with open(path, "w") as f:
        f.write(report_text(report))


def load_report(path: str) -> dict:
    with open(path) as f:
        report = json.load(f)
    if report.get("format") != REPORT_FORMAT:
        raise ValueError(f"{path} is not a portattn conformance report (format={report.get('format')!r})")
    return report


def merge_reports(reports: list[dict]) -> dict:
    """One report from shards of the same catalogue run side by side (e.g. one process per
    group of cases on one GPU). Cases, results, backends and devices are unioned; the same
    (case, backend, device) twice is an error; ``seconds`` is the longest shard's (they ran in
    parallel) and ``merged_from`` records each shard's command, time and size."""
    if not reports:
        raise ValueError("merge_reports needs at least one report")
    versions = {(r.get("format_version"), r.get("catalogue_version")) for r in reports}
    if len(versions) != 1:
        raise ValueError(f"cannot merge reports of different formats/catalogues: {sorted(versions, key=str)}")
    merged = {k: v for k, v in reports[0].items() if k not in ("cases", "results", "summary")}
    merged["cases"], merged["results"], merged["backends"], devices = {}, [], {}, []
    seen: set[tuple] = set()
    for r in reports:
        merged["cases"].update(r["cases"])
        merged["backends"].update(r.get("backends", {}))
        devices += [d for d in r.get("devices", []) if d not in devices]
        for res in r["results"]:
            key = (res["case"], res["backend"], res["device"])
            if key in seen:
                raise ValueError(f"case {key[0]} ran twice through {key[1]}@{key[2]}: shards overlap")
            seen.add(key)
            merged["results"].append(res)
    merged["devices"] = devices
    merged["seconds"] = max(r.get("seconds", 0.0) for r in reports)
    merged["command"] = f"merged from {len(reports)} shard(s) run side by side"
    merged["merged_from"] = [{"command": r.get("command"), "created": r.get("created"), "seconds": r.get("seconds"),
                              "cases": len(r["cases"]), "results": len(r["results"])} for r in reports]
    not_run = [c for r in reports for c in r.get("not_run", [])]
    if any(r.get("interrupted") for r in reports):
        merged["interrupted"], merged["not_run"] = True, not_run
    else:
        merged.pop("interrupted", None)
        merged.pop("not_run", None)
    merged["summary"] = summarize(merged)
    return merged


# ----- printing ------------------------------------------------------------------------------

def print_table(title: str, header: list[str], rows: list[list[str]], file=None) -> None:
    """A table through rich when installed, else aligned plain text."""
    file = file or sys.stdout
    try:
        from rich.console import Console
        from rich.table import Table
        table = Table(title=title)
        for h in header:
            table.add_column(h)
        for row in rows:
            table.add_row(*[str(x) for x in row])
        Console(file=file, width=max(100, shutil.get_terminal_size((140, 20)).columns)).print(table)
        return
    except ImportError:
        pass
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows)] if rows else [len(h) for h in header]
    print(title, file=file)
    print("  ".join(h.ljust(w) for h, w in zip(header, widths)), file=file)
    for row in rows:
        print("  ".join(str(x).ljust(w) for x, w in zip(row, widths)), file=file)


def print_summary(report: dict, file=None, max_failures: int = 40) -> None:
    file = file or sys.stdout
    rows = []
    for key, row in report["summary"]["by_backend"].items():
        score = row["worst_score"]
        lse = row["worst_lse_err"]
        rows.append([key, row["pass"], row["fail"], row.get("known", 0), row["skip"],
                     f"{score:.3g}" if isinstance(score, float) else score,
                     f"{lse:.2g}" if isinstance(lse, float) else lse, f"{row['seconds']:.1f}"])
    env = report["environment"]
    gpus = ", ".join(f"{g['name']} ({g['arch']}, driver {g['driver'] or '?'})" for g in env["gpus"]) or "none"
    print(f"portattn conformance — catalogue v{report['catalogue_version']}, {len(report['cases'])} cases, "
          f"devices {', '.join(report['devices'])}, GPUs: {gpus}", file=file)
    print_table("verdicts per backend (score = max|out-ref| / max|naive-ref|; pass needs out <= 2x naive + floor)",
                ["backend@device", "pass", "fail", "known", "skip", "worst score", "worst lse err", "seconds"],
                rows, file)
    unavailable = {n: b["reasons"] for n, b in report["backends"].items() if not b["available"]}
    for name, reasons in unavailable.items():
        print(f"  {name}: unavailable — {'; '.join(reasons)}", file=file)
    fails = [r for r in report["results"] if r["verdict"] == "fail"]
    for r in fails[:max_failures]:
        print(f"FAIL {r['case']} {r['backend']}@{r['device']}: {' | '.join(r['reasons'])[:400]}", file=file)
    if len(fails) > max_failures:
        print(f"... and {len(fails) - max_failures} more failures (see the JSON report)", file=file)
    known = [r for r in report["results"] if r["verdict"] == "known"]
    for r in known[:max_failures]:
        print(f"KNOWN {r['case']} {r['backend']}@{r['device']}: {' | '.join(r['reasons'][1:])[:300]}", file=file)
    s = report["summary"]
    print(f"{s['passed']} passed, {s['failed']} failed, {s.get('known', 0)} known limitation(s), "
          f"{s['skipped']} skipped in {report['seconds']}s", file=file)


def run_catalogue(*, quick: bool = False, patterns=None, backends=None, devices=None, progress=True,
                  direct=False) -> dict:
    return run_cases(select_cases(quick=quick, patterns=patterns), backends, devices, progress=progress,
                     direct=direct)


__all__ = ["run_cases", "run_catalogue", "merge_reports", "summarize", "write_report", "load_report", "print_summary",
           "print_table", "environment", "available_devices"]
