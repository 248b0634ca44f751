"""Cross-field checks of a resolved ``RunConfig``: batch arithmetic, ranges, and what each algorithm needs.

Each failure raises ``ConfigError`` naming the key(s) involved and the rule, e.g.::

    config key 'actor.ppo_mini_batch_size'=3: data.train_batch_size=8 must be a multiple of it
"""

from __future__ import annotations

import importlib.util
import os

from jaxrl_hf.config.build import ConfigError
from jaxrl_hf.config.memory_budget import check_memory_budget
from jaxrl_hf.config.registered import check_registered_names
from jaxrl_hf.config.schema import RunConfig
from jaxrl_hf.config.validate_paths import BUILTIN_DATASETS, check_paths as check_existing_paths  # noqa: F401
from jaxrl_hf.models.hf_export import parse_shard_size

KNOWN_LOGGERS = ("console", "jsonl", "tensorboard", "wandb")


def _fail(key: str, value: object, rule: str) -> None:
    raise ConfigError(f"config key '{key}'={value!r}: {rule}")


def _positive(key: str, value: float | int) -> None:
    if not value > 0:
        _fail(key, value, "must be > 0")


def train_dp_size(config: RunConfig) -> int:
    """Data-parallel size of actor training: ``placement.train.dp``."""
    return config.placement.train.dp


def check_placement(config: RunConfig) -> None:
    """Parallel sizes must tile the devices of the actor pool."""
    p = config.placement
    _positive("placement.num_processes", p.num_processes)
    _positive("placement.devices_per_process", p.devices_per_process)
    devices = p.num_processes * p.devices_per_process
    for name, size in (("pp", p.train.pp), ("tp", p.train.tp), ("dp", p.train.dp)):
        _positive(f"placement.train.{name}", size)
    if p.train.pp * p.train.tp * p.train.dp != devices:
        raise ConfigError(
            f"config keys 'placement.train.{{pp,tp,dp}}'=({p.train.pp},{p.train.tp},{p.train.dp}): pp*tp*dp="
            f"{p.train.pp * p.train.tp * p.train.dp} must equal the actor pool's devices placement.num_processes"
            f"*placement.devices_per_process={devices}"
        )
    vllm_tp = rollout_tensor_parallel(config)
    for name, size, train_size in (("pp", p.generate.pp, p.train.pp), ("tp", p.generate.tp, p.train.tp)):
        if size is None:  # same as training
            continue
        _positive(f"placement.generate.{name}", size)
        if name == "tp" and config.rollout.name == "vllm":
            continue  # vLLM's own TP layout, fed shard-wise from any training layout (checked below)
        if train_size % size:
            valid = [k for k in range(1, train_size + 1) if train_size % k == 0]
            _fail(f"placement.generate.{name}", size,
                  f"must divide placement.train.{name}={train_size} (3D-HybridEngine); valid: {valid}")
    nodes = config.trainer.nnodes or 1
    if vllm_tp > 1 and (p.num_processes % (vllm_tp * nodes) or p.devices_per_process != 1):
        _fail("placement.generate.tp", vllm_tp,
              f"with rollout.name=vllm each of the actor's processes hosts one vLLM TP rank and a TP group is {vllm_tp} "
              f"processes of one node: needs placement.devices_per_process=1 and placement.num_processes a multiple of "
              f"{vllm_tp} on each of the trainer.nnodes={nodes} node(s) (got {p.num_processes} process(es) x "
              f"{p.devices_per_process} device(s))")


def rollout_tensor_parallel(config: RunConfig) -> int:
    """vLLM's TP size for ``rollout.name=vllm`` (1 for the native engine): ``placement.generate.tp`` (verl's
    ``rollout.tensor_model_parallel_size``), else the vLLM option ``rollout.tensor_parallel_size``, else 1. The two
    spellings must agree where both are set."""
    if config.rollout.name != "vllm":
        return 1
    generate, option = config.placement.generate.tp, config.rollout.tensor_parallel_size
    if generate is not None and option is not None and int(generate) != int(option):
        _fail("rollout.tensor_parallel_size", option, f"disagrees with placement.generate.tp={generate} "
              "(rollout.tensor_model_parallel_size); both name vLLM's TP size: set one")
    value = generate if generate is not None else option
    if value is None:
        return 1
    _positive("placement.generate.tp" if generate is not None else "rollout.tensor_parallel_size", value)
    return int(value)


