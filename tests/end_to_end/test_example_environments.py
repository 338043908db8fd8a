"""examples/env_*.py: each environment package, wired as a TRL GRPO script wires it, trains two
updates through PPOTrainer, and what the package reported is what the rewards hold.

The packages are optional (``pip install -e ".[envs]"``): each test skips without its own, except
where ``TRL_PPO_EXT_REQUIRE_ENVS=1`` (CI's environment that installs them), where a missing package
fails. The policy is scripted (a random tiny policy never writes a tool call): a binary search
over the game's range that reads the hints in its own episode so far, so every episode, and so
every reward, is computed by hand below from the game's number. Two samples per prompt
(``num_generations=2``), one prompt per update: the two samples must play the same game."""

import importlib
import os
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "examples"))
sys.path.insert(0, str(ROOT / "tests" / "scripts"))
from tiny_setup import TOOL_CALL, tool_config  # noqa: E402


def need(package: str):
    """The package, or a skip; a failure where CI installed the packages (TRL_PPO_EXT_REQUIRE_ENVS=1)."""
    if os.environ.get("TRL_PPO_EXT_REQUIRE_ENVS") == "1":
        return importlib.import_module(package)
    return pytest.importorskip(package)


def binary_search(text: str, low: int, high: int) -> str:
    """The scripted policy's next turn: a guess halfway through what the hints so far leave, or
    ``Found it.`` once a reply has neither "higher" nor "lower" (the game said right)."""
    episode = text.split("<|im_start|>assistant", 1)[1]  # the turns after the prompt
    guesses = [int(g) for g in re.findall(r'"number": (\d+)', episode)]
    replies = re.findall(r"<tool_response>\n(.*?)\n</tool_response>", episode, re.S)
    for guess, reply in zip(guesses, replies):
        if "higher" in reply:
            low = guess + 1
        elif "lower" in reply:
            high = guess - 1
        else:
            return "Found it.<|im_end|>"
    return TOOL_CALL.format(name="guess", args=f'{{"number": {(low + high) // 2}}}')


def scripted_trainer(low: int, high: int):
    from trl_ppo_ext import PPOTrainer

    class Guesser(PPOTrainer):
        def generate_continuations(self, prefixes, max_new_tokens, temperature=None, **kwargs):
            tok = self.processing_class
            budgets = [max_new_tokens] * len(prefixes) if isinstance(max_new_tokens, int) else max_new_tokens
            ids = [tok(binary_search(tok.decode(p), low, high), add_special_tokens=False).input_ids[:n]
                   for p, n in zip(prefixes, budgets)]
            return ids, [[-0.5] * len(row) for row in ids]

    return Guesser


def tokenizer_and_policy(environment):
    """The byte-level chat tokenizer with the system block that shows the tool's schema as one
    added token (byte by byte it is ~600 ids of every prompt; the trainer's forwards would spend
    their time on it), and a tiny policy over it."""
    from transformers import AddedToken

    from trl_ppo_ext.agents.environments import Environments
    from trl_ppo_ext.agents.support import check_tool_support
    from trl_ppo_ext.tiny import build_tiny_causal_lm, build_tiny_chat_tokenizer

    tok = build_tiny_chat_tokenizer()
    tools = Environments(environment).tools_of[None]
    text = tok.apply_chat_template([{"role": "user", "content": "x"}], tools=tools, add_generation_prompt=True,
                                   chat_template=check_tool_support(tok), tokenize=False, enable_thinking=False)
    system = text[len("<|im_start|>"):text.index("<|im_end|>")]
    tok.add_tokens([AddedToken(system, special=False, normalized=False)])
    return tok, build_tiny_causal_lm(tok, max_position_embeddings=2048)


def snapshot(env, **extra) -> dict:
    """What an episode's environment holds when the trainer scores it (the instances are reused
    by the next update, so they are read at once)."""
    return {"id": id(env), "seed": env.seed, "done": env.done, "reward": env.get_reward(),
            "rewards": list(getattr(env, "rewards", [])), "step_turns": list(getattr(env, "step_turns", [])),
            **extra}


