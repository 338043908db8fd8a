"""benchmarks/sample_efficiency/ without training: its table, plot and log reading on fake
logs written here, its arm parsing, and the rule reward TRL's trainer gets on the verifiable
task checked against the example's own reward functions."""

import json
import math
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]



def write_run(path: Path, rewards, *, kl=0.1, entropy=1.0, batch=32, end=None):
    """A run file as a worker writes it: one row per update, then the ``done`` row."""
    path.parent.mkdir(parents=True, exist_ok=True)
    rows = [{"update": i + 1, "episode": batch * (i + 1), "reward": r, "scored": batch, "score": r,
             "kl": kl, "entropy": entropy, "explained_variance": None} for i, r in enumerate(rewards)]
    end = end if end is not None else {"done": True, "train_s": 2.0, "updates": len(rewards)}
    path.write_text("".join(json.dumps(r) + "\n" for r in rows + [end]))


def test_trailing_mean_by_hand(se):
    # window 3 over [0, 3, 6, 9]: [0], [0,3], [0,3,6], [3,6,9] -> 0, 1.5, 3, 6
    assert se.trailing_mean([0.0, 3.0, 6.0, 9.0], 3) == [0.0, 1.5, 3.0, 6.0]
    assert se.trailing_mean([2.0, 4.0], 1) == [2.0, 4.0]


def test_value_at_and_episodes_to_reach(se, tmp_path):
    write_run(tmp_path / "r.jsonl", [0.0, 0.2, 0.4, 0.6, 0.8, 1.0, 1.0, 1.0])  # episodes 32 .. 256
    run = se.read_run(tmp_path / "r.jsonl", 0)
    # half = 128 episodes = updates 1..4; window 2 -> mean(0.4, 0.6) = 0.5
    assert se.value_at(run, "reward", 128, 2) == pytest.approx(0.5, abs=1e-12)
    # end: mean(1.0, 1.0) over updates 7, 8
    assert se.value_at(run, "reward", 256, 2) == pytest.approx(1.0, abs=1e-12)
    # trailing means (window 2): 0, .1, .3, .5, .7, .9, 1, 1 -> first >= 0.7 at update 5 = episode 160
    assert se.episodes_to_reach(run, 0.7, 2) == 160
    assert se.episodes_to_reach(run, 1.01, 2) is None
    assert se.value_at(run, "reward", 16, 2) is None  # no update had ended by episode 16


def test_read_run_incomplete_crashed_non_finite_short(se, tmp_path):
    assert se.read_run(tmp_path / "missing.jsonl", 0) is None
    write_run(tmp_path / "partial.jsonl", [0.1, 0.2], end={"update": 3})  # no done row: still running
    assert se.read_run(tmp_path / "partial.jsonl", 0) is None
    write_run(tmp_path / "crash.jsonl", [0.1], end={"done": True, "crashed": True, "reason": "exit 1: boom"})
    assert se.read_run(tmp_path / "crash.jsonl", 0).crashed == "exit 1: boom"
    write_run(tmp_path / "nan.jsonl", [0.1, float("nan"), 0.3])
    assert se.read_run(tmp_path / "nan.jsonl", 0).crashed == "non-finite reward at update 2"
    write_run(tmp_path / "short.jsonl", [0.1, 0.2], end={"done": True, "train_s": 1.0, "updates": 4})
    assert se.read_run(tmp_path / "short.jsonl", 0).crashed == "stopped after 2 of 4 updates"
    write_run(tmp_path / "ok.jsonl", [0.1, 0.2])
    ok = se.read_run(tmp_path / "ok.jsonl", 3)
    assert (ok.crashed, ok.seed, ok.train_s, len(ok.rows)) == (None, 3, 2.0, 2)


