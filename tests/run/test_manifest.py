"""Run manifest: every field on tiny models, content hashes that see a changed weight, JSON
conversion, atomic write, finishing a run."""

import dataclasses
import enum
import hashlib
import json
import math
import os
import platform
from datetime import datetime
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from torch import nn

import trl_ppo_ext
from trl_ppo_ext.run.manifest import (
    build_manifest,
    dataset_identity,
    environment_identity,
    finish_manifest,
    manifest_path,
    model_identity,
    package_versions,
    to_jsonable,
    tokenizer_identity,
    write_manifest,
)
from trl_ppo_ext.tiny import TINY_CHAT_TEMPLATE, build_tiny_causal_lm, build_tiny_scorer, build_tiny_tokenizer

MODEL_KEYS = {
    "role", "class", "name_or_path", "revision", "content_hash", "content_hash_method", "dtype",
    "parameter_dtypes", "quantization", "adapters", "parameters", "shared_with",
}
# Tiny Llama (tiny.py defaults): V = 46 tokens (6 special + 40 words), H = 32, MLP 64, 2 layers, untied.
# embed V*H = 1472; per layer q,k,v,o 4*32*32 = 4096 + gate,up 2*32*64 = 4096 + down 64*32 = 2048
# + 2 norms 64 = 10304, x2 = 20608; final norm 32; lm_head 1472 -> 23584.
TINY_LM_PARAMS = 23584
# LoRA r=4 on q_proj and v_proj: A (4x32) + B (32x4) = 256 per module, 2 modules x 2 layers = 1024.
TINY_LORA_PARAMS = 1024


@pytest.fixture(scope="module")
def tokenizer():
    return build_tiny_tokenizer()


@pytest.fixture
def lm(tokenizer):
    return build_tiny_causal_lm(tokenizer, seed=0)


def strict_json(obj):
    return json.loads(json.dumps(obj, allow_nan=False))


# ---------------------------------------------------------------------- models
def test_model_identity_of_a_plain_model(lm):
    identity = model_identity(lm, "policy")
    assert set(identity) == MODEL_KEYS
    assert identity["role"] == "policy" and identity["class"] == "LlamaForCausalLM"
    assert identity["name_or_path"] is None  # random init: config._name_or_path == ""
    assert identity["revision"] is None
    assert len(identity["content_hash"]) == 64 and int(identity["content_hash"], 16) >= 0
    assert identity["content_hash_method"] == "sha256 over parameter names, shapes, dtypes and all values"
    assert identity["dtype"] == "torch.float32"
    assert identity["parameter_dtypes"] == {"torch.float32": TINY_LM_PARAMS}
    assert identity["parameters"] == {"trainable": TINY_LM_PARAMS, "total": TINY_LM_PARAMS}
    assert (identity["quantization"], identity["adapters"], identity["shared_with"]) == (None, [], [])
    assert strict_json(identity) == identity


def test_name_revision_and_sharing_are_recorded(tokenizer):
    scorer = build_tiny_scorer(tokenizer)
    scorer.config._name_or_path = "org/reward-model"
    scorer.requires_grad_(False)
    identity = model_identity(scorer, "reward", shared_with={"value", "policy"}, revision="abc123")
    assert identity["name_or_path"] == "org/reward-model"
    assert identity["revision"] == "abc123"
    assert identity["shared_with"] == ["policy", "value"]
    assert identity["parameters"]["trainable"] == 0
    scorer.config._commit_hash = "def456"  # what transformers < 5 stored
    assert model_identity(scorer, "reward")["revision"] == "def456"


def test_the_hash_changes_when_one_weight_changes(tokenizer, lm):
    before = model_identity(lm, "policy")["content_hash"]
    assert model_identity(build_tiny_causal_lm(tokenizer, seed=0), "policy")["content_hash"] == before
    weight = lm.model.layers[1].mlp.down_proj.weight
    original = weight[3, 5].item()
    with torch.no_grad():
        weight[3, 5] = original + 1e-3
    assert model_identity(lm, "policy")["content_hash"] != before
    with torch.no_grad():
        weight[3, 5] = original
    assert model_identity(lm, "policy")["content_hash"] == before
    assert model_identity(build_tiny_causal_lm(tokenizer, seed=1), "policy")["content_hash"] != before


