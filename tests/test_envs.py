"""The environment layer: the Gymnasium contract, the registry, ToolEnv's failure handling."""

from __future__ import annotations

import asyncio
import importlib
import json
import subprocess
import sys
import threading
import time
import warnings
from pathlib import Path

import gymnasium
import pytest

import treerl
from treerl.envs import ChatMessages, Completion, EnvError, Task, ToolEnv, check_env, tool
from treerl.errors import ConfigError, ToolErrorKind
from treerl.envs.registry import EnvSpec

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = str(ROOT / "examples" / "custom_env.py")

ALL_IDS = sorted(treerl.registry)


@pytest.mark.parametrize("env_id", ALL_IDS)
def test_check_env_passes_for_every_registered_env(env_id):
    env = gymnasium.make(env_id).unwrapped
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        gymnasium.utils.env_checker.check_env(env, skip_render_check=True)
    # Gymnasium's checker only warns for many problems: none may be about our env.
    problems = [str(w.message) for w in caught if "gymnasium" in str(w.filename) or "Gymnasium" in str(w.message)]
    assert problems == []
    check_env(treerl.make(env_id))


@pytest.mark.parametrize("env_id", ALL_IDS)
def test_gymnasium_make_and_treerl_make_agree(env_id):
    wrapped = gymnasium.make(env_id)
    bare = treerl.make(env_id)
    assert type(wrapped.unwrapped) is type(bare)
    obs_a, _ = wrapped.reset(seed=3)
    obs_b, _ = bare.reset(seed=3)
    assert obs_a == obs_b


@pytest.mark.parametrize("env_id", ALL_IDS)
def test_validate_gold_answers_earn_full_reward(env_id):
    report = treerl.make(env_id).validate(num_tasks=6, seed=11)
    assert report.ok, report.failures


@pytest.mark.parametrize("env_id", ALL_IDS)
def test_sync_vector_env_steps_mixed_replies(env_id):
    # Gymnasium's vector envs stack each info key across envs into one array typed by the first
    # env's value: a key that is an int in one env and None in the next cannot be stacked.
    envs = gymnasium.make_vec(env_id, num_envs=2, vectorization_mode="sync")
    try:
        envs.reset(seed=0)
        _, rewards, terminated, truncated, _ = envs.step(["\\boxed{3}", "no number here"])
        assert rewards.shape == terminated.shape == truncated.shape == (2,)
    finally:
        envs.close()


def test_spaces_contain_and_sample():
    space = ChatMessages(seed=0)
    for _ in range(20):
        assert space.sample() in space
    assert [{"role": "user", "content": 1}] not in space
    assert "not a list" not in space
    assert [{"role": "tool", "content": "x", "name": 3}] not in space
    action_space = Completion(max_length=16, seed=0)
    assert "<tool_call>\u2603" in action_space  # any character is a valid completion
    assert "x" * 17 not in action_space
    assert all(action_space.sample() in action_space for _ in range(20))


def test_calculator_episode_with_gold_and_seeded_tasks():
    env = treerl.make("treerl/Calculator-v0")
    obs, info = env.reset(seed=5)
    assert [m["role"] for m in obs] == ["system", "user"]
    assert info["tools"][0]["function"]["name"] == "calculator"
    assert info["task_id"] == "seed-5"
    expr = env.task.info["expression"]
    obs, reward, terminated, truncated, info = env.step(
        f'<tool_call>\n{{"name": "calculator", "arguments": {{"expression": "{expr}"}}}}\n</tool_call>'
    )
    assert (reward, terminated, truncated) == (0.0, False, False)
    assert obs == [{"role": "tool", "name": "calculator", "content": env.task.answer}]
    assert info["tool_calls"][0]["error"] is None
    obs, reward, terminated, truncated, info = env.step(f"So \\boxed{{{env.task.answer}}}.")
    assert (obs, reward, terminated, truncated) == ([], 1.0, True, False)
    assert info["termination"] == "final_answer"
    assert info["metrics"]["tool_calls/ok"] == 1
    # Same seed, same task; other seeds give other tasks.
    questions = {treerl.make("treerl/Calculator-v0").reset(seed=s)[0][1]["content"] for s in range(20)}
    assert len(questions) > 10
    assert treerl.make("treerl/Calculator-v0").reset(seed=5)[0] == treerl.make("treerl/Calculator-v0").reset(seed=5)[0]


@pytest.mark.parametrize(
    "action, kind",
    [
        ("I think it is big.", ToolErrorKind.NO_CALL),
        ("<tool_call>\n{not json}\n</tool_call>", ToolErrorKind.MALFORMED),
        ('<tool_call>\n{"name": "abacus", "arguments": {"expression": "1"}}\n</tool_call>', ToolErrorKind.UNKNOWN_TOOL),
        ('<tool_call>\n{"name": "calculator", "arguments": {"expr": "1"}}\n</tool_call>', ToolErrorKind.INVALID_ARGUMENTS),
        ('<tool_call>\n{"name": "calculator", "arguments": {"expression": "import os"}}\n</tool_call>', ToolErrorKind.TOOL_ERROR),
    ],
)
def test_every_failure_is_a_typed_observation(action, kind):
    env = treerl.make("treerl/Calculator-v0")
    env.reset(seed=0)
    obs, reward, terminated, truncated, info = env.step(action)
    assert not terminated and reward == 0.0
    assert len(obs) == 1 and obs[0]["content"]  # the model is told what was wrong
    assert [r["error"] for r in info["tool_calls"]] == [kind.value]
    assert info["metrics"][f"tool_calls/{kind.value}"] == 1