def _fake_arms(se, tmp_path):
    """Arm "a": seeds 0, 1 learn (final 0.8 and 0.6), seed 2 crashed; arm "b": two seeds, final 0.2 and 0.4."""
    write_run(tmp_path / "a0.jsonl", [0.0, 0.4, 0.8, 0.8], kl=0.5, entropy=2.0)
    write_run(tmp_path / "a1.jsonl", [0.0, 0.2, 0.6, 0.6], kl=0.3, entropy=1.0)
    write_run(tmp_path / "a2.jsonl", [0.0], end={"done": True, "crashed": True, "reason": "timed out"})
    write_run(tmp_path / "b0.jsonl", [0.0, 0.1, 0.2, 0.2])
    write_run(tmp_path / "b1.jsonl", [0.0, 0.3, 0.4, 0.4])
    return {"a": [se.read_run(tmp_path / f"a{s}.jsonl", s) for s in range(3)],
            "b": [se.read_run(tmp_path / f"b{s}.jsonl", s) for s in range(2)]}


def test_table_on_fake_logs(se, tmp_path):
    runs = _fake_arms(se, tmp_path)
    assert se.final_reward(runs["a"], 128, 1) == pytest.approx(0.7, abs=1e-12)  # (0.8 + 0.6) / 2, crash left out
    text = se.table(runs, episodes=128, threshold=0.5, window=1, expected_seeds=3)
    head, rule, a, b = text.splitlines()
    cells = {name: [c.strip() for c in line.strip("|").split("|")] for name, line in (("a", a), ("b", b))}
    assert head.count("|") == rule.count("|") == 12
    # a: 2 of 3 ran, 1 crashed; half = episode 64 = update 2: 0.4, 0.2 -> mean 0.3, sd sqrt(0.02) = 0.1414
    # final 0.8, 0.6 -> 0.7 +- 0.1414; threshold 0.5 first reached at update 3 (96) by both -> median 96 (2/2)
    # KL mean (0.5 + 0.3) / 2 = 0.4, entropy (2 + 1) / 2 = 1.5, no explained variance, 2 s per run (crash has none),
    # 2 s over 128 episodes = 15.625 ms per episode
    assert cells["a"] == ["a", "2/3", "1", "0.300 ± 0.141", "0.700 ± 0.141", "96 (2/2)", "0.4", "1.5", "n/a", "2",
                          "15.6"]
    # b never reaches 0.5: median over [inf, inf] -> "> budget"
    assert cells["b"][:6] == ["b", "2/3", "0", "0.200 ± 0.141", "0.300 ± 0.141", "> budget (0/2)"]
    assert se.table(runs, episodes=128, threshold=None, window=1, expected_seeds=3).splitlines()[2].split("|")[6] \
        .strip() == "n/a"


def test_median_episodes_counts_unreached_runs_as_beyond_the_budget(se, tmp_path):
    # three seeds: reach 0.5 at episode 64, at 96, never -> sorted [64, 96, inf], median 96
    write_run(tmp_path / "0.jsonl", [0.0, 0.5, 0.5])
    write_run(tmp_path / "1.jsonl", [0.0, 0.0, 0.5])
    write_run(tmp_path / "2.jsonl", [0.0, 0.0, 0.0])
    runs = {"x": [se.read_run(tmp_path / f"{s}.jsonl", s) for s in range(3)]}
    row = se.table(runs, episodes=96, threshold=0.5, window=1, expected_seeds=3).splitlines()[2]
    assert "| 96 (2/3) |" in row


def test_curves_mean_and_sd_over_seeds(se, tmp_path):
    runs = _fake_arms(se, tmp_path)["a"]
    episodes, mean, sd = se.curves(runs, "reward", 1)
    assert episodes == [32, 64, 96, 128]
    # seeds 0, 1 (the crash is left out): (0,0) (0.4,0.2) (0.8,0.6) (0.8,0.6)
    assert mean == pytest.approx([0.0, 0.3, 0.7, 0.7], abs=1e-12)
    assert sd == pytest.approx([0.0, math.sqrt(0.02)] + [math.sqrt(0.02)] * 2, abs=1e-12)