def test_sampled_hash_for_big_models_says_what_it_covers(lm):
    sampled = lambda: model_identity(lm, "policy", full_hash_max_bytes=0, samples_per_tensor=4)  # noqa: E731
    first = sampled()
    # 23584 float32 parameters = 94336 bytes > 0: sampled
    assert first["content_hash_method"] == (
        "sha256 over parameter names, shapes, dtypes and 4 evenly strided values per parameter "
        "(parameters take 94336 bytes > 0)"
    )
    embed = lm.model.embed_tokens.weight  # 46 x 32 = 1472 values: stride ceil(1472 / 4) = 368
    with torch.no_grad():
        embed.view(-1)[1] += 1.0  # flat index 1 is not sampled (0, 368, 736, 1104 are)
    assert sampled()["content_hash"] == first["content_hash"]
    with torch.no_grad():
        embed.view(-1)[368] += 1.0  # sampled
    assert sampled()["content_hash"] != first["content_hash"]


def test_adapters_of_a_peft_lora_model(lm):
    from peft import LoraConfig, get_peft_model

    peft_model = get_peft_model(lm, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    identity = model_identity(peft_model, "policy", shared_with=["reference"])
    assert identity["class"] == "PeftModel"
    assert identity["adapters"] == [{
        "name": "default", "peft_type": "LORA", "r": 4, "lora_alpha": 8,
        "target_modules": ["q_proj", "v_proj"], "modules_to_save": None, "active": True,
    }]
    assert identity["parameters"] == {"trainable": TINY_LORA_PARAMS, "total": TINY_LM_PARAMS + TINY_LORA_PARAMS}
    assert identity["shared_with"] == ["reference"]
    assert strict_json(identity) == identity


def test_adapters_injected_into_a_transformers_model_are_listed(tokenizer, tmp_path):
    """A transformers model carrying LoRA layers without a PeftModel around it (peft's
    inject_adapter_in_model; transformers' add_adapter is the same mixin) has ``active_adapters``
    as a method that raises: the manifest crashed the trainer's start with "'method' object is
    not iterable". Found with a LoRA-trained separate critic in the sample-efficiency benchmark."""
    from peft import LoraConfig, inject_adapter_in_model

    from trl_ppo_ext import PPOConfig, PPOTrainer

    value = inject_adapter_in_model(LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"]),
                                    build_tiny_scorer(tokenizer, seed=1))
    for name, param in value.named_parameters():
        param.requires_grad_("lora_" in name or name.startswith("score."))
    expected = [{"name": "default", "peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["q_proj"],
                 "modules_to_save": None, "active": True}]
    assert model_identity(value, "value")["adapters"] == expected
    prompts = [{"input_ids": tokenizer(t)["input_ids"]} for t in ("a b", "c d e", "f", "g h")]
    args = PPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=4, total_episodes=4, response_length=3,
                     num_ppo_epochs=1, num_mini_batches=1, report_to=[], disable_tqdm=True, save_strategy="no",
                     num_sample_generations=0, bf16=False)
    before = {n: p.detach().clone() for n, p in value.named_parameters()}
    trainer = PPOTrainer(args=args, processing_class=tokenizer, model=build_tiny_causal_lm(tokenizer, seed=0),
                         ref_model=None, reward_model=build_tiny_scorer(tokenizer, seed=2), value_model=value,
                         train_dataset=prompts)
    trainer.train()
    manifest = json.loads((tmp_path / "run_manifest.json").read_text())
    assert manifest["models"]["value"]["adapters"] == expected
    moved = {n for n, p in value.named_parameters() if not torch.equal(p, before[n])}
    assert moved and all("lora_" in n or n.startswith("score.") for n in moved)  # only the adapter and head trained


