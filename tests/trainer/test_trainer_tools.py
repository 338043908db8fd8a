"""A GRPO user's agent script (``tools=``, ``environment_factory=``, reward functions reading
``environments=``) with the trainer's class changed: PPOTrainer runs TRL's tool loop itself."""

import sys
import time
from pathlib import Path

import pytest
import torch

from trl_ppo_ext import PPOTrainer
from trl_ppo_ext.tiny import build_tiny_causal_lm, build_tiny_chat_tokenizer

sys.path.insert(0, str(Path(__file__).parents[1] / "scripts"))
import tiny_setup  # noqa: E402
from tiny_setup import TOOL_CALL as CALL  # noqa: E402
from tiny_setup import multiply, scripted_continuations, tool_config, tool_dataset  # noqa: E402

_config, _data = tool_config, tool_dataset


class Vault(tiny_setup.Vault):
    """tiny_setup's vault, with its own reward: 1 once opened."""

    def get_reward(self) -> float:
        return float(self.opened)




class ScriptedTurns(PPOTrainer):
    """The policy's turns replayed from a script (a random tiny policy never writes a tool call):
    the first turn calls the tool, the second answers. Everything else is the trainer's."""

    first_turn = CALL.format(name="multiply", args='{"a": 6, "b": 7}')

    def generate_continuations(self, prefixes, max_new_tokens, temperature=None):
        tok = self.processing_class
        texts = [self.first_turn if "<tool_response>" not in tok.decode(p) else "42<|im_end|>" for p in prefixes]
        return scripted_continuations(tok, texts, max_new_tokens)


@pytest.fixture(scope="module")
def policy_and_tok():
    tok = build_tiny_chat_tokenizer()
    return build_tiny_causal_lm(tok, max_position_embeddings=1024), tok


def _logs(trainer):
    return [h for h in trainer.state.log_history if "objective/scores" in h]


def test_a_grpo_tools_script_trains_with_the_class_changed(tmp_path, policy_and_tok):
    policy, tok = policy_and_tok
    seen = {}

    def correct(completions, **kwargs):  # TRL's: one message list per rollout, the last one the answer
        seen["completions"] = completions
        return [float("42" in (c[-1].get("content") or "")) for c in completions]

    trainer = ScriptedTurns(model=policy, processing_class=tok, reward_funcs=[correct], args=_config(tmp_path),
                            train_dataset=_data(), tools=[multiply])
    batches = []
    trainer.score_rollout = lambda sample, _orig=trainer.score_rollout: batches.append(r := _orig(sample)) or r
    trainer.train()
    logs = _logs(trainer)
    assert len(logs) == 2
    for log in logs:
        assert log["tools/call_frequency"] == 1.0 and log["tools/failure_frequency"] == 0.0
        assert log["rewards/correct/mean"] == 1.0 and log["rollout/turns_mean"] == 2.0
    roles = [m["role"] for m in seen["completions"][0]]
    assert roles == ["assistant", "tool", "assistant"] and seen["completions"][0][1]["content"] == "42"
    for rollout in batches:  # the tool's reply and the next header are environment tokens, the two turns actions
        env = rollout.response_mask & ~rollout.action_mask
        assert env.any(1).all() and (rollout.action_mask.sum(1) == rollout.action_mask.sum(1)[0]).all()
        text = tok.decode(rollout.responses[0][env[0]].tolist())
        assert "<tool_response>" in text and "42" in text


def test_a_grpo_environment_script_trains_with_the_class_changed(tmp_path, policy_and_tok):
    policy, tok = policy_and_tok
    got = {}

    def reads_environments(completions, environments, **kwargs):
        got["environments"] = environments
        return [0.5 * env.opened for env in environments]

    class VaultTurns(ScriptedTurns):
        first_turn = CALL.format(name="try_code", args='{"code": 41}')

    trainer = VaultTurns(model=policy, processing_class=tok, reward_funcs=[reads_environments],
                         args=_config(tmp_path), train_dataset=_data(), environment_factory=Vault)
    trainer.train()
    logs = _logs(trainer)
    assert len(logs) == 2 and all(isinstance(e, Vault) for e in got["environments"])
    # rows' targets 40..43: code 41 opens exactly one vault of the four -> Vault's own reward is 1/4 on average
    assert sum(log["rewards/Vault/mean"] for log in logs) / 2 == pytest.approx(0.25)
    assert all(log["tools/call_frequency"] == 1.0 for log in logs)


