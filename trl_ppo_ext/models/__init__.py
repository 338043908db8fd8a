"""The models of a PPO run and what is done to them: the shared-backbone actor-critic of one GPU,
the policy + value pair of separate models, loaders, 4-bit quantization, CPU offload and ZeRO's
sharded parameters.

``actor_critic``  ``SharedActorCritic``: LoRA policy + value head on one frozen base;
                  reference = adapter off; optional value adapter
``branch_critic`` the value adapter on the layers above a branch of the policy's pass only
``policy_value``  ``PolicyAndValue``: separate policy and value models; backbone/score reading
``loading``       ``load_actor_critic``, ``load_reward_model``: from a hub id or a folder
``quantization``  nf4 configs, 4-bit models made safe on the CPU
``offload``       frozen models parked on the CPU between uses
``prepare``       what the trainer does to every model it is given (dropout off, head widths)
``sharding``      ZeRO-3 parameters: gather, full copies, the ZeRO stage

The user-facing names are exported from ``trl_ppo_ext`` itself.

Example:

>>> from trl_ppo_ext.models import SharedActorCritic
>>> SharedActorCritic.__name__
'SharedActorCritic'
"""

from .actor_critic import SharedActorCritic, default_lora_config
from .loading import load_actor_critic, load_reward_model
from .policy_value import PolicyAndValue

__all__ = ["PolicyAndValue", "SharedActorCritic", "default_lora_config", "load_actor_critic", "load_reward_model"]
