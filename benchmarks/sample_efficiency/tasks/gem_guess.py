"""The ``gem_guess`` task: GEM's ``game:GuessTheNumber-v0-easy`` (``pip install gem-llm``), a game
with a reward per step, brought as a user brings it: ``examples/env_gem.py``'s
``GemGuessTheNumber`` (``trl_ppo_ext.agents.gym_environment``, one tool ``guess(number)``).

A number from 1 to 10, four turns. Each turn the policy calls ``guess``; GEM replies "higher" or
"lower" than the guess (reward 0.0), or "correct" (reward 1.0, the game ends); a move without a
number costs 0.1. The adapter books each step's reward on the turn that called it, so this
package's critic sees a reward per turn and GAE carries the win back from the turn that won; TRL
GRPO reads their sum, the episode's return. A binary search over the hints always wins within
four guesses; guessing at random wins about a third of the games.

The policy: a tiny Llama over the byte-level chat tokenizer, the fixed text of the template and
of GEM's messages as whole tokens (``build_tokenizer``), after an SFT warm-up
(``build_sft``) on played episodes: a ``SEARCH_FRACTION`` share search (each guess halfway
through what the hints leave), the others guess at random, then a short last turn. The warm-up
teaches the format and a mixture of both; the reward can teach the policy to follow the hints.
Each dataset row carries the game's ``seed`` (the ``num_generations`` samples of a row play the
same number). The ``reward`` of a row is the mean episode return of the update's rollout (1.0
for a win less 0.1 per move without a number). Without ``gem`` installed, the task is refused
with a message naming the package (``missing()``).
"""

from __future__ import annotations

import importlib.util
import random
import re
from pathlib import Path

from ..common import _examples_on_path
from ..critics import actor_and_critic
from .base import GRPOInputs, OursRun, TaskSpec

LOW, HIGH, TURNS = 1, 10, 4  # GEM's GuessTheNumber-v0-easy
SEARCH_FRACTION = 0.5  # the warm-up's share of episodes that search; the others guess at random
SFT_EPISODES, SFT_STEPS, SFT_LEARNING_RATE = 400, 200, 3e-3
PROMPT = [{"role": "user", "content": "Find the hidden number with the guess tool."}]
LAST_TURN = "Done.<|im_end|>"  # the policy's turn after the game ended
CHAT_TEMPLATE_KWARGS = {"enable_thinking": False}
REWARD_NAME = "GemGuessTheNumber"  # the environment class: rewards/<name>/mean is its return
PPO_SETTINGS = dict(
    total_episodes=1024,  # 32 updates of 32
    per_device_train_batch_size=16,
    gradient_accumulation_steps=2,
    num_mini_batches=2,
    learning_rate=3e-3,
    kl_coef=0.01,
    temperature=1.0,
    response_length=80,  # four rounds of call (~4 ids) and reply (~12), and the last turn
    max_tool_calling_iterations=TURNS,
    chat_template_kwargs=CHAT_TEMPLATE_KWARGS,
    stop_token="eos",
    local_rollout_forward_batch_size=32,
)
SPEC = TaskSpec(episodes=1024, hidden_size=32, reward_name="episode return (1 = win)",
                batch_size=32, refused={"trl112": "the gem_guess task needs environment_factory, which TRL 1.12's "
                                                  "PPOTrainer does not take."})


def missing() -> str | None:
    """None where ``gem`` imports, else what to install."""
    if importlib.util.find_spec("gem") is None:
        return 'the gem_guess task needs GEM: pip install "trl-ppo-ext[envs]" (or gem-llm)'
    return None


def settings() -> dict:
    return PPO_SETTINGS


def environment_class():
    """``examples/env_gem.py``'s ``GemGuessTheNumber`` (raises with what to install where gem is missing)."""
    why = missing()
    if why is not None:
        raise ModuleNotFoundError(why)
    _examples_on_path()
    from env_gem import GemGuessTheNumber

    return GemGuessTheNumber


def call_text(number: int) -> str:
    """The policy's turn that guesses ``number``, as Qwen3 writes a tool call (TRL's parser reads it)."""
    return f'<tool_call>\n{{"name": "guess", "arguments": {{"number": {number}}}}}\n</tool_call><|im_end|>'