def test_timeout_is_a_typed_observation_and_bounded():
    @tool(timeout=0.2)
    async def slow(seconds: float) -> str:
        """Sleep.

        Args:
            seconds: How long.
        """
        await asyncio.sleep(seconds)
        return "done"

    env = _EchoEnv(tools=[slow])
    env.reset(seed=0)
    start = time.monotonic()
    obs, _, _, _, info = env.step('<tool_call>\n{"name": "slow", "arguments": {"seconds": 5}}\n</tool_call>')
    assert time.monotonic() - start < 2.0
    assert info["tool_calls"][0]["error"] == ToolErrorKind.TIMEOUT.value
    assert obs[0]["role"] == "tool"


class _EchoEnv(ToolEnv):
    system_prompt = "test"

    def sample_task(self, rng):
        return Task(prompt=f"say {int(rng.integers(100))}", answer="ok")

    def score(self, task, completion):
        return float(completion.strip() == task.answer)


def test_an_environment_without_tools_scores_call_markup_as_text_of_the_answer():
    # Its template showed the model no tools: a reply with call markup was a malformed call, kept from the
    # score (reasoning-gym and MathVerify runs of an untrained model: every reply malformed, reward 0).
    env = _EchoEnv()
    env.reset(seed=0)
    _, reward, terminated, _, info = env.step('<tool_call>{"name": "f", "arguments": {}}</tool_call>')
    assert terminated and info["termination"] == "final_answer" and info["tool_calls"] == [] and reward == 0.0
    env = treerl.make("treerl/MathVerify-v0")
    env.reset(seed=0)
    _, reward, terminated, _, _ = env.step(f"<tool_call>x</tool_call> \\boxed{{{env.task.answer}}}")
    assert terminated and reward == 1.0


def test_truncation_after_max_turns_and_step_after_end_raises():
    env = treerl.make("treerl/Calculator-v0", max_turns=2)
    env.reset(seed=0)
    _, _, terminated, truncated, _ = env.step("hmm")
    assert (terminated, truncated) == (False, False)
    _, _, terminated, truncated, info = env.step("hmm")
    assert (terminated, truncated) == (False, True) and info["termination"] == "max_turns"
    with pytest.raises(EnvError, match="reset"):
        env.step("again")
    # Truncated on a turn with a call: the call ran, and its result is the step's observation.
    env = treerl.make("treerl/Calculator-v0", max_turns=1)
    env.reset(seed=0)
    call = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "2 + 3"}}\n</tool_call>'
    obs, _, terminated, truncated, info = env.step(call)
    assert (terminated, truncated) == (False, True) and info["tool_calls"][0]["error"] is None
    assert obs == [{"role": "tool", "name": "calculator", "content": "5"}]


def test_several_tool_calls_in_one_turn_run_concurrently():
    @tool
    async def wait(seconds: float) -> str:
        """Wait a while.

        Args:
            seconds: Delay.
        """
        await asyncio.sleep(seconds)
        return f"waited {seconds}"

    env = _EchoEnv(tools=[wait])
    env.reset(seed=0)
    calls = "\n".join(f'<tool_call>\n{{"name": "wait", "arguments": {{"seconds": 0.3}}}}\n</tool_call>' for _ in range(4))
    start = time.monotonic()
    obs, *_ = env.step(calls)
    assert time.monotonic() - start < 1.0  # four 0.3 s calls, not 1.2 s in a row
    assert [m["content"] for m in obs] == ["waited 0.3"] * 4


def test_results_of_a_turn_follow_the_order_its_calls_were_written_in_malformed_ones_included():
    # Templates without call ids (Qwen's <tool_response> blocks) pair results with calls by position.
    @tool
    def echo(text: str) -> str:
        """Echo.

        Args:
            text: What to say.
        """
        return text

    env = _EchoEnv(tools=[echo])
    env.reset(seed=0)
    good = '<tool_call>\n{{"name": "echo", "arguments": {{"text": "{}"}}}}\n</tool_call>'
    bad = '<tool_call>\n{"name": "echo", "arguments": {"text": \n</tool_call>'
    obs, _, _, _, info = env.step("\n".join([good.format("first"), bad, good.format("third")]))
    assert [m["content"][:19] for m in obs] == ["first", "Could not parse the", "third"]
    assert [r["error"] for r in info["tool_calls"]] == [None, "malformed", None]


def test_async_steps_interleave_across_environments():
    @tool
    async def io(x: int) -> int:
        """Pretend I/O.

        Args:
            x: A number.
        """
        await asyncio.sleep(0.3)
        return x

    async def episode(seed):
        env = _EchoEnv(tools=[io])
        await env.areset(seed=seed)
        obs, *_ = await env.astep(f'<tool_call>\n{{"name": "io", "arguments": {{"x": {seed}}}}}\n</tool_call>')
        return obs[0]["content"]

    async def main():
        return await asyncio.gather(*(episode(s) for s in range(8)))

    start = time.monotonic()
    assert asyncio.run(main()) == [str(s) for s in range(8)]
    assert time.monotonic() - start < 1.5