def check_sequence_parallel(config: RunConfig) -> None:
    """Ulysses sizes (``<role>.ulysses_sequence_parallel_size``): integers >= 1 dividing ``placement.train.dp``
    (the sp groups are taken out of the data-parallel devices); the reference's equals the actor's (one mesh)."""
    dp, actor_sp = config.placement.train.dp, config.actor.ulysses_sequence_parallel_size
    roles = [("actor", actor_sp), ("ref", config.ref.ulysses_sequence_parallel_size)]
    if config.critic.enable:
        roles.append(("critic", config.critic.ulysses_sequence_parallel_size))
    for role, sp in roles:
        key = f"{role}.ulysses_sequence_parallel_size"
        if isinstance(sp, bool) or not isinstance(sp, int) or sp < 1:
            _fail(key, sp, "must be an integer >= 1 (1: no sequence parallelism)")
        if dp % sp:
            valid = [k for k in range(1, dp + 1) if dp % k == 0]
            _fail(key, sp, f"must divide placement.train.dp={dp}: each group of sp data-parallel devices shares rows, "
                           f"each holding 1/sp of the sequence; valid: {valid}")
    if config.ref.ulysses_sequence_parallel_size != actor_sp:
        _fail("ref.ulysses_sequence_parallel_size", config.ref.ulysses_sequence_parallel_size,
              f"the reference runs on the actor's mesh: must equal actor.ulysses_sequence_parallel_size={actor_sp} "
              "(or be left unset)")


def check_batch_arithmetic(config: RunConfig) -> None:
    """train_batch_size·n sequences split into mini-batches, mini-batches into dp shards of micro-batches (with
    sequence parallelism the rows split over the ``dp/sp`` groups: verl's meaning of the per-device sizes)."""
    d, n, dp = config.data, config.rollout.n, train_dp_size(config)
    _positive("data.train_batch_size", d.train_batch_size)
    _positive("rollout.n", n)
    roles = [("actor", config.actor.ppo_mini_batch_size, config.actor.ppo_micro_batch_size_per_device,
              config.actor.ulysses_sequence_parallel_size, config.actor.use_dynamic_bsz)]
    if config.critic.enable:
        roles.append(("critic", config.critic.ppo_mini_batch_size, config.critic.ppo_micro_batch_size_per_device,
                      config.critic.ulysses_sequence_parallel_size, config.critic.use_dynamic_bsz))
    for role, mini, micro, sp, by_tokens in roles:
        _positive(f"{role}.ppo_mini_batch_size", mini)
        _positive(f"{role}.ppo_micro_batch_size_per_device", micro)
        if d.train_batch_size % mini:
            _fail(f"{role}.ppo_mini_batch_size", mini,
                  f"data.train_batch_size={d.train_batch_size} (prompts) must be a multiple of it")
        sequences, groups = mini * n, dp // sp
        over = f"placement.train.dp={dp}" if sp == 1 else \
            f"placement.train.dp/{role}.ulysses_sequence_parallel_size = {dp}/{sp} = {groups} sequence-parallel groups"
        if sequences % groups:
            _fail(f"{role}.ppo_mini_batch_size", mini,
                  f"a mini-batch of {mini} prompts x rollout.n={n} = {sequences} sequences must split evenly over "
                  f"{over}")
        per_rank = sequences // groups
        if per_rank % micro and not by_tokens:  # use_dynamic_bsz: micro-batches by tokens, the row count unused
            _fail(f"{role}.ppo_micro_batch_size_per_device", micro,
                  f"must divide the {per_rank} sequences per dp rank of a mini-batch "
                  f"({role}.ppo_mini_batch_size={mini} x rollout.n={n} / {over})")
    if (d.train_batch_size * n) % dp:
        _fail("data.train_batch_size", d.train_batch_size,
              f"train_batch_size x rollout.n={n} must be a multiple of placement.train.dp={dp}")
    _positive("data.gen_batch_size", d.gen_batch_size or 0)