def test_quantization_from_the_config(lm):
    lm.config.quantization_config = {"quant_method": "bitsandbytes", "load_in_4bit": True,
                                     "bnb_4bit_compute_dtype": torch.bfloat16}
    assert model_identity(lm, "reference")["quantization"] == {
        "source": "config.quantization_config",
        "config": {"quant_method": "bitsandbytes", "load_in_4bit": True, "bnb_4bit_compute_dtype": "torch.bfloat16"},
    }


def test_quantization_from_linear4bit_layers_counts_logical_parameters():
    from trl_ppo_ext.models.quantization import import_bitsandbytes

    try:
        bnb = import_bitsandbytes("the 4-bit manifest test")
    except ImportError as err:
        pytest.skip(str(err))
    model = nn.Sequential(bnb.nn.Linear4bit(64, 64, bias=False, compute_dtype=torch.float32, quant_type="nf4"))
    model = model.to("cpu")  # quantizes: 64 * 64 = 4096 weights packed two per byte
    identity = model_identity(model, "reference")
    assert identity["quantization"] == {
        "source": "bitsandbytes Linear4bit layers", "linear4bit_layers": 1, "quant_types": ["nf4"],
    }
    assert identity["parameters"]["total"] == 4096
    assert identity["dtype"] == "torch.uint8"


# ---------------------------------------------------------------------- tokenizer, datasets
def test_tokenizer_identity(tokenizer):
    identity = tokenizer_identity(tokenizer)
    assert identity == {
        "name_or_path": None,
        "class": type(tokenizer).__name__,  # TokenizersBackend in transformers 5, PreTrainedTokenizerFast before
        "vocab_size": 46,
        "base_vocab_size": 46,
        "vocab_sha256": identity["vocab_sha256"],
        "pad_token_id": 0,
        "eos_token_id": 3,
        "bos_token_id": 2,
        "padding_side": "left",
        "chat_template_sha256": hashlib.sha256(TINY_CHAT_TEMPLATE.encode("utf-8")).hexdigest(),
    }
    other = tokenizer_identity(build_tiny_tokenizer(words=["a", "b"], pad_equals_eos=True, chat_template=None))
    assert other["chat_template_sha256"] is None
    assert other["pad_token_id"] == 3 and other["vocab_size"] == 8
    assert other["vocab_sha256"] != identity["vocab_sha256"]


def test_dataset_identity_of_a_hf_dataset():
    from datasets import Dataset

    data = Dataset.from_dict({"input_ids": [[7, 8], [9]], "lengths": [2, 1]})
    identity = dataset_identity(data)
    assert identity == {
        "class": "Dataset", "fingerprint": data._fingerprint, "fingerprint_method": "datasets fingerprint",
        "size": 2, "columns": ["input_ids", "lengths"],
    }
    mapped = data.map(lambda row: {"lengths": row["lengths"] + 1})
    assert dataset_identity(mapped)["fingerprint"] != identity["fingerprint"]
    assert dataset_identity(None) is None


def test_dataset_identity_of_plain_rows_hashes_the_first_rows():
    rows = [{"prompt": f"p{i}", "ids": np.array([i, i + 1])} for i in range(5)]
    identity = dataset_identity(rows, sample_rows=3)
    assert identity["fingerprint_method"] == "sha256 of the first 3 rows as JSON"
    assert (identity["class"], identity["size"], identity["columns"]) == ("list", 5, ["prompt", "ids"])
    expected = hashlib.sha256(json.dumps(
        [{"ids": [0, 1], "prompt": "p0"}, {"ids": [1, 2], "prompt": "p1"}, {"ids": [2, 3], "prompt": "p2"}],
        sort_keys=True).encode()).hexdigest()
    assert identity["fingerprint"] == expected
    assert dataset_identity(rows[:3] + [{"prompt": "other"}], sample_rows=3)["fingerprint"] == expected
    rows[2]["prompt"] = "changed"
    assert dataset_identity(rows, sample_rows=3)["fingerprint"] != expected
    streamed = dataset_identity(iter(rows), sample_rows=2)  # no len, no indexing
    assert streamed["size"] is None and streamed["fingerprint_method"] == "sha256 of the first 2 rows as JSON"


