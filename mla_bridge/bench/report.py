"""Output: the environment, machine peaks, the rich tables, the JSON file and the PNG plot."""

from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import subprocess
from typing import Any, Iterable, Optional

import torch

from .common import SECTION_TITLES, SECTIONS, Check, Ctx, Row

__all__ = ["environment", "measure_peaks", "render", "write_json", "write_plot"]


def _version(dist: str) -> Optional[str]:
    try:
        from importlib.metadata import PackageNotFoundError, version
        try:
            return version(dist)
        except PackageNotFoundError:
            return None
    except Exception:  # noqa: BLE001
        return None


def _driver_version() -> Optional[str]:
    try:
        with open("/proc/driver/nvidia/version", encoding="utf-8") as f:
            for word in f.readline().split():
                if word[:1].isdigit() and "." in word:
                    return word
    except OSError:
        pass
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=10)
        if out.returncode == 0 and out.stdout.strip():
            return out.stdout.strip().splitlines()[0]
    except Exception:  # noqa: BLE001
        pass
    return None


def environment(ctx: Ctx) -> dict:
    """Everything needed to read the figures later: GPU, driver, torch, CUDA, FlashInfer, date."""
    from .. import __version__

    env: dict[str, Any] = {
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "device": str(ctx.device),
        "gpu": None, "gpu_capability": None, "gpu_memory_gib": None, "sm_count": None,
        "driver": None,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cudnn": None,
        "flashinfer": _version("flashinfer-python"),
        "jax": _version("jax"),
        "numpy": _version("numpy"),
        "mla_bridge": __version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "dtype": str(ctx.dtype).replace("torch.", ""),
        "mode": "quick" if ctx.quick else "full",
    }
    if ctx.cuda:
        props = torch.cuda.get_device_properties(ctx.device)
        env.update(gpu=props.name, gpu_capability=f"{props.major}.{props.minor}",
                   gpu_memory_gib=round(props.total_memory / 1024 ** 3, 1), sm_count=props.multi_processor_count,
                   driver=_driver_version())
        try:
            env["cudnn"] = torch.backends.cudnn.version()
        except Exception:  # noqa: BLE001
            pass
    return env


def measure_peaks(ctx: Ctx) -> list[Row]:
    """The machine's bf16 matmul peak (a large ``torch.matmul``) and device copy bandwidth, in this run."""
    n = 8192 if ctx.cuda and not ctx.quick else (1024 if ctx.cuda else 512)
    copy_elems = (16 if ctx.quick or not ctx.cuda else 512) * 1024 * 1024  # bytes = elems x 2 (bf16) or x 4
    g = ctx.generator(7)
    rows = []
    try:
        a, b = ctx.randn(n, n, gen=g), ctx.randn(n, n, gen=g)
        t = ctx.time(lambda: torch.matmul(a, b), repeats=max(10, ctx.repeats), warmup=max(3, ctx.warmup))
        flops = 2.0 * n ** 3
        ctx.peaks["matmul_tflops"] = flops / (t.ms * 1e-3) / 1e12
        row = ctx.row("peak", f"torch.matmul {n}^3 {str(ctx.dtype).replace('torch.', '')}", "matmul peak", t,
                      flops=flops, order=(-1, 0, 0), note="the TFLOP/s rows' 100%")
        rows.append(row)
    except Exception as err:  # noqa: BLE001
        ctx.recover()
        rows.append(ctx.skipped("peak", f"torch.matmul {n}^3", "matmul peak", "failed", err, order=(-1, 0, 0)))
    try:
        src = torch.empty(copy_elems, dtype=ctx.dtype, device=ctx.device).fill_(1)
        dst = torch.empty_like(src)
        nbytes = 2.0 * src.numel() * src.element_size()  # read + write
        t = ctx.time(lambda: dst.copy_(src), repeats=max(10, ctx.repeats), warmup=max(3, ctx.warmup))
        ctx.peaks["copy_gbps"] = nbytes / (t.ms * 1e-3) / 1e9
        row = ctx.row("peak", f"device copy {src.numel() * src.element_size() / 1024 ** 2:.0f} MiB", "copy bandwidth",
                      t, nbytes=nbytes, order=(-1, 1, 0), note="read + write; the GB/s rows' 100%")
        rows.append(row)
    except Exception as err:  # noqa: BLE001
        ctx.recover()
        rows.append(ctx.skipped("peak", "device copy", "copy bandwidth", "failed", err, order=(-1, 1, 0)))
    return rows


def _fmt(x: Optional[float], spec: str) -> str:
    return "" if x is None else format(x, spec)


def _num(x: Optional[float]) -> str:
    """1 decimal from 10 up, 3 significant digits below (CPU figures are tiny)."""
    if x is None:
        return ""
    return f"{x:.1f}" if abs(x) >= 10 else f"{x:.3g}"


def sort_rows(rows: Iterable[Row]) -> list[Row]:
    return sorted(rows, key=lambda r: r.order)


