"""The names a ``PPOConfig`` field chooses among, without the math that implements them: the
config checks a value against these, and importing it loads no tensor code.

``KL_ESTIMATORS``: ``kl_estimator``'s values (``functional.kl_penalty``); ``LOSS_TYPES``: how a
per-token loss is reduced to a scalar, named as TRL's ``GRPOConfig.loss_type`` names them
(``functional.masked_loss_aggregate``); ``OFF_POLICY_CORRECTIONS``: ``off_policy_correction``'s
values (``off_policy.behaviour_weights``); ``SERVER_WEIGHT_SYNCS`` / ``SERVER_WEIGHT_SYNC_CHOICES``:
how weights reach a vLLM server as files / every ``vllm_server_weight_sync`` value
(``generation.server_weights``).

Example:

>>> from trl_ppo_ext.choices import KL_ESTIMATORS, LOSS_TYPES
>>> KL_ESTIMATORS, LOSS_TYPES
(('k1', 'k2', 'k3'), ('dapo', 'grpo', 'dr_grpo'))
"""

KL_ESTIMATORS = ("k1", "k2", "k3")
LOSS_TYPES = ("dapo", "grpo", "dr_grpo")
OFF_POLICY_CORRECTIONS = ("none", "tis", "decoupled")
SERVER_WEIGHT_SYNCS = ("adapter", "files")
SERVER_WEIGHT_SYNC_CHOICES = ("auto", "nccl", *SERVER_WEIGHT_SYNCS)