def check_micro_batching(config: RunConfig) -> None:
    """``use_dynamic_bsz`` passes need a token budget that holds the longest row (verl's keys)."""
    a, r, c = config.actor, config.rollout, config.critic
    passes = [("actor.use_dynamic_bsz", a.use_dynamic_bsz, "actor.ppo_max_token_len_per_gpu",
               a.ppo_max_token_len_per_gpu),
              ("rollout.log_prob_use_dynamic_bsz", r.log_prob_use_dynamic_bsz, "rollout.log_prob_max_token_len_per_gpu",
               r.log_prob_max_token_len_per_gpu),
              ("ref.log_prob_use_dynamic_bsz", config.ref.log_prob_use_dynamic_bsz,
               "ref.log_prob_max_token_len_per_gpu", config.ref.log_prob_max_token_len_per_gpu)]
    if c.enable:
        passes += [("critic.use_dynamic_bsz", c.use_dynamic_bsz, key, getattr(c, key.split(".")[1]))
                   for key in ("critic.ppo_max_token_len_per_gpu", "critic.forward_max_token_len_per_gpu")]
    packed = [m for m in (config.model, c.model) if m is not None and m.use_remove_padding]
    if packed and a.ulysses_sequence_parallel_size > 1:
        _fail("actor.ulysses_sequence_parallel_size", a.ulysses_sequence_parallel_size,
              "model.use_remove_padding=True with Ulysses sequence parallelism is not supported yet (the packed "
              "sequence is not split over sp): use one of the two")
    row = r.max_prompt_length + r.response_length
    for switch, on, key, budget in passes:
        if not on:
            continue
        if budget is None:
            _fail(key, budget, f"{switch}=True forms micro-batches by a token budget: set {key} (valid tokens per "
                               f"device per micro-batch, >= one row of {row})")
        if budget < row:
            _fail(key, budget, f"smaller than one row: rollout.max_prompt_length + rollout.response_length = {row} "
                               f"tokens must fit ({switch}=True)")


def check_algorithm(config: RunConfig) -> None:
    """What each estimator (its registered ``needs``) / algorithm needs."""
    from jaxrl_hf.algos.advantages import adv_estimator_needs

    alg, n = config.algorithm, config.rollout.n
    needs = adv_estimator_needs(alg.adv_estimator)
    if "index" in needs and n < 2:
        _fail("rollout.n", n, f"algorithm.adv_estimator={alg.adv_estimator!r} compares samples of a prompt; need n >= 2")
    if alg.filter_groups.enable and n < 2:
        _fail("rollout.n", n, "algorithm.filter_groups.enable (dynamic sampling) needs n >= 2 samples per prompt")
    if "values" in needs and not config.critic.enable:
        _fail("critic.enable", config.critic.enable, f"algorithm.adv_estimator={alg.adv_estimator!r} needs a critic")
    if "reward_baselines" in needs and config.algo != "remax":
        _fail("algorithm.adv_estimator", alg.adv_estimator,
              "needs reward_baselines, the greedy rollout's reward that only --algo remax computes")
    if config.algo == "ppo" and "values" not in needs:
        _fail("algorithm.adv_estimator", alg.adv_estimator,
              "--algo ppo uses GAE with a critic; set 'gae' (or an estimator registered with needs=('values',))")
    if config.algo == "remax" and "reward_baselines" not in needs:
        _fail("algorithm.adv_estimator", alg.adv_estimator,
              "--algo remax needs the 'remax' estimator (or one registered with needs=('reward_baselines',))")
    if config.algo == "safe_rlhf":
        if not config.cost_model.enable:
            _fail("cost_model.enable", config.cost_model.enable, "--algo safe_rlhf needs a cost model")
        if "values" not in needs or not config.critic.enable:
            _fail("algorithm.adv_estimator", alg.adv_estimator, "--algo safe_rlhf uses GAE with reward and cost critics")
    if config.actor.ptx_coef > 0 and not config.data.ptx_files:
        _fail("data.ptx_files", config.data.ptx_files, f"actor.ptx_coef={config.actor.ptx_coef} needs pre-training texts")
    if alg.kl_ctrl.kl_coef < 0:
        _fail("algorithm.kl_ctrl.kl_coef", alg.kl_ctrl.kl_coef, "must be >= 0")
    if alg.kl_ctrl.type == "adaptive":
        _positive("algorithm.kl_ctrl.horizon", alg.kl_ctrl.horizon)
        _positive("algorithm.kl_ctrl.target_kl", alg.kl_ctrl.target_kl)
    if not 0 <= alg.gamma <= 1:
        _fail("algorithm.gamma", alg.gamma, "must be in [0, 1]")
    if not 0 <= alg.lam <= 1:
        _fail("algorithm.lam", alg.lam, "must be in [0, 1]")