def search_guess(replies: list[tuple[int, str]]) -> int:
    """The guess halfway through what the ``(guess, reply)`` pairs so far leave.

    >>> search_guess([]), search_guess([(5, "... is higher than 5.")]), search_guess([(5, "lower than 5")])
    (5, 8, 2)
    """
    low, high = LOW, HIGH
    for guess, reply in replies:
        if "higher" in reply:
            low = guess + 1
        elif "lower" in reply:
            high = guess - 1
    return (low + high) // 2


def play(env, seed: int, search: bool, rng: random.Random) -> list[tuple[int, str]]:
    """One game of ``env`` (an instance of the environment class) from ``seed``: ``(guess, reply)``
    per turn until it ends, searching or guessing at random (``rng``)."""
    env.reset(prompt=PROMPT, seed=seed)
    turns: list[tuple[int, str]] = []
    while not env.done:
        number = search_guess(turns) if search else rng.randint(LOW, HIGH)
        turns.append((number, env.guess(number)))
    return turns


def _pieces(texts: list[str], added: list[str]) -> list[str]:
    """The fixed text of ``texts`` between the tokenizer's ``added`` tokens and digits, longest first,
    pieces of one length in text order: the ids must not depend on the process's string hashing (the
    warm-up and the runs build the tokenizer in processes of their own)."""
    splitter = "|".join(re.escape(t) for t in sorted(added, key=len, reverse=True))
    return sorted({p for text in texts for p in re.split(f"{splitter}|[0-9]+", text) if len(p) > 1},
                  key=lambda p: (-len(p), p))


def build_tokenizer():
    """``(tokenizer, chat_template)``: the byte-level chat tokenizer of ``trl_ppo_ext.tiny`` with the
    fixed text of a prompt (the tool's schema, GEM's rules), of a call and of GEM's replies as
    whole tokens (byte by byte a prompt is ~1,300 ids); numbers stay one id per digit."""
    from transformers import AddedToken

    from trl_ppo_ext.agents.environments import Environments
    from trl_ppo_ext.agents.support import check_tool_support
    from trl_ppo_ext.agents.tool_loop import tool_suffix_ids
    from trl_ppo_ext.tiny import build_tiny_chat_tokenizer

    tok = build_tiny_chat_tokenizer()
    template = check_tool_support(tok)
    Env = environment_class()
    env, tools = Env(), Environments(Env).tools_of[None]
    conversation = [{"role": "user", "content": PROMPT[0]["content"] + env.reset(prompt=PROMPT, seed=0)}]
    texts = [tok.apply_chat_template(conversation, tools=tools, chat_template=template, add_generation_prompt=True,
                                     tokenize=False, **CHAT_TEMPLATE_KWARGS), call_text(0), LAST_TURN]
    rng = random.Random(0)
    for seed in range(4):  # every kind of reply: higher, lower, the win, the turn limit
        for search in (True, False):
            for _, reply in play(env, seed, search, rng):
                suffix = tool_suffix_ids(tok, [{"role": "tool", "name": "guess", "content": reply}], template,
                                         CHAT_TEMPLATE_KWARGS)
                texts.append(tok.decode(suffix))
    tok.add_tokens([AddedToken(p, special=False, normalized=False) for p in _pieces(texts, tok.get_added_vocab())])
    return tok, check_tool_support(tok)


def episode_ids(tok, template, env, seed: int, search: bool, rng: random.Random) -> tuple[list[int], list[int]]:
    """``(input_ids, labels)`` of one warm-up episode: the prompt as the trainer renders it (GEM's first
    observation appended to the user turn), then each call, GEM's reply (label -100) and the last turn."""
    from trl_ppo_ext.agents.environments import Environments
    from trl_ppo_ext.agents.tool_loop import render_prompt, tool_suffix_ids

    first = env.reset(prompt=PROMPT, seed=seed)
    prompt = render_prompt(tok, [{"role": "user", "content": PROMPT[0]["content"] + first}],
                           Environments(type(env)).tools_of[None], template, CHAT_TEMPLATE_KWARGS)
    ids, labels = list(prompt), [-100] * len(prompt)
    for number, reply in play(env, seed, search, rng):
        turn = tok(call_text(number), add_special_tokens=False).input_ids
        suffix = tool_suffix_ids(tok, [{"role": "tool", "name": "guess", "content": reply}], template,
                                 CHAT_TEMPLATE_KWARGS)
        ids += turn + suffix
        labels += turn + [-100] * len(suffix)
    last = tok(LAST_TURN, add_special_tokens=False).input_ids
    return ids + last, labels + last


