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

__all__ = [
    "environment",
    "measure_peaks",
    "render",
    "write_json",
    "write_plot",
    "plot_figure",
    "rows_from_payload",
    "plot_title",
]


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
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=10,
        )
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
        "gpu": None,
        "gpu_capability": None,
        "gpu_memory_gib": None,
        "sm_count": None,
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
        env.update(
            gpu=props.name,
            gpu_capability=f"{props.major}.{props.minor}",
            gpu_memory_gib=round(props.total_memory / 1024**3, 1),
            sm_count=props.multi_processor_count,
            driver=_driver_version(),
        )
        try:
            env["cudnn"] = torch.backends.cudnn.version()
        except Exception:  # noqa: BLE001
            pass
    return env


def measure_peaks(ctx: Ctx) -> list[Row]:
    """The machine's bf16 matmul peak (a large ``torch.matmul``) and device copy bandwidth, in this run."""
    n = 8192 if ctx.cuda and not ctx.quick else 1024  # 512^3 reads below a CPU's matmul peak
    copy_elems = (16 if ctx.quick or not ctx.cuda else 512) * 1024 * 1024  # bytes = elems x 2 (bf16) or x 4
    g = ctx.generator(7)
    rows = []
    try:
        a, b = ctx.randn(n, n, gen=g), ctx.randn(n, n, gen=g)
        t = ctx.time(lambda: torch.matmul(a, b), repeats=max(10, ctx.repeats), warmup=max(3, ctx.warmup))
        flops = 2.0 * n**3
        ctx.peaks["matmul_tflops"] = flops / (t.ms * 1e-3) / 1e12
        row = ctx.row(
            "peak",
            f"torch.matmul {n}^3 {str(ctx.dtype).replace('torch.', '')}",
            "matmul peak",
            t,
            flops=flops,
            order=(-1, 0, 0),
            note="the TFLOP/s rows' 100%",
        )
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
        row = ctx.row(
            "peak",
            f"device copy {src.numel() * src.element_size() / 1024**2:.0f} MiB",
            "copy bandwidth",
            t,
            nbytes=nbytes,
            order=(-1, 1, 0),
            note="read + write; the GB/s rows' 100%",
        )
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
    """One rich table per section, then the targets. Rows that cannot run on this machine (``Row.applies`` False:
    they need CUDA, FlashInfer or Triton) and targets that do not apply here (``Check.applies`` False: the targets
    are for a GPU in full mode) are counted in one line each, not listed; the JSON keeps them all."""
    from rich.markup import escape
    from rich.table import Table

    head = (
        f"{env.get('gpu') or 'CPU'} · torch {env['torch']} · CUDA {env.get('cuda')} · FlashInfer "
        f"{env.get('flashinfer')} · {env['dtype']} · {env['mode']} mode · {env['date']}"
    )
    console.print(head)
    by_section: dict[str, list[Row]] = {}
    for r in sort_rows(rows):
        if r.applies:
            by_section.setdefault(r.section, []).append(r)
    for section in ("peak",) + SECTIONS:
        srows = by_section.get(section)
        if not srows:
            continue
        table = Table(title=SECTION_TITLES.get(section, section), title_justify="left", show_lines=False, expand=False)
        for col, just in (
            ("case", "left"),
            ("path", "left"),
            ("ms", "right"),
            ("host ms", "right"),
            ("TFLOP/s", "right"),
            ("GB/s", "right"),
            ("% peak", "right"),
            ("note", "left"),
        ):
            table.add_column(col, justify="right" if just == "right" else "left", overflow="fold")
        last_case = None
        for r in srows:
            case = r.case if r.case != last_case else ""
            last_case = r.case
            if r.status != "ok":
                note = r.note[len("skipped:") :].strip() if r.note.lower().startswith("skipped:") else r.note
                table.add_row(escape(case), escape(r.path), "", "", "", "", "", f"[yellow]skipped[/]: {escape(note)}")
                continue
            pct = "" if r.fraction is None else f"{100 * r.fraction:.0f}%"
            table.add_row(
                escape(case),
                escape(r.path),
                _fmt(r.ms, ".3f"),
                _fmt(r.host_ms, ".3f"),
                _num(r.tflops),
                _num(r.gbps),
                pct,
                escape(r.note),
            )
        console.print(table)
    hidden = [r for r in rows if not r.applies]
    if hidden:
        # a skipped row says what it needs; a row that ran but does not apply (a CUDA-graph path run eagerly
        # where no graph can be captured) is named by what it is
        needs = sorted(
            {r.note if r.status == "skipped" else "CUDA graph replay: no graph here, run eagerly" for r in hidden}
        )
        console.print(
            f"Not shown: {len(hidden)} rows that do not apply on this machine ({'; '.join(needs)}); "
            "the JSON lists them.",
            highlight=False,
            markup=False,
        )
    shown = [c for c in checks if c.applies]
    if shown:
        table = Table(title="Targets (GPU, full mode)", title_justify="left")
        for col in ("target", "value", "goal", "result"):
            table.add_column(col, overflow="fold")
        for c in shown:
            if c.passed is None:
                result = "[yellow]not measured[/]"
            else:
                result = "[green]met[/]" if c.passed else "[red]missed[/]"
            note = f" — {escape(c.note)}" if c.note else ""
            table.add_row(
                escape(c.name), "" if c.value is None else f"{c.value:.4g}", f"{c.op} {c.target:g}", result + note
            )
        console.print(table)
    if len(shown) < len(checks):
        console.print(
            f"Targets: {len(checks) - len(shown)} recorded in the JSON do not apply here (they are goals "
            "for a GPU in full mode).",
            highlight=False,
            markup=False,
        )
    if peaks:
        console.print(
            f"Peaks measured in this run: matmul {_num(peaks.get('matmul_tflops'))} TFLOP/s, "
            f"copy {_num(peaks.get('copy_gbps'))} GB/s"
        )