def test_plot_writes_a_png(se, tmp_path):
    out = tmp_path / "plot.png"
    se.plot(_fake_arms(se, tmp_path), out, title="fake", reward_name="reward", threshold=0.5, episodes=128, window=2)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_report_only_main_writes_table_and_plot(se, tmp_path, capsys):
    for arm, finals in (("fast", (0.9, 0.7)), ("slow", (0.3, 0.5))):
        for seed, final in enumerate(finals):
            write_run(tmp_path / "synthetic" / arm / f"{seed}.jsonl", [0.0] * 16 + [final] * 16)
    argv = ["--report-only", "--out", str(tmp_path), "--seeds", "2", "--arms", "defaults", "--threshold", "0.6",
            "--window", "1", "--arm", "fast:learning_rate=0.001", "--arm", "slow:learning_rate=0.0001"]
    assert se.main(argv) == 0
    table = (tmp_path / "synthetic" / "table.md").read_text()
    assert "threshold 0.600 (--threshold)" in table
    # 32 updates of 32 = the 1024 default episodes; half (update 16) is still 0; final = 0.8 +- sqrt(0.02);
    # both seeds of "fast" pass 0.6 at update 17 = episode 544, neither of "slow" (0.3, 0.5) does
    assert "| fast | 2/2 | 0 | 0.000 ± 0.000 | 0.800 ± 0.141 | 544 (2/2) |" in table
    assert "| slow | 2/2 | 0 | 0.000 ± 0.000 | 0.400 ± 0.141 | > budget (0/2) |" in table
    assert "| defaults | 0/2 | 0 |" in table  # no logs for it: 0 of 2 ran, none crashed
    assert (tmp_path / "synthetic.png").read_bytes()[:4] == b"\x89PNG"
    assert "table:" in capsys.readouterr().out


def test_parse_arm_and_missing_fields(se):
    name, arm = se.parse_arm("clip:cliprange_high=0.28,loss_type=dr_grpo,reward=summed,whiten_rewards=true")
    assert name == "clip"
    assert arm.overrides == {"cliprange_high": 0.28, "loss_type": "dr_grpo", "whiten_rewards": True}
    assert (arm.reward, arm.trainer) == ("summed", "ours")
    assert se.missing_fields(arm, {"cliprange_high", "whiten_rewards"}) == ["loss_type"]
    for bad in ("noseparator", "x:cliprange_high"):
        with pytest.raises(ValueError, match="--arm"):
            se.parse_arm(bad)


def test_recipe_arm_is_the_union_of_its_elements(se):
    union = {}
    for name in se.RECIPE:
        union.update(se.ARMS[name].overrides)
    assert se.ARMS["recipe"].overrides == union
    assert se.ARMS["trl112"].trainer == "trl112" and se.ARMS["defaults"].overrides == {}


def test_short_alpha_arms_give_the_lambdas_their_comment_says(se):
    from trl_ppo_ext.functional import length_adaptive_lam

    assert se.ARMS["length_lam_short"].overrides == {"lam_length_alpha": se.SHORT_ALPHA}
    assert se.ARMS["recipe_short"].overrides == {**se.ARMS["recipe"].overrides, "lam_length_alpha": se.SHORT_ALPHA}
    # alpha 2: 1 - 1/(2*2) = 0.75, 1 - 1/(2*5) = 0.9, 1 - 1/(2*10) = 0.95; VAPO's 0.05 gives 0 below 20 tokens
    mask = torch.tensor([[True] * 2 + [False] * 8, [True] * 5 + [False] * 5, [True] * 10])
    lam = length_adaptive_lam(mask, se.SHORT_ALPHA, torch.float64)
    torch.testing.assert_close(lam, torch.tensor([0.75, 0.9, 0.95], dtype=torch.float64), rtol=0, atol=1e-12)
    assert length_adaptive_lam(mask, se.RECIPE["length_lam"]["lam_length_alpha"]).tolist() == [0.0, 0.0, 0.0]


def test_response_after_marker(se):
    # <user> a b <eos> <assistant> x y <eos> <pad> <pad>, marker 5, pad 0
    assert se.response_after_marker([4, 11, 12, 3, 5, 21, 22, 3, 0, 0], marker_id=5, pad_id=0) == [21, 22, 3]
    # the first marker ends the prompt; a generated marker or pad inside the response stays in it
    assert se.response_after_marker([0, 5, 7, 5, 0, 8, 0], marker_id=5, pad_id=0) == [7, 5, 0, 8]


