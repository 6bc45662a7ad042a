"""What a study leaves in its output: ``tune.json`` (every trial), ``best.yaml`` (the best trial's spec, runnable
with ``kubetune run``), ``report.html`` (the table and Optuna's plots) and the table printed at the end."""

from __future__ import annotations

import base64
import html
import json
from pathlib import Path

import yaml

from kubetune.paths import write_atomic
from kubetune.tune import space


def summary(study, out: Path) -> dict:
    """Every trial: its number, state, values, objective value, intermediate evaluations, directory."""
    trials = []
    every = study.get_trials(deepcopy=False)
    resumed = {t.user_attrs["resumes"]: t.number for t in every if t.user_attrs.get("resumes") is not None}
    for t in every:
        trials.append(
            {
                "number": t.number,
                # a trial a session left running: it ran again as trial `resumed_by`, from its checkpoint
                "state": "interrupted" if t.number in resumed else t.state.name.lower(),
                "resumed_by": resumed.get(t.number),
                "params": t.params,
                "value": t.value,
                "intermediate": {str(k): v for k, v in sorted(t.intermediate_values.items())},
                "dir": str(out / "trials" / t.user_attrs["dir"]) if t.user_attrs.get("dir") else None,
                "stopped_at": t.user_attrs.get("stopped_at"),
                "resumes": t.user_attrs.get("resumes"),
                "error": t.user_attrs.get("error"),
            }
        )
    best = None
    try:
        b = study.best_trial
        best = {"number": b.number, "value": b.value, "params": b.params}
    except ValueError:
        pass
    return {"study": study.study_name, "direction": study.direction.name.lower(), "best": best, "trials": trials}


def write(study, base: dict, out: Path, objective: str) -> dict:
    """tune.json, best.yaml (when a trial finished) and report.html; returns the summary."""
    data = {"objective": objective, **summary(study, out)}
    write_atomic(out / "tune.json", json.dumps(data, indent=1, default=str) + "\n")
    if data["best"] is not None:
        best = space.trial_spec(base, data["best"]["params"], str(out / "best"))
        header = (
            f"# The best trial of study {study.study_name} (trial {data['best']['number']}: {objective} "
            f"{data['best']['value']:.6g}).\n# kubetune run best.yaml trains it again into {out / 'best'}.\n"
        )
        write_atomic(out / "best.yaml", header + yaml.safe_dump(best, sort_keys=False))
    write_atomic(out / "report.html", _html(study, data, out))
    return data


def table(data: dict) -> str:
    """The trials as aligned text: number, state, objective value, values."""
    names = list(dict.fromkeys(k for t in data["trials"] for k in t["params"]))
    rows = [["trial", "state", data["objective"], *names]]
    for t in data["trials"]:
        value = f"{t['value']:.4f}" if isinstance(t["value"], float) else ""
        if t["state"] == "pruned" and t["intermediate"]:
            last = list(t["intermediate"].items())[-1]
            value = f"({last[1]:.4f} at step {last[0]})"
        if t["state"] == "interrupted":
            value = f"(resumed as trial {t['resumed_by']})"
        rows.append([str(t["number"]), t["state"], value, *(_fmt(t["params"].get(n)) for n in names)])
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows)


def _fmt(v) -> str:
    return "" if v is None else f"{v:.4g}" if isinstance(v, float) else str(v)


def _html(study, data: dict, out: Path) -> str:
    import warnings

    import optuna
    from optuna.exceptions import ExperimentalWarning

    images = []
    verbosity = optuna.logging.get_verbosity()
    for name, draw in _plots():
        path = out / "plots" / f"{name}.png"
        try:
            with warnings.catch_warnings():  # Optuna's plots are marked experimental; few trials make them warn
                warnings.simplefilter("ignore", ExperimentalWarning)
                warnings.simplefilter("ignore", UserWarning)
                # and log that a plot has no finished trial to show, which the table says already
                optuna.logging.set_verbosity(optuna.logging.ERROR)
                draw(study, path)
        except Exception as e:  # too few trials for a plot (importances need two finished): said in the report
            images.append(f"<p>{html.escape(name)}: not drawn ({html.escape(str(e)[:200])})</p>")
            continue
        finally:
            optuna.logging.set_verbosity(verbosity)
        images.append(f'<img alt="{name}" src="data:image/png;base64,{base64.b64encode(path.read_bytes()).decode()}">')
    text = html.escape(table(data))
    best = data["best"]
    head = (
        f"<p>Best: trial {best['number']}, {html.escape(data['objective'])} {best['value']:.6g}, "
        f"{html.escape(json.dumps(best['params']))}; its spec: best.yaml.</p>"
        if best
        else "<p>No trial finished yet.</p>"
    )
    title = html.escape(data["study"])
    return f"""<!doctype html><html><head><meta charset="utf-8"><title>kubetune tune: {title}</title>
<style>body{{font-family:system-ui,sans-serif;max-width:60rem;margin:2rem auto;padding:0 1rem}}img{{max-width:100%}}\
pre{{background:#f5f5f5;padding:1rem;overflow:auto}}</style></head><body>
<h1>kubetune tune: {title}</h1>{head}<pre>{text}</pre>{"".join(images)}</body></html>"""


def _plots():
    """Optuna's own plots (matplotlib): optimization history, parallel coordinates, parameter importances,
    intermediate values (the evaluations early stopping judged)."""

    def draw(fn):
        def run(study, path: Path) -> None:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt

            path.parent.mkdir(exist_ok=True)
            ax = fn(study)
            fig = ax.figure if hasattr(ax, "figure") else ax.flat[0].figure
            fig.set_size_inches(8, 4.5)
            fig.tight_layout()
            fig.savefig(path, dpi=90)
            plt.close(fig)

        return run

    from optuna.visualization import matplotlib as vm

    return [
        ("optimization_history", draw(vm.plot_optimization_history)),
        ("parallel_coordinate", draw(vm.plot_parallel_coordinate)),
        ("param_importances", draw(vm.plot_param_importances)),
        ("intermediate_values", draw(vm.plot_intermediate_values)),
    ]
