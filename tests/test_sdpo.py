"""The SDPO learner on the shipped tiny model: the packed teacher equals the unpacked one, the
distillation loss and its gradient equal a per-episode reference (masks included), the blend
with GRPO is linear, the EMA teacher follows the student (and resumes), and ``treerl learn
--learner sdpo`` trains end to end.

Episodes come from a scripted policy (tests/_scripted.py) playing Calculator through the real
engine, so each group's successes and failures, single- and multi-turn, are known.
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import json
import math
from types import SimpleNamespace

import pytest
import torch
from _scripted import ScriptedPolicy
from safetensors.torch import load_file

import treerl
from treerl.cli import main
from treerl.envs import ToolCall
from treerl.kernels.tree_attention import enable_tree_attention
from treerl.learners.distributed import Ranks
from treerl.learners.divergences import full_divergence, importance_clip, topk_divergence
from treerl.learners.forward import packed_logprobs
from treerl.learners.grpo import optimize
from treerl.learners.packing import PackingConfig, pack_groups
from treerl.learners.sdpo import Distillation, SDPOConfig, teacher_prompts, train
from treerl.learners.teacher import ema_update, make_teacher, teacher_terms, teacher_trees, term_ranks
from treerl.learners.teacher_context import TeacherPrompter
from treerl.learners.teacher_gate import TeacherGate, copy_gaps
from treerl.models import load_default_model
from treerl.rollout.engine import RolloutEngine
from treerl.rollout.trajectory import read_groups, sample_path

TEMPERATURE = 0.9
ENV = "treerl/Calculator-v0"


@pytest.fixture(autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def tiny():
    return load_default_model()


def _script(tok):
    """Task seed 0: generations 0 and 3 solve it (with the calculator), 1 answers wrong at once,
    2 calls the calculator wrongly and answers wrong. Task seed 1: every generation is wrong."""
    env = treerl.make(ENV)
    tasks = {}
    for seed in (0, 1):
        env.reset(seed=seed)
        tasks[f"seed-{seed}"] = (env.task.answer, env.task.info["expression"])
    call = lambda expression: env.parser.render([ToolCall("calculator", {"expression": expression})])  # noqa: E731

    def script(task_key, generation, turn):
        answer, expression = tasks[task_key]
        wrong = str(int(float(answer)) + 1)
        if task_key == "seed-1":
            return [f"\\boxed{{{wrong}}}", call("2 + 2"), f"\\boxed{{{wrong}}}", call("1 + 1")][generation]
        lines = [[call(expression), f"The answer is \\boxed{{{answer}}}."], [f"\\boxed{{{wrong}}}"],
                 [call("1 + 1"), f"So \\boxed{{{wrong}}}."], [call(expression), f"\\boxed{{{answer}}}"]][generation]
        return lines[min(turn, len(lines) - 1)]

    return ScriptedPolicy(tok, script, end_id=tok.convert_tokens_to_ids("<|im_end|>"))


@pytest.fixture(scope="module")
def groups(tiny):
    _, tok = tiny
    engine = RolloutEngine(_script(tok), tok, seed=0)
    out, _ = asyncio.run(engine.run(lambda: treerl.make(ENV), ENV, range(2), 4))
    assert [e.reward for e in out[0].episodes] == [1.0, 0.0, 0.0, 1.0]
    assert [e.reward for e in out[1].episodes] == [0.0] * 4
    return out


def _cfg(tmp_path, **kwargs) -> SDPOConfig:
    return SDPOConfig(output_dir=str(tmp_path), temperature=TEMPERATURE, **kwargs)


def _prompts(tok, groups, cfg):
    prompter = TeacherPrompter(tok, cfg.context_config(), tools=treerl.make(ENV).tool_schemas)
    metrics = {}
    rewards = torch.tensor([[e.reward] for g in groups for e in g.episodes])
    return teacher_prompts(groups, rewards, [1.0], prompter, metrics), metrics


def _tree_model(model):
    tree = copy.deepcopy(model).train()
    enable_tree_attention(tree)
    return tree


def _unpacked_logits(model, groups, prompts):
    """Per episode with a teacher prompt (None otherwise): the plain model's tempered logits (S, V) that
    predict each sampled token after the prompt, on ``prompt + the episode's own tokens after its prompt``."""
    out, first = [], 0
    for g in groups:
        for i, e in enumerate(g.episodes):
            prompt = prompts[first + i]
            if prompt is None:
                out.append(None)
                continue
            n = len(g.segments[0].token_ids)
            ids, sampled = e.token_ids[n:], e.sampled_mask[n:]
            logits = model(torch.tensor([[*prompt, *ids]]), use_cache=False).logits[0] / TEMPERATURE  # (L, V)
            where = [len(prompt) + j - 1 for j, s in enumerate(sampled) if s]
            out.append((logits[where], torch.tensor([t for t, s in zip(ids, sampled) if s])))
        first += len(g.episodes)
    return out