def build_sft(seed: int, out: Path, hidden_size: int, *, trainer_dir: Path, steps: int = SFT_STEPS) -> dict:
    """The initial policy of ``seed`` to ``out``: a random tiny Llama, then ``steps`` SFT steps on
    ``SFT_EPISODES`` played games (seeds 1000.., apart from the PPO rows' 0..), a ``SEARCH_FRACTION``
    share searching. Returns what ``info.json`` keeps of it."""
    from datasets import Dataset
    from tool_task import sft_warm_up

    from trl_ppo_ext.tiny import build_tiny_causal_lm

    tok, template = build_tokenizer()
    env, rng = environment_class()(), random.Random(seed)
    rows = {"input_ids": [], "labels": []}
    for i in range(SFT_EPISODES):
        ids, labels = episode_ids(tok, template, env, 1000 + i, rng.random() < SEARCH_FRACTION, rng)
        rows["input_ids"].append(ids)
        rows["labels"].append(labels)
    length = max(len(r) for r in rows["input_ids"]) + PPO_SETTINGS["response_length"]
    model = build_tiny_causal_lm(tok, seed=seed, hidden_size=hidden_size, max_position_embeddings=length)
    if steps:
        task = type("Task", (), {"tokenizer": tok})()  # sft_warm_up reads only the tokenizer
        model = sft_warm_up(task, model, Dataset.from_dict(rows), str(trainer_dir), max_steps=steps,
                            learning_rate=SFT_LEARNING_RATE, seed=seed)
    model.save_pretrained(out)
    return {"sft_steps": steps, "sft_episodes": SFT_EPISODES, "search_fraction": SEARCH_FRACTION}


def prepare(seed: int, tmp: Path, hidden_size: int) -> dict:
    return build_sft(seed, tmp / "sft", hidden_size, trainer_dir=tmp / "trainer")


def _inputs(model_dir: Path, num_prompts: int = 512):
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM

    tok, _ = build_tokenizer()
    policy = AutoModelForCausalLM.from_pretrained(model_dir / "sft")
    lora = LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, task_type="CAUSAL_LM",
                      target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "lm_head"])
    rows = Dataset.from_list([{"prompt": PROMPT, "seed": s} for s in range(num_prompts)])
    return tok, policy, lora, rows


def ours(arm, seed: int, *, make_config, model_dir: Path, hidden_size: int) -> OursRun:
    """This package's run: the SFT policy, ``environment_factory=GemGuessTheNumber`` whose ``get_reward``
    is the reward (per turn); the row's reward is its logged mean, the episode return."""
    from transformers import AutoModelForSequenceClassification

    tok, policy, lora, rows = _inputs(model_dir)
    config = make_config()
    value_model = AutoModelForSequenceClassification.from_pretrained  # TRL's example: a value model
    models = actor_and_critic(arm, policy, lora, config, lambda: value_model(model_dir / "sft", num_labels=1))
    models.update(reward_model=None, environment_factory=environment_class(), train_dataset=rows)

    def batch_reward(logs):
        return logs.get(f"rewards/{REWARD_NAME}/mean"), None

    return OursRun(config, tok, models, batch_reward)


def grpo(seed: int, ppo, *, model_dir: Path, hidden_size: int, recorder) -> GRPOInputs:
    """TRL GRPO's run: the same policy, LoRA, rows and environment; its ``get_reward`` (the return)
    is GRPO's reward, and each generation batch's returns are measured as they are read."""
    tok, policy, lora, rows = _inputs(model_dir)
    batch = ppo.per_device_train_batch_size * ppo.gradient_accumulation_steps
    seen: list[float] = []
    Env = environment_class()

    def get_reward(self):
        value = Env.get_reward(self)
        seen.append(float(value))
        if len(seen) == batch:  # TRL reads every episode of a generation batch in one call
            recorder.measure(seen[:])
            seen.clear()
        return float(value)

    Measured = type(REWARD_NAME, (Env,), {"get_reward": get_reward})
    return GRPOInputs(tok, policy, lora, rows, [], {"environment_factory": Measured})
