"""The package as ``pip install`` leaves it: run by .ci/run in an environment where only the built
wheel is installed (not editable), from a working directory outside the checkout.

    python /path/to/checkout/tests/scripts/wheel_smoke.py

Checks, each failing with a message: ``trl_ppo_ext`` is imported from site-packages, not from the
checkout, at the version ``trl_ppo_ext/_version.py`` of the checkout says; every public name
resolves; two PPO updates with a reward function on tiny models run and move the policy; ``python
-m trl_ppo_ext.memory --help`` exits 0. Only this folder (``tiny_setup``) comes from the checkout.
"""

import math
import re
import subprocess
import sys
import tempfile
from pathlib import Path

CHECKOUT = Path(__file__).resolve().parents[2]


def check(condition: bool, message: str) -> None:
    if not condition:
        sys.exit(f"wheel smoke: {message}")


def installed_not_the_checkout():
    import trl_ppo_ext

    where = Path(trl_ppo_ext.__file__).resolve()
    # the virtualenv may sit inside the checkout (.venv-wheel): the package's folder is what counts
    check("site-packages" in where.parts and where.parent != CHECKOUT / "trl_ppo_ext",
          f"trl_ppo_ext comes from {where}, not from an installed wheel")
    expected = re.search(r'__version__ = "([^"]+)"', (CHECKOUT / "trl_ppo_ext" / "_version.py").read_text()).group(1)
    from importlib.metadata import version

    check(trl_ppo_ext.__version__ == version("trl-ppo-ext") == expected,
          f"versions: module {trl_ppo_ext.__version__}, metadata {version('trl-ppo-ext')}, checkout {expected}")
    missing = [name for name in trl_ppo_ext.__all__ if getattr(trl_ppo_ext, name, None) is None]
    check(not missing, f"public names that do not resolve: {missing}")
    print(f"trl_ppo_ext {trl_ppo_ext.__version__} from {where.parent}; {len(trl_ppo_ext.__all__)} public names")


def two_updates(output_dir: str):
    import torch
    from tiny_setup import prompt_dataset, tiny_config, tiny_models

    from trl_ppo_ext import PPOTrainer
    from trl_ppo_ext.tiny import build_tiny_tokenizer

    def count_w1(completions, **kwargs):
        return [float(c.split().count("w1")) for c in completions]

    tok = build_tiny_tokenizer()
    policy, ref, value, _ = tiny_models(tok)
    before = {k: v.detach().clone() for k, v in policy.named_parameters()}
    trainer = PPOTrainer(args=tiny_config(output_dir), processing_class=tok, model=policy, ref_model=ref,
                         value_model=value, reward_funcs=[count_w1], train_dataset=prompt_dataset(tok))
    trainer.train()
    logs = [h for h in trainer.state.log_history if "objective/scores" in h]
    check(len(logs) == 2, f"expected 2 logged updates, got {len(logs)}")
    check(all(math.isfinite(h["rewards/count_w1/mean"]) for h in logs), f"reward not logged: {logs}")
    moved = [k for k, v in trainer.unwrapped.policy.named_parameters() if not torch.equal(v.detach(), before[k])]
    check(moved, "two updates left the policy unchanged")
    print(f"two updates: rewards/count_w1/mean {[h['rewards/count_w1/mean'] for h in logs]}")


def memory_cli(cwd: str):
    done = subprocess.run([sys.executable, "-m", "trl_ppo_ext.memory", "--help"], cwd=cwd, capture_output=True,
                          text=True)
    check(done.returncode == 0 and "usage" in done.stdout.lower(),
          f"python -m trl_ppo_ext.memory --help exited {done.returncode}: {done.stderr[-2000:]}")
    print("python -m trl_ppo_ext.memory --help: ok")


if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as work:
        installed_not_the_checkout()
        two_updates(work)
        memory_cli(work)
    print("wheel smoke: passed")