def train_two_updates(tmp_path, wiring, seeds, low, high, read=snapshot):
    """Two updates of one prompt each (seeds[0] and seeds[1], in the loader's order), two samples
    per prompt, three rounds of tools at most. Returns the per-update logs and, per update, what
    ``read`` took from each episode's environment, in the batch's order."""
    from datasets import Dataset

    tok, policy = tokenizer_and_policy(wiring.ENVIRONMENT)
    data = Dataset.from_list([wiring.rows(1, seed=s)[0] for s in seeds])
    args = tool_config(tmp_path, num_generations=2, response_length=400, max_tool_calling_iterations=3)
    trainer = scripted_trainer(low, high)(model=policy, processing_class=tok, args=args, train_dataset=data,
                                          environment_factory=wiring.ENVIRONMENT)
    played = []
    score = trainer.score_rollout
    trainer.score_rollout = lambda sample: played.append([read(e) for e in sample.extras["environments"]]) or \
        score(sample)
    trainer.train()
    logs = [h for h in trainer.state.log_history if "objective/scores" in h]
    assert len(logs) == 2 and len(played) == 2
    return logs, played


def by_seed(logs, played, name):
    """{seed: (logged reward mean, tool calls per episode)} of the two updates, checking that the
    two samples of each update were two instances playing one game, and ended alike."""
    out = {}
    for log, (first, second) in zip(logs, played):
        assert first["id"] != second["id"] and first["seed"] == second["seed"]  # one game: a group
        assert {k: v for k, v in first.items() if k != "id"} == {k: v for k, v in second.items() if k != "id"}
        out[first["seed"]] = (log[f"rewards/{name}/mean"], log["tools/call_frequency"])
    return out


@pytest.mark.slow
def test_gem_guess_the_number_trains_and_its_step_rewards_are_the_reward(tmp_path):
    need("gem")
    import env_gem

    # GEM 0.1.0 (1..10, four turns): seed 9 hides 8, seed 0 hides 7 (gem.make(...).reset(seed=s)).
    # Seed 9: 5 "higher", 8 right -> steps 0.0 + 1.0 = 1.0, two calls.
    # Seed 0: 5 "higher", 8 "lower", 6 "higher", then the cap (3 rounds) -> 0.0 + 0.0 + 0.0, three calls.
    read = lambda env: snapshot(env, number=env.environment.game_number)  # noqa: E731
    logs, played = train_two_updates(tmp_path, env_gem, [9, 0], 1, 10, read)
    assert by_seed(logs, played, "GemGuessTheNumber") == {9: (1.0, 2.0), 0: (0.0, 3.0)}
    episodes = {envs[0]["seed"]: envs[0] for envs in played}
    assert episodes[9] | {"id": 0} == {"id": 0, "seed": 9, "number": 8, "rewards": [0.0, 1.0], "reward": 1.0,
                                       "done": True, "step_turns": [0, 1]}
    assert episodes[0] | {"id": 0} == {"id": 0, "seed": 0, "number": 7, "rewards": [0.0, 0.0, 0.0], "reward": 0.0,
                                       "done": False, "step_turns": [0, 1, 2]}  # the 4th call: past the cap, not run
    assert episodes[9]["reward"].turns == (0.0, 1.0)  # per turn: the win on the turn that guessed 8
    assert all(log["tools/failure_frequency"] == 0.0 for log in logs)


@pytest.mark.slow
def test_openenv_environment_trains_and_the_sum_of_its_step_rewards_is_the_reward(tmp_path):
    need("openenv")
    import env_openenv

    # random.Random(seed).randint(1, 10): seed 1 -> 3, seed 9 -> 8. Steps pay -0.1 wrong, 1.0 right:
    # seed 1: 5 lower, 2 higher, 3 right -> -0.1 - 0.1 + 1.0 = 0.8 (three calls);
    # seed 9: 5 higher, 8 right -> -0.1 + 1.0 = 0.9 (two calls).
    read = lambda env: snapshot(env, target=env.environment.target)  # noqa: E731
    logs, played = train_two_updates(tmp_path, env_openenv, [1, 9], 1, 10, read)
    result = by_seed(logs, played, "OpenEnvGuessTheNumber")
    assert result[1] == (pytest.approx(0.8), 3.0) and result[9] == (pytest.approx(0.9), 2.0)
    episodes = {envs[0]["seed"]: envs[0] for envs in played}
    assert (episodes[1]["target"], episodes[1]["rewards"], episodes[1]["done"]) == (3, [-0.1, -0.1, 1.0], True)
    assert (episodes[9]["target"], episodes[9]["rewards"], episodes[9]["done"]) == (8, [-0.1, 1.0], True)
    # per turn: each guess's reward on the turn that made it
    assert episodes[1]["reward"].turns == (-0.1, -0.1, 1.0) and episodes[9]["reward"].turns == (-0.1, 1.0)