class _SleepyStepEnv(treerl.Env):
    """A plain synchronous Gymnasium-style environment whose step blocks (a slow API, a stuck call)."""

    def __init__(self, release=None, seconds=0.0):
        super().__init__()
        self.release, self.seconds = release, seconds

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        return [{"role": "user", "content": "hi"}], {}

    def step(self, action):
        if self.release is not None:
            self.release.wait()
        time.sleep(self.seconds)
        return [], 1.0, True, False, {}


def test_sync_steps_of_a_large_group_do_not_queue_behind_each_other():
    # asyncio's default executor has CPU count + 4 workers: 16 sync steps ran in waves there.
    async def main():
        return await asyncio.gather(*(_SleepyStepEnv(seconds=0.5).astep("x") for _ in range(16)))

    start = time.monotonic()
    assert len(asyncio.run(main())) == 16
    assert time.monotonic() - start < 1.5


def test_a_hung_sync_step_abandoned_by_its_timeout_does_not_hold_up_the_run():
    # The engine gives up on a step after max_episode_seconds; asyncio.run must then return,
    # not wait for the stuck thread (which the default executor's shutdown does).
    release = threading.Event()
    timer = threading.Timer(10.0, release.set)
    timer.start()

    async def main():
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(_SleepyStepEnv(release).astep("x"), timeout=0.1)

    start = time.monotonic()
    try:
        asyncio.run(main())
        assert time.monotonic() - start < 5.0
    finally:
        release.set()
        timer.cancel()


class _WaitingResetEnv(_SleepyStepEnv):
    """A synchronous reset that waits (a database, a container start) until the event loop lets it go."""

    def reset(self, *, seed=None, options=None):
        released = self.release.wait(timeout=3.0)
        super().reset(seed=seed)
        return [{"role": "user", "content": "hi"}], {"released": released, "seed": seed, "options": options}


def test_a_waiting_sync_reset_does_not_stall_the_event_loop():
    # Run on the loop, the reset held it: the coroutine that releases it could not run for 3 s.
    env = _WaitingResetEnv(threading.Event())

    async def release():
        await asyncio.sleep(0.05)
        env.release.set()

    async def main():
        (_, info), _ = await asyncio.gather(env.areset(seed=7, options={"k": 1}), release())
        return info

    assert asyncio.run(main()) == {"released": True, "seed": 7, "options": {"k": 1}}
    assert env.np_random_seed == 7


def test_an_areset_override_is_called_as_it_is():
    class OwnAreset(_SleepyStepEnv):
        async def areset(self, *, seed=None, options=None):
            return [{"role": "user", "content": "own"}], {"thread": threading.current_thread().name}

    obs, info = asyncio.run(OwnAreset().areset(seed=0))
    assert obs[0]["content"] == "own" and info["thread"] == threading.main_thread().name


def test_fork_is_independent():
    env = treerl.make("treerl/GuessNumber-v0")
    env.reset(seed=1)
    env.step("\\boxed{32}")
    child = env.fork()
    child.step("\\boxed{16}")
    assert len(child.messages) == len(env.messages) + 2
    assert env.turn == 1 and child.turn == 2
    assert child.np_random is not env.np_random


def test_a_large_dataset_is_read_once_and_shared_by_forks_not_copied(tmp_path, monkeypatch):
    """A run builds an environment per task and forks it per generation: a 100,000-row file was
    parsed and converted at every build (seconds) and deep-copied at every fork (seconds)."""
    from treerl.envs.builtin import math_verify

    path = tmp_path / "math.jsonl"
    path.write_text("".join(json.dumps({"question": f"{i} + 1?", "answer": str(i + 1)}) + "\n" for i in range(50)))
    reads = []
    real = math_verify._read_rows
    monkeypatch.setattr(math_verify, "_read_rows", lambda p: reads.append(p) or real(p))
    checks = []
    real_check = math_verify.MathVerifyEnv._prompt_key
    monkeypatch.setattr(math_verify.MathVerifyEnv, "_prompt_key",
                        staticmethod(lambda *a, **k: checks.append(1) or real_check(*a, **k)))
    env = treerl.make("treerl/MathVerify-v0", data_path=str(path))
    assert len(checks) == 50  # every row checked at the first build ...
    again = treerl.make("treerl/MathVerify-v0", data_path=str(path), prompt_key="question")
    assert len(reads) == 1 and len(again.dataset) == 50 and len(checks) == 50  # ... and not at the next
    env.reset(seed=0, options={"task_index": 7})
    child = env.fork()
    assert child.dataset is env.dataset  # shared, not copied ...
    child.task.info["mine"] = 1  # ... while the task each plays is its own
    assert "mine" not in env.task.info and "mine" not in env.dataset[7].info and child.task.prompt == "7 + 1?"
    with path.open("a") as f:  # a new version of the file is read again
        f.write(json.dumps({"question": "bad"}) + "\n")
    with pytest.raises(ValueError, match="Row 50 has no \\['answer'\\] column"):  # still refused at build
        treerl.make("treerl/MathVerify-v0", data_path=str(path))
    assert len(reads) == 2


