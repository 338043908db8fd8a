"""Fixtures of the agents tests: a tiny chat tokenizer TRL's tool-call parser reads, and a
scripted ``generate`` that replays fixed turns, so every episode is deterministic.

``chat_tok``
    ``build_tiny_chat_tokenizer()`` (byte-level, TRL's Qwen3 template), new for each test, with
    the response parser set and ``chat_tok.training_template`` the template `check_tool_support`
    chose (TRL's ``qwen3_training.jinja``).
``scripted(tok, scripts)``
    A ``generate(prefixes, max_new_tokens) -> (ids, logprobs)``. ``scripts`` maps a text to the
    turns of the episode whose prompt contains it: the n-th call for that prompt returns its n-th
    turn, tokenized and cut to ``max_new_tokens``. Token ``i`` of turn ``n`` has log-prob
    ``-(n + 1) - i / 1000``. ``.calls`` records each call's ``(prefixes, max_new_tokens)``.
"""

import pytest

from trl_ppo_ext.agents.support import check_tool_support
from trl_ppo_ext.tiny import build_tiny_chat_tokenizer


@pytest.fixture
def chat_tok():
    tok = build_tiny_chat_tokenizer()
    tok.training_template = check_tool_support(tok)
    return tok


class ScriptedGenerate:
    def __init__(self, tok, scripts):
        self.tok, self.scripts = tok, {key: list(turns) for key, turns in scripts.items()}
        self.served = {key: 0 for key in scripts}
        self.calls = []

    def _key(self, prefix):
        text = self.tok.decode(prefix)
        found = [key for key in self.scripts if key in text]
        assert len(found) == 1, f"a prefix must contain exactly one script key, found {found}"
        return found[0]

    def __call__(self, prefixes, max_new_tokens):
        self.calls.append(([list(p) for p in prefixes], list(max_new_tokens)))
        ids, logprobs = [], []
        for prefix, limit in zip(prefixes, max_new_tokens):
            key = self._key(prefix)
            n = self.served[key]
            self.served[key] += 1
            turn = self.tok(self.scripts[key][n], add_special_tokens=False).input_ids[:limit]
            ids.append(turn)
            logprobs.append([-(n + 1) - i / 1000 for i in range(len(turn))])
        return ids, logprobs


@pytest.fixture(scope="session")
def scripted():
    return ScriptedGenerate
