"""HF export of saved actor checkpoints (launch/export_hf.py, jaxrl_hf/trainer/hf_export.py): a real actor worker's
checkpoint, written through the trainer's CheckpointManager, exported offline (sharded bf16 safetensors) loads in
transformers and greedy-decodes exactly as our model on the same (bf16-rounded) weights; vLLM loads it too. (Qwen3,
Gemma 2 and Gemma 3 text exports, written by the same `write_hf_model_dir`, are checked in transformers and vLLM by
tests/test_rollout_vllm_families.py, next to their vLLM engine.)"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys

import jax
import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import load_file

from _models_helpers import jit_forward, random_params, tiny_config, tiny_worker_config, write_tiny_hf_dir
from jaxrl_hf.controller.worker import WorkerContext
from jaxrl_hf.models.hf_export import parse_shard_size, plan_shards
from jaxrl_hf.models.weights_hf import params_to_hf_state_dict
from jaxrl_hf.trainer.checkpointing import CheckpointManager
from jaxrl_hf.trainer.hf_export import ExportError, export_checkpoint, main, resolve_actor_checkpoint
from jaxrl_hf.workers import ActorRolloutRefWorker

pytestmark = pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 devices: set "
                                "XLA_FLAGS=--xla_force_host_platform_device_count=8 before jax starts")
# head_dim 32: vLLM's CPU attention supports it (tests/test_rollout_vllm.py)
MODEL = tiny_config(vocab_size=96, hidden_size=64, head_dim=32, eos_token_ids=(2,), max_position_embeddings=128)
BOS, EOS, PAD = 1, 2, 0
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def host(tree):
    return jax.tree.map(lambda x: np.asarray(jax.device_get(x)), tree)


def _source_model_dir(path):
    """A tiny HF model directory with a real (word-level) tokenizer and a generation config of its own."""
    write_tiny_hf_dir(path, MODEL, seed=4)
    with open(os.path.join(path, "generation_config.json"), "w") as fh:
        json.dump({"temperature": 0.7, "eos_token_id": EOS}, fh)
    return str(path)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A run directory with two actor checkpoints (steps 1 and 3; the weights differ) and the step-3 params."""
    root = tmp_path_factory.mktemp("export")
    src = _source_model_dir(root / "src")
    config = tiny_worker_config(lr=1e-3, n=1, response_length=4, seed=0, model={"path": src},
                                placement={"num_processes": 1, "devices_per_process": 8,
                                           "train": {"pp": 1, "tp": 1, "dp": 8}})
    worker = ActorRolloutRefWorker._instantiate(WorkerContext("actor", "local", 0, 1),
                                                (copy.deepcopy(config), "actor_rollout_ref"), {})
    worker.init_model()
    manager = CheckpointManager(str(root / "run" / "checkpoints"), max_to_keep=3)
    manager.save(1, {"actor": worker.save_checkpoint}, {"global_step": 1})
    step1 = host(worker.state.params)
    worker.state = worker.state._replace(params=jax.tree.map(lambda x: x * 1.05 + 0.01, worker.state.params))
    manager.save(3, {"actor": worker.save_checkpoint}, {"global_step": 3})
    return {"root": root, "run": str(root / "run"), "worker": worker, "step1": step1,
            "step3": host(worker.state.params), "src": src}


def _read_dir(path):
    """All tensors of an exported directory (single file or shards listed in the index)."""
    index = os.path.join(path, "model.safetensors.index.json")
    files = sorted(set(json.load(open(index))["weight_map"].values())) if os.path.isfile(index) else \
        ["model.safetensors"]
    out = {}
    for name in files:
        out.update(load_file(os.path.join(path, name)))
    return out


def _greedy_ours(params, prompt, steps, width=32):
    """Greedy continuation of ``prompt`` by our forward pass (stops after EOS); the sequence is right-padded to
    ``width`` (causal attention: the padding never reaches the last real position), so one program is compiled."""
    ids = list(prompt)
    for _ in range(steps):
        arr, mask = np.full((1, width), PAD, np.int32), np.zeros((1, width), np.int32)
        arr[0, :len(ids)], mask[0, :len(ids)] = ids, 1
        logits = np.asarray(jit_forward(params, MODEL, arr, mask))
        ids.append(int(logits[0, len(ids) - 1].argmax()))
        if ids[-1] == EOS:
            break
    return ids[len(prompt):]