def test_a_mixed_data_file_is_split_once_for_every_group_built_on_it(tmp_path, monkeypatch):
    registry = importlib.import_module("treerl.envs.registry")  # treerl.envs.registry is also the function

    path = tmp_path / "mix.jsonl"
    path.write_text("".join(json.dumps({"env": "math", "question": f"{i} + 1?", "answer": str(i + 1)}) + "\n"
                            for i in range(6)) + json.dumps({"env": "calc", "prompt": "2*3?", "answer": "6"}) + "\n")
    splits = []
    real = registry._route_rows
    monkeypatch.setattr(registry, "_route_rows", lambda *a: splits.append(1) or real(*a))
    ids = "calc=treerl/Calculator-v0,math=treerl/MathVerify-v0"
    first, second = (treerl.make(ids, data_path=str(path)) for _ in range(2))
    assert len(splits) == 1 and len(second.envs["math"].dataset) == 6
    assert [first.task_options(k)["env"] for k in range(7)] == ["math"] * 6 + ["calc"]


def test_a_fork_shares_its_tools_schemas_and_keeps_each_method_tool_its_own():
    class Counter(ToolEnv):
        def __init__(self):
            self.count = 0
            super().__init__(tools=[self.add], dataset=[{"prompt": "count"}])

        def add(self, n: int) -> str:
            """Add n."""
            self.count += n
            return str(self.count)

    env = Counter()
    env.reset(seed=0)
    child = env.fork()
    (mine,), (theirs,) = env._tools, child._tools
    assert theirs._validator is mine._validator and theirs.parameters is mine.parameters  # built once
    theirs.fn(5)  # the fork's tool is the fork's method
    assert (child.count, env.count) == (5, 0)


def test_guess_number_feedback_and_shaped_reward():
    env = treerl.make("treerl/GuessNumber-v0", high=64)
    env.reset(seed=0, options={"secret": 40})
    obs, r1, term, _, info = env.step("\\boxed{32}")
    assert obs == [{"role": "user", "content": "Higher."}] and not term
    assert r1 == pytest.approx(0.1 * 32 / 64)
    obs, r2, term, _, _ = env.step("I'll say \\boxed{48}")
    assert obs[0]["content"] == "Lower." and r2 == pytest.approx(0.1 * 17 / 64)  # 33..64 narrowed to 33..47
    obs, r3, _, _, info = env.step("no idea")
    assert r3 == 0.0 and info["outcome"] == "invalid" and "between 33 and 47" in obs[0]["content"]
    obs, r4, term, _, _ = env.step("\\boxed{40}")
    assert (r4, term, obs) == (1.0, True, [])


def test_math_verify_env_from_jsonl_and_dataset(tmp_path):
    path = tmp_path / "m.jsonl"
    path.write_text(json.dumps({"problem": "1/2 + 1/4?", "solution": "3/4"}) + "\n")
    env = treerl.make("treerl/MathVerify-v0", data_path=path, prompt_key="problem", answer_key="solution")
    env.reset(seed=0)
    assert env.step("\\boxed{0.75}")[1] == 1.0
    datasets = pytest.importorskip("datasets")
    ds = datasets.Dataset.from_list([{"question": "2+2?", "answer": "4"}, {"question": "3*3?", "answer": "9"}])
    env = treerl.make("treerl/MathVerify-v0", dataset=ds)
    obs, info = env.reset(options={"task_index": 1})
    assert obs[-1]["content"] == "3*3?" and info["task_id"] == "1"
    assert env.step("\\boxed{9}")[1] == 1.0
    with pytest.raises(ValueError, match="prompt_key"):
        treerl.make("treerl/MathVerify-v0", dataset=[{"q": "x", "answer": "1"}])
    bad = tmp_path / "bad.jsonl"
    bad.write_text("{oops\n")
    with pytest.raises(ValueError, match="bad.jsonl:1"):
        treerl.make("treerl/MathVerify-v0", data_path=bad)


def test_math_and_code_take_rows_from_an_iterable_as_they_did_before_rows_were_shared():
    """A generator or a streamed dataset (datasets.IterableDataset) has no len(): its rows are read once,
    as the environments did when they converted every row up front."""
    rows = [{"question": "2+2?", "answer": "4"}, {"question": "3*3?", "answer": "9"}]
    env = treerl.make("treerl/MathVerify-v0", dataset=(dict(r) for r in rows))
    obs, info = env.reset(options={"task_index": 1})
    assert len(env.dataset) == 2 and obs[-1]["content"] == "3*3?"
    code = treerl.make("treerl/CodeSandbox-v0", dataset=iter([{"prompt": "Print 1.", "tests": ["assert True"]}]))
    assert code.reset(options={"task_index": 0})[0][-1]["content"] == "Print 1."


