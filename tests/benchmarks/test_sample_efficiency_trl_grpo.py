"""The sample-efficiency benchmark's ``trl_grpo`` arm (TRL's own GRPOTrainer) without training,
but for one short end-to-end run: its text prompts give back exactly the prompt ids the other
arms train on, the GRPOConfig it builds per task (arithmetic by hand), its LoRA, its reward
functions in TRL GRPO's calling convention, and the rows it builds from what they measured."""

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch


def task_prompts(task_name: str):
    """(tokenizer, the prompt dataset the "ours" arms of ``task_name`` train on, seed 0), built as
    ``run_one`` builds it."""
    if task_name == "verifiable":
        from ppo_verifiable import TaskArguments, ppo_prompts
        from verifiable_task import build_task, split_pairs

        args = TaskArguments()
        task = build_task(args.operation, args.num_values)
        split = split_pairs(task, num_sft=args.num_sft_pairs, num_held_out=args.num_held_out_pairs,
                            seed=args.split_seed)
        return task.tokenizer, ppo_prompts(task, split.ppo[: args.max_ppo_pairs])
    from ppo_lora import ScriptArguments, _render_demo_prompts
    from synthetic_task import build_task

    task = build_task(0)
    length = {"synthetic": 10, "long": 32}[task_name]
    return task.tokenizer, _render_demo_prompts(task, ScriptArguments().num_train_prompts, held_out=False, seed=3,
                                                response_length=length, max_length=256)


@pytest.mark.parametrize("task_name", ["synthetic", "verifiable", "long"])
def test_text_prompts_give_back_the_prompt_ids_through_trl_grpo_tokenization(needs_trl_grpo, se, task_name):
    """TRL GRPO tokenizes a text prompt in ``_tokenize_prompts``; called here on the arm's dataset
    it gives back every prompt's ids exactly, as the other arms have them."""
    from trl import GRPOTrainer

    tok, prompts = task_prompts(task_name)
    keep = ("answer",) if task_name == "verifiable" else ()
    dataset = se.grpo_prompts(prompts, tok, keep=keep)
    assert dataset.column_names == ["prompt", *keep] and len(dataset) == len(prompts) > 0
    assert all(isinstance(p, str) for p in dataset["prompt"])
    fake_trainer = SimpleNamespace(processing_class=tok)
    ids, _, _ = GRPOTrainer._tokenize_prompts(fake_trainer, list(dataset["prompt"]))
    assert [list(x) for x in ids] == [list(x) for x in prompts["input_ids"]]
    if keep:
        assert list(dataset["answer"]) == list(prompts["answer"])


def test_prompt_texts_refuses_a_prompt_that_does_not_round_trip(se):
    class AddsBos:  # a tokenizer that puts a BOS (id 0) before every text
        def decode(self, ids):
            return " ".join(map(str, ids))

        def __call__(self, text):
            return {"input_ids": [[0] + [int(w) for w in t.split()] for t in text]}

    with pytest.raises(ValueError, match=r"tokenizes to \[0, 4, 5\], not the prompt's \[4, 5\]"):
        se.prompt_texts(AddsBos(), [[4, 5]])


def test_grpo_config_synthetic_by_hand(se, tmp_path):
    config, ppo = se.grpo_config("synthetic", 1024, output_dir=str(tmp_path), seed=0)
    # ours: rollout batch 8 x 4 = 32, 2 mini-batches of 16, 4 epochs -> 8 optimizer steps per rollout
    assert (ppo.per_device_train_batch_size, ppo.gradient_accumulation_steps, ppo.num_mini_batches,
            ppo.num_ppo_epochs) == (8, 4, 2, 4)
    # GRPO: generation batch 16 x 2 = 32 (8 prompts x 4), reused 4 times -> 2 x 4 = 8 steps per rollout;
    # 1024 / 32 = 32 rollouts -> 256 optimizer steps
    assert (config.per_device_train_batch_size, config.gradient_accumulation_steps, config.steps_per_generation,
            config.generation_batch_size, config.num_generations, config.num_iterations,
            config.max_steps) == (16, 1, 2, 32, 4, 4, 256)
    assert (config.learning_rate, config.temperature, config.max_completion_length) == (5e-3, 0.7, 10)
    assert (config.beta, config.loss_type, config.scale_rewards, config.epsilon) == (0.0, "dapo", "group", 0.2)
    assert (config.reward_weights, config.logging_steps, config.seed) == (None, 1, 0)
    # an episode budget that is not a whole number of rollouts: ceil(100 / 32) = 4 rollouts, as ours
    assert se.grpo_config("synthetic", 100, output_dir=str(tmp_path), seed=0)[0].max_steps == 4 * 8