def test_shard_sizes_follow_transformers_units_and_rule():
    assert parse_shard_size("5GB") == 5 * 10**9 and parse_shard_size("2GiB") == 2 * 2**30
    assert parse_shard_size("500kb") == 500_000 and parse_shard_size(1234) == 1234
    with pytest.raises(ValueError, match="max_shard_size='5 gigs'"):
        parse_shard_size("5 gigs")
    # a tensor bigger than the limit gets a shard of its own; otherwise shards fill in order up to the limit
    assert plan_shards([("a", 4), ("b", 4), ("c", 9), ("d", 2), ("e", 3)], 8) == [["a", "b"], ["c"], ["d", "e"]]


def test_run_dir_exports_newest_checkpoint_sharded_bf16_and_transformers_matches(run, tmp_path):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    out = str(tmp_path / "hf")
    assert main([run["run"], out, "--max-shard-size", "40KB"]) == 0
    index = json.load(open(os.path.join(out, "model.safetensors.index.json")))
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) >= 3 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    assert sorted(n for n in os.listdir(out) if n.endswith(".safetensors")) == shards
    assert all(os.path.getsize(os.path.join(out, s)) < 40_000 + 4096 for s in shards)  # + the safetensors header
    umask = os.umask(0)
    os.umask(umask)
    assert {os.stat(os.path.join(out, s)).st_mode & 0o777 for s in shards} == {0o666 & ~umask}
    # the step-3 weights, rounded to bf16 (round-to-nearest-even), every tensor present exactly once
    want = {k: v.astype(ml_dtypes.bfloat16) for k, v in params_to_hf_state_dict(run["step3"], MODEL).items()}
    got = _read_dir(out)
    assert sorted(got) == sorted(want) == sorted(index["weight_map"])
    for name, value in want.items():
        assert got[name].dtype == ml_dtypes.bfloat16
        np.testing.assert_array_equal(got[name].view(np.uint16), value.view(np.uint16), err_msg=name)
    assert index["metadata"]["total_size"] == sum(v.nbytes for v in want.values())
    config = json.load(open(os.path.join(out, "config.json")))
    assert config["torch_dtype"] == config["dtype"] == "bfloat16"
    gen = json.load(open(os.path.join(out, "generation_config.json")))
    assert (gen["bos_token_id"], gen["eos_token_id"], gen["pad_token_id"], gen["temperature"]) == (BOS, EOS, PAD, 0.7)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert open(os.path.join(out, name)).read() == open(os.path.join(run["src"], name)).read()

    tok = transformers.AutoTokenizer.from_pretrained(out)
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (BOS, EOS, PAD)
    model = transformers.AutoModelForCausalLM.from_pretrained(out)
    assert model.dtype == torch.bfloat16  # the saved dtype is the default load dtype
    model = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    ours = jax.tree.map(lambda x: x.astype(ml_dtypes.bfloat16).astype(np.float32), run["step3"])
    rng = np.random.default_rng(0)
    for length in (3, 6, 9):
        prompt = [BOS] + rng.integers(3, MODEL.vocab_size, length).tolist()
        with torch.no_grad():
            seq = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=10, pad_token_id=PAD)
        theirs = seq[0, len(prompt):].tolist()
        expected = _greedy_ours(ours, prompt, 10)
        assert theirs[:len(expected)] == expected, (prompt, theirs, expected)
        with torch.no_grad():
            hf_logits = model(torch.tensor([prompt])).logits[0].numpy()
        arr, mask = np.full((1, 32), PAD, np.int32), np.zeros((1, 32), np.int32)
        arr[0, :len(prompt)], mask[0, :len(prompt)] = prompt, 1
        np.testing.assert_allclose(np.asarray(jit_forward(ours, MODEL, arr, mask))[0, :len(prompt)], hf_logits,
                                   atol=1e-4, rtol=1e-4)