def test_code_sandbox_partial_credit_and_tool():
    env = treerl.make("treerl/CodeSandbox-v0")
    env.reset(options={"task_index": 0})  # add(a, b)
    obs, *_ = env.step('<tool_call>\n{"name": "run_python", "arguments": {"code": "print(2 + 3)"}}\n</tool_call>')
    assert obs[0]["content"].strip() == "5"
    obs, reward, terminated, *_ = env.step("```python\ndef add(a, b):\n    return int(a) + int(b)\n```")
    assert terminated and reward == pytest.approx(2 / 3)  # the float test fails


def test_code_sandbox_judges_stdin_stdout_cases_in_each_dataset_form(tmp_path):
    """Competitive-programming rows: cases in 'tests', parallel 'inputs'/'outputs', APPS/TACO's
    'input_output' (JSON text, as those datasets store it); the program reads stdin."""
    prompt = "Read two integers and print their sum."
    solution = "a, b = map(int, input().split())\nprint(a + b)"
    rows = [
        {"id": "cases", "prompt": prompt, "solution": solution,
         "tests": [{"input": "1 2\n", "output": "3\n"}, {"input": "5 5", "output": "10"}]},
        {"id": "lists", "prompt": prompt, "solution": solution, "inputs": ["1 2", "5 5"], "outputs": ["3", "10"]},
        {"id": "apps", "prompt": prompt, "solution": solution,
         "input_output": json.dumps({"inputs": ["1 2\n", "5 5\n"], "outputs": ["3\n", "10\n"]})},
    ]
    path = tmp_path / "io.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    env = treerl.make("treerl/CodeSandbox-v0", data_path=str(path))
    assert env.validate(num_tasks=3).ok  # the gold solution tried with the tool on a case's input, then answered
    assert env.system_prompt == env.program_system_prompt
    obs, *_ = env.reset(options={"task_index": 0})
    obs, *_ = env.step('<tool_call>\n{"name": "run_python", "arguments": {"code": "print(input()[::-1])", '
                       '"stdin": "abc"}}\n</tool_call>')
    assert obs[0]["content"].strip() == "cba"
    assert "stdin" not in treerl.make("treerl/CodeSandbox-v0").tools[0].parameters["properties"]
    for index in range(3):
        env.reset(options={"task_index": index})
        _, reward, terminated, _, info = env.step("```python\nprint(sum(map(int, input().split())) % 10)\n```")
        assert terminated and reward == 0.5
        case = env.task.info["io_cases"][1]
        assert env.feedback() == ("The final code passed 1 of 2 tests. Failed tests:\n"
                                  f"- on input {case['input']!r}: expected {case['output']!r}, got '0\\n'")


def test_code_sandbox_refuses_function_call_cases_instead_of_running_them_as_programs():
    """PrimeIntellect's verifiable-coding cases (also in DeepCoder and open-r1) say type 'function_call'
    and fn_name: their inputs are arguments; read as stdin, every answer would score 0."""
    case = {"type": "function_call", "fn_name": "rev", "input": ["abc"], "output": ["cba"]}
    with pytest.raises(ValueError, match="Code task 0: a case calls a function"):
        treerl.make("treerl/CodeSandbox-v0", dataset=[{"prompt": "p", "tests": json.dumps([case])}])
    stdin_case = {"type": "stdin_stdout", "fn_name": None, "input": "abc", "output": "cba"}  # open-r1's stdin form
    env = treerl.make("treerl/CodeSandbox-v0", dataset=[{"prompt": "p", "tests": [stdin_case]}])
    assert env.dataset[0].info["io_cases"] == [{"input": "abc", "output": "cba"}]


def test_code_sandbox_reads_list_columns_of_a_pandas_row():
    """A Parquet file read with pandas gives list columns as numpy arrays."""
    import numpy as np

    row = {"prompt": "Echo the line.", "inputs": np.array(["a", "b"], dtype=object), "outputs": np.array(["a", "b"], dtype=object)}
    env = treerl.make("treerl/CodeSandbox-v0", dataset=[row])
    env.reset(options={"task_index": 0})
    assert env.step("```python\nprint(input())\n```")[1] == 1.0
    tuple_row = {"prompt": "p", "tests": ("assert True",)}
    assert treerl.make("treerl/CodeSandbox-v0", dataset=[tuple_row]).dataset[0].info["tests"] == ["assert True"]


def test_code_sandbox_reads_tests_held_as_parallel_input_and_output_lists():
    """CodeContests' public/private/generated tests are {"input": [...], "output": [...]}; DeepCoder's
    TACO and CodeContests rows hold 'tests' as {"inputs": [...], "outputs": [...]} (as JSON text)."""
    code_contests = {"input": ["1 2\n", "5 5\n"], "output": ["3\n", "10\n"]}
    deepcoder = json.dumps({"inputs": ["1 2\n", "5 5\n"], "outputs": ["3\n", "10\n"]})
    env = treerl.make("treerl/CodeSandbox-v0", dataset=[{"prompt": "p", "tests": t} for t in (code_contests, deepcoder)])
    for index in range(2):
        assert env.dataset[index].info["io_cases"] == [{"input": "1 2\n", "output": "3\n"}, {"input": "5 5\n", "output": "10\n"}]
        env.reset(options={"task_index": index})
        assert env.step("```python\nprint(sum(map(int, input().split())))\n```")[1] == 1.0
    with pytest.raises(ValueError, match="Code task 0: 'tests' names fn_name='f'"):
        treerl.make("treerl/CodeSandbox-v0", dataset=[{"prompt": "p", "tests": {"inputs": [[1]], "outputs": [2], "fn_name": "f"}}])