def check_actor(config: RunConfig) -> None:
    """Loss, optimizer and sampling ranges."""
    a = config.actor
    _positive("actor.clip_ratio", a.clip_ratio)
    for key, value in (("actor.clip_ratio_low", a.clip_ratio_low), ("actor.clip_ratio_high", a.clip_ratio_high)):
        if value is not None:
            _positive(key, value)
    if not a.clip_ratio_c > 1:
        _fail("actor.clip_ratio_c", a.clip_ratio_c, "dual-clip constant must be > 1")
    _positive("actor.ppo_epochs", a.ppo_epochs)
    _positive("actor.grad_clip", a.grad_clip)
    for role, optim in (("actor", a.optim), ("critic", config.critic.optim)):
        _positive(f"{role}.optim.lr", optim.lr)
        if optim.warmup_steps < 0:
            _fail(f"{role}.optim.warmup_steps", optim.warmup_steps, "must be >= 0")
        if len(optim.betas) != 2 or not all(0 <= b < 1 for b in optim.betas):
            _fail(f"{role}.optim.betas", optim.betas, "must be two numbers in [0, 1)")
        if not 0 <= optim.lr_warmup_steps_ratio <= 1:
            _fail(f"{role}.optim.lr_warmup_steps_ratio", optim.lr_warmup_steps_ratio, "must be in [0, 1]")
        if not 0 <= optim.min_lr_ratio <= 1:
            _fail(f"{role}.optim.min_lr_ratio", optim.min_lr_ratio, "must be in [0, 1]")
    if a.rollout_correction.level is not None:
        _positive("actor.rollout_correction.threshold", a.rollout_correction.threshold)
        if a.rollout_correction.bypass_mode:
            _fail("actor.rollout_correction.bypass_mode", True,
                  "makes old_log_probs the rollout log-probs, so actor.rollout_correction.level has nothing to "
                  "correct; set one of them")
    r = config.rollout
    if not r.temperature > 0:
        _fail("rollout.temperature", r.temperature, "must be > 0 (use rollout.val.greedy for greedy decoding)")
    if not 0 < r.top_p <= 1:
        _fail("rollout.top_p", r.top_p, "must be in (0, 1]")
    _positive("rollout.val.n", r.val.n)
    _positive("rollout.val.temperature", r.val.temperature)
    mt = r.multi_turn
    if mt.max_assistant_turns is not None:
        _positive("rollout.multi_turn.max_assistant_turns", mt.max_assistant_turns)
    if mt.max_user_turns is not None:
        _positive("rollout.multi_turn.max_user_turns", mt.max_user_turns)
    _positive("rollout.multi_turn.max_parallel_calls", mt.max_parallel_calls)
    _positive("rollout.multi_turn.max_tool_response_length", mt.max_tool_response_length)
    if mt.format != "hermes":
        _fail("rollout.multi_turn.format", mt.format, "only 'hermes' (<tool_call>{json}</tool_call>) is supported")
    # the tools are built here once, so a bad entry fails before any worker (a missing file: validate_paths)
    if mt.tool_config_path is not None and os.path.isfile(mt.tool_config_path):
        from jaxrl_hf.agent import load_tool_config

        try:
            load_tool_config(mt.tool_config_path)
        except ValueError as err:
            _fail("rollout.multi_turn.tool_config_path", mt.tool_config_path, str(err))