def write_json(path: str, payload: dict) -> None:
    d = os.path.dirname(os.path.abspath(path))
    os.makedirs(d, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(payload, f, indent=1, default=str, allow_nan=False)
        f.write("\n")


def rows_from_payload(payload: dict) -> list[Row]:
    """The rows of a bench JSON (what :func:`write_json` wrote), as :class:`Row` objects in their written order:
    to draw the plot of an earlier run again (``python -m mla_bridge.bench.report BENCH.json OUT.png``)."""
    fields = set(Row.__dataclass_fields__) - {"order"}
    out = []
    for i, d in enumerate(payload.get("rows", [])):
        row = Row(**{k: v for k, v in d.items() if k in fields})
        row.order = (i,)
        out.append(row)
    return out


def _grouped(rows: list[Row], section: str, series: tuple, value) -> tuple[list[str], list[tuple[str, list]]]:
    """``(cases, [(label, values per case)])`` of ``section``'s measured rows that apply here, cases in report
    order; a series with no value at all is left out (its skipped rows: :func:`_gaps`); ``value(row)`` gives the
    plotted number (or None)."""
    cases: list[str] = []
    got: dict[tuple[str, str], float] = {}
    for r in sort_rows(rows):
        if r.section != section or not r.applies:
            continue
        if r.case not in cases and any(r.path == p for p, _ in series):
            cases.append(r.case)
        v = value(r) if r.status == "ok" else None
        if v is not None and v > 0:
            got[(r.case, r.path)] = v
    cases = [c for c in cases if any((c, path) in got for path, _ in series)]
    return cases, [
        (label, [got.get((c, path)) for c in cases]) for path, label in series if any((c, path) in got for c in cases)
    ]


def _visible(cases: list[str], series: list[tuple[str, list]]) -> tuple[list[str], list[tuple[str, list]]]:
    """A throughput panel's cases without those whose every bar would be under 1% of the panel's largest (a
    16-token case that measures the per-call overhead: its figure is its time, in the table, not a bar)."""
    top = max((v for _, vals in series for v in vals if v), default=0.0)
    keep = [i for i in range(len(cases)) if any((vals[i] or 0.0) >= 0.01 * top for _, vals in series)]
    return [cases[i] for i in keep], [(label, [vals[i] for i in keep]) for label, vals in series]


def _gaps(rows: list[Row], section: str, series: tuple, cases: list[str]) -> dict[tuple[str, str], str]:
    """``{(case, series label): why}`` for the rows of ``section``'s series that apply here and were tried without a
    figure: "out of memory", or "failed" (the row carries the error). The plot writes it where the bar would be, so
    a missing bar is not read as a path that was never tried. A path the bench does not run on purpose (the row's
    note says why: dense SDPA on a ragged batch, flex_attention on one shape) is left blank, not labelled."""
    labels = dict(series)
    gaps: dict[tuple[str, str], str] = {}
    for r in rows:
        if r.section != section or not r.applies or r.status == "ok" or r.case not in cases or r.path not in labels:
            continue
        text = f"{r.note} {r.error or ''}".lower()
        if "out of memory" in text or "resource_exhausted" in text:
            gaps[(r.case, labels[r.path])] = "out of memory"
        elif r.error:
            gaps[(r.case, labels[r.path])] = "failed"
    return gaps


def _short(v: float) -> str:
    return f"{v:.3g}" if abs(v) < 100 else f"{v:.0f}"


def _bars(
    ax: Any,
    cases: list[str],
    series: list[tuple[str, list]],
    colors: list,
    *,
    xlabel: str,
    log: bool = False,
    gaps: Optional[dict[tuple[str, str], str]] = None,
) -> None:
    """Horizontal grouped bars: one group per case (top to bottom in report order), one bar per series, each bar
    labelled with its value; where ``gaps`` has a reason for a (case, series label), that text in the bar's place;
    the legend outside the axes, on the right."""
    import textwrap

    from matplotlib.transforms import blended_transform_factory

    gaps = gaps or {}
    # each case's bars side by side, only the series it has or says why it lacks (colours stay per series)
    per_case = [
        [j for j, (label, vals) in enumerate(series) if vals[i] is not None or (cases[i], label) in gaps]
        for i in range(len(cases))
    ]
    width = max(1, max((len(js) for js in per_case), default=1))
    h = 0.8 / width
    placed: dict[int, list[tuple[float, float]]] = {}
    left_edge = blended_transform_factory(ax.transAxes, ax.transData)
    for i, js in enumerate(per_case):
        for k, j in enumerate(js):
            y, v = i + (k - (len(js) - 1) / 2) * h, series[j][1][i]
            if v is not None:
                placed.setdefault(j, []).append((y, v))
            else:
                why = gaps[(cases[i], series[j][0])]
                ax.text(0.005, y, f"{series[j][0]}: {why}", transform=left_edge, va="center", fontsize=7,
                        color=colors[j % len(colors)], style="italic")  # fmt: skip
    for j, (label, _) in enumerate(series):
        if j not in placed:
            continue
        ys, vs = zip(*placed[j])
        bars = ax.barh(ys, vs, height=h * 0.92, color=colors[j % len(colors)], label=label)
        ax.bar_label(bars, labels=[_short(x) for x in vs], padding=2, fontsize=7)
    ax.set_yticks(range(len(cases)))
    ax.set_yticklabels([textwrap.fill(c, 34) for c in cases], fontsize=8)
    ax.invert_yaxis()
    if log:
        from matplotlib.ticker import FuncFormatter, LogLocator

        ax.set_xscale("log")
        ax.xaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
        ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
        ax.xaxis.set_minor_formatter(FuncFormatter(lambda v, _: ""))
    ax.set_xlabel(xlabel, fontsize=9)
    ax.tick_params(axis="x", labelsize=8)
    ax.grid(True, axis="x", which="both", alpha=0.3)
    ax.set_axisbelow(True)
    if not log:
        ax.margins(x=0.12)


def _panels(rows: list[Row], peaks: dict, env: dict) -> list[dict]:
    """What to draw: each panel a title, cases, series and axis settings; panels without data are left out."""
    from . import context, main_pass

    def ratio(r: Row) -> Optional[float]:
        return r.extra.get("vs_attention_plus_gemm")

    cp = context.path
    main_series = tuple(
        zip(
            (v.label for v in main_pass.VARIANTS.values()),
            (
                "mla_bridge (RaggedPlan.run)",
                "raw FlashInfer (wrapper.run)",
                "torch SDPA (dense)",
                "flex_attention (document mask)",
                "mla_bridge torch backend (reference)",
            ),
        )
    )
    graphed = "CUDA graph replay" if env.get("gpu") else "capture_prefill (runs eagerly on the CPU)"
    layer = ((cp("eager"), "eager"), (cp("graph"), graphed))
    kv = (
        (cp("fused kv"), "fused kernel, eager"),
        (cp("fused kv graph"), "fused kernel, graphed"),
        (cp("separate kv"), "gather + cuBLAS, eager"),
        (cp("separate kv graph"), "gather + cuBLAS, graphed"),
    )
    times = (
        (cp("eager"), "mla_prefill, eager"),
        (cp("graph"), "mla_prefill, " + graphed),
        (cp("handwritten"), "hand-written pipeline"),
    )

    ttft_series = (
        ("transformers sdpa", "transformers, sdpa"),
        ("transformers mla_bridge", "transformers, mla_bridge"),
        ("JAX model, jax.nn.dot_product_attention cuDNN", "JAX, cuDNN"),
        ("JAX model, jax.nn.dot_product_attention XLA", "JAX, XLA"),
        ("JAX model, mla_bridge_jax", "JAX, mla_bridge_jax"),
    )

    applies = env.get("mode") == "full" and bool(env.get("gpu"))
    jax_paths: list[str] = []
    for r in sort_rows(rows):
        if r.section == "jax" and r.applies and r.status == "ok" and r.tflops and r.path not in jax_paths:
            jax_paths.append(r.path)
    tflops = dict(xlabel="TFLOP/s", peak=peaks.get("matmul_tflops"))
    targets = ((context.EAGER_TARGET, "eager"), (context.GRAPHED_TARGET, "graphed")) if applies else ()
    specs = (  # (section, series, plotted value, title, axis settings)
        ("main", main_series, lambda r: r.tflops, "Main pass, causal: throughput by case (higher is better)", tflops),
        ("context", layer, ratio, "mla_prefill with cached context: time / (attention + GEMM alone), default path "
         "(lower is better; 1 = the two kernels alone)", dict(xlabel="ratio", one=True, targets=targets)),
        ("context", kv, ratio, "mla_prefill: time / (attention + GEMM alone), one k/v path forced on every pass "
         "(lower is better)", dict(xlabel="ratio", one=True)),
        ("context", times, lambda r: r.ms, "mla_prefill per layer against the hand-written pipeline (lower is better)",
         dict(xlabel="ms per layer")),
        ("jax", tuple((p, p) for p in jax_paths[:6]), lambda r: r.tflops,
         "JAX adapter: throughput by case (higher is better)", tflops),
        ("ttft", ttft_series, lambda r: r.ms, "Time to first token: one prefill forward of a 4-layer model at "
         "DeepSeek-V2-Lite's dims (lower is better)", dict(xlabel="ms per forward")),
    )  # fmt: skip
    panels = []
    for section, wanted, value, title, axis in specs:
        cases, series = _grouped(rows, section, wanted, value)
        if axis["xlabel"] == "TFLOP/s":
            cases, series = _visible(cases, series)
        if not series:
            continue
        drawn = {label for label, _ in series}
        if wanted is times and "hand-written pipeline" not in drawn:  # it needs CUDA: the title names what is drawn
            title = "mla_prefill per layer (lower is better; the hand-written pipeline it is compared with needs CUDA)"
        panel: dict[str, Any] = dict(title=title, cases=cases, series=series, **axis)
        panel["gaps"] = {key: why for key, why in _gaps(rows, section, wanted, cases).items() if key[1] in drawn}
        if axis["xlabel"] in ("ms per layer", "ms per forward"):
            values = [v for _, vals in series for v in vals if v]
            panel["log"] = max(values) / min(values) > 20
            panel["xlabel"] += " (log scale)" if panel["log"] else ""
        panels.append(panel)
    return panels


def plot_title(env: dict) -> str:
    """The plot's title: the machine, the date (UTC) and the versions the figures depend on."""
    gpu = env.get("gpu") or f"CPU ({env.get('cpu_count') or '?'} cores)"
    if env.get("gpu_capability"):
        gpu += f", SM {env['gpu_capability']}"
    date = str(env.get("date") or "")
    date = date[:16].replace("T", " ") + " UTC" if len(date) >= 16 else date
    first = f"mla_bridge bench · {gpu} · {env.get('dtype')} · {env.get('mode')} mode · {date}"
    versions = [f"mla_bridge {env.get('mla_bridge')}", f"torch {env.get('torch')}"]
    if env.get("cuda"):
        versions.append(f"CUDA {env['cuda']}")
    if env.get("driver"):
        versions.append(f"driver {env['driver']}")
    versions.append(f"FlashInfer {env.get('flashinfer') or 'not installed'}")
    if env.get("jax"):
        versions.append(f"JAX {env['jax']}")
    return first + "\n" + " · ".join(versions)


def write_plot(path: str, rows: list[Row], peaks: dict, env: dict) -> None:
    """Small multiples, one panel per question, each a few series of horizontal bars by case: the main pass's
    TFLOP/s (mla_bridge, the raw FlashInfer kernel, the peers); the layer's time against attention + GEMM alone,
    eager and graphed (with the GPU targets in full mode); the same for each k/v path forced; the layer's ms against
    the hand-written pipeline; the JAX adapter; a whole model's time to first token. Only rows that apply on this
    machine; legends outside the axes; the machine, date and versions in the title."""
    import matplotlib.pyplot as plt

    fig = plot_figure(rows, peaks, env)
    d = os.path.dirname(os.path.abspath(path))
    os.makedirs(d, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_figure(rows: list[Row], peaks: dict, env: dict) -> Any:
    """The matplotlib figure :func:`write_plot` saves (the caller closes it)."""
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    panels = _panels(rows, peaks, env)
    colors = ["#1f77b4", "#ff7f0e", "#2ca02c", "#9467bd", "#8c564b", "#7f7f7f"]
    heights = [
        max(
            1.8,
            0.19 * (sum(v is not None for _, vals in p["series"] for v in vals) + len(p["gaps"]))
            + 0.12 * len(p["cases"])
            + 0.9,
        )
        for p in panels
    ] or [2.0]
    fig, axes = plt.subplots(
        len(heights),
        1,
        figsize=(12, sum(heights) + 1.2),
        squeeze=False,
        gridspec_kw=dict(height_ratios=heights),
        layout="constrained",
    )
    for ax, p in zip(axes[:, 0], panels):
        _bars(ax, p["cases"], p["series"], colors, xlabel=p["xlabel"], log=p.get("log", False), gaps=p["gaps"])
        if p.get("peak"):
            ax.axvline(
                p["peak"], color="gray", linestyle="--", linewidth=1, label=f"matmul peak, same run ({_num(p['peak'])})"
            )
        if p.get("one"):
            ax.axvline(1.0, color="black", linewidth=0.8)
        for k, (target, what) in enumerate(p.get("targets", ())):
            ax.axvline(
                target,
                color=colors[k],
                linestyle=("--", ":")[k % 2],
                linewidth=1.1,
                label=f"target, {what}: <= {target}",
            )
        ax.set_title(p["title"], fontsize=10, loc="left")
        ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)
    if not panels:
        axes[0, 0].text(0.5, 0.5, "no measured rows", ha="center", va="center", transform=axes[0, 0].transAxes)
        axes[0, 0].set_axis_off()
    fig.suptitle(plot_title(env), fontsize=10)
    return fig


def main(argv: Optional[list] = None) -> int:
    """``python -m mla_bridge.bench.report BENCH.json OUT.png``: the plot of an earlier run's JSON."""
    import sys

    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 2:
        print("usage: python -m mla_bridge.bench.report BENCH.json OUT.png", file=sys.stderr)
        return 2
    with open(args[0], encoding="utf-8") as f:
        payload = json.load(f)
    write_plot(args[1], rows_from_payload(payload), payload.get("peaks") or {}, payload.get("environment") or {})
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