@pytest.mark.slow
def test_textarena_guess_the_number_trains_and_its_close_reward_is_the_reward(tmp_path):
    need("textarena")
    import env_textarena

    # TextArena 0.7.4 (1..20): seed 1 hides 5, seed 8 hides 8. Seed 1: 10 lower, 5 right -> close()
    # pays 1 (two calls). Seed 8: 10 lower, 5 higher, 7 higher, then the cap: never closed -> 0.0.
    logs, played = train_two_updates(tmp_path, env_textarena, [1, 8], 1, 20)
    assert by_seed(logs, played, "TextArenaGuessTheNumber") == {1: (1.0, 2.0), 8: (0.0, 3.0)}
    assert {envs[0]["seed"]: envs[0]["done"] for envs in played} == {1: True, 8: False}  # the cut game never closed


@pytest.mark.slow
def test_reasoning_gym_score_answer_is_the_reward(tmp_path):
    need("reasoning_gym")
    import env_reasoning_gym
    from datasets import Dataset

    from trl_ppo_ext import PPOTrainer
    from trl_ppo_ext.tiny import build_tiny_causal_lm, build_tiny_chat_tokenizer

    # basic_arithmetic, seed 1: question 0 "Calculate 5 - 3 - 6." (-4), question 1 "Calculate 2 - -1." (3).
    data = env_reasoning_gym.rows(2, seed=1)
    assert [row["prompt"][0]["content"].split(" Put")[0] for row in data] == ["Calculate 5 - 3 - 6.",
                                                                              "Calculate 2 - -1."]
    answers = {"5 - 3 - 6": ["<answer>-4</answer>", "-4"], "2 - -1": ["<answer>3</answer>", "<answer>-3</answer>"]}
    tok = build_tiny_chat_tokenizer()

    def scripted(prompts, trainer):  # the policy's answers replayed: the first sample of a prompt, then the second
        ids, completions = [], []
        for b, prompt in enumerate(prompts):
            text = tok.apply_chat_template(prompt, add_generation_prompt=True, tokenize=False, enable_thinking=False)
            key = next(k for k in answers if k in text)
            ids.append(tok(text, add_special_tokens=False).input_ids)
            completions.append(tok(answers[key][b % 2] + "<|im_end|>", add_special_tokens=False).input_ids)
        return {"prompt_ids": ids, "completion_ids": completions, "logprobs": [[-0.5] * len(c) for c in completions]}

    args = tool_config(tmp_path, num_generations=2, response_length=24)
    trainer = PPOTrainer(model=build_tiny_causal_lm(tok), processing_class=tok, args=args,
                         train_dataset=Dataset.from_list(list(data)), reward_funcs=env_reasoning_gym.REWARD_FUNCS,
                         rollout_func=scripted)
    rollouts = []
    score = trainer.score_rollout
    trainer.score_rollout = lambda sample: rollouts.append(score(sample)) or rollouts[-1]
    trainer.train()
    logs = [h for h in trainer.state.log_history if "objective/scores" in h]
    # question 0: "<answer>-4</answer>" scores 1.0, "-4" without the tags 0.0 (no answer) -> mean 0.5;
    # question 1: "3" is 1.0, and "-3" 0.5: reasoning-gym's default score_answer gives an answer that
    # contains the oracle len(oracle) / len(answer) = len("3") / len("-3") -> mean 0.75
    assert sorted(log["rewards/reasoning_gym_score/mean"] for log in logs) == [0.5, 0.75]
    assert sorted(r.scores.tolist() for r in rollouts) == [[1.0, 0.0], [1.0, 0.5]]  # each sample its own score
    assert env_reasoning_gym.reasoning_gym_score(["<answer>-4</answer>", "-4", "<answer> -4 </answer>"],
                                                 ["basic_arithmetic"] * 3, [2] * 3, [1] * 3, [0] * 3) == [1.0, 0.0, 1.0]


def test_the_script_names_the_extra_when_a_package_is_missing():
    import ppo_environments

    assert ppo_environments.parse_args(["--env", "gem"]).env == "gem"
    with pytest.raises(SystemExit):
        ppo_environments.parse_args(["--env", "wordle"])  # not among the four
    with pytest.raises(SystemExit, match=r'--env no_such_package needs its package: pip install "trl-ppo-ext\[envs\]"'):
        ppo_environments.load("no_such_package")
