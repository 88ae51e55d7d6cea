"""treerl view: learn's trajectory samples, the page's data, and the page itself in headless Chromium."""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path

import pytest
import torch

from _browser import browser_missing, chromium, open_view, timed, watch
from treerl.cli import main
from treerl.learners.advantages import AdvantageConfig, compute_advantages
from treerl.learners.grpo import GRPOConfig, train
from treerl.models import load_default_model
from treerl.rollout import Group, GroupWriter, read_groups
from treerl.rollout.record import RolloutConfig, recorded_model, run_header
from treerl.rollout.trajectory import sample_files
from treerl.rollout.view import (
    SourcedGroup,
    ViewConfig,
    build_html,
    load_groups,
    load_tokenizer,
    token_pieces,
    write_view,
)

# The trajectory fields a learn run's sample must carry, and those of a handmade group with the
# tool-call outcomes a tiny model rarely produces.
MALFORMED_CALL = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "2 +</tool_call>'
PARSE_ERROR = "Could not parse the tool call: the JSON ends early. Write one JSON object."
ENV_TEXT = "\n<tool_response>\nGröße ✓ </script><b>not markup</b>\n</tool_response>"


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    """Two GRPO steps that keep two branched groups per step, with the trainer's log-probs."""
    out = tmp_path_factory.mktemp("learn")
    model, tok = load_default_model()
    train(GRPOConfig(output_dir=str(out), steps=2, tasks_per_step=2, group_size=3, branch_at_turn=1, branch_factor=2,
                     max_new_tokens=48, eval_episodes=0, progress=False, num_threads=1, sample_every=1,
                     sample_groups=2), model=model, tokenizer=tok)
    return out


def handmade_group(tok) -> Group:
    """Two samples that share "The answer is" and differ after it; one made a malformed call first."""
    g = Group(task_key="handmade-0", env_id="demo/Handmade-v0", info={"answer": "5"})
    enc = lambda text: tok(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    root = g.add_segment("prompt", enc("<|im_start|>user\nWhat is 2 + 3?<|im_end|>\n<|im_start|>assistant\n"))
    call = enc(MALFORMED_CALL)
    first = g.add_segment("sampled", call, parent=root, logprobs=[-0.05] * len(call), policy_version=2,
                          finish_reason="stop")
    env = g.add_segment("env", enc(ENV_TEXT + "<|im_end|>\n<|im_start|>assistant\n"), parent=first)
    right, wrong = enc("The answer is \\boxed{5}."), enc("The answer is \\boxed{7}.")
    a = g.add_segment("sampled", right, parent=env, logprobs=[-0.1] * len(right), policy_version=3)
    b = g.add_segment("sampled", wrong, parent=env, logprobs=[-2.0] * len(wrong), policy_version=3)
    record = {"name": "calculator", "arguments": None, "error": "malformed", "message": PARSE_ERROR, "segment": first}
    g.add_episode(leaf=a, reward=1.0, rewards=[0.0, 1.0], tool_calls=[record], termination="final_answer",
                  metrics={"turns": 2})
    g.add_episode(leaf=b, reward=0.0, rewards=[0.0, 0.0], tool_calls=[record], termination="final_answer",
                  metrics={"turns": 2})
    return g


def test_learn_keeps_samples_with_advantages_and_trainer_logprobs(run_dir):
    assert [step for step, _ in sample_files(run_dir)] == [1, 2]
    with pytest.raises(ValueError, match="sample_every=0"):
        GRPOConfig(output_dir="x", sample_every=0)
    for _, path in sample_files(run_dir):
        groups = list(read_groups(path))
        assert len(groups) == 2
        for g in groups:
            assert len(g.episodes) == 6  # 3 generations forked in 2 after the first turn
            rewards = torch.tensor(g.rewards)
            expected = compute_advantages(rewards, torch.zeros(len(rewards), dtype=torch.long),
                                          GRPOConfig(output_dir="x").advantage_config()).adv
            assert [e.advantage for e in g.episodes] == pytest.approx(expected.tolist(), abs=1e-5)
            for e in g.episodes:  # each call names the sampled segment on the episode's path that made it
                for r in e.tool_calls:
                    assert g.segments[r["segment"]].kind == "sampled" and r["segment"] in g.path_indices(e.leaf)
            for s in g.segments:
                if s.kind == "sampled":  # on-policy: the trainer gives the sampler's log-probs
                    assert len(s.trainer_logprobs) == len(s.logprobs)
                    assert max(abs(t - q) for t, q in zip(s.trainer_logprobs, s.logprobs)) < 1e-3
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert all(sum(v for k, v in m.items() if k.startswith("tool_calls/")) > 0 for m in metrics)
    pytest.importorskip("matplotlib")
    assert sorted(p.name for p in (run_dir / "plots").glob("*.png")) == sorted(
        f"{n}.png" for n in ("reward", "tool_calls", "entropy", "clip_is", "packing", "step_time"))


def test_token_pieces_rebuild_the_text_of_multibyte_characters():
    tok = load_tokenizer(None)
    text = "<tool_call>Größe ✓ 你好 🙂 \\boxed{42}</tool_call><|im_end|>"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    pieces = token_pieces(tok, ids)
    assert any(isinstance(pieces[i], list) for i in ids), "some byte-level token should split a character"
    raw = b"".join(p.encode() if isinstance(p, str) else bytes(p) for p in (pieces[i] for i in ids))
    assert raw.decode("utf-8") == tok.decode(ids, skip_special_tokens=False) == text


def test_the_page_is_one_file_with_its_data_inlined_and_escaped(tmp_path):
    tok = load_tokenizer(None)
    page = build_html([*load_groups([_write(tmp_path, [handmade_group(tok)])])], tok, title="t <b>")
    assert "Content-Security-Policy" in page and "default-src 'none'" in page
    assert not re.search(r"<(script|link|img|iframe)[^>]+(src|href)=\"(?!data:)", page), "nothing may load"
    assert "http://" not in page and "https://" not in page
    # The environment's "</script>" stays data: the only closing tags are the page's own three.
    assert page.count("</script>") == 3 and "<b>not markup</b>" not in page
    assert "<title>t &lt;b&gt;</title>" in page
    index = json.loads(re.search(r'id="treerl-index">(.*?)</script>', page, re.S).group(1))
    assert index["columns"]["task"] == ["handmade-0"] and index["columns"]["tool_errors"] == [2]


def test_view_of_a_learn_dir_without_samples_names_the_flag(tmp_path, capsys):
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n')  # a learn run that kept no samples
    assert main(["view", str(tmp_path)]) == 2
    assert "--sample-groups" in capsys.readouterr().err


def test_view_of_what_is_neither_a_run_nor_trajectories_says_so(tmp_path, capsys):
    """Not a learn directory, or a run's other files (metrics.jsonl): said as such, with no advice to
    keep samples or to --repair a file that never held trajectories."""
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "metrics.jsonl").write_text('{"step": 1, "reward/mean": 0.5}\n')
    (tmp_path / "notes").mkdir()
    for target, said in ((tmp_path / "notes", "not a `treerl learn` output directory"),
                         (tmp_path / "run" / "metrics.jsonl", "its first line is neither a treerl header nor a group")):
        assert main(["view", str(target)]) == 2
        err = capsys.readouterr().err
        assert said in err and "--sample-groups" not in err and "--repair" not in err, err


