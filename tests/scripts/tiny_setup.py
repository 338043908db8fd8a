"""The tiny run the trainer tests share, as plain functions: prompts, a PPOConfig, the four models.

tests/conftest.py turns these into fixtures; the scripts here, run in subprocesses outside
pytest, import them directly (``python tests/scripts/X.py`` puts this folder first on
``sys.path``). Not a test module: pytest collects nothing from it.
"""

import contextlib
from pathlib import Path

from trl_ppo_ext.tiny import build_tiny_causal_lm, build_tiny_scorer, random_word_prompts

# PPOTrainer's keyword for each model, in the order tiny_models builds them, and its seed. Every
# build re-seeds torch's global RNG, so the RNG a trainer starts from depends on the last model
# built: building the four in this order keeps it the same whichever ones a caller brings.
MODEL_SEEDS = {"model": 0, "ref_model": 0, "value_model": 1, "reward_model": 2}


def prompt_dataset(tokenizer, n=16, min_len=2, max_len=5, seed=0):
    """``n`` random prompts of ordinary words, tokenized (ids only), lengths in [min_len, max_len]."""
    return random_word_prompts(tokenizer, n, min_len, max_len, seed)


def tiny_config(root, **overrides):
    """A PPOConfig for a CPU run of a few seconds, writing to ``root/out``; ``overrides`` win."""
    from trl_ppo_ext import PPOConfig

    kwargs = dict(
        output_dir=str(Path(root) / "out"),
        per_device_train_batch_size=4,
        gradient_accumulation_steps=1,
        total_episodes=8,
        response_length=6,
        num_ppo_epochs=1,
        num_mini_batches=1,
        local_rollout_forward_batch_size=4,
        learning_rate=1e-3,
        report_to=[],
        disable_tqdm=True,
        num_sample_generations=0,
        save_strategy="no",
        logging_steps=1,
        stop_token="eos",
        seed=0,
        bf16=False,
    )
    kwargs.update(overrides)
    return PPOConfig(**kwargs)


def tiny_model(role, tokenizer, **config_kwargs):
    """The tiny model for ``role`` (a key of MODEL_SEEDS): a causal LM for the policy and the
    reference (equal weights), a scalar scorer for the value and the reward model."""
    build = build_tiny_causal_lm if role in ("model", "ref_model") else build_tiny_scorer
    return build(tokenizer, seed=MODEL_SEEDS[role], **config_kwargs)


def tiny_models(tokenizer, **config_kwargs):
    """``(policy, ref_policy, value_model, reward_model)``; the reference starts equal to the policy."""
    return tuple(tiny_model(role, tokenizer, **config_kwargs) for role in MODEL_SEEDS)


def record_optimizer_steps(trainer):
    """Count real optimizer steps: returns a list that gets, at each logged update, the number
    of times the wrapped torch optimizer actually stepped during that update."""
    inner = trainer.optimizer.optimizer  # accelerate's AcceleratedOptimizer wraps the torch one
    counts, current = [], [0]
    step = inner.step

    def counting_step(*args, **kwargs):
        current[0] += 1
        return step(*args, **kwargs)

    inner.step = counting_step
    log_update = trainer.log_update

    def log_and_count(metrics):
        counts.append(current[0])
        current[0] = 0
        return log_update(metrics)

    trainer.log_update = log_and_count
    return counts


# The modes of tests/scripts/ppo_two_process.py's one DDP launch (tests/conftest.py's
# ``two_process_runs``): tests/test_distributed.py's, then the DDP runs tests/end_to_end/test_fsdp2.py compares
# FSDP2 with (the layouts of tests/scripts/ppo_fsdp2.py, trained under DDP).
TWO_PROCESS_MODES = ("separate", "peft", "eval", "recipe", "shared", "budget", "episodes", "tools", "critic")
DDP_REFERENCE_MODES = ("ddp_separate", "ddp_shared", "ddp_value_adapter")