def test_grpo_config_verifiable_and_long_by_hand(se, tmp_path):
    config, ppo = se.grpo_config("verifiable", 4096, output_dir=str(tmp_path), seed=1)
    # ours: 16 x 4 = 64 per rollout, 2 mini-batches of 32, 4 epochs (PPOConfig's default)
    assert (ppo.per_device_train_batch_size * ppo.gradient_accumulation_steps, ppo.num_mini_batches,
            ppo.num_ppo_epochs) == (64, 2, 4)
    # GRPO: 32 x 2 = 64 (16 prompts x 4), 4 iterations; 4096 / 64 = 64 rollouts x 8 steps = 512
    assert (config.per_device_train_batch_size, config.steps_per_generation, config.generation_batch_size,
            config.num_iterations, config.max_steps) == (32, 2, 64, 4, 512)
    assert (config.temperature, config.max_completion_length, config.reward_weights) == (1.0, 4, [1.0, 0.2, 0.2])
    long, _ = se.grpo_config("long", 2048, output_dir=str(tmp_path), seed=0)
    # the synthetic shape with 32-token completions: 2048 / 32 = 64 rollouts x 8 = 512 steps
    assert (long.per_device_train_batch_size, long.max_steps, long.max_completion_length,
            long.temperature) == (16, 512, 32, 0.7)
    # the arm's overrides are GRPOConfig fields, applied last
    assert se.grpo_config("long", 2048, output_dir=str(tmp_path), seed=0, overrides={"beta": 0.04})[0].beta == 0.04


def test_grpo_settings_refuses_a_batch_it_cannot_split(se):
    ppo = SimpleNamespace(per_device_train_batch_size=6, gradient_accumulation_steps=1, num_mini_batches=2,
                          num_ppo_epochs=1, learning_rate=1e-3, temperature=1.0, response_length=4)
    with pytest.raises(ValueError, match="num_generations=4"):  # 6 completions are not groups of 4
        se.grpo_settings(ppo, 12)


def test_grpo_lora_trains_the_head_whole_and_keeps_the_rest(se):
    from peft import LoraConfig

    lora = LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules=["q_proj", "v_proj", "lm_head"],
                      task_type="CAUSAL_LM")
    grpo = se.grpo_lora(lora)
    assert (set(grpo.target_modules), grpo.modules_to_save, grpo.r, grpo.lora_alpha) == (
        {"q_proj", "v_proj"}, ["lm_head"], 8, 16)
    assert set(lora.target_modules) == {"q_proj", "v_proj", "lm_head"}  # the task's config is left as it was
    no_head = LoraConfig(r=2, target_modules=["q_proj"], task_type="CAUSAL_LM")
    assert se.grpo_lora(no_head) is no_head


def test_reward_model_function_scores_each_sequence_at_its_last_token(se):
    """Batched and right-padded, as the arm scores: the same as the reward model's own pooled score
    of each prompt + completion alone (no padding at all)."""
    from trl_ppo_ext.tiny import build_tiny_scorer, build_tiny_tokenizer

    tok = build_tiny_tokenizer()
    model = build_tiny_scorer(tok, seed=3, hidden_size=16).eval()
    prompts = ["<user> w0 w1 <eos> <assistant>", "<user> w5 <eos> <assistant>"]
    completions = [[10, 11, 3], [12, 13, 14, 15, 16]]  # one stopped at <eos> (3), one cut off
    scores = se.reward_model_function(model, tok)(prompts=prompts, completions=["", ""], completion_ids=completions)
    with torch.no_grad():
        alone = [model(input_ids=torch.tensor([tok(text=p)["input_ids"] + c])).logits[0, 0].item()
                 for p, c in zip(prompts, completions)]
    assert scores == pytest.approx(alone, abs=1e-5)