def test_environment_rewards_alone_are_enough(tmp_path, policy_and_tok):
    policy, tok = policy_and_tok
    trainer = ScriptedTurns(model=policy, processing_class=tok, args=_config(tmp_path), train_dataset=_data(),
                            environment_factory=Vault)
    assert [r.name for r in trainer.rewards] == ["Vault"] and trainer.rewards[0].weight == 1.0


def test_an_unscripted_policy_runs_the_tool_loop_end_to_end(tmp_path, policy_and_tok):
    policy, tok = policy_and_tok  # a random policy: no tool call, every episode one turn long
    trainer = PPOTrainer(model=policy, processing_class=tok, reward_funcs=[lambda completions, **kw: [0.0] *
                         len(completions)], args=_config(tmp_path, total_episodes=2), train_dataset=_data(2),
                         tools=[multiply])
    trainer.train()
    assert _logs(trainer)[0]["tools/call_frequency"] == 0.0


def test_tools_and_rollout_func_together_are_refused(tmp_path, policy_and_tok):
    policy, tok = policy_and_tok
    with pytest.raises(ValueError, match="either rollout_func or tools"):
        PPOTrainer(model=policy, processing_class=tok, reward_funcs=[lambda completions, **kw: [0.0]],
                   args=_config(tmp_path), train_dataset=_data(), tools=[multiply],
                   rollout_func=lambda prompts, trainer: {})


def test_an_environment_without_reset_is_refused_at_construction(tmp_path, policy_and_tok):
    policy, tok = policy_and_tok

    class NoReset:
        def poke(self) -> str:
            """Poke."""
            return "ouch"

    with pytest.raises(Exception, match="NoReset"):
        PPOTrainer(model=policy, processing_class=tok, args=_config(tmp_path), train_dataset=_data(),
                   environment_factory=NoReset)


def test_preempted_checkpoints_leave_the_environments_out(tmp_path, policy_and_tok):
    from trl_ppo_ext.run.preemption import InflightUpdate, UpdatePreempted

    policy, tok = policy_and_tok
    trainer = ScriptedTurns(model=policy, processing_class=tok, args=_config(tmp_path, num_mini_batches=2),
                            train_dataset=_data(), environment_factory=Vault)
    trainer.loop_state.sigterm.stop_agreed = lambda accelerator: True
    rollout = trainer.score_rollout(trainer.generate_rollout(next(iter(trainer.dataloader))))
    assert "environments" in rollout.extras
    with pytest.raises(UpdatePreempted) as stop:
        trainer.ppo_update(rollout, trainer.compute_advantages(rollout), 1)
    path = tmp_path / "inflight.pt"
    stop.value.inflight.save(str(path))
    loaded = InflightUpdate.load(str(path), torch.device("cpu"))  # weights_only: no live object inside
    assert "environments" not in loaded.rollout["extras"] and "target" in loaded.rollout["extras"]


def test_the_tool_loop_without_vllm_runs_no_log_prob_forward_of_its_own(tmp_path, policy_and_tok, monkeypatch):
    # without vLLM the sampler's log-probs are never read (the trainer's own forward gives the old ones), so the
    # turns skip the policy forward that would compute them; a user's own call still gets them
    import trl_ppo_ext.sampling as sampling_module

    policy, tok = policy_and_tok
    trainer = PPOTrainer(model=policy, processing_class=tok, args=_config(tmp_path, total_episodes=2),
                         reward_funcs=[lambda completions, **kw: [0.0] * len(completions)],
                         train_dataset=_data(2), tools=[multiply])
    calls = []
    original = sampling_module.reference_response_logprobs
    counted = lambda *a, **k: calls.append(1) or original(*a, **k)  # noqa: E731
    monkeypatch.setattr(sampling_module, "reference_response_logprobs", counted)
    sample = trainer.generate_rollout(next(iter(trainer.dataloader)))
    assert calls == [] and sample.engine_logprobs is None
    ids, lps = trainer.generate_continuations([[5, 6]], 2)
    assert calls == [1] and len(lps[0]) == len(ids[0]) and all(lp == lp for lp in lps[0])  # finite, not NaN


