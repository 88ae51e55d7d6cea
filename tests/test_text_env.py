"""TextEnv: GEM's and TextArena's text games played as chats.

The first tests of each use a stand-in that follows the package's interface exactly as observed
in gem-llm 0.1.0 and textarena 0.7.4, so they run without the packages; the last ones play the
real games and skip where the packages are not installed (neither is a treerl extra: gem-llm
pins nltk and reasoning-gym).
"""

from __future__ import annotations

import asyncio
import random

import numpy as np
import pytest

from treerl.envs import TextEnv, check_env


class _GemGuess:
    """``gem.core.Env``'s interface (gem-llm 0.1.0) without the package: not a ``gymnasium.Env``;
    ``reset(self, seed=None) -> (str, info)`` takes no options and seeds the global ``random``
    (``gem.utils.seeding.set_seed``); ``step(action) -> (obs, reward, terminated, truncated, info)``
    with ``info={"suffix": ...}``, both ends set at the turn limit, as GEM's GuessTheNumber does."""

    def __init__(self, max_turns: int = 3):
        self.max_turns = max_turns
        self.reset()

    def reset(self, seed=None):
        if seed is not None:
            random.seed(seed)
        self.secret, self.turn_count = random.randint(1, 10), 0
        return "Guess a number between 1 and 10 in \\boxed{}.", {"suffix": "Enter your next guess."}

    def step(self, action):
        self.turn_count += 1
        if action == f"\\boxed{{{self.secret}}}":
            return "Congratulations!", 1.0, True, False, {"suffix": "Enter your next guess."}
        if self.turn_count >= self.max_turns:
            return "You have reached the maximum number of turns.", 0.0, True, True, {"suffix": "Enter your next guess."}
        return "Wrong.", 0.0, False, False, {"suffix": "Enter your next guess."}

    @property
    def unwrapped(self):
        return self


def test_a_gem_env_resets_without_options_and_plays_to_its_end():
    env = TextEnv(_GemGuess())
    obs, info = env.reset(seed=0)  # GEM's reset has no options: passing options=None raised TypeError
    assert obs == [{"role": "user", "content": "Guess a number between 1 and 10 in \\boxed{}."}]
    assert info == {"suffix": "Enter your next guess."}
    secret = env.env.secret
    assert env.reset(seed=0)[0] == obs and env.env.secret == secret  # seeded
    fork = env.fork()
    assert fork.step(f"\\boxed{{{secret}}}")[1:4] == (1.0, True, False)
    assert env.step("\\boxed{0}")[1:4] == (0.0, False, False)  # the fork played on its own copy
    with pytest.warns(UserWarning, match="no gold answers"):
        check_env(TextEnv(_GemGuess()))  # Gymnasium's checker resets with options={}


def test_a_gem_env_closes_though_gem_envs_have_no_close():
    env = TextEnv(_GemGuess())
    env.reset(seed=0)
    env.close()  # raised AttributeError: treerl rollout closes the environment it probes the template with


def test_a_real_gem_game_plays_as_a_chat():
    gem = pytest.importorskip("gem", reason="GEM is not installed: pip install gem-llm")
    env = TextEnv(lambda: gem.make("game:GuessTheNumber-v0-easy"))
    obs, info = env.reset(seed=0)
    assert obs[0]["role"] == "user" and "Guess The Number" in obs[0]["content"] and "suffix" in info
    secret = env.env.game_number
    assert env.reset(seed=0)[0] == obs and env.env.game_number == secret
    assert env.fork().step(f"\\boxed{{{secret}}}")[1:4] == (1.0, True, False)
    new, reward, terminated, truncated, _ = env.step("no guess")
    assert "did not provide a valid guess" in new[0]["content"] and (reward, terminated, truncated) == (-0.1, True, False)
    with pytest.warns(UserWarning, match="no gold answers"):
        check_env(TextEnv(gem.make("game:GuessTheNumber-v0-easy")))
    env.close()


class _Drawing:
    """A GEM game that draws from the global generators during ``step``, as GEM's 2048 places a new
    tile: each observation is a ``random`` and a numpy draw; the reward, at the third step, their sum."""

    def reset(self, seed=None):
        if seed is not None:  # gem.utils.seeding.set_seed
            random.seed(seed)
            np.random.seed(seed)
        self.draws = []
        return "Go.", {}

    def step(self, action):
        self.draws += [random.random(), float(np.random.random())]
        done = len(self.draws) == 6
        return " ".join(map(str, self.draws[-2:])), sum(self.draws) if done else 0.0, done, False, {}

    @property
    def unwrapped(self):
        return self