# -- the packed teacher -----------------------------------------------------------------------------


@pytest.mark.parametrize("use_feedback", [False, True])
def test_the_packed_teacher_equals_the_unpacked_teacher(tiny, groups, tmp_path, use_feedback):
    model, tok = tiny
    cfg = _cfg(tmp_path, use_feedback=use_feedback)
    prompts, metrics = _prompts(tok, groups, cfg)
    tree = _tree_model(model).eval()
    with torch.no_grad():
        reference = _unpacked_logits(model, groups, prompts)
    for batch in pack_groups(groups, torch.zeros(8), PackingConfig(max_tokens_per_row=4096)):
        packed = teacher_terms(tree, groups, prompts, batch, PackingConfig(max_tokens_per_row=4096),
                               temperature=TEMPERATURE, device="cpu")
        padded = teacher_terms(tree, groups, prompts, batch, PackingConfig(max_tokens_per_row=4096, mode="padded"),
                               temperature=TEMPERATURE, device="cpu")
        assert torch.equal(packed.mask, padded.mask)
        assert torch.allclose(packed.logp, padded.logp, atol=1e-5)
        assert torch.allclose(packed.hidden, padded.hidden, atol=1e-4)
        ranks = term_ranks(batch.term_episode)
        for m in range(batch.num_terms):
            ref = reference[int(batch.term_episode[m])]
            assert bool(packed.mask[m]) == (ref is not None)
            if ref is not None:
                logits, targets = ref
                want = logits[int(ranks[m])].log_softmax(-1)[targets[int(ranks[m])]]
                assert targets[int(ranks[m])] == batch.term_target[m]  # the same sampled token
                assert abs(float(packed.logp[m]) - float(want)) < 1e-5
        # Failed siblings of task 0 share one demonstration: one teacher prefix for three branches (with
        # feedback, up to where each one's own feedback starts).
        assert packed.num_path_tokens > packed.num_tokens
    assert metrics["sdpo/reprompt_frac"] == (1.0 if use_feedback else 0.5)
    assert metrics["sdpo/no_teacher_group_frac"] == (0.0 if use_feedback else 0.5)