class StuckDoor:
    """Its tool opens the door, then hangs past tool_timeout: the model is told the call timed out."""

    def reset(self, **row):
        self.opened = False

    def open_door(self) -> str:
        """Open the door."""
        self.opened = True
        time.sleep(0.3)
        return "opened"

    def get_reward(self) -> float:
        return float(self.opened)


def test_a_timed_out_tool_cannot_decide_the_environment_reward(tmp_path, policy_and_tok):
    # issue 40 case 3: before, get_reward scored the state the timed-out call left (1.0 for every row); now the
    # rollout is unscorable for the environment reward, counted in tools/timed_out_frac
    policy, tok = policy_and_tok

    class DoorTurns(ScriptedTurns):
        first_turn = CALL.format(name="open_door", args="{}")

    trainer = DoorTurns(model=policy, processing_class=tok, args=_config(tmp_path, tool_timeout=0.05),
                        train_dataset=_data(), environment_factory=StuckDoor)
    sample = trainer.generate_rollout(next(iter(trainer.dataloader)))
    assert sample.extras["tool_timed_out"] == [True, True]
    assert all(env.opened for env in sample.extras["environments"])  # the call did change the state
    scores, values, applies = trainer.score_rewards(sample)
    assert not applies.any() and scores.tolist() == [0.0, 0.0] and values.isnan().all()
    assert trainer._tool_metrics()["tools/timed_out_frac"] == 1.0
    rollout = trainer.score_rollout(sample)
    assert (trainer.compute_advantages(rollout).advantages == 0).all()  # no reward applies: nothing to train on


def _zero(completions, **kwargs):
    return [0.0] * len(completions)


def test_a_resumed_preempted_update_logs_its_tool_figures(tmp_path, policy_and_tok):
    # issue 40 case 6: the update a preemption stopped in was logged with tools/* 0 after the resume
    from trl_ppo_ext.agents import ToolLoopStats
    from trl_ppo_ext.run.preemption import InflightUpdate, UpdatePreempted

    policy, tok = policy_and_tok
    stopped = ScriptedTurns(model=policy, processing_class=tok, args=_config(tmp_path, num_mini_batches=2),
                            train_dataset=_data(), tools=[multiply], reward_funcs=[_zero])
    stopped.loop_state.sigterm.stop_agreed = lambda accelerator: True
    stopped.loop_state.batches = stopped._repeat_dataloader()
    rollout = stopped.collect_rollout(1)  # as run_update collects it: the tool counts start from 0
    expected = stopped._tool_metrics()
    assert expected["tools/call_frequency"] == 1.0 and expected["rollout/turns_max"] == 2.0
    with pytest.raises(UpdatePreempted) as stop:
        stopped.ppo_update(rollout, stopped.compute_advantages(rollout), 1)
    path = tmp_path / "inflight.pt"
    stop.value.inflight.save(str(path))

    resumed = stopped  # as a fresh trainer loading the checkpoint: no tool loop has run in it
    resumed.sampler.tool_stats = ToolLoopStats()
    resumed.loop_state.resume_inflight = InflightUpdate.load(str(path), torch.device("cpu"))
    again, _ = resumed._resumed_rollout()
    assert resumed._tool_metrics() == expected
    assert again.extras.keys() == rollout.extras.keys()  # the counts travel beside the columns, not in them