def _observations(env, num_steps):
    return [env.step("go")[0][0]["content"] for _ in range(num_steps)]


def test_the_forks_of_a_game_that_draws_in_step_play_as_the_original_would():
    """Each fork has its own copy of the game's generator state: forks stepped by turns, or at once in
    the engine's threads, see what one environment stepping alone sees; and the process's own
    generators are not touched. (The games drew from one process-wide generator: the forks took
    turns drawing from it, and a seeded reset reseeded the whole process.)"""
    random.seed(123)
    np.random.seed(123)
    process = random.getstate(), np.random.get_state()
    env = TextEnv(lambda: _Drawing())
    env.reset(seed=0)
    alone = _observations(env.fork(), 5)
    again = TextEnv(_Drawing())
    again.reset(seed=1)
    _observations(again, 2)
    again.reset(seed=0)
    assert _observations(again, 5) == alone  # a seeded reset starts the same game, whatever came before

    first, second = env.fork(), env.fork()
    by_turns = [(first.step("go")[0][0]["content"], second.step("go")[0][0]["content"]) for _ in range(5)]
    assert [a for a, _ in by_turns] == alone and [b for _, b in by_turns] == alone

    async def play(fork):
        return [(await fork.astep("go"))[0][0]["content"] for _ in range(5)]

    async def play_all():
        return await asyncio.gather(*(play(env.fork()) for _ in range(8)))

    assert asyncio.run(play_all()) == [alone] * 8
    assert random.getstate() == process[0]  # the process's generators are as they were
    after = np.random.get_state()
    assert after[0] == process[1][0] and np.array_equal(after[1], process[1][1]) and after[2:] == process[1][2:]


def test_own_random_false_plays_on_the_process_generators():
    env = TextEnv(_Drawing(), own_random=False)
    env.reset()
    random.seed(7)
    expected = random.random()
    random.seed(7)
    assert env.step("go")[0][0]["content"].split()[0] == str(expected)


def test_the_generations_of_a_group_play_a_drawing_game_alike_in_the_engine():
    """The rollout engine plays each generation on a fork, each step in a thread: same actions, same game."""
    from _scripted import ScriptedPolicy

    from treerl.models import load_default_model
    from treerl.rollout.engine import RolloutEngine

    _, tok = load_default_model()
    policy = ScriptedPolicy(tok, lambda task, g, turn: "go", end_id=tok.convert_tokens_to_ids("<|im_end|>"))
    groups, _ = asyncio.run(RolloutEngine(policy, tok, seed=0).run(lambda: TextEnv(_Drawing()), "tests/Drawing-v0",
                                                                   range(2), 4))
    rewards = [[e.reward for e in g.episodes] for g in groups]
    assert all(len(set(r)) == 1 and r[0] > 0 for r in rewards) and rewards[0][0] != rewards[1][0]


class _ArenaGuess:
    """``textarena.Env``'s interface (textarena 0.7.4) without the package, as its raw
    GuessTheNumber plays: ``reset(num_players, seed) -> None`` seeds the global ``random``;
    ``get_observation() -> (player_id, [(from_id, text, type), ...])`` gives the messages since the
    last look, the player's own action first (from_id -1 is the game); ``step(action) -> (done,
    info)``; ``close() -> (rewards by player, game info by player)``, the verdict in the latter."""

    def __init__(self, max_turns: int = 3):
        self.max_turns = max_turns

    def reset(self, num_players, seed=None):
        if seed is not None:
            random.seed(seed)
        self.secret, self.turn, self.done, self.rewards = random.randint(1, 10), 0, False, None
        self.info = {0: {"role": "Player 0", "invalid_move": False, "turn_count": 0}}
        self.pending = [(-1, "Guess a number between 1 and 10, e.g. [5].", "PROMPT")]

    def get_observation(self):
        obs, self.pending = self.pending, []
        return 0, obs

    def step(self, action):
        self.turn += 1
        self.info[0]["turn_count"] = self.turn
        self.pending.append((0, action, "PLAYER_ACTION"))
        if action == f"[{self.secret}]":
            self.done, self.rewards, self.info[0]["reason"] = True, {0: 1}, "Congratulations!"
        elif self.turn >= self.max_turns:
            self.done, self.rewards, self.info[0]["reason"] = True, {0: 0.5}, "The turn limit has been reached."
        else:
            self.pending.append((-1, "The target number is higher.", "GAME_MESSAGE"))
        return self.done, {}

    def close(self):
        return self.rewards, self.info