def test_measuring_keeps_the_reward_and_its_name(se):
    from trl.trainer.utils import get_callable_name
    from verifiable_task import exact_answer

    seen = []
    measured = se.measuring(exact_answer, lambda kwargs, rewards: [2 * r for r in rewards], seen.append)
    assert measured(prompts=["p", "p"], completions=["3", "4"], completion_ids=[[9], [10]], answer=["3", "3"],
                    trainer_state=None) == [1.0, 0.0]
    assert seen == [[2.0, 0.0]]
    assert get_callable_name(measured) == "exact_answer"  # TRL's metric names stay rewards/exact_answer/...


def test_verifiable_reward_functions_take_trl_grpo_calling_convention(se, tmp_path):
    """``_calculate_rewards`` calls each function with prompts, completions (text for text prompts),
    completion_ids, the dataset's other columns and trainer_state / log_extra / log_metric."""
    from ppo_verifiable import TaskArguments, reward_functions
    from verifiable_task import build_task

    task = build_task("max", 20)
    _, ppo = se.grpo_config("verifiable", 64, output_dir=str(tmp_path), seed=0)
    ids = task.tokenizer.convert_tokens_to_ids
    completion_ids = [ids(["17", "<eos>"]), ids(["3", "<eos>"]), ids(["17", "17", "17", "17"])]
    kwargs = dict(prompts=["<user> max 3 17 <eos> <assistant>"] * 3, completions=["17", "3", "17 17 17 17"],
                  completion_ids=completion_ids, answer=["17"] * 3, trainer_state=None,
                  log_extra=lambda *a: None, log_metric=lambda *a: None)
    values = [f(**kwargs) for f in reward_functions(task, ppo, TaskArguments())]
    # exact: 1, 0, 0; format (one number then <eos>): 1, 1, 0; overlong (4 tokens, cache 2 of 4): 0, 0, -1
    assert values == [[1.0, 0.0, 0.0], [1.0, 1.0, 0.0], [0.0, 0.0, -1.0]]


def test_recorder_rows_by_hand(se):
    """Two optimizer steps per rollout; rollout 1 measured [0, 1] (2 completions), rollout 2 [1, 1, 1]."""
    rec = se.GRPORecorder(steps_per_rollout=2)
    rec.measure([0.0, 1.0])
    # GRPO logs its "reward" on the step that generated the batch, "entropy" on every step
    assert rec.log(1, {"reward": 0.5, "reward_std": 0.7, "frac_reward_zero_std": 0.0, "entropy": 3.0}) == []
    (row1,) = rec.log(2, {"entropy": 2.0, "loss": 0.1})
    assert row1 == {"update": 1, "episode": 2, "reward": 0.5, "scored": 2, "score": 0.5, "kl": None,
                    "entropy": 2.5, "explained_variance": None, "reward_std": 0.7, "frac_reward_zero_std": 0.0}
    rec.measure([1.0, 1.0, 1.0])
    assert rec.log(3, {"reward": 1.0, "entropy": 1.0, "kl": 0.25}) == []
    (row2,) = rec.log(4, {"entropy": 0.5, "kl": 0.75})
    # episodes count the completions measured so far: 2 + 3; kl appears only where logged (beta != 0)
    assert (row2["update"], row2["episode"], row2["reward"], row2["scored"], row2["entropy"], row2["kl"]) == (
        2, 5, 1.0, 3, 0.75, 0.5)
    # the Trainer's closing summary is no step's log and completes nothing
    assert rec.log(4, {"train_runtime": 1.0, "train_loss": 0.0}) == [] and len(rec.logs) == 4
    assert rec.rows == [row1, row2]


def test_trl_grpo_arm_is_refused_where_it_cannot_run(se):
    assert se.ARMS["trl_grpo"].trainer == "trl_grpo" and "trl_grpo" in se.TRAINERS
    cases = ((se.Arm(trainer="trl_grpo"), "multiturn", "generate_continuations"),
             (se.Arm(trainer="trl_grpo", reward="process"), "synthetic", "reward variant"),
             (se.Arm(trainer="trl_grpo", critic="separate"), "synthetic", "critic="),
             (se.Arm(trainer="trl_grpo", gae="step_through"), "synthetic", "gae="),
             (se.Arm(trainer="elsewhere"), "synthetic", "trainer="))
    for arm, task_name, message in cases:
        with pytest.raises(ValueError, match=message):
            se.run_one(task_name, arm, 0, model_dir=Path("unused"), episodes=64, hidden_size=8, out=Path("unused"))