def test_code_sandbox_reads_the_columns_a_public_dataset_names():
    """MBPP keeps its problem in 'text' and its asserts in 'test_list'; APPS its problem in 'question'."""
    mbpp = {"text": "Write add(a, b).", "test_list": ["assert add(1, 2) == 3", "assert add(2, 2) == 4"]}
    env = treerl.make("treerl/CodeSandbox-v0", dataset=[mbpp], prompt_key="text", tests_key="test_list")
    obs, _ = env.reset(options={"task_index": 0})
    assert obs[-1]["content"] == "Write add(a, b)."
    assert env.step("```python\ndef add(a, b):\n    return a + b\n```")[1] == 1.0
    apps = {"question": [{"role": "user", "content": "Echo a line."}],
            "input_output": json.dumps({"inputs": ["hi\n"], "outputs": ["hi\n"]})}
    env = treerl.make("treerl/CodeSandbox-v0", dataset=[apps], prompt_key="question")
    assert env.reset(options={"task_index": 0})[0][-1]["content"] == "Echo a line."
    assert env.step("```python\nprint(input())\n```")[1] == 1.0
    with pytest.raises(ValueError, match=r"needs 'text' and its tests \('test_list'\).*pass prompt_key=/tests_key="):
        treerl.make("treerl/CodeSandbox-v0", dataset=[{"text": "p", "tests": ["assert True"]}], prompt_key="text",
                    tests_key="test_list")
    with pytest.raises(ValueError, match="must be text or a list of chat messages"):
        treerl.make("treerl/CodeSandbox-v0", dataset=[{"prompt": ["a", "b"], "tests": ["assert True"]}])


def test_code_sandbox_refuses_rows_whose_tests_it_cannot_run():
    def make(row):
        return treerl.make("treerl/CodeSandbox-v0", dataset=[{"prompt": "p", **row}])

    with pytest.raises(ValueError, match="Code task 0: 'input_output' names fn_name='solve'"):
        make({"input_output": {"inputs": [[1]], "outputs": [[2]], "fn_name": "solve"}})
    with pytest.raises(ValueError, match="same length"):
        make({"inputs": ["1"], "outputs": []})
    with pytest.raises(ValueError, match="only stdin/stdout cases are read"):
        make({"tests": json.dumps([{"input": "[1]", "output": "2", "testtype": "functional"}])})
    with pytest.raises(ValueError, match="not a mix"):
        make({"tests": ["assert True", {"input": "", "output": ""}]})
    with pytest.raises(ValueError, match="needs 'prompt' and its tests"):
        make({"test_cases": ["assert True"]})
    # HumanEval's 'test' defines check(candidate) and never calls it: run as is, it passes any code.
    humaneval = "METADATA = {'author': 'jt'}\n\n\ndef check(candidate):\n    assert candidate(1) == 2\n"
    with pytest.raises(ValueError, match=r"Code task 0: test 0 defines check\(\) but never calls it"):
        make({"tests": [humaneval]})
    assert make({"tests": [humaneval + "\ncheck(f)"]}).dataset[0].info["tests"] == [humaneval + "\ncheck(f)"]
    with pytest.raises(ValueError, match=r"test 1 defines test_f\(\) but never calls it"):  # KodCode's pytest files
        make({"tests": ["assert True", "import math\n\ndef test_f():\n    assert f(1) == 2\n"]})
    # One snippet as text (HumanEval's 'test'): the message says what the text is and how to list it.
    with pytest.raises(ValueError, match=r"'tests' is text but not JSON .*'def check\(candidate\)"):
        make({"tests": "def check(candidate):\n    assert candidate(1) == 2\n"})


def test_code_sandbox_all_or_nothing_reward():
    env = treerl.make("treerl/CodeSandbox-v0", reward="all")
    env.reset(options={"task_index": 0})  # add(a, b): the float test fails
    _, reward, terminated, *_ = env.step("```python\ndef add(a, b):\n    return int(a) + int(b)\n```")
    assert terminated and reward == 0.0 and env.feedback().startswith("The final code passed 2 of 3 tests.")
    env.reset(options={"task_index": 0})
    assert env.step("```python\ndef add(a, b):\n    return a + b\n```")[1] == 1.0
    cases = [{"input": str(i), "output": str(i)} for i in range(4)]
    programs = treerl.make("treerl/CodeSandbox-v0", reward="all", dataset=[{"prompt": "Echo.", "tests": cases}])
    programs.reset(options={"task_index": 0})
    assert programs.step("```python\nprint(0)\n```")[1] == 0.0
    assert programs.test_report.errors.count("not run") >= 1  # judging stopped at the failure
    assert programs.feedback().startswith("The final code passed 1 of 4 tests (")
    with pytest.raises(ValueError, match="'fraction' of the tests passed, or 'all'"):
        treerl.make("treerl/CodeSandbox-v0", reward="binary")