# ---------------------------------------------------------------------- software, hardware
def test_package_versions():
    versions = package_versions()
    assert set(versions) == {"trl", "transformers", "peft", "accelerate", "bitsandbytes", "torch", "datasets",
                             "trl-ppo-ext", "python", "torch_cuda"}
    assert versions["trl-ppo-ext"] == trl_ppo_ext.__version__
    assert versions["python"] == platform.python_version()
    assert versions["torch"] == torch.__version__
    assert versions["torch_cuda"] == torch.version.cuda
    import transformers

    assert versions["transformers"] == transformers.__version__


def test_environment_identity_without_and_with_an_accelerator():
    from accelerate.utils import DistributedType

    alone = environment_identity(None)
    assert alone["world_size"] == int(os.environ.get("WORLD_SIZE", 1))
    assert alone["process_index"] == int(os.environ.get("RANK", 0))
    assert alone["device_types"] == (["cuda"] if torch.cuda.is_available() else ["cpu"])
    fake = SimpleNamespace(num_processes=2, process_index=1, local_process_index=1, device=torch.device("cpu"),
                           distributed_type=DistributedType.MULTI_CPU, mixed_precision="no")
    env = environment_identity(fake)
    assert {k: env[k] for k in ("world_size", "process_index", "local_process_index", "device", "distributed_type",
                                "mixed_precision", "device_types")} == {
        "world_size": 2, "process_index": 1, "local_process_index": 1, "device": "cpu",
        "distributed_type": "MULTI_CPU", "mixed_precision": "no", "device_types": ["cpu"],
    }
    assert strict_json(env) == env


# ---------------------------------------------------------------------- JSON conversion
class Color(enum.Enum):
    RED = "red"


@dataclasses.dataclass
class Settings:
    dtype: torch.dtype = torch.float16
    path: Path = Path("/tmp/x")


class HasToDict:
    def to_dict(self):
        return {"temperature": 0.7, "stop": {3}}


def test_to_jsonable_converts_everything_it_meets():
    converted = to_jsonable({
        1: torch.bfloat16, "enum": Color.RED, "path": Path("/a/b"), "set": {"b", "a"}, "tuple": (1, 2),
        "nan": math.nan, "inf": -math.inf, "scalar": torch.tensor(2.5), "small": torch.arange(3),
        "big": torch.zeros(10, 10), "np_int": np.int64(4), "np_arr": np.array([1.5, 2.0]),
        "dataclass": Settings(), "to_dict": HasToDict(), "type": nn.Linear, "device": torch.device("cpu"),
        "shape": torch.Size([2, 3]), "other": object,
    })
    assert converted == {
        "1": "torch.bfloat16", "enum": "red", "path": "/a/b", "set": ["a", "b"], "tuple": [1, 2],
        "nan": "nan", "inf": "-inf", "scalar": 2.5, "small": [0, 1, 2],
        "big": {"shape": [10, 10], "dtype": "torch.float32"}, "np_int": 4, "np_arr": [1.5, 2.0],
        "dataclass": {"dtype": "torch.float16", "path": "/tmp/x"}, "to_dict": {"temperature": 0.7, "stop": [3]},
        "type": "torch.nn.modules.linear.Linear", "device": "cpu", "shape": [2, 3], "other": "builtins.object",
    }
    assert strict_json(converted) == converted


