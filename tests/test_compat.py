"""The supported TRL range is a checked claim: outside it, a clear ImportError. Inside it, our
classes stand on TRL's PPO classes where TRL has them and on our own base where it does not."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from packaging.version import Version

from trl_ppo_ext import _compat

ROOT = Path(__file__).parents[1]
TRL_HAS_PPO = _compat.trl_has_ppo()
needs_trl_ppo = pytest.mark.skipif(not TRL_HAS_PPO, reason="the installed TRL has no PPO trainer (1.13 removed it)")


@pytest.mark.parametrize("version", ["1.0.0", "1.5.1", "1.12.0", "1.13.0", "1.16.0", "1.99.0"])
def test_supported_versions_pass(version):
    assert _compat.check_trl_version(version) == version


@pytest.mark.parametrize("version", ["0.29.1", "0.12.0", "2.0.0", "2.1.0"])
def test_unsupported_versions_name_the_version_and_the_range(version):
    with pytest.raises(ImportError) as err:
        _compat.check_trl_version(version)
    msg = str(err.value)
    assert f"trl=={version} is installed" in msg
    assert "trl>=1.0.0,<2.0.0" in msg and "pip install 'trl>=1.0.0,<2.0.0'" in msg


def test_pyproject_pins_the_range_compat_checks():
    text = (ROOT / "pyproject.toml").read_text()
    spec = re.search(r'"trl>=([0-9.]+),<([0-9.]+)"', text)
    assert spec, "pyproject.toml lost its trl>=MIN,<MAX requirement"
    assert Version(spec.group(1)) == Version(_compat.TRL_MIN)
    assert Version(spec.group(2)) == Version(_compat.TRL_MAX)


def test_readme_names_the_newest_verified_trl():
    assert f"trl {_compat.TRL_NEWEST_VERIFIED}" in (ROOT / "README.md").read_text()


def test_trl_has_ppo_matches_the_installed_version():
    # TRL 1.0 - 1.12 keep PPO in trl.experimental.ppo; 1.13 removed it.
    expected = Version(_compat.installed_trl_version()) < Version(_compat.TRL_WITHOUT_PPO)
    assert TRL_HAS_PPO is expected


@needs_trl_ppo
def test_installed_trl_is_found_where_it_keeps_the_trainer():
    trainer, config, module = _compat.load_trl_ppo()
    assert trainer.__name__ == "PPOTrainer" and config.__name__ == "PPOConfig"
    assert module.__name__ in ("trl.experimental.ppo", "trl")


@pytest.mark.skipif(TRL_HAS_PPO, reason="the installed TRL has a PPO trainer")
def test_without_trl_ppo_the_upstream_classes_raise_a_clear_error():
    with pytest.raises(ImportError, match=r"trl 1.0.0 - 1.12 \(TRL 1.13.0 removed it\).*pip install -e . trl==1.12.0"):
        _compat.load_trl_ppo()
    with pytest.raises(ImportError, match=r"trl_ppo_ext.PPOTrainer works without it"):
        _compat.TRLPPOConfig
    assert _compat.upstream_ppo_config() is None


@pytest.mark.skipif(TRL_HAS_PPO, reason="the installed TRL has a PPO trainer")
def test_the_comparison_with_trls_trainer_says_how_to_get_it_before_running_anything():
    """``conformance_setups.py --matrix ours trl`` used to run every 'ours' row, then crash with a
    traceback; now it stops at once with how to get TRL 1.12."""
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).parent / "scripts" / "conformance_setups.py"
    proc = subprocess.run([sys.executable, str(script), "--matrix", "ours", "trl"], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2 and proc.stdout == ""  # no row ran
    assert "trl==1.12.0" in proc.stderr and "Traceback" not in proc.stderr


def test_our_classes_stand_on_the_base_compat_chose():
    from trl_ppo_ext import PPOConfig, PPOTrainer, _base

    if _compat.uses_own_base():
        assert issubclass(PPOTrainer, _base.PPOTrainerBase) and issubclass(PPOConfig, _base.PPOConfigBase)
    else:
        trainer, config, _ = _compat.load_trl_ppo()
        assert issubclass(PPOTrainer, trainer) and issubclass(PPOConfig, config)
        assert not issubclass(PPOTrainer, _base.PPOTrainerParts)


def _run(code: str, **env) -> subprocess.CompletedProcess:
    full_env = {**os.environ, "PYTHONPATH": str(ROOT), **env}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=full_env, timeout=300)


@needs_trl_ppo
@pytest.mark.slow
def test_the_switch_forces_our_own_base_on_a_trl_with_ppo():
    code = (
        "from trl_ppo_ext import PPOConfig, PPOTrainer, _compat, _base\n"
        "import trl.experimental.ppo as up\n"
        "assert _compat.uses_own_base()\n"
        "assert issubclass(PPOTrainer, _base.PPOTrainerBase) and not issubclass(PPOTrainer, up.PPOTrainer)\n"
        "assert issubclass(PPOConfig, _base.PPOConfigBase) and not issubclass(PPOConfig, up.PPOConfig)\n"
        "assert _compat.upstream_ppo_config() is up.PPOConfig\n"
        "print(_compat.base_description())\n"
    )
    proc = _run(code, TRL_PPO_EXT_OWN_BASE="1")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "forced by TRL_PPO_EXT_OWN_BASE" in proc.stdout


@pytest.mark.parametrize("value,own", [("0", False), ("", False), ("1", True), ("true", True)])
def test_the_switch_reads_its_values(value, own):
    proc = _run("from trl_ppo_ext import _compat; print(_compat._OWN_BASE_FORCED)", TRL_PPO_EXT_OWN_BASE=value)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip() == str(own)


def test_prepare_deepspeed_calls_trl_models_utils_with_the_accelerator(monkeypatch):
    """The TRL 1.0 bug: its PPO module imports a ``prepare_deepspeed(model, batch_size, fp16,
    bf16)``; we must call ``trl.models.utils.prepare_deepspeed(model, accelerator)``."""
    import trl.models.utils

    calls = []
    monkeypatch.setattr(trl.models.utils, "prepare_deepspeed", lambda model, accelerator: calls.append(
        (model, accelerator)) or "engine")
    if TRL_HAS_PPO:  # whatever the PPO module holds must not be what runs
        module = sys.modules[_compat.load_trl_ppo()[0].__module__]
        monkeypatch.setattr(module, "prepare_deepspeed", lambda *a, **k: pytest.fail("PPO module's helper ran"),
                            raising=False)
    model, accelerator = object(), object()
    assert _compat.prepare_deepspeed(model, accelerator) == "engine"
    assert calls == [(model, accelerator)]


def test_import_of_package_fails_clearly_with_unsupported_trl(monkeypatch):
    import importlib

    monkeypatch.setattr("importlib.metadata.version", lambda name: "2.0.0" if name == "trl" else "0")
    saved = {k: v for k, v in sys.modules.items() if k.startswith("trl_ppo_ext")}
    for k in saved:
        del sys.modules[k]
    try:
        with pytest.raises(ImportError, match=r"supports trl>=1.0.0,<2.0.0 but trl==2.0.0 is installed"):
            importlib.import_module("trl_ppo_ext")
    finally:
        sys.modules.update(saved)
