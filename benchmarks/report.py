#!/usr/bin/env python3
"""Writes benchmarks/report/README.md and its PNG plots from a results directory of run_all.sh.

    python3 benchmarks/report.py [results-dir] [--out benchmarks/report] [--note TEXT]
    python3 benchmarks/report.py --write-machine results-dir/machine.json [--setting KEY=VALUE ...]

The report is regenerated, never hand-edited: every number comes from the JSON the benchmark
programs wrote (allreduce_np*.json, allreduce_gloo_np*.json, allreduce_torchrun_np*.json, allreduce_gloo_cpp_np*.json, ddp_*.json, zero_np*.json, shard_collectives_np*.json, tp_np*.json, amp*.json,
placement.json, checkpoint.json, soak.txt) and machine.json, which run_all.sh writes at the start
of a run (the second form above) with the CPU, cores, host, date, commit and the run's settings.
Benchmarks whose results are missing or unreadable get a one-line note instead of a section.
Ratios are always "ours against the reference", defined as in the programs that measured them;
each table says which way is better.
"""

import argparse
import datetime
import glob
import json
import os
import platform
import re
import socket
import statistics
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DPI = 100
PLOTS = ["allreduce_busbw.png", "ddp_step.png", "zero_memory.png", "tp_mlp.png", "pipeline_timeline.png", "amp_unscale.png",
         "checkpoint.png", "placement.png"]


# ---------------------------------------------------------------------------------------------
# machine.json


def _run(cmd):
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=20, cwd=ROOT).stdout.strip()
    except Exception:
        return ""


def shown_path(path):
    """A path as the report prints it: relative to the project inside it, else its last component
    (the report names no directory of the machine it ran on)."""
    full = os.path.abspath(path)
    if full == ROOT or full.startswith(ROOT + os.sep):
        return os.path.relpath(full, ROOT)
    return os.path.basename(full.rstrip(os.sep)) + " (outside the project)"


def machine_info(settings):
    cpu = ""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    mem_gb = None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    mem_gb = round(int(line.split()[1]) / 1024 / 1024, 1)
    except OSError:
        pass
    try:
        cores = os.sysconf("SC_NPROCESSORS_ONLN")
    except (ValueError, OSError):
        cores = os.cpu_count()
    commit = _run(["git", "rev-parse", "--short=12", "HEAD"])
    dirty = bool(_run(["git", "status", "--porcelain", "--untracked-files=no"]))
    try:
        import torch  # noqa: F401  (only its version)
        torch_version = torch.__version__
    except Exception:
        torch_version = ""
    mpi = _run(["mpirun", "--version"]).splitlines()
    return {
        "cpu": cpu or platform.processor() or "unknown",
        "cores": cores,
        "memory_gb": mem_gb,
        "hostname": socket.gethostname(),
        "kernel": platform.release(),
        "date_utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "git_commit": commit + ("+dirty" if dirty and commit else ""),
        "git_branch": _run(["git", "rev-parse", "--abbrev-ref", "HEAD"]),
        "torch": torch_version,
        "mpi": mpi[0] if mpi else "",
        "python": platform.python_version(),
        "settings": settings,
    }


def write_machine(path, pairs):
    settings = {}
    for p in pairs:
        key, _, value = p.partition("=")
        settings[key] = value
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(machine_info(settings), f, indent=2)
        f.write("\n")
    print(f"report.py: machine description in {path}")


# ---------------------------------------------------------------------------------------------
# helpers


def load(path):
    with open(path) as f:
        return json.load(f)


def med(v):
    return statistics.median(v) if v else float("nan")


def human_bytes(n):
    n = int(n)
    if n >= 1 << 30:
        return f"{n / (1 << 30):g} GiB"
    if n >= 1 << 20:
        return f"{n / (1 << 20):g} MiB"
    if n >= 1 << 10:
        return f"{n / (1 << 10):g} KiB"
    return f"{n} B"


def fmt(x, digits=3):
    if x is None or (isinstance(x, float) and x != x):
        return "-"
    return f"{x:.{digits}f}"


def sig(x, digits=3):
    """Three significant figures: bandwidths and ratios here span six orders of magnitude."""
    if x is None or (isinstance(x, float) and x != x):
        return "-"
    return f"{x:.{digits}g}"


def table(header, rows):
    out = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    for r in rows:
        out.append("| " + " | ".join(str(c) for c in r) + " |")
    return "\n".join(out) + "\n"


