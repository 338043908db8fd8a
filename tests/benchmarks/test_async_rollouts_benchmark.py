"""benchmarks/async_rollouts.py without vLLM: its command line (``--help``, the argument checks),
the reward, and the summary arithmetic on hand-made runs. (tests/test_async_rollouts.py tests the
module trl_ppo_ext/async_rollouts.py.)"""

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).parents[2] / "benchmarks" / "async_rollouts.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_async_rollouts", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_help_runs_without_vllm():
    out = subprocess.run([sys.executable, str(SCRIPT), "--help"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "--seeds" in out.stdout and "--arms" in out.stdout


def test_arguments(bench):
    args = bench.parse_args(["--seeds", "3,4", "--arms", "sync,s2_tis", "--cores", "1,0"])
    assert args.seeds == [3, 4] and args.arms == ["sync", "s2_tis"]
    assert (args.trainer_core, args.server_core) == (1, 0)
    assert args.max_loras == 3  # versions v-2 .. v loaded at once
    assert bench.parse_args(["--arms", "sync"]).max_loras == 1


@pytest.mark.parametrize("argv", [["--arms", "sync,s3_tis"], ["--arms", "s1_tis"], ["--updates", "1"],
                                  ["--response-length", "153"], ["--cores", "0"]])
def test_bad_arguments_are_refused(bench, argv):
    with pytest.raises(SystemExit):
        bench.parse_args(argv)


def test_target_share_is_a_per_token_share(bench):
    reward = bench.target_share_reward(targets=frozenset({7, 9}), response_length=4)
    # each target token earns 1/4 on its own position; a row sums to its share of the 4 positions
    assert reward([[7, 9, 1, 7], [2, 3, 4, 5], [9]]) == [[0.25, 0.25, 0.0, 0.25], [0.0] * 4, [0.25]]


def test_tokenizer_has_no_stop_id_and_the_targets_are_its_upper_half(bench):
    from trl_ppo_ext.generation.transformers_generate import stop_token_ids

    tok = bench.tokenizer()
    policy = bench.base_policy(tok)
    # no EOS on the tokenizer or the checkpoint: stop_token=None stops nowhere, responses run to the end
    assert stop_token_ids(None, None, tok, policy.generation_config) == ()
    assert len(tok) == 14  # 6 special tokens, 8 words
    assert bench.target_ids(tok) == frozenset(range(7, 14))
    assert tok.convert_ids_to_tokens(sorted(bench.target_ids(tok))) == [f"w{i}" for i in range(1, 8)]


def test_timed_generate_records_each_call_and_restores_the_class(bench, monkeypatch):
    class Engine:
        def generate(self, prompts):
            return len(prompts)

    original = Engine.generate
    ticks = iter([10.0, 10.5, 20.0, 22.0])
    monkeypatch.setattr(bench.time, "perf_counter", lambda: next(ticks))
    with bench.timed_generate(Engine) as seconds:
        assert Engine().generate([1, 2]) == 2 and Engine().generate([]) == 0
    assert seconds == [0.5, 2.0]
    assert Engine.generate is original


def test_thresholds_and_rates(bench):
    times, rewards = [1.0, 2.0, 3.0, 4.0], [0.0, 0.4, 0.4, 0.8]
    # trailing means over 2: 0, 0.2, 0.4, 0.6: first at or above 0.4 is update index 2
    assert bench.first_reaching(rewards, 0.4, 2) == 2
    assert bench.time_to_threshold(times, rewards, 0.4, 2) == 3.0
    assert bench.episodes_to_threshold(rewards, 8, 0.4, 2) == 24  # 3 updates of 8
    assert bench.time_to_threshold(times, rewards, 0.7, 2) is None
    assert bench.episodes_to_threshold(rewards, 8, 0.7, 2) is None
    # 3 updates of 8 episodes after the warm-up, in 3 s
    assert bench.episodes_per_second(times, 8) == 8.0
    assert bench.seconds_per_update(times) == 1.0


def _runs():
    # episodes/s with 2 episodes per update: sync 2 and 1, s1_tis 4 and 2 (2x sync on each seed)
    return [
        {"arm": "sync", "seed": 0, "times": [1.0, 2.0], "rewards": [0.0, 0.2], "generate_s": [0.5, 0.7]},   # 2 ep/s
        {"arm": "sync", "seed": 1, "times": [1.0, 3.0], "rewards": [0.0, 0.4], "generate_s": [0.9, 0.9]},   # 1 ep/s
        {"arm": "s1_tis", "seed": 0, "times": [1.0, 1.5], "rewards": [0.6, 0.2], "generate_s": [0.4]},      # 4 ep/s
        {"arm": "s1_tis", "seed": 1, "times": [1.0, 2.0], "rewards": [0.0, 0.4], "generate_s": [0.2, 0.6]},  # 2 ep/s
    ]


def test_summary_takes_ratios_per_seed(bench):
    args = bench.parse_args(["--seeds", "0,1", "--arms", "sync,s1_tis", "--final-window", "1", "--threshold", "0.5",
                             "--batch", "2", "--updates", "2"])
    sync, s1 = bench.summarise(_runs(), args)
    assert sync["ratio"] == 1.0 and s1["ratio"] == 2.0 and s1["ratio_min"] == s1["ratio_max"] == 2.0
    assert s1["episodes_per_s"] == 3.0
    assert sync["final_mean"] == pytest.approx(0.3) and sync["final_std"] == pytest.approx(0.02 ** 0.5)
    # s1 seed 0 reaches 0.5 at its first update (1 s, 2 episodes); seed 1 never; sync never
    assert (s1["to_threshold_s"], s1["to_threshold_episodes"], s1["reached"]) == (1.0, 2, 1)
    assert (sync["to_threshold_s"], sync["to_threshold_episodes"], sync["reached"]) == (None, None, 0)
    # seconds per update after the first: sync 1 and 2 (median 1.5); s1 0.5 and 1 (0.75)
    assert sync["update_s"] == 1.5 and s1["update_s"] == 0.75
    # server seconds per batch: median over seeds of each run's median: sync 0.6, 0.9; s1 0.4, 0.4
    assert sync["generate_s"] == pytest.approx(0.75) and s1["generate_s"] == pytest.approx(0.4)


def test_table_and_verdicts(bench):
    args = bench.parse_args(["--seeds", "0,1", "--arms", "sync,s1_tis", "--final-window", "1", "--threshold", "0.5",
                             "--batch", "2", "--updates", "2"])
    rows = bench.summarise(_runs(), args)
    lines = bench.table_lines(rows, args)
    assert lines[2] == "| sync | 1.50 | 1.00 (1.00-1.00) | 0.300 ± 0.141 | never (0/2) | never | 1.50 | 0.75 | 2.5 |"
    assert lines[3] == "| s1_tis | 3.00 | 2.00 (2.00-2.00) | 0.300 ± 0.141 | 2 (1/2) | 1.0 | 0.75 | 0.40 | 1.8 |"
    # s1's final mean equals sync's: within one std (0.141)
    assert bench.verdicts(rows) == ["s1_tis: 2.00x sync's episodes/s; final reward +0.000 from sync's "
                                    "(one std: 0.141): within"]