def render(console: Any, rows: list[Row], checks: list[Check], env: dict, peaks: dict) -> None:
    """One rich table per section, then the targets."""
    from rich.markup import escape
    from rich.table import Table

    head = f"{env.get('gpu') or 'CPU'} · torch {env['torch']} · CUDA {env.get('cuda')} · FlashInfer " \
           f"{env.get('flashinfer')} · {env['dtype']} · {env['mode']} mode · {env['date']}"
    console.print(head)
    by_section: dict[str, list[Row]] = {}
    for r in sort_rows(rows):
        by_section.setdefault(r.section, []).append(r)
    for section in ("peak",) + SECTIONS:
        srows = by_section.get(section)
        if not srows:
            continue
        table = Table(title=SECTION_TITLES.get(section, section), title_justify="left", show_lines=False,
                      expand=False)
        for col, just in (("case", "left"), ("path", "left"), ("ms", "right"), ("host ms", "right"),
                          ("TFLOP/s", "right"), ("GB/s", "right"), ("% peak", "right"), ("note", "left")):
            table.add_column(col, justify=just, overflow="fold")
        last_case = None
        for r in srows:
            case = r.case if r.case != last_case else ""
            last_case = r.case
            if r.status != "ok":
                note = r.note[len("skipped:"):].strip() if r.note.lower().startswith("skipped:") else r.note
                table.add_row(escape(case), escape(r.path), "", "", "", "", "", f"[yellow]skipped[/]: {escape(note)}")
                continue
            pct = "" if r.fraction is None else f"{100 * r.fraction:.0f}%"
            table.add_row(escape(case), escape(r.path), _fmt(r.ms, ".3f"), _fmt(r.host_ms, ".3f"), _num(r.tflops),
                          _num(r.gbps), pct, escape(r.note))
        console.print(table)
    if checks:
        table = Table(title="Targets (issue 5; they apply on the H200 in full mode)", title_justify="left")
        for col in ("target", "value", "goal", "result"):
            table.add_column(col, overflow="fold")
        for c in checks:
            if c.passed is None:
                result = "[yellow]not measured[/]"
            elif c.passed:
                result = "[green]met[/]" if c.applies else "met (n/a here)"
            else:
                result = "[red]missed[/]" if c.applies else "missed (n/a here)"
            note = f" — {escape(c.note)}" if c.note else ""
            table.add_row(escape(c.name), "" if c.value is None else f"{c.value:.4g}", f"{c.op} {c.target:g}",
                          result + note)
        console.print(table)
    if peaks:
        console.print(f"Peaks measured in this run: matmul {_num(peaks.get('matmul_tflops'))} TFLOP/s, "
                      f"copy {_num(peaks.get('copy_gbps'))} GB/s")


def write_json(path: str, payload: dict) -> None:
    d = os.path.dirname(os.path.abspath(path))
    os.makedirs(d, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(payload, f, indent=1, default=str, allow_nan=False)
        f.write("\n")


def _series(rows: list[Row], section: str, key) -> dict:
    """{(path, group): [(seq_len, tflops), ...]} of the measured TFLOP/s rows of ``section``."""
    out: dict[tuple[str, str], list[tuple[float, float]]] = {}
    for r in rows:
        if r.section == section and r.status == "ok" and r.tflops and r.seq_len:
            label = key(r)
            if label:
                out.setdefault(label, []).append((r.seq_len, r.tflops))
    return {k: sorted(v) for k, v in out.items()}


def write_plot(path: str, rows: list[Row], peaks: dict, env: dict) -> None:
    """TFLOP/s against sequence length (key tokens in the batch) per path: main pass and full prefill. One colour
    per path, one marker / line style per group (heads and ragged for the main pass, chunk budget for prefill)."""
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    def main_key(r: Row) -> tuple[str, str]:
        return r.path, f"{r.heads}h" + (", ragged" if "mixed" in r.case else "")

    def ctx_key(r: Row) -> Optional[tuple[str, str]]:
        if r.path.startswith(("phase", "context pass", "sum")):
            return None
        return r.path, (r.case.split(", ", 1)[1] if ", " in r.case else "")

    panels = [("1. main pass (causal)", _series(rows, "main", main_key)),
              ("2. mla_prefill with cached context", _series(rows, "context", ctx_key))]
    cycle = plt.rcParams["axes.prop_cycle"].by_key().get("color", ["C0", "C1", "C2", "C3", "C4", "C5"])
    markers, styles = ["o", "s", "^", "D", "v", "P"], ["-", "--", ":", "-."]
    fig, axes = plt.subplots(1, 2, figsize=(15, 6))
    for ax, (title, series) in zip(axes, panels):
        paths = sorted({p for p, _ in series})
        groups = sorted({g for _, g in series})
        for (p, grp), pts in sorted(series.items()):
            xs, ys = zip(*pts)
            gi = groups.index(grp)
            ax.plot(xs, ys, color=cycle[paths.index(p) % len(cycle)], marker=markers[gi % len(markers)],
                    linestyle=styles[gi % len(styles)] if len(pts) > 1 else "none", label=f"{p} ({grp})")
        if peaks.get("matmul_tflops"):
            ax.axhline(peaks["matmul_tflops"], color="gray", linestyle="--", linewidth=1,
                       label=f"matmul peak {_num(peaks['matmul_tflops'])}")
        ax.set_xscale("log")
        ax.set_xlabel("sequence length: key tokens in the batch (sum of kv lengths)")
        ax.set_ylabel("TFLOP/s")
        ax.set_ylim(bottom=0)
        ax.set_title(title)
        ax.grid(True, which="both", alpha=0.3)
        if series:
            ax.legend(fontsize=7, loc="best")
        else:
            ax.text(0.5, 0.5, "no measured rows", ha="center", va="center", transform=ax.transAxes)
    fig.suptitle(f"mla_bridge bench · {env.get('gpu') or 'CPU'} · {env['dtype']} · {env['date']}")
    fig.tight_layout()
    d = os.path.dirname(os.path.abspath(path))
    os.makedirs(d, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