@pytest.mark.parametrize("use_feedback", [False, True])
def test_teacher_trees_share_the_prefix_and_keep_every_token_after_it(groups, tiny, tmp_path, use_feedback):
    _, tok = tiny
    prompts, _ = _prompts(tok, groups, _cfg(tmp_path, use_feedback=use_feedback))
    trees = teacher_trees(groups, prompts)
    # Without feedback, task 1 has nothing to learn from (no success); with it, every episode has a teacher.
    assert trees.student_episodes == ([0, 1, 2, 3, 4, 5, 6, 7] if use_feedback else [0, 1, 2, 3])
    for tree, student in zip(trees.groups, groups):
        mine = [prompts[i] for i in trees.student_episodes if i // 4 == groups.index(student)]
        distinct = {tuple(p) for p in mine}
        prompt_segments = [s for s in tree.segments if s.kind == "prompt"]
        assert sum(s.parent is None for s in tree.segments) == 1  # one system prompt and task: one root
        # The teacher prompts as a trie: each shared prefix once.
        assert sum(len(s.token_ids) for s in prompt_segments) < sum(len(p) for p in distinct)
        n = len(student.segments[0].token_ids)
        for e, t, want in zip(student.episodes, tree.episodes, mine):
            t_prompt = sum(len(s.token_ids) for s in tree.path(t.leaf) if s.kind == "prompt")
            assert t.token_ids[:t_prompt] == list(want)  # the episode's own teacher prompt, exactly
            assert t.token_ids[t_prompt:] == e.token_ids[n:]  # sampled turns and env tokens between, unchanged
            assert t.sampled_mask[t_prompt:] == e.sampled_mask[n:]
    if not use_feedback:  # failed siblings 1 and 2 and success 3 read episode 0's attempt, 0 reads episode 3's
        assert len({tuple(p) for p in prompts[:4]}) == 2
    assert len(groups[0].episodes[2].messages) > 3  # a multi-turn episode is in there


# -- the loss, its masks and the blend ------------------------------------------------------------


def _run(cfg, model):
    return SimpleNamespace(cfg=cfg, ranks=Ranks(), model=model)


@pytest.mark.parametrize("mode,alpha", [("topk", 0.5), ("full", 0.0), ("sampled_token", 1.0)])
def test_the_distillation_loss_and_gradient_equal_an_unpacked_reference(tiny, groups, tmp_path, mode, alpha):
    model, tok = tiny
    cfg = _cfg(tmp_path, use_feedback=False, distillation_mode=mode, distillation_alpha=alpha, distillation_topk=20,
               teacher="live", distillation_chunk_tokens=16, distillation_weight=1.0)
    prompts, _ = _prompts(tok, groups, cfg)
    student = _tree_model(model)
    batches = pack_groups(groups, torch.zeros(8), cfg.packing_config())
    distill = Distillation(_run(cfg, student), student, groups, prompts, batches)
    loss = sum(distill(b, packed_logprobs(student, b, temperature=TEMPERATURE)) for b in batches)
    params = [p for p in student.parameters() if p.requires_grad]
    grads = torch.autograd.grad(loss, params)

    plain = copy.deepcopy(model).train()
    with torch.no_grad():
        teacher = _unpacked_logits(plain, groups, prompts)
    own_prompts = [g.segments[0].token_ids for g in groups for _ in g.episodes]
    student_side = _unpacked_logits(plain, groups, [own if p is not None else None
                                                    for own, p in zip(own_prompts, prompts)])
    terms = []
    for s, t in zip(student_side, teacher):
        if t is None:
            continue  # masked: no teacher, no term
        (zs, ids), (zt, _) = s, t
        logp = zs.log_softmax(-1).gather(1, ids[:, None]).squeeze(1)
        if mode == "sampled_token":
            per = (logp - zt.log_softmax(-1).gather(1, ids[:, None]).squeeze(1)).detach() * logp
        elif mode == "full":
            per = full_divergence(zs, zt, alpha=alpha)
        else:
            per = topk_divergence(zs, zt, alpha=alpha, topk=20, add_tail=True)
        terms.append(per * importance_clip(logp, torch.full_like(logp, -1.0), 2.0))
    want = torch.cat(terms).sum() / sum(len(t) for t in terms)  # token_mean over the terms with a teacher
    want_grads = torch.autograd.grad(want, [p for p in plain.parameters() if p.requires_grad])
    assert abs(float(loss.detach()) - float(want.detach())) < 1e-5
    for got, ref in zip(grads, want_grads):
        assert torch.allclose(got, ref, atol=1e-5, rtol=1e-4)
    metrics = distill.step_metrics()
    assert metrics["sdpo/distill_terms"] == sum(len(t) for t in terms)
    assert math.isfinite(metrics["sdpo/teacher_logp"]) and metrics["sdpo/teacher_logp"] < 0


def test_a_teacher_that_reads_the_students_prompt_agrees_with_the_student(tiny, groups, tmp_path):
    """The whole path (contexts, teacher trees, packing, alignment) on a teacher that sees nothing more."""
    model, tok = tiny
    cfg = _cfg(tmp_path, reprompt_template="{prompt}", solution_template="", feedback_template="", teacher="live")
    prompts, _ = _prompts(tok, groups, cfg)
    own = [g.segments[0].token_ids for g in groups for _ in g.episodes]
    assert all(p == o for p, o in zip(prompts, own) if p is not None)
    student = _tree_model(model)
    batches = pack_groups(groups, torch.zeros(8), cfg.packing_config())
    success = torch.tensor([e.reward >= 1.0 for g in groups for e in g.episodes])
    distill = Distillation(_run(cfg, student), student, groups, prompts, batches, success)
    for b in batches:
        out = packed_logprobs(student, b, temperature=TEMPERATURE)
        loss = distill(b, out)
        teacher = teacher_terms(student, groups, prompts, b, cfg.packing_config(), temperature=TEMPERATURE,
                                device="cpu")
        assert torch.allclose(teacher.logp[teacher.mask], out.logp_vocab.detach()[teacher.mask], atol=1e-5)
        assert abs(float(loss.detach())) < 1e-6
    metrics = distill.step_metrics()
    assert abs(metrics["sdpo/divergence"]) < 1e-6
    assert abs(metrics["sdpo/logp_gap_success"]) < 1e-5 and abs(metrics["sdpo/logp_gap_failure"]) < 1e-5


def test_distillation_reads_its_metrics_back_once_per_step(tiny, groups, tmp_path):
    """On an accelerator each value read back is a host sync in the middle of the micro-batch's
    forward: the distillation metrics are kept as tensors and read in step_metrics."""
    from _helpers import HostReads

    model, tok = tiny
    cfg = _cfg(tmp_path, use_feedback=True, teacher="initial")
    prompts, _ = _prompts(tok, groups, cfg)
    student = _tree_model(model)
    batches = pack_groups(groups, torch.zeros(8), cfg.packing_config())
    success = torch.tensor([e.reward >= 1.0 for g in groups for e in g.episodes])
    distill = Distillation(_run(cfg, student), copy.deepcopy(student).eval(), groups, prompts, batches, success)
    reads = []
    for b in batches:
        out = packed_logprobs(student, b, temperature=TEMPERATURE)
        with HostReads() as counted:
            distill(b, out)
        with HostReads() as checks:  # the teacher's own forward and the loss inputs' check, not metrics
            teacher_terms(distill.teacher, groups, prompts, b, cfg.packing_config(), temperature=TEMPERATURE,
                          device="cpu")
        reads.append(counted.count - checks.count)
    # Which episodes have a teacher, and the range check of the distillation's LossInputs.
    assert reads == [2] * len(batches)
    with HostReads() as counted:
        metrics = distill.step_metrics()
    assert counted.count == 2  # the float sums, then the counts
    assert metrics["sdpo/distill_terms"] > 0


def test_the_blend_is_linear_in_distillation_weight(tiny, groups, tmp_path):
    model, tok = tiny
    base = _cfg(tmp_path, use_feedback=True, teacher="initial", max_grad_norm=0.0)
    prompts, _ = _prompts(tok, groups, base)
    adv = torch.tensor([1.0, -1.0, -1.0, 1.0, 0.0, 0.0, 0.0, 0.0])
    start = _tree_model(model)
    frozen = copy.deepcopy(start).eval().requires_grad_(False)
    deltas = {}
    for weight in (0.0, 1.0, 0.3):
        cfg = dataclasses.replace(base, distillation_weight=weight)
        student = copy.deepcopy(start)
        batches = pack_groups(groups, adv, cfg.packing_config())
        opt = torch.optim.SGD(student.parameters(), lr=1.0)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda _: 1.0)
        distill = Distillation(_run(cfg, student), frozen, groups, prompts, batches) if weight > 0 else None
        optimize(student, opt, sched, batches, cfg, "cpu", {}, policy_coef=1.0 - weight, extra_loss=distill)
        deltas[weight] = [a.detach() - b.detach() for a, b in zip(student.parameters(), start.parameters())]
    for d0, d1, d_mix in zip(deltas[0.0], deltas[1.0], deltas[0.3]):
        assert torch.allclose(d_mix, 0.7 * d0 + 0.3 * d1, atol=1e-6)
    assert any(float(d.abs().max()) > 0 for d in deltas[1.0])