def test_verifiable_rule_matches_the_example_reward_functions(se):
    """TRL's arm trains on ``verifiable_rule``; this package's on the example's functions. Same numbers."""
    if str(ROOT / "examples") not in sys.path:
        sys.path.insert(0, str(ROOT / "examples"))
    from trl.rewards import get_soft_overlong_punishment
    from verifiable_task import build_task, exact_answer, make_format_reward

    task = build_task("max", 20)
    tok = task.tokenizer
    rule = se.verifiable_rule(task, weights=(1.0, 0.2, 0.2), response_length=4, overlong_cache=2)
    ids = tok.convert_tokens_to_ids
    responses = [["17", "<eos>"], ["3", "<eos>"], ["17"], ["17", "17", "<eos>"], ["<eos>"], ["17", "3", "3", "3"],
                 ["max", "<eos>"], ["<user>", "<eos>"], ["<assistant>", "17", "<eos>"], ["17", "<user>", "max", "1"]]
    prompt = task.prompt_ids(3, 17)
    overlong = get_soft_overlong_punishment(4, 2)
    fmt = make_format_reward(task)
    for response in responses:
        rid = ids(response)
        padded = [tok.pad_token_id] * 2 + prompt + rid + [tok.pad_token_id] * (4 - len(rid))
        text = tok.decode(rid, skip_special_tokens=True)
        exact = exact_answer(completions=[text], answer=["17"])[0]
        expected = exact + 0.2 * fmt(completion_ids=[rid])[0] + 0.2 * overlong(completion_ids=[rid])[0]
        assert rule(padded) == pytest.approx((expected, exact), abs=1e-12), response
    # by hand: "17 <eos>" = 1 + 0.2 * 1 + 0; "17 3 3 3" (4 tokens, cut off) = 0 + 0 + 0.2 * -1
    assert rule([*prompt, *ids(["17", "<eos>"])])[0] == pytest.approx(1.2, abs=1e-12)
    assert rule([*prompt, *ids(["17", "3", "3", "3"])])[0] == pytest.approx(-0.2, abs=1e-12)


def test_rule_reward_model_reads_like_a_reward_model(se):
    """TRL's get_reward reads ``getattr(model, base_model_prefix)(...).hidden_states[-1]`` through
    ``model.score`` at the last valid token: every position carries the sequence's rule value."""
    model = se._rule_reward_model_class()(lambda ids: float(sum(ids)))
    ids = torch.tensor([[1, 2, 3], [4, 0, 0]])
    out = getattr(model, model.base_model_prefix)(input_ids=ids, attention_mask=ids != 0, position_ids=None,
                                                  return_dict=True, output_hidden_states=True, use_cache=False)
    logits = model.score(out.hidden_states[-1])
    assert logits.shape == (2, 3, 1)
    assert torch.equal(logits[..., 0], torch.tensor([[6.0, 6.0, 6.0], [4.0, 4.0, 4.0]]))


def test_long_task_reward_by_hand(se):
    sys.path.insert(0, str(ROOT / "examples"))
    from synthetic_task import build_task

    task = build_task(0)
    tok = task.tokenizer
    eos = tok.eos_token
    ids = lambda words: tok.convert_tokens_to_ids(words)  # noqa: E731
    # 3 nice of 4 words, no <eos>: 3 / 4 of the target 4, no bonus
    assert se.long_task_reward(task, ids(["kind", "rude", "calm", "wise"]), target_words=4) == 0.75
    # 5 nice words then <eos>: capped at 1, and the bonus (5 >= 4 words)
    assert se.long_task_reward(task, ids(["kind"] * 5 + [eos]), target_words=4) == 1.0 + task.stop_bonus
    # stopping before the target earns no bonus: 2 nice words of a target of 4
    assert se.long_task_reward(task, ids(["kind", "calm", eos]), target_words=4) == 0.5
    # what follows the <eos> does not count
    assert se.long_task_reward(task, ids([eos, "kind", "kind"]), target_words=1) == 0.0


def test_critic_arms_parse_and_bad_ones_are_refused(se):
    name, arm = se.parse_arm("sep:critic=separate,value_lam=1.0")
    assert (name, arm.critic, arm.overrides) == ("sep", "separate", {"value_lam": 1.0})
    assert se.ARMS["defaults"].critic == "shared"
    for bad in (se.Arm(critic="sideways"), se.Arm(critic="separate", trainer="trl112")):
        with pytest.raises(ValueError, match="critic="):
            se.run_one("long", bad, 0, model_dir=Path("unused"), episodes=1, hidden_size=8, out=Path("unused"))