def _write(tmp_path: Path, groups: list[Group]) -> Path:
    path = tmp_path / "handmade.jsonl"
    with GroupWriter(path) as w:
        for g in groups:
            w.write(g)
    return path


@pytest.mark.skipif(browser_missing() is not None, reason=str(browser_missing()))
def test_view_of_a_rollout_file_decodes_with_the_model_its_header_names(tmp_path, monkeypatch):
    # treerl rollout --model DIR writes DIR's token ids; the shipped tokenizer would show other text.
    _, tok = load_default_model()
    tok.add_tokens(["<|only_in_mine|>"])
    tok.save_pretrained(tmp_path / "mine")
    mine = len(tok) - 1
    g = Group(task_key="seed-0", env_id="demo/Handmade-v0")
    g.add_episode(leaf=g.add_segment("sampled", [mine], parent=g.add_segment("prompt", [1, 2]), logprobs=[-1.0]), reward=0.0)
    monkeypatch.chdir(tmp_path)
    cfg = RolloutConfig(model="mine", out="r.jsonl")
    with GroupWriter(tmp_path / "r.jsonl", header=run_header(cfg, tok)) as writer:
        writer.write(g)
    out, _ = write_view(ViewConfig(paths=[str(tmp_path / "r.jsonl")]))
    assert "\\u003c|only_in_mine|>" in out.read_text(encoding="utf-8")
    # A Hub id or a shipped model's name is recorded as given, not as a path under the working directory.
    assert recorded_model("Qwen/Qwen3-0.6B") == "Qwen/Qwen3-0.6B" and recorded_model("tiny") == "tiny"


