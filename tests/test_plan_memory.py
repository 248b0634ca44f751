"""launch/plan_memory.py: ahead-of-time compiled memory plans of the actor's programs.

The named 7B/32B/70B plans take tens of seconds each to compile on XLA:CPU, so here the programs are compiled for
a small HF-shaped config (same code path, per-layer memory scales with the layer count: layers are scanned); the
full plans are documented commands (docs/BENCHMARKS.md). Byte counts are checked against closed forms computed
from the config alone.
"""
from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import jax
import numpy as np
import pytest

from jaxrl_hf.memory_plan import classify_keys, load_plan_config, parse_bytes, plan_memory
from jaxrl_hf.memory_plan import programs as P
from jaxrl_hf.memory_plan.plan import decode_batch, plan_devices
from jaxrl_hf.memory_plan.report import memory_stats
from jaxrl_hf.models.known_configs import KNOWN_HF_CONFIGS, PUBLISHED_PARAM_COUNTS, known_decoder_config

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "configs" / "verl_recipes" / "dapo_qwen2.5_32b.args"
SMALL = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_act": "silu", "vocab_size": 1024,
         "hidden_size": 128, "intermediate_size": 384, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 2, "max_position_embeddings": 4096, "rms_norm_eps": 1e-6, "rope_theta": 1e6,
         "tie_word_embeddings": False, "use_sliding_window": False}
# q/k/v biases (Qwen2): no embed axis, so ZeRO-3 leaves them whole; the cost model has no term for them
BIASES = SMALL["num_hidden_layers"] * (SMALL["num_attention_heads"] + 2 * SMALL["num_key_value_heads"]) * 32
BATCH = ["data.max_prompt_length=64", "data.max_response_length=64", "data.train_batch_size=8",
         "data.gen_batch_size=8", "actor_rollout_ref.rollout.n=2", "actor_rollout_ref.actor.ppo_mini_batch_size=8",
         "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1",
         "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=1",
         # rows, not the recipe's token budgets
         "actor_rollout_ref.actor.use_dynamic_bsz=False"]
COLLECTIVES = {"all-gather", "reduce-scatter", "all-reduce", "all-to-all", "collective-permute"}

needs8 = pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 devices (XLA_FLAGS host device count)")