# --- the multiturn task's step_through arm ---------------------------------------------------
def test_step_through_gae_by_hand(se):
    """Tokens a1 a2 | o1 o2 o3 | b1 b2 (o: environment), gamma 1, lambda 0.9, values .5 .6 .7 .8 on
    the actions, reward .1 on a2 and 1 on b2 (the package's GAE over the actions gives .5068 .452 .28 .2).
    Stepping through: V = r = 0 at o1..o3. Deltas r + V_next - V: b2 1 - .8 = .2; b1 .8 - .7 = .1;
    o3 .7 - 0 = .7; o2 0; o1 0; a2 .1 + 0 - .6 = -.5 (bootstraps against V(o1) = 0); a1 .6 - .5 = .1.
    A = delta + .9 A_next: b2 .2; b1 .1 + .18 = .28; o3 .7 + .252 = .952; o2 .8568; o1 .77112;
    a2 -.5 + .694008 = .194008; a1 .1 + .1746072 = .2746072."""
    action = torch.tensor([[True, True, False, False, False, True, True]])
    response = torch.ones(1, 7, dtype=torch.bool)
    values = torch.tensor([[0.5, 0.6, 9.0, -9.0, 9.0, 0.7, 0.8]], dtype=torch.float64)  # garbage at o1..o3
    rewards = torch.tensor([[0.0, 0.1, 0.0, 0.0, 0.0, 0.0, 1.0]], dtype=torch.float64)
    adv, ret = se.step_through_gae(rewards, values, response, action, 1.0, 0.9)
    expected = torch.tensor([[0.2746072, 0.194008, 0.0, 0.0, 0.0, 0.28, 0.2]], dtype=torch.float64)
    torch.testing.assert_close(adv, expected, rtol=0, atol=1e-12)
    torch.testing.assert_close(ret, torch.where(action, expected + values, 0.0), rtol=0, atol=1e-12)
    # value_lam 1: returns are the Monte-Carlo sums of the rewards ahead: .1 + 1 at a1 and a2, 1 at b1 and b2
    _, mc = se.step_through_gae(rewards, values, response, action, 1.0, 0.9, 1.0)
    torch.testing.assert_close(mc, torch.tensor([[1.1, 1.1, 0, 0, 0, 1.0, 1.0]], dtype=torch.float64),
                               rtol=0, atol=1e-12)


def test_step_through_is_the_package_gae_without_environment_tokens(se):
    from trl_ppo_ext.functional import masked_gae

    gen = torch.Generator().manual_seed(0)
    rewards, values = torch.randn(3, 6, generator=gen), torch.randn(3, 6, generator=gen)
    mask = torch.tensor([[True] * 6, [True] * 4 + [False] * 2, [True] + [False] * 5])
    adv, ret = se.step_through_gae(rewards, values, mask, mask, 0.99, 0.95)
    ref_adv, ref_ret = masked_gae(rewards, values, mask, 0.99, 0.95)
    torch.testing.assert_close(adv, ref_adv, rtol=0, atol=1e-6)
    torch.testing.assert_close(ret, ref_ret, rtol=0, atol=1e-6)


def test_step_through_arm_parses_and_is_refused_where_it_cannot_run(se):
    assert se.ARMS["step_through"].gae == "step_through" and se.ARMS["defaults"].gae == "actions"
    name, arm = se.parse_arm("st:gae=step_through,lam=0.9")
    assert (name, arm.gae, arm.overrides) == ("st", "step_through", {"lam": 0.9})
    assert se.TASKS["multiturn"].batch_size == 32
    for bad, message in ((se.Arm(gae="sideways"), "gae="), (se.Arm(trainer="trl112"), "rollout_func")):
        with pytest.raises(ValueError, match=message):
            se.run_one("multiturn", bad, 0, model_dir=Path("unused"), episodes=1, hidden_size=8, out=Path("unused"))