# -- the teacher's weights --------------------------------------------------------------------------


def test_ema_moves_only_trained_parameters_by_the_rate(tiny):
    from peft import LoraConfig, get_peft_model

    model, _ = tiny
    student = get_peft_model(copy.deepcopy(model), LoraConfig(r=4, target_modules="all-linear"))
    teacher = copy.deepcopy(student).requires_grad_(False)
    before = {k: v.clone() for k, v in teacher.state_dict().items()}
    with torch.no_grad():
        for p in student.parameters():
            if p.requires_grad:
                p.add_(1.0)
    ema_update(teacher, student, 0.1)
    trained = {n for n, p in student.named_parameters() if p.requires_grad}
    for name, value in teacher.state_dict().items():
        if name in trained:
            assert torch.allclose(value, 0.9 * before[name] + 0.1 * student.state_dict()[name], atol=1e-6)
        else:
            assert torch.equal(value, before[name])
    with pytest.raises(ValueError, match="teacher_update_rate"):
        ema_update(teacher, student, 1.5)


def test_a_lora_ema_teacher_is_the_students_base_with_averaged_adapters(tiny, groups, tmp_path):
    """With LoRA the EMA teacher holds the adapters' average alone, and scores as a whole EMA copy of the model."""
    from peft import LoraConfig, get_peft_model

    model, tok = tiny
    student = get_peft_model(_tree_model(model), LoraConfig(r=4, target_modules="all-linear"))
    full = copy.deepcopy(student).eval().requires_grad_(False)  # the EMA teacher as a whole copy
    teacher = make_teacher("ema", student, None)
    trained = [p for p in student.parameters() if p.requires_grad]
    # No second copy of the base: the teacher owns no parameters and holds tensors the adapters' size.
    assert list(teacher.parameters()) == [] and list(teacher.buffers()) == []
    assert sum(w.numel() for w in teacher.weights.values()) == sum(p.numel() for p in trained)
    for _ in range(2):  # two optimizer steps of the student, each followed by the teacher's update
        with torch.no_grad():
            for p in trained:
                p.add_(0.05 * torch.randn_like(p))
        ema_update(full, student, 0.25)
        ema_update(teacher, student, 0.25)
    cfg = _cfg(tmp_path, use_feedback=True)
    prompts, _ = _prompts(tok, groups, cfg)
    student.train()
    for b in pack_groups(groups, torch.zeros(8), cfg.packing_config()):
        got = teacher_terms(teacher, groups, prompts, b, cfg.packing_config(), temperature=TEMPERATURE, device="cpu")
        want = teacher_terms(full, groups, prompts, b, cfg.packing_config(), temperature=TEMPERATURE, device="cpu")
        assert got.mask.any() and torch.equal(got.mask, want.mask)
        assert torch.allclose(got.hidden, want.hidden, atol=1e-5) and torch.allclose(got.logp, want.logp, atol=1e-5)
        own = teacher_terms(student, groups, prompts, b, cfg.packing_config(), temperature=TEMPERATURE, device="cpu")
        assert not torch.allclose(own.logp[own.mask], want.logp[want.mask], atol=1e-4), "the teacher lags the student"
    assert student.training and all(p.requires_grad for p in trained)
    # A checkpoint's teacher of when it was a whole copy resumes into the adapters' average.
    resumed = make_teacher("ema", student, None)
    resumed.load(full.state_dict())
    assert all(torch.equal(resumed.weights[k], teacher.weights[k]) for k in teacher.weights)