def check_data_and_rewards(config: RunConfig) -> None:
    """Lengths, dataset names/paths, reward shaping."""
    d = config.data
    _positive("data.max_prompt_length", d.max_prompt_length)
    _positive("data.max_response_length", d.max_response_length)
    if not d.train_files:
        _fail("data.train_files", d.train_files, "needs at least one dataset ('arithmetic', 'calculator', 'gsm8k' or a file)")
    if d.train_size < d.train_batch_size and {"arithmetic", "calculator"} & set(d.train_files):
        _fail("data.train_size", d.train_size, f"fewer rows than one batch (data.train_batch_size={d.train_batch_size})")
    if d.val_size < 0:
        _fail("data.val_size", d.val_size, "must be >= 0 (0 = all rows)")
    for name, size in d.val_size_per_source.items():
        if not isinstance(size, int) or size < 0:
            _fail(f"data.val_size_per_source.{name}", size, "must be an int >= 0 (0 = all rows)")
    rm = config.reward_model
    ob = rm.overlong_buffer
    if ob.enable:
        if rm.reward_manager != "dapo":
            _fail("reward_model.overlong_buffer.enable", True, "needs reward_model.reward_manager='dapo'")
        if not 0 < ob.len <= d.max_response_length:
            _fail("reward_model.overlong_buffer.len", ob.len,
                  f"must be in (0, data.max_response_length={d.max_response_length}]")
    if rm.reward_manager == "prm" and not rm.prm.path:
        _fail("reward_model.prm.path", rm.prm.path, "reward_model.reward_manager='prm' needs a PRM directory "
              "(launch/train_prm.py --out)")
    agent = config.rollout.multi_turn.enable or config.rollout.loop == "multi_turn"
    if rm.reward_manager == "prm" and rm.prm.aggregation == "per_step" and agent:
        _fail("reward_model.prm.aggregation", rm.prm.aggregation, "places step scores on the policy's sampled tokens, "
              "but rollout.multi_turn.enable=true (the multi_turn loop) masks tool tokens out of the response; use "
              "'min' or 'last'")
    if rm.enable and not rm.path:
        _fail("reward_model.path", rm.path, "reward_model.enable needs a reward model directory or 'tiny-random'")
    if config.cost_model.enable and not config.cost_model.path:
        _fail("cost_model.path", config.cost_model.path, "cost_model.enable needs a cost model directory or 'tiny-random'")
    if rm.scorer != "auto" and config.custom_reward_function.path is not None:
        _fail("reward_model.scorer", rm.scorer, "custom_reward_function.path is set too: pick one scorer")
    if rm.scorer == "math_verify" and importlib.util.find_spec("math_verify") is None:
        _fail("reward_model.scorer", rm.scorer, "needs the math-verify package: pip install 'jaxrl_hf[math]'")


def check_trainer(config: RunConfig) -> None:
    """Loop, checkpoint and logging settings."""
    t = config.trainer
    if t.total_steps is not None:
        _positive("trainer.total_steps", t.total_steps)
    if t.total_epochs is not None:
        _positive("trainer.total_epochs", t.total_epochs)
    if t.resume_mode == "resume_path" and not t.resume_from_path:
        _fail("trainer.resume_from_path", t.resume_from_path, "trainer.resume_mode='resume_path' needs a checkpoint path")
    if t.max_ckpt_to_keep is not None and t.max_ckpt_to_keep < 1:
        _fail("trainer.max_ckpt_to_keep", t.max_ckpt_to_keep, "must be >= 1 or null (keep all)")
    if t.critic_warmup < 0:
        _fail("trainer.critic_warmup", t.critic_warmup, "must be >= 0")
    if t.log_val_generations < 0:
        _fail("trainer.log_val_generations", t.log_val_generations, "must be >= 0")
    try:  # checked now, not when the export runs after the last step
        parse_shard_size(t.export_hf_max_shard_size, "trainer.export_hf_max_shard_size")
    except ValueError as err:
        raise ConfigError(str(err)) from None
    check_async_rollout(config)
    for name in t.logger:
        if name not in KNOWN_LOGGERS:
            _fail("trainer.logger", name, f"valid loggers: {list(KNOWN_LOGGERS)}")