# ---------------------------------------------------------------- the environment owns the data (issue 44 item 3)
# Written from TRL 1.16's GRPOTrainer docs: "`train_dataset` may be omitted only when an `environment_factory` is
# provided and the environment owns (or procedurally generates) the data, returning the prompt from its `reset()`
# method. In that case, `max_steps` must be set"; reset(**row) gets the row's columns and its string is appended
# to the last user message.
class Riddle:
    """Owns its task: reset() poses it (and records what it was given); the tool answers it."""

    def reset(self, **row):
        self.row, self.solved = row, False
        return "Open the vault."

    def try_code(self, code: int) -> str:
        """
        Try a code on the vault.

        Args:
            code: The code to try.
        """
        self.solved = code == 41
        return "open" if self.solved else "locked"

    def get_reward(self) -> float:
        return float(self.solved)


class RiddleTurns(ScriptedTurns):
    first_turn = CALL.format(name="try_code", args='{"code": 41}')


def _train_riddles(tmp_path, policy_and_tok, train_dataset, **overrides):
    policy, tok = policy_and_tok
    seen = {}

    def reads_prompts(prompts, completions, environments, **kwargs):
        seen.setdefault("prompts", prompts)
        seen.setdefault("rows", [env.row for env in environments])
        return [0.0] * len(completions)

    trainer = RiddleTurns(model=policy, processing_class=tok, reward_funcs=[reads_prompts],
                          args=_config(tmp_path, **overrides), train_dataset=train_dataset,
                          environment_factory=Riddle)
    trainer.train()
    return trainer, seen


def test_without_a_dataset_the_environment_gives_the_prompts(tmp_path, policy_and_tok):
    trainer, seen = _train_riddles(tmp_path, policy_and_tok, None, max_steps=2)
    logs = _logs(trainer)
    assert len(logs) == 2 and all(log["rewards/Riddle/mean"] == 1.0 for log in logs)
    # GRPO's stand-in: one empty user message per prompt, reset's text appended to it
    assert seen["prompts"][0] == [{"role": "user", "content": "Open the vault."}]
    assert seen["rows"][0] == {"prompt": [{"role": "user", "content": ""}]}


def test_grpos_own_stand_in_dataset_is_accepted(tmp_path, policy_and_tok):
    from datasets import Dataset

    stand_in = Dataset.from_dict({"prompt": [[{"role": "user", "content": ""}]] * 4})  # was: "dropped 4 of 4"
    trainer, seen = _train_riddles(tmp_path, policy_and_tok, stand_in)
    assert len(_logs(trainer)) == 2 and seen["prompts"][0][-1]["content"] == "Open the vault."


def test_rows_without_a_prompt_column_only_feed_reset(tmp_path, policy_and_tok):
    from datasets import Dataset

    levels = Dataset.from_dict({"level": [1, 2, 3, 4]})  # was: "neither an `input_ids` column nor a prompt column"
    trainer, seen = _train_riddles(tmp_path, policy_and_tok, levels)
    assert len(_logs(trainer)) == 2
    assert all(set(row) == {"level"} and row["level"] in (1, 2, 3, 4) for row in seen["rows"])  # no `prompt` added
    assert seen["prompts"][0] == [{"role": "user", "content": "Open the vault."}]


@pytest.mark.parametrize("factory, overrides, match", [
    (None, {"max_steps": 2}, "unless an `environment_factory`"),
    ({"a": Riddle, "b": Riddle}, {"max_steps": 2}, "`environment` column"),
    (Riddle, {}, r"max_steps=-1"),
], ids=["no_environment", "dict_of_environments", "no_max_steps"])
def test_no_dataset_is_refused_before_any_model_is_loaded(tmp_path, factory, overrides, match):
    # the model is a folder that does not exist: the data is checked before anything is loaded from it
    with pytest.raises(ValueError, match=match):
        PPOTrainer(model=str(tmp_path / "not-a-model"), args=_config(tmp_path, **overrides), train_dataset=None,
                   environment_factory=factory, reward_funcs=[_zero])