def test_step_dir_float32_single_file_and_end_of_run_export_agree(run, tmp_path):
    step1 = os.path.join(run["run"], "checkpoints", "global_step_1")
    out = export_checkpoint(step1, str(tmp_path / "f32"), dtype="float32")
    assert "model.safetensors" in os.listdir(out) and "model.safetensors.index.json" not in os.listdir(out)
    got = _read_dir(out)
    for name, value in params_to_hf_state_dict(run["step1"], MODEL).items():
        np.testing.assert_array_equal(got[name], value, err_msg=name)  # float32: bit-exact
    # trainer.export_hf (the worker's export at the end of a run) writes the same directory as the CLI
    end_of_run = run["worker"].export_hf(str(tmp_path / "hf_actor"))
    cli = export_checkpoint(run["run"], str(tmp_path / "cli"))
    assert sorted(os.listdir(end_of_run)) == sorted(os.listdir(cli))
    for name in os.listdir(cli):
        assert open(os.path.join(cli, name), "rb").read() == open(os.path.join(end_of_run, name), "rb").read(), name


def test_not_a_checkpoint_names_the_path(run, tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    with pytest.raises(ExportError, match=f"{tmp_path / 'empty'} is not a checkpoint"):
        resolve_actor_checkpoint(str(tmp_path / "empty"))
    assert main([str(tmp_path / "missing"), str(tmp_path / "out")]) == 5
    assert f"{tmp_path / 'missing'}: no such checkpoint directory" in capsys.readouterr().err
    # a damaged checkpoint (a file altered after its completion marker) is refused, naming the file
    damaged = tmp_path / "damaged"
    import shutil
    shutil.copytree(os.path.join(run["run"], "checkpoints", "global_step_1"), damaged)
    with open(damaged / "trainer_state.json", "a") as fh:
        fh.write(" ")
    with pytest.raises(ExportError, match="trainer_state.json has"):
        resolve_actor_checkpoint(str(damaged))
    # a critic's checkpoint (a value model) is not exported as a causal LM
    critic = tmp_path / "critic"
    shutil.copytree(os.path.join(run["run"], "checkpoints", "global_step_1", "actor"), critic)
    meta = json.load(open(critic / "worker.json"))
    json.dump(dict(meta, role="critic"), open(critic / "worker.json", "w"))
    with pytest.raises(ExportError, match="role 'critic' is not an actor checkpoint"):
        export_checkpoint(str(critic), str(tmp_path / "out"))
    assert not os.path.exists(tmp_path / "out")


@pytest.mark.slow
def test_vllm_loads_the_export_and_decodes_greedily_like_our_model(run, tmp_path):
    """vLLM (CPU build) in a fresh process reads the bf16 sharded export (upcast to float32) and its greedy tokens
    equal our model's on the same rounded weights."""
    pytest.importorskip("vllm")
    out = export_checkpoint(run["run"], str(tmp_path / "hf"), max_shard_size="40KB")
    prompts = [[BOS, 5, 9, 14], [BOS] + list(range(20, 27))]
    code = (
        "import json, os, sys\n"
        "os.environ.setdefault('VLLM_ENABLE_V1_MULTIPROCESSING', '0')\n"
        "os.environ.setdefault('VLLM_CPU_OMP_THREADS_BIND', 'nobind')\n"
        "import vllm\n"
        "llm = vllm.LLM(model=sys.argv[1], dtype='float32', skip_tokenizer_init=True, max_model_len=64,\n"
        "               max_num_seqs=4, enforce_eager=True, kv_cache_memory_bytes=1 << 26)\n"
        "sp = vllm.SamplingParams(temperature=0.0, max_tokens=10, detokenize=False)\n"
        "outs = llm.generate([{'prompt_token_ids': p} for p in json.loads(sys.argv[2])], sp)\n"
        "print('TOKENS=' + json.dumps([list(o.outputs[0].token_ids) for o in outs]))\n")
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    proc = subprocess.run([sys.executable, "-c", code, out, json.dumps(prompts)], capture_output=True, text=True,
                          timeout=600, env=env, cwd=str(tmp_path))
    assert proc.returncode == 0, proc.stderr[-3000:]
    tokens = json.loads(next(l for l in proc.stdout.splitlines() if l.startswith("TOKENS="))[len("TOKENS="):])
    ours = jax.tree.map(lambda x: x.astype(ml_dtypes.bfloat16).astype(np.float32), run["step3"])
    for prompt, got in zip(prompts, tokens):
        assert got == _greedy_ours(ours, prompt, 10), prompt
