"""agents/support.py: the construction-time check of TRL, transformers and the chat template."""

import importlib.util

import pytest
from trl import chat_template_utils

from trl_ppo_ext.agents import support
from trl_ppo_ext.agents.support import check_tool_support
from trl_ppo_ext.tiny import TINY_CHAT_TEMPLATE, build_tiny_chat_tokenizer


def test_qwen3_gets_its_parser_and_trls_training_template():
    tok = build_tiny_chat_tokenizer()
    assert getattr(tok, "response_template", None) is None
    template = check_tool_support(tok)
    assert template == chat_template_utils.qwen3_training_chat_template      # qwen3.jinja is not prefix-preserving
    assert tok.response_template == chat_template_utils.qwen3_template       # TRL's parser for Qwen3


def test_a_prefix_preserving_template_is_kept():
    tok = build_tiny_chat_tokenizer(chat_template_utils.qwen3_training_chat_template)
    tok.response_template = chat_template_utils.qwen3_template   # a parser the user set: kept, not replaced
    assert check_tool_support(tok) is None                       # render with the tokenizer's own


@pytest.mark.parametrize("old", ["1.0.0", "1.7.2"])
def test_a_trl_without_the_helpers_the_loop_needs_names_the_version_needed(old):
    with pytest.raises(ImportError, match=rf"need TRL >= 1\.8\.0 .*the installed TRL is {old}\b.*'trl>=1\.8\.0'"):
        check_tool_support(build_tiny_chat_tokenizer(), trl_version=old)
    assert check_tool_support(build_tiny_chat_tokenizer(), trl_version="1.8.0") is not None


def test_a_trl_missing_one_helper_is_refused_too(monkeypatch):
    monkeypatch.delattr(chat_template_utils, "supports_tool_calling")
    with pytest.raises(ImportError, match=r"lacks \['supports_tool_calling'\]"):
        check_tool_support(build_tiny_chat_tokenizer())


@pytest.mark.parametrize("environments, installed, needed", [(False, "4.57.1", "5.0.0"), (True, "5.1.0", "5.2.0")])
def test_transformers_gates_as_trl(environments, installed, needed):
    feature = "environment_factory" if environments else "tools"
    with pytest.raises(ImportError, match=rf"{feature} needs transformers >= {needed}.*installed transformers is "
                                          rf"{installed}"):
        check_tool_support(build_tiny_chat_tokenizer(), environments=environments, transformers_version=installed)


def test_below_transformers_5_13_the_legacy_parser_needs_jmespath(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(support.importlib.util, "find_spec", lambda name: None if name == "jmespath" else real(name))
    with pytest.raises(ImportError, match="needs jmespath"):
        check_tool_support(build_tiny_chat_tokenizer(), transformers_version="5.12.0")


def test_a_tokenizer_without_a_chat_template_is_refused():
    tok = build_tiny_chat_tokenizer()
    tok.chat_template = None
    with pytest.raises(ValueError, match="has none: set processing_class.chat_template"):
        check_tool_support(tok)


def test_a_template_that_cannot_render_tool_calls_is_refused():
    with pytest.raises(ValueError, match="does not support tool calling"):
        check_tool_support(build_tiny_chat_tokenizer(TINY_CHAT_TEMPLATE))


def test_a_template_trls_parser_does_not_recognise_is_a_clear_error():
    # Qwen3's template renders tool calls, but any edit makes it unknown to TRL's exact-match parser table
    edited = chat_template_utils.qwen3_chat_template + "{#- my edit #}"
    with pytest.raises(ValueError, match="TRL's tool-call parser does not recognise this chat template.*"
                                         "response_template yourself"):
        check_tool_support(build_tiny_chat_tokenizer(edited))