class Report:
    def __init__(self, results, out, machine, note):
        self.results, self.out, self.machine, self.note = results, out, machine, note
        self.parts, self.skipped, self.figures = [], [], []
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        self.plt = plt
        plt.rcParams.update({"font.size": 9, "axes.titlesize": 10, "legend.fontsize": 8,
                             "axes.grid": True, "grid.alpha": 0.3})

    def path(self, name):
        return os.path.join(self.results, name)

    def footer(self, key):
        """Two lines for the bottom of a plot: the machine and run, and this benchmark's settings."""
        m = self.machine
        if not m:
            return ["machine and run unknown (no machine.json in the results directory)"]
        lines = [f"{m.get('cpu', '?')}, {m.get('cores', '?')} cores, host {m.get('hostname', '?')}; "
                 f"run {m.get('date_utc', '?')}, commit {m.get('git_commit') or '?'}, torch {m.get('torch', '?')}"]
        s = m.get("settings", {})
        extra = [f"{key} settings: {s[key]}"] if s.get(key) else []
        if s.get("note"):
            extra.append("reduced run, see the report's note")
        if extra:
            lines.append("; ".join(extra))
        return lines

    def layout(self, fig, key):
        """tight_layout leaving room at the bottom for the footer."""
        lines = self.footer(key)
        height = fig.get_size_inches()[1]
        fig.tight_layout(rect=(0, (0.08 + 0.13 * len(lines)) / height, 1, 1))

    def save(self, fig, name, caption, key):
        """Saves fig with the machine and run as a footer (a small palette PNG); returns its Markdown."""
        lines = self.footer(key)
        fig.text(0.01, 0.01, "\n".join(lines), fontsize=6.5, color="0.3", va="bottom", ha="left")
        path = os.path.join(self.out, name)
        fig.savefig(path, dpi=DPI)
        self.plt.close(fig)
        try:  # plots have few colours: a 256-colour palette keeps each well under 100 KB
            from PIL import Image

            Image.open(path).convert("RGB").quantize(colors=256).save(path, optimize=True)
        except Exception:
            pass
        assert name in PLOTS, name
        self.figures.append(name)
        return f"![{caption}]({name})\n\n*{caption}; the plot's footer names the machine and run.*\n"

    def result(self, name, missing):
        """The results file `name` loaded, or None with `missing` noted among what the report lacks."""
        p = self.path(name)
        if os.path.exists(p):
            return load(p)
        self.skipped.append(missing)
        return None

    def section(self, title, fn):
        before = len(self.figures)
        try:
            text = fn()
        except Exception as e:  # one broken file must not lose the rest of the report
            print(f"report.py: {title}: skipped, {type(e).__name__}: {e}", file=sys.stderr)
            self.plt.close("all")
            for name in self.figures[before:]:  # no plot without its section
                try:
                    os.remove(os.path.join(self.out, name))
                except OSError:
                    pass
            del self.figures[before:]
            self.skipped.append(f"{title}: results present but unreadable ({type(e).__name__}: {e})")
            return
        if text is None:
            return
        self.parts.append(f"## {title}\n\n{text}")

    # -----------------------------------------------------------------------------------------

    def allreduce(self):
        files = sorted(glob.glob(self.path("allreduce_np*.json")),
                       key=lambda p: int(re.search(r"np(\d+)", p).group(1)))
        if not files:
            self.skipped.append("all-reduce: no allreduce_np*.json (BENCHMARKS without `allreduce`)")
            return None
        runs = []
        for p in files:
            d = load(p)
            n = d["ranks"]
            gp = self.path(f"allreduce_gloo_np{n}.json")
            gloo = load(gp) if os.path.exists(gp) else None
            runs.append((n, d, gloo))
        plt = self.plt
        from matplotlib.ticker import FixedLocator, NullLocator

        fig, axes = plt.subplots(2, len(runs), figsize=(5.2 * len(runs), 6.6), squeeze=False, sharex="col",
                                 gridspec_kw={"height_ratios": [3, 2]})
        for col, (n, d, gloo) in enumerate(runs):
            ax, rx = axes[0][col], axes[1][col]
            r = d["results"]
            x = [row["bytes"] for row in r]
            bf = 2.0 * (n - 1) / n if n > 1 else 1.0
            ax.plot(x, [row["loom_busbw_gbps"] for row in r], "o-", ms=4, label="torchloom", color="C0")
            ax.plot(x, [row["bytes"] / (row["loom_async_us"] * 1e-6) * bf / 1e9 for row in r], ".--", ms=3,
                    label="torchloom, async (progress thread)", color="C0", alpha=0.45)
            ax.plot(x, [row["mpi_busbw_gbps"] for row in r], "s-", ms=4, label="raw MPI_Allreduce", color="C1")
            rx.plot(x, [row["ratio_loom_over_mpi_bandwidth"] for row in r], "s-", ms=4, color="C1",
                    label="torchloom / raw MPI")
            if gloo:
                g = gloo["results"]
                ax.plot([row["bytes"] for row in g], [row["gloo_busbw_gbps"] for row in g], "^-", ms=4,
                        label="PyTorch Gloo", color="C2")
                gl = {row["bytes"]: row for row in g}
                pts = [(row["bytes"], gl[row["bytes"]]["gloo_us"] / row["loom_us"]) for row in r if row["bytes"] in gl]
                rx.plot([p[0] for p in pts], [p[1] for p in pts], "^-", ms=4, color="C2", label="torchloom / Gloo")
            ax.set_yscale("log")
            ax.set_ylabel("bus bandwidth (GB/s)")
            ax.set_title(f"all_reduce float32, {n} ranks (median, slowest rank)")
            ax.legend(loc="upper left")
            rx.axhline(1, color="k", lw=0.8)
            rx.set_yscale("log")
            rx.set_ylabel("bandwidth ratio\n(> 1: torchloom faster)")
            rx.legend(loc="upper left")
            rx.set_xscale("log", base=2)
            ticks = [b for b in x[::2]]
            rx.xaxis.set_major_locator(FixedLocator(ticks))
            rx.xaxis.set_minor_locator(NullLocator())
            rx.set_xticklabels([human_bytes(b).replace("iB", "") for b in ticks])
            rx.set_xlabel("message size")
        self.layout(fig, "allreduce")
        text = ("float32 sum, in place; bus bandwidth as nccl-tests (algbw x 2(n-1)/n); each point the median "
                "of timed iterations, each iteration the slowest rank's time. loom and raw MPI are interleaved "
                "iteration by iteration in the same processes (`allreduce_bench`); PyTorch Gloo "
                "(`allreduce_gloo.py`, torch.distributed) runs as separate processes in the same run. "
                "Ratios are loom's bandwidth over the reference's (> 1: loom faster).\n\n")
        text += self.save(fig, "allreduce_busbw.png",
                          "all_reduce bus bandwidth against message size: torchloom, raw MPI, PyTorch Gloo", "allreduce")
        for n, d, gloo in runs:
            gl = {row["bytes"]: row for row in gloo["results"]} if gloo else {}
            rows = []
            for row in d["results"]:
                g = gl.get(row["bytes"])
                rows.append([human_bytes(row["bytes"]), fmt(row["mpi_us"], 1), fmt(row["loom_us"], 1),
                             fmt(g["gloo_us"], 1) if g else "-", sig(row["loom_busbw_gbps"]),
                             sig(row["mpi_busbw_gbps"]), sig(g["gloo_busbw_gbps"]) if g else "-",
                             sig(row["ratio_loom_over_mpi_bandwidth"]),
                             sig(g["gloo_us"] / row["loom_us"]) if g else "-",
                             fmt(row["check_cost_ratio"]),
                             "yes" if row["correct"] and (not g or g["correct"]) else "**NO**"])
            text += (f"\n**{n} ranks**" + ("" if gloo else " (no Gloo results for this rank count)") + "\n\n")
            text += table(["size", "MPI us", "loom us", "Gloo us", "loom GB/s", "MPI GB/s", "Gloo GB/s",
                           "loom/MPI bw", "loom/Gloo bw", "check cost", "correct"], rows)
            stream = d.get("back_to_back", [])
            if stream:
                text += (f"\nBack-to-back calls, {n} ranks ({stream[0]['calls_per_block']} per block, "
                         f"{stream[0]['rounds']} rounds of raw, loom and unchecked blocks; per call, median over "
                         "rounds, added latency's range in brackets):\n\n")
                text += table(["size", "MPI us", "loom us", "added us", "unchecked us", "check cost", "correct"],
                              [[human_bytes(row["bytes"]), fmt(row["mpi_us"], 2), fmt(row["loom_us"], 2),
                                f"{row['added_latency_us']:+.2f} [{row['added_latency_us_min']:+.2f}.."
                                f"{row['added_latency_us_max']:+.2f}]", fmt(row["loom_unchecked_us"], 2),
                                fmt(row["check_cost_ratio"]), "yes" if row["correct"] else "**NO**"]
                               for row in stream])
        text += ("\n*check cost*: loom's time with its always-on fingerprint check over its time without "
                 "(> 1: the check costs that much).\n")
        text += self.allreduce_torchrun()
        return text

    def allreduce_torchrun(self):
        """Under torchrun (no MPI): torchloom's world communicator over Gloo against torch.distributed
        over Gloo (allreduce_torchrun.py) and against LibTorch's ProcessGroupGloo called from C++
        (allreduce_gloo_bench), each in the same processes; one file per round."""
        kinds = [("allreduce_torchrun", "torch.distributed (Python, same processes)", "torch_us",
                  "`allreduce_torchrun.py`: torchloom's Python all_reduce().wait() against "
                  "torch.distributed.all_reduce on a gloo group (a run's time per size: the mean of its central "
                  "80% of calls, since these times are bimodal on 2 cores and a median jumps between the modes)"),
                 ("allreduce_gloo_cpp", "c10d::ProcessGroupGloo (C++, same processes)", "gloo_us",
                  "`allreduce_gloo_bench`: loom::Communicator against a c10d::ProcessGroupGloo the program makes")]
        text = ""
        for prefix, ref_name, ref_key, what in kinds:
            files = sorted(glob.glob(self.path(f"{prefix}_np*.json")))
            if not files:
                continue
            by_n = {}
            for p in files:
                d = load(p)
                by_n.setdefault(d["ranks"], []).append(d)
            for n, docs in sorted(by_n.items()):
                sizes = [row["bytes"] for row in docs[0]["results"]]
                rows = []
                for b in sizes:
                    found = [next(r for r in d["results"] if r["bytes"] == b) for d in docs
                             if any(r["bytes"] == b for r in d["results"])]
                    ratios = [r[ref_key] / r["loom_us"] for r in found]
                    rows.append([human_bytes(b), fmt(med([r["loom_us"] for r in found]), 1),
                                 fmt(med([r[ref_key] for r in found]), 1),
                                 f"{sig(med(ratios))} [{sig(min(ratios))}..{sig(max(ratios))}]",
                                 "yes" if med(ratios) >= 0.95 else "**no**",
                                 "yes" if all(r["correct"] for r in found) else "**NO**"])
                text += (f"\n**Under torchrun, {n} ranks: torchloom over Gloo against {ref_name}**, "
                         f"{len(docs)} run(s). {what}, interleaved call by call in alternating order, each call "
                         "after a barrier on a third Gloo group, its time the slowest rank's. Times: median over "
                         "runs of each run's time (its median unless said above); ratio = reference time / "
                         "torchloom time (>= 1: torchloom at "
                         "least as fast), median over runs [range]; target >= 0.95 (issue 24).\n\n")
                text += table(["size", "loom us", "reference us", "ratio", ">= 0.95", "correct"], rows)
                streams = [d.get("back_to_back", []) for d in docs if d.get("back_to_back")]
                if streams:
                    text += (f"\nBack-to-back calls ({streams[0][0]['calls_per_block']} per block, "
                             f"{streams[0][0]['rounds']} rounds of loom and ProcessGroupGloo blocks): per call, median "
                             "over runs of each run's median over rounds; added = loom's time less the reference's "
                             "in the same round, range over all runs' rounds.\n\n")
                    srows = []
                    for row0 in streams[0]:
                        b = row0["bytes"]
                        found = [next(r for r in st if r["bytes"] == b) for st in streams
                                 if any(r["bytes"] == b for r in st)]
                        srows.append([human_bytes(b), fmt(med([r["loom_us"] for r in found]), 2),
                                      fmt(med([r["gloo_us"] for r in found]), 2),
                                      f"{med([r['added_latency_us'] for r in found]):+.2f} "
                                      f"[{min(r['added_latency_us_min'] for r in found):+.2f}.."
                                      f"{max(r['added_latency_us_max'] for r in found):+.2f}]",
                                      fmt(med([r.get("loom_caller_cpu_us_rank0", float("nan")) for r in found]), 2),
                                      fmt(med([r.get("gloo_caller_cpu_us_rank0", float("nan")) for r in found]), 2),
                                      "yes" if all(r["correct"] for r in found) else "**NO**"])
                    text += table(["size", "loom us", "ProcessGroupGloo us", "added us", "loom caller CPU us",
                                   "ProcessGroupGloo caller CPU us", "correct"], srows)
                    text += ("\n*caller CPU*: rank 0's calling thread's CPU time per call (submit and wait), "
                             "which machine load does not inflate as it does wall time.\n")
        return text

    def ddp(self):
        summary = self.path("ddp_summary.json")
        ours = sorted(glob.glob(self.path("ddp_loom_np[2-9]*_r*.json")))
        ref = sorted(glob.glob(self.path("ddp_pytorch_np*_r*.json")))
        if not os.path.exists(summary):
            self.skipped.append("DDP: no ddp_summary.json (BENCHMARKS without `ddp`, or the run failed)")
            return None
        s = load(summary)
        m = s["median_s"]
        cfg = s["config"]
        plt = self.plt
        fig, ax = plt.subplots(figsize=(6.4, 3.9))
        groups = ["compute only\n(no DDP)", "DDP step\n(defaults)", "DDP step\n(bucket view)"]
        loom_v = [m["loom_plain"], m["loom_ddp"], float("nan")]
        ref_v = [m["pytorch_plain"], m["pytorch_ddp"], m["pytorch_ddp_bucket_view"]]
        xs = range(len(groups))
        w = 0.38
        b1 = ax.bar([x - w / 2 for x in xs], [v * 1e3 for v in loom_v], w, label="torchloom DDP", color="C0")
        b2 = ax.bar([x + w / 2 for x in xs], [v * 1e3 for v in ref_v], w, label="PyTorch DDP (Gloo)", color="C3")
        for bars in (b1, b2):
            for bar in bars:
                h = bar.get_height()
                if h == h:
                    ax.annotate(f"{h:.1f}", (bar.get_x() + bar.get_width() / 2, h), ha="center", va="bottom",
                                fontsize=7.5)
        ax.axhline(m["loom_allreduce"] * 1e3, color="C0", ls=":", lw=1,
                   label=f"loom all_reduce of the gradients ({m['loom_allreduce'] * 1e3:.1f} ms)")
        ax.set_xticks(list(xs))
        ax.set_xticklabels(groups)
        ax.set_ylabel("step time (ms), fastest round's median")
        ax.set_title(f"DDP step, MLP {cfg['input']}-{cfg['hidden']}x{cfg['layers']}-{cfg['classes']}, "
                     f"{s['ranks']} ranks, batch {cfg['batch_per_rank']}/rank")
        ax.annotate("(the same\nas defaults)", (2 - w / 2, 2), ha="center", va="bottom", fontsize=7, color="C0")
        ax.legend(loc="upper left", ncol=2, fontsize=7.5)
        ax.set_ylim(0, max(v for v in loom_v + ref_v if v == v) * 1e3 * 1.4)
        self.layout(fig, "ddp")
        text = (f"The same MLP ({cfg['input']}-{cfg['hidden']}x{cfg['layers']}-{cfg['classes']}, float32, "
                f"{cfg['threads_per_rank']} thread per rank, SGD, batch {cfg['batch_per_rank']} per rank, "
                f"{cfg['iters']} timed steps) in `ddp_bench` (loom) and `ddp_reference.py` (PyTorch DDP on "
                f"Gloo, torchrun), {s['rounds']} round(s) alternating which goes first; each side's fastest "
                f"round. Time ratios are loom over PyTorch (< 1: loom faster).\n\n")
        text += self.save(fig, "ddp_step.png", "DDP step time: torchloom against PyTorch DDP", "ddp")
        text += "\n" + table(["step (ms)", "torchloom", "PyTorch"], [
            ["compute only (no DDP)", fmt(m["loom_plain"] * 1e3, 2), fmt(m["pytorch_plain"] * 1e3, 2)],
            ["DDP, defaults", fmt(m["loom_ddp"] * 1e3, 2), fmt(m["pytorch_ddp"] * 1e3, 2)],
            ["DDP, gradients as bucket views", "(same)", fmt(m["pytorch_ddp_bucket_view"] * 1e3, 2)],
            ["all_reduce of the gradient bytes", fmt(m["loom_allreduce"] * 1e3, 2), ""],
            ["DDP minus compute", fmt((m["loom_ddp"] - m["loom_plain"]) * 1e3, 2),
             fmt((m["pytorch_ddp"] - m["pytorch_plain"]) * 1e3, 2)]])
        t = s.get("targets", {})
        ta, tb, tc = t.get("a", 0.9), t.get("b", 0.02), t.get("c", 1.0)

        def met(ok):
            return "met" if ok else "**missed**"

        rows = [["(a) loom DDP / PyTorch DDP (defaults)", fmt(s["a_loom_over_pytorch_ddp"]), f"<= {ta}",
                 met(s["a_loom_over_pytorch_ddp"] <= ta)],
                ["(a) loom DDP / best PyTorch DDP (defaults or bucket view)", fmt(s["a_loom_over_best_pytorch_ddp"]),
                 f"<= {ta}", met(s["a_loom_over_best_pytorch_ddp"] <= ta)],
                ["(a) the same, each over its own compute-only step (drift-free)",
                 fmt(s["a_normalized_by_compute_step"]), f"<= {ta}", met(s["a_normalized_by_compute_step"] <= ta)],
                ["(c) loom DDP / (compute + all_reduce)", fmt(s["c_ddp_over_compute_plus_allreduce"]), f"<= {tc}",
                 met(s["c_ddp_over_compute_plus_allreduce"] <= tc)]]
        if s.get("b_overhead_world_size_1") is not None:
            rows.append(["(b) loom DDP overhead at world size 1", f"{100 * s['b_overhead_world_size_1']:+.2f}%",
                         f"<= {100 * tb:g}%", met(s["b_overhead_world_size_1"] <= tb)])
        text += "\n" + table(["ratio (ours vs reference)", "value", "target", ""], rows)
        drift = s.get("compute_step_drift", 1.0)
        if drift > 1.2:
            text += (f"\nThe two sides' compute-only steps differ by {drift:.2f}x: the machine was busier during "
                     f"one of them; trust the drift-free row.\n")
        if ours and ref:
            text += f"\n({len(ours)} loom and {len(ref)} PyTorch round file(s) in the results.)\n"
        return text

    def ddp_backend(self):
        """PyTorch's own DDP over torch.distributed backend "loom" against over "gloo" (ddp_backend_bench.py)."""
        files = sorted(glob.glob(self.path("ddp_backend_np*.json"))) + sorted(glob.glob(self.path("fsdp_backend_np*.json")))
        if not files:
            self.skipped.append("torch.distributed backend: no ddp_backend_np*.json (BENCHMARKS without `python`)")
            return None
        rows = []
        for f in files:
            r = load(f)
            wrapper = "FSDP2" if r.get("wrapper") == "fsdp" else "DDP"
            target = 0.8 if wrapper == "FSDP2" else 1.0
            rows.append([wrapper, f"{r['ranks']} ({r['launcher']}, loom over {r['loom_host_backend']})",
                         f"{r['parameters'] / 1e6:.2f} M", fmt(r["loom_step_s"] * 1e3, 2), fmt(r["gloo_step_s"] * 1e3, 2),
                         fmt(r["ratio_loom_over_gloo"]), f"<= {target}: " + ("met" if r["ratio_loom_over_gloo"] <= target
                                                                              else "**missed**"),
                         "yes" if r["replicas_agree"] else "**no**"])
        text = ("`ddp_backend_bench.py`: PyTorch's `DistributedDataParallel` (and, `--wrapper fsdp`, FSDP2's "
                "`fully_shard` per Linear) on the same MLP and batches, over `init_process_group(\"loom\")` and over "
                "a Gloo group in the same processes, rounds alternating which goes first; median step of the slowest "
                "rank. Ratio loom over gloo (targets: DDP <= 1.0, FSDP2 <= 0.8).\n\n")
        text += table(["wrapper", "ranks", "parameters", "loom step (ms)", "gloo step (ms)", "ratio", "target",
                       "replicas agree"], rows)
        return text

    def shard_collectives(self):
        """reduce_scatter and all_gather in place against raw MPI (shard_collectives_bench)."""
        files = sorted(glob.glob(self.path("shard_collectives_np*.json")))
        if not files:
            self.skipped.append("reduce_scatter / all_gather: no shard_collectives_np*.json (BENCHMARKS without "
                                "`allreduce`)")
            return None
        rows = []
        for f in files:
            r = load(f)
            for row in r["rows"]:
                rows.append([str(r["ranks"]), row["collective"], human_bytes(row["bytes"]), fmt(row["mpi_s"] * 1e6, 1),
                             fmt(row["loom_s"] * 1e6, 1), fmt(row["ratio_mpi_over_loom"]),
                             "yes" if row["correct"] else "**no**"])
        text = ("`shard_collectives_bench`: ZeRO's two collectives in their in-place forms through "
                "`loom::Communicator` (checked entry, one operation lifecycle) against raw "
                "`MPI_Reduce_scatter_block` / `MPI_Allgather` with `MPI_IN_PLACE` in the same processes, "
                "interleaved, alternating which goes first; median of the slowest rank's time. Ratio = MPI's time "
                "over loom's (1.0: as fast as raw MPI; higher is better). Size = the whole buffer.\n\n")
        text += table(["ranks", "collective", "size", "MPI (us)", "loom (us)", "ratio", "correct"], rows)
        return text

    def zero(self):
        """ZeRO stages 1 and 2 against DDP (zero_bench): memory per rank against the DP size, step time."""
        files = sorted(glob.glob(self.path("zero_np*.json")))
        if not files:
            self.skipped.append("ZeRO: no zero_np*.json (BENCHMARKS without `zero`, or the run failed)")
            return None
        runs = [load(f) for f in files]
        by_ranks = {}
        for r in sorted(runs, key=lambda r: r.get("malloc", "glibc defaults") != "glibc defaults"):
            by_ranks.setdefault(r["ranks"], []).append(r)
        names = [("ddp", "DDP", "C7"), ("zero1", "ZeRO stage 1", "C0"), ("zero2", "ZeRO stage 2", "C2")]
        ranks = sorted(by_ranks)
        plt = self.plt
        fig, ax = plt.subplots(figsize=(6.4, 3.9))
        xs = [n for n in ranks]
        formulas = {"ddp": lambda n: 16.0, "zero1": lambda n: 8 + 8 / n, "zero2": lambda n: 4 + 4 / n + 8 / n}
        fine = [1 + k * (max(ranks) - 1) / 60 for k in range(61)] if max(ranks) > 1 else [1]
        for key, label, colour in names:
            measured = [by_ranks[n][0]["memory"][key]["bytes_per_parameter"] for n in ranks]
            ax.plot(xs, measured, "o", color=colour, label=f"{label}, measured", markersize=7)
            ax.plot(fine, [formulas[key](n) for n in fine], "--", color=colour, linewidth=1, label=f"{label}, formula")
        ax.set_xlabel("data-parallel ranks N")
        ax.set_xticks(xs)
        ax.set_ylabel("bytes per parameter per rank")
        ax.set_ylim(0, 18)
        ax.set_title("training state per rank (fp32, Adam): parameters + gradients + optimizer state")
        ax.legend(fontsize=7, ncol=2, loc="lower left")
        self.layout(fig, "zero")
        cfg = runs[0]["config"]
        text = (f"`zero_bench`: `loom::ZeroOptimizer` stages 1 and 2 against loom's DDP, Adam, on `ddp_bench`'s MLP "
                f"({runs[0]['parameters'] / 1e6:.2f} M parameters, batch {cfg['batch_per_rank']} per rank, fp32, "
                f"{cfg['threads_per_rank']} thread per rank), the three interleaved in the same processes, "
                f"{cfg['iters']} timed steps each; time = the slowest rank's, medians; the ratio is the median over "
                f"steps of ZeRO's time over DDP's in the same step (target <= 1.05 at 2 ranks). Memory: bytes of the "
                f"live tensors' storages after the run (`loom::count_training_memory`), against the ZeRO formulas "
                f"for fp32 parameters with Adam (DDP 4+4+8, stage 1 4+4+8/N, stage 2 4+4/N+8/N).\n\n")
        text += self.save(fig, "zero_memory.png", "Training state per rank against the data-parallel size", "zero")
        rows = []
        for n in ranks:
            for r in by_ranks[n]:
                extra = [(k, label, "") for k, label in (("zero2_overlap", "ZeRO stage 2, gather overlapping forward"),
                                                          ("fsdp", "fully sharded (ZeRO stage 3), a unit per layer"))
                         if k in r["median_s"]]
                for key, label, _ in names + extra:
                    m = r["memory"][key]
                    ratio = r.get("step_time_over_ddp", {}).get(key)
                    # The fully sharded variant's target is against stage 2 (the line below the table).
                    target = "" if ratio is None or n != 2 or key == "fsdp" else ("met" if ratio <= 1.05 else "**missed**")
                    rows.append([str(n), "default" if r.get("malloc", "glibc defaults") == "glibc defaults" else "kept",
                                 label, fmt(r["median_s"][key] * 1e3, 2), "" if ratio is None else fmt(ratio),
                                 target, f"{m['bytes_per_parameter']:.2f}", f"{m['formula_bytes_per_parameter']:.2f}",
                                 f"{r['communicated_bytes_per_step'][key] / 1e6:.1f}",
                                 "yes" if r["correct"] else "**no**"])
        text += "\n" + table(["ranks", "malloc", "variant", "step (ms)", "over DDP", "target", "bytes/param", "formula",
                               "MB handed to the communicator per step", "equal to DDP"], rows)
        fsdp = [(r["ranks"], r["fsdp_over_zero2"]) for n in ranks for r in by_ranks[n] if "fsdp_over_zero2" in r]
        if fsdp:
            text += ("\nFully sharded over ZeRO stage 2, paired per step (target <= 1.15 at 2 ranks): " +
                     ", ".join(f"{fmt(v)} at {n} ranks" for n, v in fsdp) + ".\n")
        bf16_rows = []
        for n in ranks:
            r = by_ranks[n][0]
            for stage in (1, 2):
                m = r["memory"].get(f"bf16_masters_zero{stage}")
                if m is None:
                    continue
                p = r["parameters"]
                bf16_rows.append([str(n), f"stage {stage}", f"{m['parameters_bytes'] / p:.2f}",
                                  f"{m['gradients_bytes'] / p:.2f}", f"{m['master_weights_bytes'] / p:.2f}",
                                  f"{m['optimizer_state_bytes'] / p:.2f}", f"{m['bytes_per_parameter']:.2f}",
                                  f"{m['formula_bytes_per_parameter']:.2f}"])
        if bf16_rows:
            text += ("\nMixed precision: the same MLP in bfloat16 with fp32 master weights of each rank's shard (Adam), "
                     "bytes per parameter counted the same way, against ZeRO's formulas (stage 1 2+2+12/N, stage 2 "
                     "2+14/N):\n\n")
            text += table(["ranks", "ZeRO", "parameters", "gradients", "fp32 masters", "Adam state", "total", "formula"],
                          bf16_rows)
        overlap = [(n, r["overlap_over_zero2"]) for n in ranks for r in by_ranks[n] if "overlap_over_zero2" in r]
        if overlap:
            text += ("\nThe parameter all-gather overlapping the next forward (`overlap_param_gather`, each layer waiting "
                     "for its own parameters), over stage 2 without it, paired medians: " +
                     ", ".join(f"{fmt(v)} ({n} ranks)" for n, v in overlap) + ".\n")
        text += ("\nmalloc: `default` is glibc's defaults; `kept` raises its trim and mmap thresholds (GLIBC_TUNABLES) "
                 "so freed memory stays in the process's heap, as the CUDA caching allocator keeps it on a GPU. Stage 2 "
                 "frees its gradient buckets after every backward; the reducer keeps each bucket's mapping and hands "
                 "its pages back lazily (MADV_FREE), so the next backward does not fault them in again on glibc's "
                 "defaults either: the `kept` run is the control.\n")
        text += ("\nDDP's communicated figure is its all-reduced bytes; ZeRO's the reduce-scattered plus the "
                 "all-gathered bytes, each half an all-reduce's traffic: the same volume on the wire reads as twice "
                 "DDP's figure (padding aside).\n")
        return text

    def tp(self):
        files = sorted(glob.glob(self.path("tp_np*.json")))
        if not files:
            self.skipped.append("tensor parallelism: no tp_np*.json (BENCHMARKS without `tp`, or the run failed)")
            return None
        docs = [load(p) for p in files]
        plt = self.plt
        fig, (a1, a2) = plt.subplots(1, 2, figsize=(8.4, 3.7))
        labels = [f"{d['ranks']} ranks" for d in docs]
        xs = range(len(docs))
        w = 0.3
        t1 = [d["median_s"]["tp1"] * 1e3 for d in docs]
        tn = [d["median_s"]["tpN"] * 1e3 for d in docs]
        a1.bar([x - w / 2 for x in xs], t1, w, label="TP=1 (whole MLP per rank)", color="C7")
        a1.bar([x + w / 2 for x in xs], tn, w, label="TP=N (Column+Row parallel)", color="C0")
        for x, d, v in zip(xs, docs, tn):
            a1.annotate(f"{d['speedup']:.2f}x", (x + w / 2, v), ha="center", va="bottom", fontsize=8)
        a1.set_xticks(list(xs))
        a1.set_xticklabels([f"TP={d['tp']}, {lab}" for d, lab in zip(docs, labels)])
        a1.set_ylabel("forward+backward (ms, median)")
        a1.set_title("step time (label: speed-up TP=1/TP=N)")
        a1.legend(loc="upper right", fontsize=7)
        a1.set_ylim(0, max(t1 + tn) * 1.3)
        a1.set_xlim(-0.75, len(docs) - 0.25)
        a1.grid(axis="x", visible=False)
        b = [d["bytes_per_step"] / 1e6 for d in docs]
        bm = [d["bytes_minimum"] / 1e6 for d in docs]
        a2.bar([x - w / 2 for x in xs], b, w, label="communicated by loom", color="C0")
        a2.bar([x + w / 2 for x in xs], bm, w, label="theoretical minimum", color="C7")
        a2.set_xticks(list(xs))
        a2.set_xticklabels([f"TP={d['tp']}, {lab}" for d, lab in zip(docs, labels)])
        a2.set_ylabel("MB per step (per rank)")
        a2.set_title("bytes communicated per step")
        a2.legend(loc="upper right", fontsize=7)
        for x, v1, v2 in zip(xs, b, bm):
            a2.annotate(f"{v1:.2f}", (x - w / 2, v1), ha="center", va="bottom", fontsize=8)
            a2.annotate(f"{v2:.2f}", (x + w / 2, v2), ha="center", va="bottom", fontsize=8)
        a2.set_ylim(0, max(b + bm) * 1.3)
        a2.set_xlim(-0.75, len(docs) - 0.25)
        a2.grid(axis="x", visible=False)
        self.layout(fig, "tp")
        c = docs[0]["config"]
        text = (f"Forward + backward of a transformer MLP ({c['hidden']} -> {c['ffn']} -> {c['hidden']}, "
                f"{c['tokens']} tokens, float32, {c['threads_per_rank']} thread per rank) with plain Linear layers "
                f"(TP=1) and with ColumnParallelLinear + RowParallelLinear (TP=N), interleaved in the same "
                f"processes (`tp_bench`). Speed-up is TP=1 time over TP=N time (> 1: TP faster); bytes are "
                f"those the region operations sent in one step against one all-reduce of the activation "
                f"forward and one backward.\n\n")
        text += self.save(fig, "tp_mlp.png", "Tensor-parallel MLP: speed-up and bytes communicated", "tp")
        rows = []
        for d in docs:
            calls = d.get("calls_per_step", {})
            rows.append([d["ranks"], d["tp"], fmt(d["median_s"]["tp1"] * 1e3, 2), fmt(d["median_s"]["tpN"] * 1e3, 2),
                         fmt(d["speedup"]), f"{d['bytes_per_step'] / 1e6:.2f}", f"{d['bytes_minimum'] / 1e6:.2f}",
                         fmt(d["bytes_per_step"] / d["bytes_minimum"] if d["bytes_minimum"] else float("nan"), 2),
                         ", ".join(f"{k} {v}" for k, v in calls.items() if v),
                         "yes" if d["correct"] else "**NO**"])
        text += "\n" + table(["ranks", "TP", "TP=1 ms", "TP=N ms", "speed-up", "MB sent", "MB minimum",
                              "sent/minimum", "calls per step", "output equal"], rows)
        return text

    def pipeline(self):
        d = self.result("pipeline_np2.json",
                        "pipeline schedules: no pipeline_np2.json (BENCHMARKS without `pipeline`, or the run failed)")
        if d is None:
            return None
        runs = d["schedules"]
        plt = self.plt
        colors = {"F": "C0", "B": "C1", "W": "C2", "C": "0.8"}
        fig, axes = plt.subplots(len(runs), 1, figsize=(8.4, 1.15 * len(runs) + 1.2), sharex=True)
        axes = axes if len(runs) > 1 else [axes]
        for ax, run in zip(axes, runs):
            lanes = run.get("median_step_timeline", [])
            for rank, actions in enumerate(lanes):
                for name, kind, start, end in actions:
                    if kind == "C" and end - start < 0.05:
                        continue  # a message group that did not wait: invisible at this scale
                    ax.broken_barh([(start, end - start)], (rank - 0.4, 0.8), facecolors=colors[kind],
                                   edgecolors="white", linewidth=0.3)
                    if kind != "C" and end - start > 6:
                        ax.text((start + end) / 2, rank, name.split("@")[0], ha="center", va="center", fontsize=5.5,
                                color="white")
            ax.set_yticks(range(len(lanes)))
            ax.set_yticklabels([f"rank {r}" for r in range(len(lanes))])
            ax.invert_yaxis()
            ax.grid(axis="y", visible=False)
            ax.set_title(f"{run['schedule']}: step {run['step_seconds_median'] * 1e3:.0f} ms, bubble measured "
                         f"{run['bubble_median']:.3f}, promised {run['bubble_promised']:.3f}", fontsize=8.5, loc="left")
        axes[-1].set_xlabel("ms from the step's start (the step whose time is the median)")
        handles = [plt.Rectangle((0, 0), 1, 1, color=colors[k]) for k in "FBWC"]
        self.layout(fig, "pipeline")
        fig.subplots_adjust(top=1 - 0.5 / fig.get_size_inches()[1])  # room for the legend above the first plot
        fig.legend(handles, ["forward", "backward (for ZB-H1: the input gradient)", "weight gradient (ZB-H1)",
                             "in a message group (waiting)"], loc="upper center", ncol=4, fontsize=7, frameon=False)
        text = (f"A stack of {d['layers']} MLP blocks (hidden {d['hidden']} -> {4 * d['hidden']} -> {d['hidden']}, "
                f"residual, linears through `loom::pp::linear`) cut into stages over {d['ranks']} ranks, "
                f"{d['micro_batches']} micro-batches of [{d['rows']}, {d['hidden']}] float32, one thread per rank; "
                f"the schedules take turns step by step in the same processes (`pipeline_bench`, medians of "
                f"{d['steps']} steps). The bubble is measured (1 - compute / step time, averaged over the ranks) "
                f"beside what the proven plan promises at unit costs (a forward 1, a backward 2, or 1 + 1 for ZB-H1's "
                f"input and weight gradients); the activation peak is the heap in use above the step's start, at its "
                f"highest. The timeline is each rank's actions in one step of each schedule (the one whose time is "
                f"the median); white is idle outside any message group.\n\n")
        text += self.save(fig, "pipeline_timeline.png", "Pipeline schedules: one step of each, rank by rank", "pipeline")
        gpipe = runs[0]["activation_peak_bytes"] or 1
        rows = [[r["schedule"], r["virtual_stages"], fmt(r["step_seconds_median"] * 1e3, 1), fmt(r["bubble_median"]),
                 fmt(r["bubble_promised"]), f"{r['bubble_median'] - r['bubble_promised']:+.3f}",
                 fmt(r.get("bubble_at_measured_costs", float("nan"))),
                 f"{r['activation_peak_bytes'] / 1048576:.1f} MiB", fmt(r["activation_peak_bytes"] / gpipe, 2)] for r in runs]
        text += ("\nThe plan at the measured costs is the plan replayed (`loom::pp::prove`) with each measured "
                 "step's own action times and instant messages, the median over the steps: the measured bubble "
                 "above it is what messages and the executor cost, and it above the promise is what unequal costs "
                 "cost (stages, or cores running at different speeds).\n")
        text += "\n" + table(["schedule", "virtual stages", "step ms", "bubble", "promised", "off by",
                              "plan at the measured costs", "activation peak", "of GPipe's"], rows)
        torch_rows = []
        for name in ("pipeline_torch_np2.json", "pipeline_torch_zb_np2.json"):
            tp = self.path(name)
            if not os.path.exists(tp):
                continue
            t = load(tp)
            ours, theirs = t["median_seconds"]["torchloom"], t["median_seconds"]["torch.distributed.pipelining"]
            label = {"1f1b": "1F1B", "zero-bubble": "ZB-H1", "gpipe": "GPipe"}.get(t["schedule"], t["schedule"])
            torch_rows.append([label, fmt(ours * 1e3, 1), fmt(theirs * 1e3, 1), fmt(t["ratio"]),
                               fmt(t["bubble_measured"]), fmt(t["bubble_promised"])])
        if torch_rows:
            text += ("\nAgainst `torch.distributed.pipelining`'s Schedule1F1B over Gloo on the same stages "
                     "(`pipeline_torch_bench.py`, the two taking turns step by step; ratio < 1: torchloom faster):\n\n")
            text += table(["torchloom schedule", "torchloom ms", "torch 1F1B ms", "ratio", "torchloom bubble",
                           "promised"], torch_rows)
        return text

    def amp(self):
        d = self.result("amp.json", "GradScaler: no amp.json (BENCHMARKS without `amp`, or the run failed)")
        if d is None:
            return None
        ws = d["workloads"]
        keys = ["loom_unscale", "foreach_mul_no_check", "copy_per_tensor", "copy_flat", "naive_loop"]
        names = {"loom_unscale": "loom GradScaler.unscale_", "foreach_mul_no_check": "torch._foreach_mul_ (no check)",
                 "copy_per_tensor": "copy, per tensor", "copy_flat": "copy, one flat buffer",
                 "naive_loop": "naive per-tensor loop", "python": "PyTorch GradScaler.unscale_"}
        colors = {"loom_unscale": "C0", "python": "C3", "foreach_mul_no_check": "C9", "copy_per_tensor": "C7",
                  "copy_flat": "0.75", "naive_loop": "C1"}
        order = ["loom_unscale", "python"] + keys[1:]
        plt = self.plt
        fig, ax = plt.subplots(figsize=(7.6, 3.9))
        w = 0.8 / len(order)
        for i, k in enumerate(order):
            vals = []
            for wl in ws:
                if k == "python":
                    py = wl.get("python")
                    vals.append(2 * wl["bytes"] / py["unscale_us"] / 1e3 if py else float("nan"))
                else:
                    vals.append(wl["gbps"][k])
            xs = [j - 0.4 + w * (i + 0.5) for j in range(len(ws))]
            bars = ax.bar(xs, vals, w, label=names[k], color=colors[k])
            for bar in bars:
                h = bar.get_height()
                if h == h:
                    ax.annotate(f"{h:.1f}", (bar.get_x() + bar.get_width() / 2, h), ha="center", va="bottom",
                                fontsize=6.5)
        ax.set_xticks(range(len(ws)))
        ax.set_xticklabels([f"{wl['name']}: {wl['tensors']} tensors, {wl['bytes'] / 1e6:.0f} MB" for wl in ws])
        ax.set_ylabel("GB/s (2 x gradient bytes / median time)")
        ax.set_title(f"GradScaler unscale_ on the CPU, float32, {d.get('threads', '?')} thread")
        ax.legend(ncol=2, loc="upper left")
        top = max(max(wl["gbps"].values()) for wl in ws)
        ax.set_ylim(0, top * 1.45)
        self.layout(fig, "amp")
        text = ("`loom::GradScaler::unscale_` (divide every gradient by the scale and check for inf/NaN) "
                "against PyTorch's `torch.amp.GradScaler.unscale_` (`amp_reference.py`, a separate process), "
                "a naive loop, the same in-place pass without the check, and memory copies (`amp_bench`). "
                "GB/s counts every gradient byte read once and written once. Ratios are loom's bandwidth "
                "over the reference's (> 1: loom faster); the normalised one divides each program's time by "
                "its own per-tensor copy, which cancels drift between the two processes.\n\n")
        text += self.save(fig, "amp_unscale.png", "GradScaler unscale_: torchloom against PyTorch and memory", "amp")
        rows = []
        for wl in ws:
            py = wl.get("python") or {}
            rows.append([wl["name"], wl["tensors"], f"{wl['bytes'] / 1e6:.1f}", fmt(wl["median_us"]["loom_unscale"], 0),
                         fmt(py.get("unscale_us"), 0), fmt(py.get("ratio_loom_over_python_bandwidth")),
                         fmt(py.get("ratio_loom_over_python_normalised_by_copy")),
                         fmt(wl["ratio_unscale_over_copy_bandwidth"]) + (" (>= 0.9 met)" if wl["copy_target_met"]
                                                                         else " (>= 0.9 MISSED)"),
                         fmt(wl["ratio_unscale_over_foreach_mul_bandwidth"]), f"{wl['speedup_over_naive']:.1f}x",
                         "yes" if wl["correct"] and wl["inf_detected"] else "**NO**"])
        text += "\n" + table(["workload", "tensors", "MB", "loom us", "PyTorch us", "loom/PyTorch bw",
                              "normalised by copy", "loom/copy bw", "loom/`_foreach_mul_` bw", "vs naive loop",
                              "exact, inf caught"], rows)
        return text

    def checkpoint(self):
        p = self.path("checkpoint.json")
        if not os.path.exists(p):
            self.skipped.append("checkpoint: no checkpoint.json (BENCHMARKS without `checkpoint`, or the run failed)")
            return None
        d = load(p)
        s = {k: med(v) for k, v in d["samples_s"].items()}
        gb, state_gb = d["checkpoint_bytes"] / 1e9, d["state_bytes"] / 1e9
        plt = self.plt
        fig, (a1, a2) = plt.subplots(1, 2, figsize=(8.6, 3.8), gridspec_kw={"width_ratios": [2, 1]})
        bars = [("save\n(durable)", gb / s["save"], "C0"), ("write+\nfdatasync", state_gb / s["write_fdatasync"], "C7"),
                ("torch::save\n+fsync", state_gb / s["torch_save_fsync"], "C3"),
                ("load\n(cold)", gb / s["load_cold"], "C0"), ("read()\n(cold)", gb / s["read_cold"], "C7"),
                ("torch::load\n(cold)", state_gb / s["torch_load_cold"], "C3")]
        xs = [0, 1, 2, 3.6, 4.6, 5.6]
        if "read_cold_new_memory" in s:  # results from before this reference have no such bar
            bars.insert(5, ("read() into\nnew memory", gb / s["read_cold_new_memory"], "C8"))
            xs = [0, 1, 2, 3.6, 4.6, 5.6, 6.6]
        bs = a1.bar(xs, [b[1] for b in bars], 0.8, color=[b[2] for b in bars])
        for bar in bs:
            a1.annotate(f"{bar.get_height():.2f}", (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                        ha="center", va="bottom", fontsize=7.5)
        a1.set_xticks(xs)
        a1.set_xticklabels([b[0] for b in bars], fontsize=7.5)
        a1.set_ylabel("GB/s (state bytes / median time)")
        a1.set_title(f"save and load, {state_gb * 1e3:.0f} MB of model + Adam state")
        a1.set_ylim(0, max(b[1] for b in bars) * 1.45)
        from matplotlib.patches import Patch

        a1.legend(handles=[Patch(color="C0", label="torchloom Checkpointer"),
                           Patch(color="C7", label="the disk (raw write / read)"),
                           Patch(color="C8", label="read() into new memory"),
                           Patch(color="C3", label="torch::save / torch::load")], loc="upper left", fontsize=7)
        st = [("async save\nstall", s["async_stall"] * 1e3, "C0"), ("memcpy of\nthe state", s["memcpy"] * 1e3, "C7")]
        bs = a2.bar(range(2), [b[1] for b in st], 0.7, color=[b[2] for b in st])
        for bar in bs:
            a2.annotate(f"{bar.get_height():.1f}", (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                        ha="center", va="bottom", fontsize=7.5)
        a2.set_xticks(range(2))
        a2.set_xticklabels([b[0] for b in st], fontsize=7.5)
        a2.set_ylabel("ms (median)")
        a2.set_title("training stall of an async save")
        a2.set_ylim(0, max(b[1] for b in st) * 1.2)
        self.layout(fig, "checkpoint")
        text = (f"`loom::Checkpointer` on the disk of the results directory, one process, {d['rounds']} rounds "
                f"interleaving every variant, medians (`checkpoint_bench`): the durable save against "
                f"write+fdatasync of the same bytes and torch::save + fsync, the cold load (page cache evicted) "
                f"against read() of the same files (into a reused buffer: the disk; and, for information, into "
                f"memory allocated for the read, as a load's must be; also for information, that much new "
                f"memory's pages faulted in with no disk, the floor of a load that cannot write into live "
                f"memory before its verdict) and torch::load, the async save's stall "
                f"against a memcpy. "
                f"Bandwidth ratios are ours over the reference (higher is better), time ratios ours over the "
                f"reference (lower is better), as `checkpoint_bench` prints them.\n\n")
        text += self.save(fig, "checkpoint.png", "Checkpoint throughput against the disk, memory and torch::save/load", "checkpoint")
        rows = [[r["row"], r["ours"], r["reference"], r["reference_value"], fmt(r["ratio"]), r["target"],
                 "" if r["target"] == "(info)" else ("met" if r["met"] else "**missed**")] for r in d["table"]]
        text += "\n" + table(["measure", "ours", "reference", "reference value", "ratio", "target", ""], rows)
        return text

    def placement(self):
        p = self.path("placement.json")
        if not os.path.exists(p):
            self.skipped.append("placement: no placement.json (BENCHMARKS without `placement`)")
            return None
        d = load(p)
        rows = d["results"]

        def ratio(naive, planned):
            return naive / planned if planned > 0 else float("nan")

        plt = self.plt
        fig, (a1, a2) = plt.subplots(1, 2, figsize=(9.6, 4.6), gridspec_kw={"width_ratios": [3, 2]})
        # Only the cases where the plan differs from the naive layout get a bar; the rest are counted.
        differ = [r for r in rows if abs(ratio(r["naive_tp_allreduce_us"], r["tp_allreduce_us"]) - 1) > 0.001 or
                  abs(ratio(r["naive_dp_allreduce_us"], r["dp_allreduce_us"]) - 1) > 0.001]
        labels = [f"{r['topology'].replace('.txt', '')[:34]}, tp {r['tp']}" for r in differ]
        ys = range(len(differ))
        tpr = [ratio(r["naive_tp_allreduce_us"], r["tp_allreduce_us"]) for r in differ]
        dpr = [ratio(r["naive_dp_allreduce_us"], r["dp_allreduce_us"]) for r in differ]
        a1.barh([y - 0.2 for y in ys], tpr, 0.4, label="TP group all-reduce", color="C0")
        a1.barh([y + 0.2 for y in ys], dpr, 0.4, label="DP all-reduce", color="C2")
        for y, v in zip(ys, tpr):
            if v == v:
                a1.annotate(f"{v:.2f}", (v, y - 0.2), va="center", fontsize=6.5, xytext=(2, 0),
                            textcoords="offset points")
        for y, v in zip(ys, dpr):
            if v == v:
                a1.annotate(f"{v:.2f}", (v, y + 0.2), va="center", fontsize=6.5, xytext=(2, 0),
                            textcoords="offset points")
        a1.axvline(1, color="k", lw=0.8)
        a1.set_yticks(list(ys))
        a1.set_yticklabels(labels, fontsize=6.5)
        a1.invert_yaxis()
        a1.set_xlabel("naive / planned modelled time (> 1: plan faster)")
        a1.set_title(f"the {len(differ)} of {len(rows)} cases where the plan differs from naive "
                     f"(the other {len(rows) - len(differ)}: equal)", fontsize=9)
        a1.legend(loc="upper right")
        a1.set_xlim(0, max([v for v in tpr + dpr if v == v] + [1]) * 1.45)
        sims = [r for r in rows if r["topology"].startswith("sim ")]
        kinds = sorted({(r["topology"].split()[-1], r["tp"]) for r in sims})
        for i, (kind, tp) in enumerate(kinds):
            pts = sorted((r["world_size"], r["planner_ms"]) for r in sims
                         if r["topology"].split()[-1] == kind and r["tp"] == tp)
            a2.plot([p[0] for p in pts], [p[1] for p in pts], "o-" if "dgx" in kind else "s--", ms=3,
                    label=f"{kind}, tp {tp}", color=f"C{i}")
        a2.set_xscale("log", base=2)
        a2.set_yscale("log")
        a2.set_xlabel("ranks (simulated clusters of n x 8 GPUs)")
        a2.set_ylabel("planner run time (ms)")
        a2.set_title("planner run time")
        a2.legend(fontsize=6.5)
        self.layout(fig, "placement")
        text = (f"Modelled, no GPU needed (`placement_bench`): the all-reduce time of a "
                f"{human_bytes(d['message_bytes'])} message in the planned TP groups and DP rings against the "
                f"naive layout (consecutive ranks) on every topology fixture and on simulated clusters of up to "
                f"1,024 nodes, and the planner's own run time. Ratios are naive over planned (> 1: the plan is "
                f"faster), as the program prints them.\n\n")
        text += self.save(fig, "placement.png", "Planner layouts against naive ones (modelled), and planner time", "placement")
        trs = []
        for r in rows:
            trs.append([r["topology"], r["nodes"], r["gpus_per_node"], r["tp"], r["world_size"],
                        fmt(r["tp_allreduce_us"], 1), fmt(r["naive_tp_allreduce_us"], 1),
                        fmt(ratio(r["naive_tp_allreduce_us"], r["tp_allreduce_us"]), 2),
                        fmt(r["dp_allreduce_us"], 1), fmt(r["naive_dp_allreduce_us"], 1),
                        fmt(ratio(r["naive_dp_allreduce_us"], r["dp_allreduce_us"]), 2), fmt(r["planner_ms"], 3)])
        better = sum(1 for r in rows if ratio(r["naive_tp_allreduce_us"], r["tp_allreduce_us"]) > 1.001 or
                     ratio(r["naive_dp_allreduce_us"], r["dp_allreduce_us"]) > 1.001)
        worse = sum(1 for r in rows if ratio(r["naive_tp_allreduce_us"], r["tp_allreduce_us"]) < 0.999 or
                    ratio(r["naive_dp_allreduce_us"], r["dp_allreduce_us"]) < 0.999)
        text += (f"\nThe plan is faster than the naive layout in {better} of {len(rows)} cases and slower in "
                 f"{worse}; the largest planner run took {max(r['planner_ms'] for r in rows):.1f} ms.\n\n")
        header = ["topology", "nodes", "GPUs/node", "TP", "ranks", "TP us", "naive TP us", "TP naive/plan",
                  "DP us", "naive DP us", "DP naive/plan", "planner ms"]
        keep = [i for i, r in enumerate(rows) if r in differ]
        text += "Cases where the plan differs from the naive layout:\n\n" + table(header, [trs[i] for i in keep])
        text += ("\n<details><summary>All " + str(len(rows)) + " cases</summary>\n\n" + table(header, trs) +
                 "\n</details>\n")
        return text

    def soak(self):
        p = self.path("soak.txt")
        if not os.path.exists(p):
            self.skipped.append("soak: no soak.txt (BENCHMARKS without `soak`)")
            return None
        with open(p, errors="replace") as f:
            lines = f.read().strip().splitlines()
        pat = re.compile(r"\[rank (\d+)\] soak: (\d+) operations checked, (\d+) wrong, ([\d.]+) MB issued in "
                         r"([\d.]+) s, resident memory ([+-][\d.]+) MB")
        ranks = sorted((tuple(float(g) for g in m.groups()) for m in map(pat.search, lines) if m))
        text = ("The long load run (`loom_soak`: mixed asynchronous collectives from many ranks, every result "
                "checked, resident memory after warm-up watched). ")
        if ranks:
            text += (f"{len(ranks)} ranks, {int(ranks[0][1])} operations each, "
                     f"{int(sum(r[2] for r in ranks))} wrong results, {ranks[0][3]:g} MB issued per rank in "
                     f"{max(r[4] for r in ranks):g} s, resident memory growth after warm-up at most "
                     f"{max(r[5] for r in ranks):+g} MB.\n\n")
        else:
            text += "Its output did not contain the per-rank summary lines.\n\n"
        text += "The output's last lines:\n\n```\n" + "\n".join(sorted(lines[-12:])) + "\n```\n"
        return text

    # -----------------------------------------------------------------------------------------

    def write(self):
        os.makedirs(self.out, exist_ok=True)
        for old in PLOTS:  # a plot from an earlier run must not outlive its missing section
            if os.path.exists(os.path.join(self.out, old)):
                os.remove(os.path.join(self.out, old))
        self.section("All-reduce bus bandwidth: torchloom, raw MPI, PyTorch Gloo", self.allreduce)
        self.section("DDP step time: torchloom against PyTorch DDP", self.ddp)
        self.section("PyTorch's DDP over torch.distributed backend \"loom\" against \"gloo\"", self.ddp_backend)
        self.section("ZeRO: memory per rank and step time against DDP", self.zero)
        self.section("ZeRO's collectives: reduce_scatter and all_gather against raw MPI", self.shard_collectives)
        self.section("Tensor parallelism: speed-up and bytes communicated", self.tp)
        self.section("Pipeline schedules: bubble, activation memory and one step's timeline", self.pipeline)
        self.section("GradScaler: torchloom against PyTorch", self.amp)
        self.section("Checkpoints: throughput against the disk", self.checkpoint)
        self.section("Placement: planned layouts against naive ones", self.placement)
        self.section("Soak", self.soak)
        m = self.machine or {}
        head = ["# torchloom benchmark report", "",
                "Generated by `python3 benchmarks/report.py` from the JSON that `bash benchmarks/run_all.sh` "
                "writes; **do not edit by hand**: `bash benchmarks/run_all.sh` reruns the benchmarks and regenerates "
                "it, `python3 benchmarks/report.py [results-dir]` regenerates it from existing results. Machines "
                "are noisy: compare ratios from one run, not numbers across runs. Every ratio is ours against "
                "the reference, as the measuring program defines it; each table says which way is better.", ""]
        note = self.note or m.get("settings", {}).get("note", "")
        if note:
            head += [f"> **{note}**", ""]
        if m:
            s = m.get("settings", {})
            head += ["| machine and run | |", "|---|---|",
                     f"| CPU | {m.get('cpu', '?')} ({m.get('cores', '?')} cores online) |",
                     f"| memory | {m.get('memory_gb', '?')} GB |",
                     f"| host, kernel | {m.get('hostname', '?')}, Linux {m.get('kernel', '?')} |",
                     f"| run started | {m.get('date_utc', '?')} |",
                     f"| commit | {m.get('git_commit') or '?'} ({m.get('git_branch') or '?'}) |",
                     f"| torch, MPI, Python | {m.get('torch', '?')}; {m.get('mpi', '?')}; {m.get('python', '?')} |"]
            head += [f"| {k} | {shown_path(v) if k == 'results' else v} |" for k, v in s.items() if k != "note"]
            head.append("")
        else:
            head += ["(No machine.json in the results directory: the machine and run are unknown.)", ""]
        head.append(f"Results directory: `{shown_path(self.results)}`; "
                    f"sections: " + (", ".join(f"[{p.splitlines()[0][3:]}](#{anchor(p.splitlines()[0][3:])})"
                                               for p in self.parts) or "none") + ".")
        head.append("")
        if self.skipped:
            head += ["Not in this report:", ""] + [f"- {s}" for s in self.skipped] + [""]
        with open(os.path.join(self.out, "README.md"), "w") as f:
            f.write("\n".join(head) + "\n" + "\n".join(self.parts))
        print(f"report.py: wrote {os.path.join(self.out, 'README.md')} and {len(self.figures)} plot(s); "
              f"{len(self.parts)} section(s), {len(self.skipped)} missing")


def anchor(title):
    a = re.sub(r"[^\w\- ]", "", title.lower()).replace(" ", "-")
    return a


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("results", nargs="?", default=os.path.join(ROOT, "build", "benchmark-results"))
    p.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "report"))
    p.add_argument("--note", default="", help="a line printed at the top of the report (e.g. how the run was reduced)")
    p.add_argument("--write-machine", metavar="PATH", help="write the machine description and exit")
    p.add_argument("--setting", action="append", default=[], metavar="KEY=VALUE",
                   help="with --write-machine: a setting of the run to record")
    args = p.parse_args()
    if args.write_machine:
        write_machine(args.write_machine, args.setting)
        return 0
    results = os.path.abspath(args.results)
    if not os.path.isdir(results):
        sys.exit(f"report.py: no results directory {results} (run bash benchmarks/run_all.sh first)")
    mp = os.path.join(results, "machine.json")
    machine = None
    if os.path.exists(mp):
        try:
            machine = load(mp)
        except Exception as e:
            print(f"report.py: {mp} unreadable ({e}); the report will say the machine is unknown", file=sys.stderr)
    Report(results, os.path.abspath(args.out), machine, args.note).write()
    return 0


if __name__ == "__main__":
    sys.exit(main())