def test_code_sandbox_times_only_the_run_not_the_wait_for_a_sandbox_slot(monkeypatch):
    # The hidden tests and the tool wait for a sandbox slot when other episodes' runs hold them all;
    # only the sandbox's own limit (from when the run has a slot) may judge the program.
    from treerl.envs.sandbox import SandboxLimits, run_python

    monkeypatch.setenv("TREERL_SANDBOX_MAX_CONCURRENT", "1")
    env = treerl.make("treerl/CodeSandbox-v0", limits=SandboxLimits(timeout_s=1.0))
    assert env.score_timeout_s is None and [t.timeout for t in env.tools] == [None]
    env.reset(options={"task_index": 0})  # add(a, b)
    busy = threading.Thread(target=run_python, args=("import time; time.sleep(0.8)",))
    busy.start()
    time.sleep(0.3)  # the other run holds the only slot
    _, reward, terminated, *_ = env.step("```python\ndef add(a, b):\n    return a + b\n```")
    busy.join()
    assert terminated and reward == 1.0


def test_plain_functions_are_tools_as_in_trl():
    def add(a: int, b: int) -> int:
        """Add two integers.

        Args:
            a: The first.
            b: The second.
        """
        return a + b

    class _AddEnv(_EchoEnv):
        tool_list = (add,)

    for env in (_EchoEnv(tools=[add]), _AddEnv()):
        assert env.tool_schemas[0]["function"]["parameters"]["properties"]["a"] == {
            "type": "integer", "description": "The first."}
        env.reset(seed=0)
        obs, *_, info = env.step('<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>')
        assert obs[0]["content"] == "5" and info["tool_calls"][0]["error"] is None


def test_registry_errors_and_custom_registration():
    with pytest.raises(KeyError, match="Calculator-v0"):
        treerl.make("treerl/Calculater-v0")
    spec = treerl.register("tests/Echo-v0", _EchoEnv, override=True, max_turns=2)
    assert isinstance(spec, EnvSpec)
    assert treerl.make("tests/Echo-v0").max_turns == 2
    assert gymnasium.make("tests/Echo-v0").unwrapped.max_turns == 2
    with pytest.raises(ValueError, match="already registered"):
        treerl.register("tests/Echo-v0", _EchoEnv)
    # Gymnasium's own form of the constructor's defaults, kwargs={...}; its other options are refused by name.
    treerl.register("tests/Echo-v0", _EchoEnv, override=True, kwargs={"max_turns": 3})
    assert treerl.make("tests/Echo-v0").max_turns == 3 and treerl.make("tests/Echo-v0", max_turns=1).max_turns == 1
    with pytest.raises(ValueError, match=r"\['max_episode_steps'\] are gymnasium.register options"):
        treerl.register("tests/Echo-v0", _EchoEnv, override=True, max_episode_steps=5)
    with pytest.raises(ValueError, match=r"\['max_turns'\] given both"):
        treerl.register("tests/Echo-v0", _EchoEnv, override=True, kwargs={"max_turns": 3}, max_turns=2)