SMALL = ["--steps", "2", "--tasks-per-step", "2", "--group-size", "4", "--max-new-tokens", "24", "--eval-episodes",
         "0", "--progress", "false", "--num-threads", "1", "--save-every", "1"]


@pytest.mark.slow  # a whole run (processes or a model forward): CI's slow tier
def test_treerl_learn_sdpo_trains_and_checkpoints_its_ema_teacher(tmp_path):
    out = tmp_path / "run"
    assert main(["learn", "--learner", "sdpo", "--env", ENV, "--output-dir", str(out), *SMALL,
                 "--teacher", "ema", "--teacher-update-rate", "0.25", "--distillation-gate-margin", "none"]) == 0
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in lines] == [1, 2]
    for m in lines:
        for key in ("loss/distill", "sdpo/reprompt_frac", "sdpo/no_teacher_group_frac", "reward/mean", "grad/norm"):
            assert math.isfinite(m[key]), key
    active = [m for m in lines if m["sdpo/distill_terms"] > 0]
    assert active and all(math.isfinite(m["sdpo/divergence"]) and m["sdpo/teacher_logp"] < 0 for m in active)
    start, _ = load_default_model()
    theta0 = start.state_dict()
    ckpt = out / "checkpoints"
    theta1, theta2 = (load_file(ckpt / f"step-{s}" / "model.safetensors") for s in (1, 2))
    teacher1, teacher2 = (load_file(ckpt / f"step-{s}" / "teacher.safetensors") for s in (1, 2))
    assert any(not torch.equal(theta2[k], theta0[k]) for k in theta2), "training must change the parameters"
    for k in teacher1:  # teacher_1 = 0.75 theta_0 + 0.25 theta_1, teacher_2 = 0.75 teacher_1 + 0.25 theta_2
        assert torch.allclose(teacher1[k], 0.75 * theta0[k] + 0.25 * theta1[k], atol=1e-6), k
        assert torch.allclose(teacher2[k], 0.75 * teacher1[k] + 0.25 * theta2[k], atol=1e-6), k
    # A resumed run's teacher continues from the checkpoint, not from the student.
    assert main(["learn", "--learner", "sdpo", "--env", ENV, "--output-dir", str(out), *SMALL, "--steps", "3",
                 "--teacher", "ema", "--teacher-update-rate", "0.25", "--distillation-gate-margin", "none",
                 "--resume", "true"]) == 0
    theta3 = load_file(ckpt / "step-3" / "model.safetensors")
    teacher3 = load_file(ckpt / "step-3" / "teacher.safetensors")
    for k in teacher3:
        assert torch.allclose(teacher3[k], 0.75 * teacher2[k] + 0.25 * theta3[k], atol=1e-6), k