def cli_main(argv: list[str]) -> int:
    """``launch/plan_memory.py``'s ``main``, loaded from its file (launch/ is not a package)."""
    spec = importlib.util.spec_from_file_location("plan_memory_cli", ROOT / "launch" / "plan_memory.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.main(argv)


def read_recipe() -> list[str]:
    spec = importlib.util.spec_from_file_location("plan_memory_cli", ROOT / "launch" / "plan_memory.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.read_args_file(str(RECIPE))


@pytest.fixture(scope="module")
def small_model(tmp_path_factory):
    path = tmp_path_factory.mktemp("small") / "config.json"
    path.write_text(json.dumps(SMALL))
    return str(path)


@pytest.fixture(scope="module")
def fsdp_plan(small_model):
    return plan_memory(small_model, 8, ["actor_rollout_ref.actor.strategy=fsdp", *BATCH])


@pytest.fixture(scope="module")
def megatron_cli(small_model, tmp_path_factory):
    """The megatron plan through the CLI, with a device memory too small for it: ``(exit code, report)``."""
    out = tmp_path_factory.mktemp("cli") / "plan.json"
    code = cli_main(["--model", small_model, "--devices", "8", "--device-memory", "1MiB", "--json", str(out),
                     "actor_rollout_ref.actor.strategy=megatron", *BATCH])
    return code, json.loads(out.read_text())


@pytest.fixture(scope="module")
def megatron_plan(megatron_cli):
    return megatron_cli[1]


def test_known_configs_match_the_published_parameter_counts(small_model):
    assert set(KNOWN_HF_CONFIGS) == {"qwen2.5-7b", "qwen2.5-32b", "llama3.1-8b", "llama3.1-70b", "qwen3-8b",
                                     "gemma2-9b", "qwen3-30b-a3b"}
    for name, count in PUBLISHED_PARAM_COUNTS.items():
        assert known_decoder_config(name).num_params() == count, name
    moe = known_decoder_config("qwen3-30b-a3b")  # the model card: "30.5B in total and 3.3B activated"
    assert moe.num_params() // 10**8 == 305 and moe.num_params(active=True) // 10**8 == 33
    assert known_decoder_config("Qwen2.5-7B", dtype="bfloat16").dtype == "bfloat16"
    assert known_decoder_config(small_model).hidden_size == 128
    with pytest.raises(ValueError, match="qwen2.5-7b"):
        known_decoder_config("qwen9-1t")


@needs8
def test_plan_schema_and_fsdp_shards_state_over_all_devices(fsdp_plan):
    n = known_decoder_config(fsdp_plan["model"]).num_params()
    assert {"model", "num_params", "devices", "device_memory_bytes", "programs", "fits"} <= set(fsdp_plan)
    assert fsdp_plan["num_params"] == n and fsdp_plan["devices"] == 8
    assert fsdp_plan["device_memory_bytes"] == 80 * 2 ** 30 and fsdp_plan["fits"] is True
    assert fsdp_plan["usable_bytes_per_device"] == int(0.95 * 80 * 2 ** 30)  # JAX's share: 1 − memory margin
    assert set(fsdp_plan["programs"]) == {"update_actor", "log_prob", "generate"}
    for name, p in fsdp_plan["programs"].items():
        peak = p["argument_bytes"] + p["output_bytes"] - p["alias_bytes"] + p["temp_bytes"]
        assert p["peak_bytes_per_device"] == peak
        assert p["total_bytes_per_device"] == p["peak_bytes_per_device"] + p["resident_bytes_per_device"]
        assert set(p["collectives"]) == COLLECTIVES
        assert p["cost_model"]["predicted_bytes_per_device"] > 0, name
    update = fsdp_plan["programs"]["update_actor"]
    # float32 params, 1/8 per device on their embed dim; the q/k/v biases have none and stay whole
    assert update["param_bytes_per_device"] == ((n - BIASES) // 8 + BIASES) * 4
    assert 0 <= update["optimizer_bytes_per_device"] - 2 * update["param_bytes_per_device"] <= 16  # + step counters
    # XLA's numbers are per device: the donated train state is an argument and aliased to the output
    assert update["argument_bytes"] >= 3 * n * 4 // 8 and update["alias_bytes"] >= 3 * n * 4 // 8
    assert update["argument_bytes"] < 3 * n * 4 // 4
    c = update["collectives"]
    assert c["all-gather"] > 0 and c["reduce-scatter"] + c["all-reduce"] > 0  # ZeRO-3: gather params, reduce grads
    assert update["float_collectives"]["all-gather"] > 0
    # the Adam moments stay on the device outside update_actor (no optimizer offload)
    assert fsdp_plan["programs"]["log_prob"]["resident_bytes_per_device"] == update["optimizer_bytes_per_device"]
    assert fsdp_plan["layout"]["rule_set"] == "fsdp" and fsdp_plan["layout"]["dtype"] == "bfloat16"


@needs8
def test_megatron_dp8_replicates_params_and_gathers_none(megatron_plan, fsdp_plan):
    n = megatron_plan["num_params"]
    update = megatron_plan["programs"]["update_actor"]
    assert update["param_bytes_per_device"] == n * 4
    assert 0 <= update["optimizer_bytes_per_device"] - 2 * n * 4 <= 16
    assert update["float_collectives"]["all-gather"] == 0  # params whole on every device: none gathered
    assert update["collectives"]["all-reduce"] > 0   # data-parallel gradient reduction
    # the cost model keeps weights whole over d: its weight term is the compiled params under megatron, less the
    # q/k/v biases its architecture has no term for
    log_prob = megatron_plan["programs"]["log_prob"]
    gap = log_prob["param_bytes_per_device"] - log_prob["cost_model"]["terms"]["weight_bytes"]
    assert gap == BIASES * 4
    assert update["peak_bytes_per_device"] > fsdp_plan["programs"]["update_actor"]["peak_bytes_per_device"]


@needs8
def test_generate_holds_the_kv_cache_of_the_decode_batch(fsdp_plan):
    gen = fsdp_plan["programs"]["generate"]
    shapes = gen["shapes"]
    assert shapes["replicas"] == 8 and shapes["decode_batch_per_replica"] == 2  # 8 prompts · n=2 over 8 replicas
    assert shapes["cache_len"] == 128
    # k and v: layers · batch/replicas · slots · kv_heads · head_dim · 2 bytes (bf16), batch sharded over 8
    kv = 2 * SMALL["num_hidden_layers"] * 2 * 128 * SMALL["num_key_value_heads"] * 32 * 2
    assert shapes["kv_cache_bytes_per_device"] == kv
    assert gen["alias_bytes"] >= kv  # the cache is donated, as the engine's loop carry is updated in place
    # fsdp generates from params gathered over dp (d_g=1 layout): every device holds all of them, float32
    assert gen["param_bytes_per_device"] == fsdp_plan["num_params"] * 4


@needs8
def test_decode_batch_is_the_largest_that_fits(small_model):
    config, _ = load_plan_config([*BATCH, "actor_rollout_ref.rollout.n=8"], 8)  # 8 rows per generation replica
    model = known_decoder_config(small_model, dtype=config.model.dtype, remat=config.model.remat)
    layout = P.ActorLayout.build(config, model, plan_devices(8))
    setup = P.generation_setup(layout)
    programs: dict[int, P.CompiledProgram] = {}

    def compile_at(b: int) -> P.CompiledProgram:
        if b not in programs:
            programs[b] = P.generate_program(layout, setup, b)
        return programs[b]

    def peak(b: int) -> int:
        return memory_stats(compile_at(b).compiled)["peak_bytes_per_device"]

    resident = 1000
    budget = resident + (peak(1) + peak(8)) / 2
    program, why = decode_batch(config, setup.replicas, budget, resident, compile_at)
    b = program.shapes["decode_batch_per_replica"]
    assert 1 < b < 8 and why.startswith("memory")
    assert peak(b) + resident <= budget < peak(b + 1) + resident  # the largest batch whose compiled step fits
    whole, why = decode_batch(config, setup.replicas, 10 * budget, resident, compile_at)
    assert whole.shapes["decode_batch_per_replica"] == 8 and why.startswith("all rollout rows")


@needs8
def test_tiny_device_memory_does_not_fit(megatron_cli):
    code, report = megatron_cli
    assert code == 1 and report["fits"] is False and report["device_memory_bytes"] == 2 ** 20
    assert any(p["total_bytes_per_device"] > 2 ** 20 for p in report["programs"].values())


def test_bad_key_names_the_key(small_model, capsys):
    with pytest.raises(ValueError, match="actor_rollout_ref.actor.ppo_mini_batch_sze.*ppo_mini_batch_size"):
        classify_keys(["actor_rollout_ref.actor.ppo_mini_batch_sze=32"])
    with pytest.raises(ValueError, match="trainer.nnodes"):
        classify_keys(["trainer.nnode=2"])
    typo = "actor_rollout_ref.actor.fsdp_config.optimizer_ofload=1"
    assert cli_main(["--model", small_model, "--devices", "8", typo]) == 2
    assert "optimizer_ofload" in capsys.readouterr().err
    with pytest.raises(ValueError, match="trainer.nnodes × trainer.n_gpus_per_node = 2 × 8 = 16"):
        load_plan_config(["trainer.nnodes=2", "trainer.n_gpus_per_node=8"], devices=8)
    with pytest.raises(ValueError, match="80GiB"):
        parse_bytes("eighty")
    assert parse_bytes("80GiB") == 80 * 2 ** 30 and parse_bytes("1.5GB") == 1_500_000_000


def test_a_plan_reads_the_recipe_not_the_laptop_sizing():
    """The planned model is --model: no model.path in the keys must not pull in configs/laptop/<algo>.yaml (the
    embedded default model's 64 + 32 tokens), so the recipe's lengths are planned unless the keys say otherwise."""
    config, _ = load_plan_config([], devices=8)
    assert (config.data.max_prompt_length, config.data.max_response_length) == (2048, 20480)
    config, _ = load_plan_config(["data.max_response_length=8192"], devices=8)
    assert config.data.max_response_length == 8192


def test_verl_dapo_32b_recipe_line_parses():
    args = read_recipe()
    assert len(args) == 69 and "actor_rollout_ref.rollout.tensor_model_parallel_size=4" in args
    assert "data.truncation=left" in args and "trainer.logger=[console,wandb]" in args  # unquoted as by a shell
    config, keys = load_plan_config(args, devices=128)
    train, gen = config.placement.train, config.placement.generate
    # 16 nodes x 8 GPUs; rollout TP 4 -> generation tp, the training tp raised to it (fsdp -> fsdp_tp) and the
    # Ulysses size divided by as much: each sequence still spans tp·sp = 8 devices (40 heads split over them)
    assert (train.pp, train.tp, train.dp, gen.tp) == (1, 4, 32, 4)
    assert config.actor.ulysses_sequence_parallel_size == config.ref.ulysses_sequence_parallel_size == 2
    assert dict(keys.mapped)["actor.ulysses_sequence_parallel_size"].startswith("2 (was 8")
    assert config.actor.strategy == "fsdp"  # the recipe sets none: verl's default, the plan's too
    assert config.actor.offload_optimizer is True and keys.offload_params and keys.offload_ref_params
    assert config.model.remat == "full" and config.model.dtype == "bfloat16"
    assert config.actor.optim.total_steps is not None  # trainer.total_epochs=1: the plan reads no data
    assert (config.rollout.n, config.data.gen_batch_size, config.actor.ppo_mini_batch_size) == (16, 1536, 32)
    assert (config.rollout.max_prompt_length, config.rollout.response_length) == (2048, 20480)
    assert math.isclose(config.rollout.gpu_memory_utilization, 0.8)
    ignored = dict(keys.ignored)
    assert "trainer.logger" in ignored and "actor_rollout_ref.rollout.val_kwargs.top_k" in ignored
    every = keys.applied + keys.mapped + keys.ignored + keys.not_modelled
    # packing with Ulysses sp is refused by the loader: planned as padded rows of the same token budget
    assert config.model.use_remove_padding is False and config.actor.use_dynamic_bsz is True
    assert config.actor.ppo_max_token_len_per_gpu == 22528 and "model.use_remove_padding" in dict(keys.mapped)
    added = {"placement.train.tp", "actor.ulysses_sequence_parallel_size", "ref.ulysses_sequence_parallel_size",
             "model.use_remove_padding"}
    assert sum(1 for k, _ in every if k not in added) == len(args)  # every key as written accounted for once


@needs8
def test_ulysses_sp_plans_sequence_sharded_programs(small_model):
    keys = [*BATCH, "data.max_prompt_length=63", "actor_rollout_ref.actor.ulysses_sequence_parallel_size=2",
            "actor_rollout_ref.model.use_remove_padding=False"]  # configs/dapo.yaml packs; sp does not
    report = plan_memory(small_model, 8, keys)
    update = report["programs"]["update_actor"]
    assert report["layout"]["train"].endswith("(sp2)") and report["layout"]["rule_set"].endswith("_sp")
    # rows over dp/sp = 4 groups; the 63 + 64 token columns left-padded to a multiple of sp
    assert update["shapes"]["micro_rows"] == 4 and update["shapes"]["seq_len"] == 128
    assert update["float_collectives"]["all-to-all"] > 0  # Ulysses: heads <-> sequence around attention
    assert report["programs"]["log_prob"]["shapes"]["rows"] == 4


@needs8
def test_packed_token_budget_micro_batches(small_model):
    keys = [*BATCH, "actor_rollout_ref.model.use_remove_padding=True", "actor_rollout_ref.actor.use_dynamic_bsz=True",
            "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=256"]
    report = plan_memory(small_model, 8, keys)
    update, log_prob = report["programs"]["update_actor"]["shapes"], report["programs"]["log_prob"]["shapes"]
    # 128-token rows: 2 per device in a 256-token packed sequence; 16 rows of a mini-batch / (8 devices · 2) = 1
    assert (update["rows_per_device"], update["packed_length"], update["num_micro"]) == (2, 256, 1)
    assert {"pack_input_ids", "pack_segment_ids", "pack_position_ids", "pack_rows"} <= set(update["columns"])
    assert "input_ids" not in update["columns"] and update["by_tokens"] is True
    # the log-prob pass inherits the budget (rollout.log_prob_* default to the actor's) and is packed too
    assert log_prob["packed_length"] == 256 and "pack_rows" in log_prob["columns"]
    assert not report["keys"]["not_modelled"]


def test_verl_dapo_32b_recipe_with_vllm_keeps_its_own_layout():
    """With vLLM (verl's default rollout) the recipe's layout is planned as written: FSDP over all 128 devices with
    Ulysses 8, vLLM TP 4 fed shard-wise (no training tp raised to the rollout's)."""
    config, keys = load_plan_config([*read_recipe(), "actor_rollout_ref.rollout.name=vllm"], devices=128)
    train = config.placement.train
    assert (train.pp, train.tp, train.dp, config.placement.generate.tp) == (1, 1, 128, 4)
    assert config.actor.ulysses_sequence_parallel_size == config.ref.ulysses_sequence_parallel_size == 8
    assert "placement.train.tp" not in dict(keys.mapped)


@needs8
@pytest.mark.parametrize("allocator", ["bfc", "platform"])
def test_vllm_plan_counts_the_sync_vllm_and_both_phases(small_model, allocator):
    from jaxrl_hf.memory_plan.vllm_rollout import CONTEXT_ALLOWANCE_BYTES
    from jaxrl_hf.rollout.vllm_tp import tp_shard_shapes

    keys = ["actor_rollout_ref.rollout.name=vllm", "actor_rollout_ref.rollout.tensor_model_parallel_size=2",
            "actor_rollout_ref.actor.strategy=fsdp", f"placement.memory.allocator={allocator}", *BATCH]
    report = plan_memory(small_model, 8, keys)
    assert set(report["programs"]) == {"update_actor", "log_prob", "weight_sync"}
    sync = report["programs"]["weight_sync"]
    assert sync["shapes"]["tp"] == 2 and sync["shapes"]["replicas"] == 4 and sync["shapes"]["dtype"] == "bfloat16"
    decoder = known_decoder_config(small_model, dtype="bfloat16")
    vllm = report["vllm"]
    assert vllm["weight_bytes_per_device"] == 2 * sum(int(np.prod(s)) for s in tp_shard_shapes(decoder, 2).values())
    assert vllm["share_bytes_per_device"] == int(0.5 * 80 * 2 ** 30)  # vLLM's default gpu_memory_utilization
    assert vllm["kv_cache_bytes_per_device"] == (vllm["share_bytes_per_device"] - vllm["weight_bytes_per_device"]
                                                 - vllm["activation_allowance_bytes"])
    phases = report["phases"]
    kept = report["programs"]["update_actor"]["param_bytes_per_device"] + \
        report["programs"]["update_actor"]["optimizer_bytes_per_device"]
    train_peak = max(report["programs"][p]["total_bytes_per_device"] for p in ("update_actor", "log_prob"))
    assert phases["train"]["jax_bytes"] == train_peak and phases["train"]["vllm_bytes"] == 0
    assert phases["sync"]["vllm_bytes"] == vllm["weight_bytes_per_device"]
    # BFC keeps JAX's high-water mark through generation; the platform allocator hands freed buffers back
    expected = kept if allocator == "platform" else max(train_peak, sync["total_bytes_per_device"])
    assert phases["generate"]["jax_bytes"] == expected
    for row in phases.values():
        assert row["total_bytes"] == row["jax_bytes"] + row["vllm_bytes"] + CONTEXT_ALLOWANCE_BYTES
    assert report["fits"] and report["time_sharing"]["time_shared"] == (allocator == "platform")