def check_async_rollout(config: RunConfig) -> None:
    """``trainer.max_staleness`` and the split rollout group (``placement.rollout``)."""
    staleness, split = config.trainer.max_staleness, not config.placement.rollout.colocate
    if staleness < 0:
        _fail("trainer.max_staleness", staleness, "must be >= 0 (0: synchronous)")
    if not split:
        return
    if config.placement.generate.pp is not None or config.placement.generate.tp is not None:
        _fail("placement.generate", config.placement.generate,
              "a separate rollout group (placement.rollout.colocate=false) generates on its own mesh; the hybrid "
              "engine's generation layout applies only to a colocated rollout")
    if config.model.lora_rank:
        _fail("model.lora_rank", config.model.lora_rank, "a separate rollout group (placement.rollout.colocate=false "
              "or trainer.max_staleness > 0) is handed full weights, not LoRA adapters, yet: use a colocated rollout")


def check_lora(config: RunConfig) -> None:
    """``model.lora_rank`` >= 0; with LoRA on, ``lora_alpha`` > 0 and ``target_modules`` names known modules."""
    m = config.model
    if m.lora_rank < 0:
        _fail("model.lora_rank", m.lora_rank, "must be >= 0 (0 = LoRA off)")
    if m.lora_rank:
        _positive("model.lora_alpha", m.lora_alpha)
        from jaxrl_hf.models.lora import resolve_target_modules
        try:
            resolve_target_modules(m.target_modules)
        except ValueError as e:
            _fail("model.target_modules", m.target_modules, str(e))


def check_parallel_heads(config: RunConfig) -> None:
    """Tensor parallelism splits the attention heads and the key/value heads over ``placement.train.tp`` devices
    (and over ``placement.generate.tp``, which divides it): both head counts must be divisible, or the model cannot
    be laid out. Checked where the model's shape can be read without loading it (`validate_paths.model_heads`)."""
    from jaxrl_hf.config.validate_paths import model_heads

    for key, tp in (("placement.train.tp", config.placement.train.tp),
                    ("placement.generate.tp", rollout_tensor_parallel(config))):
        shape = model_heads(config.model) if tp > 1 else None
        if shape is None:
            continue
        heads, kv_heads, where = shape
        if heads % tp or kv_heads % tp:
            valid = [k for k in range(1, heads + 1) if heads % k == 0 and kv_heads % k == 0]
            _fail(key, tp, f"tensor parallelism splits the model's {heads} attention heads and "
                  f"{kv_heads} key/value heads ({where}) over tp devices: both must be divisible; valid: {valid}")


def validate_config(config: RunConfig, check_paths: bool = True, check_model: bool = True) -> None:
    """All checks; raises ``ConfigError`` on the first problem. ``check_paths=False`` (a dry run) skips the checks
    that files and directories exist (`jaxrl_hf.config.validate_paths`); ``check_model=False`` those against the
    shape of ``model.path`` (a memory plan, whose model is given apart)."""
    check_registered_names(config)
    check_placement(config)
    if check_model:
        check_parallel_heads(config)
    check_sequence_parallel(config)
    check_batch_arithmetic(config)
    check_micro_batching(config)
    check_algorithm(config)
    check_actor(config)
    check_data_and_rewards(config)
    check_trainer(config)
    check_lora(config)
    if check_paths:
        check_existing_paths(config)
    check_memory_budget(config)  # vLLM's + JAX's share of each GPU (with the environment's XLA_PYTHON_CLIENT_*)