@pytest.mark.parametrize("kind", ["initial", "live"])
def test_the_other_teachers_train(tiny, tmp_path, kind):
    model, tok = tiny
    model = copy.deepcopy(model)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    cfg = _cfg(tmp_path, teacher=kind, steps=1, tasks_per_step=1, group_size=4, eval_episodes=0, progress=False,
               max_new_tokens=24, distillation_mode="sampled_token", distillation_alpha=1.0,
               distillation_weight=0.5, distillation_gate_margin=None)
    train(cfg, model=model, tokenizer=tok, policy=_script(tok))
    [m] = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert m["sdpo/reprompt_frac"] == 1.0 and m["sdpo/distill_terms"] > 0 and math.isfinite(m["loss/distill"])
    assert any(not torch.equal(v, before[k]) for k, v in model.state_dict().items())


def test_sdpo_keeps_trajectory_samples_for_treerl_view(tiny, tmp_path):
    model, tok = tiny
    cfg = _cfg(tmp_path, steps=1, tasks_per_step=2, group_size=4, eval_episodes=0, progress=False,
               max_new_tokens=24, sample_groups=1)
    train(cfg, model=copy.deepcopy(model), tokenizer=tok, policy=_script(tok))
    [group] = read_groups(sample_path(tmp_path, 1))  # step 1 is sampled; only the first group kept
    assert group.task_key == "seed-0" and [e.reward for e in group.episodes] == [1.0, 0.0, 0.0, 1.0]
    adv = [e.advantage for e in group.episodes]  # GRPO's advantages within the group: successes above failures
    assert adv[0] == adv[3] > 0 > adv[1] == adv[2]
    sampled = [s for s in group.segments if s.kind == "sampled"]
    assert sampled and all(s.trainer_logprobs is not None and len(s.trainer_logprobs) == len(s.token_ids)
                           for s in sampled)
    assert all(lp <= 0.0 for s in sampled for lp in s.trainer_logprobs)