def test_shared_actor_critic_has_a_value_head_only_when_the_estimator_trains_a_critic(se, tmp_path):
    from peft import LoraConfig

    from trl_ppo_ext import PPOConfig
    from trl_ppo_ext.tiny import build_tiny_causal_lm, build_tiny_tokenizer

    tok = build_tiny_tokenizer()
    lora = LoraConfig(r=2, lora_alpha=4, lora_dropout=0.0, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    built = {}
    for estimator, generations in (("gae", 1), ("grpo", 4), ("reinforce_pp", 1)):
        config = PPOConfig(output_dir=str(tmp_path), advantage_estimator=estimator, num_generations=generations,
                           per_device_train_batch_size=4, report_to="none")
        model = se.shared_actor_critic("shared", build_tiny_causal_lm(tok, hidden_size=8), lora, config)
        built[estimator] = (model.has_value, any("value" in n for n, _ in model.named_parameters()))
    # without a config (TRL's own config, or a PPOConfig before the estimators): a value head, as before
    model = se.shared_actor_critic("shared", build_tiny_causal_lm(tok, hidden_size=8), lora)
    built["no config"] = (model.has_value, any("value" in n for n, _ in model.named_parameters()))
    assert built == {"gae": (True, True), "grpo": (False, False), "reinforce_pp": (False, False),
                     "no config": (True, True)}


def test_the_critic_of_each_arm_is_chosen_in_one_place(se):
    """trl112 and "separate" get the loaded value model itself, every weight trained; "lora" the same
    model with an adapter (only lora_* and score.* train); "shared" no value model, and the value
    model is then never loaded."""
    from peft import LoraConfig

    from trl_ppo_ext.models.actor_critic import SharedActorCritic
    from trl_ppo_ext.tiny import build_tiny_causal_lm, build_tiny_scorer, build_tiny_tokenizer

    tok = build_tiny_tokenizer()
    lora = LoraConfig(r=2, lora_alpha=4, lora_dropout=0.0, target_modules=["q_proj", "lm_head"], task_type="CAUSAL_LM")
    loads = []

    def value_model():
        loads.append(1)
        return build_tiny_scorer(tok, hidden_size=8)

    for arm in (se.ARMS["trl112"], se.Arm(critic="separate")):
        models = se.actor_and_critic(arm, "policy", lora, None, value_model)
        assert models["model"] == "policy" and models["peft_config"] is lora and models["ref_model"] is None
        assert all(p.requires_grad for p in models["value_model"].parameters())
        assert not any("lora_" in n for n, _ in models["value_model"].named_parameters())
    models = se.actor_and_critic(se.Arm(critic="lora"), "policy", lora, None, value_model)
    trained = [n for n, p in models["value_model"].named_parameters() if p.requires_grad]
    assert trained and all("lora_" in n or n.startswith("score.") for n in trained)
    assert any(n.startswith("score.") for n in trained) and any("lora_" in n for n in trained)
    assert len(loads) == 3
    models = se.actor_and_critic(se.ARMS["defaults"], build_tiny_causal_lm(tok, hidden_size=8), lora, None, value_model)
    assert isinstance(models["model"], SharedActorCritic) and models["value_model"] is None and len(loads) == 3


def test_an_arm_keeps_its_colour_in_every_panel_when_another_logs_no_kl(se, tmp_path, monkeypatch):
    """TRL's GRPO (beta 0) logs no KL: its curve is missing from the KL panel, and the arm after it must
    not take its colour there."""
    import matplotlib.figure

    write_run(tmp_path / "a.jsonl", [0.1, 0.2], kl=None)
    write_run(tmp_path / "b.jsonl", [0.3, 0.4], kl=0.5)
    runs = {"no_kl": [se.read_run(tmp_path / "a.jsonl", 0)], "with_kl": [se.read_run(tmp_path / "b.jsonl", 0)]}
    saved = []
    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", lambda fig, *a, **k: saved.append(fig))
    se.plot(runs, tmp_path / "p.png", title="t", reward_name="r", threshold=None, episodes=64, window=1)
    reward_ax, kl_ax, _ = saved[0].axes
    colour = {line.get_label(): line.get_color() for line in reward_ax.lines}["with_kl (1 seeds)"]
    assert [line.get_color() for line in kl_ax.lines] == [colour]
