"""What this framework does with each verl config key it does not hold under the same name (data, no logic).

Keys are canonical: verl's ``actor_rollout_ref.{actor,rollout,ref,model}.X`` is written ``{actor,rollout,ref,model}.X``
(`jaxrl_hf.config.verl_keys.KEY_ALIASES`). An entry ending in ``.`` or ``_`` is a prefix: it covers every key under it
that has no entry of its own (the longest entry wins). `jaxrl_hf.config.verl_keys.classify_key` reads them:

* `RENAMED`: verl key -> this schema's key, same value.
* `CONVERTED`: verl key -> (schema key, how the value is converted); ``None`` from the converter means "verl's
  value for *unset*: nothing to apply".
* `IGNORED`: verl key -> why it is accepted with no effect here (printed by ``--dry-run``, logged in a run).
* `UNSUPPORTED`: verl key -> (why it is an error, the values that are this framework's own behaviour and so are
  accepted with no effect). A key that would change the algorithm and is not implemented is here, never in
  `IGNORED`.
* `VALUE_ALTERNATIVES`: schema key -> {a value verl accepts there and this framework does not: what to use
  instead}, added to the error that refuses the value.
"""

from __future__ import annotations

from typing import Any, Callable

RENAMED: dict[str, str] = {
    "actor.ppo_micro_batch_size_per_gpu": "actor.ppo_micro_batch_size_per_device",
    "critic.ppo_micro_batch_size_per_gpu": "critic.ppo_micro_batch_size_per_device",
    "rollout.log_prob_micro_batch_size_per_gpu": "actor.log_prob_micro_batch_size_per_device",
    "reward_model.micro_batch_size_per_gpu": "reward_model.micro_batch_size_per_device",
    "reward_model.model.path": "reward_model.path",
    "actor.fsdp_config.optimizer_offload": "actor.offload_optimizer",
    "actor.megatron.optimizer_offload": "actor.offload_optimizer",
    "rollout.tensor_model_parallel_size": "placement.generate.tp",
    "actor.megatron.override_transformer_config.moe_aux_loss_coeff": "actor.router_aux_loss_coef",
    "actor.megatron.override_transformer_config.moe_z_loss_coeff": "actor.router_z_loss_coef",
    "actor.megatron.tensor_model_parallel_size": "placement.train.tp",
    "actor.megatron.pipeline_model_parallel_size": "placement.train.pp",
    "actor.optim.clip_grad": "actor.grad_clip",
    "critic.optim.clip_grad": "critic.grad_clip",
    "actor.optim.warmup_style": "actor.optim.lr_scheduler",
    "actor.optim.lr_decay_style": "actor.optim.lr_scheduler",
    "actor.optim.lr_scheduler_type": "actor.optim.lr_scheduler",
    "critic.optim.warmup_style": "critic.optim.lr_scheduler",
    "critic.optim.lr_scheduler_type": "critic.optim.lr_scheduler",
    "rollout.val_kwargs.n": "rollout.val.n",
    "rollout.val_kwargs.temperature": "rollout.val.temperature",
    "rollout.val_kwargs.top_p": "rollout.val.top_p",
    "model.lora.rank": "model.lora_rank",
    "model.lora.alpha": "model.lora_alpha",
    "model.lora.target_modules": "model.target_modules",
    "trainer.max_actor_ckpt_to_keep": "trainer.max_ckpt_to_keep",
    "algorithm.rollout_correction.rollout_is": "actor.rollout_correction.level",
    "algorithm.rollout_correction.rollout_is_threshold": "actor.rollout_correction.threshold",
    "algorithm.rollout_correction.bypass_mode": "actor.rollout_correction.bypass_mode",
    "reward_model.reward_kwargs.overlong_buffer_cfg.": "reward_model.overlong_buffer.",
    "custom_reward_function.overlong_buffer.": "reward_model.overlong_buffer.",
}