def test_reward_functions_log_extra_values_under_sdpo(tiny, tmp_path):
    model, tok = tiny

    def says_boxed(completions, log_extra, **kwargs):
        log_extra("boxed", ["boxed" in c[-1]["content"] for c in completions])
        return [0.0 for _ in completions]

    cfg = _cfg(tmp_path, steps=1, tasks_per_step=2, group_size=4, eval_episodes=0, progress=False, max_new_tokens=24)
    train(cfg, model=copy.deepcopy(model), tokenizer=tok, policy=_script(tok), reward_funcs=[says_boxed])
    [line] = [json.loads(line) for line in (tmp_path / "reward_extras.jsonl").read_text().splitlines()]
    assert line["step"] == 1 and len(line["boxed"]) == 8


def test_nothing_to_learn_from_changes_nothing_and_says_so(tiny, tmp_path):
    model, tok = tiny
    model = copy.deepcopy(model)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    always_wrong = ScriptedPolicy(tok, lambda task, g, turn: "\\boxed{-1}", tok.convert_tokens_to_ids("<|im_end|>"))
    cfg = _cfg(tmp_path, steps=1, tasks_per_step=2, group_size=2, eval_episodes=0, progress=False, use_feedback=False)
    train(cfg, model=model, tokenizer=tok, policy=always_wrong)
    [m] = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert m["sdpo/reprompt_frac"] == 0.0 and m["loss/distill"] == 0.0 and m["diag/sdpo_no_teacher"] == 1.0
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())  # a zero gradient: no update
    [diag] = [json.loads(line) for line in (tmp_path / "diagnostics.jsonl").read_text().splitlines()
              if "sdpo" in line]
    assert "success_threshold" in diag["action"] and "--use-feedback" in diag["action"]


def test_config_errors_name_the_fix(tmp_path):
    with pytest.raises(ValueError, match="--distillation-alpha 1"):
        _cfg(tmp_path, distillation_mode="sampled_token", distillation_alpha=0.5)
    with pytest.raises(ValueError, match="distillation_weight=1.5 must be in"):
        _cfg(tmp_path, distillation_weight=1.5)
    with pytest.raises(ValueError, match="teacher='student'"):
        _cfg(tmp_path, teacher="student")
    with pytest.raises(ValueError, match="max-tokens-per-row"):
        _cfg(tmp_path, max_teacher_prompt_tokens=4000)
    with pytest.raises(ValueError, match="solution_template"):
        _cfg(tmp_path, solution_template="{solution}")
    assert main(["learn", "--learner", "sdpo", "--output-dir", str(tmp_path), "--distillation-mode", "nope"]) == 2


# -- the gate -----------------------------------------------------------------------------------------


