"""The supported TRL range is a checked claim: outside it, a clear ImportError."""

import pytest

from trl_ppo_ext import _compat


@pytest.mark.parametrize("version", ["1.0.0", "1.5.1", "1.12.0"])
def test_supported_versions_pass(version):
    assert _compat.check_trl_version(version) == version


@pytest.mark.parametrize("version,extra", [("1.13.0", "removed the PPO trainer"), ("0.29.1", ""), ("2.0.0", "removed")])
def test_unsupported_versions_name_the_version_and_the_range(version, extra):
    with pytest.raises(ImportError) as err:
        _compat.check_trl_version(version)
    msg = str(err.value)
    assert f"trl=={version} is installed" in msg
    assert "trl>=1.0.0,<1.13.0" in msg and extra in msg


def test_installed_trl_is_found_where_it_keeps_the_trainer():
    trainer, config, module = _compat.load_trl_ppo()
    assert trainer.__name__ == "PPOTrainer" and config.__name__ == "PPOConfig"
    assert module.__name__ in ("trl.experimental.ppo", "trl")


def test_import_of_package_fails_clearly_with_unsupported_trl(monkeypatch):
    import importlib
    import sys

    monkeypatch.setattr("importlib.metadata.version", lambda name: "1.13.0" if name == "trl" else "0")
    saved = {k: v for k, v in sys.modules.items() if k.startswith("trl_ppo_ext")}
    for k in saved:
        del sys.modules[k]
    try:
        with pytest.raises(ImportError, match=r"trl==1.13.0 is installed.*removed the PPO trainer"):
            importlib.import_module("trl_ppo_ext")
    finally:
        sys.modules.update(saved)


def test_prepare_deepspeed_calls_trl_models_utils_with_the_accelerator(monkeypatch):
    """The TRL 1.0 bug: its PPO module imports a ``prepare_deepspeed(model, batch_size, fp16,
    bf16)``; we must call ``trl.models.utils.prepare_deepspeed(model, accelerator)``."""
    import sys

    import trl.models.utils

    calls = []
    monkeypatch.setattr(trl.models.utils, "prepare_deepspeed", lambda model, accelerator: calls.append(
        (model, accelerator)) or "engine")
    module = sys.modules[_compat.load_trl_ppo()[0].__module__]  # whatever it holds must not run
    monkeypatch.setattr(module, "prepare_deepspeed", lambda *a, **k: pytest.fail("PPO module's helper ran"),
                        raising=False)
    model, accelerator = object(), object()
    assert _compat.prepare_deepspeed(model, accelerator) == "engine"
    assert calls == [(model, accelerator)]
