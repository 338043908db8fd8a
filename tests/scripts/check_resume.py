"""Compare the outputs of ``ppo_resume.py OUT straight`` and ``ppo_resume.py OUT resume``.

    check_resume.py OUT

Exit 0 when the resumed run ends with trainable parameters ``torch.equal`` to the straight
run's and the same logged metrics (throughput ``eps`` aside); else print what differs and exit 1.
CI uses it across TRL versions: ``straight`` and ``killed`` under one TRL, ``resume`` under another.
"""

import json
import sys
from pathlib import Path

import torch

from trl_ppo_ext.reporting import TIMING_KEYS


def differences(out: Path) -> list[str]:
    a = torch.load(out / "final_params_straight.pt")
    b = torch.load(out / "final_params_resume.pt")
    problems = []
    if a.keys() != b.keys():
        problems.append(f"parameter names differ: {sorted(set(a) ^ set(b))[:5]}")
    problems += [f"parameter {k} differs (max |diff| {(a[k] - b[k]).abs().max():.3g})"
                 for k in sorted(set(a) & set(b)) if not torch.equal(a[k], b[k])]
    logs_a = [{k: v for k, v in h.items() if k not in TIMING_KEYS}
              for h in json.loads((out / "logs_straight.json").read_text())]
    logs_b = [{k: v for k, v in h.items() if k not in TIMING_KEYS}
              for h in json.loads((out / "logs_resume.json").read_text())]
    if logs_a != logs_b:
        problems.append(f"log history differs ({len(logs_a)} vs {len(logs_b)} entries)")
    return problems


if __name__ == "__main__":
    out = Path(sys.argv[1])
    problems = differences(out)
    for p in problems:
        print("MISMATCH:", p)
    if not problems:
        n = len(torch.load(out / "final_params_resume.pt"))
        print(f"resumed run equals the straight run: {n} trainable tensors torch.equal, same log history")
    sys.exit(1 if problems else 0)