def _negated(value: Any) -> Any:
    """``do_sample`` -> ``greedy``: the opposite bool (a non-bool is passed on for the schema to reject)."""
    return (not value) if isinstance(value, bool) else value


def _unless_negative(value: Any) -> Any:
    """verl's ``lr_warmup_steps`` < 0 means "use ``lr_warmup_steps_ratio``": nothing to set."""
    return None if isinstance(value, (int, float)) and not isinstance(value, bool) and value < 0 else value


def _token_level(value: Any) -> Any:
    """verl's old ``use_token_level_loss``: true is ``loss_agg_mode=token-mean``, false ``seq-mean-token-mean``."""
    return {True: "token-mean", False: "seq-mean-token-mean"}.get(value, value) if isinstance(value, bool) else value


CONVERTED: dict[str, tuple[str, Callable[[Any], Any]]] = {
    "actor.use_token_level_loss": ("actor.loss_agg_mode", _token_level),
    "rollout.val_kwargs.do_sample": ("rollout.val.greedy", _negated),
    "actor.optim.lr_warmup_steps": ("actor.optim.warmup_steps", _unless_negative),
    "critic.optim.lr_warmup_steps": ("critic.optim.warmup_steps", _unless_negative),
}

_FSDP = "verl's FSDP wrapper option; sharding here is actor.strategy (fsdp / megatron rule sets) over placement.train"
_MEGATRON_FUSION = "Megatron kernel fusion option; the JAX model is compiled and fused by XLA"
_PROFILER = "verl's profiler option; not used here (timings: launch/bench, the perf/* metrics)"
_ONE_MESH = "the reference runs on the actor's mesh (placement.train, actor.strategy)"

