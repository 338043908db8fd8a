"""``PPOTrainer.__init__`` never runs ``Trainer.__init__`` (nor TRL's): it sets by hand the
attributes that the ``transformers.Trainer`` methods it inherits read. This pins that set.

The attribute reads are found statically: the source of each inherited method the package
calls (and of every Trainer/TRL method those call on ``self``) is parsed, and each
``self.<name>`` that is not a method or property of the class is an instance attribute the
method needs. A transformers (or TRL) release that reads a new one changes the set and fails
here, in CI, instead of with an ``AttributeError`` in a user's run.
"""

import ast
import inspect
import textwrap
from pathlib import Path

import pytest
import transformers

from trl_ppo_ext import PPOTrainer

PACKAGE = Path(__file__).parents[1] / "trl_ppo_ext"

# Trainer / TRL-base methods the package calls on `self` without overriding them.
ENTRY_POINTS = (
    "add_callback", "create_model_card", "create_optimizer_and_scheduler", "init_hf_repo",
    "is_local_process_zero", "is_world_process_zero", "log", "push_to_hub", "store_flos",
)
# Reached through super() from save_model (ours on our own base, TRL's PPOTrainer's otherwise) and
# from create_optimizer (the critic's learning rate).
EXTRA_FUNCTIONS = (transformers.Trainer.save_model, transformers.Trainer.create_optimizer)

# The instance attributes those methods read (transformers 5.x, TRL 1.0 - 1.16).
PINNED = {
    "_initial_num_input_tokens_seen", "accelerator", "args", "callback_handler", "control", "current_flos",
    "data_collator", "deepspeed", "hub_model_id", "is_deepspeed_enabled", "is_distributed_loading_by_transformers",
    "is_fsdp_enabled", "is_fsdp_xla_v1_enabled", "lr_scheduler", "model", "model_wrapped", "optimizer",
    "optimizer_cls_and_kwargs", "processing_class", "push_in_progress", "state",
}
# Read only behind a guard, or on a path a CPU run never takes: not set on every trainer.
NOT_ALWAYS_SET = {
    "push_in_progress": "read after `hasattr(self, 'push_in_progress')` in Trainer._finish_current_push",
    "deepspeed": "set in PPOTrainer._begin_training under DeepSpeed, read by Trainer.save_model only then",
    "is_fsdp_xla_v1_enabled": "read by Trainer.save_model only on TPU (XLA)",
}


def _is_upstream(owner: type) -> bool:
    return owner.__module__.startswith(("transformers.", "trl."))


def _owner(cls: type, name: str) -> type | None:
    return next((c for c in cls.__mro__ if name in vars(c)), None)


def _function(obj):
    obj = obj.fget if isinstance(obj, property) else obj
    return getattr(obj, "__func__", obj)


def attributes_read(cls: type, names, functions=()) -> dict[str, str]:
    """Instance attributes (``self.<name>`` loads that are not class members) read by the
    methods ``names`` of ``cls`` and ``functions``, following calls into further
    transformers/TRL methods; -> {attribute: first method seen reading it}."""
    todo = [(n, _function(inspect.getattr_static(cls, n))) for n in names]
    todo += [(f.__qualname__, f) for f in functions]
    seen, found = set(), {}
    while todo:
        where, fn = todo.pop()
        if fn in seen:
            continue
        seen.add(fn)
        for node in ast.walk(ast.parse(textwrap.dedent(inspect.getsource(fn)))):
            if not (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self"):
                continue
            owner = _owner(cls, node.attr)
            if owner is None:
                if isinstance(node.ctx, ast.Load):
                    found.setdefault(node.attr, where)
                continue
            member = vars(owner)[node.attr]
            if _is_upstream(owner) and (inspect.isfunction(_function(member)) or isinstance(member, property)):
                todo.append((f"{owner.__name__}.{node.attr}", _function(member)))
    return found


def test_the_set_of_attributes_inherited_methods_read_is_pinned():
    found = attributes_read(PPOTrainer, ENTRY_POINTS, EXTRA_FUNCTIONS)
    new, gone = set(found) - PINNED, PINNED - set(found)
    assert not new and not gone, (
        f"transformers {transformers.__version__} changed what the inherited Trainer methods read. "
        f"New: {sorted((a, found[a]) for a in new)} -> set them by hand in PPOTrainer (as "
        f"`_setup_callbacks_and_state` does) and add them to PINNED; no longer read: {sorted(gone)}."
    )


def test_every_pinned_attribute_is_set_on_a_new_trainer(make_trainer):
    trainer = make_trainer()
    missing = sorted(a for a in PINNED - set(NOT_ALWAYS_SET) if not hasattr(trainer, a))
    assert missing == [], f"read by inherited Trainer methods but not set by PPOTrainer.__init__: {missing}"


def _self_calls(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    calls = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            target = node.func.value
            if isinstance(target, ast.Name) and target.id == "self":
                calls.add(node.func.attr)
    return calls


@pytest.mark.parametrize("module", ["trainer.py", "run/checkpointing.py", "run/manifest.py", "_base.py"])
def test_entry_points_cover_every_inherited_method_the_package_calls(module):
    calls = _self_calls(PACKAGE / module)
    inherited = {c for c in calls if (o := _owner(PPOTrainer, c)) is not None and _is_upstream(o)
                 and inspect.isfunction(_function(vars(o)[c]))}
    # methods TRL's PPO trainer defines that ours overrides are not inherited; anything else is
    unknown = inherited - set(ENTRY_POINTS) - {"save_model"}
    assert not unknown, f"{module} calls inherited {sorted(unknown)}: add to ENTRY_POINTS (and re-pin PINNED)"


def test_not_always_set_names_only_pinned_attributes():
    assert set(NOT_ALWAYS_SET) <= PINNED