def launch_two_processes(launch_args, script_args, env, timeout=600):
    """``accelerate launch --num_processes 2 --mixed_precision no <launch_args> <script_args>``
    from this environment's ``accelerate``, with ``env`` added to this process's environment
    (offline, one thread per process, this checkout first on ``PYTHONPATH``; a None value removes
    the variable). A launch past ``timeout`` is killed and returned with exit status None."""
    import os
    import shutil
    import subprocess
    import sys

    accelerate = shutil.which("accelerate", path=os.path.dirname(sys.executable)) or shutil.which("accelerate")
    cmd = [accelerate, "launch", *launch_args, "--num_processes", "2", "--mixed_precision", "no", *script_args]
    full_env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRL_EXPERIMENTAL_SILENCE": "1", "OMP_NUM_THREADS": "1",
                "PYTHONPATH": str(Path(__file__).parents[2]), **env}
    full_env = {k: v for k, v in full_env.items() if v is not None}
    try:
        return subprocess.run(cmd, capture_output=True, text=True, env=full_env, timeout=timeout)
    except subprocess.TimeoutExpired as late:
        text = lambda b: b.decode(errors="replace") if isinstance(b, bytes) else (b or "")  # noqa: E731
        return subprocess.CompletedProcess(late.cmd, None, text(late.stdout), text(late.stderr))


def run_and_exit(main) -> None:
    """Run ``main()``, then leave with its exit status without the interpreter's teardown.

    With two gloo processes the teardown sometimes aborts a rank ("terminate called without an
    active exception", exit -6) after every file was written and the process group destroyed:
    4 of 46 launches of ppo_two_process.py on this machine (torch 2.13, CPU; 1 of 8 with the
    package as it was before the change that found it). The tests check the files and the exit status of the work, so
    the teardown is skipped. ``SystemExit`` (a preempted run stops inside ``train()``) keeps
    its code; any other exception prints its traceback and exits 1.
    """
    import os
    import sys
    import traceback

    try:
        main()
        code = 0
    except SystemExit as stop:
        code = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
    except BaseException:
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def two_turn_rollout(tokenizer, first_turn=2, reply_length=2, reply_words=10):
    """A ``rollout_func`` for tests: the policy answers (at most ``first_turn`` tokens), the
    environment replies with ``reply_length`` words drawn from torch's global RNG (the run's, so
    a resumed run must restore it), the policy answers again within what is left of
    ``response_length``. Returns TRL's keys, ``env_mask`` and a ``reply`` column (the words)."""
    import torch

    from trl_ppo_ext.tiny import default_words

    word_ids = tokenizer.convert_tokens_to_ids(default_words()[:reply_words])

    def rollout_func(prompts, trainer):
        prompt_ids = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompts]
        first, first_lp = trainer.generate_continuations(prompt_ids, first_turn)
        picks = torch.randint(0, len(word_ids), (len(prompts), reply_length)).tolist()
        replies = [[word_ids[k] for k in row] for row in picks]
        left = [trainer.args.response_length - len(a) - reply_length for a in first]
        second, second_lp = trainer.generate_continuations(
            [p + a + r for p, a, r in zip(prompt_ids, first, replies)], left)
        return {
            "prompt_ids": prompt_ids,
            "completion_ids": [a + r + b for a, r, b in zip(first, replies, second)],
            "logprobs": [la + [0.0] * reply_length + lb for la, lb in zip(first_lp, second_lp)],
            "env_mask": [[1] * len(a) + [0] * reply_length + [1] * len(b) for a, b in zip(first, second)],
            "reply": [tokenizer.decode(r) for r in replies],
        }

    return rollout_func


# ---------------------------------------------------------------- tools (tests/trainer/test_trainer_tools.py)
TOOL_CALL = '<tool_call>\n{{"name": "{name}", "arguments": {args}}}\n</tool_call><|im_end|>'


def multiply(a: int, b: int) -> int:
    """
    Multiply two integers.

    Args:
        a: The first factor.
        b: The second factor.

    Returns:
        The product.
    """
    return a * b


