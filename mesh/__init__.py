"""Named device meshes, logical-axis sharding rules and the 3D-HybridEngine reshard.

Modules, one concern each:
  topology           p-t-d / p_g-t_g layouts, rank <-> group arithmetic (HybridFlow §2.5.1, §2.5.3)
  device_mesh        jax Meshes for the training and generation layouts over the same devices
  rule_sets          named logical-axis rule sets as data (megatron, fsdp, fsdp_tp and their sequence-parallel
                     variants sp, fsdp_sp, fsdp_tp_sp), their registry
  rules              the one resolver: logical-axis rules -> PartitionSpec / NamedSharding trees
  synthetic          Llama-like synthetic param trees + logical axes (tests, benchmark)
  hybrid_engine      to_generation / to_training, and the HybridFlow-V and DS-Chat baselines
  chunked_reshard    the low-peak schedule of the reshard: leaf by leaf, layer group by layer group
  hlo_collectives    collectives + per-device bytes parsed from compiled HLO text
  transition_report  compiled-program traffic / peak memory, and timing of a transition
"""

from jaxrl_hf.mesh.chunked_reshard import DEFAULT_LAYERS_PER_GROUP, ChunkedReshard
from jaxrl_hf.mesh.device_mesh import (TRAIN_AXES, TRAIN_SP_AXES, HybridMeshes, build_hybrid_meshes,
                                       build_train_mesh, build_vanilla_generation_mesh, flat_device_ids,
                                       ordered_devices, train_mesh_axes)
from jaxrl_hf.mesh.hlo_collectives import Collective, CollectiveSummary, parse_collectives, summarize
from jaxrl_hf.mesh.hybrid_engine import (METHODS, DeepSpeedChatTransition, HybridEngine, VanillaTransition,
                                         delete_tree, make_transition, shard_bytes_per_device)
from jaxrl_hf.mesh.rule_sets import (MEGATRON, RULE_SETS, RuleSet, get_rule_set, register_rule_set,
                                     rule_set_for_strategy)
from jaxrl_hf.mesh.rules import (Rules, generation_activation_rules, generation_param_rules, logical_to_shardings,
                                 logical_to_spec, logical_to_specs, optimizer_state_shardings, train_activation_rules,
                                 train_param_rules)
from jaxrl_hf.mesh.synthetic import (LLAMA_SHAPES, LlamaShape, init_params, llama_logical_axes, llama_param_shapes,
                                     llama_shape, param_bytes, param_count)
from jaxrl_hf.mesh.topology import (GenParallel, TrainParallel, generation_coords, generation_tp_groups,
                                    micro_dp_groups, parse_config, train_coords, training_model_parallel_groups)
from jaxrl_hf.mesh.transition_report import (TransitionAnalysis, analyze_transition, live_bytes_per_device,
                                             time_transition, tree_bytes_per_device)

__all__ = [
    "DEFAULT_LAYERS_PER_GROUP", "ChunkedReshard",
    "TRAIN_AXES", "TRAIN_SP_AXES", "train_mesh_axes", "HybridMeshes", "build_hybrid_meshes", "build_train_mesh",
    "build_vanilla_generation_mesh", "flat_device_ids", "ordered_devices", "Collective", "CollectiveSummary",
    "parse_collectives", "summarize",
    "METHODS", "DeepSpeedChatTransition", "HybridEngine", "VanillaTransition", "delete_tree", "make_transition",
    "shard_bytes_per_device", "MEGATRON", "RULE_SETS", "RuleSet", "get_rule_set", "register_rule_set",
    "rule_set_for_strategy", "Rules", "generation_activation_rules", "generation_param_rules",
    "logical_to_shardings", "logical_to_spec", "logical_to_specs", "optimizer_state_shardings",
    "train_activation_rules", "train_param_rules", "LLAMA_SHAPES", "LlamaShape", "init_params",
    "llama_logical_axes", "llama_param_shapes", "llama_shape", "param_bytes", "param_count", "GenParallel",
    "TrainParallel", "generation_coords", "generation_tp_groups", "micro_dp_groups", "parse_config",
    "train_coords", "training_model_parallel_groups", "TransitionAnalysis", "analyze_transition",
    "live_bytes_per_device", "time_transition", "tree_bytes_per_device",
]