def test_the_page_in_headless_chromium(run_dir, tmp_path):
    tok = load_tokenizer(None)
    extra = _write(tmp_path, [handmade_group(tok)])
    out, num_groups = write_view(ViewConfig(paths=[str(run_dir), str(extra)], out=str(tmp_path / "view.html")))
    assert num_groups == 5
    first = next(read_groups(sample_files(run_dir)[0][1]))
    with chromium() as context:
        page = context.new_page()
        page.set_default_timeout(15_000)
        errors, requests = watch(page)
        page.goto(out.resolve().as_uri())
        page.wait_for_selector("body[data-ready='1']")
        assert page.locator("#list-count").inner_text() == "5 groups"

        # The first learn group: a tree with one leaf per episode, a tool call, rewards and advantages.
        page.locator("#list-body .row", has_text=first.task_key).first.click()
        page.wait_for_selector(".group-head")
        assert page.locator(".fact-leaves").inner_text() == str(len(first.episodes))
        assert page.locator(".node.kind-prompt").count() == 1  # the shared prompt, once
        branch = page.locator(".branch").first
        branch.locator(".branch-head").click()
        assert branch.locator(":scope > .branch-body").is_visible()
        assert branch.locator(".node").count() >= 1
        page.click("#expand-all")
        assert page.locator(".leaf:not(.extra)").count() == len(first.episodes)
        calls = [r for e in first.episodes for r in e.tool_calls if r["name"]]
        assert calls, "the tiny model calls its calculator"
        call_text = page.locator(".call .call-what").first.inner_text()
        assert call_text.startswith("calculator {\"expression\":")
        leaf_text = page.locator(".leaf").first.inner_text()
        assert re.search(r"reward \d\.\d\d", leaf_text) and "advantage" in leaf_text

        # Token colouring: off -> sampler log-prob -> sampler/trainer ratio, each token a coloured span.
        assert page.locator(".text .tok").count() == 0
        page.click("button.colour[data-colour=logprob]")
        tokens = page.locator(".kind-sampled .text .tok")
        assert tokens.count() > 10
        assert "logp" in tokens.first.get_attribute("title")
        assert tokens.first.evaluate("e => getComputedStyle(e).backgroundColor") != "rgba(0, 0, 0, 0)"
        page.click("button.colour[data-colour=ratio]")
        assert "ratio" in page.locator(".kind-sampled .text .tok").first.get_attribute("title")
        assert "this group: 1.0" in page.locator("#legend").inner_text()  # on-policy ratios are 1
        page.screenshot(path=str(tmp_path / "view-learn-group.png"))

        # The handmade group: the filter finds it; the malformed call, its message, the environment's
        # answer (multi-byte text, markup shown as text) and where the two samples diverge.
        page.click("button.colour[data-colour=none]")
        page.fill("#filter", "handmade errors>0")
        page.locator("#list-count", has_text="1 of 5 groups").wait_for()
        page.locator("#list-body .row").first.click()
        page.click("#expand-all")
        malformed = page.locator(".call.outcome-malformed")
        assert malformed.locator(".call-badge").inner_text() == "malformed"
        assert PARSE_ERROR in malformed.inner_text()
        assert page.locator(".toolcall.outcome-malformed").count() == 1
        assert "Größe ✓ </script><b>not markup</b>" in page.locator(".node.kind-env .text").inner_text()
        shared = page.locator(".node", has_text="shared by 2 samples")
        assert shared.locator(".text").inner_text().startswith("The answer is")
        assert page.locator(".leaf.success").count() == 1 and page.locator(".leaf.fail").count() == 1
        assert page.locator(".node-head .version", has_text="policy v2").count() == 1
        page.screenshot(path=str(tmp_path / "view-handmade-group.png"), full_page=True)

    assert errors == [], errors
    assert requests == [out.resolve().as_uri()], "the page must load nothing but itself"
    assert (tmp_path / "view-learn-group.png").stat().st_size > 10_000


@pytest.mark.skipif(browser_missing() is not None, reason=str(browser_missing()))
def test_ten_thousand_episodes_open_in_under_3_s(run_dir, tmp_path):
    """The learn samples' groups repeated under new task keys to 10,000 episodes, timed in the page."""
    base = [g for _, path in sample_files(run_dir) for g in read_groups(path)]
    groups, episodes = [], 0
    while episodes < 10_000:
        g = copy.copy(base[len(groups) % len(base)])  # shares the segments and episodes: a new key only
        g.task_key = f"copy-{len(groups)}"
        groups.append(SourcedGroup(g, source="copies", step=len(groups) % 60 + 1))
        episodes += len(g.episodes)
    out = tmp_path / "big.html"
    out.write_text(build_html(groups, load_tokenizer(None), title="10,000 episodes"), encoding="utf-8")
    with chromium() as context:
        page, errors, _, ready_ms = open_view(context, out.resolve().as_uri())
        assert page.locator("#list-count").inner_text() == f"{len(groups)} groups"
        assert page.locator("#list-body .row").count() < 100  # only the rows in view are rendered
        open_ms = timed(page, "open", len(groups) - 1)
        sort_ms = timed(page, "sort", "reward_mean")  # sorting every group stays quick too
        assert errors == []
    print(f"10,000 episodes ({out.stat().st_size / 2**20:.1f} MiB): ready {ready_ms:.0f} ms, group {open_ms:.0f} ms, "
          f"sort {sort_ms:.0f} ms")
    assert ready_ms < 3000 and open_ms < 1000 and sort_ms < 1000
