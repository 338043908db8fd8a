"""PPO on an environment from a package you already have: OpenEnv, GEM, TextArena or Reasoning Gym.

    pip install "trl-ppo-ext[envs]"                       # the four packages (docs/tools.md: their cost)
    python examples/ppo_environments.py --env gem         # or openenv, textarena, reasoning_gym
    python examples/ppo_environments.py --env gem --model_name_or_path Qwen/Qwen3-0.6B --total_episodes 512

Each ``examples/env_<name>.py`` is the package wired as a TRL GRPO script wires it: an
``environment_factory`` class (``ENVIRONMENT``; its ``get_reward`` the reward) or reward functions
(``REWARD_FUNCS``), and ``rows(n, seed)``, the prompts with the ``seed`` each episode's ``reset``
starts from. This script passes them to ``trl_ppo_ext.PPOTrainer`` as they would go to
``trl.GRPOTrainer``, with ``num_generations`` samples per prompt, so the samples of a prompt play
the same game.

Without ``--model_name_or_path`` the policy is a random tiny Llama over the byte-level chat
tokenizer of ``trl_ppo_ext.tiny`` (TRL's Qwen3 template): the run shows the wiring on a CPU in
seconds and learns nothing (a random policy never writes a tool call). A chat model whose template
TRL's tool-call parser knows (Qwen3, Llama 3.1+, ...) plays the games.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # _startup and the env_<name> modules
import _startup  # noqa: E402, F401  (env defaults; the package from a source checkout)

ENVIRONMENTS = ("openenv", "gem", "textarena", "reasoning_gym")


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--env", choices=ENVIRONMENTS, required=True, help="The package to train on.")
    parser.add_argument("--model_name_or_path", default=None, help="A chat model; default: a random tiny Llama.")
    parser.add_argument("--output_dir", default="outputs/ppo_environments")
    parser.add_argument("--total_episodes", type=int, default=8)
    parser.add_argument("--num_prompts", type=int, default=64, help="Prompts (games, questions) in the dataset.")
    parser.add_argument("--response_length", type=int, default=256, help="The episode's budget, tool tokens included.")
    parser.add_argument("--max_tool_calling_iterations", type=int, default=6)
    return parser.parse_args(argv)


def load(env: str):
    """The wiring module ``env_<env>``; a missing package says what to install."""
    try:
        return importlib.import_module(f"env_{env}")
    except ModuleNotFoundError as error:
        raise SystemExit(f"--env {env} needs its package: pip install \"trl-ppo-ext[envs]\" ({error})") from error


def policy_and_tokenizer(name: str | None):
    if name is None:
        from trl_ppo_ext.tiny import build_tiny_causal_lm, build_tiny_chat_tokenizer

        tok = build_tiny_chat_tokenizer()
        return build_tiny_causal_lm(tok, max_position_embeddings=4096), tok
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return AutoModelForCausalLM.from_pretrained(name), AutoTokenizer.from_pretrained(name)


def main(argv=None) -> dict:
    from trl_ppo_ext import PPOConfig, PPOTrainer

    args = parse_args(argv)
    wiring = load(args.env)
    policy, tok = policy_and_tokenizer(args.model_name_or_path)
    config = PPOConfig(
        output_dir=args.output_dir, total_episodes=args.total_episodes, per_device_train_batch_size=4,
        num_generations=2,  # two samples of each prompt: the same seed, the same game
        response_length=args.response_length, max_tool_calling_iterations=args.max_tool_calling_iterations,
        chat_template_kwargs={"enable_thinking": False}, learning_rate=1e-4, num_mini_batches=1,
        local_rollout_forward_batch_size=4, num_sample_generations=0, save_strategy="no", logging_steps=1,
        report_to=[], bf16=False, seed=0,
    )
    trainer = PPOTrainer(model=policy, processing_class=tok, args=config, train_dataset=wiring.rows(args.num_prompts),
                         reward_funcs=wiring.REWARD_FUNCS or None, environment_factory=wiring.ENVIRONMENT)
    trainer.train()
    logs = [h for h in trainer.state.log_history if "objective/scores" in h]
    for h in logs:
        print({k: round(v, 4) for k, v in h.items() if k.startswith(("rewards/", "tools/", "objective/scores"))})
    return {"env": args.env, "updates": len(logs), "log_history": logs}


if __name__ == "__main__":
    main()
