"""Plots and reports: treerl plot, treerl compare, treerl eval --per-task, and plots without matplotlib."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from treerl.cli import main
from treerl.learners.core import _write_plots
from treerl.learners.plots import PLOTS, write_plots
from treerl.rollout import Group
from treerl.rollout.summary import RolloutStats, task_rows, task_table

PNG = b"\x89PNG\r\n\x1a\n"


def fake_run(root: Path, name: str, rewards: list[float], *, lr: float, success: tuple[float, float]) -> Path:
    """A learn output directory as `treerl learn` leaves it: metrics, summary and config."""
    run = root / name
    run.mkdir()
    lines = []
    for step, reward in enumerate(rewards, 1):
        lines.append({"step": step, "reward/mean": reward, "reward/std": 0.1, "reward/success_rate": reward,
                      "loss/policy": -0.01 * step, "entropy/mean": 1.0 / step, "clip/region_frac": 0.0,
                      "is/ratio_mean": 1.0, "tree/packing_ratio": 2.5, "perf/rollout_s": 1.0, "perf/sync_s": 0.1,
                      "perf/step_s": 2.0, "perf/tokens_per_s": 300.0, "tool_calls/ok": 6.0 + step,
                      **({"tool_calls/malformed": 2.0} if step % 2 else {})})
    (run / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in lines) + '{"step": 9, "rew')  # torn
    (run / "summary.json").write_text(json.dumps({"eval_start": {"success_rate": success[0]},
                                                  "eval_end": {"success_rate": success[1]}}))
    (run / "config.json").write_text(json.dumps({"output_dir": str(run), "learning_rate": lr, "steps": len(rewards)}))
    return run


def test_compare_prints_final_metrics_and_differing_config(tmp_path, capsys):
    a = fake_run(tmp_path, "a", [0.1, 0.2, 0.3, 0.5], lr=2e-4, success=(0.2, 0.6))
    b = fake_run(tmp_path, "b", [0.1, 0.1, 0.2, 0.2], lr=1e-4, success=(0.2, 0.3))
    assert main(["compare", str(a), str(b), "--last", "2"]) == 0
    rows = {line.split()[0]: line.split()[1:] for line in capsys.readouterr().out.splitlines() if line.strip()}
    assert rows["reward/mean"] == ["0.4", "0.2"]  # the mean of each run's last 2 steps
    assert rows["eval/success_end"] == ["60.0%", "30.0%"] and rows["time/steps_s"] == ["8.00", "s", "8.00", "s"]
    assert rows["learning_rate"] == ["0.0002", "0.0001"] and "steps" in rows
    assert main(["compare", str(a), str(b), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["runs"]["a"]["eval/success_start"] == 0.2
    assert data["runs"]["b"]["reward/mean"] == pytest.approx(0.15, abs=1e-9)
    assert list(data["config_differences"]) == ["learning_rate", "output_dir"]


def test_compare_takes_its_runs_from_a_config_file_too(tmp_path, capsys):
    """`paths` is an option of the config like any other: a --config file may name the runs."""
    a = fake_run(tmp_path, "a", [0.1, 0.5], lr=2e-4, success=(0.2, 0.6))
    b = fake_run(tmp_path, "b", [0.1, 0.2], lr=1e-4, success=(0.2, 0.3))
    config = tmp_path / "compare.yaml"
    config.write_text(f"paths: [{a}, {b}]\nlast: 1\n")
    assert main(["compare", "--config", str(config)]) == 0
    rows = {line.split()[0]: line.split()[1:] for line in capsys.readouterr().out.splitlines() if line.strip()}
    assert rows["reward/mean"] == ["0.5", "0.2"]
    assert main(["compare", str(a), "--config", str(config)]) == 0  # the command line's runs win
    assert capsys.readouterr().out.splitlines()[0].split()[-1] == "a"
    assert main(["compare"]) == 2
    assert "paths: name at least one run directory" in capsys.readouterr().err


def test_plot_draws_every_figure_and_overlays_runs(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    a = fake_run(tmp_path, "a", [0.1, 0.2, 0.3, 0.5], lr=2e-4, success=(0.2, 0.6))
    b = fake_run(tmp_path, "b", [0.5, 0.4, 0.2, 0.1], lr=1e-4, success=(0.2, 0.3))
    single = write_plots([a])  # one run: into RUN/plots
    assert [p.parent for p in single] == [a / "plots"] * len(PLOTS)
    assert main(["plot", str(a), str(b), "-o", str(tmp_path / "both")]) == 0
    printed = capsys.readouterr().out.split()
    assert sorted(Path(p).name for p in printed) == sorted(f"{n}.png" for n in PLOTS)
    for name in PLOTS:
        overlay, alone = (tmp_path / "both" / f"{name}.png").read_bytes(), (a / "plots" / f"{name}.png").read_bytes()
        assert overlay.startswith(PNG) and alone.startswith(PNG) and overlay != alone


def test_overlaid_plots_name_each_run_in_held_out_labels_and_step_time(tmp_path):
    pytest.importorskip("matplotlib")
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    from treerl.learners.plots import _DRAW, read_run

    runs = [read_run(fake_run(tmp_path, f"run{i}", [0.1, 0.3], lr=1e-4, success=(0.1 * i, 0.5)), f"run{i}")
            for i in range(6)]
    fig = Figure()
    FigureCanvasAgg(fig)
    _DRAW["reward"](fig, runs)
    held_out = [t.get_text() for t in fig.axes[0].texts]
    assert held_out[:2] == ["run0: held-out 0%", "run0: held-out 50%"] and len(held_out) == 12
    fig = Figure()
    FigureCanvasAgg(fig)
    _DRAW["step_time"](fig, runs)  # every run gets its panel, not only the first four
    assert [ax.get_title() for ax in fig.axes] == [f"Step time: run{i}" for i in range(6)]


def test_without_matplotlib_plot_names_the_extra_and_learn_only_notes_it(tmp_path, capsys, monkeypatch):
    run = fake_run(tmp_path, "a", [0.1, 0.2], lr=2e-4, success=(0.2, 0.6))
    for module in ("matplotlib", "matplotlib.figure", "matplotlib.backends.backend_agg"):
        monkeypatch.setitem(sys.modules, module, None)  # import now fails as when not installed
    assert main(["plot", str(run)]) == 2
    assert "pip install 'treerl[plot]'" in capsys.readouterr().err
    _write_plots(run)  # what `treerl learn` does at the end: a note, no failure
    assert "no plots:" in capsys.readouterr().err and not (run / "plots").exists()


def test_eval_per_task_json_from_the_command_line(capsys):
    assert main(["eval", "--num-episodes", "1", "--max-new-tokens", "48", "--per-task", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    [task] = report["tasks"]
    assert task["task"] == "seed-10000" and task["answer"] is not None and task["turns"] >= 1
    assert task["success_rate"] == report["success_rate"] and sum(task["tool_calls"].values()) >= 1


def test_per_task_table_has_one_row_per_task():
    groups = []
    for seed, (reward, error) in enumerate([(1.0, None), (0.0, "malformed")]):
        g = Group(task_key=f"seed-{seed}", env_id="demo",
                  info={"answer": str(seed), **({"task_id": "row-7"} if seed else {})})
        root = g.add_segment("prompt", [1, 2])
        leaf = g.add_segment("sampled", [3, 4, 5], parent=root, logprobs=[-0.1] * 3)
        g.add_episode(leaf=leaf, reward=reward, rewards=[0.0, reward], termination="final_answer", metrics={"turns": 2},
                      tool_calls=[{"name": "calculator", "error": error}])
        groups.append(g)
    lines = task_table(task_rows(groups)).splitlines()
    assert lines[0].split() == ["task", "id", "answer", "reward", "success", "turns", "tokens", "tool", "calls",
                                "ended"]
    assert lines[2].split() == ["seed-0", "-", "0", "1.000", "100%", "2.0", "3", "ok=1", "final_answer=1"]
    assert lines[3].split() == ["seed-1", "row-7", "1", "0.000", "0%", "2.0", "3", "malformed=1", "final_answer=1"]


def test_eval_warns_when_the_chat_template_ignores_tools(tmp_path, capsys):
    from treerl.models import load_default_model

    model, tok = load_default_model()
    tok.chat_template = "{% for m in messages %}{{ m['content'] }}\n{% endfor %}"  # no tools, no tool turns
    model.save_pretrained(tmp_path / "m")
    tok.save_pretrained(tmp_path / "m")
    assert main(["eval", "--model", str(tmp_path / "m"), "--num-episodes", "1", "--max-new-tokens", "8"]) == 0
    err = capsys.readouterr().err
    assert "warning: the chat template ignores `tools`" in err  # as rollout and learn say before they play


def test_tokens_per_s_counts_a_turn_sampled_before_a_fork_once():
    # One generation sampled 4 tokens, then branched into 3 continuations of 2 tokens each:
    # the policy generated 4 + 3 * 2 = 10 tokens, though each episode's path holds 6 sampled ones.
    g = Group(task_key="seed-0", env_id="demo")
    root = g.add_segment("prompt", [1, 2])
    first = g.add_segment("sampled", [3, 4, 5, 6], parent=root, logprobs=[-0.1] * 4)
    bridge = g.add_segment("env", [7], parent=first)
    for b in range(3):
        leaf = g.add_segment("sampled", [8, 9 + b], parent=bridge, logprobs=[-0.1] * 2)
        g.add_episode(leaf=leaf, reward=1.0, rewards=[0.0, 1.0], termination="terminated")
    stats = RolloutStats()
    stats.add(g)
    stats.wall_s = 2.0
    assert stats.summary()["perf/tokens_per_s"] == 5.0


def test_a_resumed_rollout_says_its_summary_leaves_out_the_tasks_already_in_the_file(tmp_path, capsys):
    args = ["rollout", "--group-size", "1", "--max-new-tokens", "4", "--progress", "false", "--out", str(tmp_path / "r.jsonl")]
    assert main([*args, "--num-tasks", "1"]) == 0
    assert "resumed" not in capsys.readouterr().out
    assert main([*args, "--num-tasks", "2"]) == 0
    rows = capsys.readouterr().out
    assert "1 task(s) already in" in rows and "groups / episodes  1 / 1" in rows