IGNORED: dict[str, str] = {
    "data.return_raw_chat": "rows keep their chat messages ('prompt'); the chat template is applied here when needed",
    "data.trust_remote_code": "no remote code runs here (tokenizers load with transformers' own classes)",
    "data.dataloader_num_workers": "prompts are read in the driver", "data.filter_overlong_prompts_workers":
    "prompts are filtered in the driver",
    "data.image_key": "text-only: an image column is not read (vision-language models are not supported)",
    "model.trust_remote_code": "models run on this framework's JAX implementation; no remote code runs",
    "critic.model.trust_remote_code": "models run on this framework's JAX implementation; no remote code runs",
    "model.use_shm": "loading detail of verl's workers", "model.external_lib": "loading detail of verl's workers",
    "model.use_fused_kernels": "verl's fused torch kernels; the JAX model is compiled by XLA",
    "model.fused_kernel_options.": "verl's fused torch kernels; the JAX model is compiled by XLA",
    "model.lora.lora_A_init_method": "LoRA A starts as peft's default here (jaxrl_hf.models.lora)",
    "actor.fsdp_config.param_offload": "parameters stay on the devices (the optimizer state can move: "
    "actor.offload_optimizer)",
    "actor.fsdp_config.model_dtype": "parameters are kept in float32; the compute dtype is model.dtype",
    "actor.fsdp_config.mixed_precision.": "the compute dtype is model.dtype; gradients are reduced in float32",
    "actor.fsdp_config.": _FSDP, "ref.fsdp_config.": _FSDP, "critic.model.fsdp_config.": _FSDP,
    "reward_model.model.fsdp_config.": _FSDP, "critic.fsdp_config.": _FSDP,
    "reward_model.model.use_remove_padding": "the reward model scores padded rows",
    "actor.megatron.param_offload": "parameters stay on the devices", "actor.megatron.grad_offload":
    "gradients stay on the devices",
    "actor.megatron.dtype": "the compute dtype is model.dtype",
    "actor.megatron.use_remove_padding": "packing is model.use_remove_padding",
    "actor.megatron.use_dist_checkpointing": "weights load from model.path (HF safetensors)",
    "actor.megatron.dist_checkpointing_path": "weights load from model.path (HF safetensors)",
    "actor.megatron.use_mbridge": "weights load from model.path (HF safetensors)",
    "actor.megatron.vanilla_mbridge": "weights load from model.path (HF safetensors)",
    "actor.megatron.seed": "the seed is trainer.seed",
    "actor.megatron.override_transformer_config.": _MEGATRON_FUSION,
    "actor.megatron.override_transformer_config.recompute_granularity": "recomputation is model.remat / "
    "model.enable_gradient_checkpointing",
    "actor.megatron.override_transformer_config.recompute_method": "recomputation is model.remat",
    "actor.megatron.override_transformer_config.recompute_num_layers": "recomputation is model.remat",
    "actor.megatron.override_transformer_config.recompute_modules": "recomputation is model.remat",
    "actor.megatron.override_transformer_config.attention_backend": "attention is model.attn_implementation",
    "actor.megatron.override_transformer_config.use_flash_attn": "attention is model.attn_implementation",
    "actor.megatron.override_transformer_config.num_layers_in_first_pipeline_stage": "pipeline stages hold equal "
    "numbers of layers",
    "actor.megatron.override_transformer_config.num_layers_in_last_pipeline_stage": "pipeline stages hold equal "
    "numbers of layers",
    "ref.megatron.": _ONE_MESH, "ref.strategy": _ONE_MESH, "ref.fsdp_config.param_offload": _ONE_MESH,
    "critic.megatron.": "the critic's parallel sizes follow placement (placement.train when colocated)",
    "actor.optim.override_optimizer_config.": "Megatron optimizer option; optimizer-state offload is "
    "actor.offload_optimizer",
    "actor.checkpoint.": "checkpoints hold params, optimizer state and data position (trainer.save_freq)",
    "critic.checkpoint.": "checkpoints hold params, optimizer state and data position (trainer.save_freq)",
    "actor.profiler.": _PROFILER, "ref.profiler.": _PROFILER, "critic.profiler.": _PROFILER,
    "rollout.profiler.": _PROFILER, "global_profiler.": _PROFILER,
    "actor.use_torch_compile": "the JAX model is compiled by XLA", "ref.use_torch_compile":
    "the JAX model is compiled by XLA",
    "actor.entropy_checkpointing": "memory option of verl's entropy computation",
    "actor.entropy_from_logits_with_chunking": "memory option of verl's entropy computation",
    "ref.entropy_checkpointing": "memory option of verl's entropy computation",
    "ref.entropy_from_logits_with_chunking": "memory option of verl's entropy computation",
    "actor.freeze_vision_tower": "text-only models (no vision tower)",
    "ref.log_prob_micro_batch_size_per_gpu": "the reference forward uses the actor's log-prob micro-batch "
    "(actor.log_prob_micro_batch_size_per_device, verl's rollout.log_prob_micro_batch_size_per_gpu)",
    "actor_rollout_ref.nccl_timeout": "worker calls time out after trainer.worker_timeout_s",
    "rollout.calculate_log_probs": "the sampler's log-probs are always kept (rollout_log_probs)",
    "rollout.checkpoint_engine.": "weight sync to the rollout engine is this framework's own",
    "rollout.data_parallel_size": "the generation data parallelism is derived: devices / (placement.generate pp·tp)",
    "rollout.enable_chunked_prefill": "vLLM scheduling option of verl's server",
    "rollout.max_num_batched_tokens": "vLLM scheduling option of verl's server",
    "rollout.free_cache_engine": "vLLM's KV cache is freed by rollout.enable_sleep_mode",
    "rollout.load_format": "weights reach the engine from the actor (weight sync)",
    "rollout.layered_summon": "weights reach the engine from the actor (weight sync)",
    "rollout.multi_stage_wake_up": "vLLM wake-up order is this framework's own (rollout.sleep_level)",
    "rollout.mode": "verl's sync/async server mode; asynchronous training here is trainer.max_staleness",
    "rollout.engine_kwargs.": "engine options of verl's vLLM / SGLang / TensorRT-LLM servers",
    "rollout.agent.": "agent loop workers of verl's server mode; loops here: rollout.loop",
    "trainer.max_critic_ckpt_to_keep": "one checkpoint per step holds actor and critic: "
    "trainer.max_ckpt_to_keep (verl's max_actor_ckpt_to_keep) applies to both",
    "trainer.dump_high_diff_dir": "verl debugging dump", "trainer.dump_high_diff_tokens": "verl debugging dump",
    "trainer.use_legacy_worker_impl": "verl worker implementation switch",
    "trainer.ray_wait_register_center_timeout": "Ray start is bounded by trainer.ray_init_timeout_s",
    "ray_init.": "Ray is started by jaxrl_hf (trainer.ray_init_timeout_s; RAY_ADDRESS joins a cluster)",
    "ray_kwargs.": "Ray is started by jaxrl_hf (trainer.ray_init_timeout_s; RAY_ADDRESS joins a cluster)",
    "reward_model.use_reward_loop": "rewards are scored by the driver's reward manager (reward_model.num_workers)",
    "reward_model.reward_kwargs.max_resp_len": "the overlong buffer counts from data.max_response_length",
    "reward_model.sandbox_fusion.": "used only by reward_model.sandbox_fusion.url, which is not supported (an "
    "error when set)",
    "data.custom_cls.name": "used only by data.custom_cls.path, which is not supported (an error when set)",
    "algorithm.pf_ppo.": "used only by algorithm.use_pf_ppo, which is not supported (an error when true)",
    "algorithm.rollout_correction.rollout_rs_threshold": "used only by algorithm.rollout_correction.rollout_rs, "
    "which is not supported (an error when set)",
    "algorithm.rollout_correction.rollout_rs_threshold_lower": "used only by algorithm.rollout_correction.rollout_rs, "
    "which is not supported (an error when set)",
}