def test_ms_per_episode_and_the_memory_column(se, tmp_path, capsys):
    """Two seeds of 4 updates of 32 (128 episodes) in 2 s and 4 s: 15.6 and 31.2 ms per episode,
    median 23.4. A memory.json for one arm adds the column; the other arm shows n/a there."""
    for arm, times in (("defaults", (2.0, 4.0)), ("trl_grpo", (1.0, 1.0))):
        for seed, train_s in enumerate(times):
            path = tmp_path / "synthetic" / arm / f"{seed}.jsonl"
            path.parent.mkdir(parents=True, exist_ok=True)
            rows = [{"update": i + 1, "episode": 32 * (i + 1), "reward": 0.5, "scored": 32} for i in range(4)]
            path.write_text("".join(json.dumps(r) + "\n" for r in rows + [{"done": True, "train_s": train_s,
                                                                              "updates": 4}]))
    argv = ["--report-only", "--out", str(tmp_path), "--seeds", "2", "--arms", "defaults", "trl_grpo",
            "--episodes", "128", "--window", "1"]
    assert se.main(argv) == 0
    head, _, ours, grpo = (tmp_path / "synthetic" / "table.md").read_text().splitlines()[2:6]
    assert head.endswith("| train s / run | ms / episode (median) |")
    assert ours.endswith("| 3 | 23.4 |") and grpo.endswith("| 1 | 7.81 |")  # 1000 / 128 = 7.8125
    (tmp_path / "synthetic" / "trl_grpo" / "memory.json").write_text(json.dumps({"peak_live_tensors_mib": 12.345}))
    assert se.main(argv) == 0
    text = (tmp_path / "synthetic" / "table.md").read_text()
    head, _, ours, grpo = text.splitlines()[2:6]
    assert head.endswith("| ms / episode (median) | peak live tensors (MiB) |")
    assert ours.endswith("| 23.4 | n/a |") and grpo.endswith("| 7.81 | 12.3 |")
    assert "peak live tensors: one run per arm, seed 0, 2 updates" in text.splitlines()[0]
    capsys.readouterr()


@pytest.mark.slow
def test_trl_grpo_and_defaults_runs_line_up_on_the_synthetic_task(needs_trl_grpo, se, tmp_path):
    """Both arms end to end, 64 episodes (2 rollouts of 32), a random reward model standing in for
    the trained one: the same episodes per row, the GRPO rows complete; then its memory run's peak."""
    from synthetic_task import build_task

    from trl_ppo_ext.tiny import build_tiny_scorer

    model_dir = tmp_path / "_models" / "seed0"
    build_tiny_scorer(build_task(0).tokenizer, seed=5, hidden_size=32).save_pretrained(model_dir / "reward_model")
    rows = {}
    for name in ("trl_grpo", "defaults"):
        out = tmp_path / name / "0.jsonl"
        out.parent.mkdir()
        assert se.run_one("synthetic", se.ARMS[name], 0, model_dir=model_dir, episodes=64, hidden_size=32,
                          out=out) == 2
        *rows[name], done = [json.loads(line) for line in out.with_suffix(".partial").read_text().splitlines()]
        assert done["done"] and done["updates"] == 2 and done["train_s"] > 0
    assert [r["episode"] for r in rows["trl_grpo"]] == [r["episode"] for r in rows["defaults"]] == [32, 64]
    for row in rows["trl_grpo"]:
        assert row["scored"] == 32 and row["kl"] is None and 0.0 <= row["reward"] <= 1.5
        assert row["entropy"] > 0 and row["score"] is not None and row["frac_reward_zero_std"] is not None
    # the memory run: the same run inside the live-tensor tracker, its peak above what was alive at the start
    memory = tmp_path / "trl_grpo" / "memory.json"
    se.run_one("synthetic", se.ARMS["trl_grpo"], 0, model_dir=model_dir, episodes=64, hidden_size=32,
               out=tmp_path / "trl_grpo" / "memory.jsonl", memory=memory)
    peak = json.loads(memory.read_text())
    assert peak["peak_live_tensors_mib"] > peak["start_live_tensors_mib"] > 0
    assert se.read_memory(memory) == peak["peak_live_tensors_mib"]


def test_the_trl_grpo_arm_names_the_trl_it_needs(se, monkeypatch):
    import importlib.metadata

    monkeypatch.setattr(importlib.metadata, "version", lambda name: "1.12.0")
    assert se.trl_grpo_ok() == "the trl_grpo arm needs TRL >= 1.16, this python has 1.12.0"