# ---------------------------------------------------------------------- the manifest file
def manifest_for(tokenizer, lm):
    from datasets import Dataset

    return build_manifest(
        models={"policy": model_identity(lm, "policy", shared_with=["value"]),
                "value": model_identity(lm, "value", shared_with=["policy"])},
        tokenizer=tokenizer,
        train_dataset=Dataset.from_dict({"input_ids": [[7], [8, 9]]}),
        eval_dataset=None,
        generation={"temperature": 0.7, "stop_token_id": 3, "response_length": 6},
        hyperparameters={"learning_rate": 3e-6, "output_dir": Path("out"), "bf16": None, "cliprange": 0.2,
                         "whiten": {"advantages"}, "max_grad_norm": math.inf},
        seed=42,
        environment=environment_identity(None),
    )


def test_build_manifest_has_every_field_and_is_strict_json(tokenizer, lm):
    manifest = manifest_for(tokenizer, lm)
    assert set(manifest) == {"format_version", "status", "started_at", "stopped_at", "stop_reason", "seed", "models",
                             "tokenizer", "datasets", "generation", "hyperparameters", "environment", "packages"}
    assert (manifest["status"], manifest["stopped_at"], manifest["stop_reason"]) == ("running", None, None)
    assert datetime.fromisoformat(manifest["started_at"]).utcoffset().total_seconds() == 0
    assert set(manifest["models"]) == {"policy", "value"} and set(manifest["models"]["value"]) == MODEL_KEYS
    assert manifest["datasets"]["train"]["size"] == 2 and manifest["datasets"]["eval"] is None
    assert manifest["tokenizer"]["chat_template_sha256"] is not None
    assert manifest["hyperparameters"] == {"learning_rate": 3e-6, "output_dir": "out", "bf16": None, "cliprange": 0.2,
                                           "whiten": ["advantages"], "max_grad_norm": "inf"}
    assert manifest["seed"] == 42
    assert strict_json(manifest) == manifest


def test_build_manifest_wants_identity_dicts(tokenizer, lm):
    with pytest.raises(TypeError, match=r"models must map role -> model_identity\(...\) dict"):
        build_manifest(models=[lm], tokenizer=tokenizer, train_dataset=None, eval_dataset=None, generation={},
                       hyperparameters={}, seed=0, environment={})


def test_write_is_atomic_and_finish_records_the_stop(tmp_path, tokenizer, lm):
    path = manifest_path(tmp_path)
    assert path == os.path.join(tmp_path, "run_manifest.json")
    manifest = manifest_for(tokenizer, lm)
    write_manifest(path, manifest)
    write_manifest(path, manifest)  # overwriting is atomic too
    assert os.listdir(tmp_path) == ["run_manifest.json"]
    with open(path) as handle:
        assert json.load(handle) == manifest
    reason = "Guard 'kl_range' halted training at update 6: objective/kl=nan outside [...]"
    finished = finish_manifest(path, stop_reason=reason, status="halted")
    with open(path) as handle:
        on_disk = json.load(handle)
    assert on_disk == finished
    assert (on_disk["status"], on_disk["stop_reason"]) == ("halted", reason)
    assert datetime.fromisoformat(on_disk["stopped_at"]) >= datetime.fromisoformat(on_disk["started_at"])
    assert {k: v for k, v in on_disk.items() if k not in ("status", "stop_reason", "stopped_at")} == {
        k: v for k, v in manifest.items() if k not in ("status", "stop_reason", "stopped_at")
    }
    assert os.listdir(tmp_path) == ["run_manifest.json"]


def test_finish_refuses_an_unknown_status_or_a_missing_manifest(tmp_path):
    with pytest.raises(ValueError, match=r"status must be one of \['completed', 'halted', 'failed', 'interrupted', "
                                         r"'preempted'\], got 'done'"):
        finish_manifest(tmp_path / "run_manifest.json", "x", "done")
    with pytest.raises(FileNotFoundError, match="No run manifest at .* Write it with write_manifest"):
        finish_manifest(tmp_path / "run_manifest.json", "x", "completed")
