"""The temperature a tool episode samples at: the one the rollout was asked for, greedy included."""

import sys
from pathlib import Path

import trl_ppo_ext.generation.transformers_generate as generate_module
from trl_ppo_ext import PPOTrainer
from trl_ppo_ext.tiny import build_tiny_causal_lm, build_tiny_chat_tokenizer

sys.path.insert(0, str(Path(__file__).parents[1] / "scripts"))
from tiny_setup import multiply, tool_config, tool_dataset  # noqa: E402


def test_a_greedy_tool_rollout_generates_greedily(tmp_path, monkeypatch):
    tok = build_tiny_chat_tokenizer()
    trainer = PPOTrainer(model=build_tiny_causal_lm(tok, max_position_embeddings=1024), processing_class=tok,
                         reward_funcs=[lambda completions, **kw: [0.0] * len(completions)],
                         args=tool_config(tmp_path, temperature=0.7, response_length=4),
                         train_dataset=tool_dataset(2), tools=[multiply])
    seen = []

    def recording(*args, **kwargs):
        seen.append(args[3] if len(args) > 3 else kwargs["temperature"])  # sampling_config(width, stops, pad, t)
        return sampling_config(*args, **kwargs)

    sampling_config = generate_module.sampling_config
    monkeypatch.setattr(generate_module, "sampling_config", recording)
    trainer.generate_rollout(next(iter(trainer.dataloader)), temperature=0.0)
    assert seen and all(t == 0.0 for t in seen), seen  # it sampled at 0.7 when 0.0 read as "not given"
    # outside a rollout the config's temperature holds again
    seen.clear()
    trainer.generate_continuations([[5, 6]], 2)
    assert seen == [0.7]