def tool_config(tmp_path, **overrides):
    """A PPOConfig for a tool run on the tiny chat tokenizer: long enough for a tool call and its answer."""
    from trl_ppo_ext import PPOConfig

    kwargs = dict(output_dir=str(tmp_path / "out"), per_device_train_batch_size=2, total_episodes=4,
                  response_length=128, num_ppo_epochs=1, num_mini_batches=1, local_rollout_forward_batch_size=2,
                  learning_rate=1e-3, report_to=[], disable_tqdm=True, num_sample_generations=0,
                  save_strategy="no", logging_steps=1, seed=0, bf16=False, max_tool_calling_iterations=2,
                  chat_template_kwargs={"enable_thinking": False})
    kwargs.update(overrides)
    return PPOConfig(**kwargs)


def scripted_continuations(tokenizer, texts, max_new_tokens):
    """A tool loop's turns replayed from a script: each text tokenized and cut to its row's budget
    (``max_new_tokens``: one for every row or one per row), with log-probs -0.5 (a script has no
    sampler; the tests that replay turns read none)."""
    budgets = [max_new_tokens] * len(texts) if isinstance(max_new_tokens, int) else max_new_tokens
    ids = [tokenizer(t, add_special_tokens=False).input_ids[:n] for t, n in zip(texts, budgets)]
    return ids, [[-0.5] * len(row) for row in ids]


class Vault:
    """One environment per rollout: the code is the row's ``target``; its method ``try_code`` is the tool."""

    def reset(self, target, **row):
        self.target, self.opened = target, False

    def try_code(self, code: int) -> str:
        """
        Try a code on the vault.

        Args:
            code: The code to try.
        """
        self.opened = code == self.target
        return "open" if self.opened else "locked"


def tool_dataset(n=4):
    """``n`` conversational prompts with a ``target`` column (40, 41, ...)."""
    from datasets import Dataset

    return Dataset.from_list([{"prompt": [{"role": "user", "content": "6*7?"}], "target": 40 + i} for i in range(n)])


# Shapes vLLM's CPU attention accepts (head_dim 64, not the default 16), for the use_vllm tests.
VLLM_SHAPES = {"hidden_size": 128, "num_heads": 2, "max_position_embeddings": 64}


def _vllm_trainer():
    from trl_ppo_ext import PPOTrainer

    class VllmTrainer(PPOTrainer):
        """Small engines for tests: eager (no compilation at start), a 64 MiB KV cache."""

        vllm_engine_kwargs = {"enforce_eager": True, "kv_cache_memory_bytes": 64 << 20}

    return VllmTrainer


def __getattr__(name):  # VllmTrainer imports the trainer only when asked for
    if name == "VllmTrainer":
        return _vllm_trainer()
    raise AttributeError(name)


# ---------------------------------------------------------------- a vLLM server in a subprocess
def free_port() -> int:
    """A free TCP port on 127.0.0.1."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def lora_server_command(folder: str, port: int, max_model_len: int = 64) -> list:
    """vLLM's API server for the fp32 checkpoint ``folder`` on 127.0.0.1:``port``, loading LoRA
    adapters (rank <= 8, 3 at a time) and sampling with vLLM's own generation defaults."""
    import sys

    return [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", folder, "--host", "127.0.0.1",
            "--port", str(port), "--dtype", "float32", "--enforce-eager", "--max-model-len", str(max_model_len),
            "--skip-tokenizer-init", "--generation-config", "vllm", "--logprobs-mode", "processed_logprobs",
            "--enable-lora", "--max-lora-rank", "8", "--max-loras", "3"]


@contextlib.contextmanager
def server_process(command: list, log_path, **env):
    """Runs ``command`` (a vLLM server) in a session of its own, one CPU thread, output to
    ``log_path``, ``env`` added to the environment; yields the process. On exit the server and the
    engine process it started get SIGTERM, then SIGKILL after 30 s."""
    import os
    import signal
    import subprocess

    env = {**os.environ, "OMP_NUM_THREADS": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind", "VLLM_CPU_KVCACHE_SPACE": "1",
           **env}
    with open(log_path, "w") as log:
        process = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            yield process
        finally:
            os.killpg(process.pid, signal.SIGTERM)
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