def test_a_textarena_game_plays_as_its_single_player():
    env = TextEnv(_ArenaGuess())
    obs, info = env.reset(seed=0)  # TextArena's reset needs num_players and returns nothing
    assert obs == [{"role": "user", "content": "Guess a number between 1 and 10, e.g. [5]."}] and info == {}
    secret = env.env.unwrapped.secret
    won = env.fork().step(f"[{secret}]")
    assert won[:4] == ([{"role": "user", "content": "Congratulations!"}], 1.0, True, False)
    assert won[4]["reason"] == "Congratulations!" and won[4]["turn_count"] == 1
    # Each observation is the game's new messages, without the action the chat already holds.
    assert env.step("[0]") == ([{"role": "user", "content": "The target number is higher."}], 0.0, False, False, {})
    env.step("[0]")
    assert env.step("[0]")[1:4] == (0.5, True, False)  # TextArena's turn limit ends the game with its reward
    assert env.reset(seed=0)[0] == obs and env.env.unwrapped.secret == secret
    with pytest.warns(UserWarning, match="no gold answers"):
        check_env(TextEnv(_ArenaGuess()))


class _ArenaWrapper:
    """TextArena 0.7.4's ``Wrapper``: the wrapped game in ``env``, every call passed on."""

    def __init__(self, env):
        self.env = env

    def __getattr__(self, name):
        return getattr(self.env, name)

    def reset(self, num_players, seed=None):
        return self.env.reset(num_players=num_players, seed=seed)

    def step(self, action):
        return self.env.step(action)

    def get_observation(self):
        return self.env.get_observation()

    def close(self):
        return self.env.close()


class _ArenaHistory(_ArenaWrapper):
    """TextArena's default ``LLMObservationWrapper``: the whole game so far as one string every
    turn, kept across ``reset`` (its ``full_observations`` is never cleared)."""

    full_observations: list = []

    def get_observation(self):
        player, new = self.env.get_observation()
        self.full_observations = [*self.full_observations, *new]
        return player, "".join(f"\n[{sender}] {text}" for sender, text, _ in self.full_observations)


class _ArenaBrackets(_ArenaWrapper):
    """TextArena's ``ActionFormattingWrapper``: an action without brackets gets them."""

    def step(self, action):
        return self.env.step(action if action.startswith("[") else f"[{action}]")


def test_a_textarena_game_under_the_default_wrappers_plays_as_the_raw_one():
    """``ta.make("X-v0")`` wraps the game in observation wrappers that resend the whole game every turn
    and keep the last game's messages after reset: observations are read under them, actions go through."""
    env = TextEnv(_ArenaBrackets(_ArenaHistory(_ArenaGuess())))
    obs, _ = env.reset(seed=0)
    assert obs == [{"role": "user", "content": "Guess a number between 1 and 10, e.g. [5]."}]
    assert env.step("0")[0] == [{"role": "user", "content": "The target number is higher."}]  # "0" played as "[0]"
    assert env.reset(seed=0)[0] == obs


def test_a_real_textarena_game_plays_as_a_chat():
    ta = pytest.importorskip("textarena", reason="TextArena is not installed: pip install textarena")
    env = TextEnv(lambda: ta.make("GuessTheNumber-v0-raw"))
    obs, info = env.reset(seed=0)
    assert obs[0]["role"] == "user" and "Guess The Number" in obs[0]["content"] and info == {}
    secret = env.env.unwrapped.game_number
    assert env.fork().step(f"[{secret}]")[1:4] == (1.0, True, False)
    wrong = 1 if secret != 1 else 2
    new, reward, terminated, truncated, _ = env.step(f"[{wrong}]")
    assert new[0]["content"] in ("The target number is higher.", "The target number is lower.")
    assert (reward, terminated, truncated) == (0.0, False, False)
    new, reward, terminated, _, info = env.step(f"[{wrong}]")  # a repeated guess: TextArena's warning, then the end
    assert "invalid move" in new[0]["content"] and not terminated
    new, reward, terminated, _, info = env.step(f"[{wrong}]")
    assert terminated and info["invalid_move"] and new[0]["content"] == info["reason"] and 0 <= reward < 1
    with pytest.warns(UserWarning, match="no gold answers"):
        check_env(TextEnv(ta.make("GuessTheNumber-v0-raw")))


def test_a_real_textarena_game_under_its_default_wrappers():
    ta = pytest.importorskip("textarena", reason="TextArena is not installed: pip install textarena")
    env = TextEnv(lambda: ta.make("GuessTheNumber-v0"))
    obs, _ = env.reset(seed=0)
    assert env.step("[1]")[0][0]["content"] in ("The target number is higher.", "Congratulations!")
    assert env.reset(seed=0)[0] == obs
    with pytest.warns(UserWarning, match="no gold answers"):
        check_env(TextEnv(ta.make("GuessTheNumber-v0")))