def test_the_gate_keeps_teachers_whose_demonstration_it_can_copy():
    gate = TeacherGate(margin=0.1)
    assert gate.decide([None, None], [True, False], {}) == [True, False]  # nothing measured yet: trusted
    # Demonstration 2 copies (0.5 >= 0.1), 5 does not; feedback-only episodes follow the pooled gap
    # (0.5 * 10 + 0.0 * 30) / 40 = 0.125 >= 0.1.
    assert gate.decide([2, 5, None, None], [True, True, True, False], {2: (0.5, 10), 5: (0.0, 30)}) == [
        True, False, True, False]
    assert gate.decide([None], [True], {}) == [True]  # a step without probes: the last pooled gap judges
    assert gate.decide([7, None], [True, True], {7: (-0.3, 5)}) == [False, False]
    assert gate.decide([None], [True], {}) == [False] and gate.last_pooled == -0.3


def test_the_copy_probe_equals_an_unpacked_reference(tiny, groups, tmp_path):
    model, tok = tiny
    cfg = _cfg(tmp_path)
    prompter = TeacherPrompter(tok, cfg.context_config(), tools=treerl.make(ENV).tool_schemas)
    tree = _tree_model(model)
    own = list(groups[0].segments[0].token_ids)
    probes = [prompter.self_prompt(groups[0], i) if i in (0, 3) else None for i in range(8)]
    gaps = copy_gaps(tree, tree, groups, probes, cfg.packing_config(), temperature=TEMPERATURE, device="cpu")
    assert set(gaps) == {0, 3}
    with torch.no_grad():
        taught = _unpacked_logits(model, groups, probes)
        plain = _unpacked_logits(model, groups, [own if p is not None else None for p in probes])
    for e in (0, 3):
        (lt, target), (ls, _) = taught[e], plain[e]
        reference = (lt.log_softmax(-1)[torch.arange(len(target)), target]
                     - ls.log_softmax(-1)[torch.arange(len(target)), target]).mean()
        assert gaps[e][1] == len(target) and abs(gaps[e][0] - float(reference)) < 1e-5
    # Probed with the student's own prompt, the teacher is the student: the gap is 0.
    same = copy_gaps(tree, tree, groups, [own if p is not None else None for p in probes], cfg.packing_config(),
                     temperature=TEMPERATURE, device="cpu")
    assert all(abs(g) < 1e-6 for g, _ in same.values())
    # The shipped model does not copy what its teacher prompt shows: the gap is negative.
    assert all(g < 0 for g, _ in gaps.values())


def test_the_gate_turns_off_a_teacher_that_cannot_copy_and_grpo_still_learns(tiny, tmp_path):
    model, tok = tiny
    model = copy.deepcopy(model)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    cfg = _cfg(tmp_path, steps=1, tasks_per_step=2, group_size=4, eval_episodes=0, progress=False, max_new_tokens=24)
    assert cfg.distillation_weight == 0.5 and cfg.distillation_gate_margin == 0.0  # the defaults
    train(cfg, model=model, tokenizer=tok, policy=_script(tok))
    [m] = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    # Task 0's two successes are probed (each demonstrates for someone); both copy badly, so every
    # teacher is gated, task 1's feedback-only ones by the pooled gap.
    assert m["sdpo/copy_probes"] == 2 and m["sdpo/copy_gap"] < 0
    assert m["sdpo/reprompt_frac"] == 1.0 and m["sdpo/gated_frac"] == 1.0 and m["sdpo/distill_terms"] == 0
    assert m["diag/sdpo_teacher_gated"] == 1.0
    assert any(not torch.equal(v, before[k]) for k, v in model.state_dict().items())  # GRPO's half trained


def test_a_reward_functions_none_is_left_out_of_the_reward_a_teacher_is_chosen_by():
    """A reward function's None (NaN: not applicable) leaves the weighted sum, as in the advantages; it made the
    episode's reward NaN, so that a successful episode was never a sibling's solution."""
    from treerl.learners.sdpo import weighted_rewards

    rewards = torch.tensor([[1.0, float("nan")], [0.0, 2.0]])
    assert weighted_rewards(rewards, [1.0, 0.5]).tolist() == [1.0, 1.0]