_MOE = ("Megatron's expert-parallel groups and other MoE options are not supported here; a qwen3_moe policy splits "
        "its experts over the tensor-parallel devices with actor.strategy=fsdp_tp_ep (EP size = placement.train.tp; "
        "fsdp_tp splits each expert over them instead)")
_NONE = (None, "null", "None", "none", "~")

UNSUPPORTED: dict[str, tuple[str, tuple[Any, ...]]] = {
    "actor.ppo_micro_batch_size": ("verl's deprecated global micro-batch size; use "
                                   "actor.ppo_micro_batch_size_per_device (verl's ppo_micro_batch_size_per_gpu) "
                                   "instead", _NONE),
    "rollout.log_prob_micro_batch_size": ("verl's deprecated global micro-batch size; use "
                                          "actor.log_prob_micro_batch_size_per_device instead", _NONE),
    "ref.log_prob_micro_batch_size": ("verl's deprecated global micro-batch size; use "
                                      "actor.log_prob_micro_batch_size_per_device instead", _NONE),
    "critic.ppo_micro_batch_size": ("verl's deprecated global micro-batch size; use "
                                    "critic.ppo_micro_batch_size_per_device instead", _NONE),
    "data.prompt_key": ("rows hold their prompt in the 'prompt' column (verl's default); rename the column",
                        ("prompt",)),
    "data.truncation": ("prompts are never truncated here: over-long ones are dropped with "
                        "data.filter_overlong_prompts=true or raise an error (verl's 'error'); raise "
                        "data.max_prompt_length instead", ("error",)),
    "data.custom_cls.path": ("custom dataset classes are not supported: rows follow verl's parquet/jsonl schema "
                         "(jaxrl_hf.data)", _NONE),
    "data.apply_chat_template_kwargs.": ("extra chat-template arguments are not passed to the template", _NONE),
    "model.override_config.attention_dropout": ("the models here have no dropout", (0, 0.0)),
    "model.override_config.embd_pdrop": ("the models here have no dropout", (0, 0.0)),
    "model.override_config.resid_pdrop": ("the models here have no dropout", (0, 0.0)),
    "model.override_config.": ("model config overrides are not applied: the model is model.path's config.json", ()),
    "model.exclude_modules": ("LoRA module exclusion is not supported; list the modules that get adapters in "
                              "model.target_modules instead", _NONE),
    "model.lora_adapter_path": ("starting from a saved LoRA adapter is not supported (adapters start fresh)", _NONE),
    "actor.fsdp_config.fsdp_size": ("hybrid sharding (FSDP groups smaller than all devices) is not supported: "
                                    "actor.strategy=fsdp shards over placement.train.dp", (-1,)),
    "actor.megatron.context_parallel_size": ("context parallelism is not supported; use "
                                             "actor.ulysses_sequence_parallel_size instead", (1,)),
    "actor.megatron.virtual_pipeline_model_parallel_size": ("interleaved (virtual) pipeline stages are not "
                                                            "supported", _NONE + (1,)),
    "actor.megatron.expert_model_parallel_size": (_MOE, (1,)),
    "actor.megatron.expert_tensor_parallel_size": (_MOE, _NONE + (1,)),
    "rollout.expert_parallel_size": (_MOE, (1,)),
    "actor.megatron.override_transformer_config.moe_": (_MOE, ()),
    "actor.megatron.override_transformer_config.fp8": ("FP8 training is not supported", _NONE + (False,)),
    "actor.megatron.override_transformer_config.fp8_recipe": ("FP8 training is not supported", _NONE),
    "actor.optim.override_optimizer_config.fp8_recipe": ("FP8 training is not supported", _NONE),
    "rollout.quantization": ("quantized (FP8) rollout is not supported", _NONE),
    "rollout.do_sample": ("training rollouts always sample (rollout.temperature, top_p, top_k)", (True,)),
    "rollout.ignore_eos": ("generation always stops at the model's stop tokens", (False,)),
    "rollout.val_kwargs.top_k": ("validation samples without top-k here (rollout.val: n, temperature, top_p, greedy)",
                                 _NONE + (-1, 0)),
    "actor_rollout_ref.hybrid_engine": ("the actor always holds the rollout engine (hybrid engine); a rollout "
                                        "group of its own is placement.rollout.colocate=false", (True,)),
    "algorithm.use_pf_ppo": ("PF-PPO's reweighting of the batch is not implemented", (False,)),
    "algorithm.rollout_correction.rollout_rs": ("rollout rejection sampling is not implemented (truncated importance "
                                                "sampling is: algorithm.rollout_correction.rollout_is)", _NONE),
    "algorithm.rollout_correction.rollout_token_veto_threshold": ("the token veto of rollout correction is not "
                                                                  "implemented", _NONE),
    "algorithm.rollout_correction.rollout_is_batch_normalize": ("batch-normalised importance weights are not "
                                                                "implemented", (False,)),
    "algorithm.rollout_correction.loss_type": ("bypass mode here uses the PPO-clip loss", ("ppo_clip",)),
    "reward_model.rollout.": ("a generative reward model served by a rollout engine is not supported "
                              "(reward_model.path: a value-head reward model)", _NONE),
    "reward_model.sandbox_fusion.url": ("verl's Sandbox Fusion code scorer is not supported; score with "
                                     "custom_reward_function instead", _NONE),
    "reward_model.strategy": ("reward models run on this framework's JAX implementation", ("fsdp", "fsdp2")),
}

VALUE_ALTERNATIVES: dict[str, dict[Any, str]] = {
    "rollout.name": {
        "sglang": "use rollout.name=vllm instead: the same sampling keys (rollout.temperature, top_p, top_k, n, "
                  "response_length, gpu_memory_utilization, tensor_model_parallel_size) apply, or rollout.name=jax "
                  "(the native JAX engine, no extra package)",
        "hf": "use rollout.name=jax instead: the native JAX engine generates from the actor's own weights, as verl's "
              "hf engine does, with the same sampling keys",
    },
}