def test_ids_registered_with_gymnasium_and_module_prefixed_ids_are_made(tmp_path, monkeypatch):
    # A Gymnasium user registers with gymnasium.register and names the module to import in the id.
    (tmp_path / "user_echo_envs.py").write_text(
        "import gymnasium\n"
        "from treerl.envs import Task, ToolEnv\n"
        "class EchoEnv(ToolEnv):\n"
        "    def sample_task(self, rng):\n"
        "        return Task(prompt='say ok', answer='ok')\n"
        "gymnasium.register('user/Echo-v0', entry_point=EchoEnv, kwargs={'max_turns': 2})\n"
        "gymnasium.register('user/EchoLimited-v0', entry_point='user_echo_envs:EchoEnv', max_episode_steps=3)\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        env = treerl.make("user_echo_envs:user/Echo-v0", system_prompt="hi")
        assert type(env).__name__ == "EchoEnv" and env.max_turns == 2
        assert env.spec.id == "user/Echo-v0" and env.spec.kwargs == {"max_turns": 2, "system_prompt": "hi"}
        assert treerl.make("user/Echo-v0").max_turns == 2
        with pytest.raises(ConfigError, match="max_episode_steps=3.*max_turns"):
            treerl.make("user/EchoLimited-v0")  # treerl plays it bare: the TimeLimit would be lost
    finally:
        for env_id in ("user/Echo-v0", "user/EchoLimited-v0"):
            gymnasium.registry.pop(env_id, None)
    with pytest.raises(ConfigError, match="CartPole-v1 is a Gymnasium environment .* not a treerl one"):
        treerl.make("CartPole-v1")
    with pytest.raises(ConfigError, match="importing 'no_such_user_module' failed"):
        treerl.make("no_such_user_module:user/Echo-v0")


def test_check_env_passes_an_env_without_gold_answers_with_a_warning():
    # gold_actions() is optional: check_env says what it could not check instead of raising NotImplementedError.
    with pytest.warns(UserWarning, match="_EchoEnv has no gold answers.*gold_actions"):
        check_env(_EchoEnv(), gymnasium_checks=False)


def test_check_env_catches_episode_metrics_that_raise_on_an_episode_without_a_final_answer():
    class Counting(_EchoEnv):
        def episode_metrics(self):
            return {"answer_chars": len(self.final_answer)}  # None after a malformed call: a TypeError

        def gold_actions(self, task):
            return [task.answer]

    def ping(text: str) -> str:
        """Echo the text."""
        return text

    from treerl.envs.checker import EnvCheckError

    with pytest.raises(EnvCheckError, match=r"episode_metrics\(\) after step.*raised TypeError"):
        check_env(Counting(tools=[ping]), gymnasium_checks=False)  # with a tool, call markup can be malformed


@pytest.mark.slow  # a treerl envs process: about 6 s
def test_example_custom_env_is_listed_by_treerl_envs():
    out = subprocess.run(
        [sys.executable, "-m", "treerl.cli", "envs", "--json", "--import", EXAMPLE],
        capture_output=True, text=True, check=True,
    )
    entries = {e["id"]: e for e in json.loads(out.stdout)}
    assert set(ALL_IDS) <= set(entries)
    shop = entries["examples/Shopping-v0"]
    assert shop["tools"][0]["function"]["parameters"]["properties"]["item"]["type"] == "string"
    assert shop["description"]
    text = subprocess.run([sys.executable, "-m", "treerl.cli", "envs"], capture_output=True, text=True, check=True).stdout
    assert "treerl/Calculator-v0" in text and "tool calculator" in text


def test_custom_env_example_passes_check_env():
    import runpy

    runpy.run_path(EXAMPLE, run_name="not_main")
    check_env(treerl.make("examples/Shopping-v0"))


def test_parser_follows_the_policys_template_unless_given():
    from transformers import PreTrainedTokenizerFast
    from tokenizers import Tokenizer, models

    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel({"a": 0, "[UNK]": 1}, unk_token="[UNK]")))
    tok.chat_template = "{% for m in messages %}[INST]{{ m.content }}[/INST]{% endfor %}[TOOL_CALLS]"
    env = treerl.make("treerl/Calculator-v0")
    assert env.parser.name == "hermes"  # alone: Hermes
    env.use_parser_of(tok)
    assert env.parser.name == "mistral"
    env.reset(seed=0)
    _, _, _, _, info = env.step('[TOOL_CALLS][{"name": "calculator", "arguments": {"expression": "2 + 2"}}]')
    assert info["tool_calls"][0]["error"] is None
    fixed = treerl.make("treerl/Calculator-v0", parser="pythonic")
    fixed.use_parser_of(tok)
    assert fixed.parser.name == "pythonic"  # an explicit choice wins


def test_fork_shares_what_cannot_be_deep_copied_and_copies_the_rest():
    """An environment holding a client (here a lock, as an HTTP session does) still plays groups: each
    generation gets its own state, the client is shared, and a warning names it."""
    from treerl.envs.core import Env

    class WithClient(Env):
        def __init__(self):
            super().__init__()
            self.client = threading.Lock()
            self.calls = []

    env = WithClient()
    env.calls.append("reset")
    with pytest.warns(UserWarning, match=r"client \(lock\) cannot be deep-copied"):
        child = env.fork()
    child.calls.append("step")
    assert child.client is env.client and env.calls == ["reset"] and child.calls == ["reset", "step"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per class
        env.fork()


@pytest.mark.parametrize("env_id", ["treerl/Calculator-v0", "treerl/GuessNumber-v0"])
def test_gymnasiums_checker_passes_the_builtin_envs_without_warnings(env_id):
    from gymnasium.utils.env_checker import check_env as gymnasium_check_env

    env = gymnasium.make(env_id, render_mode="ansi")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        gymnasium_check_env(env.unwrapped)


class _GuessText(gymnasium.Env):
    """A text game as GEM and TextArena write them: str observations, str actions."""

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.secret = int(self.np_random.integers(1, 4))
        return "Guess my number from 1 to 3; answer with the digit.", {"secret": self.secret}

    def step(self, action):
        right = action.strip() == str(self.secret)
        return ("Correct!" if right else "No, try again."), float(right), right, False, {}


def test_a_text_game_plays_as_a_chat_through_the_engine():
    from _scripted import ScriptedPolicy

    from treerl.envs import TextEnv
    from treerl.models import load_default_model
    from treerl.rollout.engine import RolloutEngine

    _, tok = load_default_model()
    with pytest.warns(UserWarning, match="no gold answers"):
        check_env(TextEnv(_GuessText()))  # Gymnasium's checker and treerl's pass
    policy = ScriptedPolicy(tok, lambda task, g, turn: str(turn + 1), end_id=tok.convert_tokens_to_ids("<|im_end|>"))
    factory = lambda: TextEnv(_GuessText, system_prompt="Play the game.")  # noqa: E731
    (group,), _ = asyncio.run(RolloutEngine(policy, tok, seed=0).run(factory, "tests/Guess-v0", range(1), 2))
    secret = factory().reset(seed=0)[1]["secret"]
    for episode in group.episodes:  # guesses 1, 2, 3: right at the secret's turn
        assert episode.reward == 1.0 and episode.termination == "terminated"
        text = tok.decode(episode.token_ids)
        assert text.count("No, try again.") == secret - 1 and "Play the game." in text and "Correct!" not in text
